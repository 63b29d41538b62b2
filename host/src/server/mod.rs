//! `pulsar-host serve`: an OpenAI-compatible HTTP server (axum on tokio) with
//! a built-in web chat page.
//!
//! Routes: `GET /` (chat UI), `GET /health`, `GET /metrics`,
//! `GET /v1/models[/{id}]`, `POST /v1/chat/completions`, `POST /v1/completions`.
//!
//! One engine thread owns the model's sequence pool ([`crate::engine::BatchEngine`],
//! on the CPU or on a GPU: [`Compute`]) and runs every active request's next
//! tokens in one batched step
//! ([`scheduler`]); HTTP handlers tokenize, validate, queue a job and relay its
//! events as a JSON body or an SSE stream.
//!
//! ```text
//! pulsar-host serve -m model.gguf --parallel 4 --api-key KEY
//! curl -H 'Authorization: Bearer KEY' http://127.0.0.1:11435/v1/chat/completions \
//!      -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'
//! ```
//!
//! Also llama-server's `GET /props` (the sampling defaults, the context, the
//! chat template), `POST /tokenize` (`content`, `add_special`,
//! `with_pieces`), `POST /detokenize` (`tokens`) and `POST /apply-template`
//! (`messages`: the prompt the chat template renders, without generating).
//!
//! Request fields used: `messages` / `prompt` (one), `stream`,
//! `stream_options.include_usage`, `temperature` (default 1), `top_p`,
//! `min_p`, `top_k`, `seed`, `max_tokens` / `max_completion_tokens` (clamped to
//! the context), `stop` (string or up to 16), `n` (1 only), `model` (the
//! served id or absent; another name is a 404),
//! `presence_penalty` / `frequency_penalty` (OpenAI's, in [-2, 2]) and
//! llama.cpp's `repeat_penalty` / `repeat_last_n` (64 by default) and
//! `ignore_eos` (end-of-turn tokens do not stop it); a field
//! left out takes the server's default (`serve --temp ...`, else the GGUF's
//! `general.sampling.*`, else llama-server's 0.8 / 40 / 0.95 / 0.05).
//! Fields not implemented yet (`tools`, `response_format`, `logprobs`,
//! `logit_bias`, ...) are refused with a 400 naming the field when they ask
//! for something; other unknown fields are ignored. Responses
//! add `usage.prompt_tokens_details.cached_tokens` (prefix reuse) and a
//! `timings` object.

pub mod api;
mod conn;
mod guard;
mod handlers;
pub mod metrics;
pub mod scheduler;
pub mod stop;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pulsar_tokenizer::Tokenizer;

use crate::chat::ChatTemplate;
use crate::cpu::{CpuBackend, ExpertSource};
use crate::model::Model;

pub use guard::HostPolicy;
pub use metrics::{Metrics, TierStats};

/// Request bodies larger than this get 413.
pub const BODY_LIMIT: usize = 8 << 20;

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Address to bind (loopback unless told).
    pub host: String,
    /// 0 picks a free port (see [`Server::addr`]).
    pub port: u16,
    /// Required as `Authorization: Bearer KEY` on every route but `/health` (and the static `/` page).
    pub api_key: Option<String>,
    /// Positions per sequence.
    pub n_ctx: usize,
    /// Sequences decoded at once (KV cache slots).
    pub parallel: usize,
    /// Positions the KV pool holds for all sequences together (None: every
    /// slot at full context; never less than one full context).
    pub kv_pool: Option<usize>,
    /// Most tokens in one batched step.
    pub ubatch: usize,
    /// Requests that may wait for a slot; beyond, 503.
    pub max_queue: usize,
    /// Extra names accepted in Host/Origin headers.
    pub allow_hosts: Vec<String>,
    /// After SIGINT/SIGTERM, how long running generations may still finish.
    pub grace: Duration,
    /// The id `/v1/models` reports.
    pub model_id: String,
    /// Open connections at most; one more gets 503 and is closed.
    pub max_connections: usize,
    /// A request head must arrive within this (also the keep-alive idle limit).
    pub header_timeout: Duration,
    /// A request body must arrive within this once its head has.
    pub body_timeout: Duration,
    /// A response the client stops reading fails after this without progress.
    pub write_timeout: Duration,
    /// A request still waiting for a sequence slot after this gets 503.
    pub queue_timeout: Duration,
    /// What a request gets for each sampling field it leaves out.
    pub sampling: crate::sample::SamplerConfig,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            host: "127.0.0.1".into(),
            port: 11435,
            api_key: None,
            n_ctx: 4096,
            parallel: 4,
            kv_pool: None,
            ubatch: 256,
            max_queue: 512,
            allow_hosts: Vec::new(),
            grace: Duration::from_secs(10),
            model_id: "pulsar".into(),
            max_connections: 256,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(60),
            queue_timeout: Duration::from_secs(300),
            sampling: crate::sample::SamplerConfig::llama_server(),
        }
    }
}

