//! gemma3 family plugin (being written).
