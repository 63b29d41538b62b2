//! pulsar-store: the routed-expert store (DESIGN.md, "The expert store").

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

pub use buffer::{page_size, AlignedBuf, HostAllocator, PageAllocator};
pub use catalog::{Catalog, SlabId, SlabKind, SlabLoc, Triple, TripleLayout};
pub use error::{Result, StoreError};
pub use reader::{DiskReader, ReadCounters, ReaderOptions, SlabData, SlabRead, WarnOnce};
pub use host_cache::{CacheCounters, HostCache, LfuPolicy, Lookup, Owner};
pub use budget::{budget_from_gib, default_host_budget, host_budget_from_meminfo};
pub use census::{load_sidecar, save_sidecar, sidecar_path, Census, SidecarLoad};
pub use hotlist::{builtin_hotlist, hotlist_from_census, Hotlist};
pub use hotset::{Admission, HotSet, HotSetConfig, HotSetCounters};
pub use placement::{place_resident, Placement};
pub use prefetch::PrefetchLimits;
pub use stats::{PrefetchStats, StepStats, StoreStats, TierCount, TierStats};
pub use store::{ExpertStore, Selection, ShardBytes, StepGuard, StoreConfig, TripleBytes};
