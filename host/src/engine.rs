//! Model sessions: the KV cache, the position, and the forward step that
//! runs the plugin's graph over a chunk of tokens.
//!
//! [`Engine`] is one sequence on the CPU (the CLI). [`BatchEngine`] holds a
//! pool of sequences on any backend ([`SeqBackend`]: the CPU's or a GPU's),
//! each with its own KV cache, and runs rows of several of them in one
//! forward step, so the weights (a MoE's experts above all) are read once
//! per step for everyone. A row's logits do not depend on the other rows of
//! its step: batched and alone give the same bits.

use crate::cpu::{CpuBackend, CpuStep, ExpertSource, Named, SeqState, Snapshot};
use crate::model::Model;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("forward step failed: {0}")]
    Forward(String),
    #[error("context is full: {need} positions needed, --ctx is {n_ctx}")]
    ContextFull { need: usize, n_ctx: usize },
    #[error("empty token sequence")]
    Empty,
    #[error("sequence {0} is not allocated")]
    NoSuchSeq(u32),
    #[error("sequence {0} appears twice in one step")]
    DuplicateSeq(u32),
    #[error("the KV pool is full: sequence {seq} needs {need} more blocks of {block} positions and {free} are free (raise --kv-pool)")]
    KvFull { seq: u32, need: usize, free: usize, block: usize },
}

/// A step of `n` tokens after `n_past` cached ones: refused when empty or
/// past the context.
pub(crate) fn check_room(n: usize, n_past: usize, n_ctx: usize) -> Result<(), EngineError> {
    if n == 0 {
        return Err(EngineError::Empty);
    }
    if n_past + n > n_ctx {
        return Err(EngineError::ContextFull { need: n_past + n, n_ctx });
    }
    Ok(())
}

