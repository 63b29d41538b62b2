//! `pulsar-host bench`: llama-bench-style prompt-processing (pp) and
//! text-generation (tg) rates, a cold run then a warm one, per-tier traffic
//! and the floor the measured links imply.
//!
//! As llama-bench does: random prompt tokens, one untimed warm-up step, each
//! repeat from an empty cache; tg times single-token steps after a one-token
//! context.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::Ctx;
use crate::cpu::{CpuBackend, ExpertSource, MappedExperts};
use crate::cuda::{CudaEngine, CudaKv, CudaModel};
use crate::engine::Engine;
use crate::session::{open_device, Session};
use crate::experts::StoreExperts;
use crate::model::Model;
use crate::sample::Rng;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF model.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Prompt tokens of the pp tests: one or a list (`-p 128,512`, or -p
    /// repeated); 0 = none.
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512", value_name = "N,...")]
    pub n_prompt: Vec<usize>,
    /// Generated tokens of the tg tests: one or a list; 0 = none.
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128", value_name = "N,...")]
    pub n_gen: Vec<usize>,
    /// Context tokens prefilled (untimed) before each test, one or a list, as
    /// llama-bench's `-d`: speed at a long context (KV caches grow, recurrent states do not).
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_value = "0", value_name = "N,...")]
    pub n_depth: Vec<usize>,
    /// Repeats per test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    pub repeats: usize,
    /// Output format: llama-bench's md (the default), csv, json or jsonl,
    /// with Pulsar's columns (run, per-tier traffic) after llama-bench's.
    #[arg(short = 'o', long = "output", value_enum, default_value = "md")]
    pub output: super::bench_out::Format,
    /// Print Pulsar's full report instead, one JSON document: every tier,
    /// link and the cold-path cost model.
    #[arg(long)]
    pub json: bool,
    /// Host RAM for the expert cache, GiB (default: experts resident when they fit).
    #[arg(long, env = "PULSAR_CACHE_GB", value_name = "GB")]
    pub host_cache: Option<f64>,
    /// Largest prefill chunk.
    #[arg(long, visible_alias = "ubatch-size", default_value_t = 512)]
    pub ubatch: usize,
    /// CUDA: time every op of the steps on the GPU (each alone, no graph)
    /// and print a table per step kind to stderr; rates then include the
    /// profiling's synchronisation.
    #[arg(long)]
    pub profile_ops: bool,
    #[command(flatten)]
    pub gpu: super::GpuArgs,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Rate {
    pub mean: f64,
    pub sd: f64,
    pub samples: Vec<f64>,
}

