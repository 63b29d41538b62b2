//! The engine thread: a FIFO queue of requests, a pool of sequence slots, and
//! a loop that runs every active sequence's next tokens in ONE batched
//! forward step (decodes one token each, prefills in chunks that share the
//! step's token budget), samples, and streams text back per request.
//!
//! A request whose receiver is gone (the client disconnected, the handler was
//! dropped) is dropped from the queue or stopped and its slot freed at the
//! next step boundary; the others carry on.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use pulsar_tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, CachedTokens, Timings, Usage};
use super::metrics::Metrics;
use super::stop::StopMatcher;
use super::Compute;
use crate::engine::{BatchEngine, BatchItem, EngineError, SeqBackend, SeqId};
use crate::model::Model;
use crate::sample::{Sampler, SamplerConfig};

/// What the engine sends back to a request's handler.
#[derive(Debug)]
pub enum Event {
    /// More generated text (never empty).
    Text(String),
    /// The generation ended.
    Done(Finish),
    /// It failed or was cancelled (shutdown).
    Error(ApiError),
}

#[derive(Debug, Clone, Copy)]
pub struct Finish {
    /// `stop` (a stop token or string) or `length` (max_tokens or the context).
    pub reason: &'static str,
    pub usage: Usage,
    pub timings: Timings,
}

/// One generation request.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplerConfig,
    /// Already clamped so that prompt + max_tokens fits the context.
    pub max_tokens: usize,
    pub stops: Vec<String>,
    /// End-of-turn tokens do not end it (llama-server's `ignore_eos`).
    pub ignore_eos: bool,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

pub enum Cmd {
    Submit(Job),
    /// Stop admitting; fail what is queued; let active sequences finish for
    /// up to the grace period, then cancel them; then exit.
    Shutdown,
}

/// Everything the engine thread owns.
pub struct EngineParts {
    pub model: Arc<Model>,
    pub compute: Compute,
    pub tok: Arc<Tokenizer>,
    /// Token ids that end a generation.
    pub stop_ids: Vec<u32>,
    pub n_ctx: usize,
    pub parallel: usize,
    /// Positions the KV pool holds (None: every slot at full context).
    pub kv_pool: Option<usize>,
    /// Most tokens one step runs (prefill chunks share it with decodes).
    pub ubatch: usize,
    pub grace: Duration,
    /// Queued requests older than this are failed with 503.
    pub queue_timeout: Duration,
    pub metrics: Arc<Metrics>,
}

struct Active<'t> {
    job: Job,
    seq: SeqId,
    /// Tokens to run next: the uncached prompt, then each sampled token.
    todo: Vec<u32>,
    prefilled: bool,
    cached: usize,
    generated: usize,
    sampler: Sampler,
    dec: StreamDecoder<'t>,
    stops: StopMatcher,
    admitted: Instant,
    first_token: Option<Instant>,
    /// Paused for KV blocks with this many others running: it goes on once
    /// fewer run (one finished, so its blocks came back), never sooner, or
    /// it would pause again at once.
    paused_beside: usize,
}

impl Active<'_> {
    fn send(&self, e: Event) {
        // A closed receiver is noticed at the next step boundary.
        let _ = self.job.events.send(e);
    }

    fn finish(&mut self, reason: &'static str) {
        let tail = self.dec.finish();
        let (mut text, _) = self.stops.push(&tail);
        text.push_str(&self.stops.finish());
        if !text.is_empty() {
            self.send(Event::Text(text));
        }
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let predicted = now.duration_since(first).as_secs_f64();
        let usage = Usage {
            prompt_tokens: self.job.prompt.len(),
            completion_tokens: self.generated,
            total_tokens: self.job.prompt.len() + self.generated,
            prompt_tokens_details: CachedTokens { cached_tokens: self.cached },
        };
        let timings = Timings {
            queue_ms: 1e3 * self.admitted.duration_since(self.job.enqueued).as_secs_f64(),
            prompt_ms: 1e3 * first.duration_since(self.admitted).as_secs_f64(),
            predicted_ms: 1e3 * predicted,
            // The first token comes from the prefill; the rest are decode steps.
            predicted_per_second: if predicted > 0.0 { self.generated.saturating_sub(1) as f64 / predicted } else { 0.0 },
        };
        tracing::info!(
            "sequence {}: {} prompt tokens ({} cached), {} generated, {reason}; queued {:.0} ms, prompt {:.0} ms, {:.1} tok/s",
            self.seq.0,
            usage.prompt_tokens,
            self.cached,
            self.generated,
            timings.queue_ms,
            timings.prompt_ms,
            timings.predicted_per_second
        );
        self.send(Event::Done(Finish { reason, usage, timings }));
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "unknown".into())
}

