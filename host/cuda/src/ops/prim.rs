//! The step graph's primitives (kernels/cuda/prim.cu): strided copies,
//! elementwise and broadcast ops, lane ops along an axis, top-k and index
//! ops, batched matmul, the mask, the scan and the rows-state write. Values
//! are buffers of 4-byte words (f32, or i32 ids in the same buffer type).
//! Twins: `pulsar_host::cpu::prim` and the CPU step's mask / scan / rope.

use super::*;
use crate::kernels::Prim;
use pulsar_kernels::ops::DELTA_NET_CHUNK;

/// Value columns a block of `prim_delta_net_chunked` takes (its `DN_COLS`; its
/// `DN_CHUNK` is [`DELTA_NET_CHUNK`]).
pub(crate) const DELTA_NET_COLS: usize = 32;

/// Most axes a primitive's index space has (PRIM_RANK in prim.cu).
pub const PRIM_RANK: usize = 8;

/// prim.cu's `NgramAttrs` (n-gram hash constants, passed by value).
const NGRAM_MAX_N: usize = 8;
const NGRAM_MAX_HEADS: usize = 64;
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct NgramAttrs {
    eos: i64,
    n: i32,
    heads: i32,
    mult: [i64; NGRAM_MAX_N],
    off: [i64; NGRAM_MAX_HEADS],
    voc: [i64; NGRAM_MAX_HEADS],
}

/// An N-D index space, row-major over `dims`, and where each of its
/// elements lies in two operands: `off + Σ index[d] * st[d]` (prim.cu's
/// struct, passed by value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrimShape {
    n: i64,
    rank: i32,
    pad: i32,
    dims: [i64; PRIM_RANK],
    st_a: [i64; PRIM_RANK],
    st_b: [i64; PRIM_RANK],
    off_a: i64,
    off_b: i64,
}

impl PrimShape {
    /// `dims` with operand strides `st_a` / `st_b` (one per axis, in
    /// elements) and base offsets.
    pub fn new(dims: &[usize], st_a: &[usize], off_a: usize, st_b: &[usize], off_b: usize) -> Result<PrimShape, CudaError> {
        if dims.len() > PRIM_RANK || st_a.len() != dims.len() || st_b.len() != dims.len() {
            return Err(shape("prim", format!("{} axes (at most {PRIM_RANK}), strides {} / {}", dims.len(), st_a.len(), st_b.len())));
        }
        let mut s = PrimShape { n: dims.iter().product::<usize>() as i64, rank: dims.len() as i32, off_a: off_a as i64, off_b: off_b as i64, ..Default::default() };
        for (i, &d) in dims.iter().enumerate() {
            s.dims[i] = d as i64;
            s.st_a[i] = st_a[i] as i64;
            s.st_b[i] = st_b[i] as i64;
        }
        Ok(s)
    }

    /// Elements of the index space.
    pub fn len(&self) -> usize {
        self.n as usize
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// One past the largest offset into operand a (0 when empty).
    fn end(&self, st: &[i64; PRIM_RANK], off: i64) -> usize {
        if self.n == 0 {
            return 0;
        }
        (off + (0..self.rank as usize).map(|d| (self.dims[d] - 1) * st[d]).sum::<i64>() + 1) as usize
    }
    fn end_a(&self) -> usize {
        self.end(&self.st_a, self.off_a)
    }
    fn end_b(&self) -> usize {
        self.end(&self.st_b, self.off_b)
    }
}

/// Row-major strides of `dims`, in elements.
pub fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

fn within(op: &'static str, what: &str, end: usize, len: usize) -> Result<(), CudaError> {
    if end > len {
        return Err(shape(op, format!("{what}: reads or writes up to {end} values of {len}")));
    }
    Ok(())
}

/// Blocks of 256 threads for `n` items (a grid-stride loop covers the rest).
fn blocks(n: usize) -> (u32, u32, u32) {
    ((n.div_ceil(256)).clamp(1, 1 << 20) as u32, 1, 1)
}

/// Lanes along one axis of `dims`: (outer, n, inner).
pub fn lanes(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (dims[..axis].iter().product(), dims[axis], dims[axis + 1..].iter().product())
}

impl CudaDevice {
    fn prim(&self, p: Prim) -> Result<&CudaFunction, CudaError> {
        self.func(Family::Prim, p as usize)
    }

