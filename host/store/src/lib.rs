//! pulsar-store (being written).
