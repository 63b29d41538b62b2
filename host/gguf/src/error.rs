//! The one error type of this crate.
//!
//! Every variant names what it is about (a key, a tensor, a shard, a file) and,
//! for malformed input, the byte offset where the problem was found, so that a
//! user holding a broken 40 GB file knows where to look.

use std::io;
use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// Everything that can go wrong reading, querying or writing GGUF.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// An operating-system error, with what was being done.
    /// (The OS error is part of the message, not a `source`: a chain printer
    /// would print it twice.)
    #[error("{context}: {error}")]
    Io { context: String, error: io::Error },

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic at offset 0 is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },

    /// A version this reader does not read (v1, big-endian, or newer than v3).
    #[error("{}", version_message(*version))]
    UnsupportedVersion { version: u32 },

    /// The input ends before `what` (which starts at `offset`) is complete.
    #[error("truncated: {what} at offset {offset} needs {needed} bytes, but the file has only {available} left")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    /// A structurally invalid field: `what` names the key/tensor/field.
    #[error("{what} at offset {offset}: {reason}")]
    Malformed {
        what: String,
        offset: u64,
        reason: String,
    },

    /// The same metadata key appears twice.
    #[error("duplicate metadata key '{key}' at offset {offset}")]
    DuplicateKey { key: String, offset: u64 },

    /// The same tensor name appears twice (within one file or across shards).
    #[error("duplicate tensor name '{name}' (shard {shard}, tensor info at offset {offset})")]
    DuplicateTensor {
        name: String,
        shard: usize,
        offset: u64,
    },

    /// A tensor's `ggml_type` id is not in [`crate::GgmlType`].
    #[error("tensor '{tensor}' (tensor info at offset {offset}) has unknown ggml type id {id}")]
    UnknownTensorType { tensor: String, id: u32, offset: u64 },

    /// An error in one file of a set, with that file's path.
    #[error("{}: {error}", path.display())]
    InFile { path: PathBuf, error: Box<GgufError> },

    /// A split shard set is inconsistent (wrong `split.no`, counts, names...).
    #[error("split shard set: {0}")]
    Split(String),

    /// A shard of a split set does not exist.
    /// `index` is 0-based; the message counts from 1, like the file names.
    #[error("split shard {} of {count} is missing: {}", index + 1, path.display())]
    MissingShard {
        path: PathBuf,
        index: usize,
        count: usize,
    },

    /// A metadata key a caller required is absent.
    #[error("metadata key '{key}' is missing")]
    MissingKey { key: String },

    /// A metadata key holds a value of another type than the caller asked for.
    #[error("metadata key '{key}': expected {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    /// A metadata integer does not fit the type the caller asked for.
    #[error("metadata key '{key}': value {value} does not fit in {expected}")]
    OutOfRange {
        key: String,
        value: String,
        expected: &'static str,
    },

    /// A tensor-level request that does not make sense for that tensor.
    #[error("tensor '{tensor}': {reason}")]
    Tensor { tensor: String, reason: String },

    /// A byte range outside a shard, or a shard index that does not exist.
    #[error("shard {shard}: byte range {offset}+{len} is outside the shard ({shard_len} bytes)")]
    OutOfBounds {
        shard: usize,
        offset: u64,
        len: u64,
        shard_len: u64,
    },

    /// A shard index that does not exist.
    #[error("shard {shard} does not exist (the file set has {count})")]
    NoSuchShard { shard: usize, count: usize },

    /// Misuse of [`crate::GgufWriter`] (duplicate, unknown or mis-sized tensor...).
    #[error("GGUF writer: {0}")]
    Writer(String),
}

fn version_message(version: u32) -> String {
    match version {
        1 => "GGUF version 1 is not supported (this reader reads v2 and v3); \
              re-convert the model with a current llama.cpp"
            .to_string(),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            format!("big-endian GGUF (version {}) is not supported", v.swap_bytes())
        }
        v => format!("unsupported GGUF version {v} (this reader reads v2 and v3)"),
    }
}

impl GgufError {
    /// The error itself, looking through [`GgufError::InFile`] wrappers.
    pub fn innermost(&self) -> &GgufError {
        match self {
            GgufError::InFile { error, .. } => error.innermost(),
            e => e,
        }
    }

    pub(crate) fn io(context: impl Into<String>, error: io::Error) -> Self {
        GgufError::Io { context: context.into(), error }
    }

    pub(crate) fn malformed(what: impl Into<String>, offset: u64, reason: impl Into<String>) -> Self {
        GgufError::Malformed {
            what: what.into(),
            offset,
            reason: reason.into(),
        }
    }
}
