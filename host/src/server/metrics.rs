//! Server counters for `GET /metrics`: Prometheus text, or JSON when asked.
//!
//! Expert-store tier hit rates (and, on a GPU, the VRAM expert pool's
//! counters under `gpu_pool`) are not measured here: the server asks
//! [`Backend::tier_stats`](super::Backend::tier_stats) for them. Until the
//! store is wired in that is `None`, and the field is `null` in JSON and a
//! comment in Prometheus text (no made-up numbers).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

/// Reports the expert store's hit rate per tier (`{"vram": 0.93, ...}`).
pub type TierStats = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// How far back the token rates look.
const WINDOW: Duration = Duration::from_secs(10);

#[derive(Default)]
pub struct Metrics {
    pub requests_total: AtomicU64,
    pub requests_rejected: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub queue_depth: AtomicU64,
    pub active_sequences: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub prompt_tokens_cached_total: AtomicU64,
    pub completion_tokens_total: AtomicU64,
    pub steps_total: AtomicU64,
    pub step_rows_total: AtomicU64,
    pub step_seconds_total_us: AtomicU64,
    /// Rows of the latest batched step.
    pub last_step_rows: AtomicU64,
    /// Time to first token (queued to first token), summed, and how many.
    pub ttft_total_us: AtomicU64,
    pub ttft_count: AtomicU64,
    /// Recent steps: (when, prompt rows, generated tokens).
    recent: Mutex<VecDeque<(Instant, u64, u64)>>,
    /// Sequence slots of the pool (fixed at start).
    pub slots: AtomicU64,
    /// The KV pool, in blocks of `kv_block_positions`: all, held by running
    /// sequences, held by free slots' cached prefixes.
    pub kv_block_positions: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_cached: AtomicU64,
    /// Sequences paused because the KV pool ran out (resumed when it has room).
    pub sequences_preempted: AtomicU64,
    pub sequences_waiting_for_kv: AtomicU64,
    pub tier_stats: Option<TierStats>,
    /// Why the engine stopped serving (the model file changed on disk); `/health` reports it.
    pub broken: Mutex<Option<String>>,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub requests_total: u64,
    pub requests_rejected: u64,
    pub requests_cancelled: u64,
    pub queue_depth: u64,
    pub active_sequences: u64,
    pub slots: u64,
    pub kv_block_positions: u64,
    pub kv_blocks_total: u64,
    /// KV blocks held by running sequences (0 when nothing runs).
    pub kv_blocks_used: u64,
    /// KV blocks held by free slots' cached prefixes (given up on demand).
    pub kv_blocks_cached: u64,
    pub sequences_preempted: u64,
    pub sequences_waiting_for_kv: u64,
    pub prompt_tokens_total: u64,
    pub prompt_tokens_cached_total: u64,
    pub completion_tokens_total: u64,
    pub steps_total: u64,
    /// Mean rows per batched step (sequences sharing one forward pass).
    pub mean_rows_per_step: f64,
    /// Rows of the latest step.
    pub last_step_rows: u64,
    /// Mean time from a request's arrival to its first token, ms (0 before one).
    pub mean_time_to_first_token_ms: f64,
    /// Generated tokens per second over the last 10 s.
    pub generation_tokens_per_second: f64,
    /// Prompt tokens processed per second over the last 10 s.
    pub prompt_tokens_per_second: f64,
    /// Expert-store tier hit rates, from the store; `null` until one is wired in.
    pub expert_tier_hit_rates: Option<serde_json::Value>,
}

impl Metrics {
    pub fn new(tier_stats: Option<TierStats>) -> Metrics {
        Metrics { tier_stats, ..Metrics::default() }
    }

    /// Record one batched step.
    pub fn step(&self, rows: u64, prompt_rows: u64, generated: u64, took: Duration) {
        self.steps_total.fetch_add(1, Relaxed);
        self.step_rows_total.fetch_add(rows, Relaxed);
        self.last_step_rows.store(rows, Relaxed);
        self.step_seconds_total_us.fetch_add(took.as_micros() as u64, Relaxed);
        self.prompt_tokens_total.fetch_add(prompt_rows, Relaxed);
        self.completion_tokens_total.fetch_add(generated, Relaxed);
        let now = Instant::now();
        let mut r = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        r.push_back((now, prompt_rows, generated));
        while r.front().is_some_and(|&(t, _, _)| now.duration_since(t) > WINDOW) {
            r.pop_front();
        }
    }

