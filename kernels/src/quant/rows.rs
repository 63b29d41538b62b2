//! `Kernels::dot_rows`: the dots of several weight rows with one activation
//! row. Each output is bit for bit the [`Kernels::dot`] of its row; where a
//! multi-row kernel exists (AVX-512 VNNI: q2_K, q3_K, q4_K, q8_0, q4_0, q5_0;
//! AVX2: q4_K, q6_K and the 32-value block formats) it reuses every
//! activation load across rows and reduces integer sums for several rows at
//! once, else it is a loop over the single-row kernel.

use pulsar_gguf::GgmlType;

use super::{dot_row_bytes, q2_k, q3_k, q4_0, q4_1, q4_k, q5_0, q5_1, q6_k, q8_0, ActRow};
use crate::error::QuantError;
use crate::isa::{Isa, Kernels};

impl Kernels {
    /// The multi-row kernels take rows in groups of this many: callers that
    /// split rows into chunks should make chunks a multiple of it.
    pub const DOT_ROWS_GROUP: usize = 4;

    /// `out[r] = dot(ty, row r, x)` for the `n_rows` rows of `ty` laid end to
    /// end in `rows` (each `x.cols()` weights); `out` has `n_rows` values.
    /// Equal to `n_rows` calls of [`Kernels::dot`] bit for bit, at any ISA.
    pub fn dot_rows(
        &self,
        ty: GgmlType,
        rows: &[u8],
        n_rows: usize,
        x: ActRow<'_>,
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        let rb = dot_row_bytes(ty, x)?;
        if out.len() != n_rows {
            return Err(QuantError::LengthMismatch {
                what: "outputs for dot_rows",
                expected: n_rows,
                got: out.len(),
            });
        }
        let need = rb.saturating_mul(n_rows);
        if rows.len() != need {
            return Err(QuantError::LengthMismatch {
                what: "weight bytes for dot_rows",
                expected: need,
                got: rows.len(),
            });
        }
        self.dot_rows_checked(ty, rows, x, out);
        Ok(())
    }

    /// `dot_rows` after its checks: `rows` is exactly `out.len()` rows that
    /// pass `check_dot` with `x`.
    pub(crate) fn dot_rows_checked(
        &self,
        ty: GgmlType,
        rows: &[u8],
        x: ActRow<'_>,
        out: &mut [f32],
    ) {
        if out.is_empty() {
            return;
        }
        debug_assert_eq!(rows.len() % out.len(), 0);
        #[cfg(target_arch = "x86_64")]
        if self.isa() == Isa::Avx512Vnni {
            // SAFETY: a Kernels at Avx512Vnni exists only on a CPU with those
            // features; check_dot fixed the row length for x, and rows holds
            // exactly out.len() of them.
            match ty {
                GgmlType::Q2_K => return unsafe { q2_k::dot_rows_avx512(rows, x.bytes(), out) },
                GgmlType::Q3_K => return unsafe { q3_k::dot_rows_avx512(rows, x.bytes(), out) },
                GgmlType::Q4_K => return unsafe { q4_k::dot_rows_avx512(rows, x.bytes(), out) },
                GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => {
                    let fmt = super::gemm32::Fmt::of(ty).expect("a 32-block format");
                    return unsafe { super::gemm32::dot_rows_avx512(fmt, rows, x.bytes(), out) };
                }
                _ => {}
            }
        }
        #[cfg(target_arch = "x86_64")]
        if self.isa() == Isa::Avx2 {
            // SAFETY: a Kernels at Avx2 exists only on a CPU with AVX2, FMA
            // and F16C; lengths as above.
            match ty {
                GgmlType::Q4_K => return unsafe { q4_k::dot_rows_avx2(rows, x.bytes(), out) },
                GgmlType::Q6_K => return unsafe { q6_k::dot_rows_avx2(rows, x.bytes(), out) },
                GgmlType::Q8_0 => return unsafe { q8_0::dot_rows_avx2(rows, x.bytes(), out) },
                GgmlType::Q4_0 => return unsafe { q4_0::dot_rows_avx2(rows, x.bytes(), out) },
                GgmlType::Q5_0 => return unsafe { q5_0::dot_rows_avx2(rows, x.bytes(), out) },
                GgmlType::Q4_1 => return unsafe { q4_1::dot_rows_avx2(rows, x.bytes(), out) },
                GgmlType::Q5_1 => return unsafe { q5_1::dot_rows_avx2(rows, x.bytes(), out) },
                _ => {}
            }
        }
        let rb = rows.len() / out.len();
        for (r, o) in out.iter_mut().enumerate() {
            *o = self.dot_checked(ty, &rows[r * rb..(r + 1) * rb], x);
        }
    }
}