    /// `dst[b(i)] = src[a(i)]` for every index of `s` (4-byte words).
    pub fn prim_copy(&self, stream: &CudaStream, src: &DeviceBuf<f32>, dst: &mut DeviceBuf<f32>, s: &PrimShape) -> Result<(), CudaError> {
        within("prim_copy", "src", s.end_a(), src.len())?;
        within("prim_copy", "dst", s.end_b(), dst.len())?;
        let f = self.prim(Prim::Copy)?;
        let (sp, dp) = (src.device_ptr(), dst.device_ptr());
        // SAFETY: (src, dst, s) as prim_copy; both ranges checked above.
        unsafe { self.launch(f, blocks(s.len()), 256, 0, stream, &mut params![sp, dp, *s]) }
    }

    /// `y = f(x)` elementwise: `op` is `Unary`'s declaration index, 15 scale
    /// by `p0`, 16 clamp to `[p0, p1]`.
    pub fn prim_unary(&self, stream: &CudaStream, x: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, op: u32, p0: f32, p1: f32) -> Result<(), CudaError> {
        want("prim_unary", "y", y.len(), x.len())?;
        let f = self.prim(Prim::Unary)?;
        let (xp, yp, n, op) = (x.device_ptr(), y.device_ptr(), x.len() as i64, op as i32);
        // SAFETY: (x, y, n, op, p0, p1) as prim_unary.
        unsafe { self.launch(f, blocks(x.len()), 256, 0, stream, &mut params![xp, yp, n, op, p0, p1]) }
    }

    /// `y[i] = f(a[a(i)], b[b(i)])`, `op` is `Binary`'s declaration index.
    pub fn prim_binary(&self, stream: &CudaStream, a: &DeviceBuf<f32>, b: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, s: &PrimShape, op: u32) -> Result<(), CudaError> {
        within("prim_binary", "a", s.end_a(), a.len())?;
        within("prim_binary", "b", s.end_b(), b.len())?;
        want("prim_binary", "y", y.len(), s.len())?;
        let f = self.prim(Prim::Binary)?;
        let (ap, bp, yp, op) = (a.device_ptr(), b.device_ptr(), y.device_ptr(), op as i32);
        // SAFETY: (a, b, y, s, op) as prim_binary.
        unsafe { self.launch(f, blocks(s.len()), 256, 0, stream, &mut params![ap, bp, yp, *s, op]) }
    }

    fn lane_launch(&self, p: Prim, stream: &CudaStream, x: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, (outer, n, inner): (usize, usize, usize), y_len: usize, extra: &[i32]) -> Result<(), CudaError> {
        let op = "prim lane op";
        want(op, "x", x.len(), outer * n * inner)?;
        want(op, "y", y.len(), y_len)?;
        let f = self.prim(p)?;
        let (xp, yp, o, nn, i) = (x.device_ptr(), y.device_ptr(), outer as i64, to_i32(op, "n", n)?, inner as i64);
        let lanes = outer * inner;
        let (e0, e1) = (extra.first().copied().unwrap_or(0), extra.get(1).copied().unwrap_or(0));
        // SAFETY: (x, y, outer, n, inner[, e0, e1]) as the lane kernels; extra
        // parameters past a kernel's own are not read.
        unsafe { self.launch(f, (lanes.div_ceil(128) as u32, 1, 1), 128, 0, stream, &mut params![xp, yp, o, nn, i, e0, e1]) }
    }

    /// Softmax along the axis of `lanes` (outer, n, inner).
    pub fn prim_softmax(&self, stream: &CudaStream, x: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, lanes: (usize, usize, usize)) -> Result<(), CudaError> {
        self.lane_launch(Prim::Softmax, stream, x, y, lanes, x.len(), &[])
    }

    /// Sum (0), mean (1) or max (2) along the axis, one value a lane.
    /// `reverse` sums in the wrong order: only the Ops harness's negative
    /// control sets it.
    pub fn prim_reduce(&self, stream: &CudaStream, x: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, lanes: (usize, usize, usize), kind: u32, reverse: bool) -> Result<(), CudaError> {
        self.lane_launch(Prim::Reduce, stream, x, y, lanes, lanes.0 * lanes.2, &[kind as i32, reverse as i32])
    }

    pub fn prim_cumsum(&self, stream: &CudaStream, x: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, lanes: (usize, usize, usize)) -> Result<(), CudaError> {
        self.lane_launch(Prim::Cumsum, stream, x, y, lanes, x.len(), &[])
    }

