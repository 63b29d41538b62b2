//! Measured throughputs of the cold paths and the time estimates the split
//! is made from.
//!
//! The link numbers come from the CUDA side; the CPU lane measures itself
//! here, with the same code that will serve the experts, so the estimate
//! includes its threading and quantization overheads.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::Activation;
use serde::Serialize;

use super::lane::{random_slab, CpuLane, GateUp, LaneError, LaneJob, LanePair, Slab};
use super::split::ColdPath;

/// A realistic routed-expert shape (Qwen3-30B-A3B class: d_model 2048..4096, ff 768..1536).
pub const BENCH_D_MODEL: usize = 4096;
pub const BENCH_FF: usize = 1536;
/// Bytes of experts the benchmark cycles through, so they stream from RAM as
/// host-cache experts do instead of sitting in the last-level cache.
const BENCH_WORKING_SET: u64 = 64 << 20;
const BENCH_MAX_EXPERTS: usize = 8;

/// Throughputs in GB/s (1e9 bytes a second) of weight bytes; `None` or a
/// non-positive value: unmeasured, so that path is not used.
#[derive(Clone, Debug, Serialize)]
pub struct CostModel {
    /// Host -> device copies from pinned memory (the host cache).
    pub h2d_pinned_gbs: Option<f64>,
    /// The rate the copy stream achieved on real steps' expert copies
    /// (per-copy overheads included), once observed: uploads are estimated
    /// with it in place of the probe's.
    pub h2d_observed_gbs: Option<f64>,
    /// Host -> device copies from pageable memory.
    pub h2d_pageable_gbs: Option<f64>,
    /// A GEMV kernel reading pinned host memory in place.
    pub zerocopy_gbs: Option<f64>,
    /// A GEMV kernel reading VRAM (the compute after an upload).
    pub gpu_gemv_gbs: Option<f64>,
    /// Threads the CPU lane numbers were measured with.
    pub cpu_threads: usize,
    /// SIMD level of the CPU lane.
    pub cpu_isa: String,
    /// CPU lane throughput per weight format (GGUF type name): the rate of
    /// its bytes beyond the first, the fixed cost being `cpu_fixed_s`.
    pub cpu_dot_gbs: BTreeMap<String, f64>,
    /// Seconds a lane job costs whatever its size (waking the threads, the
    /// two fork-joins, quantizing the input, staging the rows).
    pub cpu_fixed_s: f64,
    /// Correction the step applies to the lane's estimate, from whether the
    /// lane or the link finished a layer first (1: trust the rates).
    pub cpu_bias: f64,
    /// Seconds of a decode layer's serial work besides the lane (host
    /// planning, the GPU's kernels between one routing sync and the next):
    /// when the host waits for the lane, the lane's share must fit beside it
    /// within the link's time (a lane beside the host overlaps it instead).
    pub chain_s: f64,
}

/// Bounds of [`CostModel::cpu_bias`]: the measured rates are never off by more.
const BIAS_RANGE: (f64, f64) = (0.25, 4.0);
/// Lane jobs smaller than this do not update the rate.
const OBSERVE_MIN_BYTES: u64 = 1 << 20;
/// How far one layer's outcome moves the bias.
const BIAS_STEP: f64 = 1.04;

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            h2d_pinned_gbs: None,
            h2d_observed_gbs: None,
            h2d_pageable_gbs: None,
            zerocopy_gbs: None,
            gpu_gemv_gbs: None,
            cpu_threads: 0,
            cpu_isa: String::new(),
            cpu_dot_gbs: BTreeMap::new(),
            cpu_fixed_s: 0.0,
            cpu_bias: 1.0,
            chain_s: 0.0,
        }
    }
}

/// A usable rate, or `None`.
fn rate(g: Option<f64>) -> Option<f64> {
    g.filter(|v| v.is_finite() && *v > 0.0)
}

impl CostModel {
    /// The CPU lane's rate for `ty`, if measured and non-zero.
    pub fn cpu_gbs(&self, ty: GgmlType) -> Option<f64> {
        rate(self.cpu_dot_gbs.get(ty.name()).copied())
    }

