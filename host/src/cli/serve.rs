//! `pulsar-host serve`: the OpenAI-compatible HTTP server and web chat page.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use super::Ctx;
use crate::config;
use crate::cpu::{CpuBackend, MappedExperts};
use crate::cuda::{CudaKv, CudaModel};
use crate::server::{self, Backend, Compute, ServeOptions};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF model.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Address to listen on (loopback by default; 0.0.0.0 exposes the server).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 11435)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "PULSAR_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Context length per sequence (default: the model's, capped at 4096).
    #[arg(short = 'c', long, visible_alias = "ctx-size", env = "PULSAR_CTX")]
    pub ctx: Option<usize>,
    /// Sequences decoded at once, each with its own KV cache; more requests queue.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// GiB of KV cache shared by all sequences, taken in blocks of 16
    /// positions as they grow (default: every slot at full --ctx). When it
    /// runs out, the newest sequence pauses until room comes back. At least
    /// one full context. On a GPU the caches map VRAM pages as they grow and
    /// the VRAM budget reserves the pool, not every slot's full context; there
    /// the default is a pool of a quarter of the VRAM past the weights when
    /// every slot at full context would take more.
    #[arg(long, value_name = "GIB")]
    pub kv_pool: Option<f64>,
    /// Most tokens in one batched step (prefill chunks share it with decodes).
    #[arg(long, default_value_t = 256)]
    pub ubatch: usize,
    /// Requests that may wait for a sequence slot before new ones get 503.
    #[arg(long, default_value_t = 512)]
    pub max_queue: usize,
    /// Also accept this name in Host/Origin headers (repeatable; DNS-rebinding guard).
    #[arg(long = "allow-host", value_name = "NAME")]
    pub allow_hosts: Vec<String>,
    /// Seconds running generations may still take after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace: u64,
    /// Open connections at most; one more gets 503 and is closed at once.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers (also how long an
    /// idle keep-alive connection stays open).
    #[arg(long, default_value_t = 30, value_name = "S")]
    pub header_timeout: u64,
    /// Seconds a client has to send a request's body once its headers came.
    #[arg(long, default_value_t = 60, value_name = "S")]
    pub body_timeout: u64,
    /// Seconds a response may wait on a client that stopped reading; then the
    /// request is dropped and its sequence slot freed.
    #[arg(long, default_value_t = 60, value_name = "S")]
    pub write_timeout: u64,
    /// Seconds a request may wait for a sequence slot before it gets 503.
    #[arg(long, default_value_t = 300, value_name = "S")]
    pub queue_timeout: u64,
    /// Model id reported by /v1/models (default: the file name without .gguf).
    #[arg(long)]
    pub alias: Option<String>,
    /// Use this plugin instead of the one `general.architecture` selects.
    #[arg(long, value_name = "NAME")]
    pub arch_plugin: Option<String>,
    /// Host RAM for the expert cache, in GiB (default: everything resident when
    /// the experts fit in available memory, else a budget solved from
    /// MemAvailable); experts beyond it are read from disk as requests route to them.
    #[arg(long, env = "PULSAR_CACHE_GB", value_name = "GB")]
    pub host_cache: Option<f64>,
    /// Default temperature of requests that give none (else the GGUF's
    /// `general.sampling.temp`, else 0.8).
    #[arg(long, visible_alias = "temperature", help_heading = "Sampling defaults")]
    pub temp: Option<f32>,
    /// Default top-k (else the GGUF's, else 40; 0 = off).
    #[arg(long, help_heading = "Sampling defaults")]
    pub top_k: Option<usize>,
    /// Default top-p (else the GGUF's, else 0.95).
    #[arg(long, help_heading = "Sampling defaults")]
    pub top_p: Option<f32>,
    /// Default min-p (else the GGUF's, else 0.05).
    #[arg(long, help_heading = "Sampling defaults")]
    pub min_p: Option<f32>,
    /// Default repetition penalty (else the GGUF's, else 1 = off).
    #[arg(long, help_heading = "Sampling defaults")]
    pub repeat_penalty: Option<f32>,
    /// Default presence penalty (0 = off).
    #[arg(long, allow_negative_numbers = true, help_heading = "Sampling defaults")]
    pub presence_penalty: Option<f32>,
    /// Default frequency penalty (0 = off).
    #[arg(long, allow_negative_numbers = true, help_heading = "Sampling defaults")]
    pub frequency_penalty: Option<f32>,
    #[command(flatten)]
    pub gpu: super::GpuArgs,
}