/// Run the engine loop until shutdown (or every sender is gone).
pub fn run(p: EngineParts, rx: Receiver<Cmd>) {
    match &p.compute {
        Compute::Cpu { cpu, experts } => {
            let mut engine = BatchEngine::new(&p.model, cpu, &**experts, p.n_ctx, p.parallel);
            if let Some(n) = p.kv_pool {
                engine = engine.with_kv_pool(n);
            }
            serve_loop(&p, engine, p.ubatch, rx)
        }
        Compute::Cuda { cm, store } => {
            // The engine thread makes the GPU calls: the context is current here.
            if let Err(e) = cm.dev.context().bind_to_thread() {
                tracing::error!("engine: cannot use the GPU on this thread: {e}");
                return fail_all(&p, rx, &format!("the GPU is not usable: {e}"));
            }
            let seqs = match crate::cuda::CudaSeqs::new(&p.model, cm, store.as_deref()) {
                Ok(s) if p.kv_pool.is_some() => s.paged(),
                Ok(s) => s,
                Err(e) => return fail_all(&p, rx, &e.to_string()),
            };
            // A step carries at most the chunk the VRAM budget's activation reserve holds.
            let ubatch = p.ubatch.min(seqs.max_rows()).max(1);
            match BatchEngine::with_backend(seqs, p.n_ctx, p.parallel) {
                Ok(engine) => serve_loop(&p, match p.kv_pool {
                    Some(n) => engine.with_kv_pool(n),
                    None => engine,
                }, ubatch, rx),
                Err(e) => fail_all(&p, rx, &format!("allocating the sequences' caches on the GPU: {e}")),
            }
        }
    }
}

/// No engine could start: answer every request with why, until shutdown.
fn fail_all(p: &EngineParts, rx: Receiver<Cmd>, why: &str) {
    tracing::error!("engine: {why}");
    *p.metrics.broken.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.to_string());
    while let Ok(c) = rx.recv() {
        match c {
            Cmd::Submit(job) => {
                p.metrics.queue_depth.fetch_sub(1, Relaxed);
                let _ = job.events.send(Event::Error(ApiError::unavailable(why.to_string())));
            }
            Cmd::Shutdown => break,
        }
    }
}