/// What the server runs: a model with its compute resources.
pub struct Backend {
    pub model: Arc<Model>,
    pub compute: Compute,
    /// The expert store's hit rate per tier for `/metrics` (None: not measured).
    pub tier_stats: Option<metrics::TierStats>,
}

impl Backend {
    /// The model on the CPU, its experts from `experts`.
    pub fn cpu(model: Arc<Model>, cpu: Arc<CpuBackend>, experts: Arc<dyn ExpertSource + Send + Sync>) -> Backend {
        Backend { model, compute: Compute::Cpu { cpu, experts }, tier_stats: None }
    }
}

/// Where the steps run.
pub enum Compute {
    Cpu { cpu: Arc<CpuBackend>, experts: Arc<dyn ExpertSource + Send + Sync> },
    /// On a GPU; streamed experts come through `store`'s host cache when it
    /// has one (else the file mapping).
    Cuda { cm: Arc<crate::cuda::CudaModel>, store: Option<Arc<crate::experts::StoreExperts>> },
}

/// Called once when the server stops, after the engine thread has finished
/// (nothing runs the model any more): the place to save the expert census.
pub type ShutdownHook = Box<dyn FnOnce() + Send>;

/// Shared by every handler.
pub struct AppState {
    pub opts: ServeOptions,
    pub tok: Arc<Tokenizer>,
    /// The chat template, or why there is none.
    pub template: Result<ChatTemplate, String>,
    pub metrics: Arc<Metrics>,
    pub hosts: HostPolicy,
    pub api_key: Option<String>,
    /// To the engine thread.
    pub(crate) engine: mpsc::Sender<scheduler::Cmd>,
    /// Seeds requests that give none.
    pub seeds: AtomicU64,
    /// Cleared when the engine thread ends.
    pub engine_alive: Arc<AtomicBool>,
    pub ids: AtomicU64,
    pub created: u64,
    /// Turns for the CPU work requests bring (parsing, rendering,
    /// tokenizing): one a core.
    pub cpu_work: tokio::sync::Semaphore,
}

/// Token ids that end a turn: the vocabulary's stops plus the plugin's markers.
pub fn stop_ids(model: &Model, tok: &Tokenizer) -> Vec<u32> {
    let mut v: Vec<u32> = tok.stop_tokens().to_vec();
    for m in model.chat.stop_markers.iter() {
        if let Some(id) = tok.token_id(m.as_str()) {
            v.push(id);
        }
    }
    v.sort_unstable();
    v.dedup();
    v
}

fn template(model: &Model, tok: &Tokenizer) -> Result<ChatTemplate, String> {
    let gguf = model.file.metadata().get_str("tokenizer.chat_template").map_err(|e| e.to_string())?;
    let piece = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
    let fallback = model.chat.fallback_template.as_ref().map(|s| s.as_str()).into_option();
    ChatTemplate::new(gguf, fallback, &piece(tok.bos()), &piece(tok.eos())).map_err(|e| format!("{e:#}"))
}

