//! The cold path: serving the routed experts of a step that are not in VRAM.
//!
//! On a GPU too small for the model, each MoE layer's step has cold experts,
//! and each one takes one of three paths:
//!
//! - **Upload**: copy its bytes host -> device over PCIe, then the GPU computes;
//! - **ZeroCopy**: the GPU kernel reads the pinned host-cache bytes in place
//!   over PCIe (so only host-cache hits qualify, not disk misses);
//! - **Cpu**: the CPU lane ([`CpuLane`]) computes its FFN from the host-cache
//!   bytes while the GPU does the rest; its output rows are uploaded and
//!   summed with the others on the GPU in the fixed selection order, so the
//!   result does not depend on which path served which expert.
//!
//! Upload and ZeroCopy share one link, so they spend one time budget; the CPU
//! lane runs beside it. Per step, [`split`] assigns the paths from a
//! [`CostModel`] of measured rates (link numbers from the CUDA side, CPU lane
//! numbers from [`measure_cpu_lane`]) so the link and the lane finish
//! together; `--cold-path` ([`ColdPolicy`]) can force one path instead.
//!
//! An expert can also be split: the lane computes the first rows of its gate
//! and up products (its "head", [`CpuLane::heads`]) and the GPU the rest and
//! down, so the lane's share of a layer is not limited to whole experts.
//! [`head_rows`] sizes the heads of the next layer's predicted cold experts
//! before their prefetch, and the cost model's bias follows whether the lane
//! or the link held each layer up. The lane runs on its own spinning threads
//! ([`spin::SpinPool`]): a layer's job must start within microseconds. Where
//! the GPU can wait on a host flag, the lane's job runs on its own driver
//! thread ([`driver::Driver`]) while the host goes on queueing the layer.

pub mod cost;
pub mod driver;
pub mod lane;
pub mod spin;
pub mod split;

pub use cost::{measure_cpu_lane, CostModel};
pub use lane::{random_slab, CpuLane, GateUp, LaneError, LaneHead, LaneHeadJob, LaneJob, LanePair, Slab};
pub use split::{head_rows, lane_seconds, split, split_busy, Busy, ColdExpert, ColdPath, ColdPolicy, ParseColdPolicyError};
