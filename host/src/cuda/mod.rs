//! The CUDA backend: executes a plugin's ops on the GPU with the kernels of
//! `pulsar-cuda`, the same op semantics as the CPU backend (each kernel has a
//! CPU twin there).
//!
//! Memory: every resident weight (everything but routed experts) is uploaded
//! once at load. Routed experts are uploaded whole when they fit the VRAM
//! budget, with per-expert pointer tables on the device so a MoE layer routes
//! and runs with no host round trip. Otherwise they stream through a fixed
//! pool of expert slots in VRAM: the hot set (tier 2, admission by heat, warm
//! loaded from the census) plus scratch slots for one layer's cold slabs.
//! The file mapping is page-locked in place when host memory allows, so cold
//! slabs are copied on the copy stream at pinned speed or read in place by
//! the kernels (zero-copy). Activations come from a pool reused across steps,
//! so after the first step a decode allocates nothing.

mod fuse;
mod lower;
mod measure;
pub mod opcheck;
mod pinned;
pub mod prim;
pub(crate) mod pool;
mod profile;
pub mod roles;
mod seqs;
mod step;

use std::collections::HashMap;
use std::sync::Mutex;

use pulsar_cuda::{CudaDevice, DeviceBuf};
use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::KvType;
use pulsar_plugin_api::graph::{Op, Rope};
use pulsar_plugin_api::Role;

use crate::model::Model;

pub use measure::measure_h2d;
pub use pinned::{PinnedAllocator, PinnedRanges};
pub use pool::{ExpertPool, LayerPlan, LayerRequest, PoolStats};
pub use seqs::CudaSeqs;
pub use step::{CudaEngine, CudaRunner, CudaSnapshot};

#[derive(Debug, thiserror::Error)]
pub enum CudaBackendError {
    #[error("CUDA: {0}")]
    Cuda(#[from] pulsar_cuda::CudaError),
    #[error("{0}")]
    Other(String),
}

/// A weight on the device.
pub struct DevWeight {
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    /// Raw bytes (None for streamed routed experts).
    pub raw: Option<DeviceBuf<u8>>,
    /// Dequantized f32 values for vectors (norm weights) and the weights a
    /// graph reads as values.
    pub f32: Option<DeviceBuf<f32>>,
}

/// A model's weights on one GPU.
pub struct CudaModel {
    pub dev: CudaDevice,
    pub weights: Vec<DevWeight>,
    /// Each YaRN rope of the graphs with its inverse frequencies.
    pub rope_freq: Vec<(Rope, DeviceBuf<f32>)>,
    /// Per-expert device addresses of each resident routed-expert weight
    /// (by weight index), for the on-device pointer gather.
    pub expert_tables: HashMap<usize, DeviceBuf<u64>>,
    /// Some: routed experts stream through this pool.
    pub experts: Option<Mutex<ExpertPool>>,
    /// Routed-expert weights by (layer, slab kind): index into the model's weights.
    pub slab_index: HashMap<(u32, pulsar_store::SlabKind), usize>,
    /// Copy the next layer's predicted cold slabs ahead in decode.
    pub prefetch: bool,
    /// How cold slabs are served in decode steps (`--cold-path`).
    pub cold: crate::cold::ColdPolicy,
    /// The CPU lane for cold experts (streaming runs with lane threads).
    pub lane: Option<crate::cold::CpuLane>,
    /// Measured rates the cold-path split reads; the CPU lane's rate is
    /// refined from its real steps (a microbenchmark on synthetic experts
    /// overstates what a sub-millisecond share of one layer achieves).
    pub cost: Mutex<crate::cold::CostModel>,
    pub resident_bytes: u64,
    /// Largest prefill chunk: with streamed experts, what the activation
    /// reserve kept inside the VRAM budget holds.
    pub max_chunk: usize,
    /// Bytes of the budget kept for a chunk's activations (streaming only).
    pub activation_reserve: u64,
    /// Decode steps may be captured as CUDA graphs: every expert is resident,
    /// so a step runs with no host round trip.
    pub graphs: bool,
}

/// Most tokens of one prefill step on the GPU.
pub const MAX_CHUNK: usize = 512;

/// Expert slots a streaming model needs at least: three hot and three
/// scratch (one expert's gate, up and down; a layer's fill runs in passes).
pub const MIN_EXPERT_SLOTS: usize = 6;

/// The prefill chunk for a streaming model: the largest power of two up to
/// [`MAX_CHUNK`] whose activations take at most a sixteenth of what the budget
/// leaves after the resident weights and KV (the rest holds expert slabs), and
/// the bytes to reserve for it.
pub fn chunk_for_budget(room: u64, per_token: u64) -> (usize, u64) {
    let mut chunk = MAX_CHUNK;
    while chunk > 16 && per_token * chunk as u64 > room / 16 {
        chunk /= 2;
    }
    (chunk, per_token * chunk as u64)
}

/// How [`CudaModel::load`] places a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Caps what weights, KV and pools may occupy (emulates a smaller card).
    pub vram_budget: Option<u64>,
    pub kv_bytes: u64,
    /// Expert popularity from earlier runs (or a built-in hotlist): the hot
    /// set is warm-loaded with its hottest triples.
    pub census: Option<pulsar_store::Census>,
    /// How decode's cold experts are served (auto splits by measured cost).
    pub cold: crate::cold::ColdPolicy,
    /// CPU lane threads (None: half the cores; 0: no CPU lane).
    pub lane_threads: Option<usize>,
    /// The host thread waits for the CPU lane's jobs instead of the GPU
    /// waiting on a host flag.
    pub lane_sync: bool,
    /// Never page-lock the file mapping (uploads then go pageable).
    pub no_pin: bool,
    /// Do not copy the next layer's predicted experts ahead in decode.
    pub no_prefetch: bool,
    /// Never capture decode steps as CUDA graphs.
    pub no_graphs: bool,
    /// Never launch kernels with programmatic dependent launch.
    pub no_pdl: bool,
}

