//! `pulsar-host run`: generate, chat, or check a model.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use pulsar_tokenizer::Tokenizer;

use super::Ctx;
use crate::chat::{ChatTemplate, Message};
use crate::config;
use crate::cpu::{CpuBackend, ExpertSource, MappedExperts};
use crate::cuda::{CudaEngine, CudaKv, CudaModel};
use crate::engine::Engine;
use crate::server::stop_ids;
use crate::session::{open_device, reuse_prefix, Session, CHAT_CHECKPOINTS};
use crate::model::Model;
use crate::sample::{argmax, Sampler, SamplerConfig};
use super::repl::Input;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF model (default: a built-in tiny synthetic model, created on first use).
    #[arg(short = 'm', long = "model", help_heading = "Model")]
    pub model: Option<PathBuf>,
    /// Use this plugin instead of the one `general.architecture` selects.
    #[arg(long, value_name = "NAME", help_heading = "Model")]
    pub arch_plugin: Option<String>,
    /// Context length (default: the model's, capped at 4096).
    #[arg(short = 'c', long, visible_alias = "ctx-size", env = "PULSAR_CTX", help_heading = "Model")]
    pub ctx: Option<usize>,

    /// Prompt text.
    #[arg(short = 'p', long = "prompt", conflicts_with = "file", help_heading = "Generation")]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long = "file", value_name = "FILE", help_heading = "Generation")]
    pub file: Option<PathBuf>,
    /// Tokens to generate; -1: until end of turn or a full context (default:
    /// 32, and -1 in --chat).
    #[arg(short = 'n', long = "n-predict", visible_alias = "predict", allow_negative_numbers = true, value_name = "N", help_heading = "Generation")]
    pub n_predict: Option<i64>,
    /// Interactive multi-turn chat (line editing and history; the KV cache is
    /// kept across turns; /help lists the commands).
    #[arg(long, visible_alias = "conversation", help_heading = "Generation")]
    pub chat: bool,
    /// System prompt for --chat.
    #[arg(long, visible_alias = "system-prompt", help_heading = "Generation")]
    pub system: Option<String>,
    /// Do not add the vocabulary's BOS token to the prompt.
    #[arg(long, help_heading = "Generation")]
    pub no_bos: bool,
    /// Prompt as token ids (`1,2,3`) instead of text; used as given.
    #[arg(long, value_delimiter = ',', help_heading = "Generation")]
    pub tokens: Option<Vec<u32>>,
    /// Keep generating past end-of-turn tokens (for measurements and checks).
    #[arg(long, help_heading = "Generation")]
    pub ignore_eos: bool,

    /// Sampling temperature (0 = greedy, the default).
    #[arg(long, visible_alias = "temperature", default_value_t = 0.0, help_heading = "Sampling")]
    pub temp: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0, help_heading = "Sampling")]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 1.0, help_heading = "Sampling")]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0, help_heading = "Sampling")]
    pub min_p: f32,
    /// Seed of the sampler (same seed, same text).
    #[arg(short = 's', long, default_value_t = 0x5eed, help_heading = "Sampling")]
    pub seed: u64,
    /// Penalize tokens among the last --repeat-last-n (1 = off; llama.cpp's).
    #[arg(long, default_value_t = 1.0, help_heading = "Sampling")]
    pub repeat_penalty: f32,
    /// How many recent tokens (prompt and reply) the penalties look at (0 = off).
    #[arg(long, default_value_t = 64, help_heading = "Sampling")]
    pub repeat_last_n: usize,
    /// Subtract this from the logit of every recent token (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, help_heading = "Sampling")]
    pub presence_penalty: f32,
    /// Subtract this per occurrence of a recent token (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, help_heading = "Sampling")]
    pub frequency_penalty: f32,

    /// Host RAM for the expert cache, in GiB (default: everything resident when
    /// the experts fit in available memory, else a budget solved from MemAvailable).
    #[arg(long, env = "PULSAR_CACHE_GB", value_name = "GB", help_heading = "Memory and streaming")]
    pub host_cache: Option<f64>,
    /// Largest prefill chunk, in tokens.
    #[arg(long, visible_alias = "ubatch-size", default_value_t = 256, help_heading = "Memory and streaming")]
    pub ubatch: usize,
    /// Print per-token expert-store traffic (bytes and hits per tier) and a summary.
    #[arg(long, help_heading = "Memory and streaming")]
    pub stats: bool,
    #[command(flatten)]
    pub gpu: super::GpuArgs,

    /// Write the logits of every prompt position to a NumPy .npy [n_tokens, n_vocab].
    #[arg(long, value_name = "FILE", help_heading = "Checks")]
    pub dump_logits: Option<PathBuf>,
    /// Print, per prompt position, the token and the five highest next-token logits (JSON Lines).
    #[arg(long, help_heading = "Checks")]
    pub teacher_force: bool,
    /// Decode N tokens, prefill the same sequence fresh, report max |Δlogit|.
    #[arg(long, value_name = "N", help_heading = "Checks")]
    pub decode_consistency: Option<usize>,
}

