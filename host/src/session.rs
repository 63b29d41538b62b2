//! What the CLI drives, whichever backend runs it.

use crate::cpu::Snapshot;
use crate::cuda::{CudaEngine, CudaSnapshot};
use crate::engine::{Engine, EngineError};

/// A session's state at one position (its recurrent states and where it
/// was), to go back to: for a family with a recurrent state, the only way to
/// reuse a prefix shorter than the history.
pub enum Checkpoint {
    Cpu(Snapshot),
    Cuda(CudaSnapshot),
}

impl Checkpoint {
    pub fn n_past(&self) -> usize {
        match self {
            Checkpoint::Cpu(s) => s.n_past,
            Checkpoint::Cuda(s) => s.n_past,
        }
    }
}

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
    /// Whether the state can go back only through a [`Checkpoint`].
    fn has_recurrent(&self) -> bool;
    /// The state now, to [`Session::rewind`] to later.
    fn checkpoint(&self) -> Result<Checkpoint, EngineError>;
    /// Go back to `c`, taken from this session at or before now.
    fn rewind(&mut self, c: &Checkpoint) -> Result<(), EngineError>;
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
    fn has_recurrent(&self) -> bool {
        self.kv.has_recurrent()
    }
    fn checkpoint(&self) -> Result<Checkpoint, EngineError> {
        Ok(Checkpoint::Cpu(self.snapshot()))
    }
    fn rewind(&mut self, c: &Checkpoint) -> Result<(), EngineError> {
        match c {
            Checkpoint::Cpu(s) => self.restore(s),
            Checkpoint::Cuda(_) => Err(EngineError::Forward("a CUDA checkpoint cannot restore a CPU session".into())),
        }
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
    fn has_recurrent(&self) -> bool {
        !self.kv.recurrent.is_empty()
    }
    fn checkpoint(&self) -> Result<Checkpoint, EngineError> {
        Ok(Checkpoint::Cuda(self.snapshot()?))
    }
    fn rewind(&mut self, c: &Checkpoint) -> Result<(), EngineError> {
        match c {
            Checkpoint::Cuda(s) => self.restore(s),
            Checkpoint::Cpu(_) => Err(EngineError::Forward("a CPU checkpoint cannot restore a CUDA session".into())),
        }
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

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Auto => f.write_str("auto"),
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl<'de> serde::Deserialize<'de> for DeviceChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
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

/// Checkpoints a chat keeps for a family with a recurrent state (each is that
/// state's size: tens of MiB at a real geometry).
pub const CHAT_CHECKPOINTS: usize = 2;

/// Make `s` ready to run `ids` after as much of its cached history as can be
/// reused, and return how many leading tokens of `ids` are already in: the
/// shared prefix when the state can go back to it (no recurrent state, or the
/// whole history is shared), else the latest of `checkpoints` inside the
/// shared prefix, else none (a restart: never a wrong state). Checkpoints
/// past the point gone back to are dropped (they no longer match the history).
pub fn reuse_prefix(s: &mut dyn Session, ids: &[u32], checkpoints: &mut Vec<Checkpoint>) -> Result<usize, EngineError> {
    // At least the last token runs, so there are logits.
    let common = s.history().iter().zip(ids).take_while(|(x, y)| x == y).count().min(ids.len().saturating_sub(1));
    if !s.has_recurrent() || common == s.n_past() {
        return Ok(s.truncate(common));
    }
    checkpoints.retain(|c| c.n_past() <= common);
    match checkpoints.last() {
        Some(c) => {
            s.rewind(c)?;
            Ok(c.n_past())
        }
        None => {
            s.reset();
            Ok(0)
        }
    }
}
