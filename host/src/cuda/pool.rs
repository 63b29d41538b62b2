//! VRAM pools: reusable activation buffers ([`bufs`]), and the expert-slot
//! hot set.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::CudaEvent;
use pulsar_cuda::{CudaDevice, DeviceBuf, HostFlag, HostRegistration, PinnedBuf};
use pulsar_store::{Catalog, Census, HotSet, HotSetConfig, SlabId, SlabKind};

use super::pinned::PinnedRanges;

use super::CudaBackendError;

mod bufs;
mod lane;

pub use bufs::BufPool;
pub use lane::LaneOutput;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PoolStats {
    pub slots: usize,
    pub hot_slots: usize,
    pub slot_bytes: usize,
    /// Slabs found in their hot-set slot.
    pub hits: u64,
    /// Slabs uploaded (admitted to the hot set, or into a scratch slot).
    pub misses: u64,
    /// Cold slabs the kernels read in place from page-locked host memory.
    pub zero_copy: u64,
    pub zero_copy_bytes: u64,
    /// Cold slabs copied ahead during the previous layer (predicted by its
    /// router on the previous layer's input), and how many were then used.
    pub prefetched: u64,
    pub prefetch_hits: u64,
    /// Cold slabs the CPU lane computed with (host bytes, no upload).
    pub cpu_lane: u64,
    pub cpu_lane_bytes: u64,
    /// Wall time the lane spent on them (fixed costs included).
    pub cpu_lane_seconds: f64,
    /// Host time spent waiting for the link at a layer's plan (the layer
    /// before queued copies the host caught up with), and for the routing
    /// ids (the GPU's work up to the router).
    pub link_wait_seconds: f64,
    pub route_wait_seconds: f64,
    pub uploaded_bytes: u64,
    /// Of those, bytes copied from page-locked memory on the copy stream.
    pub pinned_bytes: u64,
    /// Copy-stream time of the pinned uploads plus host time of the others.
    pub upload_seconds: f64,
    pub admissions: u64,
    pub evictions: u64,
    /// Slabs put in place before the first step from the census or hotlist.
    pub warm_loaded: u64,
}

/// Tier 2 on the device: a fixed pool of expert-slab slots in VRAM. Hot slots
/// follow [`HotSet`]'s admission policy (a slab earns a slot only by being
/// hotter than the coldest resident); scratch slots hold one layer's cold
/// slabs that were not admitted. Copies from registered (page-locked) host
/// memory run on the copy stream; the compute stream waits on an event.
pub struct ExpertPool {
    slots: DeviceBuf<u8>,
    slot_bytes: usize,
    n_hot: usize,
    n_scratch: usize,
    scratch_next: usize,
    hot: HotSet,
    /// Page-locked host ranges slabs may be copied or read from.
    pinned: Vec<HostRegistration>,
    copy_start: CudaEvent,
    copy_done: CudaEvent,
    /// Recorded on the compute stream after a prefill layer's expert kernels:
    /// the copy stream waits on it before reusing their scratch slots.
    compute_mark: CudaEvent,
    /// A timed copy is in flight since the last layer (read its time at the next).
    timing_pending: bool,
    table_host: [PinnedBuf<u64>; 3],
    table_dev: [DeviceBuf<u64>; 3],
    n_exp: usize,
    /// This run's expert selections, for the census sidecar.
    census: Census,
    /// The current layer's admissions (sorted), between plan and fill.
    admitted: Vec<SlabId>,
    /// Page-locked host-cache allocations (the store's pinned allocator).
    host_pinned: Option<PinnedRanges>,
    /// Staging for the CPU lane's output rows, and how much of it this
    /// layer's calls have used.
    lane_stage: Option<PinnedBuf<f32>>,
    lane_stage_used: usize,
    /// The layer's input, copied out for the lane before the routing sync
    /// (so that one sync brings both), and the split experts' first rows
    /// staged for the device.
    lane_input: Option<PinnedBuf<f32>>,
    row_lo_stage: Option<PinnedBuf<i32>>,
    /// The asynchronous lane: the flag the compute stream waits on, the last
    /// job number handed out, and the staging its outputs are written to.
    lane_flag: Option<Arc<HostFlag>>,
    lane_seq: u32,
    /// (Both with the address kernels read them at, looked up once.)
    lane_async_stage: Option<(PinnedBuf<f32>, u64)>,
    lane_seg_stage: Option<(PinnedBuf<i32>, u64)>,
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
    /// The last lane layer's outcome, from the next plan (a layer had lane
    /// work when `lane_secs` > 0).
    lane_outcome: Option<bool>,
    /// Decode: when the last plan's wait for the link ended (and its layer),
    /// the lane's seconds since, and the last layer's chain (its host and
    /// GPU work besides the lane, from one plan to the next).
    last_plan: Option<(std::time::Instant, u32)>,
    lane_secs: f64,
    chain_sample: Option<f64>,
    /// Pinned bytes copied before the current timed span, and the last
    /// finished span's (bytes, copy-stream seconds).
    pinned_at_start: u64,
    last_copies: Option<(u64, f64)>,
    pub stats: PoolStats,
}