/// Whether the CUDA backend can run `model`'s step graphs: the lowering of
/// both, or the first node it has no kernel for. Needs no GPU.
pub fn lowers(model: &Model) -> Result<(), String> {
    lower::Lowering::new(&model.steps.decode)?;
    lower::Lowering::new(&model.steps.prefill).map(|_| ())
}

/// The fused launches the CUDA step finds in `model`'s decode and prefill
/// graphs (checked without a GPU): norm + rope pairs, MoE combines with
/// their residual add, and groups of linear ops on one input.
pub fn fusions(model: &Model) -> Result<[Fusions; 2], String> {
    let count = |p| {
        lower::Lowering::new(p).map(|l| {
            let (norm_rope, combine_add, linear_groups) = l.fusions();
            Fusions { norm_rope, combine_add, linear_groups }
        })
    };
    Ok([count(&model.steps.decode)?, count(&model.steps.prefill)?])
}

/// How many of each fused launch a step graph allows ([`fusions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fusions {
    pub norm_rope: usize,
    pub combine_add: usize,
    pub linear_groups: usize,
}

/// Free device memory minus a reserve for activations, KV and the driver.
pub fn default_vram_budget(dev: &CudaDevice) -> Result<u64, CudaBackendError> {
    let (free, _total) = dev.memory()?;
    Ok((free as u64).saturating_sub(2 << 30))
}