/// The sampling a request gets for the fields it leaves out: the flag, else
/// the GGUF's recommendation (`general.sampling.*`, as llama.cpp's converter
/// writes it), else llama-server's defaults.
fn sampling_defaults(a: &Args, meta: &pulsar_gguf::Metadata) -> anyhow::Result<crate::sample::SamplerConfig> {
    let base = crate::sample::SamplerConfig::llama_server();
    let f = |k: &str| meta.get_f32(&format!("general.sampling.{k}")).ok().flatten();
    let u = |k: &str| meta.get_u32(&format!("general.sampling.{k}")).ok().flatten().map(|v| v as usize);
    let s = crate::sample::SamplerConfig {
        temperature: a.temp.or(f("temp")).unwrap_or(base.temperature),
        top_k: a.top_k.or(u("top_k")).unwrap_or(base.top_k),
        top_p: a.top_p.or(f("top_p")).unwrap_or(base.top_p),
        min_p: a.min_p.or(f("min_p")).unwrap_or(base.min_p),
        repeat_penalty: a.repeat_penalty.or(f("penalty_repeat")).unwrap_or(base.repeat_penalty),
        repeat_last_n: u("penalty_last_n").unwrap_or(base.repeat_last_n),
        presence_penalty: a.presence_penalty.unwrap_or(base.presence_penalty),
        frequency_penalty: a.frequency_penalty.unwrap_or(base.frequency_penalty),
        ..base
    };
    s.validate().map_err(|e| anyhow::anyhow!("sampling defaults: {e}"))?;
    Ok(s)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for SIGINT: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("pulsar-host serve: shutting down");
}

/// The longest `--shutdown-grace` (a day): beyond it the deadline arithmetic
/// would overflow, and no generation needs longer.
const MAX_GRACE_S: u64 = 86_400;

/// The flags that need no model, checked before anything is opened: one
/// line naming the flag, never a panic or a server that quietly ignores it.
fn check_flags(a: &Args) -> anyhow::Result<()> {
    if a.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        anyhow::bail!("--api-key (or PULSAR_API_KEY) is empty: give a key, or unset it to serve without one");
    }
    if a.max_queue == 0 {
        anyhow::bail!("--max-queue 0 would refuse every request that has to wait: use 1 or more");
    }
    if a.shutdown_grace > MAX_GRACE_S {
        anyhow::bail!("--shutdown-grace {} is longer than a day ({MAX_GRACE_S} s)", a.shutdown_grace);
    }
    for (flag, v) in
        [("--header-timeout", a.header_timeout), ("--body-timeout", a.body_timeout), ("--write-timeout", a.write_timeout), ("--queue-timeout", a.queue_timeout)]
    {
        if v == 0 || v > MAX_GRACE_S {
            anyhow::bail!("{flag} {v}: give 1 to {MAX_GRACE_S} seconds");
        }
    }
    if a.max_connections == 0 {
        anyhow::bail!("--max-connections 0 would refuse every client: use 1 or more");
    }
    if let Some(soft) = open_file_limit() {
        // A few descriptors go to the model, plugins, the listener and logs.
        if a.max_connections as u64 + 64 > soft {
            tracing::warn!(
                "--max-connections {} is near the open-file limit ({soft}, `ulimit -n`): accepts may fail with EMFILE before the cap is reached",
                a.max_connections
            );
        }
    }
    if a.parallel == 0 {
        anyhow::bail!("--parallel 0: at least one sequence");
    }
    if a.ctx == Some(0) {
        anyhow::bail!("--ctx 0: at least one position");
    }
    if let Some(g) = a.kv_pool {
        if !(g.is_finite() && g > 0.0) {
            anyhow::bail!("--kv-pool {g}: a positive number of GiB");
        }
    }
    Ok(())
}