impl Args {
    /// The token budget of one reply: `None` runs to end of turn (or a full context).
    fn budget(&self) -> anyhow::Result<Option<usize>> {
        match self.n_predict {
            None if self.chat => Ok(None),
            None => Ok(Some(32)),
            Some(-1) => Ok(None),
            Some(n) if n >= 0 => Ok(Some(n as usize)),
            Some(n) => anyhow::bail!("-n {n}: give a count of tokens, or -1 for \"until end of turn\""),
        }
    }

    fn sampling(&self) -> anyhow::Result<SamplerConfig> {
        let s = SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
        };
        s.validate().map_err(|e| anyhow::anyhow!("sampling: {e}"))?;
        Ok(s)
    }
}


/// One token's expert traffic: the difference of two store snapshots.
fn token_traffic(b: &pulsar_store::StoreStats, a: &pulsar_store::StoreStats) -> String {
    let (x, y) = (&b.total, &a.total);
    let mib = |v: u64| v as f64 / 1048576.0;
    let secs = y.disk_seconds - x.disk_seconds;
    let disk = y.disk.bytes - x.disk.bytes;
    format!(
        "host {} hits ({:.2} MiB), disk {} reads ({:.2} MiB, {:.2} GB/s), resident {} ({:.2} MiB)",
        y.host.slabs - x.host.slabs,
        mib(y.host.bytes - x.host.bytes),
        y.disk.slabs - x.disk.slabs,
        mib(disk),
        if secs > 0.0 { disk as f64 / secs / 1e9 } else { 0.0 },
        y.mapped.slabs - x.mapped.slabs,
        mib(y.mapped.bytes - x.mapped.bytes),
    )
}

fn stats_line(s: &pulsar_store::StoreStats) -> String {
    let t = &s.total;
    format!(
        "experts: {} selections; host {} hits ({:.1} MiB), disk {} reads ({:.1} MiB, {:.2} GB/s), mapped {} ({:.1} MiB); prefetch {:.0}% precise",
        t.selections,
        t.host.slabs,
        t.host.bytes as f64 / 1048576.0,
        t.disk.slabs,
        t.disk.bytes as f64 / 1048576.0,
        if t.disk_seconds > 0.0 { t.disk.bytes as f64 / t.disk_seconds / 1e9 } else { 0.0 },
        t.mapped.slabs,
        t.mapped.bytes as f64 / 1048576.0,
        100.0 * s.prefetch.precision(),
    )
}

struct Timing {
    /// Model load time, on the first line a run prints.
    load_secs: Option<f64>,
    prefill_tokens: usize,
    prefill_secs: f64,
    decode_tokens: usize,
    decode_secs: f64,
}

impl Timing {
    fn line(&self) -> String {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        let load = self.load_secs.map_or(String::new(), |s| format!("load: {s:.2} s | "));
        format!(
            "{load}prefill: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s",
            self.prefill_tokens,
            rate(self.prefill_tokens, self.prefill_secs),
            self.decode_tokens,
            rate(self.decode_tokens, self.decode_secs)
        )
    }
}

