//! pulsar-gguf (being written).
