//! pulsar-gguf: the GGUF file format (reader, writer, tensor types).
mod types;
pub use types::GgmlType;
