//! The resolve API the MoE op calls: for one layer and one step, where each
//! needed slab's bytes are, pinned until the step's guard drops.
//!
//! Two backings give identical bytes: a host cache over the disk reader
//! (budgeted), or the caller's memory maps of the shards (everything
//! resident, no budget).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::buffer::{AlignedBuf, HostAllocator, PageAllocator};
use crate::catalog::{Catalog, SlabId, SlabKind, SlabLoc, TripleLayout};
use crate::census::Census;
use crate::error::{Result, StoreError};
use crate::host_cache::{HostCache, Lookup, Owner};
use crate::prefetch::{PrefetchLimits, PrefetchWorker};
use crate::reader::{aligned_buffer_len, DiskReader, ReaderOptions, SlabData, SlabRead};
use crate::stats::{PrefetchStats, StepStats, StoreStats, TierStats};

/// One routing decision: token `token`'s `slot`-th choice is `expert`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Selection {
    pub token: u32,
    pub slot: u32,
    pub expert: u32,
}

/// Bytes of one shard file, resident (a memory map, a `Vec<u8>`...).
pub trait ShardBytes: Send + Sync {
    fn bytes(&self) -> &[u8];
}

impl<T: AsRef<[u8]> + Send + Sync> ShardBytes for T {
    fn bytes(&self) -> &[u8] {
        self.as_ref()
    }
}

/// Configuration of a cached store.
#[derive(Clone)]
pub struct StoreConfig {
    pub host_budget: u64,
    pub reader: ReaderOptions,
    /// `None`: no background prefetch (predictions are still scored).
    pub prefetch: Option<PrefetchLimits>,
    /// Where host-cache memory comes from (pinned memory for a GPU backend).
    pub allocator: Arc<dyn HostAllocator>,
}

impl StoreConfig {
    pub fn new(host_budget: u64) -> StoreConfig {
        StoreConfig { host_budget, reader: ReaderOptions::default(), prefetch: Some(PrefetchLimits::default()), allocator: Arc::new(PageAllocator) }
    }
}

/// Poisoning only means another thread panicked mid-update of plain
/// counters and maps; carrying on beats cascading panics.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) struct CacheState {
    pub cache: Mutex<HostCache>,
    /// Signalled whenever a slab lands, a reservation is released or pins drop.
    pub changed: Condvar,
    span_align: u64,
}

impl CacheState {
    /// Bytes a slab occupies in the cache (its aligned read buffer).
    pub fn cost(&self, loc: &SlabLoc) -> u64 {
        aligned_buffer_len(loc.bytes, self.span_align)
    }
}

#[allow(clippy::large_enum_variant)] // one per store
pub(crate) enum Backing {
    Mapped(Vec<Arc<dyn ShardBytes>>),
    Cached(CacheState),
}

#[derive(Default)]
pub(crate) struct Counters {
    pub steps: u64,
    pub total: TierStats,
    pub last: Option<StepStats>,
    pub prefetch: PrefetchStats,
}

pub(crate) struct Shared {
    pub catalog: Arc<Catalog>,
    pub backing: Backing,
    pub census: Mutex<Census>,
    pub counters: Mutex<Counters>,
    /// Experts predicted per layer, scored when that layer is resolved.
    pub predictions: Mutex<HashMap<u32, Vec<u32>>>,
}

/// The expert store: catalogue, backing, census, stats and prefetch.
pub struct ExpertStore {
    shared: Arc<Shared>,
    demand: Option<Mutex<DiskReader>>,
    worker: Option<PrefetchWorker>,
}

enum SlabRef<'a> {
    Mapped(&'a [u8]),
    Cached(Arc<SlabData>),
}

impl SlabRef<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            SlabRef::Mapped(b) => b,
            SlabRef::Cached(d) => d.bytes(),
        }
    }
}

/// One expert's weights for a step.
#[derive(Clone, Copy, Debug)]
pub enum TripleBytes<'a> {
    Separate { gate: &'a [u8], up: &'a [u8], down: &'a [u8] },
    Fused { gate_up: &'a [u8], down: &'a [u8] },
}

/// The slabs of one step, pinned in the host cache until dropped.
pub struct StepGuard<'a> {
    store: &'a ExpertStore,
    layer: u32,
    selections: Vec<Selection>,
    experts: Vec<u32>,
    slabs: HashMap<SlabId, SlabRef<'a>>,
    stats: StepStats,
}