impl CudaModel {
    /// Upload `model`'s weights. `vram_budget` caps what weights may occupy
    /// (emulating a smaller card); experts beyond it stream.
    pub fn load(dev: CudaDevice, model: &Model, opts: &LoadOptions) -> Result<CudaModel, CudaBackendError> {
        let kv_bytes = opts.kv_bytes;
        let budget = match opts.vram_budget {
            Some(b) => b,
            None => default_vram_budget(&dev)?,
        };
        let mem = model.memory_plan();
        let fixed = mem.resident_bytes + kv_bytes;
        if fixed > budget {
            return Err(CudaBackendError::Other(format!(
                "the resident weights and KV cache need {}, more than the VRAM budget of {}",
                size(fixed),
                size(budget)
            )));
        }
        let stream_experts = mem.expert_bytes > budget - fixed;
        let (mut max_chunk, mut activation_reserve) = (MAX_CHUNK, 0u64);
        let stream = dev.compute().clone();
        let mut weights = Vec::with_capacity(model.weights.len());
        let mut resident = 0u64;
        // Weights the graphs read as values (and the convs' taps) are kept as f32 too.
        let as_values: std::collections::HashSet<u32> = [&model.steps.decode, &model.steps.prefill]
            .iter()
            .flat_map(|p| p.ops.iter())
            .filter_map(|op| match op {
                Op::Weight(w) | Op::ShortConv { weight: w, .. } | Op::ConvRows { weight: w, .. } => Some(w.0),
                _ => None,
            })
            .collect();
        let to_upload: u64 = model.weights.iter().filter(|w| !(w.role == Role::RoutedExpert && stream_experts)).map(|w| w.bytes).sum();
        let bar = crate::progress::bytes_bar(to_upload, format!("uploading to {}", dev.name()));
        for (wi, w) in model.weights.iter().enumerate() {
            let expert = w.role == Role::RoutedExpert;
            let raw = if expert && stream_experts {
                None
            } else {
                let bytes = model.data(w);
                let mut b = dev.alloc::<u8>(bytes.len())?;
                b.upload(&stream, bytes)?;
                resident += bytes.len() as u64;
                bar.inc(bytes.len() as u64);
                Some(b)
            };
            let f32 = if w.dims.len() == 1 || as_values.contains(&(wi as u32)) {
                let mut v = vec![0f32; w.dims.iter().product::<u64>() as usize];
                pulsar_kernels::dequantize(w.ty, model.data(w), &mut v).map_err(|e| CudaBackendError::Other(format!("{}: {e}", w.name)))?;
                if w.dims.len() > 1 {
                    resident += 4 * v.len() as u64;
                }
                Some(dev.upload(&v)?)
            } else {
                None
            };
            weights.push(DevWeight { ty: w.ty, dims: w.dims.clone(), raw, f32 });
        }
        bar.finish_and_clear();
        // The YaRN ropes' frequency tables, by the CPU's formula.
        let mut rope_freq: Vec<(Rope, DeviceBuf<f32>)> = Vec::new();
        for op in [&model.steps.decode, &model.steps.prefill].iter().flat_map(|p| p.ops.iter()) {
            if let Op::Rope(r) = op {
                if let (Some(f), false) = (crate::cpu::prim::rope_freq(r), rope_freq.iter().any(|(q, _)| q == r)) {
                    rope_freq.push((*r, dev.upload(&f)?));
                }
            }
        }
        let mut expert_tables = HashMap::new();
        if !stream_experts {
            for (i, (w, dw)) in model.weights.iter().zip(&weights).enumerate() {
                if let (Role::RoutedExpert, Some(raw)) = (w.role, &dw.raw) {
                    let n = w.dims.get(2).copied().unwrap_or(1).max(1) as usize;
                    let slab = w.bytes as usize / n;
                    let tab: Vec<u64> = (0..n).map(|e| raw.device_ptr_at(e * slab)).collect::<Result<_, _>>()?;
                    expert_tables.insert(i, dev.upload(&tab)?);
                }
            }
        }
        let slab_index = slab_tensors(model);
        let experts = if stream_experts {
            let slot_bytes = model
                .weights
                .iter()
                .filter(|w| w.role == Role::RoutedExpert)
                .map(|w| w.bytes / w.dims.get(2).copied().unwrap_or(1).max(1))
                .max()
                .unwrap_or(0);
            let n_exp = model.weights.iter().filter(|w| w.role == Role::RoutedExpert).filter_map(|w| w.dims.get(2)).copied().max().unwrap_or(1) as usize;
            let n_moe_layers = model.weights.iter().filter(|w| w.role == Role::RoutedExpert).filter_map(|w| w.layer).collect::<std::collections::BTreeSet<_>>().len().max(1);
            // Scratch for one layer's cold slabs and the tables come out of the
            // budget too, and so do a prefill chunk's activations.
            let (chunk, reserve) = chunk_for_budget(budget - fixed, mem.activation_bytes_per_token);
            (max_chunk, activation_reserve) = (chunk, reserve);
            tracing::info!("prefill chunks of up to {chunk} tokens: {:.0} MiB of the budget kept for activations", reserve as f64 / (1u64 << 20) as f64);
            let room = (budget - fixed).saturating_sub(reserve);
            let n_slots = (room / slot_bytes.max(1)) as usize;
            // The least that runs: the smallest chunk's activations and six
            // slots (half hot, half scratch: one expert's three slabs, a
            // layer's fill then runs in as many passes as it needs).
            let least = fixed + chunk_for_budget(0, mem.activation_bytes_per_token).1 + MIN_EXPERT_SLOTS as u64 * slot_bytes;
            tracing::info!("the smallest --vram-budget that runs this model: {} (resident weights and KV {}, {MIN_EXPERT_SLOTS} expert slots of {})", size(least), size(fixed), size(slot_bytes));
            if n_slots < MIN_EXPERT_SLOTS {
                return Err(CudaBackendError::Other(format!(
                    "the VRAM budget of {} leaves room for {n_slots} expert slabs, fewer than the {MIN_EXPERT_SLOTS} streaming needs: raise --vram-budget to at least {}",
                    size(budget),
                    size(least)
                )));
            }
            // Heat halves over about 256 tokens (one hot-set step per MoE layer).
            let mut pool = ExpertPool::new(&dev, slot_bytes as usize, n_slots, n_exp, 256.0 * n_moe_layers as f64)?;
            if !opts.no_pin {
                pin_mapping(&dev, model, mem.expert_bytes, &mut pool);
            }
            if !opts.lane_sync && !pool.enable_async_lane(&dev) {
                tracing::info!("this device cannot wait on host flags: the CPU lane's jobs block the host thread");
            }
            if let Some(census) = opts.census.as_ref().filter(|c| !c.is_empty()) {
                let cat = crate::experts::catalog(model).map_err(|e| CudaBackendError::Other(e.to_string()))?;
                pool.warm_load(&dev, &cat, census, &|id| {
                    let &w = slab_index.get(&(id.layer, id.kind)).ok_or_else(|| format!("{id}: no such expert tensor"))?;
                    let t = model.tensor(&model.weights[w]);
                    let r = model.file.expert_slab(t, id.expert as u64).map_err(|e| e.to_string())?;
                    model.file.bytes(&r).map_err(|e| e.to_string())
                })?;
                tracing::info!("hot set warm-loaded with {} slabs from the census", pool.stats.warm_loaded);
            }
            Some(Mutex::new(pool))
        } else {
            None
        };
        let (lane, cost) = match &experts {
            Some(_) => cold_lane(&dev, model, opts)?,
            None => (None, crate::cold::CostModel::default()),
        };
        let graphs = experts.is_none() && !opts.no_graphs;
        dev.set_programmatic_launch(!opts.no_pdl);
        Ok(CudaModel { dev, weights, rope_freq, expert_tables, experts, slab_index, prefetch: !opts.no_prefetch, cold: opts.cold, lane, cost: Mutex::new(cost), resident_bytes: resident, max_chunk, activation_reserve, graphs })
    }