pub struct Engine<'m> {
    pub model: &'m Model,
    pub cpu: &'m CpuBackend,
    pub experts: &'m dyn ExpertSource,
    pub kv: SeqState,
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
        Engine { model, cpu, experts, kv: SeqState::new(&model.plan, n_ctx, model.kv_type), n_past: 0, ubatch: 256, capture: None, history: Vec::new() }
    }

    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx()
    }

    /// Forget the cache (positions restart at 0).
    pub fn reset(&mut self) {
        self.n_past = 0;
        self.history.clear();
    }

    /// Keep the first `n` cached positions and drop the rest. A family with
    /// recurrent state cannot go back without a snapshot: it restarts at 0.
    /// Returns the positions kept.
    pub fn truncate(&mut self, n: usize) -> usize {
        self.n_past = self.kv.keepable(n, self.n_past);
        self.history.truncate(self.n_past);
        self.n_past
    }

    /// The sequence's state now, to [`Engine::restore`] later (speculative
    /// decoding: run draft tokens, then go back).
    pub fn snapshot(&self) -> Snapshot {
        self.kv.snapshot(self.n_past)
    }

    /// Go back to `snap` (taken from this engine at or before now).
    pub fn restore(&mut self, snap: &Snapshot) -> Result<(), EngineError> {
        if snap.n_past > self.n_past {
            return Err(EngineError::Forward(format!("a snapshot at position {} is ahead of the sequence ({})", snap.n_past, self.n_past)));
        }
        self.n_past = self.kv.restore(snap).map_err(EngineError::Forward)?;
        self.history.truncate(self.n_past);
        Ok(())
    }

    /// Run `tokens` after the cached ones. Returns the logits of every token
    /// (`all`) or of the last only, one `Vec` per row.
    pub fn forward(&mut self, tokens: &[u32], all: bool) -> Result<Vec<Vec<f32>>, EngineError> {
        check_room(tokens.len(), self.n_past, self.n_ctx())?;
        let mut out = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(self.ubatch.max(1)).collect();
        let last_chunk = chunks.len() - 1;
        for (ci, chunk) in chunks.into_iter().enumerate() {
            let positions: Vec<u32> = (self.n_past..self.n_past + chunk.len()).map(|p| p as u32).collect();
            let mut step = CpuStep::new(self.model, self.cpu, &mut self.kv, self.experts, chunk, &positions, all);
            if let Some(c) = self.capture.as_mut() {
                step.capture = Some(c);
            }
            let m = step.run(self.model.steps.for_tokens(chunk.len())).map_err(EngineError::Forward)?;
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

/// A sequence slot of a [`BatchEngine`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

/// One sequence's part of a batched step: `tokens` follow its cached ones.
#[derive(Clone, Copy, Debug)]
pub struct BatchItem<'t> {
    pub seq: SeqId,
    pub tokens: &'t [u32],
}

/// What a [`BatchEngine`] needs of a backend: a state (KV cache, recurrent
/// states) per sequence slot, and one forward step over rows of several.
/// The slots, prefix reuse and checkpoints are the engine's, the same on
/// every backend.
pub trait SeqBackend {
    /// One sequence's cache and states.
    type State;
    /// A state's recurrent parts at one position (to go back to).
    type Snap;
    fn new_state(&mut self, n_ctx: usize) -> Result<Self::State, EngineError>;
    /// Bytes of memory `s` holds now.
    fn state_bytes(s: &Self::State) -> usize;
    /// How many of `have` cached positions can stay when only the first
    /// `want` are wanted, without a snapshot.
    fn keepable(s: &Self::State, want: usize, have: usize) -> usize;
    /// Whether `s` can go back only through a snapshot.
    fn has_recurrent(s: &Self::State) -> bool;
    fn snapshot(&self, s: &Self::State, n_past: usize) -> Result<Self::Snap, EngineError>;
    fn snap_pos(snap: &Self::Snap) -> usize;
    fn restore(&self, s: &mut Self::State, snap: &Self::Snap) -> Result<(), EngineError>;
    /// Copy the first `n` cached positions of `from` into `to` (states
    /// without a recurrent part: [`SeqBackend::has_recurrent`] false).
    fn copy_prefix(&self, to: &mut Self::State, from: &Self::State, n: usize) -> Result<(), EngineError>;
    /// Whether rows of several sequences may share a step (else the engine
    /// runs one sequence a step).
    fn batches(&self) -> bool;
    /// `s` now holds KV blocks for its first `positions` (more as it grows,
    /// fewer when cut, none when evicted): back them with memory, and give
    /// back what lies past them, where the backend can.
    fn fit(&mut self, s: &mut Self::State, positions: usize) -> Result<(), EngineError> {
        let _ = (s, positions);
        Ok(())
    }
    /// One forward step: row `i` (`tokens[i]` at `positions[i]`) reads and
    /// extends `states[seqs[i]]`; a sequence's rows are contiguous and in
    /// position order. Returns the logits of the last row of each sequence.
    fn step(&mut self, states: &mut [Self::State], seqs: &[u32], tokens: &[u32], positions: &[u32]) -> Result<Vec<Vec<f32>>, EngineError>;
}

/// The CPU backend's sequences: [`SeqState`]s and [`CpuStep::batched`].
pub struct CpuSeqs<'m> {
    pub model: &'m Model,
    pub cpu: &'m CpuBackend,
    pub experts: &'m dyn ExpertSource,
}

impl SeqBackend for CpuSeqs<'_> {
    type State = SeqState;
    type Snap = Snapshot;
    fn new_state(&mut self, n_ctx: usize) -> Result<SeqState, EngineError> {
        Ok(SeqState::new(&self.model.plan, n_ctx, self.model.kv_type))
    }
    fn state_bytes(s: &SeqState) -> usize {
        s.bytes()
    }
    fn keepable(s: &SeqState, want: usize, have: usize) -> usize {
        s.keepable(want, have)
    }
    fn has_recurrent(s: &SeqState) -> bool {
        s.has_recurrent()
    }
    fn snapshot(&self, s: &SeqState, n_past: usize) -> Result<Snapshot, EngineError> {
        Ok(s.snapshot(n_past))
    }
    fn snap_pos(snap: &Snapshot) -> usize {
        snap.n_past
    }
    fn restore(&self, s: &mut SeqState, snap: &Snapshot) -> Result<(), EngineError> {
        s.restore(snap).map(|_| ()).map_err(EngineError::Forward)
    }
    fn copy_prefix(&self, to: &mut SeqState, from: &SeqState, n: usize) -> Result<(), EngineError> {
        to.copy_prefix(from, n).map_err(EngineError::Forward)
    }
    fn fit(&mut self, s: &mut SeqState, positions: usize) -> Result<(), EngineError> {
        // The buffers are mapped lazily: only an evicted cache has memory to give back.
        if positions == 0 {
            s.release();
        }
        Ok(())
    }
    fn batches(&self) -> bool {
        // A graph that reads a sequence's whole cache (an attention composed
        // over `C`, minimax-m3's and qwen4exp's) runs one sequence a step.
        let reads_cache = |p: &crate::graph::StepPlan| p.shapes.iter().any(|s| s.dims.contains(&pulsar_plugin_api::Dim::C));
        !(reads_cache(&self.model.steps.decode) || reads_cache(&self.model.steps.prefill))
    }
    fn step(&mut self, states: &mut [SeqState], seqs: &[u32], tokens: &[u32], positions: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut step = CpuStep::batched(self.model, self.cpu, states, seqs, self.experts, tokens, positions, false);
        let m = step.run(self.model.steps.for_tokens(tokens.len())).map_err(EngineError::Forward)?;
        Ok(m.data.chunks(m.cols.max(1)).map(|r| r.to_vec()).collect())
    }
}