    /// The `k` largest of each row of `n` (i32 ids into `ids`).
    pub fn prim_topk(&self, stream: &CudaStream, x: &DeviceBuf<f32>, ids: &mut DeviceBuf<f32>, n: usize, k: usize) -> Result<(), CudaError> {
        const OP: &str = "prim_topk";
        if n == 0 || k > n || x.len() % n != 0 {
            return Err(shape(OP, format!("top {k} of rows of {n} ({} values)", x.len())));
        }
        let rows = x.len() / n;
        want(OP, "ids", ids.len(), rows * k)?;
        let f = self.prim(Prim::TopK)?;
        let (xp, ip, r, nn, kk) = (x.device_ptr(), ids.device_ptr(), rows as i64, to_i32(OP, "n", n)?, to_i32(OP, "k", k)?);
        // SAFETY: (x, ids, rows, n, k) as prim_topk.
        unsafe { self.launch(f, (rows.div_ceil(64) as u32, 1, 1), 64, 0, stream, &mut params![xp, ip, r, nn, kk]) }
    }

    /// `y[r, j] = x[r, ids[r, j]]` over rows of `n` and `k`.
    pub fn prim_take_along(&self, stream: &CudaStream, x: &DeviceBuf<f32>, ids: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, n: usize, k: usize) -> Result<(), CudaError> {
        const OP: &str = "prim_take_along";
        if n == 0 || k == 0 || x.len() % n != 0 {
            return Err(shape(OP, format!("rows of {n} ({} values)", x.len())));
        }
        let rows = x.len() / n;
        want(OP, "ids", ids.len(), rows * k)?;
        want(OP, "y", y.len(), rows * k)?;
        let f = self.prim(Prim::TakeAlong)?;
        let (xp, ip, yp, r, nn, kk) = (x.device_ptr(), ids.device_ptr(), y.device_ptr(), rows as i64, to_i32(OP, "n", n)?, to_i32(OP, "k", k)?);
        // SAFETY: (x, ids, y, rows, n, k) as prim_take_along.
        unsafe { self.launch(f, blocks(rows * k), 256, 0, stream, &mut params![xp, ip, yp, r, nn, kk]) }
    }

    /// `y[i, :] = x[ids[i], :]` for rows of `width` words.
    pub fn prim_gather(&self, stream: &CudaStream, x: &DeviceBuf<f32>, ids: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, width: usize) -> Result<(), CudaError> {
        const OP: &str = "prim_gather";
        if width == 0 || x.len() % width != 0 {
            return Err(shape(OP, format!("rows of {width} ({} values)", x.len())));
        }
        want(OP, "y", y.len(), ids.len() * width)?;
        let f = self.prim(Prim::Gather)?;
        let (xp, ip, yp, n, rows, w) = (x.device_ptr(), ids.device_ptr(), y.device_ptr(), ids.len() as i64, (x.len() / width) as i64, width as i64);
        // SAFETY: (x, ids, y, n_ids, rows, width) as prim_gather.
        unsafe { self.launch(f, blocks(ids.len() * width), 256, 0, stream, &mut params![xp, ip, yp, n, rows, w]) }
    }

    /// `[.., m, k] · [.., k, n]` with `batch` spanning the batch axes (its
    /// strides count elements of a and b).
    #[allow(clippy::too_many_arguments)]
    pub fn prim_matmul(&self, stream: &CudaStream, a: &DeviceBuf<f32>, b: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, batch: &PrimShape, m: usize, k: usize, n: usize) -> Result<(), CudaError> {
        const OP: &str = "prim_matmul";
        within(OP, "a", batch.end_a() + if batch.is_empty() { 0 } else { m * k - 1 }, a.len())?;
        within(OP, "b", batch.end_b() + if batch.is_empty() { 0 } else { k * n - 1 }, b.len())?;
        want(OP, "y", y.len(), batch.len() * m * n)?;
        let f = self.prim(Prim::Matmul)?;
        let (ap, bp, yp) = (a.device_ptr(), b.device_ptr(), y.device_ptr());
        let (mm, kk, nn) = (to_i32(OP, "m", m)?, to_i32(OP, "k", k)?, to_i32(OP, "n", n)?);
        // SAFETY: (a, b, y, batch, m, k, n) as prim_matmul.
        unsafe { self.launch(f, blocks(y.len()), 256, 0, stream, &mut params![ap, bp, yp, *batch, mm, kk, nn]) }
    }