/// Bytes the KV caches of `parallel` sequences of `n_ctx` positions take
/// (checked arithmetic: a huge `--ctx` is an error naming it, not an overflow).
fn kv_bytes(parallel: usize, n_ctx: usize, per_token: u64) -> anyhow::Result<u64> {
    (parallel as u64)
        .checked_mul(n_ctx as u64)
        .and_then(|x| x.checked_mul(per_token))
        .ok_or_else(|| anyhow::anyhow!("--parallel {parallel} x --ctx {n_ctx} sequences' KV caches overflow 64 bits"))
}

/// Without `--kv-pool` on a GPU: every slot at full context while that takes
/// at most a quarter of the VRAM past the resident weights, else a paged pool
/// of that quarter (never below one full context), so slots x context never
/// crowd the expert pool out of the budget.
fn default_gpu_pool(model: &crate::model::Model, gpu: &super::GpuArgs, dev: &pulsar_cuda::CudaDevice, kv_total: u64, per_token: u64, n_ctx: usize) -> anyhow::Result<Option<usize>> {
    let budget = match gpu.vram_budget_bytes() {
        Some(b) => b,
        None => dev.memory()?.1 as u64,
    };
    let quarter = budget.saturating_sub(model.memory_plan().resident_bytes) / 4;
    if kv_total <= quarter || per_token == 0 {
        return Ok(None);
    }
    let positions = ((quarter / per_token) as usize).max(n_ctx);
    tracing::info!(
        "KV cache: --parallel x --ctx would take {:.2} GiB, more than a quarter of the VRAM past the weights: a paged pool of {positions} positions ({:.2} GiB; --kv-pool sets it)",
        kv_total as f64 / (1u64 << 30) as f64,
        (positions as u64 * per_token) as f64 / (1u64 << 30) as f64
    );
    Ok(Some(positions))
}

/// The most address space every slot's full-context caches may map (a
/// quarter of x86-64's 47-bit user space).
const MAX_KV_MAPPING: u64 = 1 << 45;

/// `--kv-pool` GiB as positions of `per_token` bytes; refused below one full context.
fn kv_pool_positions(gib: Option<f64>, per_token: u64, n_ctx: usize) -> anyhow::Result<Option<usize>> {
    let (Some(g), true) = (gib, per_token > 0) else { return Ok(None) };
    let positions = (g * (1u64 << 30) as f64 / per_token as f64) as usize;
    if positions < n_ctx {
        anyhow::bail!(
            "--kv-pool {g} GiB holds {positions} positions, less than one sequence's --ctx {n_ctx} ({:.2} MiB)",
            (n_ctx as u64 * per_token) as f64 / (1u64 << 20) as f64
        );
    }
    Ok(Some(positions))
}

/// The CPU's KV caches (`need` bytes, from `--parallel` x `--ctx`) must fit
/// the memory the machine has free.
fn check_memory(need: u64) -> anyhow::Result<()> {
    match available_memory() {
        Some(f) if need > f => anyhow::bail!(
            "--parallel x --ctx need {:.1} GiB of KV cache, more than the {:.1} GiB of memory available",
            need as f64 / (1u64 << 30) as f64,
            f as f64 / (1u64 << 30) as f64
        ),
        _ => Ok(()),
    }
}

/// The soft `Max open files` of /proc/self/limits (None where unknown or unlimited).
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// `MemAvailable` of /proc/meminfo (None where there is none).
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