    /// Let the VRAM pool copy asynchronously from the store's page-locked host cache.
    pub fn set_host_pinned(&self, r: PinnedRanges) {
        if let Some(p) = &self.experts {
            p.lock().unwrap_or_else(|e| e.into_inner()).set_host_pinned(r);
        }
    }

    pub fn pool_stats(&self) -> Option<PoolStats> {
        self.experts.as_ref().map(|p| p.lock().unwrap_or_else(|e| e.into_inner()).stats.clone())
    }
}

/// Expert popularity to warm-load the hot set with: the model's census
/// sidecar when there is a valid one, else the family's built-in hotlist.
pub fn warm_census(model_path: &std::path::Path, model: &Model) -> Option<pulsar_store::Census> {
    let side = pulsar_store::sidecar_path(model_path);
    match pulsar_store::load_sidecar(&side, &model.file.fingerprint()) {
        pulsar_store::SidecarLoad::Loaded(c) if !c.is_empty() => Some(c),
        _ => pulsar_store::builtin_hotlist(&model.arch).map(|h| h.to_census()).filter(|c| !c.is_empty()),
    }
}

impl CudaModel {
    /// Merge this run's expert selections (streaming runs only) into the
    /// model's census sidecar; `None` when nothing was recorded.
    pub fn save_census(&self, model_path: &std::path::Path, model: &Model) -> anyhow::Result<Option<std::path::PathBuf>> {
        let Some(p) = &self.experts else { return Ok(None) };
        let census = p.lock().unwrap_or_else(|e| e.into_inner()).census().clone();
        if census.is_empty() {
            return Ok(None);
        }
        let path = pulsar_store::sidecar_path(model_path);
        pulsar_store::save_sidecar(&path, &model.file.fingerprint(), &census)?;
        Ok(Some(path))
    }
}