impl Rate {
    pub(crate) fn of(samples: Vec<f64>) -> Rate {
        let n = samples.len().max(1) as f64;
        let mean = samples.iter().sum::<f64>() / n;
        let var = if samples.len() > 1 { samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
        Rate { mean, sd: var.sqrt(), samples }
    }
}

#[derive(Serialize, Clone, Debug, Default)]
pub struct Traffic {
    /// Expert bytes per generated token, by where they came from.
    pub disk_bytes_per_token: f64,
    pub host_bytes_per_token: f64,
    pub mapped_bytes_per_token: f64,
    /// Host-cache hits over all slab lookups that went through the cache.
    pub host_hit_rate: f64,
    /// Disk throughput while reading.
    pub disk_gbps: f64,
    pub prefetch_precision: f64,
    /// GPU backends: expert bytes uploaded into the VRAM pool per token, its hit rate, the upload rate.
    pub vram_upload_bytes_per_token: f64,
    pub vram_hit_rate: f64,
    pub h2d_gbps: f64,
    /// Cold expert bytes per token the GPU kernels read in place from page-locked host memory.
    pub vram_zero_copy_bytes_per_token: f64,
    /// Of the cold slabs copied ahead for the next layer, the share it used.
    pub vram_prefetch_precision: f64,
    /// Cold expert bytes per token the CPU lane computed with (no upload),
    /// and the rate it achieved on them (wall time, fixed costs included).
    pub vram_cpu_lane_bytes_per_token: f64,
    pub cpu_lane_gbps: f64,
    /// Host milliseconds per token: the CPU lane's work, waiting for the
    /// link at a layer's start, waiting for the GPU's routing ids.
    pub cpu_lane_ms_per_token: f64,
    pub link_wait_ms_per_token: f64,
    pub route_wait_ms_per_token: f64,
    /// Hot-set admissions per token (slabs that earned a VRAM slot).
    pub vram_admissions_per_token: f64,
    /// Slabs warm-loaded into the hot set before the run (from the census).
    pub vram_warm_loaded: u64,
}

/// One pp or tg test at one depth: llama-bench's row.
#[derive(Serialize, Clone, Debug)]
pub struct Test {
    /// llama-bench's name: `pp512`, `tg128 @ d4096`.
    pub test: String,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_depth: usize,
    pub rate: Rate,
    /// When the test ended (UTC, RFC 3339, as llama-bench's `test_time`).
    pub test_time: String,
    /// tg tests: expert traffic per generated token, by tier.
    pub traffic: Option<Traffic>,
    /// tg tests: tok/s the measured links allow for that traffic.
    pub floor_tg_tok_s: Option<f64>,
}

#[derive(Serialize, Clone, Debug)]
pub struct Run {
    /// "cold" (empty caches) or "warm" (caches as the cold run left them).
    pub name: String,
    pub tests: Vec<Test>,
    /// GPU backends: the cold-path cost model as the run left it (the
    /// ceilings measured at load, the lane's rates as refined by real steps).
    pub cold_cost: Option<crate::cold::CostModel>,
}

#[derive(Serialize, Clone, Debug)]
pub struct Links {
    /// O_DIRECT reads of the model's expert slabs at the store's queue depth.
    pub disk_read_gbps: Option<f64>,
    /// One-thread memcpy bandwidth of host RAM.
    pub host_copy_gbps: f64,
    /// Pinned host-to-device (GPU backends).
    pub h2d_pinned_gbps: Option<f64>,
}

#[derive(Serialize, Clone, Debug)]
pub struct Report {
    pub model: String,
    pub arch: String,
    pub file_bytes: u64,
    pub params: u64,
    pub expert_bytes: u64,
    pub resident_bytes: u64,
    pub backend: String,
    /// llama-bench's `cpu_info` / `gpu_info` (empty without a GPU).
    pub cpu_info: String,
    pub gpu_info: String,
    pub threads: usize,
    /// llama-bench's model column: family, size, file type.
    pub model_type: String,
    pub n_prompt: Vec<usize>,
    pub n_gen: Vec<usize>,
    /// Context tokens before each test.
    pub n_depth: Vec<usize>,
    pub repeats: usize,
    pub ubatch: usize,
    pub host_cache_bytes: Option<u64>,
    pub vram_budget_bytes: Option<u64>,
    pub links: Links,
    pub runs: Vec<Run>,
}

fn params(model: &Model) -> u64 {
    model.file.tensors().iter().map(|t| t.n_elements()).sum()
}

fn host_copy_gbps() -> f64 {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src); // fault the pages in
    let t = Instant::now();
    for _ in 0..3 {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
    }
    3.0 * n as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Read up to 512 MiB of expert slabs through a fresh store with a budget
/// that holds them, timing the disk tier.
fn disk_gbps(model: &Model) -> Option<f64> {
    let st = StoreExperts::open(model, 1 << 30).ok()?;
    let cat = st.store.catalog();
    let mut sel = Vec::new();
    let mut bytes = 0u64;
    let layer = cat.layers().next()?;
    for e in cat.experts(layer) {
        sel.push(pulsar_store::Selection { token: 0, slot: sel.len() as u32, expert: e });
        bytes += cat.triple(layer, e).map_or(0, |t| cat.triple_bytes(t));
        if bytes > 512 << 20 {
            break;
        }
    }
    let t = Instant::now();
    let g = st.store.resolve(layer, &sel).ok()?;
    let secs = t.elapsed().as_secs_f64();
    drop(g);
    (secs > 0.0).then(|| bytes as f64 / secs / 1e9)
}


/// The CPU's model name (`/proc/cpuinfo`), as llama-bench's `cpu_info`.
fn cpu_info() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    info.lines().find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string())).unwrap_or_default()
}

/// Now, UTC, RFC 3339 to the second (days to civil date after H. Hinnant).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

fn random_tokens(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.next_u64() % vocab as u64) as u32).collect()
}

struct Bench<'a> {
    model: &'a Model,
    store: Option<&'a StoreExperts>,
    cpu: &'a CpuBackend,
    cuda: Option<&'a CudaModel>,
    args: &'a Args,
}