pub fn main(mut ctx: Ctx, mut a: Args) -> anyhow::Result<ExitCode> {
    check_flags(&a)?;
    a.host_cache = ctx.cfg.settle_opt(&ctx.sub, "host_cache", "host_cache_gb", a.host_cache, ctx.file.host_cache_gb);
    ctx.cfg.ctx = config::resolve(&ctx.sub, "ctx", a.ctx.map(Some), ctx.file.ctx.map(Some), || None);
    a.gpu.settle(&mut ctx.cfg, &ctx.sub, &ctx.file);
    let mut model = ctx.open_model(&a.model, a.arch_plugin.as_deref())?;
    model.kv_type = a.gpu.kv_type;
    let n_ctx = ctx.cfg.ctx.value.unwrap_or_else(|| (model.plan.n_ctx_train as usize).clamp(1, 4096));
    if n_ctx == 0 {
        anyhow::bail!("ctx 0 (from {}): at least one position", ctx.cfg.ctx.source);
    }
    // Refuse impossible sizes before any note or warning, so a refusal stays
    // one line. On a GPU the caches take VRAM: the load checks them against
    // the budget.
    let per_token = CudaKv::bytes_for(&model, 1);
    let kv_total = kv_bytes(a.parallel, n_ctx, per_token)?;
    let mut kv_pool = kv_pool_positions(a.kv_pool, per_token, n_ctx)?;
    // The CPU's caches take memory only where written: the pool bounds that,
    // but every slot's full context is still mapped (address space, not memory).
    let cpu_kv = kv_pool.map_or(kv_total, |n| kv_total.min(n as u64 * per_token));
    if kv_pool.is_some() && kv_total > MAX_KV_MAPPING {
        anyhow::bail!(
            "--parallel {} x --ctx {n_ctx} map {:.0} TiB of KV cache even with --kv-pool (at most {} TiB): fewer slots or a shorter context",
            a.parallel,
            kv_total as f64 / (1u64 << 40) as f64,
            MAX_KV_MAPPING >> 40
        );
    }
    let choice = a.gpu.resolve_device(&model, ctx.print_config)?;
    let gpu_likely = choice != crate::session::DeviceChoice::Cpu && pulsar_cuda::CudaDevice::available();
    if !gpu_likely {
        check_memory(cpu_kv)?;
    }
    let device = crate::session::open_device(choice)?;
    if device.is_none() && gpu_likely {
        check_memory(cpu_kv)?;
    }
    super::warn_past_trained_ctx(&model, n_ctx);
    let cpu = CpuBackend::new(ctx.cfg.threads.value)?;
    let model_id = a.alias.clone().unwrap_or_else(|| a.model.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned()));
    let sampling = sampling_defaults(&a, model.file.metadata())?;
    if ctx.print_config {
        // The sampling defaults come from the flags, then the model file.
        let meta = model.file.metadata();
        let in_file = |k: &str| {
            let key = format!("general.sampling.{k}");
            meta.get_f32(&key).ok().flatten().is_some() || meta.get_u32(&key).ok().flatten().is_some()
        };
        let src = |given: bool, key: &str| match (given, in_file(key)) {
            (true, _) => crate::config::Source::Flag,
            (false, true) => crate::config::Source::Model,
            _ => crate::config::Source::Default,
        };
        for (k, v, given, key) in [
            ("temp", sampling.temperature.to_string(), a.temp.is_some(), "temp"),
            ("top_k", sampling.top_k.to_string(), a.top_k.is_some(), "top_k"),
            ("top_p", sampling.top_p.to_string(), a.top_p.is_some(), "top_p"),
            ("min_p", sampling.min_p.to_string(), a.min_p.is_some(), "min_p"),
            ("repeat_penalty", sampling.repeat_penalty.to_string(), a.repeat_penalty.is_some(), "penalty_repeat"),
        ] {
            ctx.cfg.rows.push((k.into(), v, src(given, key)));
        }
        eprint!("{}", ctx.cfg.print());
    }
    tracing::info!(
        "sampling defaults: temperature {}, top-k {}, top-p {}, min-p {}, repeat penalty {}",
        sampling.temperature,
        sampling.top_k,
        sampling.top_p,
        sampling.min_p,
        sampling.repeat_penalty
    );
    let mut opts = ServeOptions {
        sampling,
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone(),
        n_ctx,
        parallel: a.parallel,
        kv_pool,
        ubatch: a.ubatch.max(1),
        max_queue: a.max_queue,
        allow_hosts: a.allow_hosts.clone(),
        grace: Duration::from_secs(a.shutdown_grace),
        model_id,
        max_connections: a.max_connections,
        header_timeout: Duration::from_secs(a.header_timeout),
        body_timeout: Duration::from_secs(a.body_timeout),
        write_timeout: Duration::from_secs(a.write_timeout),
        queue_timeout: Duration::from_secs(a.queue_timeout),
    };
    // On a GPU the host cache is page-locked, so its slabs upload by DMA.
    let pinned = device.as_ref().map(|d| crate::cuda::PinnedAllocator::new(d.context().clone()));
    let ranges = pinned.as_ref().map(|p| p.ranges());
    let alloc = pinned.map(|p| Arc::new(p) as Arc<dyn pulsar_store::HostAllocator>);
    let store = crate::experts::experts_for_with(&model, a.host_cache, alloc)?.map(Arc::new);
    let (compute, backend_line) = match device {
        Some(dev) => {
            let census = crate::cuda::warm_census(&a.model, &model);
            // Paged caches: the budget holds the pool, the caches too small
            // to page, and a page of slack per paged cache and slot.
            if kv_pool.is_none() {
                kv_pool = default_gpu_pool(&model, &a.gpu, &dev, kv_total, per_token, n_ctx)?;
            }
            let kv_vram = match kv_pool {
                Some(n) => kv_total.min(CudaKv::paged_bytes_for(&model, n_ctx, a.parallel, n, dev.page_bytes()?)),
                None => kv_total,
            };
            let opts = a.gpu.load_options(kv_vram, census, store.as_ref().is_some_and(|s| s.cached));
            let cm = CudaModel::load(dev, &model, &opts)?;
            if let Some(r) = ranges {
                cm.set_host_pinned(r);
            }
            let line = format!(
                "CUDA on {} ({:.2} GiB resident, experts {})",
                cm.dev.name(),
                cm.resident_bytes as f64 / (1u64 << 30) as f64,
                if cm.experts.is_some() { "streamed through a VRAM pool" } else { "resident" }
            );
            (Compute::Cuda { cm: Arc::new(cm), store: store.clone() }, line)
        }
        None => {
            let experts: Arc<dyn crate::cpu::ExpertSource + Send + Sync> = match &store {
                Some(s) => s.clone(),
                None => Arc::new(MappedExperts),
            };
            let line = format!("the CPU ({} threads, {})", cpu.pool.current_num_threads(), cpu.kernels.isa().name());
            (Compute::Cpu { cpu: Arc::new(cpu), experts }, line)
        }
    };
    let cuda = match &compute {
        Compute::Cuda { cm, .. } => Some(cm.clone()),
        Compute::Cpu { .. } => None,
    };
    // /metrics: the host store's tier hit rates, and on a GPU the VRAM
    // pool's traffic (hits, uploads, zero-copy and CPU-lane bytes).
    let tier_stats: Option<server::metrics::TierStats> = match (cuda.clone().filter(|cm| cm.experts.is_some()), store.clone()) {
        (None, None) => None,
        (None, Some(s)) => Some(Arc::new(move || crate::experts::tier_hit_rates(&s.store.stats()))),
        (Some(cm), s) => Some(Arc::new(move || {
            let mut v = s.as_ref().map_or_else(|| serde_json::json!({}), |s| crate::experts::tier_hit_rates(&s.store.stats()));
            v["gpu_pool"] = cm.pool_stats().and_then(|p| serde_json::to_value(p).ok()).unwrap_or(serde_json::Value::Null);
            v
        })),
    };
    // A GPU may have chosen a pool (default_gpu_pool).
    opts.kv_pool = kv_pool;
    let model = Arc::new(model);
    let backend = Backend { model: model.clone(), compute, tier_stats };
    let model_path = a.model.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().thread_name("pulsar-http").build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port)).await.with_context(|| format!("cannot listen on {}:{}", opts.host, opts.port))?;
        let addr = listener.local_addr()?;
        let shown = if addr.is_ipv6() { format!("[{}]:{}", addr.ip(), addr.port()) } else { addr.to_string() };
        eprintln!(
            "pulsar-host serve: listening on http://{shown} (model {}, on {backend_line}, ctx {} per sequence, {} sequence slots{}{})",
            opts.model_id,
            opts.n_ctx,
            opts.parallel,
            opts.kv_pool.map_or_else(String::new, |n| format!(", a KV pool of {n} positions")),
            if opts.api_key.is_some() { ", API key required" } else { "" }
        );
        // Save the expert census like the CLI does, once nothing runs the model.
        let on_shutdown: server::ShutdownHook = Box::new(move || super::save_census(cuda.as_deref(), store.as_deref(), &model_path, &model));
        server::serve(listener, backend, opts, shutdown_signal(), Some(on_shutdown)).await
    })?;
    Ok(ExitCode::SUCCESS)
}
