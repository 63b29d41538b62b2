//! pulsar-gguf: the GGUF file format (reader, writer, tensor types).
//!
//! - [`GgufFile::open`] reads GGUF v2/v3 files and split shard sets as one
//!   view: metadata ([`Metadata`], typed getters), the tensor directory
//!   ([`TensorInfo`]), mapped data, pread access and expert slabs.
//! - [`parse_header`] parses from any [`ByteSource`] (a slice, a pread file).
//! - [`GgufWriter`] streams v3 files and split sets.
//! - [`report`] renders what `pulsar-host inspect` prints.
//!
//! The parser treats its input as hostile: every count, length and offset is
//! checked before use, and no input makes it panic, hang or allocate more
//! than a small multiple of the input's size.
mod error;
mod file;
mod metadata;
mod parse;
pub mod report;
mod sha256;
mod source;
pub mod split;
mod tensor;
pub mod tempfile;
mod types;
mod value;
mod writer;

pub use error::{GgufError, Result};
pub use file::{GgufFile, ShardInfo};
pub use metadata::Metadata;
pub use parse::{parse_header, Header, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH, VERSION};
pub use source::{ByteSource, FileSource};
pub use tensor::{tensor_bytes, ByteRange, TensorInfo, MAX_DIMS};
pub use types::GgmlType;
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, TensorDataWriter, WriteAt};