impl ExpertStore {
    /// A store backed by a host cache of `cfg.host_budget` bytes over the
    /// catalogue's shard files.
    pub fn open(catalog: Arc<Catalog>, cfg: StoreConfig) -> Result<ExpertStore> {
        let demand = DiskReader::open(&catalog, &cfg.reader)?;
        let span_align = demand.span_align();
        let cache = HostCache::new(cfg.host_budget, demand.buffer_align(), cfg.allocator.clone());
        let shared = Arc::new(Shared {
            catalog: catalog.clone(),
            backing: Backing::Cached(CacheState { cache: Mutex::new(cache), changed: Condvar::new(), span_align }),
            census: Mutex::new(Census::new()),
            counters: Mutex::new(Counters::default()),
            predictions: Mutex::new(HashMap::new()),
        });
        let worker = match &cfg.prefetch {
            Some(limits) => {
                let reader = DiskReader::open(&catalog, &cfg.reader)?;
                Some(PrefetchWorker::spawn(shared.clone(), reader, *limits)?)
            }
            None => None,
        };
        Ok(ExpertStore { shared, demand: Some(Mutex::new(demand)), worker })
    }

    /// A store serving every slab straight from resident shard bytes (one per
    /// catalogue file, in order): no budget, no disk reads.
    pub fn mapped(catalog: Arc<Catalog>, shards: Vec<Arc<dyn ShardBytes>>) -> Result<ExpertStore> {
        if shards.len() != catalog.files().len() {
            return Err(StoreError::ShardCount { expected: catalog.files().len(), got: shards.len() });
        }
        for (id, loc) in catalog.slabs() {
            let len = shards[usize::from(loc.file)].bytes().len() as u64;
            if loc.offset + loc.bytes > len {
                let file = catalog.files()[usize::from(loc.file)].clone();
                return Err(StoreError::SlabPastEof { slab: *id, file, end: loc.offset + loc.bytes, file_len: len });
            }
        }
        let shared = Arc::new(Shared {
            catalog,
            backing: Backing::Mapped(shards),
            census: Mutex::new(Census::new()),
            counters: Mutex::new(Counters::default()),
            predictions: Mutex::new(HashMap::new()),
        });
        Ok(ExpertStore { shared, demand: None, worker: None })
    }

    pub fn catalog(&self) -> &Catalog {
        &self.shared.catalog
    }

    /// This run's routing census so far.
    pub fn census(&self) -> Census {
        lock(&self.shared.census).clone()
    }

