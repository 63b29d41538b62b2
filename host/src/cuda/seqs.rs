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
}

impl<'m> CudaSeqs<'m> {
    pub fn new(model: &'m Model, cm: &'m CudaModel, store: Option<&'m StoreExperts>) -> Result<CudaSeqs<'m>, EngineError> {
        let run = CudaRunner::new(model, cm).map_err(|e| EngineError::Forward(e.to_string()))?.with_store(store);
        Ok(CudaSeqs { run, max_rows: cm.max_chunk })
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
        CudaKv::new(&self.run.cm.dev, self.run.model, n_ctx).map_err(|e| EngineError::Forward(format!("allocating a sequence's cache of {n_ctx} positions: {e}")))
    }
    fn state_bytes(s: &CudaKv) -> usize {
        s.bytes()
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
