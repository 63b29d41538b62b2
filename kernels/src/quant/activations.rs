//! Activations prepared for the dots: kept as `f32` for float weights, or
//! quantized once to `q8_0` / `q8_K` blocks and reused for every weight row.

use std::fmt;

use pulsar_gguf::GgmlType;

use super::row_bytes;
use crate::error::QuantError;

/// The form activations take for a weight type's dot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActFormat {
    /// Plain `f32` (for f32/f16/bf16 weights).
    F32,
    /// `q8_0` blocks of 32 (for q4_0, q4_1, q5_0, q5_1, q8_0 weights).
    Q8_0,
    /// `q8_K` blocks of 256 with 16-value sums (for K-quant and IQ weights).
    Q8K,
}

impl ActFormat {
    /// The activation format `ty` weights dot against, or `None` when there is no dot for `ty`.
    pub fn for_weight(ty: GgmlType) -> Option<ActFormat> {
        use GgmlType::*;
        match ty {
            F32 | F16 | BF16 => Some(ActFormat::F32),
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 => Some(ActFormat::Q8_0),
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ2_XXS | IQ2_XS | IQ3_XXS => Some(ActFormat::Q8K),
            _ => None,
        }
    }

    /// The GGUF type of one activation row.
    pub fn ggml_type(self) -> GgmlType {
        match self {
            ActFormat::F32 => GgmlType::F32,
            ActFormat::Q8_0 => GgmlType::Q8_0,
            ActFormat::Q8K => GgmlType::Q8_K,
        }
    }

    /// Values per block: a row's width must be a multiple of it.
    pub fn block_elems(self) -> usize {
        self.ggml_type().block_elems() as usize
    }
}

impl fmt::Display for ActFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.ggml_type().name())
    }
}

/// Rows from which [`Activations::set`] quantizes in parallel, and rows per task.
const PAR_ROWS: usize = 8;
const ROWS_PER_TASK: usize = 4;

/// One or more activation rows of `cols` values in one [`ActFormat`].
///
/// Quantized rows come only from [`Activations::quantize`], so every `q8` value
/// is within [-127, 127]: the SIMD dots rely on that (negating -128 overflows).
#[derive(Clone, Debug)]
pub struct Activations {
    format: ActFormat,
    rows: usize,
    cols: usize,
    f32s: Vec<f32>,
    bytes: Vec<u8>,
}

impl Activations {
    /// An empty set in `format`, to be filled (and refilled) with [`Activations::set`].
    pub fn new(format: ActFormat) -> Activations {
        Activations {
            format,
            rows: 0,
            cols: 0,
            f32s: Vec::new(),
            bytes: Vec::new(),
        }
    }

    /// Quantize `x`, rows of `cols` values laid end to end, to `format`.
    pub fn quantize(format: ActFormat, x: &[f32], cols: usize) -> Result<Activations, QuantError> {
        let mut a = Activations::new(format);
        a.set(x, cols)?;
        Ok(a)
    }

    /// The activations `ty` weights dot against, quantized from `x`.
    pub fn for_weight(ty: GgmlType, x: &[f32], cols: usize) -> Result<Activations, QuantError> {
        let format = ActFormat::for_weight(ty).ok_or(QuantError::Unsupported { ty, op: "dot" })?;
        Activations::quantize(format, x, cols)
    }

