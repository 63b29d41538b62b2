//! qwen3moe family plugin (being written).
