//! The expert store behind the MoE op: the slab catalogue built from a
//! model's routed-expert weights, and an [`ExpertSource`] that resolves each
//! layer's experts through the store's tiers (host cache over NVMe).

use std::collections::HashMap;
use std::sync::Arc;

use pulsar_plugin_api::Role;
use pulsar_store::{Catalog, ExpertStore, Selection, SlabId, SlabLoc, StoreConfig};

use crate::cpu::moe::{experts_of, slab_kind, ExpertSource, SlabBytes, SlabLookup};
use crate::model::{Model, Weight};

/// One catalogue entry per (layer, kind, expert) of every routed-expert weight.
pub fn catalog(model: &Model) -> anyhow::Result<Catalog> {
    let mut entries = Vec::new();
    for w in model.weights.iter().filter(|w| w.role == Role::RoutedExpert) {
        let kind = slab_kind(&w.name).ok_or_else(|| anyhow::anyhow!("{}: not a known expert tensor name", w.name))?;
        let layer = w.layer.ok_or_else(|| anyhow::anyhow!("{}: an expert weight outside the blocks", w.name))?;
        let t = model.tensor(w);
        let n = t.n_experts().ok_or_else(|| anyhow::anyhow!("{}: not a 3-D expert tensor", w.name))?;
        for e in 0..n {
            let r = model.file.expert_slab(t, e)?;
            let loc = SlabLoc { file: r.shard as u16, offset: r.offset, bytes: r.len, ty: t.ty, rows: t.dims[1], cols: t.dims[0] };
            entries.push((SlabId::new(layer, kind, e as u32), loc));
        }
    }
    Ok(Catalog::new(model.file.shard_paths().to_vec(), entries)?)
}

/// Hit rates per tier since the start, for `/metrics` and reports.
pub fn tier_hit_rates(s: &pulsar_store::StoreStats) -> serde_json::Value {
    let t = &s.total;
    let n = (t.host.slabs + t.disk.slabs + t.mapped.slabs).max(1) as f64;
    serde_json::json!({
        "host": t.host.slabs as f64 / n,
        "disk": t.disk.slabs as f64 / n,
        "resident": t.mapped.slabs as f64 / n,
    })
}

/// Experts served by an [`ExpertStore`].
pub struct StoreExperts {
    pub store: ExpertStore,
    /// A budgeted host cache over the disk (else the file mappings).
    pub cached: bool,
}

impl StoreExperts {
    /// A store with a host cache of `host_budget` bytes over the model's files.
    pub fn open(model: &Model, host_budget: u64) -> anyhow::Result<StoreExperts> {
        Self::open_with(model, host_budget, None)
    }

    /// As [`StoreExperts::open`], the cache's memory from `alloc` (page-locked
    /// memory for a GPU backend).
    pub fn open_with(model: &Model, host_budget: u64, alloc: Option<Arc<dyn pulsar_store::HostAllocator>>) -> anyhow::Result<StoreExperts> {
        let cat = Arc::new(catalog(model)?);
        let mut cfg = StoreConfig::new(host_budget);
        if let Some(a) = alloc {
            cfg.allocator = a;
        }
        Ok(StoreExperts { store: ExpertStore::open(cat, cfg)?, cached: true })
    }