    /// The causal mask `[n_tok, c]` of queries at `positions`.
    pub fn prim_mask(&self, stream: &CudaStream, positions: &DeviceBuf<u32>, y: &mut DeviceBuf<f32>, n_tok: usize, c: usize, window: u32) -> Result<(), CudaError> {
        const OP: &str = "prim_mask";
        if positions.len() < n_tok {
            return Err(shape(OP, format!("{} positions for {n_tok} queries", positions.len())));
        }
        want(OP, "y", y.len(), n_tok * c)?;
        let f = self.prim(Prim::Mask)?;
        let (pp, yp, t, cc, w) = (positions.device_ptr(), y.device_ptr(), to_i32(OP, "n_tok", n_tok)?, to_i32(OP, "c", c)?, window as i32);
        // SAFETY: (positions, y, n_tok, c, window) as prim_mask.
        unsafe { self.launch(f, blocks(n_tok * c), 256, 0, stream, &mut params![pp, yp, t, cc, w]) }
    }

    /// Block-sparse attention's selection over rows of `c` key scores (row
    /// `r`'s query at `positions[r % n_tok]`): the additive mask of the
    /// `top_k` best blocks of `block` keys, the query's own block and the
    /// `local - 1` before it first (see `Op::BlockSelect`).
    #[allow(clippy::too_many_arguments)]
    pub fn prim_block_select(&self, stream: &CudaStream, x: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, positions: &DeviceBuf<u32>, n_tok: usize, c: usize, block: usize, top_k: usize, local: usize) -> Result<(), CudaError> {
        const OP: &str = "prim_block_select";
        // The block scores and flags live in the default 48 KiB of shared memory.
        const MAX_BLOCKS: usize = 48 * 1024 / 5;
        if c == 0 || block == 0 || n_tok == 0 || x.len() % c != 0 || (x.len() / c) % n_tok != 0 {
            return Err(shape(OP, format!("rows of {c} keys in blocks of {block} for {n_tok} queries ({} values)", x.len())));
        }
        if positions.len() < n_tok {
            return Err(shape(OP, format!("{} positions for {n_tok} queries", positions.len())));
        }
        let nb = c.div_ceil(block);
        if nb > MAX_BLOCKS {
            return Err(shape(OP, format!("{nb} key blocks (at most {MAX_BLOCKS}: use larger blocks)")));
        }
        want(OP, "y", y.len(), x.len())?;
        let rows = x.len() / c;
        let f = self.prim(Prim::BlockSelect)?;
        let (xp, yp, pp, r) = (x.device_ptr(), y.device_ptr(), positions.device_ptr(), rows as i64);
        let (cc, t, b, k, l) = (to_i32(OP, "c", c)?, to_i32(OP, "n_tok", n_tok)?, to_i32(OP, "block", block)?, to_i32(OP, "top_k", top_k)?, to_i32(OP, "local", local)?);
        let grid = u32::try_from(rows).map_err(|_| shape(OP, format!("{rows} rows")))?;
        // SAFETY: (x, y, positions, rows, c, t, block, top_k, local) as prim_block_select; 5 bytes of shared memory a block.
        unsafe { self.launch(f, (grid, 1, 1), 256, (nb * 5) as u32, stream, &mut params![xp, yp, pp, r, cc, t, b, k, l]) }
    }

    /// i32 values `x` (ids) as f32 into `y` (see `Op::ToF32`).
    pub fn prim_to_f32(&self, stream: &CudaStream, x: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>) -> Result<(), CudaError> {
        const OP: &str = "prim_to_f32";
        want(OP, "y", y.len(), x.len())?;
        let f = self.prim(Prim::ToF32)?;
        let (xp, yp, n) = (x.device_ptr(), y.device_ptr(), y.len() as i64);
        // SAFETY: (x, y, n) as prim_to_f32; lengths checked above.
        unsafe { self.launch(f, blocks(y.len()), 256, 0, stream, &mut params![xp, yp, n]) }
    }

