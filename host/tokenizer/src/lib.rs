//! pulsar-tokenizer (being written).
