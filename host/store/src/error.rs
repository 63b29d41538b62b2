//! One error type for the store. Every variant names the thing it is about
//! (slab, file, offset) so a failure deep in an I/O batch is actionable.

use std::io;
use std::path::PathBuf;

use crate::catalog::SlabId;

/// Result alias used throughout the crate.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    // ---- catalogue ----
    #[error("slab {slab} is listed twice in the catalogue")]
    DuplicateSlab { slab: SlabId },
    #[error("slab {slab} names shard file {file}, but the catalogue has {n_files} file(s)")]
    BadFileIndex { slab: SlabId, file: u16, n_files: usize },
    #[error("slab {slab}: {bytes} bytes recorded, but {rows} rows of {cols} {ty} weights take {expected}")]
    SizeMismatch { slab: SlabId, bytes: u64, rows: u64, cols: u64, ty: pulsar_gguf::GgmlType, expected: String },
    #[error("slab {slab}: offset {offset} + {bytes} bytes overflows")]
    RangeOverflow { slab: SlabId, offset: u64, bytes: u64 },
    #[error("layer {layer} expert {expert}: incomplete triple ({reason})")]
    IncompleteTriple { layer: u32, expert: u32, reason: &'static str },
    #[error("slab {slab} is not in the catalogue")]
    UnknownSlab { slab: SlabId },
    #[error("layer {layer} expert {expert} is not in the catalogue")]
    UnknownExpert { layer: u32, expert: u32 },
    #[error("{got} shard mapping(s) given for a catalogue of {expected} file(s)")]
    ShardCount { expected: usize, got: usize },

    // ---- files and disk reads ----
    #[error("cannot open shard {file}: {source}")]
    Open { file: PathBuf, source: io::Error },
    #[error("slab {slab} ends at byte {end} of {file}, which is only {file_len} bytes long")]
    SlabPastEof { slab: SlabId, file: PathBuf, end: u64, file_len: u64 },
    #[error("reading slab {slab} from {file} at offset {offset}: {source}")]
    Read { slab: SlabId, file: PathBuf, offset: u64, source: io::Error },
    #[error("reading slab {slab} from {file}: end of file at offset {offset}, {missing} byte(s) of the slab missing")]
    UnexpectedEof { slab: SlabId, file: PathBuf, offset: u64, missing: u64 },
    #[error("I/O backend {backend}: {source}")]
    Backend { backend: &'static str, source: io::Error },
    #[error("slab {slab}: destination buffer of {have} bytes (align {align}) cannot hold the {need}-byte aligned read")]
    BadBuffer { slab: SlabId, have: usize, need: usize, align: usize },

    // ---- memory and budgets ----
    #[error("cannot allocate {bytes} bytes of host memory (align {align})")]
    Alloc { bytes: usize, align: usize },
    #[error("slab {slab} needs {bytes} bytes, more than the whole host-cache budget of {budget}")]
    SlabOverBudget { slab: SlabId, bytes: u64, budget: u64 },
    #[error("layer {layer}: this step needs {needed} more bytes in the host cache, but only {available} of the {budget}-byte budget can be freed (the rest is pinned by steps in progress); split the step")]
    StepOverBudget { layer: u32, needed: u64, available: u64, budget: u64 },
    #[error("host budget: {0}")]
    Budget(String),
    #[error("slab {slab}: its consumer failed: {reason}")]
    Consumer { slab: SlabId, reason: String },

    // ---- census, sidecar, hotlist ----
    #[error("writing census sidecar {path}: {source}")]
    SidecarWrite { path: PathBuf, source: io::Error },
    #[error("hotlist line {line}: {reason}")]
    Hotlist { line: usize, reason: String },

    // ---- background work ----
    #[error("the prefetch thread has stopped")]
    PrefetchStopped,
}