fn prompt_tokens(a: &Args, tok: &Tokenizer, text: &str) -> Vec<u32> {
    if let Some(t) = &a.tokens {
        return t.clone();
    }
    let mut ids = Vec::new();
    if tok.add_bos() && !a.no_bos {
        ids.extend(tok.bos());
    }
    ids.extend(tok.encode(text, false, true));
    ids
}

pub fn main(mut ctx: Ctx, mut a: Args) -> anyhow::Result<ExitCode> {
    settle(&mut ctx, &mut a);
    // Flags that need no model are checked before one loads.
    let budget = a.budget()?;
    let sampling = a.sampling()?;
    let prompt_text = match &a.file {
        Some(f) => Some(std::fs::read_to_string(f).with_context(|| format!("cannot read the prompt file (-f) {}", f.display()))?),
        None => a.prompt.clone(),
    };
    let model_path = match &a.model {
        Some(p) => p.clone(),
        None => {
            let p = crate::synth::default_model()?;
            eprintln!("no -m given: running the built-in default model {} (random weights: the text is noise)", p.display());
            p
        }
    };
    ctx.cfg.ctx = config::resolve(&ctx.sub, "ctx", a.ctx.map(Some), ctx.file.ctx.map(Some), || None);
    if ctx.print_config {
        eprint!("{}", ctx.cfg.print());
    }
    let t_load = Instant::now();
    let mut model = ctx.open_model(&model_path, a.arch_plugin.as_deref())?;
    model.kv_type = a.gpu.kv_type;
    let tok = crate::tok::load(&model.file).with_context(|| format!("tokenizer of {}", model_path.display()))?;
    let n_ctx = ctx.cfg.ctx.value.unwrap_or_else(|| (model.plan.n_ctx_train as usize).clamp(1, 4096));
    super::warn_past_trained_ctx(&model, n_ctx);
    let cpu = CpuBackend::new(ctx.cfg.threads.value)?;
    let device = open_device(a.gpu.resolve_device(&model, ctx.print_config)?)?;
    // On a GPU the host cache is page-locked, so its slabs upload by DMA.
    let pinned = device.as_ref().map(|d| crate::cuda::PinnedAllocator::new(d.context().clone()));
    let ranges = pinned.as_ref().map(|p| p.ranges());
    let alloc = pinned.map(|p| std::sync::Arc::new(p) as std::sync::Arc<dyn pulsar_store::HostAllocator>);
    let store = crate::experts::experts_for_with(&model, a.host_cache, alloc)?;
    let source: &dyn ExpertSource = match &store {
        Some(s) => s,
        None => &MappedExperts,
    };
    let cuda_model = match device {
        Some(dev) => {
            let t = Instant::now();
            let census = crate::cuda::warm_census(&model_path, &model);
            let opts = a.gpu.load_options(CudaKv::bytes_for(&model, n_ctx), census, store.as_ref().is_some_and(|s| s.cached));
            let cm = CudaModel::load(dev, &model, &opts)?;
            if let Some(r) = ranges {
                cm.set_host_pinned(r);
            }
            tracing::info!(
                "{} ({}): {:.2} GiB resident, experts {} in {:.2} s",
                cm.dev.name(),
                cm.dev.arch(),
                cm.resident_bytes as f64 / (1u64 << 30) as f64,
                if cm.experts.is_some() { "stream through a VRAM pool" } else { "resident" },
                t.elapsed().as_secs_f64()
            );
            Some(cm)
        }
        None => None,
    };
    let mut cpu_engine;
    let mut cuda_engine;
    let engine: &mut dyn Session = match &cuda_model {
        Some(cm) => {
            cuda_engine = CudaEngine::new(&model, cm, n_ctx)?.with_store(store.as_ref());
            &mut cuda_engine
        }
        None => {
            cpu_engine = Engine::new(&model, &cpu, source, n_ctx);
            &mut cpu_engine
        }
    };
    engine.set_ubatch(a.ubatch);
    let mem = model.memory_plan();
    tracing::info!(
        "loaded {} ({}, plugin {}) in {:.2} s: {:.1} MiB resident, {:.1} MiB routed experts, ctx {n_ctx}, {} threads ({})",
        model_path.display(),
        model.arch,
        model.plugin,
        t_load.elapsed().as_secs_f64(),
        mem.resident_bytes as f64 / 1048576.0,
        mem.expert_bytes as f64 / 1048576.0,
        cpu.pool.current_num_threads(),
        cpu.kernels.isa().name(),
    );
    let load_secs = t_load.elapsed().as_secs_f64();
    let code = if a.chat {
        chat(&a, &model, &tok, engine, sampling, budget)?
    } else {
        let job = Generate { text: prompt_text.unwrap_or_default(), budget, sampling, load_secs };
        generate(&a, &model, &tok, engine, job, store.as_ref())?
    };
    if let (Some(cm), true) = (&cuda_model, a.stats) {
        if let Some(p) = cm.pool_stats() {
            eprintln!("vram expert pool: {}", serde_json::to_string(&p)?);
        }
    }
    if let (None, Some(st), true) = (&cuda_model, &store, a.stats) {
        eprintln!("{}", stats_line(&st.store.stats()));
    }
    super::save_census(cuda_model.as_ref(), store.as_ref(), &model_path, &model);
    Ok(code)
}