    /// Hashed n-gram ids (see `Op::NgramHash`) of the step's `n_tok` rows
    /// from the token history `hist` `[c]` into `y` `[n_tok, (n - 1) * heads]`.
    #[allow(clippy::too_many_arguments)]
    pub fn prim_ngram_hash(&self, stream: &CudaStream, hist: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, positions: &DeviceBuf<u32>, n_tok: usize, eos: i64, mult: &[i64], offsets: &[i64], vocab: &[i64]) -> Result<(), CudaError> {
        const OP: &str = "prim_ngram_hash";
        let n = mult.len();
        if n < 2 || n > NGRAM_MAX_N || offsets.len() != vocab.len() || offsets.len() % (n - 1) != 0 || offsets.len() > NGRAM_MAX_HEADS || vocab.iter().any(|&v| v <= 0) {
            return Err(shape(OP, format!("n {n} with {} heads (at most {NGRAM_MAX_N} and {NGRAM_MAX_HEADS})", offsets.len())));
        }
        within(OP, "positions", n_tok, positions.len())?;
        want(OP, "y", y.len(), n_tok * offsets.len())?;
        if hist.is_empty() {
            return Err(shape(OP, "an empty token history"));
        }
        let mut a = NgramAttrs { eos, n: n as i32, heads: (offsets.len() / (n - 1)) as i32, mult: [0; NGRAM_MAX_N], off: [0; NGRAM_MAX_HEADS], voc: [1; NGRAM_MAX_HEADS] };
        a.mult[..n].copy_from_slice(mult);
        a.off[..offsets.len()].copy_from_slice(offsets);
        a.voc[..vocab.len()].copy_from_slice(vocab);
        let f = self.prim(Prim::NgramHash)?;
        let (hp, yp, pp, t) = (hist.device_ptr(), y.device_ptr(), positions.device_ptr(), to_i32(OP, "n_tok", n_tok)?);
        // SAFETY: (hist, y, positions, n_tok, attrs) as prim_ngram_hash; lengths checked above
        // (the positions lie in the history: the step writes it up to them first).
        unsafe { self.launch(f, blocks(y.len()), 256, 0, stream, &mut params![hp, yp, pp, t, a]) }
    }

    /// The dilated depthwise conv of the step's `n_tok` rows over the rows
    /// cache `cache` `[c, w]` with taps `taps` `[w, k]` (see `Op::ConvRows`).
    #[allow(clippy::too_many_arguments)]
    pub fn prim_conv_rows(&self, stream: &CudaStream, cache: &DeviceBuf<f32>, taps: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, positions: &DeviceBuf<u32>, n_tok: usize, w: usize, dilation: usize) -> Result<(), CudaError> {
        const OP: &str = "prim_conv_rows";
        if w == 0 || taps.len() % w != 0 || taps.is_empty() || dilation == 0 || cache.len() % w != 0 {
            return Err(shape(OP, format!("{} taps over {w} channels, dilation {dilation}", taps.len())));
        }
        within(OP, "positions", n_tok, positions.len())?;
        want(OP, "y", y.len(), n_tok * w)?;
        let k = taps.len() / w;
        let f = self.prim(Prim::ConvRows)?;
        let (cp, tp, yp, pp) = (cache.device_ptr(), taps.device_ptr(), y.device_ptr(), positions.device_ptr());
        let (t, ww, kk, d) = (to_i32(OP, "n_tok", n_tok)?, to_i32(OP, "w", w)?, to_i32(OP, "k", k)?, to_i32(OP, "dilation", dilation)?);
        // SAFETY: (cache, taps, y, positions, n_tok, w, k, dilation) as prim_conv_rows; lengths checked above.
        unsafe { self.launch(f, blocks(y.len()), 256, 0, stream, &mut params![cp, tp, yp, pp, t, ww, kk, d]) }
    }