struct Slot<S> {
    in_use: bool,
    /// The tokens in the slot's cache, in order (kept after `free` for prefix reuse).
    history: Vec<u32>,
    /// Step counter when last used (least recently used slots are reused first).
    last_used: u64,
    /// Families with a recurrent state: the state at the end of the slot's
    /// last multi-token step (a prompt), the one point short of the history's
    /// end it can go back to.
    checkpoint: Option<S>,
    /// KV blocks this slot's cache holds (of [`KV_BLOCK`] positions): enough
    /// for its history, taken as it grows and given back when it is cut or
    /// evicted.
    blocks: usize,
}

/// Positions per KV block: the unit the pool hands out. Small enough that a
/// short request holds little more than it uses.
pub const KV_BLOCK: usize = 16;

fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(KV_BLOCK)
}

/// Where a [`BatchEngine`]'s KV pool stands, in blocks of `block` positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct KvUsage {
    pub block: usize,
    pub total: usize,
    /// Held by running sequences.
    pub used: usize,
    /// Held by free slots' caches (kept for prefix reuse, evicted first
    /// when a running sequence needs room).
    pub cached: usize,
}

/// Several sequences over one model, each with its own KV cache, decoded
/// together in batched steps, on the CPU ([`CpuSeqs`], the default) or a
/// GPU (`crate::cuda::CudaSeqs`).
///
/// The caches draw blocks of [`KV_BLOCK`] positions from one pool as they
/// grow, so a pool smaller than every slot at full context serves many
/// short sequences: a step that needs a block evicts free slots' cached
/// prefixes (least recently used first) and, when none is left, fails with
/// [`EngineError::KvFull`] naming the sequence (the server then pauses
/// that sequence until room comes back).
pub struct BatchEngine<B: SeqBackend> {
    backend: B,
    states: Vec<B::State>,
    slots: Vec<Slot<B::Snap>>,
    n_ctx: usize,
    clock: u64,
    /// Blocks in the pool.
    pool: usize,
}

impl<'m> BatchEngine<CpuSeqs<'m>> {
    /// A pool of `n_seq` sequences of `n_ctx` positions each on the CPU (caches allocated now).
    pub fn new(model: &'m Model, cpu: &'m CpuBackend, experts: &'m dyn ExpertSource, n_ctx: usize, n_seq: usize) -> BatchEngine<CpuSeqs<'m>> {
        match BatchEngine::with_backend(CpuSeqs { model, cpu, experts }, n_ctx, n_seq) {
            Ok(e) => e,
            // CpuSeqs::new_state cannot fail.
            Err(e) => unreachable!("{e}"),
        }
    }
}

impl<B: SeqBackend> BatchEngine<B> {
    /// A pool of `n_seq` sequences of `n_ctx` positions each on `backend`
    /// (caches allocated now).
    pub fn with_backend(mut backend: B, n_ctx: usize, n_seq: usize) -> Result<BatchEngine<B>, EngineError> {
        let n_seq = n_seq.max(1);
        let states = (0..n_seq).map(|_| backend.new_state(n_ctx)).collect::<Result<Vec<_>, _>>()?;
        let slots = (0..n_seq).map(|_| Slot { in_use: false, history: Vec::new(), last_used: 0, checkpoint: None, blocks: 0 }).collect();
        Ok(BatchEngine { backend, states, slots, n_ctx, clock: 0, pool: n_seq * blocks_for(n_ctx) })
    }