    /// Resolve every selection of one step of `layer`.
    pub fn resolve(&self, layer: u32, selections: &[Selection]) -> Result<StepGuard<'_>> {
        self.resolve_with(layer, selections, &|_| true)
    }

    /// Resolve a step, serving only experts for which `mine` is true; the
    /// others (placed on another device) are neither loaded nor pointed to.
    pub fn resolve_with(&self, layer: u32, selections: &[Selection], mine: &dyn Fn(u32) -> bool) -> Result<StepGuard<'_>> {
        self.resolve_streaming(layer, selections, mine, &mut |_, _| Ok(()))
    }

    /// [`resolve_with`](Self::resolve_with), handing each slab to `on_ready`
    /// as soon as its bytes are in place (host-cache hits at once, disk reads
    /// as each completes), so a consumer (the GPU's copy stream) starts on
    /// them while the rest are still being read. The bytes stay valid while
    /// the returned guard lives. An error from `on_ready` ends the step.
    pub fn resolve_streaming(
        &self,
        layer: u32,
        selections: &[Selection],
        mine: &dyn Fn(u32) -> bool,
        on_ready: &mut dyn FnMut(SlabId, &[u8]) -> std::result::Result<(), String>,
    ) -> Result<StepGuard<'_>> {
        let cat = &self.shared.catalog;
        let mut all: Vec<u32> = selections.iter().map(|s| s.expert).collect();
        all.sort_unstable();
        all.dedup();
        let mut experts = Vec::with_capacity(all.len());
        let mut stats = StepStats { layer, ..Default::default() };
        stats.tiers.selections = selections.len() as u64;
        let mut ids = Vec::new();
        for &e in &all {
            let t = cat.triple(layer, e).ok_or(StoreError::UnknownExpert { layer, expert: e })?;
            if mine(e) {
                experts.push(e);
                ids.extend(t.slabs());
            } else {
                for id in t.slabs() {
                    stats.tiers.elsewhere.add(cat.loc(id)?.bytes);
                }
            }
        }
        stats.tiers.experts = experts.len() as u64;
        {
            let mut census = lock(&self.shared.census);
            for s in selections {
                census.record(layer, s.expert, 1);
            }
        }
        if let Some(pred) = lock(&self.shared.predictions).remove(&layer) {
            let mut c = lock(&self.shared.counters);
            c.prefetch.predicted += pred.len() as u64;
            c.prefetch.used += all.len() as u64;
            c.prefetch.predicted_used += pred.iter().filter(|e| all.binary_search(e).is_ok()).count() as u64;
        }
        let mut guard = StepGuard { store: self, layer, selections: selections.to_vec(), experts, slabs: HashMap::with_capacity(ids.len()), stats };
        match &self.shared.backing {
            Backing::Mapped(shards) => {
                for id in ids {
                    let loc = cat.loc(id)?;
                    let b = &shards[usize::from(loc.file)].bytes()[loc.offset as usize..(loc.offset + loc.bytes) as usize];
                    guard.stats.tiers.mapped.add(loc.bytes);
                    guard.slabs.insert(id, SlabRef::Mapped(b));
                    on_ready(id, b).map_err(|reason| StoreError::Consumer { slab: id, reason })?;
                }
            }
            Backing::Cached(cs) => self.acquire(cs, ids, &mut guard, on_ready)?,
        }
        let mut c = lock(&self.shared.counters);
        c.steps += 1;
        c.total.merge(&guard.stats.tiers);
        c.last = Some(guard.stats);
        Ok(guard)
    }

    /// Pin hits, read misses, and wait for slabs a prefetch is reading. Never
    /// waits while holding reservations of its own (so two steps cannot wait
    /// on each other): reserved misses are read first.
    #[allow(clippy::type_complexity)]
    fn acquire<'a>(
        &'a self,
        cs: &'a CacheState,
        ids: Vec<SlabId>,
        guard: &mut StepGuard<'a>,
        on_ready: &mut dyn FnMut(SlabId, &[u8]) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let cat = &self.shared.catalog;
        let budget = lock(&cs.cache).budget();
        let mut todo = ids;
        loop {
            let mut misses: Vec<(SlabId, SlabLoc, AlignedBuf, u64)> = Vec::new();
            let mut waiting = Vec::new();
            // Hits are handed on after the cache lock is released.
            let mut hits: Vec<SlabId> = Vec::new();
            let mut no_room = 0u64;
            {
                let mut cache = lock(&cs.cache);
                for id in todo.drain(..) {
                    let loc = *cat.loc(id)?;
                    match cache.lookup_pin(id) {
                        Lookup::Hit { data, prefetched } => {
                            guard.stats.tiers.host.add(loc.bytes);
                            if prefetched {
                                guard.stats.tiers.host_prefetched.add(loc.bytes);
                            }
                            guard.slabs.insert(id, SlabRef::Cached(data));
                            hits.push(id);
                        }
                        Lookup::Pending => waiting.push(id),
                        Lookup::Miss => {
                            let cost = cs.cost(&loc);
                            let reserved = match cache.reserve(id, cost, Owner::Demand) {
                                Ok(r) => r,
                                Err(e) => {
                                    for (id, _, _, cost) in misses.drain(..) {
                                        cache.cancel(id, cost, Owner::Demand, None);
                                    }
                                    return Err(e);
                                }
                            };
                            match reserved {
                                Some(buf) => misses.push((id, loc, buf, cost)),
                                None => {
                                    no_room += cost;
                                    waiting.push(id);
                                }
                            }
                        }
                    }
                }
            }
            let handed = hits.iter().try_for_each(|&id| {
                let b = guard.slabs.get(&id).map(SlabRef::bytes).unwrap_or(&[]);
                on_ready(id, b).map_err(|reason| StoreError::Consumer { slab: id, reason })
            });
            if let Err(e) = handed {
                let mut cache = lock(&cs.cache);
                for (id, _, _, cost) in misses.drain(..) {
                    cache.cancel(id, cost, Owner::Demand, None);
                }
                cs.changed.notify_all();
                return Err(e);
            }
            if !misses.is_empty() {
                self.read_misses(cs, misses, guard, on_ready)?;
            }
            if waiting.is_empty() {
                return Ok(());
            }
            let cache = lock(&cs.cache);
            let pending = waiting.iter().any(|&id| cache.is_pending(id));
            let room_may_free = no_room > 0 && cache.reserved(Owner::Prefetch) > 0;
            if no_room > 0 && !pending && !room_may_free && cache.available() < no_room {
                return Err(StoreError::StepOverBudget { layer: guard.layer, needed: no_room, available: cache.available(), budget });
            }
            if pending || room_may_free {
                drop(cs.changed.wait(cache).unwrap_or_else(|e| e.into_inner()));
            }
            todo = waiting;
        }
    }

    #[allow(clippy::type_complexity)]
    fn read_misses<'a>(
        &'a self,
        cs: &'a CacheState,
        misses: Vec<(SlabId, SlabLoc, AlignedBuf, u64)>,
        guard: &mut StepGuard<'a>,
        on_ready: &mut dyn FnMut(SlabId, &[u8]) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let costs: HashMap<SlabId, u64> = misses.iter().map(|m| (m.0, m.3)).collect();
        let reqs: Vec<SlabRead> = misses.into_iter().map(|(id, loc, buf, _)| SlabRead { id, loc, buf }).collect();
        let mut delivered = HashSet::new();
        let reader = self.demand.as_ref().expect("cached stores have a demand reader");
        let t0 = Instant::now();
        let res = lock(reader).read(reqs, &mut |data| {
            let id = data.id();
            let bytes = data.bytes().len() as u64;
            let arc = lock(&cs.cache).fill(data, costs[&id], Owner::Demand, true);
            cs.changed.notify_all();
            delivered.insert(id);
            guard.stats.tiers.disk.add(bytes);
            let r = on_ready(id, arc.bytes()).map_err(|reason| StoreError::Consumer { slab: id, reason });
            guard.slabs.insert(id, SlabRef::Cached(arc));
            r
        });
        guard.stats.tiers.disk_seconds += t0.elapsed().as_secs_f64();
        if res.is_err() {
            let mut cache = lock(&cs.cache);
            for (&id, &cost) in costs.iter().filter(|(id, _)| !delivered.contains(id)) {
                cache.cancel(id, cost, Owner::Demand, None);
            }
            cs.changed.notify_all();
        }
        res
    }

    /// Queue the slabs of `experts` of `layer` (predicted for a coming step)
    /// for background reading. Returns how many slabs were queued; the rest
    /// were resident already or refused by the caps. The prediction is scored
    /// against what `resolve(layer, ..)` then uses.
    pub fn prefetch(&self, layer: u32, experts: &[u32]) -> usize {
        let mut pred: Vec<u32> = experts.iter().copied().filter(|&e| self.shared.catalog.triple(layer, e).is_some()).collect();
        pred.sort_unstable();
        pred.dedup();
        let queued = match &self.worker {
            Some(w) => w.enqueue(layer, &pred),
            None => 0,
        };
        lock(&self.shared.predictions).insert(layer, pred);
        queued
    }

    /// Block until the prefetch queue is empty and nothing is being read.
    pub fn wait_prefetch_idle(&self) {
        if let Some(w) = &self.worker {
            w.wait_idle();
        }
    }

    pub fn stats(&self) -> StoreStats {
        let c = lock(&self.shared.counters);
        let (mode, cache) = match &self.shared.backing {
            Backing::Mapped(_) => ("mapped", None),
            Backing::Cached(cs) => ("cached", Some(lock(&cs.cache).counters())),
        };
        StoreStats {
            mode: mode.into(),
            steps: c.steps,
            total: c.total,
            last_step: c.last,
            prefetch: c.prefetch,
            cache,
            disk_reader: self.demand.as_ref().map(|r| lock(r).counters()),
        }
    }
}

