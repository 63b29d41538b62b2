//! pulsar-kernels (being written).