impl Bench<'_> {
    fn session<'s>(&'s self, source: &'s dyn ExpertSource, n_ctx: usize) -> anyhow::Result<Box<dyn Session + 's>> {
        let mut s: Box<dyn Session + 's> = match self.cuda {
            Some(cm) => Box::new(CudaEngine::new(self.model, cm, n_ctx)?.with_store(self.store).with_profile(self.args.profile_ops)?),
            None => Box::new(Engine::new(self.model, self.cpu, source, n_ctx)),
        };
        s.set_ubatch(self.args.ubatch);
        Ok(s)
    }

    fn pp(&self, source: &dyn ExpertSource, n_prompt: usize, depth: usize) -> anyhow::Result<Rate> {
        let vocab = self.model.plan.n_vocab.max(2);
        let mut eng = self.session(source, depth + n_prompt + 8)?;
        eng.forward(&random_tokens(8, vocab, 7), false)?; // warm-up, untimed
        let mut s = Vec::new();
        for r in 0..self.args.repeats {
            eng.reset();
            if depth > 0 {
                eng.forward(&random_tokens(depth, vocab, 500 + r as u64), false)?; // the context, untimed
            }
            let toks = random_tokens(n_prompt, vocab, 100 + r as u64);
            let t = Instant::now();
            eng.forward(&toks, false)?;
            s.push(n_prompt as f64 / t.elapsed().as_secs_f64());
        }
        if let Some(t) = eng.op_profile() {
            eprintln!("{t}");
        }
        Ok(Rate::of(s))
    }

    fn tg(&self, source: &dyn ExpertSource, n_gen: usize, depth: usize) -> anyhow::Result<Rate> {
        let vocab = self.model.plan.n_vocab.max(2);
        let ctx = depth.max(1);
        let mut eng = self.session(source, ctx + n_gen + 8)?;
        let mut s = Vec::new();
        for r in 0..self.args.repeats {
            eng.reset();
            let toks = random_tokens(ctx + n_gen, vocab, 900 + r as u64);
            eng.forward(&toks[..ctx], false)?; // the context, untimed
            let t = Instant::now();
            for &tok in &toks[ctx..] {
                eng.forward(&[tok], false)?;
            }
            s.push(n_gen as f64 / t.elapsed().as_secs_f64());
        }
        if let Some(t) = eng.op_profile() {
            eprintln!("{t}");
        }
        Ok(Rate::of(s))
    }
}

fn traffic(before: &pulsar_store::StoreStats, after: &pulsar_store::StoreStats, tokens: f64) -> Traffic {
    let d = |a: u64, b: u64| (b - a) as f64 / tokens.max(1.0);
    let (a, b) = (&before.total, &after.total);
    let host_hits = (b.host.slabs - a.host.slabs) as f64;
    let disk = (b.disk.slabs - a.disk.slabs) as f64;
    let secs = b.disk_seconds - a.disk_seconds;
    Traffic {
        disk_bytes_per_token: d(a.disk.bytes, b.disk.bytes),
        host_bytes_per_token: d(a.host.bytes, b.host.bytes),
        mapped_bytes_per_token: d(a.mapped.bytes, b.mapped.bytes),
        host_hit_rate: if host_hits + disk > 0.0 { host_hits / (host_hits + disk) } else { 0.0 },
        disk_gbps: if secs > 0.0 { (b.disk.bytes - a.disk.bytes) as f64 / secs / 1e9 } else { 0.0 },
        prefetch_precision: after.prefetch.precision(),
        ..Traffic::default()
    }
}

