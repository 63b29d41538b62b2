//! The Pulsar host runtime: model loading through family plugins, the CPU
//! backend, tokenization, chat templates, sampling and the `pulsar-host`
//! subcommands.

pub mod chat;
pub mod cli;
pub mod cold;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod experts;
pub mod graph;
pub mod model;
pub mod npy;
pub mod opcheck;
pub mod progress;
pub mod sample;
pub mod server;
pub mod session;
pub mod synth;
pub mod tok;
