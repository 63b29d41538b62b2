//! A model session on the CPU backend: the KV cache, the position, and the
//! forward step that runs the plugin's graph over a chunk of tokens.

use abi_stable::sabi_trait::TD_Opaque;
use pulsar_plugin_api::Ops_TO;

use crate::cpu::{CpuBackend, CpuStep, ExpertSource, KvCache, Named};
use crate::model::Model;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("forward step failed: {0}")]
    Forward(String),
    #[error("context is full: {need} positions needed, --ctx is {n_ctx}")]
    ContextFull { need: usize, n_ctx: usize },
    #[error("empty token sequence")]
    Empty,
}

pub struct Engine<'m> {
    pub model: &'m Model,
    pub cpu: &'m CpuBackend,
    pub experts: &'m dyn ExpertSource,
    pub kv: KvCache,
    /// Tokens already in the cache.
    pub n_past: usize,
    /// Largest chunk a prefill runs at once.
    pub ubatch: usize,
    /// Capture named intermediates of every step (for dumps); costs copies.
    pub capture: Option<Vec<Named>>,
    /// The tokens in the cache, in order (for prefix reuse across chat turns).
    pub history: Vec<u32>,
}

impl<'m> Engine<'m> {
    pub fn new(model: &'m Model, cpu: &'m CpuBackend, experts: &'m dyn ExpertSource, n_ctx: usize) -> Engine<'m> {
        Engine { model, cpu, experts, kv: KvCache::new(&model.plan, n_ctx), n_past: 0, ubatch: 256, capture: None, history: Vec::new() }
    }

    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx()
    }

    /// Forget the cache (positions restart at 0).
    pub fn reset(&mut self) {
        self.n_past = 0;
        self.history.clear();
    }

    /// Keep the first `n` cached positions and drop the rest.
    pub fn truncate(&mut self, n: usize) {
        self.n_past = self.n_past.min(n);
        self.history.truncate(self.n_past);
    }

    /// Run `tokens` after the cached ones. Returns the logits of every token
    /// (`all`) or of the last only, one `Vec` per row.
    pub fn forward(&mut self, tokens: &[u32], all: bool) -> Result<Vec<Vec<f32>>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::Empty);
        }
        if self.n_past + tokens.len() > self.n_ctx() {
            return Err(EngineError::ContextFull { need: self.n_past + tokens.len(), n_ctx: self.n_ctx() });
        }
        let mut out = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(self.ubatch.max(1)).collect();
        let last_chunk = chunks.len() - 1;
        for (ci, chunk) in chunks.into_iter().enumerate() {
            let positions: Vec<u32> = (self.n_past..self.n_past + chunk.len()).map(|p| p as u32).collect();
            let mut step = CpuStep::new(self.model, self.cpu, &mut self.kv, self.experts, chunk, &positions, all);
            if let Some(c) = self.capture.as_mut() {
                step.capture = Some(c);
            }
            let r = self.model.family.forward(Ops_TO::from_ptr(&mut step, TD_Opaque)).into_result();
            let logits = r.map_err(|e| EngineError::Forward(e.into_string()))?;
            let m = step.take(logits).map_err(EngineError::Forward)?;
            self.n_past += chunk.len();
            self.history.extend_from_slice(chunk);
            if all || ci == last_chunk {
                let rows: Vec<Vec<f32>> = m.data.chunks(m.cols.max(1)).map(|r| r.to_vec()).collect();
                if all {
                    out.extend(rows);
                } else if let Some(last) = rows.into_iter().last() {
                    out.push(last);
                }
            }
        }
        Ok(out)
    }
}
