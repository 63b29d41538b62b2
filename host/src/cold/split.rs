//! Which path serves each cold expert of one layer's step.
//!
//! The link (PCIe, shared by Upload and ZeroCopy) and the CPU lane run at the
//! same time, so the step ends when the slower of the two ends. `Auto` hands
//! out experts, largest first, to whichever side would finish it earliest;
//! that keeps both sides ending together without searching.

use std::fmt;
use std::str::FromStr;

use pulsar_gguf::GgmlType;
use serde::Serialize;

use super::cost::CostModel;

/// How one cold expert reaches the compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ColdPath {
    /// Copy the bytes host -> device, then compute from VRAM.
    Upload,
    /// The GPU kernel reads the pinned host bytes in place over PCIe.
    #[value(name = "zerocopy", alias = "zero-copy")]
    ZeroCopy,
    /// The CPU lane computes the expert from host memory.
    Cpu,
}

impl ColdPath {
    pub const ALL: [ColdPath; 3] = [ColdPath::Upload, ColdPath::ZeroCopy, ColdPath::Cpu];

    pub fn name(self) -> &'static str {
        match self {
            ColdPath::Upload => "upload",
            ColdPath::ZeroCopy => "zerocopy",
            ColdPath::Cpu => "cpu",
        }
    }
}

impl fmt::Display for ColdPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The `--cold-path` setting: measured split, or one path for every expert.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ColdPolicy {
    #[default]
    Auto,
    Force(ColdPath),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown cold path {0:?}: expected auto, upload, zerocopy or cpu")]
pub struct ParseColdPolicyError(pub String);

impl FromStr for ColdPolicy {
    type Err = ParseColdPolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("auto") {
            return Ok(ColdPolicy::Auto);
        }
        // "zero-copy" too: the spelling `crate::cuda::ColdPath` accepts.
        let t = if t.eq_ignore_ascii_case("zero-copy") { "zerocopy" } else { t };
        ColdPath::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(t))
            .map(ColdPolicy::Force)
            .ok_or_else(|| ParseColdPolicyError(s.to_string()))
    }
}

impl fmt::Display for ColdPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ColdPolicy::Auto => f.write_str("auto"),
            ColdPolicy::Force(p) => p.fmt(f),
        }
    }
}

/// One expert of a step that is not resident in VRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColdExpert {
    pub expert: u32,
    /// All its slabs together.
    pub bytes: u64,
    pub ty: GgmlType,
    /// False: a host-cache miss, read from disk first (so not zero-copy).
    pub in_host_memory: bool,
}

/// A path for each of `cold`, in the same order.
///
/// `Force(ZeroCopy)` still uploads disk misses: their bytes sit in a staging
/// buffer, not in the pinned cache the kernel could read in place. An expert
/// no measured path can serve is uploaded (the path that always works).
pub fn split(cold: &[ColdExpert], cost: &CostModel, policy: ColdPolicy) -> Vec<ColdPath> {
    split_busy(cold, cost, policy, Busy::default())
}

/// Seconds of work the link and the CPU lane already have in a step before
/// the experts being split (the lane's counts its fixed cost, if any).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Busy {
    pub link: f64,
    pub cpu: f64,
}

/// [`split`] when each side already has `busy` seconds of the step's work.
pub fn split_busy(cold: &[ColdExpert], cost: &CostModel, policy: ColdPolicy, busy: Busy) -> Vec<ColdPath> {
    match policy {
        ColdPolicy::Force(ColdPath::ZeroCopy) => cold
            .iter()
            .map(|e| if e.in_host_memory { ColdPath::ZeroCopy } else { ColdPath::Upload })
            .collect(),
        ColdPolicy::Force(p) => vec![p; cold.len()],
        ColdPolicy::Auto => auto(cold, cost, busy),
    }
}