    /// Limit the KV pool to `positions` (rounded down to whole blocks; never
    /// below one full context, so any single sequence can always run; never
    /// above every slot at full context).
    pub fn with_kv_pool(mut self, positions: usize) -> BatchEngine<B> {
        self.pool = (positions / KV_BLOCK).clamp(blocks_for(self.n_ctx), self.slots.len() * blocks_for(self.n_ctx));
        self
    }

    /// The pool's blocks: total, held by running sequences, held by free slots' caches.
    pub fn kv_usage(&self) -> KvUsage {
        let held = |busy: bool| self.slots.iter().filter(|s| s.in_use == busy).map(|s| s.blocks).sum();
        KvUsage { block: KV_BLOCK, total: self.pool, used: held(true), cached: held(false) }
    }

    /// Whether a prompt of `n` positions can start now: its blocks are free
    /// or held only by free slots' caches.
    pub fn has_room_for(&self, n: usize) -> bool {
        blocks_for(n) <= self.pool - self.kv_usage().used
    }

    /// Give slot `i`'s blocks past its first `keep` positions back.
    fn trim_blocks(&mut self, i: usize, keep: usize) {
        let blocks = self.slots[i].blocks.min(blocks_for(keep));
        if blocks < self.slots[i].blocks {
            self.slots[i].blocks = blocks;
            // Giving memory back cannot fail short of a broken device; then
            // the memory stays with the slot (the pool's count is still right).
            if let Err(e) = self.backend.fit(&mut self.states[i], blocks * KV_BLOCK) {
                tracing::warn!("kv pool: slot {i} kept memory past {} positions: {e}", blocks * KV_BLOCK);
            }
        }
    }

    /// Drop free slot `i`'s cache and give its blocks back.
    fn evict(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        if slot.blocks > 0 {
            tracing::debug!("kv pool: evicting free slot {i}'s {} cached positions", slot.history.len());
        }
        slot.history.clear();
        slot.checkpoint = None;
        self.trim_blocks(i, 0);
    }

    /// Make slot `i` hold blocks for `positions`, evicting free slots'
    /// caches (least recently used first) when the pool is short.
    fn reserve(&mut self, i: usize, positions: usize) -> Result<(), EngineError> {
        let need = blocks_for(positions).saturating_sub(self.slots[i].blocks);
        if need == 0 {
            return Ok(());
        }
        let free = |e: &Self| e.pool - e.slots.iter().map(|s| s.blocks).sum::<usize>();
        while free(self) < need {
            let victim = (0..self.slots.len()).filter(|&j| j != i && !self.slots[j].in_use && self.slots[j].blocks > 0).min_by_key(|&j| self.slots[j].last_used);
            match victim {
                Some(j) => self.evict(j),
                None => return Err(EngineError::KvFull { seq: i as u32, need, free: free(self), block: KV_BLOCK }),
            }
        }
        let blocks = self.slots[i].blocks + need;
        self.backend.fit(&mut self.states[i], blocks * KV_BLOCK)?;
        self.slots[i].blocks = blocks;
        Ok(())
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn n_seq(&self) -> usize {
        self.slots.len()
    }

    pub fn n_free(&self) -> usize {
        self.slots.iter().filter(|s| !s.in_use).count()
    }

    /// Bytes of memory all caches hold now (paged caches: what is mapped).
    pub fn kv_bytes(&self) -> usize {
        self.states.iter().map(B::state_bytes).sum()
    }

    /// Take a free slot for a sequence that starts with `prompt`: the one whose
    /// cached history shares the longest prefix with it (that prefix is kept,
    /// the rest dropped), else the least recently used. Returns the slot and
    /// how many leading prompt tokens are already cached (always fewer than
    /// the prompt's length, so the last token runs and gives logits).
    pub fn alloc(&mut self, prompt: &[u32]) -> Option<(SeqId, usize)> {
        let common = |h: &[u32]| h.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len().saturating_sub(1));
        let best = (0..self.slots.len())
            .filter(|&i| !self.slots[i].in_use)
            // Longest reusable prefix first; among equals, the least recently used.
            .max_by_key(|&i| (self.reusable(i, common(&self.slots[i].history)), std::cmp::Reverse(self.slots[i].last_used)))?;
        self.slots[best].in_use = true;
        let mut keep = self.go_back(best, common(&self.slots[best].history));
        // A longer prefix cached in a sequence still running (requests that
        // share a system prompt arriving together): copy its rows instead
        // of computing them again. Recurrent states hold no prefix to copy.
        if !B::has_recurrent(&self.states[best]) {
            let donor = (0..self.slots.len()).filter(|&i| self.slots[i].in_use).map(|i| (common(&self.slots[i].history), i)).max();
            // Room for the copy comes from the pool like any growth; without it, compute.
            if let Some((n, from)) = donor.filter(|&(n, _)| n > keep && self.reserve(best, n).is_ok()) {
                let (to_s, from_s) = if best < from {
                    let (a, b) = self.states.split_at_mut(from);
                    (&mut a[best], &b[0])
                } else {
                    let (a, b) = self.states.split_at_mut(best);
                    (&mut b[0], &a[from])
                };
                if self.backend.copy_prefix(to_s, from_s, n).is_ok() {
                    self.slots[best].history = prompt[..n].to_vec();
                    self.slots[best].checkpoint = None;
                    keep = n;
                }
                self.trim_blocks(best, keep);
            }
        }
        let slot = &mut self.slots[best];
        self.clock += 1;
        slot.last_used = self.clock;
        Some((SeqId(best as u32), keep))
    }