    /// The rate uploads run at: pinned (the host cache is pinned), else pageable.
    pub fn upload_gbs(&self) -> Option<f64> {
        rate(self.h2d_observed_gbs).or(rate(self.h2d_pinned_gbs)).or(rate(self.h2d_pageable_gbs))
    }

    /// Fold one layer's copies (`bytes` in `secs` of copy-stream time) into
    /// the observed upload rate: a moving average; layers that copied under
    /// a MiB say more about latency than rate and are skipped.
    pub fn observe_link(&mut self, bytes: u64, secs: f64) {
        if bytes < OBSERVE_MIN_BYTES || !(secs.is_finite() && secs > 0.0) {
            return;
        }
        let g = bytes as f64 / secs / 1e9;
        self.h2d_observed_gbs = Some(match rate(self.h2d_observed_gbs) {
            Some(o) => 0.9 * o + 0.1 * g,
            None => g,
        });
    }

    /// Estimated seconds for `path` to serve one expert of `bytes` of `ty`;
    /// infinite when a rate it needs is unmeasured. An unmeasured GPU GEMV
    /// counts as free: VRAM is an order of magnitude faster than PCIe.
    pub fn seconds(&self, path: ColdPath, bytes: u64, ty: GgmlType) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        let over = |g: Option<f64>| g.map_or(f64::INFINITY, |g| bytes as f64 / (g * 1e9));
        match path {
            ColdPath::Upload => over(self.upload_gbs()) + rate(self.gpu_gemv_gbs).map_or(0.0, |g| bytes as f64 / (g * 1e9)),
            ColdPath::ZeroCopy => over(rate(self.zerocopy_gbs)),
            ColdPath::Cpu => over(self.cpu_gbs(ty)) * self.bias(),
        }
    }

    /// The lane's fixed cost of a job (its first expert pays it), biased as
    /// its rates are.
    pub fn cpu_fixed(&self) -> f64 {
        if self.cpu_fixed_s.is_finite() && self.cpu_fixed_s > 0.0 {
            self.cpu_fixed_s * self.bias()
        } else {
            0.0
        }
    }

    fn bias(&self) -> f64 {
        if self.cpu_bias.is_finite() {
            self.cpu_bias.clamp(BIAS_RANGE.0, BIAS_RANGE.1)
        } else {
            1.0
        }
    }

    /// One layer's outcome: `lane_first` when the CPU lane finished while the
    /// link was still busy (copying what the next layer needs), so the lane
    /// can take more; otherwise the link went idle waiting for the lane's
    /// layer to end. A small step each way keeps the two finishing together,
    /// whatever the rates missed (the GPU's serial work after the lane,
    /// memory contention, the link's other traffic).
    pub fn balance(&mut self, lane_first: bool) {
        let b = if lane_first { self.bias() / BIAS_STEP } else { self.bias() * BIAS_STEP };
        self.cpu_bias = b.clamp(BIAS_RANGE.0, BIAS_RANGE.1);
    }

    /// One decode layer's chain (see [`chain_s`](Self::chain_s)): a moving
    /// average that follows within a few layers.
    pub fn observe_chain(&mut self, secs: f64) {
        if !(secs.is_finite() && secs >= 0.0) {
            return;
        }
        self.chain_s = if self.chain_s > 0.0 { 0.9 * self.chain_s + 0.1 * secs } else { secs };
    }

    /// A layer whose cold experts all went over the link: no outcome to
    /// learn from, so the bias drifts back toward the measured rates (a lane
    /// priced out once gets to try again).
    pub fn relax(&mut self) {
        self.cpu_bias = self.bias().powf(0.98);
    }

    /// Fill the CPU part by timing `lane` on synthetic experts of each of
    /// `types`, about `budget / types.len()` each (plus generating the data).
    /// A type the lane cannot run is left out, so the split never sends it there.
    pub fn measure_cpu(&mut self, lane: &CpuLane, types: &[GgmlType], budget: Duration) {
        self.measure_cpu_shape(lane, types, budget, BENCH_D_MODEL, BENCH_FF);
    }

    pub(crate) fn measure_cpu_shape(&mut self, lane: &CpuLane, types: &[GgmlType], budget: Duration, d_model: usize, ff: usize) {
        self.cpu_threads = lane.threads();
        self.cpu_isa = lane.kernels().isa().name().to_string();
        let each = budget / types.len().max(1) as u32;
        let mut fixed: f64 = 0.0;
        for &ty in types {
            match bench_type(lane, ty, d_model, ff, each) {
                Ok((gbs, fixed_s)) => {
                    tracing::debug!(ty = ty.name(), gbs, fixed_us = fixed_s * 1e6, threads = lane.threads(), "cpu lane measured");
                    self.cpu_dot_gbs.insert(ty.name().to_string(), gbs);
                    // One fixed cost for all formats: it is the threads', not the dots'.
                    fixed = fixed.max(fixed_s);
                }
                Err(e) => {
                    tracing::warn!("cpu lane: not measuring {ty}: {e}");
                    self.cpu_dot_gbs.remove(ty.name());
                }
            }
        }
        self.cpu_fixed_s = fixed;
    }

    /// Fold one real lane job (`bytes` of `ty` weights in `secs`, fixed cost
    /// included) into the rate for `ty`: an exponential moving average that
    /// follows within a few steps, starting from the microbenchmark. The
    /// fixed cost comes off first (at most three quarters of the time, so a
    /// fast job cannot imply an infinite rate).
    pub fn observe_cpu(&mut self, ty: GgmlType, bytes: u64, secs: f64) {
        // A small job's time is mostly latency, not rate: it would drag the
        // rate down, shrinking the next share further.
        if !(secs.is_finite() && secs > 0.0) || bytes < OBSERVE_MIN_BYTES {
            return;
        }
        let fixed = if self.cpu_fixed_s.is_finite() { self.cpu_fixed_s.max(0.0) } else { 0.0 };
        let gbs = bytes as f64 / (secs - fixed).max(0.25 * secs) / 1e9;
        let e = self.cpu_dot_gbs.entry(ty.name().to_string()).or_insert(gbs);
        *e = 0.8 * *e + 0.2 * gbs;
    }

    /// One line per link and per CPU format, for `--print-config`.
    pub fn summary(&self) -> String {
        let show = |g: Option<f64>| rate(g).map_or("unmeasured".to_string(), |g| format!("{g:.1} GB/s"));
        let mut s = format!(
            "cold h2d pinned    {} (steps: {})\ncold h2d pageable  {}\ncold zero-copy     {}\ncold gpu gemv      {}\n",
            show(self.h2d_pinned_gbs),
            show(self.h2d_observed_gbs),
            show(self.h2d_pageable_gbs),
            show(self.zerocopy_gbs),
            show(self.gpu_gemv_gbs)
        );
        if self.cpu_dot_gbs.is_empty() {
            s.push_str("cold cpu lane      unmeasured\n");
        } else {
            s.push_str(&format!("cold cpu lane job  {:.0} us fixed, bias {:.2}, layer chain {:.0} us\n", self.cpu_fixed_s * 1e6, self.bias(), self.chain_s * 1e6));
        }
        for (ty, g) in &self.cpu_dot_gbs {
            s.push_str(&format!(
                "cold cpu lane {ty:<8} {} ({} threads, {})\n",
                show(Some(*g)),
                self.cpu_threads,
                self.cpu_isa
            ));
        }
        s
    }
}

