//! The expert pool's slot book: every decision about which slab lives in
//! which VRAM slot, with no device in sight.
//!
//! The pool's slots are `n_hot` hot-set slots followed by `n_scratch`
//! scratch slots. This book holds the [`HotSet`] (which slab owns which hot
//! slot), the current layer's admissions, the scratch window a step's cold
//! slabs take, the cross-layer prefetch's record of what is already in
//! scratch, and the moving average that says whether prefetching pays.
//! [`ExpertPool`](super::ExpertPool) owns the device side (the slot
//! allocation, the copy stream's events, page-locked staging, the pointer
//! tables' uploads) and carries out what the book decides.
//!
//! The split keeps the device's order of operations: a layer's fill asks
//! [`SlotBook::place`] for one slab at a time and issues that slab's device
//! work (a move, a head fix) before asking for the next, exactly as the one
//! loop before the split did; a prefetch asks [`SlotBook::ahead_slot`] per
//! slab the same way. Kept free of `CudaDevice`, the book's unit tests
//! (`slots/tests.rs`) run on machines with no GPU.

use std::collections::HashMap;

use pulsar_store::{Admission, Catalog, Census, HotSet, HotSetConfig, SlabId, SlabKind};

use super::super::CudaBackendError;
use super::PoolStats;

#[cfg(test)]
mod tests;

/// A slab copied ahead into a scratch slot: its first `head` bytes are absent
/// (a split expert's gate/up rows the CPU lane computes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Ahead {
    pub slot: usize,
    pub len: usize,
    pub head: usize,
}

/// What the CPU lane takes of one predicted expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneShare {
    /// All of it: nothing is copied.
    Whole,
    /// Gate and up rows `0..rows` (`bytes` of each slab): the rest of those
    /// slabs and all of down are copied.
    Head { rows: usize, bytes: usize },
}

/// One layer's slabs to serve: for each of gate/up/down, the kind and a
/// lookup of an expert's bytes.
pub struct LayerRequest<'a> {
    pub layer: u32,
    pub kinds: [SlabKind; 3],
    /// Distinct experts, ascending.
    pub experts: &'a [u32],
    /// Every (token, slot) selection's expert, for heat (repeats count).
    pub touched: &'a [u32],
    /// Cold experts (ascending) read in place from page-locked host memory
    /// (falls back to upload where their bytes are not page-locked).
    pub zero_copy: &'a [u32],
    /// Cold experts (ascending) the CPU lane serves: null pointers here.
    pub cpu: &'a [u32],
    /// Experts (ascending) whose gate/up heads the CPU lane computes this
    /// step, from [`ExpertPool::heads_ready`](super::ExpertPool::heads_ready):
    /// their slabs as prefetched.
    pub heads: &'a [u32],
    /// A decode step (one token): cold slabs use this layer's half of the
    /// scratch (the other half takes the next layer's prefetch); a prefill
    /// step uses all of it and drops any prefetch.
    pub decode: bool,
}

/// What a layer's step needs, from [`ExpertPool::plan_layer`](super::ExpertPool::plan_layer).
#[derive(Debug, Default)]
pub struct LayerPlan {
    /// Experts whose bytes the fill reads (admitted or cold slabs), ascending.
    pub need: Vec<u32>,
    /// Of those, experts with no slab in the hot set nor admitted: these may
    /// take any cold path.
    pub cold: Vec<u32>,
}

/// Where one slab of a layer's fill lives ([`SlotBook::place`]), and so what
/// the device must do for it. Its pointer-table entry is [`SlotBook::addr`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Place<'b> {
    /// The CPU lane serves it: a null pointer, nothing on the device.
    Lane,
    /// Resident in its hot-set slot.
    Hit { slot: usize },
    /// Just admitted to hot slot `slot`: its host bytes are to be copied there.
    Upload { slot: usize },
    /// Prefetched into scratch slot `from` and just admitted to hot slot
    /// `to`: moved device to device (`len` bytes), then `head` (the bytes the
    /// prefetch left out), if any, copied to the start of `to`.
    Move { from: usize, to: usize, len: usize, head: Option<&'b [u8]> },
    /// Prefetched into scratch slot `slot` and read there; `head` as for `Move`.
    Ahead { slot: usize, head: Option<&'b [u8]> },
    /// Read in place from page-locked host memory at device address `addr`.
    ZeroCopy { addr: u64 },
    /// Cold: its host bytes are to be copied to scratch slot `slot`.
    Scratch { slot: usize },
}

/// Where a prefetch puts one slab ([`SlotBook::ahead_slot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AheadSlot {
    /// Hot or already prefetched: nothing to copy.
    Skip,
    /// The window is full: stop prefetching.
    Full,
    /// Copy it into this scratch slot.
    Slot(usize),
}