    /// How many of slot `i`'s cached positions can stay when the first `want`
    /// are wanted: all `want` unless a recurrent state would have to go back,
    /// then its checkpoint's position when that is within `want`, else 0.
    fn reusable(&self, i: usize, want: usize) -> usize {
        let have = self.slots[i].history.len();
        match B::keepable(&self.states[i], want, have) {
            k if k < want.min(have) => self.slots[i].checkpoint.as_ref().map(B::snap_pos).filter(|&n| n <= want).unwrap_or(k),
            k => k,
        }
    }

    /// Keep [`BatchEngine::reusable`] positions of slot `i` (restoring its
    /// checkpoint when that is the way back); returns how many.
    fn go_back(&mut self, i: usize, want: usize) -> usize {
        let (keep, plain) = (self.reusable(i, want), B::keepable(&self.states[i], want, self.slots[i].history.len()));
        let slot = &mut self.slots[i];
        if keep != plain {
            // The checkpoint is the way back.
            if let Some(c) = &slot.checkpoint {
                // Only fails for a snapshot of another model's states (or a
                // device error): then restart.
                if self.backend.restore(&mut self.states[i], c).is_err() {
                    slot.history.clear();
                    slot.checkpoint = None;
                    return 0;
                }
            }
        }
        slot.history.truncate(keep);
        if slot.checkpoint.as_ref().is_some_and(|c| B::snap_pos(c) > keep) {
            slot.checkpoint = None;
        }
        self.trim_blocks(i, keep);
        keep
    }

    /// Give a slot back; its cache and history stay for prefix reuse.
    pub fn free(&mut self, seq: SeqId) {
        if let Some(s) = self.slots.get_mut(seq.0 as usize) {
            s.in_use = false;
        }
    }

    /// Forget every free slot's cached history (the next allocations start
    /// cold) and give its blocks back.
    pub fn forget_free(&mut self) {
        for i in 0..self.slots.len() {
            if !self.slots[i].in_use {
                self.evict(i);
            }
        }
    }

    fn slot(&self, seq: SeqId) -> Result<&Slot<B::Snap>, EngineError> {
        self.slots.get(seq.0 as usize).filter(|s| s.in_use).ok_or(EngineError::NoSuchSeq(seq.0))
    }

    /// Tokens cached for `seq`.
    pub fn n_past(&self, seq: SeqId) -> Result<usize, EngineError> {
        Ok(self.slot(seq)?.history.len())
    }

    pub fn history(&self, seq: SeqId) -> Result<&[u32], EngineError> {
        Ok(&self.slot(seq)?.history)
    }

    /// Keep at most the first `n` cached positions of `seq` (fewer when a
    /// recurrent state cannot go back that far: its checkpoint, or none);
    /// returns how many stay.
    pub fn truncate(&mut self, seq: SeqId, n: usize) -> Result<usize, EngineError> {
        self.slot(seq)?;
        Ok(self.go_back(seq.0 as usize, n))
    }