/// The CPU lane and the cost model the cold-path split reads: pinned
/// host-to-device rate measured here, the lane's dot rate per expert format
/// measured on the lane itself.
fn cold_lane(dev: &CudaDevice, model: &Model, opts: &LoadOptions) -> Result<(Option<crate::cold::CpuLane>, crate::cold::CostModel), CudaBackendError> {
    use crate::cold::{ColdPath, ColdPolicy};
    // Half the cores by default: on the H200 host 8 spinning lane threads
    // tie 12 (one run each way, within the noise) and beat 6; 16 under rayon
    // lost to 4-8, whose fork-join cost on a layer's few experts outweighed
    // the extra bandwidth (docs/perf.md, session 8).
    let threads = opts.lane_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)));
    let wants_lane = threads > 0 && matches!(opts.cold, ColdPolicy::Auto | ColdPolicy::Force(ColdPath::Cpu));
    let mut types: Vec<GgmlType> = model.weights.iter().filter(|w| w.role == Role::RoutedExpert).map(|w| w.ty).collect();
    types.sort_by_key(|t| t.name());
    types.dedup();
    let t = std::time::Instant::now();
    let (lane, mut cost) = if wants_lane {
        let lane = crate::cold::CpuLane::new(threads).map_err(|e| CudaBackendError::Other(e.to_string()))?;
        let mut cost = crate::cold::CostModel::default();
        cost.measure_cpu(&lane, &types, std::time::Duration::from_millis(150 * types.len() as u64));
        (Some(lane), cost)
    } else {
        (None, crate::cold::CostModel::default())
    };
    cost.h2d_pinned_gbs = measure_h2d(dev).ok();
    cost.h2d_pageable_gbs = measure::measure_h2d_pageable(dev).ok();
    // The kernels on the model's own expert shape, weights in VRAM and in place in host memory.
    let slabs = slab_tensors(model);
    let first = slabs.keys().map(|k| k.0).min();
    let shape = first.and_then(|l| Some((&model.weights[*slabs.get(&(l, pulsar_store::SlabKind::Gate))?], &model.weights[*slabs.get(&(l, pulsar_store::SlabKind::Down))?])));
    if let Some((g, d)) = shape {
        let (d_model, ff) = (g.dims[0] as usize, g.dims[1] as usize);
        let read = |in_place| match measure::measure_expert_read(dev, g.ty, d.ty, d_model, ff, in_place) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!("cold path: not measuring the expert kernels ({}): {e}", if in_place { "zero-copy" } else { "VRAM" });
                None
            }
        };
        cost.gpu_gemv_gbs = read(false);
        cost.zerocopy_gbs = read(true);
    }
    tracing::info!("cold path ({:?}), measured in {:.2} s:\n{}", opts.cold, t.elapsed().as_secs_f64(), cost.summary());
    Ok((lane, cost))
}

/// Expert weights by (layer, slab kind): the index into `model.weights`.
pub(crate) fn slab_tensors(model: &Model) -> HashMap<(u32, pulsar_store::SlabKind), usize> {
    model
        .weights
        .iter()
        .enumerate()
        .filter(|(_, w)| w.role == Role::RoutedExpert)
        .filter_map(|(i, w)| Some(((w.layer?, crate::cpu::moe::slab_kind(&w.name)?), i)))
        .collect()
}

