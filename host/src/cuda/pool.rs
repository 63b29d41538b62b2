//! VRAM pools: reusable activation buffers ([`bufs`]), and the expert slots:
//! the device side here, the decisions in [`slots`].
//!
//! [`ExpertPool`] owns the slot allocation, the copy stream's events and
//! timing, the page-locked registrations and the pointer tables' staging;
//! its [`SlotBook`] decides which slab sits in which slot. Each method here
//! asks the book, then issues the device work the answer calls for, in the
//! order the answers come, so the split changes no copy, move or event.
//! The CPU lane's stagings are in [`lane`].

use std::sync::Arc;

use cudarc::driver::CudaEvent;
use pulsar_cuda::{CudaDevice, DeviceBuf, HostFlag, HostRegistration, PinnedBuf};
use pulsar_store::{Catalog, Census, SlabId, SlabKind};

use super::pinned::PinnedRanges;

use super::CudaBackendError;

mod bufs;
mod lane;
mod slots;

pub use bufs::BufPool;
pub use lane::LaneOutput;
pub use slots::{LaneShare, LayerPlan, LayerRequest};
use slots::{Ahead, AheadSlot, Place, SlotBook};

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
/// follow [`HotSet`](pulsar_store::HotSet)'s admission policy (a slab earns a
/// slot only by being hotter than the coldest resident); scratch slots hold
/// one layer's cold slabs that were not admitted ([`SlotBook`] decides).
/// Copies from registered (page-locked) host memory run on the copy stream;
/// the compute stream waits on an event.
pub struct ExpertPool {
    slots: DeviceBuf<u8>,
    book: SlotBook,
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
        let book = SlotBook::new(slot_bytes, n_slots, n_exp, half_life_steps)?;
        let n_hot = book.n_hot();
        Ok(ExpertPool {
            slots: dev.alloc::<u8>(slot_bytes * n_slots)?,
            book,
            pinned: Vec::new(),
            copy_start: dev.new_event(true)?,
            copy_done: dev.new_event(true)?,
            compute_mark: dev.new_event(false)?,
            timing_pending: false,
            table_host: [dev.alloc_pinned::<u64>(n_exp)?, dev.alloc_pinned::<u64>(n_exp)?, dev.alloc_pinned::<u64>(n_exp)?],
            table_dev: [dev.alloc::<u64>(n_exp)?, dev.alloc::<u64>(n_exp)?, dev.alloc::<u64>(n_exp)?],
            host_pinned: None,
            lane_stage: None,
            lane_stage_used: 0,
            lane_input: None,
            row_lo_stage: None,
            lane_flag: None,
            lane_seq: 0,
            lane_async_stage: None,
            lane_seg_stage: None,
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
        self.book.enable_prefetch(top_k, self.has_pinned());
    }

    pub fn prefetch_enabled(&self) -> bool {
        self.book.prefetch_enabled()
    }

    /// Whether predicting and copying the next layer ahead pays: prefetch is
    /// on and recent decode layers copied in at least two slabs each.
    pub fn prefetch_pays(&self) -> bool {
        self.book.prefetch_pays()
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
        let Some((copied, cap)) = self.book.begin_prefetch(layer, decode, experts, lane, self.has_pinned()) else {
            return Ok(());
        };
        self.copy_ahead(dev, layer, kinds, &copied, bytes, cap, false)
    }

    /// The experts of `layer` its prefetch left to the CPU lane.
    pub fn lane_reserved(&self, layer: u32) -> &[u32] {
        self.book.lane_reserved(layer)
    }

    /// Of `experts` (this step's, of `layer`), those whose heads the lane
    /// should compute: the prefetch left their gate and up heads out and the
    /// hot set has not admitted either (call after `plan_layer`). (expert,
    /// head rows), ascending.
    pub fn heads_ready(&self, layer: u32, kinds: [SlabKind; 3], experts: &[u32]) -> Vec<(u32, usize)> {
        self.book.heads_ready(layer, kinds, experts)
    }

    /// Of `experts` (of `layer`), those with none of the `kinds` slabs in the
    /// hot set: the ones a step would find cold.
    pub fn cold_of(&self, layer: u32, kinds: [SlabKind; 3], experts: &[u32]) -> Vec<u32> {
        self.book.cold_of(layer, kinds, experts)
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
        let mut copied = false;
        'outer: for &(e, head_bytes) in experts {
            for (ki, &k) in kinds.iter().enumerate() {
                let id = SlabId::new(layer, k, e);
                let slot = match self.book.ahead_slot(id, cap) {
                    AheadSlot::Skip => continue,
                    AheadSlot::Full => break 'outer,
                    AheadSlot::Slot(s) => s,
                };
                let b = bytes(ki, e).map_err(CudaBackendError::Other)?;
                if !self.is_pinned(b) {
                    continue;
                }
                if after_compute && !copied {
                    self.compute_mark.record(dev.compute()).map_err(pulsar_cuda::CudaError::from)?;
                    dev.copy().wait(&self.compute_mark).map_err(pulsar_cuda::CudaError::from)?;
                }
                let head = slots::head_len(ki, head_bytes, b.len());
                self.upload_at(dev, slot, head, &b[head..])?;
                self.book.add_ahead(id, Ahead { slot, len: b.len(), head }, &mut self.stats);
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
        let Some(window) = self.book.rest_cap(layer, self.has_pinned()) else {
            return Ok(());
        };
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

    /// Copies may also come from these page-locked host-cache allocations.
    pub fn set_host_pinned(&mut self, r: PinnedRanges) {
        self.host_pinned = Some(r);
    }

    fn is_pinned(&self, bytes: &[u8]) -> bool {
        registration(&self.pinned, bytes).is_some() || self.host_pinned.as_ref().is_some_and(|r| r.contains(bytes))
    }

    fn slot_ptr(&self, slot: usize) -> u64 {
        self.book.slot_addr(self.slots.device_ptr(), slot)
    }

    fn upload(&mut self, dev: &CudaDevice, slot: usize, bytes: &[u8]) -> Result<u64, CudaBackendError> {
        self.upload_at(dev, slot, 0, bytes)
    }

    /// Copy `bytes` to offset `at` of `slot`; returns the slot's address.
    fn upload_at(&mut self, dev: &CudaDevice, slot: usize, at: usize, bytes: &[u8]) -> Result<u64, CudaBackendError> {
        let slot_bytes = self.book.slot_bytes();
        if at + bytes.len() > slot_bytes {
            return Err(CudaBackendError::Other(format!("expert slab of {} bytes exceeds the slot size {slot_bytes}", at + bytes.len())));
        }
        let base = self.slot_ptr(slot);
        let ptr = base + at as u64;
        if self.is_pinned(bytes) {
            self.start_timing(dev)?;
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

    /// Open a timed span of copy-stream work, unless one is open.
    fn start_timing(&mut self, dev: &CudaDevice) -> Result<(), CudaBackendError> {
        if !self.timing_pending {
            self.copy_start.record(dev.copy()).map_err(pulsar_cuda::CudaError::from)?;
            self.timing_pending = true;
            self.pinned_at_start = self.stats.pinned_bytes;
        }
        Ok(())
    }

    /// Copy a slab between slots on the copy stream (a prefetched slab the
    /// hot set has just admitted).
    fn move_slot(&mut self, dev: &CudaDevice, from: usize, to: usize, len: usize) -> Result<(), CudaBackendError> {
        let (src, dst) = (self.slot_ptr(from), self.slot_ptr(to));
        self.start_timing(dev)?;
        dev.context().bind_to_thread().map_err(pulsar_cuda::CudaError::from)?;
        // SAFETY: both slots lie in the pool's allocation and hold `slot_bytes
        // >= len` bytes; the compute stream waits for the copy stream.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, len, dev.copy().cu_stream()) }.map_err(pulsar_cuda::CudaError::from)?;
        Ok(())
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
        for a in self.book.warm_load(catalog, census) {
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
        Ok(self.book.plan_layer(req, &mut self.stats))
    }

    /// The passes a layer's fill takes so that no pass overflows the
    /// scratch ([`SlotBook::passes`]): call after [`plan_layer`](Self::plan_layer),
    /// then fill and run each pass's experts in turn, the device done with
    /// one pass's kernels before the next fill reuses its slots.
    pub fn passes(&mut self, req: &LayerRequest<'_>) -> Result<Vec<std::ops::Range<usize>>, CudaBackendError> {
        self.book.passes(req)
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
    #[allow(clippy::type_complexity)]
    pub fn assign_layer<'b>(
        &mut self,
        dev: &CudaDevice,
        req: &LayerRequest<'_>,
        bytes: Option<&dyn Fn(usize, u32) -> Result<&'b [u8], String>>,
    ) -> Result<FillPlan, CudaBackendError> {
        let copied_before = self.stats.misses + self.stats.prefetch_hits;
        self.book.begin_fill(req);
        let n_exp = self.book.n_exp();
        let base = self.slots.device_ptr();
        let mut plan = FillPlan { table: vec![0u64; 3 * n_exp], copies: Vec::new(), decode: req.decode, copied_before };
        for (ki, &kind) in req.kinds.iter().enumerate() {
            for &e in req.experts {
                let pinned = &self.pinned;
                let place = self.book.place(req, ki, e, bytes, |b| registration(pinned, b).and_then(|r| r.device_addr(b)), &mut self.stats)?;
                // Each slab's device work is issued before the next slab is
                // placed: the order of moves and uploads is the book's.
                match place {
                    Place::Move { from, to, len, head } => {
                        self.move_slot(dev, from, to, len)?;
                        if let Some(h) = head {
                            // After the move on the same stream: the head lands last.
                            self.upload_at(dev, to, 0, h)?;
                        }
                    }
                    Place::Ahead { slot, head: Some(h) } => {
                        self.upload_at(dev, slot, 0, h)?;
                    }
                    Place::Upload { slot } | Place::Scratch { slot } => plan.copies.push((SlabId::new(req.layer, kind, e), ki, e, slot)),
                    Place::Lane | Place::Hit { .. } | Place::Ahead { head: None, .. } | Place::ZeroCopy { .. } => {}
                }
                plan.table[ki * n_exp + e as usize] = self.book.addr(base, place);
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
            self.book.note_copied((self.stats.misses + self.stats.prefetch_hits - plan.copied_before) as f64);
        }
        self.finish_copies(dev)?;
        // The previous layer's table copy has finished: the compute stream was
        // synchronised (routing ids came back) before this call.
        let n_exp = self.book.n_exp();
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
        self.book.census()
    }

    /// Flush pending timing (for reports after a run).
    pub fn settle(&mut self) -> Result<(), CudaBackendError> {
        self.read_copy_time()
    }
}

/// The registered range `bytes` lie in, if any (a free function so that a
/// fill can look it up while the slot book is borrowed).
fn registration<'r>(pinned: &'r [HostRegistration], bytes: &[u8]) -> Option<&'r HostRegistration> {
    pinned.iter().find(|r| r.contains(bytes))
}