    /// QSA's block selection (see `Op::PooledSelect`, no YaRN): the raw
    /// index keys `keys` `[c, d]` pooled into `pooled` (`c / block` rows,
    /// normed with `key_norm`, rotated at each block's first position), then
    /// per query of `q` `[n_tok, nh, d]` the additive mask `y` `[n_tok, c]`.
    #[allow(clippy::too_many_arguments)]
    pub fn prim_pooled_select(&self, stream: &CudaStream, q: &DeviceBuf<f32>, keys: &DeviceBuf<f32>, key_norm: &DeviceBuf<f32>, pooled: &mut DeviceBuf<f32>, y: &mut DeviceBuf<f32>, positions: &DeviceBuf<u32>, dims: [usize; 4], block: usize, top_k: usize, eps: f32, scale: f32, rope: (usize, bool, f32, f32)) -> Result<(), CudaError> {
        const OP: &str = "prim_pooled_select";
        // The block scores and flags live in the default 48 KiB of shared memory.
        const MAX_BLOCKS: usize = 48 * 1024 / 5;
        let [n_tok, nh, d, c] = dims;
        let (n_rot, neox, base, linear_factor) = rope;
        if d == 0 || block == 0 || top_k == 0 || n_rot == 0 || n_rot > d || n_rot % 2 != 0 || c / block > MAX_BLOCKS {
            return Err(shape(OP, format!("{c} keys of {d} in blocks of {block} (at most {MAX_BLOCKS} blocks), rope over {n_rot}")));
        }
        within(OP, "positions", n_tok, positions.len())?;
        want(OP, "q", q.len(), n_tok * nh * d)?;
        want(OP, "keys", keys.len(), c * d)?;
        want(OP, "key_norm", key_norm.len(), d)?;
        want(OP, "y", y.len(), n_tok * c)?;
        let nb = c / block;
        within(OP, "pooled", nb * d, pooled.len())?;
        let (dd, bb, nr, kind) = (to_i32(OP, "d", d)?, to_i32(OP, "block", block)?, to_i32(OP, "n_rot", n_rot)?, if neox { 0i32 } else { 1i32 });
        if nb > 0 {
            let f = self.prim(Prim::PoolKeys)?;
            let (kp, wp, pp) = (keys.device_ptr(), key_norm.device_ptr(), pooled.device_ptr());
            // SAFETY: (keys, w, pooled, d, block, eps, n_rot, kind, base, linear_factor) as prim_pool_keys; lengths checked above.
            unsafe { self.launch(f, (nb as u32, 1, 1), 256, 0, stream, &mut params![kp, wp, pp, dd, bb, eps, nr, kind, base, linear_factor])? }
        }
        let f = self.prim(Prim::PooledSelect)?;
        let (qp, pp, yp, sp) = (q.device_ptr(), pooled.device_ptr(), y.device_ptr(), positions.device_ptr());
        let (cc, hh, kk) = (to_i32(OP, "c", c)?, to_i32(OP, "nh", nh)?, to_i32(OP, "top_k", top_k)?);
        let grid = u32::try_from(n_tok).map_err(|_| shape(OP, format!("{n_tok} rows")))?;
        // SAFETY: (q, pooled, y, positions, c, nh, d, block, top_k, scale) as prim_pooled_select; 5 bytes of shared memory a block.
        unsafe { self.launch(f, (grid, 1, 1), 256, (nb.max(1) * 5) as u32, stream, &mut params![qp, pp, yp, sp, cc, hh, dd, bb, kk, scale]) }
    }

    /// The first `y.len()` words of `src` (positions, tokens) as i32 values.
    pub fn prim_ids(&self, stream: &CudaStream, src: &DeviceBuf<u32>, y: &mut DeviceBuf<f32>) -> Result<(), CudaError> {
        const OP: &str = "prim_ids";
        within(OP, "src", y.len(), src.len())?;
        let f = self.prim(Prim::Ids)?;
        let (sp, yp, n) = (src.device_ptr(), y.device_ptr(), to_i32(OP, "n", y.len())?);
        // SAFETY: (src, y, n) as prim_ids.
        unsafe { self.launch(f, blocks(y.len()), 256, 0, stream, &mut params![sp, yp, n]) }
    }

    /// `S_t = a_t * S_{t-1} + b_t` over `n` rows of `state.len()` entries
    /// (from zero when `positions[0]` is 0); every `S_t` into `y`, the last
    /// kept in `state`.
    #[allow(clippy::too_many_arguments)]
    pub fn prim_scan(&self, stream: &CudaStream, a: &DeviceBuf<f32>, b: &DeviceBuf<f32>, state: &mut DeviceBuf<f32>, y: &mut DeviceBuf<f32>, positions: &DeviceBuf<u32>, n: usize) -> Result<(), CudaError> {
        const OP: &str = "prim_scan";
        let w = state.len();
        want(OP, "a", a.len(), n * w)?;
        want(OP, "b", b.len(), n * w)?;
        want(OP, "y", y.len(), n * w)?;
        if positions.is_empty() {
            return Err(shape(OP, "no positions".to_string()));
        }
        let f = self.prim(Prim::Scan)?;
        let (ap, bp, sp, yp, pp, nn, ww) = (a.device_ptr(), b.device_ptr(), state.device_ptr(), y.device_ptr(), positions.device_ptr(), to_i32(OP, "n", n)?, w as i64);
        // SAFETY: (a, b, state, y, positions, n, w) as prim_scan.
        unsafe { self.launch(f, (w.div_ceil(128) as u32, 1, 1), 128, 0, stream, &mut params![ap, bp, sp, yp, pp, nn, ww]) }
    }