    /// One forward step over every item's tokens (each after its sequence's
    /// cached ones). Returns, per item in order, the logits of its last token.
    pub fn step(&mut self, items: &[BatchItem<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        if items.is_empty() || items.iter().any(|it| it.tokens.is_empty()) {
            return Err(EngineError::Empty);
        }
        let mut seen = vec![false; self.slots.len()];
        let (mut tokens, mut positions, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
        for it in items {
            let n_past = self.slot(it.seq)?.history.len();
            let s = it.seq.0 as usize;
            if std::mem::replace(&mut seen[s], true) {
                return Err(EngineError::DuplicateSeq(it.seq.0));
            }
            if n_past + it.tokens.len() > self.n_ctx {
                return Err(EngineError::ContextFull { need: n_past + it.tokens.len(), n_ctx: self.n_ctx });
            }
            self.reserve(s, n_past + it.tokens.len())?;
            tokens.extend_from_slice(it.tokens);
            positions.extend((n_past..n_past + it.tokens.len()).map(|p| p as u32));
            seqs.extend(std::iter::repeat_n(it.seq.0, it.tokens.len()));
        }
        if items.len() > 1 && !self.backend.batches() {
            let mut out = Vec::with_capacity(items.len());
            for it in items {
                out.extend(self.step(std::slice::from_ref(it))?);
            }
            return Ok(out);
        }
        let rows = self.backend.step(&mut self.states, &seqs, &tokens, &positions)?;
        if rows.len() != items.len() {
            return Err(EngineError::Forward(format!("the step gave {} logit rows for {} sequences", rows.len(), items.len())));
        }
        self.clock += 1;
        for it in items {
            let i = it.seq.0 as usize;
            let slot = &mut self.slots[i];
            slot.history.extend_from_slice(it.tokens);
            slot.last_used = self.clock;
            if it.tokens.len() > 1 && B::has_recurrent(&self.states[i]) {
                // A prompt (or a chunk of one): the next request's render of
                // this turn may differ from the reply's tokens.
                slot.checkpoint = Some(self.backend.snapshot(&self.states[i], slot.history.len())?);
            }
        }
        Ok(rows)
    }
}

#[cfg(test)]
mod pool_tests {
    use super::*;

    /// A backend whose state is the tokens at each position and whose
    /// logits are `[n_past]`: enough to watch the engine's pool.
    struct Fake {
        released: usize,
    }

    impl SeqBackend for Fake {
        type State = Vec<u32>;
        type Snap = usize;
        fn new_state(&mut self, _: usize) -> Result<Vec<u32>, EngineError> {
            Ok(Vec::new())
        }
        fn state_bytes(_: &Vec<u32>) -> usize {
            0
        }
        fn keepable(_: &Vec<u32>, want: usize, have: usize) -> usize {
            want.min(have)
        }
        fn has_recurrent(_: &Vec<u32>) -> bool {
            false
        }
        fn snapshot(&self, _: &Vec<u32>, n: usize) -> Result<usize, EngineError> {
            Ok(n)
        }
        fn snap_pos(s: &usize) -> usize {
            *s
        }
        fn restore(&self, _: &mut Vec<u32>, _: &usize) -> Result<(), EngineError> {
            Ok(())
        }
        fn copy_prefix(&self, to: &mut Vec<u32>, from: &Vec<u32>, n: usize) -> Result<(), EngineError> {
            *to = from[..n].to_vec();
            Ok(())
        }
        fn batches(&self) -> bool {
            true
        }
        fn fit(&mut self, s: &mut Vec<u32>, positions: usize) -> Result<(), EngineError> {
            if positions == 0 {
                s.clear();
                self.released += 1;
            }
            Ok(())
        }
        fn step(&mut self, states: &mut [Vec<u32>], seqs: &[u32], tokens: &[u32], positions: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
            let mut out: Vec<Vec<f32>> = Vec::new();
            for (i, (&s, (&t, &p))) in seqs.iter().zip(tokens.iter().zip(positions)).enumerate() {
                let st = &mut states[s as usize];
                st.truncate(p as usize);
                st.push(t);
                if i + 1 == seqs.len() || seqs[i + 1] != s {
                    out.push(vec![st.len() as f32]);
                }
            }
            Ok(out)
        }
    }

    fn engine(n_ctx: usize, n_seq: usize, pool: usize) -> BatchEngine<Fake> {
        BatchEngine::with_backend(Fake { released: 0 }, n_ctx, n_seq).unwrap().with_kv_pool(pool)
    }

    fn run(e: &mut BatchEngine<Fake>, seq: SeqId, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        e.step(&[BatchItem { seq, tokens }])
    }

    #[test]
    fn blocks_follow_the_history_and_a_freed_cache_counts_as_cached() {
        let mut e = engine(64, 2, 1 << 20);
        assert_eq!(e.kv_usage(), KvUsage { block: KV_BLOCK, total: 8, used: 0, cached: 0 }, "the pool is clamped to every slot at full context");
        let (a, _) = e.alloc(&[1; 20]).unwrap();
        run(&mut e, a, &[1; 20]).unwrap();
        assert_eq!(e.kv_usage().used, 2, "20 positions hold two blocks of 16");
        for _ in 0..12 {
            run(&mut e, a, &[2]).unwrap();
        }
        assert_eq!(e.kv_usage().used, 2, "32 positions still two");
        run(&mut e, a, &[3]).unwrap();
        assert_eq!(e.kv_usage().used, 3);
        e.truncate(a, 5).unwrap();
        assert_eq!(e.kv_usage().used, 1, "cutting the history gives its blocks back");
        e.free(a);
        assert_eq!((e.kv_usage().used, e.kv_usage().cached), (0, 1), "a freed slot's cache is kept, as cached");
        e.forget_free();
        assert_eq!((e.kv_usage().used, e.kv_usage().cached), (0, 0));
        assert_eq!(e.backend().released, 1, "the used slot gives its memory back (the other held none)");
    }

    #[test]
    fn a_step_evicts_the_least_recently_used_free_cache_then_reports_the_pool_full() {
        // Four slots of 64 positions sharing 80 positions (5 blocks).
        let mut e = engine(64, 4, 80);
        assert_eq!(e.kv_usage().total, 5, "never above nor below what was asked when that holds one context");
        let (a, _) = e.alloc(&[7; 16]).unwrap();
        run(&mut e, a, &[7; 16]).unwrap();
        e.free(a);
        let (b, _) = e.alloc(&[8; 16]).unwrap();
        run(&mut e, b, &[8; 16]).unwrap();
        e.free(b);
        assert_eq!(e.kv_usage().cached, 2);
        // A long prompt needs 4 blocks: 3 free, then `a`'s (the older) goes.
        let (c, cached) = e.alloc(&[9; 60]).unwrap();
        assert_eq!(cached, 0);
        assert!(e.has_room_for(60));
        run(&mut e, c, &[9; 60]).unwrap();
        assert_eq!(e.kv_usage(), KvUsage { block: KV_BLOCK, total: 5, used: 4, cached: 1 });
        let (b2, cached) = e.alloc(&[8; 17]).unwrap();
        assert_eq!((b2, cached), (b, 16), "the newer cache survived and is reused");
        assert!(!e.has_room_for(33), "one block is all the room left");
        match run(&mut e, b2, &[8; 17]) {
            Err(EngineError::KvFull { seq, need, free, block }) => assert_eq!((seq, need, free, block), (b.0, 2, 0, KV_BLOCK)),
            r => panic!("expected KvFull, got {r:?}"),
        }
        // Once `c` is done, its blocks make room.
        e.free(c);
        assert_eq!(run(&mut e, b2, &[8]).unwrap(), vec![vec![17.0]]);
        assert_eq!(e.kv_usage().used, 2);
    }

    #[test]
    fn a_copied_prefix_takes_blocks_and_falls_back_to_computing_without_them() {
        let mut e = engine(64, 2, 64);
        let (a, _) = e.alloc(&[5; 40]).unwrap();
        run(&mut e, a, &[5; 40]).unwrap();
        // 64 positions: 3 blocks held by `a`, 1 free; copying 40 needs 3.
        let (b, cached) = e.alloc(&[5; 50]).unwrap();
        assert_eq!(cached, 0, "no room to copy: the prefix is computed");
        assert_eq!(e.kv_usage().used, 3);
        e.free(b);
        e.free(a);
        let mut e = engine(64, 2, 128);
        let (a, _) = e.alloc(&[5; 40]).unwrap();
        run(&mut e, a, &[5; 40]).unwrap();
        let (_, cached) = e.alloc(&[5; 50]).unwrap();
        assert_eq!(cached, 40);
        assert_eq!(e.kv_usage().used, 6);
    }
}
