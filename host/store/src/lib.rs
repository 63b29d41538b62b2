//! pulsar-store: the routed-expert store (DESIGN.md, "The expert store").

pub mod buffer;
pub mod catalog;
pub mod error;
pub mod io;
pub mod reader;

pub use buffer::{page_size, AlignedBuf, HostAllocator, PageAllocator};
pub use catalog::{Catalog, SlabId, SlabKind, SlabLoc, Triple, TripleLayout};
pub use error::{Result, StoreError};
pub use reader::{DiskReader, ReadCounters, ReaderOptions, SlabData, SlabRead, WarnOnce};
