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
#[derive(Clone, Debug, Default, Serialize)]
pub struct CostModel {
    /// Host -> device copies from pinned memory (the host cache).
    pub h2d_pinned_gbs: Option<f64>,
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
    /// CPU lane throughput per weight format (GGUF type name).
    pub cpu_dot_gbs: BTreeMap<String, f64>,
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
        rate(self.h2d_pinned_gbs).or(rate(self.h2d_pageable_gbs))
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
            ColdPath::Cpu => over(self.cpu_gbs(ty)),
        }
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
        for &ty in types {
            match bench_type(lane, ty, d_model, ff, each) {
                Ok(gbs) => {
                    tracing::debug!(ty = ty.name(), gbs, threads = lane.threads(), "cpu lane measured");
                    self.cpu_dot_gbs.insert(ty.name().to_string(), gbs);
                }
                Err(e) => {
                    tracing::warn!("cpu lane: not measuring {ty}: {e}");
                    self.cpu_dot_gbs.remove(ty.name());
                }
            }
        }
    }

    /// Fold one observed CPU-lane rate (GB/s of weight bytes, from a real
    /// step) into the estimate for `ty`: an exponential moving average that
    /// follows within a few steps, starting from the microbenchmark.
    pub fn observe_cpu(&mut self, ty: GgmlType, gbs: f64) {
        if !(gbs.is_finite() && gbs > 0.0) {
            return;
        }
        let e = self.cpu_dot_gbs.entry(ty.name().to_string()).or_insert(gbs);
        *e = 0.8 * *e + 0.2 * gbs;
    }

    /// One line per link and per CPU format, for `--print-config`.
    pub fn summary(&self) -> String {
        let show = |g: Option<f64>| rate(g).map_or("unmeasured".to_string(), |g| format!("{g:.1} GB/s"));
        let mut s = format!(
            "cold h2d pinned    {}\ncold h2d pageable  {}\ncold zero-copy     {}\ncold gpu gemv      {}\n",
            show(self.h2d_pinned_gbs),
            show(self.h2d_pageable_gbs),
            show(self.zerocopy_gbs),
            show(self.gpu_gemv_gbs)
        );
        if self.cpu_dot_gbs.is_empty() {
            s.push_str("cold cpu lane      unmeasured\n");
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

/// GB/s of weight bytes the lane sustains on one token through several
/// synthetic `[ff, d_model]` experts of `ty` (one decode step's cold share).
fn bench_type(lane: &CpuLane, ty: GgmlType, d_model: usize, ff: usize, budget: Duration) -> Result<f64, LaneError> {
    let slab = |rows, cols, seed| {
        random_slab(ty, rows, cols, seed, 0.02).map_err(|source| LaneError::Kernel { pair: 0, expert: 0, slab: "synthetic", source })
    };
    let row = pulsar_kernels::quant::row_bytes(ty, d_model)
        .map_err(|source| LaneError::Kernel { pair: 0, expert: 0, slab: "synthetic", source })?;
    let expert_bytes = (row as u64 * 3 * ff as u64).max(1);
    let n = BENCH_WORKING_SET.div_ceil(expert_bytes).clamp(1, BENCH_MAX_EXPERTS as u64) as usize;
    let mut experts = Vec::with_capacity(n);
    for e in 0..n as u64 {
        experts.push((slab(ff, d_model, 3 * e)?, slab(ff, d_model, 3 * e + 1)?, slab(d_model, ff, 3 * e + 2)?));
    }
    let x = pulsar_kernels::quant::random_values(d_model, 42);
    let pairs = experts
        .iter()
        .enumerate()
        .map(|(e, (g, u, d))| LanePair {
            expert: e as u32,
            x: &x,
            gate_up: GateUp::Split { gate: Slab { ty, bytes: g }, up: Slab { ty, bytes: u } },
            down: Slab { ty, bytes: d },
        })
        .collect();
    let job = LaneJob { d_model, ff, act: Activation::Silu, pairs };
    let bytes = job.weight_bytes() as f64;
    lane.run(&job)?; // warm-up: page faults, thread wake-up
    let (start, mut runs) = (Instant::now(), 0u32);
    while runs == 0 || start.elapsed() < budget {
        std::hint::black_box(lane.run(&job)?);
        runs += 1;
    }
    Ok(bytes * runs as f64 / start.elapsed().as_secs_f64().max(1e-9) / 1e9)
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
        assert_eq!(s.lines().count(), 5, "{s}");
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
        for _ in 0..40 {
            m.observe_cpu(GgmlType::Q2_K, 10.0);
        }
        let g = m.cpu_gbs(GgmlType::Q2_K).unwrap();
        assert!((g - 10.0).abs() < 0.1, "{g}");
        m.observe_cpu(GgmlType::Q2_K, f64::NAN);
        m.observe_cpu(GgmlType::Q2_K, 0.0);
        assert_eq!(m.cpu_gbs(GgmlType::Q2_K), Some(g));
        m.observe_cpu(GgmlType::Q4_K, 5.0);
        assert_eq!(m.cpu_gbs(GgmlType::Q4_K), Some(5.0));
    }
}