/// The scratch slots a step's cold slabs may use: `cap` of them from
/// `base`, counted from the bottom or (`down`) from the top.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Window {
    base: usize,
    pub cap: usize,
    down: bool,
}

impl Window {
    /// The slot of the window's `i`-th slab.
    pub fn slot(&self, i: usize) -> usize {
        if self.down {
            self.base + self.cap - 1 - i
        } else {
            self.base + i
        }
    }
}

/// Bytes of a prefetched slab left out at its start: a split expert's head,
/// only in gate and up (kind indices 0 and 1), never more than the slab.
pub(super) fn head_len(ki: usize, head_bytes: usize, len: usize) -> usize {
    if ki < 2 {
        head_bytes.min(len)
    } else {
        0
    }
}

/// Which slab occupies which slot, decided on the host (see the module docs).
pub(super) struct SlotBook {
    slot_bytes: usize,
    n_hot: usize,
    n_scratch: usize,
    n_exp: usize,
    hot: HotSet,
    /// This run's expert selections, for the census sidecar.
    census: Census,
    /// The current layer's admissions (sorted), between plan and fill.
    admitted: Vec<SlabId>,
    /// The fill in progress: its window, and how many of its slots are taken.
    fill: Window,
    scratch_next: usize,
    /// Cross-layer prefetch: cold slabs of `pf_layer` already copied into
    /// its scratch window (slot, bytes), during the layer before.
    pf_enabled: bool,
    /// Moving average of the slabs a decode layer had to copy in: with few
    /// misses, predicting the next layer costs more than it hides.
    copied_per_layer: f64,
    pf_layer: Option<u32>,
    /// Whether `pf` was copied for a decode step (windows differ from prefill's).
    pf_decode: bool,
    pf: HashMap<SlabId, Ahead>,
    /// Predicted experts of `pf_layer` left to the CPU lane instead of
    /// prefetched (ascending): the lane serves them when they come.
    pf_lane: Vec<u32>,
    /// Predicted experts of `pf_layer` whose gate/up heads (rows `0..rows`)
    /// were left to the CPU lane: only their other rows and down were copied.
    pf_heads: Vec<(u32, usize)>,
}

impl SlotBook {
    /// `n_slots` slots of `slot_bytes`; `n_exp` experts per layer (the scratch
    /// part holds one layer's three slabs per expert at most, and at most
    /// half the slots).
    pub fn new(slot_bytes: usize, n_slots: usize, n_exp: usize, half_life_steps: f64) -> Result<SlotBook, CudaBackendError> {
        let n_scratch = (3 * n_exp).min(n_slots / 2);
        let n_hot = n_slots - n_scratch;
        if n_scratch == 0 {
            return Err(CudaBackendError::Other("the VRAM budget leaves no room for a single expert slab".into()));
        }
        let mut cfg = HotSetConfig::new(n_hot);
        cfg.half_life_steps = half_life_steps;
        Ok(SlotBook {
            slot_bytes,
            n_hot,
            n_scratch,
            n_exp,
            hot: HotSet::new(cfg),
            census: Census::new(),
            admitted: Vec::new(),
            fill: Window { base: n_hot, cap: 0, down: false },
            scratch_next: 0,
            pf_enabled: false,
            copied_per_layer: f64::INFINITY,
            pf_layer: None,
            pf_decode: false,
            pf: HashMap::new(),
            pf_lane: Vec::new(),
            pf_heads: Vec::new(),
        })
    }

    pub fn n_slots(&self) -> usize {
        self.n_hot + self.n_scratch
    }

