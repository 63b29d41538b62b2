//! pulsar-cuda: the CUDA compute layer.
//!
//! Kernel sources live in `kernels/cuda/*.cu`, are embedded at build time,
//! compiled by NVRTC for the device's own architecture at first use (CUBIN,
//! cached on disk) and launched through cudarc's driver API (loaded
//! dynamically: this crate builds and its CPU-side tests run with no CUDA
//! installed). Every kernel has a CPU twin in `pulsar-kernels`;
//! [`selftest::run`] compares them on a real device.

pub mod compile;
pub mod error;
pub mod kernels;

pub use error::CudaError;
pub use kernels::Family;
pub mod buf;
pub mod device;
pub mod flag;

pub use buf::{copy_to_device_async, DeviceBuf, HostRegistration, PinnedBuf, Pod};
pub use device::CudaDevice;
pub use flag::HostFlag;
pub mod ops;

pub use ops::{
    act_bytes, attention_graph_ctx, attention_workspace_len, grouped_items_len, weight_bytes, AttnKernel, Gating, GemmKernel, kv_bytes, kv_elems, KvBf16, KvElem, KvFp8, KvQ4,
    ExpertRun, GemvPart, GroupedScratch, MoePairs, NormRopePart, PrimShape, RouterSpec, PRIM_RANK,
};
pub mod selftest;
