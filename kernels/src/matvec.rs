//! Matrix-vector (decode) and small matrix-matrix (prefill) products of a
//! quantized weight matrix with activations, threaded over weight rows.
//!
//! Each output element is exactly its row's [`Kernels::dot`] (computed on one
//! thread by [`Kernels::dot_rows`], several rows at a time), so results do not
//! depend on the thread count or the tiling, and `matmul` gives exactly what
//! `matvec` gives for each of its tokens.

use pulsar_gguf::GgmlType;
use rayon::prelude::*;
use rayon::ThreadPool;

use crate::error::QuantError;
use crate::isa::Kernels;
use crate::quant::{check_dot, row_bytes, ActFormat, Activations};
#[cfg(target_arch = "x86_64")]
use crate::quant::{gemm32, gemm_k};

/// A repacking prefill GEMM chosen for one matmul, and its width: the
/// 512-bit kernels (AVX-512 VNNI, groups of 16 rows) or the 256-bit ones
/// (AVX2, groups of 8).
#[cfg(target_arch = "x86_64")]
struct Gemm {
    kind: GemmKind,
    wide: bool,
}

#[cfg(target_arch = "x86_64")]
enum GemmKind {
    B32(gemm32::Fmt, gemm32::ActSums),
    K(gemm_k::Fmt),
}

#[cfg(target_arch = "x86_64")]
impl Gemm {
    /// Rows per repacked group: tasks are whole groups.
    fn group(&self) -> usize {
        if self.wide {
            gemm32::GROUP
        } else {
            gemm32::avx2::GROUP
        }
    }
}

/// A `[rows x cols]` weight matrix of one GGUF type, rows laid end to end.
#[derive(Clone, Copy, Debug)]
pub struct WeightMatrix<'a> {
    ty: GgmlType,
    data: &'a [u8],
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl<'a> WeightMatrix<'a> {
    /// Checks that `data` is exactly `rows` rows of `cols` values of `ty` and
    /// that `ty` has a dot kernel.
    pub fn new(ty: GgmlType, data: &'a [u8], rows: usize, cols: usize) -> Result<Self, QuantError> {
        if ActFormat::for_weight(ty).is_none() {
            return Err(QuantError::Unsupported { ty, op: "matvec" });
        }
        let rb = row_bytes(ty, cols)?;
        let need = rb.checked_mul(rows).ok_or(QuantError::LengthMismatch {
            what: "weight matrix bytes",
            expected: usize::MAX,
            got: data.len(),
        })?;
        if data.len() != need {
            return Err(QuantError::LengthMismatch {
                what: "weight matrix bytes",
                expected: need,
                got: data.len(),
            });
        }
        Ok(WeightMatrix {
            ty,
            data,
            rows,
            cols,
            row_bytes: rb,
        })
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }
    /// The whole matrix.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
    /// Row `r` (panics past the end, like slice indexing).
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
}

/// Tokens from which a weight tile is repacked once for the chunk
/// (`quant::gemm32`, `quant::gemm_k`) instead of dotted row by row per token.
const GEMM_MIN_TOKENS: usize = 4;

/// Bytes of weight rows one task walks once per token (they stay in L2).
const ROW_TILE_BYTES: usize = 64 * 1024;
/// Below this many weight bytes, threads cost more than they save.
const SERIAL_BYTES: usize = 256 * 1024;

impl Kernels {
    /// The repacking GEMM that serves `w` for the tokens `x` at this ISA, if any.
    #[cfg(target_arch = "x86_64")]
    fn gemm_for(&self, w: &WeightMatrix<'_>, x: &Activations) -> Option<Gemm> {
        use crate::isa::Isa;
        let wide = match self.isa() {
            Isa::Avx512Vnni => true,
            Isa::Avx2 => false,
            Isa::Scalar => return None,
        };
        if x.rows() < GEMM_MIN_TOKENS {
            return None;
        }
        if let Some(fmt) = gemm_k::Fmt::of(w.ty()) {
            return Some(Gemm { kind: GemmKind::K(fmt), wide });
        }
        let fmt = gemm32::Fmt::of(w.ty())?;
        let nb = w.row_bytes() / fmt.block_bytes();
        let rows = (0..x.rows()).map(|t| x.row(t).expect("t < rows").bytes());
        Some(Gemm { kind: GemmKind::B32(fmt, gemm32::ActSums::new(rows, nb)), wide })
    }

    /// `y = W x` for one activation row (`x.rows() == 1`); `y` has `w.rows()` values.
    pub fn matvec(
        &self,
        pool: &ThreadPool,
        w: &WeightMatrix<'_>,
        x: &Activations,
        y: &mut [f32],
    ) -> Result<(), QuantError> {
        if x.rows() != 1 {
            return Err(QuantError::LengthMismatch {
                what: "activation rows for matvec",
                expected: 1,
                got: x.rows(),
            });
        }
        self.matmul(pool, w, x, y)
    }

    /// Quantizes `x` (one row of `w.cols()` values) to the format `w` dots
    /// against, then [`Kernels::matvec`]. Allocates; the host's hot path should
    /// keep an [`Activations`] and refill it with [`Activations::set`].
    pub fn matvec_f32(
        &self,
        pool: &ThreadPool,
        w: &WeightMatrix<'_>,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), QuantError> {
        let a = Activations::for_weight(w.ty(), x, w.cols())?;
        self.matvec(pool, w, &a, y)
    }