    /// Everything resident: slabs straight from memory maps of the files (the
    /// census and stats still count every selection).
    pub fn mapped(model: &Model) -> anyhow::Result<StoreExperts> {
        let cat = Arc::new(catalog(model)?);
        let mut shards: Vec<Arc<dyn pulsar_store::ShardBytes>> = Vec::new();
        for p in model.file.shard_paths() {
            let f = std::fs::File::open(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            // SAFETY: the file is opened read-only and never written by us;
            // GgufFile maps the same file the same way.
            let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            shards.push(Arc::new(m));
        }
        Ok(StoreExperts { store: ExpertStore::mapped(cat, shards)?, cached: false })
    }

    /// Save this run's census into the model's `.warm` sidecar (merged with
    /// earlier runs, written atomically).
    pub fn save_census(&self, model_path: &std::path::Path, model: &Model) -> anyhow::Result<std::path::PathBuf> {
        let path = pulsar_store::sidecar_path(model_path);
        pulsar_store::save_sidecar(&path, &model.file.fingerprint(), &self.store.census())?;
        Ok(path)
    }
}

impl StoreExperts {
    /// Resolve `experts` together; when the host cache cannot hold them all
    /// at once (a prefill chunk touching many experts under a small budget),
    /// serve them in halves, each released before the next is loaded.
    fn serve(
        &self,
        layer: u32,
        experts: &[u32],
        sel: &[Selection],
        kinds: &HashMap<usize, pulsar_store::SlabKind>,
        f: &mut dyn FnMut(&dyn SlabLookup, &[u32]) -> Result<(), String>,
    ) -> Result<(), String> {
        let mine: Vec<Selection> = sel.iter().filter(|s| experts.binary_search(&s.expert).is_ok()).copied().collect();
        match self.store.resolve(layer, &mine) {
            Ok(guard) => f(&GuardLookup { guard: &guard, layer, kinds }, experts),
            Err(pulsar_store::StoreError::StepOverBudget { .. }) if experts.len() > 1 => {
                let (a, b) = experts.split_at(experts.len() / 2);
                self.serve(layer, a, sel, kinds, f)?;
                self.serve(layer, b, sel, kinds, f)
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

struct GuardLookup<'g, 's> {
    guard: &'g pulsar_store::StepGuard<'s>,
    layer: u32,
    kinds: &'g HashMap<usize, pulsar_store::SlabKind>,
}

impl SlabLookup for GuardLookup<'_, '_> {
    fn slab(&self, w: &Weight, expert: u32) -> Result<SlabBytes<'_>, String> {
        let kind = self.kinds.get(&w.tensor).copied().or_else(|| slab_kind(&w.name)).ok_or_else(|| format!("{}: not an expert tensor", w.name))?;
        let id = SlabId::new(self.layer, kind, expert);
        self.guard.slab(id).ok_or_else(|| format!("{id}: not resolved for this step"))
    }
}

impl ExpertSource for StoreExperts {
    fn with_layer(&self, model: &Model, layer: u32, sel: &[Selection], f: &mut dyn FnMut(&dyn SlabLookup, &[u32]) -> Result<(), String>) -> Result<(), String> {
        let kinds: HashMap<usize, pulsar_store::SlabKind> = model
            .weights
            .iter()
            .filter(|w| w.role == Role::RoutedExpert && w.layer == Some(layer))
            .filter_map(|w| slab_kind(&w.name).map(|k| (w.tensor, k)))
            .collect();
        self.serve(layer, &experts_of(sel), sel, &kinds, f)
    }

    fn prefetch(&self, layer: u32, experts: &[u32]) {
        self.store.prefetch(layer, experts);
    }
}

/// How routed experts are served: `None` for a model without routed experts;
/// everything resident (mapped) when they fit in available memory and no
/// budget is given; else a host cache of `host_cache` GiB (or the default budget).
pub fn experts_for(model: &Model, host_cache: Option<f64>) -> anyhow::Result<Option<StoreExperts>> {
    experts_for_with(model, host_cache, None)
}

/// As [`experts_for`], a budgeted cache's memory from `alloc`.
pub fn experts_for_with(model: &Model, host_cache: Option<f64>, alloc: Option<Arc<dyn pulsar_store::HostAllocator>>) -> anyhow::Result<Option<StoreExperts>> {
    let expert_bytes = model.memory_plan().expert_bytes;
    if expert_bytes == 0 {
        return Ok(None);
    }
    let budget = match host_cache {
        Some(gb) => Some(pulsar_store::budget_from_gib(gb)?),
        None => match pulsar_store::default_host_budget() {
            Ok(b) if b >= expert_bytes => None,
            Ok(b) => Some(b),
            Err(e) => {
                tracing::warn!("{e}; serving experts from the file mapping");
                None
            }
        },
    };
    Ok(Some(match budget {
        Some(b) => {
            tracing::info!("expert store: host cache of {:.2} GiB over {:.2} GiB of experts", b as f64 / (1u64 << 30) as f64, expert_bytes as f64 / (1u64 << 30) as f64);
            StoreExperts::open_with(model, b, alloc)?
        }
        None => StoreExperts::mapped(model)?,
    }))
}