fn serve_loop<B: SeqBackend>(p: &EngineParts, mut engine: BatchEngine<B>, ubatch: usize, rx: Receiver<Cmd>) {
    let tok: &Tokenizer = &p.tok;
    let kv = engine.kv_usage();
    tracing::info!(
        "engine: {} sequence slots of {} positions; KV pool of {} positions ({} blocks of {})",
        engine.n_seq(),
        p.n_ctx,
        kv.total * kv.block,
        kv.total,
        kv.block
    );
    p.metrics.slots.store(engine.n_seq() as u64, Relaxed);
    let m = &p.metrics;
    m.kv(kv);
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut active: Vec<Active<'_>> = Vec::new();
    // Sequences paused when the KV pool ran out, oldest first; `todo` holds
    // every token they need cached again to go on.
    let mut parked: VecDeque<Active<'_>> = VecDeque::new();
    let mut shutdown: Option<Instant> = None;
    let mut broken: Option<String> = None;
    let mut rr = 0usize;
    let unavailable = || ApiError::unavailable("the server is shutting down");
    loop {
        m.active_sequences.store(active.len() as u64, Relaxed);
        m.sequences_waiting_for_kv.store(parked.len() as u64, Relaxed);
        m.kv(engine.kv_usage());
        let mut cmds = Vec::new();
        if active.is_empty() && queue.is_empty() && parked.is_empty() {
            if shutdown.is_some() {
                break;
            }
            match rx.recv() {
                Ok(c) => cmds.push(c),
                Err(_) => break,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(c) => cmds.push(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    shutdown.get_or_insert_with(Instant::now);
                    break;
                }
            }
        }
        for c in cmds {
            match c {
                Cmd::Submit(job) if shutdown.is_some() => {
                    m.queue_depth.fetch_sub(1, Relaxed);
                    let _ = job.events.send(Event::Error(unavailable()));
                }
                Cmd::Submit(job) => queue.push_back(job),
                Cmd::Shutdown => {
                    shutdown.get_or_insert_with(Instant::now);
                }
            }
        }
        if shutdown.is_some() {
            for job in queue.drain(..) {
                m.queue_depth.fetch_sub(1, Relaxed);
                let _ = job.events.send(Event::Error(unavailable()));
            }
        }
        // Clients that went away, and requests that waited too long.
        let before = queue.len();
        queue.retain(|j| !j.events.is_closed());
        let gone = before - queue.len();
        m.queue_depth.fetch_sub(gone as u64, Relaxed);
        m.requests_cancelled.fetch_add(gone as u64, Relaxed);
        let before = queue.len();
        queue.retain(|j| {
            let waited = j.enqueued.elapsed();
            let keep = waited < p.queue_timeout;
            if !keep {
                let e = ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    Some("queue_timeout"),
                    format!("no sequence slot came free within {:.0} s: retry later", waited.as_secs_f64()),
                );
                let _ = j.events.send(Event::Error(e));
            }
            keep
        });
        let expired = before - queue.len();
        m.queue_depth.fetch_sub(expired as u64, Relaxed);
        m.requests_rejected.fetch_add(expired as u64, Relaxed);
        let grace_over = shutdown.is_some_and(|t| t.elapsed() >= p.grace);
        parked.retain(|a| {
            if a.job.events.is_closed() {
                m.requests_cancelled.fetch_add(1, Relaxed);
                false
            } else if grace_over {
                a.send(Event::Error(ApiError::unavailable("the server shut down before this generation finished")));
                false
            } else {
                true
            }
        });
        active.retain(|a| {
            if a.job.events.is_closed() {
                tracing::info!("sequence {}: client gone after {} tokens; slot freed", a.seq.0, a.generated);
                m.requests_cancelled.fetch_add(1, Relaxed);
                engine.free(a.seq);
                false
            } else if grace_over {
                a.send(Event::Error(ApiError::unavailable("the server shut down before this generation finished")));
                engine.free(a.seq);
                false
            } else {
                true
            }
        });
        // A model file written in place would fault (SIGBUS) on the next
        // read of its mapping: stop touching it and fail every request with
        // the reason instead (checked once a step, on the open descriptor).
        if broken.is_none() && !(queue.is_empty() && active.is_empty()) {
            if let Some(why) = p.model.file.changed_in_place() {
                tracing::error!("{why}: failing every request until the server is restarted");
                *m.broken.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
                broken = Some(format!("{why}: restart the server to serve it"));
            }
        }
        if let Some(why) = &broken {
            for job in queue.drain(..) {
                m.queue_depth.fetch_sub(1, Relaxed);
                let _ = job.events.send(Event::Error(ApiError::unavailable(why.clone())));
            }
            for a in active.drain(..) {
                a.send(Event::Error(ApiError::unavailable(why.clone())));
                engine.free(a.seq);
            }
            for a in parked.drain(..) {
                a.send(Event::Error(ApiError::unavailable(why.clone())));
            }
            continue;
        }
        // Paused sequences go on first, once the pool holds what they had
        // (alone, a sequence always fits: the pool holds one full context).
        while engine.n_free() > 0 && parked.front().is_some_and(|a| active.len() < a.paused_beside && engine.has_room_for(a.todo.len()) || active.is_empty()) {
            let Some(mut a) = parked.pop_front() else { break };
            let Some((seq, cached)) = engine.alloc(&a.todo) else {
                parked.push_front(a);
                break;
            };
            tracing::debug!("sequence {}: resumed as {}, {} of {} positions still cached", a.seq.0, seq.0, cached, a.todo.len());
            a.seq = seq;
            a.todo.drain(..cached);
            a.prefilled = false;
            active.push(a);
        }
        // Admit in arrival order while slots and KV blocks are free (none
        // while a paused sequence waits for blocks).
        while engine.n_free() > 0 && parked.is_empty() {
            let Some(job) = queue.pop_front() else { break };
            if !active.is_empty() && !engine.has_room_for(job.prompt.len()) {
                queue.push_front(job);
                break;
            }
            let Some((seq, cached)) = engine.alloc(&job.prompt) else {
                queue.push_front(job);
                break;
            };
            m.queue_depth.fetch_sub(1, Relaxed);
            m.prompt_tokens_cached_total.fetch_add(cached as u64, Relaxed);
            tracing::debug!("sequence {}: {} prompt tokens, {cached} cached", seq.0, job.prompt.len());
            // The penalties look at the prompt's tokens too, as llama.cpp's do.
            let mut sampler = Sampler::new(job.sampling.clone());
            sampler.accept_all(&job.prompt);
            active.push(Active {
                todo: job.prompt[cached..].to_vec(),
                seq,
                prefilled: false,
                cached,
                generated: 0,
                sampler,
                dec: tok.stream_decoder(true),
                stops: StopMatcher::new(job.stops.clone()),
                admitted: Instant::now(),
                first_token: None,
                paused_beside: 0,
                job,
            });
        }
        m.active_sequences.store(active.len() as u64, Relaxed);
        if active.is_empty() {
            continue;
        }
        // The step: one token per decoding sequence, then prefill chunks in
        // round-robin order over what is left of the token budget.
        let n = active.len();
        rr = (rr + 1) % n;
        let n_decode = active.iter().filter(|a| a.prefilled).count();
        let mut budget = ubatch.saturating_sub(n_decode).max(16);
        let mut take = vec![0usize; n];
        for k in 0..n {
            let i = (rr + k) % n;
            let a = &active[i];
            if a.prefilled {
                take[i] = 1;
            } else if budget > 0 {
                take[i] = a.todo.len().min(budget);
                budget -= take[i];
            }
        }
        let order: Vec<usize> = (0..n).filter(|&i| take[i] > 0).collect();
        let items: Vec<BatchItem<'_>> = order.iter().map(|&i| BatchItem { seq: active[i].seq, tokens: &active[i].todo[..take[i]] }).collect();
        let rows: usize = items.iter().map(|it| it.tokens.len()).sum();
        let prompt_rows: usize = order.iter().filter(|&&i| !active[i].prefilled).map(|&i| take[i]).sum();
        let t0 = Instant::now();
        // A bug in an op must not take the server down: fail this step's requests.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.step(&items)))
            .unwrap_or_else(|p| Err(EngineError::Forward(format!("panic: {}", panic_text(&*p)))));
        drop(items);
        let logits = match result {
            Ok(l) => l,
            Err(EngineError::KvFull { seq, need, free, .. }) if active.len() > 1 => {
                // Pause the latest admitted sequence (its cache stays as a free
                // slot's, reused if nobody needs the room) and run the others.
                let i = (0..active.len()).max_by_key(|&i| active[i].admitted).unwrap_or(0);
                let mut a = active.remove(i);
                let mut all = engine.history(a.seq).map(<[u32]>::to_vec).unwrap_or_default();
                all.append(&mut a.todo);
                a.todo = all;
                engine.free(a.seq);
                a.paused_beside = active.len();
                m.sequences_preempted.fetch_add(1, Relaxed);
                tracing::info!("kv pool full (sequence {seq} needed {need} blocks, {free} free): sequence {} paused at {} positions", a.seq.0, a.todo.len());
                parked.push_back(a);
                continue;
            }
            Err(e) => {
                tracing::error!("batched step failed: {e}");
                let failed: Vec<SeqId> = order.iter().map(|&i| active[i].seq).collect();
                active.retain(|a| {
                    let hit = failed.contains(&a.seq);
                    if hit {
                        a.send(Event::Error(ApiError::internal(format!("the forward step failed: {e}"))));
                        engine.free(a.seq);
                    }
                    !hit
                });
                continue;
            }
        };
        let mut generated = 0u64;
        let mut done = Vec::new();
        for (row, &i) in logits.iter().zip(&order) {
            let a = &mut active[i];
            a.todo.drain(..take[i]);
            if !a.todo.is_empty() {
                continue; // Still prefilling.
            }
            if !a.prefilled {
                a.prefilled = true;
                // A resumed sequence had its first token before it was paused.
                if a.first_token.is_none() {
                    a.first_token = Some(Instant::now());
                    m.first_token(a.job.enqueued.elapsed());
                }
            }
            let t = a.sampler.sample(row);
            if !a.job.ignore_eos && p.stop_ids.contains(&t) {
                done.push((i, "stop"));
                continue;
            }
            a.generated += 1;
            generated += 1;
            let piece = a.dec.push(t);
            let (text, hit) = a.stops.push(&piece);
            if !text.is_empty() {
                a.send(Event::Text(text));
            }
            let n_past = engine.n_past(a.seq).unwrap_or(p.n_ctx);
            if hit {
                done.push((i, "stop"));
            } else if a.generated >= a.job.max_tokens || n_past + 1 > p.n_ctx {
                done.push((i, "length"));
            } else {
                a.todo.push(t);
            }
        }
        m.step(rows as u64, prompt_rows as u64, generated, t0.elapsed());
        // Free the slot and update the gauges (sequences and KV blocks)
        // before the client hears "done": a client reading /metrics after
        // its last response sees the pool as it is.
        done.sort_unstable();
        for &(i, reason) in done.iter().rev() {
            let mut a = active.remove(i);
            engine.free(a.seq);
            m.active_sequences.store(active.len() as u64, Relaxed);
            m.kv(engine.kv_usage());
            a.finish(reason);
        }
    }
    m.active_sequences.store(0, Relaxed);
    tracing::info!("engine: stopped");
}