/// A slab copied ahead into a scratch slot: its first `head` bytes are absent
/// (a split expert's gate/up rows the CPU lane computes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ahead {
    slot: usize,
    len: usize,
    head: usize,
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
    /// step, from [`ExpertPool::heads_ready`]: their slabs as prefetched.
    pub heads: &'a [u32],
    /// A decode step (one token): cold slabs use this layer's half of the
    /// scratch (the other half takes the next layer's prefetch); a prefill
    /// step uses all of it and drops any prefetch.
    pub decode: bool,
}

/// What a layer's step needs, from [`ExpertPool::plan_layer`].
#[derive(Debug, Default)]
pub struct LayerPlan {
    /// Experts whose bytes the fill reads (admitted or cold slabs), ascending.
    pub need: Vec<u32>,
    /// Of those, experts with no slab in the hot set nor admitted: these may
    /// take any cold path.
    pub cold: Vec<u32>,
}

/// A layer's fill decided ahead of its bytes ([`ExpertPool::assign_layer`]).
pub struct FillPlan {
    table: Vec<u64>,
    /// (slab, kind index, expert, slot) of every slab still to be copied in.
    pub copies: Vec<(SlabId, usize, u32, usize)>,
    decode: bool,
    copied_before: u64,
}

impl ExpertPool {
    /// `n_slots` slots of `slot_bytes`; `n_exp` experts per layer (the scratch
    /// part holds one layer's three slabs per expert at most).
    pub fn new(dev: &CudaDevice, slot_bytes: usize, n_slots: usize, n_exp: usize, half_life_steps: f64) -> Result<ExpertPool, CudaBackendError> {
        let n_scratch = (3 * n_exp).min(n_slots / 2);
        let n_hot = n_slots - n_scratch;
        if n_scratch == 0 {
            return Err(CudaBackendError::Other("the VRAM budget leaves no room for a single expert slab".into()));
        }
        let mut cfg = HotSetConfig::new(n_hot);
        cfg.half_life_steps = half_life_steps;
        Ok(ExpertPool {
            slots: dev.alloc::<u8>(slot_bytes * n_slots)?,
            slot_bytes,
            n_hot,
            n_scratch,
            scratch_next: 0,
            hot: HotSet::new(cfg),
            pinned: Vec::new(),
            copy_start: dev.new_event(true)?,
            copy_done: dev.new_event(true)?,
            compute_mark: dev.new_event(false)?,
            timing_pending: false,
            table_host: [dev.alloc_pinned::<u64>(n_exp)?, dev.alloc_pinned::<u64>(n_exp)?, dev.alloc_pinned::<u64>(n_exp)?],
            table_dev: [dev.alloc::<u64>(n_exp)?, dev.alloc::<u64>(n_exp)?, dev.alloc::<u64>(n_exp)?],
            n_exp,
            census: Census::new(),
            admitted: Vec::new(),
            host_pinned: None,
            lane_stage: None,
            lane_stage_used: 0,
            lane_input: None,
            row_lo_stage: None,
            lane_flag: None,
            lane_seq: 0,
            lane_async_stage: None,
            lane_seg_stage: None,
            pf_enabled: false,
            copied_per_layer: f64::INFINITY,
            pf_layer: None,
            pf_decode: false,
            pf: HashMap::new(),
            pf_lane: Vec::new(),
            pf_heads: Vec::new(),
            lane_outcome: None,
            last_plan: None,
            lane_secs: 0.0,
            chain_sample: None,
            pinned_at_start: 0,
            last_copies: None,
            stats: PoolStats { slots: n_slots, hot_slots: n_hot, slot_bytes, ..Default::default() },
        })
    }