    /// Record where the KV pool stands.
    pub fn kv(&self, u: crate::engine::KvUsage) {
        self.kv_block_positions.store(u.block as u64, Relaxed);
        self.kv_blocks_total.store(u.total as u64, Relaxed);
        self.kv_blocks_used.store(u.used as u64, Relaxed);
        self.kv_blocks_cached.store(u.cached as u64, Relaxed);
    }

    /// Record a request's first token, `waited` after it was queued.
    pub fn first_token(&self, waited: Duration) {
        self.ttft_total_us.fetch_add(waited.as_micros() as u64, Relaxed);
        self.ttft_count.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        let now = Instant::now();
        let (mut p, mut g) = (0u64, 0u64);
        {
            let r = self.recent.lock().unwrap_or_else(|e| e.into_inner());
            for &(t, pr, gen) in r.iter() {
                if now.duration_since(t) <= WINDOW {
                    p += pr;
                    g += gen;
                }
            }
        }
        let secs = WINDOW.as_secs_f64();
        let steps = self.steps_total.load(Relaxed);
        Snapshot {
            requests_total: self.requests_total.load(Relaxed),
            requests_rejected: self.requests_rejected.load(Relaxed),
            requests_cancelled: self.requests_cancelled.load(Relaxed),
            queue_depth: self.queue_depth.load(Relaxed),
            active_sequences: self.active_sequences.load(Relaxed),
            slots: self.slots.load(Relaxed),
            kv_block_positions: self.kv_block_positions.load(Relaxed),
            kv_blocks_total: self.kv_blocks_total.load(Relaxed),
            kv_blocks_used: self.kv_blocks_used.load(Relaxed),
            kv_blocks_cached: self.kv_blocks_cached.load(Relaxed),
            sequences_preempted: self.sequences_preempted.load(Relaxed),
            sequences_waiting_for_kv: self.sequences_waiting_for_kv.load(Relaxed),
            prompt_tokens_total: self.prompt_tokens_total.load(Relaxed),
            prompt_tokens_cached_total: self.prompt_tokens_cached_total.load(Relaxed),
            completion_tokens_total: self.completion_tokens_total.load(Relaxed),
            steps_total: steps,
            mean_rows_per_step: if steps > 0 { self.step_rows_total.load(Relaxed) as f64 / steps as f64 } else { 0.0 },
            last_step_rows: self.last_step_rows.load(Relaxed),
            mean_time_to_first_token_ms: match self.ttft_count.load(Relaxed) {
                0 => 0.0,
                n => self.ttft_total_us.load(Relaxed) as f64 / n as f64 / 1e3,
            },
            generation_tokens_per_second: g as f64 / secs,
            prompt_tokens_per_second: p as f64 / secs,
            expert_tier_hit_rates: self.tier_stats.as_ref().map(|f| f()),
        }
    }
}

