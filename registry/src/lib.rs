//! pulsar-registry (being written).