/// Flag or env > config file > default, for what a config file may set;
/// each resolved value is kept for `--print-config`.
fn settle(ctx: &mut Ctx, a: &mut Args) {
    let (cfg, m, f) = (&mut ctx.cfg, &ctx.sub, &ctx.file);
    a.temp = cfg.settle(m, "temp", "temp", a.temp, f.temp);
    a.top_k = cfg.settle(m, "top_k", "top_k", a.top_k, f.top_k);
    a.top_p = cfg.settle(m, "top_p", "top_p", a.top_p, f.top_p);
    a.min_p = cfg.settle(m, "min_p", "min_p", a.min_p, f.min_p);
    a.seed = cfg.settle(m, "seed", "seed", a.seed, f.seed);
    a.repeat_penalty = cfg.settle(m, "repeat_penalty", "repeat_penalty", a.repeat_penalty, f.repeat_penalty);
    a.repeat_last_n = cfg.settle(m, "repeat_last_n", "repeat_last_n", a.repeat_last_n, f.repeat_last_n);
    a.presence_penalty = cfg.settle(m, "presence_penalty", "presence_penalty", a.presence_penalty, f.presence_penalty);
    a.frequency_penalty = cfg.settle(m, "frequency_penalty", "frequency_penalty", a.frequency_penalty, f.frequency_penalty);
    a.host_cache = cfg.settle_opt(m, "host_cache", "host_cache_gb", a.host_cache, f.host_cache_gb);
    a.ubatch = cfg.settle(m, "ubatch", "ubatch", a.ubatch, None);
    a.gpu.settle(cfg, m, f);
}

/// What one `run` without `--chat` generates from.
struct Generate {
    text: String,
    budget: Option<usize>,
    sampling: SamplerConfig,
    load_secs: f64,
}

