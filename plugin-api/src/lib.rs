//! pulsar-plugin-api (being written).
