//! pulsar-store: where routed-expert bytes live and how they get to a step
//! (DESIGN.md, "The expert store").
//!
//! - [`Catalog`]: every slab (one expert's slice of one `*_exps` tensor),
//!   built from plain `(SlabId, SlabLoc)` entries.
//! - Tier 4, [`DiskReader`]: io_uring + O_DIRECT reads of aligned supersets,
//!   exact sub-slices handed to a callback as each slab completes; raw
//!   backends behind [`io::IoBackend`] so tests inject faults.
//! - Tier 3, [`HostCache`]: byte-budgeted LFU-DA over page-aligned buffers
//!   from a [`HostAllocator`]; slabs pinned by a step are never evicted.
//! - Tier 2, [`HotSet`]: VRAM slot admission policy (decisions only).
//! - Tier 1, [`place_resident`]: which whole triples live on spare GPUs.
//! - [`ExpertStore::resolve`]: one layer-step's slabs behind a [`StepGuard`];
//!   [`ExpertStore::prefetch`] reads predicted slabs in the background.
//! - [`Census`] and its `<model>.gguf.warm` sidecar; [`Hotlist`]s.
//! - [`StoreStats`]: serde-serialisable per-step and cumulative counters.

pub mod budget;
pub mod buffer;
pub mod catalog;
pub mod census;
pub mod error;
pub mod host_cache;
pub mod hotlist;
pub mod hotset;
pub mod io;
pub mod placement;
pub mod prefetch;
pub mod reader;
pub mod sim;
pub mod stats;
pub mod store;

pub use budget::{budget_from_gib, default_host_budget, host_budget_from_meminfo};
pub use buffer::{page_size, AlignedBuf, HostAllocator, PageAllocator};
pub use catalog::{Catalog, SlabId, SlabKind, SlabLoc, Triple, TripleLayout};
pub use census::{load_sidecar, save_sidecar, sidecar_path, Census, SidecarLoad};
pub use error::{Result, StoreError};
pub use host_cache::{CacheCounters, HostCache, LfuPolicy, Lookup, Owner};
pub use hotlist::{builtin_hotlist, hotlist_from_census, Hotlist};
pub use hotset::{Admission, HotSet, HotSetConfig, HotSetCounters};
pub use placement::{place_resident, Placement};
pub use prefetch::PrefetchLimits;
pub use reader::{DiskReader, ReadCounters, ReaderOptions, SlabData, SlabRead, WarnOnce};
pub use stats::{PrefetchStats, StepStats, StoreStats, TierCount, TierStats};
pub use store::{ExpertStore, Selection, ShardBytes, StepGuard, StoreConfig, TripleBytes};