impl<'a> StepGuard<'a> {
    pub fn layer(&self) -> u32 {
        self.layer
    }

    /// Experts this store serves in the step, ascending.
    pub fn experts(&self) -> &[u32] {
        &self.experts
    }

    pub fn selections(&self) -> &[Selection] {
        &self.selections
    }

    pub fn stats(&self) -> &StepStats {
        &self.stats
    }

    pub fn slab(&self, id: SlabId) -> Option<&[u8]> {
        (id.layer == self.layer).then(|| self.slabs.get(&id).map(SlabRef::bytes)).flatten()
    }

    pub fn triple(&self, expert: u32) -> Option<TripleBytes<'_>> {
        let t = self.store.catalog().triple(self.layer, expert)?;
        let get = |k| self.slab(SlabId::new(self.layer, k, expert));
        Some(match t.layout {
            TripleLayout::Separate => TripleBytes::Separate { gate: get(SlabKind::Gate)?, up: get(SlabKind::Up)?, down: get(SlabKind::Down)? },
            TripleLayout::Fused => TripleBytes::Fused { gate_up: get(SlabKind::GateUp)?, down: get(SlabKind::Down)? },
        })
    }

    /// For each selection (same order as given to resolve), the bytes of its
    /// expert's `kind` slab; `None` where the expert is not ours (or the
    /// layer has no such kind).
    pub fn per_selection(&self, kind: SlabKind) -> Vec<Option<&[u8]>> {
        self.selections.iter().map(|s| self.slab(SlabId::new(self.layer, kind, s.expert))).collect()
    }

    /// [`StepGuard::per_selection`] as raw pointers for a kernel launch: null
    /// means "not mine". Valid while this guard lives.
    pub fn pointers(&self, kind: SlabKind) -> Vec<*const u8> {
        self.per_selection(kind).into_iter().map(|b| b.map_or(std::ptr::null(), <[u8]>::as_ptr)).collect()
    }
}

impl Drop for StepGuard<'_> {
    fn drop(&mut self) {
        if let Backing::Cached(cs) = &self.store.shared.backing {
            let mut cache = lock(&cs.cache);
            for (id, r) in self.slabs.drain() {
                if matches!(r, SlabRef::Cached(_)) {
                    drop(r);
                    cache.unpin(id);
                }
            }
            cs.changed.notify_all();
        }
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        if let Some(w) = self.worker.take() {
            w.shutdown();
        }
    }
}