impl fmt::Display for CostModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.summary().trim_end())
    }
}

/// A cost model with only the CPU lane measured: a fresh `threads`-thread lane
/// timed for about `budget` in all over `types`.
pub fn measure_cpu_lane(types: &[GgmlType], threads: usize, budget: Duration) -> Result<CostModel, LaneError> {
    let lane = CpuLane::new(threads)?;
    let mut m = CostModel::default();
    m.measure_cpu(&lane, types, budget);
    Ok(m)
}

/// The lane on one token through synthetic `[ff, d_model]` experts of `ty`:
/// (GB/s of weight bytes beyond a job's first expert, seconds of fixed cost
/// a job pays). Jobs of one expert and of all of them are timed in turn,
/// cycling through more bytes than the last-level cache holds, so the
/// weights stream from DRAM as host-cache experts do.
fn bench_type(lane: &CpuLane, ty: GgmlType, d_model: usize, ff: usize, budget: Duration) -> Result<(f64, f64), LaneError> {
    let slab = |rows, cols, seed| {
        random_slab(ty, rows, cols, seed, 0.02).map_err(|source| LaneError::Kernel { pair: 0, expert: 0, slab: "synthetic", source })
    };
    let row = pulsar_kernels::quant::row_bytes(ty, d_model)
        .map_err(|source| LaneError::Kernel { pair: 0, expert: 0, slab: "synthetic", source })?;
    let expert_bytes = (row as u64 * 3 * ff as u64).max(1);
    let n = BENCH_WORKING_SET.div_ceil(expert_bytes).clamp(2, BENCH_MAX_EXPERTS as u64) as usize;
    let mut experts = Vec::with_capacity(n);
    for e in 0..n as u64 {
        experts.push((slab(ff, d_model, 3 * e)?, slab(ff, d_model, 3 * e + 1)?, slab(d_model, ff, 3 * e + 2)?));
    }
    let x = pulsar_kernels::quant::random_values(d_model, 42);
    let job = |range: std::ops::Range<usize>| LaneJob {
        d_model,
        ff,
        act: Activation::Silu,
        pairs: experts[range]
            .iter()
            .enumerate()
            .map(|(e, (g, u, d))| LanePair {
                expert: e as u32,
                x: &x,
                gate_up: GateUp::Split { gate: Slab { ty, bytes: g }, up: Slab { ty, bytes: u } },
                down: Slab { ty, bytes: d },
            })
            .collect(),
    };
    let all = job(0..n);
    let singles: Vec<LaneJob> = (0..n).map(|e| job(e..e + 1)).collect();
    lane.run(&all)?; // warm-up: page faults, thread wake-up
    // Seconds per job, alternating so both see the same machine state.
    let (mut t_all, mut t_one, mut runs) = (0.0f64, 0.0f64, 0usize);
    let start = Instant::now();
    while runs == 0 || start.elapsed() < budget {
        let t = Instant::now();
        std::hint::black_box(lane.run(&all)?);
        t_all += t.elapsed().as_secs_f64();
        let t = Instant::now();
        for j in &singles {
            std::hint::black_box(lane.run(j)?);
        }
        t_one += t.elapsed().as_secs_f64() / n as f64;
        runs += 1;
    }
    let (t_all, t_one) = (t_all / runs as f64, t_one / runs as f64);
    let b = expert_bytes as f64;
    // Two points of a line: time = fixed + bytes / rate.
    let marginal = t_all - t_one;
    if marginal > 0.0 {
        let rate = (n - 1) as f64 * b / marginal;
        Ok((rate / 1e9, (t_one - b / rate).max(0.0)))
    } else {
        Ok((n as f64 * b / t_all.max(1e-9) / 1e9, 0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linked() -> CostModel {
        let mut m = CostModel { h2d_pinned_gbs: Some(25.0), zerocopy_gbs: Some(20.0), gpu_gemv_gbs: Some(4000.0), ..Default::default() };
        m.cpu_dot_gbs.insert("q4_K".into(), 10.0);
        m
    }

    #[test]
    fn seconds_follow_the_rates() {
        let m = linked();
        let gb = 1_000_000_000;
        assert!((m.seconds(ColdPath::Upload, gb, GgmlType::Q4_K) - (1.0 / 25.0 + 1.0 / 4000.0)).abs() < 1e-12);
        assert!((m.seconds(ColdPath::ZeroCopy, gb, GgmlType::Q4_K) - 0.05).abs() < 1e-12);
        assert!((m.seconds(ColdPath::Cpu, gb, GgmlType::Q4_K) - 0.1).abs() < 1e-12);
        assert_eq!(m.seconds(ColdPath::Cpu, gb, GgmlType::Q8_0), f64::INFINITY);
        assert_eq!(m.seconds(ColdPath::Cpu, 0, GgmlType::Q8_0), 0.0);
        let mut p = CostModel { h2d_pageable_gbs: Some(10.0), zerocopy_gbs: Some(0.0), ..Default::default() };
        assert!((p.seconds(ColdPath::Upload, gb, GgmlType::Q4_K) - 0.1).abs() < 1e-12, "falls back to pageable");
        assert_eq!(p.seconds(ColdPath::ZeroCopy, gb, GgmlType::Q4_K), f64::INFINITY);
        p.h2d_pageable_gbs = Some(f64::NAN);
        assert_eq!(p.seconds(ColdPath::Upload, gb, GgmlType::Q4_K), f64::INFINITY);
    }

    #[test]
    fn summary_has_a_line_per_link_and_format() {
        let s = linked().summary();
        assert_eq!(s.lines().count(), 6, "{s}");
        assert!(s.contains("us fixed, bias 1.00, layer chain 0 us"), "{s}");
        assert!(s.contains("h2d pageable  unmeasured") && s.contains("q4_K") && s.contains("25.0 GB/s"), "{s}");
        assert_eq!(CostModel::default().to_string().lines().count(), 5);
        let j = serde_json::to_value(linked()).unwrap();
        assert_eq!(j["cpu_dot_gbs"]["q4_K"], 10.0);
    }

    #[test]
    fn measures_the_lane_it_is_given() {
        let lane = CpuLane::new(2).unwrap();
        let mut m = CostModel::default();
        let types = [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::IQ1_S];
        m.measure_cpu_shape(&lane, &types, Duration::from_millis(30), 512, 256);
        assert_eq!(m.cpu_threads, 2);
        for ty in [GgmlType::Q4_K, GgmlType::Q8_0] {
            let g = m.cpu_gbs(ty).unwrap_or_else(|| panic!("{ty} unmeasured"));
            assert!(g > 0.0 && g.is_finite(), "{ty}: {g}");
        }
        assert!(m.cpu_gbs(GgmlType::IQ1_S).is_none(), "no CPU dot for iq1_s");
        assert!(measure_cpu_lane(&[], 1, Duration::ZERO).unwrap().cpu_dot_gbs.is_empty());
    }

    /// `cargo test -p pulsar-host --lib cold -- --ignored --nocapture`: this machine's lane.
    #[test]
    #[ignore]
    fn print_this_machines_lane() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let types = [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q2_K, GgmlType::IQ2_XXS];
        println!("{}", measure_cpu_lane(&types, threads, Duration::from_secs(2)).unwrap());
    }

    #[test]
    fn observed_rates_pull_the_estimate() {
        let mut m = CostModel::default();
        m.cpu_dot_gbs.insert("q2_K".into(), 30.0);
        // 1 GB in 0.1 s, of which 0 s fixed: 10 GB/s.
        for _ in 0..40 {
            m.observe_cpu(GgmlType::Q2_K, 1_000_000_000, 0.1);
        }
        let g = m.cpu_gbs(GgmlType::Q2_K).unwrap();
        assert!((g - 10.0).abs() < 0.1, "{g}");
        m.observe_cpu(GgmlType::Q2_K, 1000, f64::NAN);
        m.observe_cpu(GgmlType::Q2_K, 1000, 0.0);
        m.observe_cpu(GgmlType::Q2_K, 0, 1.0);
        m.observe_cpu(GgmlType::Q2_K, 100_000, 1.0);
        assert_eq!(m.cpu_gbs(GgmlType::Q2_K), Some(g), "small jobs say nothing of the rate");
        // The fixed cost comes off: 0.5 GB in 0.15 s with 0.05 s fixed is 5 GB/s.
        m.cpu_fixed_s = 0.05;
        m.observe_cpu(GgmlType::Q4_K, 500_000_000, 0.15);
        assert!((m.cpu_gbs(GgmlType::Q4_K).unwrap() - 5.0).abs() < 1e-9);
        // ...but never more than three quarters of the time.
        m.observe_cpu(GgmlType::Q8_0, 1_000_000_000, 0.04);
        assert!((m.cpu_gbs(GgmlType::Q8_0).unwrap() - 100.0).abs() < 1e-6);
    }

    #[test]
    fn the_bias_follows_which_side_finished_first_within_bounds() {
        let mut m = linked();
        let gb = 1_000_000_000;
        let base = m.seconds(ColdPath::Cpu, gb, GgmlType::Q4_K);
        m.cpu_fixed_s = 0.001;
        m.balance(true);
        assert!(m.seconds(ColdPath::Cpu, gb, GgmlType::Q4_K) < base, "lane first: it looks cheaper");
        assert!(m.cpu_fixed() < 0.001);
        for _ in 0..200 {
            m.balance(false);
        }
        assert!((m.seconds(ColdPath::Cpu, gb, GgmlType::Q4_K) - 4.0 * base).abs() < 1e-9, "capped at 4x");
        for _ in 0..400 {
            m.balance(true);
        }
        assert!((m.seconds(ColdPath::Cpu, gb, GgmlType::Q4_K) - 0.25 * base).abs() < 1e-9, "floored at 1/4");
        // The link's estimates never move.
        assert!((m.seconds(ColdPath::Upload, gb, GgmlType::Q4_K) - (1.0 / 25.0 + 1.0 / 4000.0)).abs() < 1e-12);
        for _ in 0..400 {
            m.relax();
        }
        assert!((m.cpu_bias - 1.0).abs() < 1e-3, "relaxes to 1: {}", m.cpu_bias);
        m.cpu_bias = f64::NAN;
        assert_eq!(m.seconds(ColdPath::Cpu, gb, GgmlType::Q4_K), base);
    }

    #[test]
    fn observed_copies_take_over_the_upload_estimate() {
        let mut m = linked();
        let gb = 1_000_000_000;
        m.observe_link(100_000, 1e-6);
        assert_eq!(m.h2d_observed_gbs, None, "a small layer says nothing");
        m.observe_link(10_000_000, 0.001);
        assert!((m.upload_gbs().unwrap() - 10.0).abs() < 1e-9);
        assert!((m.seconds(ColdPath::Upload, gb, GgmlType::Q4_K) - (0.1 + 1.0 / 4000.0)).abs() < 1e-12);
        for _ in 0..100 {
            m.observe_link(20_000_000, 0.001);
        }
        assert!((m.upload_gbs().unwrap() - 20.0).abs() < 1e-3);
        assert!(m.summary().contains("(steps: 20.0 GB/s)"), "{}", m.summary());
    }

    #[test]
    fn the_chain_is_a_moving_average() {
        let mut m = CostModel::default();
        m.observe_chain(f64::NAN);
        m.observe_chain(-1.0);
        assert_eq!(m.chain_s, 0.0);
        m.observe_chain(200e-6);
        assert!((m.chain_s - 200e-6).abs() < 1e-12, "the first sample is taken whole");
        for _ in 0..100 {
            m.observe_chain(100e-6);
        }
        assert!((m.chain_s - 100e-6).abs() < 1e-7);
    }

    #[test]
    fn the_benchmark_separates_fixed_cost_from_rate() {
        let lane = CpuLane::new(1).unwrap();
        let (gbs, fixed) = bench_type(&lane, GgmlType::Q8_0, 512, 256, Duration::from_millis(40)).unwrap();
        assert!(gbs.is_finite() && gbs > 0.0, "{gbs}");
        assert!(fixed.is_finite() && (0.0..0.1).contains(&fixed), "{fixed}");
    }
}
