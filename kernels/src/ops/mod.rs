//! f32 CPU ops of the forward pass: norms, rotary embeddings, activations,
//! softmax/top-k and attention over a KV cache. The reference for every other
//! backend. Each op works row by row with a fixed order of arithmetic, so a
//! row's result does not depend on how many rows are processed together
//! (prefill and decode give bit-identical values).

mod act;
mod attention;
pub mod math;
mod norm;
mod rope;
mod route;

pub use act::{gelu, gelu_tanh, glu_rows, silu, Activation};
pub use attention::{attend_rows, AttnParams};
pub use norm::rms_norm_rows;
pub use rope::{rope_rows, rope_rows_with, yarn_inv_freq, RopeKind, RopeParams};
pub use route::{softmax_in_place, top_k};