/// A tg test's expert traffic per token: the store's tiers and, on a GPU,
/// the VRAM pool's (snapshots before the test and now).
fn tg_traffic(
    store: Option<&StoreExperts>,
    before: Option<&pulsar_store::StoreStats>,
    pool_before: Option<&crate::cuda::PoolStats>,
    cuda: Option<&CudaModel>,
    tokens: f64,
) -> Traffic {
    let mut t = match (store, before) {
        (Some(s), Some(b)) => traffic(b, &s.store.stats(), tokens),
        _ => Traffic::default(),
    };
    if let (Some(b), Some(after)) = (pool_before, cuda.and_then(|c| c.pool_stats())) {
        let per = |x: u64, y: u64| (y - x) as f64 / tokens.max(1.0);
        t.vram_upload_bytes_per_token = per(b.uploaded_bytes, after.uploaded_bytes);
        t.vram_zero_copy_bytes_per_token = per(b.zero_copy_bytes, after.zero_copy_bytes);
        t.vram_admissions_per_token = per(b.admissions, after.admissions);
        t.vram_cpu_lane_bytes_per_token = per(b.cpu_lane_bytes, after.cpu_lane_bytes);
        let lane_secs = after.cpu_lane_seconds - b.cpu_lane_seconds;
        let ms = |x: f64, y: f64| 1e3 * (y - x) / tokens.max(1.0);
        t.cpu_lane_ms_per_token = ms(b.cpu_lane_seconds, after.cpu_lane_seconds);
        t.link_wait_ms_per_token = ms(b.link_wait_seconds, after.link_wait_seconds);
        t.route_wait_ms_per_token = ms(b.route_wait_seconds, after.route_wait_seconds);
        t.cpu_lane_gbps = if lane_secs > 0.0 { (after.cpu_lane_bytes - b.cpu_lane_bytes) as f64 / lane_secs / 1e9 } else { 0.0 };
        let pf = (after.prefetched - b.prefetched) as f64;
        t.vram_prefetch_precision = if pf > 0.0 { (after.prefetch_hits - b.prefetch_hits) as f64 / pf } else { 0.0 };
        t.vram_warm_loaded = after.warm_loaded;
        let (h, m) = ((after.hits - b.hits) as f64, (after.misses - b.misses + after.zero_copy - b.zero_copy + after.cpu_lane - b.cpu_lane) as f64);
        t.vram_hit_rate = if h + m > 0.0 { h / (h + m) } else { 0.0 };
        let secs = after.upload_seconds - b.upload_seconds;
        t.h2d_gbps = if secs > 0.0 { (after.uploaded_bytes - b.uploaded_bytes) as f64 / secs / 1e9 } else { 0.0 };
    }
    t
}

/// The tok/s the measured links allow for a test's per-token traffic: each
/// link's share of a token at its measured rate, summed (no overlap assumed).
fn floor_tok_s(t: &Traffic, links: &Links, gpu: bool) -> Option<f64> {
    let link_bytes = t.vram_upload_bytes_per_token + t.vram_zero_copy_bytes_per_token;
    let mut secs = 0.0;
    let mut known = false;
    if let (true, Some(g)) = (link_bytes > 0.0, links.h2d_pinned_gbps) {
        secs += link_bytes / (g * 1e9);
        known = true;
    }
    if let (true, Some(g)) = (t.disk_bytes_per_token > 0.0, links.disk_read_gbps) {
        secs += t.disk_bytes_per_token / (g * 1e9);
        if !gpu {
            secs += t.host_bytes_per_token / (links.host_copy_gbps * 1e9);
        }
        known = true;
    }
    (known && secs > 0.0).then(|| 1.0 / secs)
}