/// Serve on `listener` until `signal` resolves, then shut down gracefully:
/// stop accepting, fail queued requests, give running ones `opts.grace` to
/// finish, cancel the rest, wait for the engine thread, run `on_shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    backend: Backend,
    opts: ServeOptions,
    signal: impl std::future::Future<Output = ()> + Send + 'static,
    on_shutdown: Option<ShutdownHook>,
) -> anyhow::Result<()> {
    let tok = Arc::new(crate::tok::load(&backend.model.file).context("the model's tokenizer")?);
    let template = template(&backend.model, &tok);
    if let Err(e) = &template {
        tracing::warn!("no chat template ({e}): /v1/chat/completions will refuse requests, /v1/completions works");
    }
    let metrics = Arc::new(Metrics::new(backend.tier_stats.clone()));
    let (tx, rx) = mpsc::channel();
    let parts = scheduler::EngineParts {
        stop_ids: stop_ids(&backend.model, &tok),
        model: backend.model,
        compute: backend.compute,
        tok: tok.clone(),
        n_ctx: opts.n_ctx,
        parallel: opts.parallel.max(1),
        kv_pool: opts.kv_pool,
        ubatch: opts.ubatch.max(1),
        grace: opts.grace,
        queue_timeout: opts.queue_timeout,
        metrics: metrics.clone(),
    };
    let engine_alive = Arc::new(AtomicBool::new(true));
    let alive = engine_alive.clone();
    let engine = std::thread::Builder::new().name("pulsar-engine".into()).spawn(move || {
        // Cleared however the thread ends, a panic included.
        struct Alive(Arc<AtomicBool>);
        impl Drop for Alive {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Relaxed);
            }
        }
        let _alive = Alive(alive);
        scheduler::run(parts, rx)
    })?;
    let bound = listener.local_addr()?;
    let seed0 = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let state = Arc::new(AppState {
        hosts: HostPolicy::new(&opts.host, &opts.allow_hosts),
        api_key: opts.api_key.clone().filter(|k| !k.is_empty()),
        opts: opts.clone(),
        tok,
        template,
        metrics,
        engine: tx.clone(),
        seeds: AtomicU64::new(seed0),
        engine_alive,
        ids: AtomicU64::new(1),
        created: api::now_secs(),
        cpu_work: tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get())),
    });
    let app = handlers::router(state.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let graceful = async move {
        signal.await;
        tracing::info!("shutting down: no new connections; running generations get {:?} to finish", opts.grace);
        let _ = tx.send(scheduler::Cmd::Shutdown);
        let _ = stop_tx.send(());
    };
    let limits = conn::Limits { max_connections: opts.max_connections, header_timeout: opts.header_timeout, write_timeout: opts.write_timeout };
    let server = conn::serve(listener, app, limits, graceful);
    tracing::info!("serving on http://{bound}");
    let mut server = std::pin::pin!(server);
    tokio::select! {
        _ = &mut server => {}
        _ = async {
            if stop_rx.await.is_ok() {
                // Cancelled generations end their streams; allow a little more
                // for clients to read them, then stop waiting.
                tokio::time::sleep(opts.grace + Duration::from_secs(5)).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => tracing::warn!("connections still open after the grace period: closing them"),
    }
    // The engine exits once the Shutdown command is seen and it is idle.
    let _ = state.engine.send(scheduler::Cmd::Shutdown);
    drop(state);
    let joined = tokio::task::spawn_blocking(move || engine.join()).await;
    if !matches!(joined, Ok(Ok(()))) {
        tracing::error!("the engine thread panicked");
    }
    if let Some(hook) = on_shutdown {
        hook();
    }
    tracing::info!("server stopped");
    Ok(())
}

/// A server running on its own thread and runtime (tests, embedding).
pub struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl Server {
    /// Bind `opts.host:opts.port` now (port 0 picks one) and serve in the background.
    pub fn start(backend: Backend, opts: ServeOptions, on_shutdown: Option<ShutdownHook>) -> anyhow::Result<Server> {
        let std_listener = std::net::TcpListener::bind((opts.host.as_str(), opts.port)).with_context(|| format!("cannot bind {}:{}", opts.host, opts.port))?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("pulsar-http".into()).spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().thread_name("pulsar-http").build()?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener)?;
                let signal = async move {
                    let _ = stop_rx.await;
                };
                serve(listener, backend, opts, signal, on_shutdown).await
            })
        })?;
        Ok(Server { addr, stop: Some(stop), thread: Some(thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Shut down gracefully (as on SIGTERM) and wait until it has stopped.
    pub fn shutdown(mut self) -> anyhow::Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> anyhow::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| anyhow::anyhow!("the server thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}
