//! What the CLI drives, whichever backend runs it.

use crate::cuda::CudaEngine;
use crate::engine::{Engine, EngineError};

/// A single-sequence model session: a KV cache and a position.
pub trait Session {
    /// Run `tokens` after the cached ones; logits of every row (`all`) or the last.
    fn forward(&mut self, tokens: &[u32], all: bool) -> Result<Vec<Vec<f32>>, EngineError>;
    fn reset(&mut self);
    /// Keep at most the first `n` cached positions; returns how many stay
    /// (fewer when the state cannot go back, e.g. a recurrent one).
    fn truncate(&mut self, n: usize) -> usize;
    fn n_past(&self) -> usize;
    fn n_ctx(&self) -> usize;
    fn history(&self) -> &[u32];
    fn set_ubatch(&mut self, n: usize);
    /// The per-op GPU time table, when the session profiles its ops.
    fn op_profile(&self) -> Option<String> {
        None
    }
}

impl Session for Engine<'_> {
    fn forward(&mut self, tokens: &[u32], all: bool) -> Result<Vec<Vec<f32>>, EngineError> {
        Engine::forward(self, tokens, all)
    }
    fn reset(&mut self) {
        Engine::reset(self)
    }
    fn truncate(&mut self, n: usize) -> usize {
        Engine::truncate(self, n)
    }
    fn n_past(&self) -> usize {
        self.n_past
    }
    fn n_ctx(&self) -> usize {
        Engine::n_ctx(self)
    }
    fn history(&self) -> &[u32] {
        &self.history
    }
    fn set_ubatch(&mut self, n: usize) {
        self.ubatch = n.max(1);
    }
}

impl Session for CudaEngine<'_> {
    fn forward(&mut self, tokens: &[u32], all: bool) -> Result<Vec<Vec<f32>>, EngineError> {
        CudaEngine::forward(self, tokens, all)
    }
    fn reset(&mut self) {
        CudaEngine::reset(self)
    }
    fn truncate(&mut self, n: usize) -> usize {
        CudaEngine::truncate(self, n);
        self.n_past
    }
    fn n_past(&self) -> usize {
        self.n_past
    }
    fn n_ctx(&self) -> usize {
        CudaEngine::n_ctx(self)
    }
    fn history(&self) -> &[u32] {
        &self.history
    }
    fn set_ubatch(&mut self, n: usize) {
        self.ubatch = n.max(1);
    }
    fn op_profile(&self) -> Option<String> {
        self.profile_report()
    }
}

/// Which device a run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(DeviceChoice::Cuda(n)),
                _ => Err(format!("unknown device `{s}` (cpu, cuda, cuda:N, auto)")),
            },
        }
    }
}

/// Open the CUDA device the choice asks for; `Ok(None)` means the CPU.
/// `auto` falls back to the CPU with one notice when no driver or GPU is there.
pub fn open_device(choice: DeviceChoice) -> anyhow::Result<Option<pulsar_cuda::CudaDevice>> {
    match choice {
        DeviceChoice::Cpu => Ok(None),
        DeviceChoice::Cuda(n) => Ok(Some(pulsar_cuda::CudaDevice::open(n)?)),
        DeviceChoice::Auto => {
            if !pulsar_cuda::CudaDevice::available() {
                eprintln!("note: no CUDA driver or GPU found; running on the CPU");
                return Ok(None);
            }
            match pulsar_cuda::CudaDevice::open(0) {
                Ok(d) => Ok(Some(d)),
                Err(e) => {
                    eprintln!("note: CUDA unavailable ({e}); running on the CPU");
                    Ok(None)
                }
            }
        }
    }
}