/// Page-lock the file mapping in place when the routed experts fit in
/// available host memory, so cold slabs upload at pinned speed and can be
/// read in place. Pinning faults every page in: on a model larger than RAM
/// it would thrash, so it is skipped there (uploads then go pageable).
fn pin_mapping(dev: &CudaDevice, model: &Model, expert_bytes: u64, pool: &mut ExpertPool) {
    let avail = match pulsar_store::default_host_budget() {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!("not page-locking the model: {e}");
            return;
        }
    };
    if expert_bytes > avail {
        tracing::info!("experts ({:.1} GiB) exceed available host memory ({:.1} GiB): uploads go pageable", expert_bytes as f64 / GIB, avail as f64 / GIB);
        return;
    }
    let t = std::time::Instant::now();
    let page = pulsar_store::page_size();
    for (i, info) in model.file.shard_infos().enumerate() {
        let Ok(all) = model.file.bytes(&pulsar_gguf::ByteRange { shard: i, offset: 0, len: info.len }) else { continue };
        // The mapping covers whole pages: the last partial page is mapped too.
        let len = all.len().next_multiple_of(page);
        // SAFETY: the mapping lives as long as the model, which outlives the
        // pool (CudaModel borrows nothing but is dropped before the Model by
        // every caller); READ_ONLY matches the read-only map.
        match unsafe { dev.register_host(all.as_ptr(), len, true) } {
            Ok(r) => pool.add_pinned(r),
            Err(e) => {
                tracing::warn!("could not page-lock shard {i} of the model ({e}); its slabs upload pageable");
            }
        }
    }
    tracing::info!("page-locked the model mapping in {:.2} s", t.elapsed().as_secs_f64());
}

pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// Bytes as GiB, or MiB / KiB when smaller (a tiny model's budget is not "0.00 GiB").
fn size(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / GIB),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.1} KiB", b as f64 / 1024.0),
    }
}

/// Caches smaller than this many pages are allocated whole even when paged:
/// a page each would cost more than it saves.
pub const PAGED_MIN_PAGES: usize = 4;

/// One KV cache buffer on the device, in the model's [`KvType`].
pub enum KvDev {
    F32(DeviceBuf<f32>),
    /// f16 bits.
    F16(DeviceBuf<u16>),
    Bf16(DeviceBuf<pulsar_cuda::KvBf16>),
    /// q8_0 rows (`KvType::Q8_0.row_bytes`).
    Q8_0(DeviceBuf<u8>),
    /// q4_0 rows (`KvType::Q4_0.row_bytes`).
    Q4_0(DeviceBuf<pulsar_cuda::KvQ4>),
    /// e4m3 bytes.
    Fp8(DeviceBuf<pulsar_cuda::KvFp8>),
}

/// `$body` over a layer's key and value buffers of one format (`$k`, `$v`
/// bound to their typed buffers); `$mixed` where their formats differ.
macro_rules! with_kv_pair {
    ($pair:expr, |$k:ident, $v:ident| $body:expr, $mixed:expr) => {
        match $pair {
            ($crate::cuda::KvDev::F32($k), $crate::cuda::KvDev::F32($v)) => $body,
            ($crate::cuda::KvDev::F16($k), $crate::cuda::KvDev::F16($v)) => $body,
            ($crate::cuda::KvDev::Bf16($k), $crate::cuda::KvDev::Bf16($v)) => $body,
            ($crate::cuda::KvDev::Q8_0($k), $crate::cuda::KvDev::Q8_0($v)) => $body,
            ($crate::cuda::KvDev::Q4_0($k), $crate::cuda::KvDev::Q4_0($v)) => $body,
            ($crate::cuda::KvDev::Fp8($k), $crate::cuda::KvDev::Fp8($v)) => $body,
            _ => $mixed,
        }
    };
}
/// `$body` over one buffer (`$b` bound to it), whatever its element type.
macro_rules! with_kv_buf {
    ($kv:expr, |$b:ident| $body:expr) => {
        match $kv {
            $crate::cuda::KvDev::F32($b) => $body,
            $crate::cuda::KvDev::F16($b) => $body,
            $crate::cuda::KvDev::Bf16($b) => $body,
            $crate::cuda::KvDev::Q8_0($b) => $body,
            $crate::cuda::KvDev::Q4_0($b) => $body,
            $crate::cuda::KvDev::Fp8($b) => $body,
        }
    };
}
pub(crate) use with_kv_pair;

/// Elements of `b`'s type in `bytes` bytes.
fn elems<T: pulsar_cuda::Pod>(_: &DeviceBuf<T>, bytes: usize) -> usize {
    bytes / std::mem::size_of::<T>()
}