    /// The depthwise causal conv of `x` `[n, c]` with taps `w` `[c, k]` over
    /// the conv window `win` `[k - 1, c]` (read as zero when `positions[0]`
    /// is 0), which keeps the last `k - 1` inputs (see `Op::ShortConv`).
    #[allow(clippy::too_many_arguments)]
    pub fn prim_short_conv(&self, stream: &CudaStream, x: &DeviceBuf<f32>, w: &DeviceBuf<f32>, win: &mut DeviceBuf<f32>, y: &mut DeviceBuf<f32>, positions: &DeviceBuf<u32>, n: usize, c: usize) -> Result<(), CudaError> {
        const OP: &str = "prim_short_conv";
        if c == 0 || w.len() % c != 0 || w.len() / c < 2 || positions.is_empty() {
            return Err(shape(OP, format!("{} taps over {c} channels", w.len())));
        }
        let k = w.len() / c;
        want(OP, "x", x.len(), n * c)?;
        want(OP, "y", y.len(), n * c)?;
        want(OP, "window", win.len(), (k - 1) * c)?;
        let f = self.prim(Prim::ShortConv)?;
        let (xp, wp, sp, yp, pp) = (x.device_ptr(), w.device_ptr(), win.device_ptr(), y.device_ptr(), positions.device_ptr());
        let (nn, cc, kk) = (to_i32(OP, "n", n)?, to_i32(OP, "c", c)?, to_i32(OP, "k", k)?);
        // SAFETY: (x, w, win, y, positions, n, c, k) as prim_short_conv; lengths checked above.
        unsafe { self.launch(f, (c.div_ceil(128) as u32, 1, 1), 128, 0, stream, &mut params![xp, wp, sp, yp, pp, nn, cc, kk]) }
    }

    /// The gated delta rule over `n` tokens on the state `s` `[hv, dk, dv]`
    /// (zeroed when `positions[0]` is 0): q, k `[n, hk, dk]`, v `[n, hv, dv]`,
    /// g, beta `[n, hv]`; o `[n, hv, dv]` (see `Op::DeltaNet`).
    #[allow(clippy::too_many_arguments)]
    pub fn prim_delta_net(&self, stream: &CudaStream, ins: [&DeviceBuf<f32>; 5], s: &mut DeviceBuf<f32>, o: &mut DeviceBuf<f32>, positions: &DeviceBuf<u32>, dims: [usize; 5], scale: f32) -> Result<(), CudaError> {
        const OP: &str = "prim_delta_net";
        let [n, hk, hv, dk, dv] = dims;
        if hk == 0 || hv % hk != 0 || dk == 0 || dv == 0 || positions.is_empty() || 2 * dk * 4 > 48 * 1024 {
            return Err(shape(OP, format!("{hv} v heads over {hk} k heads, key dim {dk}, value dim {dv}")));
        }
        let [q, k, v, g, b] = ins;
        want(OP, "q", q.len(), n * hk * dk)?;
        want(OP, "k", k.len(), n * hk * dk)?;
        want(OP, "v", v.len(), n * hv * dv)?;
        want(OP, "g", g.len(), n * hv)?;
        want(OP, "beta", b.len(), n * hv)?;
        want(OP, "state", s.len(), hv * dk * dv)?;
        want(OP, "o", o.len(), n * hv * dv)?;
        let (qp, kp, vp, gp, bp, sp, op, pp) = (q.device_ptr(), k.device_ptr(), v.device_ptr(), g.device_ptr(), b.device_ptr(), s.device_ptr(), o.device_ptr(), positions.device_ptr());
        let (nn, hkk, hvv, dkk, dvv) = (to_i32(OP, "n", n)?, hk as i32, to_i32(OP, "hv", hv)?, to_i32(OP, "dk", dk)?, to_i32(OP, "dv", dv)?);
        let mut args = params![qp, kp, vp, gp, bp, sp, op, pp, nn, hkk, hvv, dkk, dvv, scale];
        if n == 1 {
            // Decode: the recurrent form, one block a v head, one thread a value column.
            let threads = dv.next_multiple_of(32).min(1024) as u32;
            let f = self.prim(Prim::DeltaNet)?;
            // SAFETY: (q, k, v, g, beta, s, o, positions, n, hk, hv, dk, dv, scale) as prim_delta_net; lengths checked above, 2 dk floats of shared memory.
            unsafe { self.launch(f, (hvv as u32, 1, 1), threads, (2 * dk * 4) as u32, stream, &mut args) }
        } else {
            // The chunked form (the CPU's rule: more than one token), a block per
            // v head and DELTA_NET_COLS value columns.
            let f = self.prim(Prim::DeltaNetChunked)?;
            let (c, cols) = (DELTA_NET_CHUNK, DELTA_NET_COLS);
            let smem = ((2 * c * c + 3 * c + c * cols) * 4) as u32;
            // SAFETY: as above, for prim_delta_net_chunked (DN_CHUNK = DELTA_NET_CHUNK, DN_COLS = DELTA_NET_COLS); smem is its shared layout.
            unsafe { self.launch(f, (hvv as u32, dv.div_ceil(cols) as u32, 1), 256, smem, stream, &mut args) }
        }
    }