    /// Replace the contents with `x` (rows of `cols` values), reusing the buffers.
    pub fn set(&mut self, x: &[f32], cols: usize) -> Result<(), QuantError> {
        let ty = self.format.ggml_type();
        let row = row_bytes(ty, cols)?;
        if cols == 0 || x.len() % cols != 0 {
            return Err(QuantError::LengthMismatch {
                what: "activation values (a whole number of rows)",
                expected: x.len().div_ceil(cols.max(1)) * cols,
                got: x.len(),
            });
        }
        let rows = x.len() / cols;
        self.rows = rows;
        self.cols = cols;
        self.f32s.clear();
        self.bytes.clear();
        match self.format {
            ActFormat::F32 => self.f32s.extend_from_slice(x),
            ActFormat::Q8_0 | ActFormat::Q8K => {
                self.bytes.resize(rows * row, 0);
                let q = self.quantizer();
                // Rows are independent: a prefill chunk's rows are quantized
                // in parallel (on the pool of the caller, when it runs on one).
                if rows >= PAR_ROWS {
                    use rayon::prelude::*;
                    x.par_chunks(cols * ROWS_PER_TASK)
                        .zip(self.bytes.par_chunks_mut(row * ROWS_PER_TASK))
                        .for_each(|(x, b)| q(x, b));
                } else {
                    q(x, &mut self.bytes);
                }
            }
        }
        Ok(())
    }

    fn quantizer(&self) -> fn(&[f32], &mut [u8]) {
        match self.format {
            ActFormat::Q8K => super::act_simd::q8_k,
            _ => super::act_simd::q8_0,
        }
    }

    pub fn format(&self) -> ActFormat {
        self.format
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `i`, or `None` past the end.
    pub fn row(&self, i: usize) -> Option<ActRow<'_>> {
        if i >= self.rows {
            return None;
        }
        Some(match self.format {
            ActFormat::F32 => ActRow {
                format: self.format,
                cols: self.cols,
                f32s: &self.f32s[i * self.cols..(i + 1) * self.cols],
                bytes: &[],
            },
            _ => {
                let rb = self.bytes.len() / self.rows;
                ActRow {
                    format: self.format,
                    cols: self.cols,
                    f32s: &[],
                    bytes: &self.bytes[i * rb..(i + 1) * rb],
                }
            }
        })
    }

    /// The quantized blocks of all rows (GGUF `q8_0`/`q8_K` layout), e.g. to hand
    /// to a GPU twin; empty for [`ActFormat::F32`].
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// One activation row, borrowed from [`Activations`] or from plain `f32`s.
#[derive(Clone, Copy, Debug)]
pub struct ActRow<'a> {
    format: ActFormat,
    cols: usize,
    f32s: &'a [f32],
    bytes: &'a [u8],
}

impl<'a> ActRow<'a> {
    /// A plain `f32` row (for f32/f16/bf16 weights); no copy.
    pub fn from_f32(x: &'a [f32]) -> ActRow<'a> {
        ActRow {
            format: ActFormat::F32,
            cols: x.len(),
            f32s: x,
            bytes: &[],
        }
    }
    pub fn format(&self) -> ActFormat {
        self.format
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub(crate) fn f32s(&self) -> &'a [f32] {
        self.f32s
    }
    pub(crate) fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_errors() {
        let x: Vec<f32> = (0..512).map(|i| i as f32 - 200.0).collect();
        let a = Activations::quantize(ActFormat::Q8K, &x, 256).unwrap();
        assert_eq!((a.rows(), a.cols()), (2, 256));
        assert_eq!(a.row(1).unwrap().bytes().len(), 292);
        assert!(a.row(2).is_none());
        assert_eq!(a.as_bytes().len(), 584);
        // 256 values are not a whole number of rows of 96, nor 96 a q8_K block multiple.
        assert!(Activations::quantize(ActFormat::F32, &x[..256], 96).is_err());
        assert!(Activations::quantize(ActFormat::Q8K, &x[..192], 96).is_err());
        assert!(Activations::quantize(ActFormat::Q8_0, &x, 0).is_err());
        let f = Activations::quantize(ActFormat::F32, &x, 128).unwrap();
        assert_eq!(f.row(3).unwrap().f32s(), &x[384..]);
        assert_eq!(ActFormat::for_weight(GgmlType::Q5_1), Some(ActFormat::Q8_0));
        assert_eq!(
            ActFormat::for_weight(GgmlType::IQ3_XXS),
            Some(ActFormat::Q8K)
        );
        assert_eq!(ActFormat::for_weight(GgmlType::IQ1_S), None);
    }
}