    /// Let decode steps copy the next layer's predicted cold slabs ahead
    /// (only from page-locked memory, and only with room for two windows of
    /// a top-`top_k` step's slabs).
    pub fn enable_prefetch(&mut self, top_k: usize) {
        self.pf_enabled = self.has_pinned() && self.n_scratch / 2 >= 3 * top_k.max(1);
    }

    pub fn prefetch_enabled(&self) -> bool {
        self.pf_enabled
    }

    /// Whether predicting and copying the next layer ahead pays: prefetch is
    /// on and recent decode layers copied in at least two slabs each (on the
    /// H200 it cost 2-3 tok/s at 97% VRAM hits and gained 5-6 at 70%).
    pub fn prefetch_pays(&self) -> bool {
        self.pf_enabled && !(self.copied_per_layer < 2.0)
    }

    /// The scratch slots a step's cold slabs may use: slot of its `i`-th cold
    /// slab, and how many there are. Decode with prefetch: one half per layer
    /// parity (the other takes the next layer's prefetch). Prefill: all of
    /// them, even layers from the bottom up, odd layers from the top down, so
    /// the next layer's prefetch fills from the far end while this layer's
    /// slabs are still being read.
    fn window(&self, decode: bool, layer: u32) -> (impl Fn(usize) -> usize, usize) {
        let (n_hot, n) = (self.n_hot, self.n_scratch);
        let (base, cap, down) = if decode && self.pf_enabled {
            let half = n / 2;
            (n_hot + (layer as usize % 2) * half, half, false)
        } else {
            (n_hot, n, layer % 2 == 1)
        };
        (move |i: usize| if down { base + cap - 1 - i } else { base + i }, cap)
    }
    fn prefetched(&self, layer: u32, id: SlabId) -> Option<Ahead> {
        (self.pf_layer == Some(layer)).then(|| self.pf.get(&id).copied()).flatten()
    }