fn generate(a: &Args, model: &Model, tok: &Tokenizer, engine: &mut dyn Session, job: Generate, store: Option<&crate::experts::StoreExperts>) -> anyhow::Result<ExitCode> {
    let Generate { text, budget, sampling, load_secs } = job;
    let prompt = prompt_tokens(a, tok, &text);
    if prompt.is_empty() {
        anyhow::bail!("the prompt is empty: give -p TEXT or --tokens (the vocabulary adds no BOS)");
    }
    if let Some(n) = a.decode_consistency {
        return decode_consistency(engine, &prompt, n);
    }
    let want_all = a.teacher_force || a.dump_logits.is_some();
    let t0 = Instant::now();
    let logits = engine.forward(&prompt, want_all)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    if let Some(path) = &a.dump_logits {
        let vocab = logits.first().map_or(0, |r| r.len());
        let flat: Vec<f32> = logits.iter().flatten().copied().collect();
        crate::npy::write_f32(path, &[logits.len(), vocab], &flat).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote logits [{}, {vocab}] to {}", logits.len(), path.display());
    }
    if a.teacher_force {
        let out = std::io::stdout();
        let mut out = out.lock();
        for (pos, (row, &token)) in logits.iter().zip(&prompt).enumerate() {
            let mut idx: Vec<usize> = (0..row.len()).collect();
            idx.sort_by(|&x, &y| row[y].partial_cmp(&row[x]).unwrap_or(std::cmp::Ordering::Equal).then(x.cmp(&y)));
            let top: Vec<(usize, f32)> = idx.iter().take(5).map(|&i| (i, row[i])).collect();
            writeln!(out, "{}", serde_json::json!({"pos": pos, "token": token, "top": top}))?;
        }
        eprintln!("{}", Timing { load_secs: Some(load_secs), prefill_tokens: prompt.len(), prefill_secs, decode_tokens: 0, decode_secs: 0.0 }.line());
        return Ok(ExitCode::SUCCESS);
    }
    let mut sampler = Sampler::new(sampling);
    sampler.accept_all(&prompt);
    let mut next = sampler.sample(logits.last().expect("one row"));
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if a.tokens.is_none() {
        write!(out, "{text}")?;
    }
    let mut dec = tok.stream_decoder(true);
    let t1 = Instant::now();
    let mut generated = 0;
    let stops = stop_ids(model, tok);
    let limit = budget.unwrap_or(usize::MAX);
    let mut reason = Stop::Length;
    while generated < limit {
        if !a.ignore_eos && stops.contains(&next) {
            reason = Stop::EndOfText;
            break;
        }
        write!(out, "{}", dec.push(next))?;
        out.flush()?;
        generated += 1;
        if generated == limit {
            break;
        }
        if engine.n_past() + 1 > engine.n_ctx() {
            reason = Stop::ContextFull;
            break;
        }
        let before = store.filter(|_| a.stats).map(|s| s.store.stats());
        let l = engine.forward(&[next], false)?;
        if let (Some(b), Some(s)) = (before, store) {
            eprintln!("[token {generated}] {}", token_traffic(&b, &s.store.stats()));
        }
        next = sampler.sample(&l[0]);
    }
    writeln!(out, "{}", dec.finish())?;
    let decode_secs = t1.elapsed().as_secs_f64();
    // The first generated token comes from the prefill's logits.
    let decode_tokens = generated.saturating_sub(1);
    eprintln!("[{}]", reason.label());
    eprintln!("{}", Timing { load_secs: Some(load_secs), prefill_tokens: prompt.len(), prefill_secs, decode_tokens, decode_secs }.line());
    Ok(ExitCode::SUCCESS)
}

fn decode_consistency(engine: &mut dyn Session, prompt: &[u32], n: usize) -> anyhow::Result<ExitCode> {
    // Incremental: prefill the prompt, then one token at a time (greedy).
    let mut seq = prompt.to_vec();
    let mut inc: Vec<Vec<f32>> = vec![engine.forward(prompt, false)?.pop().expect("one row")];
    for _ in 0..n {
        let next = argmax(inc.last().expect("non-empty"));
        seq.push(next);
        inc.push(engine.forward(&[next], false)?.pop().expect("one row"));
    }
    // Fresh: the whole sequence in one prefill, every row's logits.
    engine.reset();
    let fresh = engine.forward(&seq, true)?;
    let mut max = 0f32;
    for (i, row) in inc.iter().enumerate() {
        let f = &fresh[prompt.len() - 1 + i];
        for (x, y) in row.iter().zip(f) {
            max = max.max((x - y).abs());
        }
    }
    println!("decode-consistency: {n} decoded tokens, {} positions compared, max |Δlogit| = {max:e}", inc.len());
    Ok(ExitCode::SUCCESS)
}

