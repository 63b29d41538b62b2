//! Per-step and cumulative store statistics (embedded in benchmark JSON).

use serde::{Deserialize, Serialize};

use crate::host_cache::CacheCounters;
use crate::reader::ReadCounters;

/// A slab count and its bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCount {
    pub slabs: u64,
    pub bytes: u64,
}

impl TierCount {
    pub fn add(&mut self, bytes: u64) {
        self.slabs += 1;
        self.bytes += bytes;
    }
    fn merge(&mut self, o: TierCount) {
        self.slabs += o.slabs;
        self.bytes += o.bytes;
    }
}

/// Where a step's slabs came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TierStats {
    pub selections: u64,
    /// Distinct experts served by this store.
    pub experts: u64,
    /// Tier 1: slabs of selections that are not ours (placed on another device).
    pub elsewhere: TierCount,
    /// Tier 2: filled in by a GPU backend; this store never serves from VRAM.
    pub vram: TierCount,
    /// Tier 3: host-cache hits.
    pub host: TierCount,
    /// The part of `host` that a prefetch brought in.
    pub host_prefetched: TierCount,
    /// Tier 4: read from disk during the step.
    pub disk: TierCount,
    pub disk_seconds: f64,
    /// Fully resident mode: served straight from the caller's mapping.
    pub mapped: TierCount,
}

impl TierStats {
    pub fn merge(&mut self, o: &TierStats) {
        self.selections += o.selections;
        self.experts += o.experts;
        self.elsewhere.merge(o.elsewhere);
        self.vram.merge(o.vram);
        self.host.merge(o.host);
        self.host_prefetched.merge(o.host_prefetched);
        self.disk.merge(o.disk);
        self.disk_seconds += o.disk_seconds;
        self.mapped.merge(o.mapped);
    }

    /// Achieved disk throughput of demand reads, GB/s (10^9).
    pub fn disk_gbps(&self) -> f64 {
        if self.disk_seconds > 0.0 { self.disk.bytes as f64 / self.disk_seconds / 1e9 } else { 0.0 }
    }

    /// Host-cache hits over slabs this store had to provide.
    pub fn host_hit_rate(&self) -> f64 {
        let n = self.host.slabs + self.disk.slabs;
        if n > 0 { self.host.slabs as f64 / n as f64 } else { 0.0 }
    }
}

/// One resolve call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    pub layer: u32,
    #[serde(flatten)]
    pub tiers: TierStats,
}

/// Background prefetch and prediction accuracy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefetchStats {
    /// Slabs accepted into the queue.
    pub queued: u64,
    /// Slabs refused because the queue was at its request or byte cap, or the
    /// cache had no unpinned room.
    pub dropped: u64,
    /// Slabs already resident or being read.
    pub skipped: u64,
    pub read: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub failed: u64,
    /// Experts predicted for layer-steps that were then resolved.
    pub predicted: u64,
    /// Of those, experts the step really used.
    pub predicted_used: u64,
    /// Experts used by steps that had a prediction.
    pub used: u64,
}

impl PrefetchStats {
    /// Fraction of predictions that were used.
    pub fn precision(&self) -> f64 {
        if self.predicted > 0 { self.predicted_used as f64 / self.predicted as f64 } else { 0.0 }
    }
    /// Fraction of used experts that had been predicted.
    pub fn recall(&self) -> f64 {
        if self.used > 0 { self.predicted_used as f64 / self.used as f64 } else { 0.0 }
    }
}

/// Everything, cumulative since the store was opened.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StoreStats {
    /// "cached" (host cache over disk) or "mapped" (fully resident).
    pub mode: String,
    pub steps: u64,
    pub total: TierStats,
    pub last_step: Option<StepStats>,
    pub prefetch: PrefetchStats,
    pub cache: Option<CacheCounters>,
    /// The demand reader (prefetch reads are in `prefetch`).
    pub disk_reader: Option<ReadCounters>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_json() {
        let mut t = TierStats::default();
        t.host.add(100);
        t.host.add(100);
        t.disk.add(2_000_000_000);
        t.disk_seconds = 2.0;
        assert!((t.disk_gbps() - 1.0).abs() < 1e-9);
        assert!((t.host_hit_rate() - 2.0 / 3.0).abs() < 1e-9);
        let mut sum = TierStats::default();
        sum.merge(&t);
        sum.merge(&t);
        assert_eq!(sum.disk.slabs, 2);
        let p = PrefetchStats { predicted: 10, predicted_used: 6, used: 8, ..Default::default() };
        assert!((p.precision() - 0.6).abs() < 1e-9 && (p.recall() - 0.75).abs() < 1e-9);
        let s = StoreStats { mode: "cached".into(), steps: 1, total: t, last_step: Some(StepStats { layer: 3, tiers: t }), ..Default::default() };
        let j = serde_json::to_string(&s).unwrap();
        assert!(j.contains("\"layer\":3") && j.contains("\"disk_seconds\":2.0"), "{j}");
        assert_eq!(serde_json::from_str::<StoreStats>(&j).unwrap(), s);
    }
}
