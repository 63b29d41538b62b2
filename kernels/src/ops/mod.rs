//! f32 CPU ops of the forward pass: norms, rotary embeddings, activations,
//! softmax/top-k and attention over a KV cache. The reference for every other
//! backend. Each op works row by row with a fixed order of arithmetic, so a
//! row's result does not depend on how many rows are processed together
//! (prefill and decode give bit-identical values). The one exception is the
//! host's gated delta rule, whose prefill form sums in another order than its
//! decode form ([`DELTA_NET_CHUNK`]).

/// Tokens per chunk of the gated delta rule's chunked form (the host's
/// `delta_net` op on a run of more than one token, on the CPU and CUDA alike:
/// both chunk a run from its first token, so they give the same bits).
pub const DELTA_NET_CHUNK: usize = 64;

mod act;
mod attention;
mod kv;
pub mod math;
mod norm;
mod rope;
mod route;

pub use act::{gelu, gelu_tanh, glu_rows, silu, Activation};
pub use attention::{attend_rows, AttnParams};
pub use kv::{bf16_bits, KvRows, KvType, Q8_0_BLOCK};
pub use norm::rms_norm_rows;
pub use rope::{rope_rows, rope_rows_with, yarn_inv_freq, RopeKind, RopeParams};
pub use route::{softmax_in_place, top_k};