impl Snapshot {
    /// Prometheus text exposition format.
    pub fn prometheus(&self) -> String {
        let mut s = String::new();
        let mut put = |name: &str, kind: &str, help: &str, v: f64| {
            s.push_str(&format!("# HELP pulsar_{name} {help}\n# TYPE pulsar_{name} {kind}\npulsar_{name} {v}\n"));
        };
        put("requests_total", "counter", "Completion requests accepted.", self.requests_total as f64);
        put("requests_rejected_total", "counter", "Requests refused (bad input, queue full, shutting down).", self.requests_rejected as f64);
        put("requests_cancelled_total", "counter", "Generations stopped because the client went away.", self.requests_cancelled as f64);
        put("queue_depth", "gauge", "Requests waiting for a sequence slot.", self.queue_depth as f64);
        put("active_sequences", "gauge", "Sequences decoding now.", self.active_sequences as f64);
        put("sequence_slots", "gauge", "Sequence slots (--parallel).", self.slots as f64);
        put("kv_block_positions", "gauge", "Positions per KV block.", self.kv_block_positions as f64);
        put("kv_blocks_total", "gauge", "KV blocks in the pool (--kv-pool).", self.kv_blocks_total as f64);
        put("kv_blocks_used", "gauge", "KV blocks held by running sequences.", self.kv_blocks_used as f64);
        put("kv_blocks_cached", "gauge", "KV blocks held by free slots' cached prefixes.", self.kv_blocks_cached as f64);
        put("sequences_preempted_total", "counter", "Sequences paused because the KV pool ran out.", self.sequences_preempted as f64);
        put("sequences_waiting_for_kv", "gauge", "Paused sequences waiting for KV blocks.", self.sequences_waiting_for_kv as f64);
        put("prompt_tokens_total", "counter", "Prompt tokens run through the model.", self.prompt_tokens_total as f64);
        put("prompt_tokens_cached_total", "counter", "Prompt tokens reused from a cached prefix.", self.prompt_tokens_cached_total as f64);
        put("completion_tokens_total", "counter", "Tokens generated.", self.completion_tokens_total as f64);
        put("steps_total", "counter", "Batched forward steps.", self.steps_total as f64);
        put("rows_per_step", "gauge", "Mean rows per batched step.", self.mean_rows_per_step);
        put("last_step_rows", "gauge", "Rows of the latest batched step.", self.last_step_rows as f64);
        put("time_to_first_token_ms", "gauge", "Mean time from a request's arrival to its first token.", self.mean_time_to_first_token_ms);
        put("generation_tokens_per_second", "gauge", "Generated tokens per second, last 10 s.", self.generation_tokens_per_second);
        put("prompt_tokens_per_second", "gauge", "Prompt tokens per second, last 10 s.", self.prompt_tokens_per_second);
        match self.expert_tier_hit_rates.as_ref().and_then(|v| v.as_object()) {
            Some(tiers) => {
                s.push_str("# HELP pulsar_expert_tier_hit_rate Expert-store hit rate per tier.\n# TYPE pulsar_expert_tier_hit_rate gauge\n");
                for (tier, v) in tiers {
                    if let Some(x) = v.as_f64() {
                        s.push_str(&format!("pulsar_expert_tier_hit_rate{{tier=\"{tier}\"}} {x}\n"));
                    }
                }
            }
            None => s.push_str("# pulsar_expert_tier_hit_rate: not measured (no expert store is wired to the server yet)\n"),
        }
        // On a GPU with streamed experts: the VRAM pool's counters (hits,
        // uploads, zero-copy and CPU-lane bytes, ...), one gauge each.
        if let Some(pool) = self.expert_tier_hit_rates.as_ref().and_then(|v| v.get("gpu_pool")).and_then(|p| p.as_object()) {
            s.push_str("# HELP pulsar_gpu_expert_pool The VRAM expert pool's counters since start, by field.\n# TYPE pulsar_gpu_expert_pool gauge\n");
            for (field, v) in pool {
                if let Some(x) = v.as_f64() {
                    s.push_str(&format!("pulsar_gpu_expert_pool{{field=\"{field}\"}} {x}\n"));
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_lists_the_tiers_and_the_gpu_pool_counters() {
        let stats: TierStats = Arc::new(|| serde_json::json!({"host": 0.25, "disk": 0.75, "gpu_pool": {"uploaded_bytes": 1024, "hits": 7, "slots": 3}}));
        let text = Metrics::new(Some(stats)).snapshot().prometheus();
        assert!(text.contains("pulsar_expert_tier_hit_rate{tier=\"disk\"} 0.75"), "{text}");
        assert!(text.contains("pulsar_gpu_expert_pool{field=\"uploaded_bytes\"} 1024"), "{text}");
        assert!(text.contains("pulsar_gpu_expert_pool{field=\"hits\"} 7"), "{text}");
        let none = Metrics::new(None).snapshot().prometheus();
        assert!(none.contains("not measured") && !none.contains("gpu_expert_pool"), "{none}");
    }
}