impl KvDev {
    /// `n` rows of `w` values.
    fn alloc(dev: &CudaDevice, ty: KvType, w: usize, n: usize, paged: bool) -> Result<KvDev, CudaBackendError> {
        let units = |b: usize| n * ty.row_bytes(w) / b;
        Ok(match (ty, paged) {
            (KvType::F32, false) => KvDev::F32(dev.alloc(units(4))?),
            (KvType::F32, true) => KvDev::F32(dev.alloc_paged(units(4))?),
            (KvType::F16, false) => KvDev::F16(dev.alloc(units(2))?),
            (KvType::F16, true) => KvDev::F16(dev.alloc_paged(units(2))?),
            (KvType::Bf16, false) => KvDev::Bf16(dev.alloc(units(2))?),
            (KvType::Bf16, true) => KvDev::Bf16(dev.alloc_paged(units(2))?),
            (KvType::Q8_0, false) => KvDev::Q8_0(dev.alloc(units(1))?),
            (KvType::Q8_0, true) => KvDev::Q8_0(dev.alloc_paged(units(1))?),
            (KvType::Q4_0, false) => KvDev::Q4_0(dev.alloc(units(1))?),
            (KvType::Q4_0, true) => KvDev::Q4_0(dev.alloc_paged(units(1))?),
            (KvType::Fp8, false) => KvDev::Fp8(dev.alloc(units(1))?),
            (KvType::Fp8, true) => KvDev::Fp8(dev.alloc_paged(units(1))?),
        })
    }
    pub fn kv_type(&self) -> KvType {
        match self {
            KvDev::F32(_) => KvType::F32,
            KvDev::F16(_) => KvType::F16,
            KvDev::Bf16(_) => KvType::Bf16,
            KvDev::Q8_0(_) => KvType::Q8_0,
            KvDev::Q4_0(_) => KvType::Q4_0,
            KvDev::Fp8(_) => KvType::Fp8,
        }
    }
    pub fn device_ptr(&self) -> u64 {
        with_kv_buf!(self, |b| b.device_ptr())
    }
    pub fn bytes(&self) -> usize {
        with_kv_buf!(self, |b| b.bytes())
    }
    pub fn backed_bytes(&self) -> usize {
        with_kv_buf!(self, |b| b.backed_bytes())
    }
    /// Map memory for the first `n` rows of `w` values (a paged buffer).
    pub fn back(&mut self, w: usize, n: usize) -> Result<(), pulsar_cuda::CudaError> {
        let bytes = n * self.kv_type().row_bytes(w);
        with_kv_buf!(self, |b| b.back(elems(b, bytes)))
    }
}

/// The KV cache on the device: rows in the model's [`KvType`], one key and
/// one value buffer per KV state (by state index).
pub struct CudaKv {
    pub n_ctx: usize,
    pub layers: HashMap<usize, (usize, usize, KvDev, KvDev)>,
    /// Rows states (latent caches): width and `n_ctx` rows.
    pub rows: HashMap<usize, (usize, DeviceBuf<f32>)>,
    /// Recurrent states (one sequence's).
    pub recurrent: HashMap<usize, DeviceBuf<f32>>,
}

impl CudaKv {
    /// Every cache allocated whole for `n_ctx` positions.
    pub fn new(dev: &CudaDevice, model: &Model, n_ctx: usize) -> Result<CudaKv, CudaBackendError> {
        CudaKv::new_paged(dev, model, n_ctx, usize::MAX)
    }

    /// The caches, each KV and rows cache of at least `min_pages` pages
    /// ([`PAGED_MIN_PAGES`] serves; `usize::MAX`: none, [`CudaKv::new`]) paged: its addresses
    /// are reserved for `n_ctx` positions and [`CudaKv::back`] maps memory
    /// as the sequence grows (smaller ones are allocated whole: a page each
    /// would cost more than they take).
    pub fn new_paged(dev: &CudaDevice, model: &Model, n_ctx: usize, min_pages: usize) -> Result<CudaKv, CudaBackendError> {
        // Nothing paged: no page size to ask the driver for.
        let page = if min_pages == usize::MAX { usize::MAX } else { dev.page_bytes()? };
        let alloc = |n: usize| if n * 4 >= min_pages.saturating_mul(page) { dev.alloc_paged::<f32>(n) } else { dev.alloc::<f32>(n) };
        let ty = model.kv_type;
        let alloc_kv = |w: usize| KvDev::alloc(dev, ty, w, n_ctx, n_ctx * ty.row_bytes(w) >= min_pages.saturating_mul(page));
        let mut kv = CudaKv { n_ctx, layers: HashMap::new(), rows: HashMap::new(), recurrent: HashMap::new() };
        for (i, s) in model.plan.states.iter().enumerate() {
            let n: usize = s.dims.iter().product::<u64>() as usize;
            if let Some((h, dk, dv, _)) = s.as_kv() {
                let (kw, vw) = ((h * dk) as usize, (h * dv) as usize);
                kv.layers.insert(i, (kw, vw, alloc_kv(kw)?, alloc_kv(vw)?));
            } else if s.kind == pulsar_plugin_api::STATE_ROWS {
                kv.rows.insert(i, (n, alloc(n * n_ctx)?));
            } else if s.kind == pulsar_plugin_api::STATE_RECURRENT {
                kv.recurrent.insert(i, dev.alloc::<f32>(n)?);
            }
        }
        Ok(kv)
    }