fn chat(a: &Args, model: &Model, tok: &Tokenizer, engine: &mut dyn Session, sampling: SamplerConfig, budget: Option<usize>) -> anyhow::Result<ExitCode> {
    let gguf_tpl = model.file.metadata().get_str("tokenizer.chat_template")?;
    let piece = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
    let tpl = ChatTemplate::new(gguf_tpl, model.chat.fallback_template.as_ref().map(|s| s.as_str()).into_option(), &piece(tok.bos()), &piece(tok.eos()))?;
    if gguf_tpl.is_none() {
        eprintln!(
            "warning: the file has no chat template (a base model?): the {} plugin's fallback template is used, and a model not tuned for it may not stop",
            model.arch
        );
    }
    let system: Vec<Message> = a.system.iter().map(|s| Message { role: "system".into(), content: s.clone() }).collect();
    let mut messages = system.clone();
    let stops = stop_ids(model, tok);
    let mut sampler = Sampler::new(sampling);
    let mut checkpoints = Vec::new();
    let mut repl = super::repl::Repl::new()?;
    let ctrl_c = super::repl::StopOnCtrlC::install();
    let mut out = std::io::stdout();
    eprintln!("chat with {} (template: {}); /help for commands, /bye or Ctrl-D to leave, Ctrl-C stops a reply", model.arch, tpl.source);
    loop {
        let line = match repl.read()? {
            Input::Bye => break,
            Input::Help => {
                eprintln!("{}", super::repl::HELP);
                continue;
            }
            Input::Clear => {
                messages = system.clone();
                engine.reset();
                checkpoints.clear();
                eprintln!("(conversation cleared)");
                continue;
            }
            Input::Unknown(c) => {
                eprintln!("unknown command {c}: /help lists them");
                continue;
            }
            Input::Message(m) => m,
        };
        // A model file copied over in place while the chat waited would fault the next read.
        if let Some(why) = model.file.changed_in_place() {
            anyhow::bail!("{why}: start the chat again to load it");
        }
        messages.push(Message { role: "user".into(), content: line });
        let text = tpl.render(&messages, true)?;
        // The template adds BOS itself when the family wants one.
        let ids = tok.encode(&text, false, true);
        if ids.len() + 1 > engine.n_ctx() {
            eprintln!("[the conversation ({} tokens) fills the context of {}: /clear to start again]", ids.len(), engine.n_ctx());
            messages.pop();
            continue;
        }
        // Reuse the cached prefix shared with the previous turns (for a
        // recurrent state, up to the latest checkpoint inside it).
        let common = reuse_prefix(engine, &ids, &mut checkpoints)?;
        ctrl_c.take();
        let t0 = Instant::now();
        let mut logits = engine.forward(&ids[common..], false)?.pop().expect("one row");
        if engine.has_recurrent() {
            // The next turn's render may differ from this reply's tokens
            // (thinking stripped, whitespace): keep the state at the prompt's end.
            checkpoints.push(engine.checkpoint()?);
            if checkpoints.len() > CHAT_CHECKPOINTS {
                checkpoints.remove(0);
            }
        }
        let prefill = (ids.len() - common, t0.elapsed().as_secs_f64());
        sampler.forget();
        sampler.accept_all(&ids);
        let mut reply = Vec::new();
        let mut dec = tok.stream_decoder(true);
        let t1 = Instant::now();
        let limit = budget.unwrap_or(usize::MAX);
        let mut reason = Stop::Length;
        while reply.len() < limit {
            if ctrl_c.take() {
                reason = Stop::Interrupted;
                break;
            }
            let next = sampler.sample(&logits);
            if !a.ignore_eos && stops.contains(&next) {
                reason = Stop::EndOfText;
                break;
            }
            reply.push(next);
            write!(out, "{}", dec.push(next))?;
            out.flush()?;
            if engine.n_past() + 1 > engine.n_ctx() {
                reason = Stop::ContextFull;
                break;
            }
            logits = engine.forward(&[next], false)?.pop().expect("one row");
        }
        writeln!(out, "{}", dec.finish())?;
        let timing = Timing { load_secs: None, prefill_tokens: prefill.0, prefill_secs: prefill.1, decode_tokens: reply.len(), decode_secs: t1.elapsed().as_secs_f64() };
        eprintln!("[{}] {}", reason.label(), timing.line());
        // A stopped reply stays in the conversation as far as it got.
        messages.push(Message { role: "assistant".into(), content: tok.decode(&reply) });
    }
    Ok(ExitCode::SUCCESS)
}

/// Why a reply ended, printed after it as llama.cpp does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    EndOfText,
    Length,
    ContextFull,
    Interrupted,
}

impl Stop {
    fn label(self) -> &'static str {
        match self {
            Stop::EndOfText => "end of text",
            Stop::Length => "length",
            Stop::ContextFull => "context full",
            Stop::Interrupted => "stopped",
        }
    }
}