/// Estimated seconds of the link and the CPU lane for `paths` (the lane's
/// fixed cost once, if it has anything).
pub fn lane_seconds(cold: &[ColdExpert], paths: &[ColdPath], cost: &CostModel) -> (f64, f64) {
    let (mut link, mut cpu) = (0.0, 0.0);
    for (e, &p) in cold.iter().zip(paths) {
        let s = cost.seconds(p, e.bytes, e.ty);
        match p {
            ColdPath::Cpu => cpu += s,
            _ => link += s,
        }
    }
    if paths.contains(&ColdPath::Cpu) {
        cpu += cost.cpu_fixed();
    }
    (link, cpu)
}

/// Head rows of each of `cold` (the next layer's predicted cold experts, all
/// of one shape: `ff` rows of gate and of up, `gate_up_row_bytes` the bytes of
/// one row of both) for the CPU lane to compute, so that it and the link
/// finish together: the lane takes `b` bytes of heads, the link the rest,
/// with `serial + fixed + b / cpu = (total - b) / link`. `serial` is the
/// layer's other work the lane's time adds to: the layer's chain
/// ([`CostModel::chain_s`]) when the host waits for the lane, nothing when the
/// lane runs beside the host (the bias then finds what the GPU's tail after
/// the lane costs). A multiple of `granule` rows (rounded down), at most
/// `ff`; 0 when the lane would not gain.
pub fn head_rows(cold: &[ColdExpert], gate_up_row_bytes: u64, ff: usize, granule: usize, serial_s: f64, cost: &CostModel) -> usize {
    let total: u64 = cold.iter().map(|e| e.bytes).sum();
    let Some(first) = cold.first() else { return 0 };
    if total == 0 || gate_up_row_bytes == 0 || cold.iter().any(|e| !e.in_host_memory) {
        return 0;
    }
    let per_byte = |p: ColdPath| cost.seconds(p, total, first.ty) / total as f64;
    let (link, cpu) = (per_byte(ColdPath::Upload), per_byte(ColdPath::Cpu));
    if !(link.is_finite() && cpu.is_finite()) {
        return 0;
    }
    let serial = if serial_s.is_finite() { serial_s.max(0.0) } else { 0.0 };
    let b = (total as f64 * link - cost.cpu_fixed() - serial) / (cpu + link);
    let rows = b / (cold.len() as f64 * gate_up_row_bytes as f64);
    if !(rows.is_finite() && rows > 0.0) {
        return 0;
    }
    let g = granule.max(1);
    ((rows as usize).min(ff) / g * g).min(ff)
}

/// The cheaper link path for `e` and its seconds (infinite: no link path).
fn best_link(e: &ColdExpert, cost: &CostModel) -> (ColdPath, f64) {
    let up = cost.seconds(ColdPath::Upload, e.bytes, e.ty);
    if !e.in_host_memory {
        return (ColdPath::Upload, up);
    }
    let zc = cost.seconds(ColdPath::ZeroCopy, e.bytes, e.ty);
    // Ties go to Upload: the copy leaves VRAM warm for a repeat in the step.
    if zc < up {
        (ColdPath::ZeroCopy, zc)
    } else {
        (ColdPath::Upload, up)
    }
}