    /// Rows `x` (`[n, w]`) into `cache` at `positions` (rows past the
    /// cache's end are dropped; callers check the context first).
    pub fn prim_rows_write(&self, stream: &CudaStream, x: &DeviceBuf<f32>, cache: &mut DeviceBuf<f32>, positions: &DeviceBuf<u32>, n: usize, w: usize) -> Result<(), CudaError> {
        const OP: &str = "prim_rows_write";
        want(OP, "x", x.len(), n * w)?;
        if positions.len() < n || w == 0 {
            return Err(shape(OP, format!("{} positions for {n} rows of {w}", positions.len())));
        }
        let f = self.prim(Prim::RowsWrite)?;
        let (xp, cp, pp, nn, ww, cap) = (x.device_ptr(), cache.device_ptr(), positions.device_ptr(), to_i32(OP, "n", n)?, w as i64, (cache.len() / w) as i64);
        // SAFETY: (x, cache, positions, n, w, cap) as prim_rows_write.
        unsafe { self.launch(f, blocks(n * w), 256, 0, stream, &mut params![xp, cp, pp, nn, ww, cap]) }
    }

    /// [`CudaDevice::rope`] with the pairs' inverse frequencies given
    /// (`p.n_rot / 2` of them; `p.base` is not read).
    pub fn prim_rope_freq(&self, stream: &CudaStream, x: &DeviceBuf<f32>, y: &mut DeviceBuf<f32>, width: usize, positions: &DeviceBuf<u32>, inv_freq: &DeviceBuf<f32>, p: &RopeParams) -> Result<(), CudaError> {
        const OP: &str = "prim_rope_freq";
        if p.head_dim == 0 || width % p.head_dim != 0 || p.n_rot > p.head_dim || p.n_rot % 2 != 0 || width == 0 || x.len() % width != 0 {
            return Err(shape(OP, format!("width {width}, head_dim {}, n_rot {}", p.head_dim, p.n_rot)));
        }
        want(OP, "y", y.len(), x.len())?;
        want(OP, "inv_freq", inv_freq.len(), p.n_rot / 2)?;
        let rows = x.len() / width;
        if positions.len() < rows {
            return Err(shape(OP, format!("{} positions for {rows} rows", positions.len())));
        }
        let f = self.prim(Prim::RopeFreq)?;
        let kind = match p.kind {
            RopeKind::Neox => 0i32,
            RopeKind::Interleaved => 1,
        };
        let (xp, yp, pp, fp) = (x.device_ptr(), y.device_ptr(), positions.device_ptr(), inv_freq.device_ptr());
        let (w, r, hd, nr, lf) = (to_i32(OP, "width", width)?, to_i32(OP, "rows", rows)?, p.head_dim as i32, p.n_rot as i32, p.linear_factor);
        let total = rows * (width / p.head_dim) * (p.n_rot / 2 + p.head_dim - p.n_rot);
        // SAFETY: (x, y, width, positions, n_rows, head_dim, n_rot, inv_freq, linear_factor, kind) as prim_rope_freq.
        unsafe { self.launch(f, blocks(total), 256, 0, stream, &mut params![xp, yp, w, pp, r, hd, nr, fp, lf, kind]) }
    }
}