    /// Give the paged caches memory for exactly their first `positions`
    /// (rounded up to pages): more as the sequence grows, less when it is
    /// cut or evicted.
    pub fn back(&mut self, positions: usize) -> Result<(), CudaBackendError> {
        let n = positions.min(self.n_ctx);
        for (kw, vw, k, v) in self.layers.values_mut() {
            k.back(*kw, n)?;
            v.back(*vw, n)?;
        }
        for (w, b) in self.rows.values_mut() {
            b.back(n * *w)?;
        }
        Ok(())
    }

    /// Device memory the caches hold now (a paged cache's mapped pages).
    pub fn backed_bytes(&self) -> usize {
        let kv: usize = self.layers.values().map(|(_, _, k, v)| k.backed_bytes() + v.backed_bytes()).sum();
        kv + self.rows.values().map(|(_, b)| b.backed_bytes()).sum::<usize>() + self.recurrent.values().map(|b| b.bytes()).sum::<usize>()
    }

    /// The most VRAM `n_seq` paged sequences of `n_ctx` positions take when
    /// together they hold `pool` positions: the unpaged caches whole, the
    /// paged ones `pool` positions plus up to a page each per sequence.
    pub fn paged_bytes_for(model: &Model, n_ctx: usize, n_seq: usize, pool: usize, page: usize) -> u64 {
        let (mut whole, mut per_pos, mut paged) = (0u64, 0u64, 0u64);
        let kv = |w: u32| model.kv_type.row_bytes(w as usize) as u64;
        for s in &model.plan.states {
            // Bytes of a position's row, per buffer.
            let rows: Vec<u64> = match (s.as_kv(), s.kind) {
                (Some((h, dk, dv, _)), _) => vec![kv(h * dk), kv(h * dv)],
                (None, pulsar_plugin_api::STATE_ROWS) => vec![4 * s.dims.iter().product::<u64>()],
                _ => continue,
            };
            for b in rows {
                if b * n_ctx as u64 >= (PAGED_MIN_PAGES * page) as u64 {
                    per_pos += b;
                    paged += 1;
                } else {
                    whole += b * n_ctx as u64;
                }
            }
        }
        n_seq as u64 * (whole + paged * page as u64) + per_pos * pool as u64
    }

    pub fn bytes_for(model: &Model, n_ctx: usize) -> u64 {
        model.memory_plan().kv_bytes_per_token * n_ctx as u64
    }
}

#[cfg(test)]
mod chunk_tests {
    use super::{chunk_for_budget, size, MAX_CHUNK};

    #[test]
    fn sizes_read_in_a_unit_that_shows_them() {
        assert_eq!(size(3 << 30), "3.00 GiB");
        assert_eq!(size(5 << 20), "5.00 MiB");
        assert_eq!(size(150 * 1024), "150.0 KiB");
    }

    #[test]
    fn the_prefill_chunk_shrinks_with_the_budget_and_is_reserved() {
        // ~11 GiB of room and 0.8 MB a token (the q2_K 48-layer model at 16 GiB): full chunks.
        assert_eq!(chunk_for_budget(11 << 30, 800_000), (MAX_CHUNK, 800_000 * MAX_CHUNK as u64));
        // 1 GiB of room and 0.4 MB a token: a sixteenth holds 167 tokens, so 128.
        assert_eq!(chunk_for_budget(1 << 30, 400_000).0, 128);
        // Never below 16 tokens, however tight.
        assert_eq!(chunk_for_budget(1 << 20, 400_000).0, 16);
    }
}