pub fn main(ctx: &mut Ctx, mut a: Args) -> anyhow::Result<ExitCode> {
    a.host_cache = ctx.cfg.settle_opt(&ctx.sub, "host_cache", "host_cache_gb", a.host_cache, ctx.file.host_cache_gb);
    a.gpu.settle(&mut ctx.cfg, &ctx.sub, &ctx.file);
    if ctx.print_config {
        eprint!("{}", ctx.cfg.print());
    }
    if a.repeats == 0 {
        anyhow::bail!("-r must be at least 1");
    }
    if a.n_prompt.iter().chain(&a.n_gen).all(|&n| n == 0) {
        anyhow::bail!("nothing to measure: -p and -n are all 0");
    }
    let mut model = ctx.open_model(&a.model, None)?;
    model.kv_type = a.gpu.kv_type;
    let cpu = CpuBackend::new(ctx.cfg.threads.value)?;
    let mem = model.memory_plan();
    let budget = a.host_cache.map(pulsar_store::budget_from_gib).transpose()?;
    let links = Links {
        disk_read_gbps: if mem.expert_bytes > 0 { disk_gbps(&model) } else { None },
        host_copy_gbps: host_copy_gbps(),
        h2d_pinned_gbps: None,
    };
    let device = open_device(a.gpu.resolve_device(&model, ctx.print_config)?)?;
    let max = |v: &[usize]| v.iter().copied().max().unwrap_or(0);
    let n_ctx = max(&a.n_depth) + max(&a.n_prompt).max(max(&a.n_gen)) + 16;
    let h2d = device.as_ref().and_then(|d| crate::cuda::measure_h2d(d).ok());
    let links = Links { h2d_pinned_gbps: h2d, ..links };
    let backend = match &device {
        Some(d) => format!("cuda ({}, {})", d.name(), d.arch()),
        None => format!("cpu ({})", cpu.kernels.isa().name()),
    };
    let gpu_info = device.as_ref().map_or(String::new(), |d| d.name().to_string());
    let ordinal = device.as_ref().map(|d| d.ordinal());
    let mut device = device;
    let pinned = device.as_ref().map(|d| crate::cuda::PinnedAllocator::new(d.context().clone()));
    let ranges = pinned.as_ref().map(|p| p.ranges());
    let store = match (mem.expert_bytes, budget) {
        (0, _) => None,
        (_, Some(b)) => Some(StoreExperts::open_with(&model, b, pinned.map(|p| Arc::new(p) as Arc<dyn pulsar_store::HostAllocator>))?),
        (_, None) => Some(StoreExperts::mapped(&model)?),
    };
    let source: &dyn ExpertSource = match &store {
        Some(s) => s,
        None => &MappedExperts,
    };
    let mut runs = Vec::new();
    for name in ["cold", "warm"] {
        // GPU: a fresh load per run. The cold one starts with an empty hot
        // set; the warm one is warm-loaded from the census the cold one saved.
        let cuda_model = match ordinal {
            Some(n) => {
                let dev = match device.take() {
                    Some(d) => d,
                    None => pulsar_cuda::CudaDevice::open(n)?,
                };
                let census = if name == "warm" { crate::cuda::warm_census(&a.model, &model) } else { None };
                let opts = a.gpu.load_options(CudaKv::bytes_for(&model, n_ctx), census, store.as_ref().is_some_and(|s| s.cached));
                let cm = CudaModel::load(dev, &model, &opts)?;
                if let Some(r) = &ranges {
                    cm.set_host_pinned(r.clone());
                }
                Some(cm)
            }
            None => None,
        };
        let bench = Bench { model: &model, store: store.as_ref(), cpu: &cpu, cuda: cuda_model.as_ref(), args: &a };
        let mut tests = Vec::new();
        for &d in &a.n_depth {
            let at = if d > 0 { format!(" @ d{d}") } else { String::new() };
            for &p in a.n_prompt.iter().filter(|&&p| p > 0) {
                let rate = bench.pp(source, p, d)?;
                tests.push(Test { test: format!("pp{p}{at}"), n_prompt: p, n_gen: 0, n_depth: d, rate, test_time: utc_now(), traffic: None, floor_tg_tok_s: None });
            }
            for &n in a.n_gen.iter().filter(|&&n| n > 0) {
                let before = store.as_ref().map(|s| s.store.stats());
                let pool_before = cuda_model.as_ref().and_then(|c| c.pool_stats());
                let rate = bench.tg(source, n, d)?;
                let tokens = (n * a.repeats) as f64;
                let t = tg_traffic(store.as_ref(), before.as_ref(), pool_before.as_ref(), cuda_model.as_ref(), tokens);
                let floor = floor_tok_s(&t, &links, cuda_model.is_some());
                tests.push(Test { test: format!("tg{n}{at}"), n_prompt: 0, n_gen: n, n_depth: d, rate, test_time: utc_now(), traffic: Some(t), floor_tg_tok_s: floor });
            }
        }
        if let Some(cm) = &cuda_model {
            if let Err(e) = cm.save_census(&a.model, &model) {
                tracing::warn!("could not save the census: {e:#}");
            }
        }
        let cold_cost = cuda_model.as_ref().map(|c| c.cost.lock().unwrap_or_else(|e| e.into_inner()).clone());
        runs.push(Run { name: name.into(), tests, cold_cost });
    }
    if let (Some(s), None) = (&store, ordinal) {
        if let Err(e) = s.save_census(&a.model, &model) {
            tracing::warn!("could not save the census: {e:#}");
        }
    }
    let report = Report {
        model: a.model.display().to_string(),
        arch: model.arch.clone(),
        file_bytes: model.file.total_bytes(),
        params: params(&model),
        expert_bytes: mem.expert_bytes,
        resident_bytes: mem.resident_bytes,
        backend,
        cpu_info: cpu_info(),
        gpu_info,
        threads: cpu.pool.current_num_threads(),
        vram_budget_bytes: a.gpu.vram_budget_bytes(),
        model_type: super::bench_out::model_type(&model),
        n_prompt: a.n_prompt.clone(),
        n_gen: a.n_gen.clone(),
        n_depth: a.n_depth.clone(),
        repeats: a.repeats,
        ubatch: a.ubatch,
        host_cache_bytes: budget,
        links,
        runs,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", super::bench_out::render(&report, a.output)?);
    }
    Ok(ExitCode::SUCCESS)
}