    pub fn n_hot(&self) -> usize {
        self.n_hot
    }

    pub fn n_exp(&self) -> usize {
        self.n_exp
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slot `slot`'s device address, the slots starting at `base`.
    pub fn slot_addr(&self, base: u64, slot: usize) -> u64 {
        debug_assert!(slot < self.n_slots(), "slot {slot} of {}", self.n_slots());
        base + (slot * self.slot_bytes) as u64
    }

    /// The pointer-table entry of a slab placed at `p`, the slots starting
    /// at `base` (0, "not mine", for the CPU lane's).
    pub fn addr(&self, base: u64, p: Place<'_>) -> u64 {
        match p {
            Place::Lane => 0,
            Place::ZeroCopy { addr } => addr,
            Place::Hit { slot } | Place::Upload { slot } | Place::Scratch { slot } | Place::Ahead { slot, .. } | Place::Move { to: slot, .. } => self.slot_addr(base, slot),
        }
    }

    /// Let decode steps copy the next layer's predicted cold slabs ahead
    /// (only with page-locked memory to copy from, and only with room for
    /// two windows of a top-`top_k` step's slabs).
    pub fn enable_prefetch(&mut self, top_k: usize, has_pinned: bool) {
        self.pf_enabled = has_pinned && self.n_scratch / 2 >= 3 * top_k.max(1);
    }

    pub fn prefetch_enabled(&self) -> bool {
        self.pf_enabled
    }

    /// Whether predicting and copying the next layer ahead pays: prefetch is
    /// on and recent decode layers copied in at least two slabs each (on the
    /// H200 it cost 2-3 tok/s at 97% VRAM hits and gained 5-6 at 70%).
    // Kept as "not below" (not `>= 2.0`), as the pool always had it: the
    // two differ only for a NaN average, which leaves prefetch on.
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    pub fn prefetch_pays(&self) -> bool {
        self.pf_enabled && !(self.copied_per_layer < 2.0)
    }

    /// A decode layer's fill copied `copied` slabs in (uploads and prefetch
    /// hits): fold it into the moving average (the first sample replaces
    /// the initial infinity, which keeps prefetch on until measured).
    pub fn note_copied(&mut self, copied: f64) {
        self.copied_per_layer = if self.copied_per_layer.is_finite() { 0.9 * self.copied_per_layer + 0.1 * copied } else { copied };
    }

    /// The scratch slots a step's cold slabs may use. Decode with prefetch:
    /// one half per layer parity (the other takes the next layer's
    /// prefetch). Prefill: all of them, even layers from the bottom up, odd
    /// layers from the top down, so the next layer's prefetch fills from the
    /// far end while this layer's slabs are still being read.
    pub fn window(&self, decode: bool, layer: u32) -> Window {
        let (n_hot, n) = (self.n_hot, self.n_scratch);
        if decode && self.pf_enabled {
            let half = n / 2;
            Window { base: n_hot + (layer as usize % 2) * half, cap: half, down: false }
        } else {
            Window { base: n_hot, cap: n, down: layer % 2 == 1 }
        }
    }

    fn prefetched(&self, layer: u32, id: SlabId) -> Option<Ahead> {
        (self.pf_layer == Some(layer)).then(|| self.pf.get(&id).copied()).flatten()
    }

    /// Fill free hot slots with the hottest whole triples of `census`.
    pub fn warm_load(&mut self, catalog: &Catalog, census: &Census) -> Vec<Admission> {
        self.hot.warm_load(catalog, census)
    }

    /// The experts this run selected, per (layer, expert).
    pub fn census(&self) -> &Census {
        &self.census
    }

    /// The bookkeeping of a layer's plan: drop a prefetch made for another
    /// layer or step kind, record the touches (heat, census), take the hot
    /// set's admissions, and list the experts whose host bytes the fill
    /// needs (admitted or cold slabs; hits and prefetched slabs need none).
    pub fn plan_layer(&mut self, req: &LayerRequest<'_>, stats: &mut PoolStats) -> LayerPlan {
        if self.pf_layer != Some(req.layer) || self.pf_decode != req.decode {
            self.pf.clear();
            self.pf_lane.clear();
            self.pf_layer = None;
        }
        for &e in req.touched {
            self.census.record(req.layer, e, 1);
        }
        let touched: Vec<SlabId> = req
            .touched
            .iter()
            .flat_map(|&e| req.kinds.iter().map(move |&k| SlabId::new(req.layer, k, e)))
            .collect();
        self.admitted = self.hot.step(&touched).into_iter().map(|a| a.slab).collect();
        self.admitted.sort_unstable();
        let c = self.hot.counters();
        (stats.admissions, stats.evictions) = (c.admissions, c.evictions);
        let mut plan = LayerPlan::default();
        for &e in req.experts {
            let (mut any, mut all) = (false, true);
            for &k in &req.kinds {
                let id = SlabId::new(req.layer, k, e);
                let cold = self.hot.slot_of(id).is_none();
                // Prefetched slabs are on the device already (an admitted
                // one moves device to device): no host bytes needed. A head
                // left to the lane is on the device too unless admitted (it
                // then needs all its bytes).
                let ahead = self.prefetched(req.layer, id).is_some_and(|a| a.head == 0 || cold);
                any |= !ahead && (cold || self.admitted.binary_search(&id).is_ok());
                all &= cold && !ahead;
            }
            if any {
                plan.need.push(e);
            }
            if all {
                plan.cold.push(e);
            }
        }
        plan
    }

    /// The fill's passes over `req.experts` (ranges of it, in order), each
    /// taking at most the scratch the window has after this layer's
    /// prefetch: one pass unless the layer's cold slabs overflow it (a
    /// prefill chunk routed to more experts than the scratch holds). A slab
    /// takes a scratch slot when it is neither hot (admitted ones have a hot
    /// slot) nor prefetched. Call after [`plan_layer`](Self::plan_layer);
    /// an expert that alone does not fit is the fill's overflow error.
    pub fn passes(&mut self, req: &LayerRequest<'_>) -> Result<Vec<std::ops::Range<usize>>, CudaBackendError> {
        let with_pf = self.split(req, true);
        if with_pf.as_ref().is_ok_and(|p| p.len() == 1) || self.pf_layer != Some(req.layer) {
            return with_pf;
        }
        // The layer's prefetch holds scratch the passes need (a prefill
        // prefetch may take the whole window): drop it, its slabs are
        // copied again with their pass.
        self.pf.clear();
        self.pf_lane.clear();
        self.pf_heads.clear();
        self.pf_layer = None;
        self.split(req, false)
    }

    /// [`passes`](Self::passes) with (`with_pf`) or without this layer's prefetch.
    fn split(&self, req: &LayerRequest<'_>, with_pf: bool) -> Result<Vec<std::ops::Range<usize>>, CudaBackendError> {
        let pf = if with_pf && self.pf_layer == Some(req.layer) { self.pf.len() } else { 0 };
        let room = self.window(req.decode, req.layer).cap.saturating_sub(pf);
        let mut passes = Vec::new();
        let (mut start, mut used) = (0, 0);
        for (i, &e) in req.experts.iter().enumerate() {
            let need = req.kinds.iter().filter(|&&k| {
                let id = SlabId::new(req.layer, k, e);
                self.hot.slot_of(id).is_none() && !(with_pf && self.prefetched(req.layer, id).is_some())
            });
            let need = need.count();
            if need > room {
                return Err(CudaBackendError::Other(format!(
                    "layer {}: expert {e}'s {need} cold slabs exceed the {room} scratch slots; raise --vram-budget",
                    req.layer
                )));
            }
            if used + need > room {
                passes.push(start..i);
                (start, used) = (i, 0);
            }
            used += need;
        }
        passes.push(start..req.experts.len());
        Ok(passes)
    }

    /// Start a layer's fill: its window, whose first slots hold this
    /// layer's prefetch (cold slabs take the slots after it).
    pub fn begin_fill(&mut self, req: &LayerRequest<'_>) {
        self.fill = self.window(req.decode, req.layer);
        self.scratch_next = if self.pf_layer == Some(req.layer) { self.pf.len() } else { 0 };
    }

    /// Where the fill begun with [`begin_fill`](Self::begin_fill) puts slab
    /// kind `ki` of expert `e`, counting it in `stats`. `bytes` looks up host
    /// bytes where a decision needs them (a prefetched head to complete, a
    /// zero-copy candidate); without it, such slabs are copied whole.
    /// `zero_copy` gives the device address of page-locked bytes kernels may
    /// read in place (None where they are not registered).
    #[allow(clippy::type_complexity)]
    pub fn place<'b>(
        &mut self,
        req: &LayerRequest<'_>,
        ki: usize,
        e: u32,
        bytes: Option<&dyn Fn(usize, u32) -> Result<&'b [u8], String>>,
        zero_copy: impl FnOnce(&[u8]) -> Option<u64>,
        stats: &mut PoolStats,
    ) -> Result<Place<'b>, CudaBackendError> {
        let n_exp = self.n_exp;
        if e as usize >= n_exp {
            return Err(CudaBackendError::Other(format!("layer {}: expert {e} of {n_exp}", req.layer)));
        }
        let id = SlabId::new(req.layer, req.kinds[ki], e);
        let hot = self.hot.slot_of(id).map(|s| s as usize);
        if req.cpu.binary_search(&e).is_ok() && hot.is_none() {
            stats.cpu_lane += 1;
            return Ok(Place::Lane); // served by the CPU lane: a null pointer
        }
        let admitted = self.admitted.binary_search(&id).is_ok();
        let mut ahead = self.prefetched(req.layer, id);
        // A slab prefetched without its head that the lane does not compute
        // from this step (the hot set took it, or took its sibling): its head
        // bytes complete it where it ends up. With no bytes at hand, it is
        // copied whole instead.
        let mut head: Option<&'b [u8]> = None;
        if let Some(a) = ahead.filter(|a| a.head > 0 && (admitted || req.heads.binary_search(&e).is_err())) {
            match bytes {
                Some(f) => head = Some(&f(ki, e).map_err(CudaBackendError::Other)?[..a.head]),
                None => ahead = None,
            }
        }
        Ok(match (hot, ahead) {
            (Some(to), Some(a)) if admitted => {
                stats.prefetch_hits += 1;
                Place::Move { from: a.slot, to, len: a.len, head }
            }
            (Some(slot), None) if admitted => Place::Upload { slot },
            (Some(slot), _) => {
                stats.hits += 1;
                Place::Hit { slot }
            }
            (None, Some(a)) => {
                stats.prefetch_hits += 1;
                Place::Ahead { slot: a.slot, head }
            }
            (None, None) => {
                let zc = match bytes.filter(|_| req.zero_copy.binary_search(&e).is_ok()) {
                    Some(f) => {
                        let b = f(ki, e).map_err(CudaBackendError::Other)?;
                        zero_copy(b).map(|a| (a, b.len()))
                    }
                    None => None,
                };
                match zc {
                    Some((addr, len)) => {
                        stats.zero_copy += 1;
                        stats.zero_copy_bytes += len as u64;
                        Place::ZeroCopy { addr }
                    }
                    None => Place::Scratch { slot: self.take_scratch(req.layer)? },
                }
            }
        })
    }

    /// The fill's next free scratch slot.
    fn take_scratch(&mut self, layer: u32) -> Result<usize, CudaBackendError> {
        let cap = self.fill.cap;
        if self.scratch_next >= cap {
            return Err(CudaBackendError::Other(format!(
                "layer {layer}: {} cold slabs in one step exceed the {cap} scratch slots; raise --vram-budget",
                self.scratch_next + 1,
            )));
        }
        let slot = self.fill.slot(self.scratch_next);
        self.scratch_next += 1;
        Ok(slot)
    }

    /// Start a prefetch of `experts` for `layer` (see
    /// [`ExpertPool::prefetch_layer`](super::ExpertPool::prefetch_layer)):
    /// forget the last one and note what `lane` leaves to the CPU lane.
    /// Returns the (expert, head bytes to leave out) to copy and how many
    /// slabs the window takes, or None where this step does not prefetch.
    pub fn begin_prefetch(&mut self, layer: u32, decode: bool, experts: &[u32], lane: &[(u32, LaneShare)], has_pinned: bool) -> Option<(Vec<(u32, usize)>, usize)> {
        self.pf.clear();
        self.pf_lane.clear();
        self.pf_heads.clear();
        self.pf_layer = Some(layer);
        self.pf_decode = decode;
        if !(if decode { self.pf_enabled } else { has_pinned }) {
            return None;
        }
        for &(e, share) in lane {
            match share {
                LaneShare::Whole => self.pf_lane.push(e),
                LaneShare::Head { rows, .. } => self.pf_heads.push((e, rows)),
            }
        }
        self.pf_lane.sort_unstable();
        self.pf_heads.sort_unstable();
        let head_of = |e: u32| lane.iter().find(|s| s.0 == e).map(|s| s.1);
        let copied: Vec<(u32, usize)> = experts
            .iter()
            .filter_map(|&e| match head_of(e) {
                Some(LaneShare::Whole) => None,
                Some(LaneShare::Head { bytes, .. }) => Some((e, bytes)),
                None => Some((e, 0)),
            })
            .collect();
        // Prefill prefetches into the slots the current layer's fill left free.
        let window = self.window(decode, layer).cap;
        let cap = if decode { window } else { window.saturating_sub(self.scratch_next) };
        Some((copied, cap))
    }

    /// The window size for the rest of a prefill prefetch of `layer` (see
    /// [`ExpertPool::prefetch_rest`](super::ExpertPool::prefetch_rest)), or
    /// None where there is none to finish.
    pub fn rest_cap(&self, layer: u32, has_pinned: bool) -> Option<usize> {
        if self.pf_layer != Some(layer) || self.pf_decode || !has_pinned {
            return None;
        }
        Some(self.window(false, layer).cap)
    }

    /// Where the prefetch in progress copies slab `id` (of its layer), with
    /// room for `cap` prefetched slabs in all.
    pub fn ahead_slot(&self, id: SlabId, cap: usize) -> AheadSlot {
        if self.hot.slot_of(id).is_some() || self.pf.contains_key(&id) {
            return AheadSlot::Skip;
        }
        if self.pf.len() >= cap {
            return AheadSlot::Full;
        }
        AheadSlot::Slot(self.window(self.pf_decode, id.layer).slot(self.pf.len()))
    }

    /// Slab `id` was copied ahead as `a`.
    pub fn add_ahead(&mut self, id: SlabId, a: Ahead, stats: &mut PoolStats) {
        self.pf.insert(id, a);
        stats.prefetched += 1;
    }

    /// The experts of `layer` its prefetch left to the CPU lane.
    pub fn lane_reserved(&self, layer: u32) -> &[u32] {
        if self.pf_layer == Some(layer) && self.pf_decode {
            &self.pf_lane
        } else {
            &[]
        }
    }

    /// Of `experts` (this step's, of `layer`), those whose heads the lane
    /// should compute: the prefetch left their gate and up heads out and the
    /// hot set has not admitted either (call after `plan_layer`). (expert,
    /// head rows), ascending.
    pub fn heads_ready(&self, layer: u32, kinds: [SlabKind; 3], experts: &[u32]) -> Vec<(u32, usize)> {
        if self.pf_layer != Some(layer) || !self.pf_decode {
            return Vec::new();
        }
        self.pf_heads
            .iter()
            .copied()
            .filter(|(e, _)| experts.binary_search(e).is_ok())
            .filter(|&(e, _)| {
                kinds[..2].iter().all(|&k| {
                    let id = SlabId::new(layer, k, e);
                    self.hot.slot_of(id).is_none() && self.pf.get(&id).is_some_and(|a| a.head > 0)
                })
            })
            .collect()
    }

    /// Of `experts` (of `layer`), those with none of the `kinds` slabs in the
    /// hot set: the ones a step would find cold.
    pub fn cold_of(&self, layer: u32, kinds: [SlabKind; 3], experts: &[u32]) -> Vec<u32> {
        experts.iter().copied().filter(|&e| kinds.iter().all(|&k| self.hot.slot_of(SlabId::new(layer, k, e)).is_none())).collect()
    }
}
