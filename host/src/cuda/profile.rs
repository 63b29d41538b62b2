//! GPU time per op (`bench --profile-ops`): each op starts on a drained
//! stream between two events, so a row is its kernels' time plus their launch
//! latency, without the host's time between ops. Steps run kernel by kernel
//! (no graph) while profiling.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaStream};
use pulsar_cuda::CudaDevice;

use super::CudaBackendError;

pub struct OpProfile {
    start: CudaEvent,
    end: CudaEvent,
    /// The segment being timed: (step kind, label), and when the host began it.
    open: Option<(usize, String)>,
    began: Instant,
    /// (kind, label) -> (calls, GPU milliseconds, host milliseconds).
    rows: BTreeMap<(usize, String), (u64, f64, f64)>,
    /// Steps seen per kind (0 decode, 1 prefill).
    pub steps: [u64; 2],
}

impl OpProfile {
    pub fn new(dev: &CudaDevice) -> Result<OpProfile, CudaBackendError> {
        Ok(OpProfile { start: dev.new_event(true)?, end: dev.new_event(true)?, open: None, began: Instant::now(), rows: BTreeMap::new(), steps: [0; 2] })
    }

    /// Close the open segment (if any) and, with `label`, open the next one.
    pub fn mark(&mut self, stream: &CudaStream, kind: usize, label: Option<String>) {
        if let Some(key) = self.open.take() {
            // Host time: from the segment's start to here (its launches, and
            // any wait for the device inside it), before waiting on the events.
            let host = self.began.elapsed().as_secs_f64() * 1e3;
            let ms = self.end.record(stream).and_then(|_| self.start.elapsed_ms(&self.end));
            if let Ok(ms) = ms {
                let e = self.rows.entry(key).or_default();
                e.0 += 1;
                e.1 += ms as f64;
                e.2 += host;
            }
        }
        if let Some(l) = label {
            if stream.synchronize().is_ok() && self.start.record(stream).is_ok() {
                self.open = Some((kind, l));
                self.began = Instant::now();
            }
        }
    }

    /// A Markdown table per step kind: calls and milliseconds per step, share.
    pub fn report(&self) -> String {
        let mut out = String::new();
        for (kind, name) in [(0, "decode"), (1, "prefill")] {
            let n = self.steps[kind];
            if n == 0 {
                continue;
            }
            let mut rows: Vec<(&str, u64, f64, f64)> = self.rows.iter().filter(|((k, _), _)| *k == kind).map(|((_, l), &(c, ms, h))| (l.as_str(), c, ms, h)).collect();
            rows.sort_by(|a, b| b.2.total_cmp(&a.2));
            let total: f64 = rows.iter().map(|r| r.2).sum();
            let host: f64 = rows.iter().map(|r| r.3).sum();
            let _ = writeln!(out, "\n{name}: {n} steps, {:.3} ms of GPU time and {:.3} ms of host time a step (ops run one at a time)\n", total / n as f64, host / n as f64);
            let _ = writeln!(out, "| op | calls a step | GPU ms a step | share | host ms a step |\n|---|---:|---:|---:|---:|");
            for (l, c, ms, h) in rows {
                let _ = writeln!(out, "| {l} | {:.1} | {:.3} | {:.1}% | {:.3} |", c as f64 / n as f64, ms / n as f64, 100.0 * ms / total.max(1e-12), h / n as f64);
            }
        }
        out
    }
}

/// A weight's name without its layer prefix (`blk.3.attn_q.weight` -> `attn_q.weight`).
pub fn short_name(name: &str) -> &str {
    match name.strip_prefix("blk.") {
        Some(rest) => rest.split_once('.').map_or(rest, |(_, t)| t),
        None => name,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn layer_prefixes_are_dropped() {
        assert_eq!(super::short_name("blk.12.ffn_gate_exps.weight"), "ffn_gate_exps.weight");
        assert_eq!(super::short_name("output.weight"), "output.weight");
    }
}
