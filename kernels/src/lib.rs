//! pulsar-kernels: the CPU compute of Pulsar.
//!
//! - [`quant`]: every GGUF quant format (dequantize, quantize, dot products
//!   against `q8_0`/`q8_K`/`f32` activations), a scalar reference and SIMD paths;
//! - [`Kernels`]: the instruction-set level, chosen once at run time;
//! - [`matvec`]: multi-threaded matrix-vector and small matrix-matrix products
//!   over a quantized weight matrix.

// Index loops mirror the block layouts in the docs; `%` keeps the MSRV (1.85).
#![allow(clippy::needless_range_loop, clippy::manual_is_multiple_of)]

pub mod error;
pub mod isa;
pub mod matvec;
pub mod ops;
pub mod quant;
mod simd;

pub use error::QuantError;
pub use isa::{Isa, Kernels};
pub use matvec::WeightMatrix;
pub use quant::{dequantize, quantize, ActFormat, ActRow, Activations};
