//! Several sequences on one GPU for [`crate::engine::BatchEngine`] (the
//! server): a [`CudaKv`] per sequence slot and one [`CudaRunner`] whose
//! steps carry rows of all of them, so a decode step reads each layer's
//! weights and routed experts once for every sequence in it. Attention runs
//! each row over its own sequence's cache in the same launch
//! (`attention_rows`), so a row's logits have the bits they have alone.

use super::step::{CudaRunner, CudaSnapshot};
use super::{CudaKv, CudaModel};
use crate::engine::{EngineError, SeqBackend};
use crate::experts::StoreExperts;
use crate::model::Model;

pub struct CudaSeqs<'m> {
    run: CudaRunner<'m>,
    /// Largest chunk one step may run (the activation reserve's).
    max_rows: usize,
    /// Caches of at least this many pages take VRAM pages as they grow
    /// ([`CudaKv::new_paged`]) instead of their full context at once.
    paged: Option<usize>,
}

impl<'m> CudaSeqs<'m> {
    pub fn new(model: &'m Model, cm: &'m CudaModel, store: Option<&'m StoreExperts>) -> Result<CudaSeqs<'m>, EngineError> {
        let run = CudaRunner::new(model, cm).map_err(|e| EngineError::Forward(e.to_string()))?.with_store(store);
        Ok(CudaSeqs { run, max_rows: cm.max_chunk, paged: None })
    }

    /// Page the sequences' caches: each maps VRAM for the positions the
    /// engine's KV pool gives it (for `BatchEngine::with_kv_pool`).
    pub fn paged(self) -> CudaSeqs<'m> {
        self.paged_from(super::PAGED_MIN_PAGES)
    }

    /// As [`CudaSeqs::paged`] for caches of at least `min_pages` pages (0: all).
    pub fn paged_from(self, min_pages: usize) -> CudaSeqs<'m> {
        CudaSeqs { paged: Some(min_pages), ..self }
    }

    /// The most rows one step should carry (the prefill chunk the VRAM
    /// budget's activation reserve holds).
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    pub fn cm(&self) -> &'m CudaModel {
        self.run.cm
    }
}

impl SeqBackend for CudaSeqs<'_> {
    type State = CudaKv;
    type Snap = CudaSnapshot;
    fn new_state(&mut self, n_ctx: usize) -> Result<CudaKv, EngineError> {
        let (dev, model) = (&self.run.cm.dev, self.run.model);
        let kv = match self.paged {
            Some(min_pages) => CudaKv::new_paged(dev, model, n_ctx, min_pages),
            None => CudaKv::new(dev, model, n_ctx),
        };
        kv.map_err(|e| EngineError::Forward(format!("allocating a sequence's cache of {n_ctx} positions: {e}")))
    }
    fn fit(&mut self, s: &mut CudaKv, positions: usize) -> Result<(), EngineError> {
        s.back(positions).map_err(|e| EngineError::Forward(format!("mapping VRAM for {positions} cached positions: {e}")))
    }
    fn state_bytes(s: &CudaKv) -> usize {
        s.backed_bytes()
    }
    fn keepable(s: &CudaKv, want: usize, have: usize) -> usize {
        // A recurrent state cannot go back without a snapshot: a restart.
        if want >= have || s.recurrent.is_empty() {
            want.min(have)
        } else {
            0
        }
    }
    fn has_recurrent(s: &CudaKv) -> bool {
        !s.recurrent.is_empty()
    }
    fn snapshot(&self, s: &CudaKv, n_past: usize) -> Result<CudaSnapshot, EngineError> {
        s.snapshot(&self.run.cm.dev, n_past)
    }
    fn snap_pos(snap: &CudaSnapshot) -> usize {
        snap.n_past
    }
    fn restore(&self, s: &mut CudaKv, snap: &CudaSnapshot) -> Result<(), EngineError> {
        s.restore(&self.run.cm.dev, snap)
    }
    fn copy_prefix(&self, to: &mut CudaKv, from: &CudaKv, n: usize) -> Result<(), EngineError> {
        to.copy_prefix(&self.run.cm.dev, from, n)
    }
    fn batches(&self) -> bool {
        self.run.batches()
    }
    fn step(&mut self, states: &mut [CudaKv], seqs: &[u32], tokens: &[u32], positions: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.run.step(states, Some(seqs), tokens, positions, false).map_err(EngineError::Forward)
    }
}