/// Greedy longest-processing-time over two machines, the link and the CPU,
/// starting from `busy`; the lane's first expert also pays its fixed cost.
fn auto(cold: &[ColdExpert], cost: &CostModel, busy: Busy) -> Vec<ColdPath> {
    struct Cand {
        idx: usize,
        link: (ColdPath, f64),
        cpu: f64,
    }
    let mut cands: Vec<Cand> = cold
        .iter()
        .enumerate()
        .map(|(idx, e)| {
            let cpu = cost.seconds(ColdPath::Cpu, e.bytes, e.ty);
            Cand { idx, link: best_link(e, cost), cpu: if cpu > 0.0 { cpu } else { f64::INFINITY } }
        })
        .collect();
    // Longest first by its best time; equal times by expert id, then position,
    // so the order (and the answer) never depends on the input order of ties.
    let key = |c: &Cand| c.link.1.min(c.cpu);
    cands.sort_by(|a, b| {
        key(b)
            .total_cmp(&key(a))
            .then(cold[a.idx].expert.cmp(&cold[b.idx].expert))
            .then(a.idx.cmp(&b.idx))
    });
    let mut out = vec![ColdPath::Upload; cold.len()];
    let (mut link_t, mut cpu_t) = (busy.link.max(0.0), busy.cpu.max(0.0));
    let mut fixed = if cpu_t > 0.0 { 0.0 } else { cost.cpu_fixed() };
    for c in &cands {
        let (lp, ls) = c.link;
        let (on_link, on_cpu) = (link_t + ls, cpu_t + c.cpu + fixed);
        if !on_link.is_finite() && !on_cpu.is_finite() {
            out[c.idx] = ColdPath::Upload;
        } else if on_cpu < on_link {
            out[c.idx] = ColdPath::Cpu;
            cpu_t = on_cpu;
            fixed = 0.0;
        } else {
            out[c.idx] = lp;
            link_t = on_link;
        }
    }
    tracing::trace!(experts = cold.len(), link_s = link_t, cpu_s = cpu_t, "cold split");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn model(link_gbs: f64, zc_gbs: Option<f64>, cpu_gbs: f64) -> CostModel {
        let mut cpu = BTreeMap::new();
        cpu.insert(GgmlType::Q4_K.name().to_string(), cpu_gbs);
        CostModel {
            h2d_pinned_gbs: Some(link_gbs),
            h2d_pageable_gbs: None,
            zerocopy_gbs: zc_gbs,
            gpu_gemv_gbs: None,
            cpu_threads: 8,
            cpu_isa: "test".into(),
            cpu_dot_gbs: cpu,
            ..Default::default()
        }
    }

    fn experts(n: u32, in_host: impl Fn(u32) -> bool) -> Vec<ColdExpert> {
        (0..n)
            .map(|i| ColdExpert {
                expert: i,
                // Uneven sizes so the greedy has something to balance.
                bytes: 1_000_000 + (i as u64 * 7919 % 13) * 50_000,
                ty: GgmlType::Q4_K,
                in_host_memory: in_host(i),
            })
            .collect()
    }

    fn cpu_share(cold: &[ColdExpert], paths: &[ColdPath]) -> f64 {
        let total: u64 = cold.iter().map(|e| e.bytes).sum();
        let cpu: u64 = cold.iter().zip(paths).filter(|(_, p)| **p == ColdPath::Cpu).map(|(e, _)| e.bytes).sum();
        cpu as f64 / total as f64
    }

    #[test]
    fn policy_parses_and_prints() {
        assert_eq!("auto".parse::<ColdPolicy>().unwrap(), ColdPolicy::Auto);
        assert_eq!("Upload".parse::<ColdPolicy>().unwrap(), ColdPolicy::Force(ColdPath::Upload));
        assert_eq!(" zerocopy ".parse::<ColdPolicy>().unwrap(), ColdPolicy::Force(ColdPath::ZeroCopy));
        assert_eq!("zero-copy".parse::<ColdPolicy>().unwrap(), ColdPolicy::Force(ColdPath::ZeroCopy));
        assert_eq!("cpu".parse::<ColdPolicy>().unwrap(), ColdPolicy::Force(ColdPath::Cpu));
        let err = "gpu".parse::<ColdPolicy>().unwrap_err().to_string();
        assert!(err.contains("\"gpu\"") && err.contains("auto, upload, zerocopy or cpu"), "{err}");
        for p in ["auto", "upload", "zerocopy", "cpu"] {
            assert_eq!(p.parse::<ColdPolicy>().unwrap().to_string(), p);
        }
        use clap::ValueEnum;
        assert_eq!(ColdPath::from_str("zerocopy", false).unwrap(), ColdPath::ZeroCopy);
        assert_eq!(ColdPath::from_str("zero-copy", false).unwrap(), ColdPath::ZeroCopy);
    }

    #[test]
    fn forced_policies() {
        let cold = experts(6, |i| i != 2);
        let cost = model(25.0, Some(20.0), 10.0);
        assert_eq!(split(&cold, &cost, ColdPolicy::Force(ColdPath::Upload)), vec![ColdPath::Upload; 6]);
        assert_eq!(split(&cold, &cost, ColdPolicy::Force(ColdPath::Cpu)), vec![ColdPath::Cpu; 6]);
        let zc = split(&cold, &cost, ColdPolicy::Force(ColdPath::ZeroCopy));
        for (i, p) in zc.iter().enumerate() {
            assert_eq!(*p, if i == 2 { ColdPath::Upload } else { ColdPath::ZeroCopy });
        }
    }

    #[test]
    fn cpu_three_times_slower_takes_a_quarter() {
        let cold = experts(64, |_| true);
        let cost = model(30.0, None, 10.0);
        let paths = split(&cold, &cost, ColdPolicy::Auto);
        assert!(!paths.contains(&ColdPath::ZeroCopy), "zero-copy is unmeasured");
        let share = cpu_share(&cold, &paths);
        assert!((share - 0.25).abs() < 0.03, "cpu share {share}");
        let (link, cpu) = lane_seconds(&cold, &paths, &cost);
        assert!((link - cpu).abs() / link < 0.1, "link {link}s cpu {cpu}s");
    }

    #[test]
    fn faster_link_path_wins_and_disk_misses_never_zero_copy() {
        let cold = experts(40, |i| i % 3 != 0);
        let cost = model(20.0, Some(25.0), 5.0);
        let paths = split(&cold, &cost, ColdPolicy::Auto);
        for (e, p) in cold.iter().zip(&paths) {
            if !e.in_host_memory {
                assert_ne!(*p, ColdPath::ZeroCopy, "expert {}", e.expert);
            }
        }
        assert!(paths.contains(&ColdPath::ZeroCopy));
        assert!(paths.contains(&ColdPath::Cpu));
    }

    #[test]
    fn no_cpu_throughput_means_no_cpu() {
        let cold = experts(16, |_| true);
        for cpu_gbs in [0.0, -1.0] {
            let paths = split(&cold, &model(25.0, Some(20.0), cpu_gbs), ColdPolicy::Auto);
            assert!(!paths.contains(&ColdPath::Cpu), "{paths:?}");
        }
        // A format the CPU lane was not measured on is not sent to it either.
        let mut other = cold.clone();
        other.iter_mut().for_each(|e| e.ty = GgmlType::Q8_0);
        assert!(!split(&other, &model(25.0, None, 100.0), ColdPolicy::Auto).contains(&ColdPath::Cpu));
    }

    #[test]
    fn nothing_measured_falls_back_to_upload() {
        let mut cost = model(25.0, None, 0.0);
        cost.h2d_pinned_gbs = None;
        assert_eq!(split(&experts(3, |_| true), &cost, ColdPolicy::Auto), vec![ColdPath::Upload; 3]);
    }

    #[test]
    fn deterministic_whatever_the_input_order() {
        let mut cold = experts(24, |i| i % 5 != 1);
        // Equal sizes make ties everywhere.
        cold.iter_mut().skip(12).for_each(|e| e.bytes = 1_000_000);
        let cost = model(24.0, Some(24.0), 8.0);
        let a = split(&cold, &cost, ColdPolicy::Auto);
        assert_eq!(a, split(&cold, &cost, ColdPolicy::Auto));
        let mut rev = cold.clone();
        rev.reverse();
        let mut b = split(&rev, &cost, ColdPolicy::Auto);
        b.reverse();
        assert_eq!(a, b);
    }

    #[test]
    fn fixed_cost_and_busy_sides_shift_the_split() {
        let cold = experts(8, |_| true);
        // Lane and link equally fast: without a fixed cost the lane takes half.
        let mut cost = model(20.0, None, 20.0);
        let even = cpu_share(&cold, &split(&cold, &cost, ColdPolicy::Auto));
        assert!((even - 0.5).abs() < 0.15, "{even}");
        // A fixed cost of one expert's lane time: the lane takes less.
        cost.cpu_fixed_s = 1_000_000.0 / 20e9;
        let paths = split(&cold, &cost, ColdPolicy::Auto);
        let fixed = cpu_share(&cold, &paths);
        assert!(fixed < even && fixed > 0.0, "{fixed} vs {even}");
        let (link, cpu) = lane_seconds(&cold, &paths, &cost);
        assert!((link - cpu).abs() <= 1.2e6 / 20e9, "link {link}s cpu {cpu}s");
        // A lane already busy for the whole link time takes nothing more...
        let all_link: f64 = cold.iter().map(|e| cost.seconds(ColdPath::Upload, e.bytes, e.ty)).sum();
        let busy = Busy { link: 0.0, cpu: all_link };
        assert!(!split_busy(&cold, &cost, ColdPolicy::Auto, busy).contains(&ColdPath::Cpu));
        // ...and a busy link pushes work to the lane.
        let busy = Busy { link: all_link, cpu: 0.0 };
        assert!(cpu_share(&cold, &split_busy(&cold, &cost, ColdPolicy::Auto, busy)) > 0.9);
        // Forced paths ignore both.
        assert_eq!(split_busy(&cold, &cost, ColdPolicy::Force(ColdPath::Upload), busy), vec![ColdPath::Upload; 8]);
    }

    #[test]
    fn head_rows_balance_the_link_and_the_lane() {
        // Three experts of 1 MB: 2/3 of each is gate + up, 1024 rows.
        let cold: Vec<ColdExpert> = (0..3).map(|i| ColdExpert { expert: i, bytes: 1_000_000, ty: GgmlType::Q4_K, in_host_memory: true }).collect();
        let row = 2 * 1_000_000 / 3 / 1024;
        // Equal rates, no fixed cost: half the bytes each, capped by the heads' 2/3.
        let cost = model(20.0, None, 20.0);
        let r = head_rows(&cold, row, 1024, 1, 0.0, &cost);
        let b = (3 * r as u64 * row) as f64;
        assert!((b / 3e6 - 0.5).abs() < 0.01, "lane share {}", b / 3e6);
        // A lane three times slower takes a quarter; a multiple of the granule.
        let cost = model(30.0, None, 10.0);
        let r = head_rows(&cold, row, 1024, 32, 0.0, &cost);
        assert_eq!(r % 32, 0);
        let share = (3 * r as u64 * row) as f64 / 3e6;
        assert!((share - 0.25).abs() < 0.02, "{share}");
        // A fixed cost takes some away; one as long as the link time, all.
        let mut fixed = cost.clone();
        fixed.cpu_fixed_s = 0.01e-3;
        assert!(head_rows(&cold, row, 1024, 32, 0.0, &fixed) < r);
        fixed.cpu_fixed_s = 3e6 / 30e9;
        assert_eq!(head_rows(&cold, row, 1024, 32, 0.0, &fixed), 0);
        // So does the layer's serial work.
        assert!(head_rows(&cold, row, 1024, 32, 0.01e-3, &cost) < r);
        assert_eq!(head_rows(&cold, row, 1024, 32, 3e6 / 30e9, &cost), 0);
        // A lane far faster than the link is capped at every row.
        assert_eq!(head_rows(&cold, row, 1024, 32, 0.0, &model(1.0, None, 1000.0)), 1024);
        // Nothing measured, nothing cold, or a disk miss among them: none.
        assert_eq!(head_rows(&cold, row, 1024, 32, 0.0, &model(30.0, None, 0.0)), 0);
        assert_eq!(head_rows(&[], row, 1024, 32, 0.0, &cost), 0);
        let mut miss = cold.clone();
        miss[1].in_host_memory = false;
        assert_eq!(head_rows(&miss, row, 1024, 32, 0.0, &cost), 0);
    }

    #[test]
    fn empty_list() {
        let cost = model(25.0, Some(20.0), 10.0);
        for p in [ColdPolicy::Auto, ColdPolicy::Force(ColdPath::Cpu), ColdPolicy::Force(ColdPath::ZeroCopy)] {
            assert!(split(&[], &cost, p).is_empty());
        }
        assert_eq!(lane_seconds(&[], &[], &cost), (0.0, 0.0));
    }
}