    /// `Y = X W^T` for `n = x.rows()` tokens: `y[t * w.rows() + r] = dot(row r, token t)`.
    /// Activations are quantized once (by the caller) and reused for every weight row;
    /// each task walks a tile of weight rows for every token in turn, so weights
    /// are read from memory once.
    pub fn matmul(
        &self,
        pool: &ThreadPool,
        w: &WeightMatrix<'_>,
        x: &Activations,
        y: &mut [f32],
    ) -> Result<(), QuantError> {
        let n = x.rows();
        if x.cols() != w.cols() {
            return Err(QuantError::LengthMismatch {
                what: "activation width",
                expected: w.cols(),
                got: x.cols(),
            });
        }
        if y.len() != n * w.rows() {
            return Err(QuantError::LengthMismatch {
                what: "output values",
                expected: n * w.rows(),
                got: y.len(),
            });
        }
        if n == 0 || w.rows() == 0 {
            return Ok(());
        }
        check_dot(w.ty(), w.row_bytes(), x.row(0).expect("n > 0"))?;
        let rows = w.rows();
        // Rows per task: enough tasks to balance the threads. Dotted row by
        // row for several tokens, few enough weight bytes per task to stay
        // cache resident while the tokens pass; one token reads each row once,
        // and a repacking GEMM keeps only one group of rows hot at a time, so
        // neither needs the cache bound (which made thousands of tiny tasks
        // of a 262144-row output head). A GEMM's tasks are whole groups.
        #[cfg(target_arch = "x86_64")]
        let gemm = self.gemm_for(w, x);
        #[cfg(target_arch = "x86_64")]
        let group = gemm.as_ref().map_or(Kernels::DOT_ROWS_GROUP, Gemm::group);
        #[cfg(not(target_arch = "x86_64"))]
        let group = Kernels::DOT_ROWS_GROUP;
        let threads = pool.current_num_threads().max(1);
        let by_balance = rows.div_ceil(4 * threads).max(1);
        let by_cache = if n == 1 || group > Kernels::DOT_ROWS_GROUP {
            usize::MAX
        } else {
            (ROW_TILE_BYTES / w.row_bytes().max(1)).max(1)
        };
        let chunk = by_cache.min(by_balance).next_multiple_of(group).min(rows);
        let run = |r0: usize, outs: &mut [&mut [f32]]| {
            let r1 = (r0 + chunk).min(rows);
            let tile = &w.data()[r0 * w.row_bytes()..r1 * w.row_bytes()];
            #[cfg(target_arch = "x86_64")]
            if let Some(gemm) = &gemm {
                let xs: Vec<&[u8]> = (0..n).map(|t| x.row(t).expect("t < n").bytes()).collect();
                let mut packed = Vec::new();
                let (rb, m) = (w.row_bytes(), r1 - r0);
                // SAFETY: `gemm_for` chose a wide GEMM only at Avx512Vnni and a
                // 256-bit one only at Avx2 or above (a Kernels at a level
                // exists only on a CPU with its features); the tile holds
                // r1 - r0 whole rows and every token row matches them, its
                // quants in -127..=127 as every quantized activation's.
                unsafe {
                    match (&gemm.kind, gemm.wide) {
                        (GemmKind::B32(fmt, sums), true) => {
                            gemm32::repack(*fmt, tile, m, rb, &mut packed);
                            gemm32::gemm(*fmt, &packed, rb / fmt.block_bytes(), &xs, sums, outs);
                        }
                        (GemmKind::B32(fmt, sums), false) => {
                            gemm32::avx2::repack(*fmt, tile, m, rb, &mut packed);
                            gemm32::avx2::gemm(*fmt, &packed, rb / fmt.block_bytes(), &xs, sums, outs);
                        }
                        (GemmKind::K(fmt), true) => {
                            gemm_k::repack(*fmt, tile, m, rb, &mut packed);
                            gemm_k::gemm(*fmt, &packed, rb / fmt.block_bytes(), &xs, outs);
                        }
                        (GemmKind::K(fmt), false) => {
                            gemm_k::avx2::repack(*fmt, tile, m, rb, &mut packed);
                            gemm_k::avx2::gemm(*fmt, &packed, rb / fmt.block_bytes(), &xs, outs);
                        }
                    }
                }
                return;
            }
            // Without a repacking GEMM (the scalar level), q4_0 / q5_0 tiles are decoded
            // once to q8_0 for the chunk's tokens: the same bits, and the q8_0
            // rows kernel skips the per-token nibble and high-bit unpacking.
            let mut q8 = Vec::new();
            let (ty, tile) = if n >= GEMM_MIN_TOKENS && crate::quant::levels_as_q8_0(self, w.ty(), tile, &mut q8) {
                (GgmlType::Q8_0, &q8[..])
            } else {
                (w.ty(), tile)
            };
            for (t, out) in outs.iter_mut().enumerate() {
                let xr = x.row(t).expect("t < n");
                self.dot_rows_checked(ty, tile, xr, out);
            }
        };

        // For each task (a run of `chunk` rows), its slice of every token's output row.
        let n_chunks = rows.div_ceil(chunk);
        let mut per_task: Vec<Vec<&mut [f32]>> =
            (0..n_chunks).map(|_| Vec::with_capacity(n)).collect();
        for yt in y.chunks_mut(rows) {
            for (c, part) in yt.chunks_mut(chunk).enumerate() {
                per_task[c].push(part);
            }
        }
        if w.data().len().saturating_mul(n) < SERIAL_BYTES || threads == 1 {
            for (c, outs) in per_task.iter_mut().enumerate() {
                run(c * chunk, outs);
            }
        } else {
            pool.install(|| {
                per_task
                    .par_iter_mut()
                    .enumerate()
                    .for_each(|(c, outs)| run(c * chunk, outs));
            });
        }
        Ok(())
    }
}