    /// Copy the cold slabs of `experts` (predicted for `layer`, the next MoE
    /// layer) into that layer's scratch window on the copy stream, where its
    /// step will find them. Only page-locked bytes are copied (a pageable
    /// copy would block the host); a full window stops early. Experts in
    /// `lane` (ascending) are not copied: that layer's CPU lane serves them
    /// ([`lane_reserved`](Self::lane_reserved)).
    ///
    /// A prefill step (`decode` false) prefetches into the slots the current
    /// layer's fill left free (call it after that fill), the far end of the
    /// scratch: the current layer's kernels still read the others.
    #[allow(clippy::too_many_arguments)]
    pub fn prefetch_layer<'b>(
        &mut self,
        dev: &CudaDevice,
        layer: u32,
        decode: bool,
        kinds: [SlabKind; 3],
        experts: &[u32],
        lane: &[(u32, LaneShare)],
        bytes: &dyn Fn(usize, u32) -> Result<&'b [u8], String>,
    ) -> Result<(), CudaBackendError> {
        self.pf.clear();
        self.pf_lane.clear();
        self.pf_heads.clear();
        self.pf_layer = Some(layer);
        self.pf_decode = decode;
        if !(if decode { self.pf_enabled } else { self.has_pinned() }) {
            return Ok(());
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
        let window = self.window(decode, layer).1;
        let cap = if decode { window } else { window.saturating_sub(self.scratch_next) };
        self.copy_ahead(dev, layer, kinds, &copied, bytes, cap, false)
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

    /// The CPU lane worked `secs` in this layer (its outcome is read at the
    /// next layer's plan).
    pub fn note_lane_work(&mut self, secs: f64) {
        self.lane_secs += secs;
    }

    /// After a decode plan, what the layer before says: whether the link was
    /// still busy when the host reached this plan, if that layer had lane
    /// work (`Some(true)`: the lane's layer ended first, so the lane can
    /// take more), and that layer's chain in seconds (its work besides the
    /// lane and the wait for the link), if it directly preceded this one.
    pub fn take_layer_outcome(&mut self) -> (Option<bool>, Option<f64>) {
        (self.lane_outcome.take(), self.chain_sample.take())
    }

    /// The last finished span of copies: (pinned bytes, copy-stream seconds).
    pub fn take_copy_span(&mut self) -> Option<(u64, f64)> {
        self.last_copies.take()
    }

    /// Copy the cold, not yet prefetched slabs of `experts` (layer `layer`)
    /// into its window until `cap` slabs are there; with `after_compute` the
    /// copy stream first waits for the compute stream's queued work. The next
    /// layer's plan waits for these copies (read_copy_time) before any kernel
    /// reads the slots.
    #[allow(clippy::too_many_arguments)]
    fn copy_ahead<'b>(
        &mut self,
        dev: &CudaDevice,
        layer: u32,
        kinds: [SlabKind; 3],
        experts: &[(u32, usize)],
        bytes: &dyn Fn(usize, u32) -> Result<&'b [u8], String>,
        cap: usize,
        after_compute: bool,
    ) -> Result<(), CudaBackendError> {
        let slot_of = self.window(self.pf_decode, layer).0;
        let mut copied = false;
        'outer: for &(e, head_bytes) in experts {
            for (ki, &k) in kinds.iter().enumerate() {
                let id = SlabId::new(layer, k, e);
                if self.hot.slot_of(id).is_some() || self.pf.contains_key(&id) {
                    continue;
                }
                if self.pf.len() >= cap {
                    break 'outer;
                }
                let b = bytes(ki, e).map_err(CudaBackendError::Other)?;
                if !self.is_pinned(b) {
                    continue;
                }
                if after_compute && !copied {
                    self.compute_mark.record(dev.compute()).map_err(pulsar_cuda::CudaError::from)?;
                    dev.copy().wait(&self.compute_mark).map_err(pulsar_cuda::CudaError::from)?;
                }
                let slot = slot_of(self.pf.len());
                // Gate and up (kinds 0, 1) of a split expert: all but the head.
                let head = if ki < 2 { head_bytes.min(b.len()) } else { 0 };
                self.upload_at(dev, slot, head, &b[head..])?;
                self.pf.insert(id, Ahead { slot, len: b.len(), head });
                self.stats.prefetched += 1;
                copied = true;
            }
        }
        if copied {
            self.copy_done.record(dev.copy()).map_err(pulsar_cuda::CudaError::from)?;
        }
        Ok(())
    }

    /// Prefill, once this layer's expert kernels are queued: copy the rest of
    /// the next layer's predicted cold slabs (what the free slots could not
    /// take, see [`prefetch_layer`](Self::prefetch_layer)) into the slots this
    /// layer's kernels read. The copy stream waits for those kernels on the
    /// device, so the copies start the moment they finish, during the next
    /// layer's attention, with no host in the loop. (The copy-time statistic
    /// then includes that wait.)
    pub fn prefetch_rest<'b>(
        &mut self,
        dev: &CudaDevice,
        layer: u32,
        kinds: [SlabKind; 3],
        experts: &[u32],
        bytes: &dyn Fn(usize, u32) -> Result<&'b [u8], String>,
    ) -> Result<(), CudaBackendError> {
        if self.pf_layer != Some(layer) || self.pf_decode || !self.has_pinned() {
            return Ok(());
        }
        let window = self.window(false, layer).1;
        let whole: Vec<(u32, usize)> = experts.iter().map(|&e| (e, 0)).collect();
        self.copy_ahead(dev, layer, kinds, &whole, bytes, window, true)
    }

    /// Copies and zero-copy reads may use this page-locked host range.
    pub fn add_pinned(&mut self, r: HostRegistration) {
        self.pinned.push(r);
    }

    pub fn has_pinned(&self) -> bool {
        !self.pinned.is_empty()
    }

    fn registration(&self, bytes: &[u8]) -> Option<&HostRegistration> {
        self.pinned.iter().find(|r| r.contains(bytes))
    }

    /// Copies may also come from these page-locked host-cache allocations.
    pub fn set_host_pinned(&mut self, r: PinnedRanges) {
        self.host_pinned = Some(r);
    }

    fn is_pinned(&self, bytes: &[u8]) -> bool {
        self.registration(bytes).is_some() || self.host_pinned.as_ref().is_some_and(|r| r.contains(bytes))
    }

    fn slot_ptr(&self, slot: usize) -> Result<u64, CudaBackendError> {
        Ok(self.slots.device_ptr_at(slot * self.slot_bytes)?)
    }

    fn upload(&mut self, dev: &CudaDevice, slot: usize, bytes: &[u8]) -> Result<u64, CudaBackendError> {
        self.upload_at(dev, slot, 0, bytes)
    }

    /// Copy `bytes` to offset `at` of `slot`; returns the slot's address.
    fn upload_at(&mut self, dev: &CudaDevice, slot: usize, at: usize, bytes: &[u8]) -> Result<u64, CudaBackendError> {
        if at + bytes.len() > self.slot_bytes {
            return Err(CudaBackendError::Other(format!("expert slab of {} bytes exceeds the slot size {}", at + bytes.len(), self.slot_bytes)));
        }
        let base = self.slot_ptr(slot)?;
        let ptr = base + at as u64;
        if self.is_pinned(bytes) {
            if !self.timing_pending {
                self.copy_start.record(dev.copy()).map_err(pulsar_cuda::CudaError::from)?;
                self.timing_pending = true;
                self.pinned_at_start = self.stats.pinned_bytes;
            }
            // SAFETY: the slot holds `slot_bytes >= bytes.len()` bytes; the
            // bytes are page-locked file or cache memory that outlives the
            // step, and the compute stream waits for this copy (copy_done).
            unsafe { pulsar_cuda::copy_to_device_async(dev.copy(), ptr, bytes) }?;
            self.stats.pinned_bytes += bytes.len() as u64;
        } else {
            let t = std::time::Instant::now();
            dev.context().bind_to_thread().map_err(pulsar_cuda::CudaError::from)?;
            // SAFETY: as above; a pageable copy completes before the call
            // returns, so `bytes` may go away after.
            unsafe { cudarc::driver::result::memcpy_htod_sync(ptr, bytes) }.map_err(pulsar_cuda::CudaError::from)?;
            self.stats.upload_seconds += t.elapsed().as_secs_f64();
        }
        self.stats.misses += 1;
        self.stats.uploaded_bytes += bytes.len() as u64;
        Ok(base)
    }

    /// Copy a slab between slots on the copy stream (a prefetched slab the
    /// hot set has just admitted).
    fn move_slot(&mut self, dev: &CudaDevice, from: usize, to: usize, len: usize) -> Result<u64, CudaBackendError> {
        let (src, dst) = (self.slot_ptr(from)?, self.slot_ptr(to)?);
        if !self.timing_pending {
            self.copy_start.record(dev.copy()).map_err(pulsar_cuda::CudaError::from)?;
            self.timing_pending = true;
            self.pinned_at_start = self.stats.pinned_bytes;
        }
        dev.context().bind_to_thread().map_err(pulsar_cuda::CudaError::from)?;
        // SAFETY: both slots lie in the pool's allocation and hold `slot_bytes
        // >= len` bytes; the compute stream waits for the copy stream.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, len, dev.copy().cu_stream()) }.map_err(pulsar_cuda::CudaError::from)?;
        Ok(dst)
    }

    /// Fill free hot slots with the hottest whole triples of `census` (the
    /// sidecar of earlier runs, or a built-in hotlist) before the first step.
    pub fn warm_load<'b>(
        &mut self,
        dev: &CudaDevice,
        catalog: &Catalog,
        census: &Census,
        bytes: &dyn Fn(SlabId) -> Result<&'b [u8], String>,
    ) -> Result<(), CudaBackendError> {
        for a in self.hot.warm_load(catalog, census) {
            let b = bytes(a.slab).map_err(CudaBackendError::Other)?;
            self.upload(dev, a.slot as usize, b)?;
            self.stats.warm_loaded += 1;
        }
        self.finish_copies(dev)
    }

    /// Phase one of a layer's step: record the touches (heat, census), take
    /// the hot set's admissions, and return the experts whose bytes the fill
    /// needs (admitted or cold slabs; hot-set hits need none), ascending.
    pub fn plan_layer(&mut self, req: &LayerRequest<'_>) -> Result<LayerPlan, CudaBackendError> {
        let arrived = std::time::Instant::now();
        self.read_copy_time()?;
        if req.decode {
            if let Some((t, _)) = self.last_plan.filter(|&(_, l)| l + 1 == req.layer) {
                self.chain_sample = Some(arrived.duration_since(t).as_secs_f64() - self.lane_secs);
            }
            self.last_plan = Some((std::time::Instant::now(), req.layer));
        }
        self.lane_secs = 0.0;
        // The routing sync before this call finished every staged lane copy.
        self.lane_stage_used = 0;
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
        (self.stats.admissions, self.stats.evictions) = (c.admissions, c.evictions);
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
        Ok(plan)
    }

    /// Phase two: the device's per-expert pointer tables (gate, up, down; 0
    /// for experts not selected), uploading what [`ExpertPool::plan_layer`]
    /// said is needed from `bytes(kind index, expert)`. Call only when the
    /// compute stream has finished earlier layers' expert kernels (their
    /// scratch and evicted slots are reused here).
    pub fn fill_layer<'b>(
        &mut self,
        dev: &CudaDevice,
        req: &LayerRequest<'_>,
        bytes: &dyn Fn(usize, u32) -> Result<&'b [u8], String>,
    ) -> Result<&[DeviceBuf<u64>; 3], CudaBackendError> {
        let plan = self.assign_layer(dev, req, Some(bytes))?;
        for &(id, ki, e, slot) in &plan.copies {
            let b = bytes(ki, e).map_err(CudaBackendError::Other)?;
            self.copy_to_slot(dev, id, slot, b)?;
        }
        self.finish_fill(dev, plan)
    }

    /// [`fill_layer`](Self::fill_layer) in three steps, for bytes that arrive
    /// over time (the store's disk reads): decide every slab's place and the
    /// pointer tables now ([`FillPlan::copies`] lists the slabs whose host
    /// bytes are still to be copied), copy each with [`copy_slab`](Self::copy_slab)
    /// as it lands, then [`finish_fill`](Self::finish_fill). Zero-copy needs
    /// the bytes up front: without `bytes`, zero-copy experts are uploaded.
    pub fn assign_layer<'b>(
        &mut self,
        dev: &CudaDevice,
        req: &LayerRequest<'_>,
        bytes: Option<&dyn Fn(usize, u32) -> Result<&'b [u8], String>>,
    ) -> Result<FillPlan, CudaBackendError> {
        let copied_before = self.stats.misses + self.stats.prefetch_hits;
        let (slot_of, cap) = self.window(req.decode, req.layer);
        // The window's first slots hold this layer's prefetch.
        self.scratch_next = if self.pf_layer == Some(req.layer) { self.pf.len() } else { 0 };
        let n_exp = self.n_exp;
        let mut plan = FillPlan { table: vec![0u64; 3 * n_exp], copies: Vec::new(), decode: req.decode, copied_before };
        for (ki, &kind) in req.kinds.iter().enumerate() {
            for &e in req.experts {
                if e as usize >= n_exp {
                    return Err(CudaBackendError::Other(format!("layer {}: expert {e} of {n_exp}", req.layer)));
                }
                let id = SlabId::new(req.layer, kind, e);
                if req.cpu.binary_search(&e).is_ok() && self.hot.slot_of(id).is_none() {
                    self.stats.cpu_lane += 1;
                    continue; // served by the CPU lane: a null pointer
                }
                let admitted = self.admitted.binary_search(&id).is_ok();
                let mut ahead = self.prefetched(req.layer, id);
                // A slab prefetched without its head that the lane does not
                // compute from this step (the hot set took it, or took its
                // sibling): its head bytes complete it where it ends up. With
                // no bytes at hand, it is copied whole instead.
                let mut head_fix: Option<&[u8]> = None;
                if let Some(a) = ahead.filter(|a| a.head > 0 && (admitted || req.heads.binary_search(&e).is_err())) {
                    match bytes {
                        Some(f) => head_fix = Some(&f(ki, e).map_err(CudaBackendError::Other)?[..a.head]),
                        None => ahead = None,
                    }
                }
                let ptr = match (self.hot.slot_of(id), ahead) {
                    (Some(s), Some(a)) if admitted => {
                        self.stats.prefetch_hits += 1;
                        let p = self.move_slot(dev, a.slot, s as usize, a.len)?;
                        if let Some(h) = head_fix {
                            // After the move on the same stream: the head lands last.
                            self.upload_at(dev, s as usize, 0, h)?;
                        }
                        p
                    }
                    (Some(s), None) if admitted => {
                        plan.copies.push((id, ki, e, s as usize));
                        self.slot_ptr(s as usize)?
                    }
                    (Some(s), _) => {
                        self.stats.hits += 1;
                        self.slot_ptr(s as usize)?
                    }
                    (None, Some(a)) => {
                        self.stats.prefetch_hits += 1;
                        if let Some(h) = head_fix {
                            self.upload_at(dev, a.slot, 0, h)?;
                        }
                        self.slot_ptr(a.slot)?
                    }
                    (None, None) => {
                        let zc = match bytes.filter(|_| req.zero_copy.binary_search(&e).is_ok()) {
                            Some(f) => {
                                let b = f(ki, e).map_err(CudaBackendError::Other)?;
                                self.registration(b).and_then(|r| r.device_addr(b)).map(|a| (a, b.len()))
                            }
                            None => None,
                        };
                        match zc {
                            Some((addr, len)) => {
                                self.stats.zero_copy += 1;
                                self.stats.zero_copy_bytes += len as u64;
                                addr
                            }
                            None => {
                                if self.scratch_next >= cap {
                                    return Err(CudaBackendError::Other(format!(
                                        "layer {}: {} cold slabs in one step exceed the {cap} scratch slots; raise --vram-budget",
                                        req.layer,
                                        self.scratch_next + 1,
                                    )));
                                }
                                let slot = slot_of(self.scratch_next);
                                self.scratch_next += 1;
                                plan.copies.push((id, ki, e, slot));
                                self.slot_ptr(slot)?
                            }
                        }
                    }
                };
                plan.table[ki * n_exp + e as usize] = ptr;
            }
        }
        Ok(plan)
    }

    /// Copy slab `id`'s host bytes to its place in `plan`, if it has one there
    /// (slabs the plan serves from VRAM, zero-copy or the CPU lane are skipped).
    pub fn copy_slab(&mut self, dev: &CudaDevice, plan: &FillPlan, id: SlabId, bytes: &[u8]) -> Result<(), CudaBackendError> {
        match plan.copies.iter().find(|c| c.0 == id) {
            Some(&(_, _, _, slot)) => self.copy_to_slot(dev, id, slot, bytes),
            None => Ok(()),
        }
    }

    fn copy_to_slot(&mut self, dev: &CudaDevice, id: SlabId, slot: usize, bytes: &[u8]) -> Result<(), CudaBackendError> {
        self.upload(dev, slot, bytes).map(|_| ()).map_err(|e| CudaBackendError::Other(format!("{id}: {e}")))
    }

    /// Last step of a fill: the compute stream waits for the copies, and the
    /// pointer tables go to the device.
    pub fn finish_fill(&mut self, dev: &CudaDevice, plan: FillPlan) -> Result<&[DeviceBuf<u64>; 3], CudaBackendError> {
        if plan.decode {
            let copied = (self.stats.misses + self.stats.prefetch_hits - plan.copied_before) as f64;
            self.copied_per_layer = if self.copied_per_layer.is_finite() { 0.9 * self.copied_per_layer + 0.1 * copied } else { copied };
        }
        self.finish_copies(dev)?;
        // The previous layer's table copy has finished: the compute stream was
        // synchronised (routing ids came back) before this call.
        let n_exp = self.n_exp;
        for (ki, (h, d)) in self.table_host.iter_mut().zip(self.table_dev.iter_mut()).enumerate() {
            h.as_mut_slice().copy_from_slice(&plan.table[ki * n_exp..(ki + 1) * n_exp]);
            d.upload_async(dev.compute(), h)?;
        }
        Ok(&self.table_dev)
    }

    /// The host copies of the tables the last fill wrote.
    pub fn host_tables(&self) -> [&[u64]; 3] {
        [self.table_host[0].as_slice(), self.table_host[1].as_slice(), self.table_host[2].as_slice()]
    }

    /// The tables the last fill wrote.
    pub fn tables(&self) -> &[DeviceBuf<u64>; 3] {
        &self.table_dev
    }

    /// Block until this layer's copies have left host memory (before the
    /// host bytes they read from may be released).
    pub fn wait_copies(&self) -> Result<(), CudaBackendError> {
        if self.timing_pending {
            self.copy_done.synchronize().map_err(pulsar_cuda::CudaError::from)?;
        }
        Ok(())
    }

    /// Make the compute stream wait for the copies issued so far.
    fn finish_copies(&mut self, dev: &CudaDevice) -> Result<(), CudaBackendError> {
        if self.timing_pending {
            self.copy_done.record(dev.copy()).map_err(pulsar_cuda::CudaError::from)?;
            dev.compute().wait(&self.copy_done).map_err(pulsar_cuda::CudaError::from)?;
        }
        Ok(())
    }

    /// Account the last layer's copy-stream time (its copies are done: the
    /// compute stream waited for them and has since been synchronised).
    fn read_copy_time(&mut self) -> Result<(), CudaBackendError> {
        // Whether the host got here before the link was done: a link-bound
        // layer. The outcome the lane's share is steered by.
        let busy = self.timing_pending && !self.copy_done.is_complete();
        if self.lane_secs > 0.0 {
            self.lane_outcome = Some(busy);
        }
        if self.timing_pending {
            let t = std::time::Instant::now();
            self.copy_done.synchronize().map_err(pulsar_cuda::CudaError::from)?;
            if busy {
                self.stats.link_wait_seconds += t.elapsed().as_secs_f64();
            }
            let ms = self.copy_start.elapsed_ms(&self.copy_done).map_err(pulsar_cuda::CudaError::from)?;
            self.stats.upload_seconds += ms as f64 / 1e3;
            self.last_copies = Some((self.stats.pinned_bytes - self.pinned_at_start, ms as f64 / 1e3));
            self.timing_pending = false;
        }
        Ok(())
    }

    /// The experts this run selected, per (layer, expert).
    pub fn census(&self) -> &Census {
        &self.census
    }

    /// Flush pending timing (for reports after a run).
    pub fn settle(&mut self) -> Result<(), CudaBackendError> {
        self.read_copy_time()
    }
}
