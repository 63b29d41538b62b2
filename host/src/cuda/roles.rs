//! Roles for several GPUs, chosen from measurements rather than labels (a
//! slot trained at x1 looks like any other until a copy is timed).
//!
//! - Expert streaming goes to the GPU with the fastest measured
//!   host-to-device link: it carries every cold expert.
//! - For MLA families (compressed KV, small activations between attention and
//!   the MoE) the attention stack and KV can sit on a second card, the one with
//!   the most free memory that holds them; only activations cross.
//! - Every other card becomes a resident expert tier (tier 1): its budget
//!   takes the hottest whole triples of the census
//!   ([`pulsar_store::place_resident`]).
//!
//! `--gpu` / `PULSAR_GPU`, `--attn-gpu` / `PULSAR_ATTN_GPU` and `--tiers off` /
//! `PULSAR_TIERS=off` override; `--print-config` shows the plan
//! and why. This module plans only: the engine runs on the streaming GPU (the
//! single-GPU path), and executing attention offload and tier GPUs is not
//! implemented yet.

use std::fmt;

/// What was measured of one GPU at start-up.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GpuProbe {
    pub ordinal: usize,
    pub name: String,
    /// Pinned host-to-device copy rate.
    pub h2d_gbps: f64,
    pub free_bytes: u64,
}

/// User overrides of the measured choice.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoleOverrides {
    pub stream_gpu: Option<usize>,
    pub attn_gpu: Option<usize>,
    /// Resident expert tiers on spare cards (on unless turned off).
    pub no_tiers: bool,
}

/// What the model asks of the cards.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelNeeds {
    /// A family whose attention can live apart from the experts (MLA).
    pub mla: bool,
    /// Attention and dense weights plus the KV cache.
    pub attention_bytes: u64,
}

/// Families with multi-head latent attention.
pub fn is_mla_family(arch: &str) -> bool {
    matches!(arch, "deepseek2" | "deepseek4" | "glm-dsa" | "glm_dsa" | "kimi" | "kimi_k2")
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RolePlan {
    pub gpus: Vec<GpuProbe>,
    /// Ordinal of the GPU that streams experts (and runs everything else
    /// unless `attention` differs).
    pub stream: usize,
    pub attention: usize,
    /// Spare GPUs holding resident expert triples, with their byte budgets.
    pub tiers: Vec<(usize, u64)>,
    /// One line per decision.
    pub why: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RoleError {
    #[error("{what} asks for GPU {ordinal}, but the GPUs are {have:?}")]
    NoSuchGpu { what: &'static str, ordinal: usize, have: Vec<usize> },
    #[error("no GPU to plan for")]
    NoGpu,
}

/// Assign roles. `reserve` is kept free on every card (activations, driver).
pub fn plan_roles(gpus: &[GpuProbe], needs: &ModelNeeds, ov: &RoleOverrides, reserve: u64) -> Result<RolePlan, RoleError> {
    if gpus.is_empty() {
        return Err(RoleError::NoGpu);
    }
    let have: Vec<usize> = gpus.iter().map(|g| g.ordinal).collect();
    let find = |what: &'static str, o: usize| gpus.iter().find(|g| g.ordinal == o).ok_or(RoleError::NoSuchGpu { what, ordinal: o, have: have.clone() });
    let mut why = Vec::new();
    let stream = match ov.stream_gpu {
        Some(o) => {
            find("--gpu / PULSAR_GPU", o)?;
            why.push(format!("experts stream on GPU {o}: chosen by --gpu / PULSAR_GPU"));
            o
        }
        None => {
            // Fastest link; ties to the lowest ordinal.
            let best = gpus.iter().fold(&gpus[0], |b, g| if g.h2d_gbps > b.h2d_gbps { g } else { b });
            if gpus.len() > 1 {
                let others: Vec<String> = gpus.iter().filter(|g| g.ordinal != best.ordinal).map(|g| format!("GPU {} {:.1}", g.ordinal, g.h2d_gbps)).collect();
                why.push(format!("experts stream on GPU {}: fastest host-to-device link, {:.1} GB/s (others: {})", best.ordinal, best.h2d_gbps, others.join(", ")));
            } else {
                why.push(format!("experts stream on GPU {}: the only GPU", best.ordinal));
            }
            best.ordinal
        }
    };
    let attention = match ov.attn_gpu {
        Some(o) => {
            find("--attn-gpu / PULSAR_ATTN_GPU", o)?;
            why.push(format!("attention and KV on GPU {o}: chosen by --attn-gpu / PULSAR_ATTN_GPU"));
            o
        }
        None if needs.mla && gpus.len() > 1 => {
            let fits = gpus
                .iter()
                .filter(|g| g.ordinal != stream && g.free_bytes >= needs.attention_bytes + reserve)
                .fold(None::<&GpuProbe>, |b, g| match b {
                    Some(b) if b.free_bytes >= g.free_bytes => Some(b),
                    _ => Some(g),
                });
            match fits {
                Some(g) => {
                    why.push(format!(
                        "attention and KV on GPU {}: an MLA family, and the spare card with the most free memory ({:.1} GiB for {:.1} GiB)",
                        g.ordinal,
                        g.free_bytes as f64 / GIB,
                        needs.attention_bytes as f64 / GIB
                    ));
                    g.ordinal
                }
                None => {
                    why.push(format!("attention stays on GPU {stream}: no spare card holds its {:.1} GiB", needs.attention_bytes as f64 / GIB));
                    stream
                }
            }
        }
        None => {
            if gpus.len() > 1 {
                why.push(format!("attention stays on GPU {stream}: not an MLA family (its activations between attention and experts are large)"));
            }
            stream
        }
    };
    let mut tiers = Vec::new();
    let spare: Vec<&GpuProbe> = gpus.iter().filter(|g| g.ordinal != stream && g.ordinal != attention).collect();
    if ov.no_tiers {
        if !spare.is_empty() {
            why.push("resident expert tiers off (--tiers off / PULSAR_TIERS=off)".to_string());
        }
    } else {
        for g in spare {
            let budget = g.free_bytes.saturating_sub(reserve);
            if budget > 0 {
                why.push(format!("GPU {}: resident tier for the hottest triples of the census, {:.1} GiB", g.ordinal, budget as f64 / GIB));
                tiers.push((g.ordinal, budget));
            }
        }
    }
    Ok(RolePlan { gpus: gpus.to_vec(), stream, attention, tiers, why })
}

const GIB: f64 = (1u64 << 30) as f64;

impl fmt::Display for RolePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for g in &self.gpus {
            writeln!(f, "gpu {}: {} — {:.1} GB/s host-to-device, {:.1} GiB free", g.ordinal, g.name, g.h2d_gbps, g.free_bytes as f64 / GIB)?;
        }
        for w in &self.why {
            writeln!(f, "  {w}")?;
        }
        if self.attention != self.stream || !self.tiers.is_empty() {
            writeln!(f, "  (planned only: this build runs everything on GPU {})", self.stream)?;
        }
        Ok(())
    }
}

/// Measure every visible GPU: free memory and a pinned copy's rate.
pub fn probe_all() -> Result<Vec<GpuProbe>, super::CudaBackendError> {
    let n = cudarc::driver::result::device::get_count().map_err(pulsar_cuda::CudaError::from)? as usize;
    let mut out = Vec::with_capacity(n);
    for ordinal in 0..n {
        let dev = pulsar_cuda::CudaDevice::open(ordinal)?;
        let (free, _) = dev.memory()?;
        out.push(GpuProbe { ordinal, name: dev.name().to_string(), h2d_gbps: super::measure_h2d(&dev)?, free_bytes: free as u64 });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(ordinal: usize, h2d: f64, free_gib: u64) -> GpuProbe {
        GpuProbe { ordinal, name: format!("H200 #{ordinal}"), h2d_gbps: h2d, free_bytes: free_gib << 30 }
    }

    const R: u64 = 2 << 30;

    #[test]
    fn one_gpu_does_everything() {
        let p = plan_roles(&[gpu(0, 55.0, 140)], &ModelNeeds { mla: true, attention_bytes: 10 << 30 }, &RoleOverrides::default(), R).unwrap();
        assert_eq!((p.stream, p.attention, p.tiers.len()), (0, 0, 0));
        assert!(!p.to_string().contains("planned only"));
    }

    #[test]
    fn the_fastest_link_streams_even_when_not_first() {
        // GPU 0 sits in a slot trained at x1: its label says nothing.
        let gpus = [gpu(0, 6.5, 140), gpu(1, 54.9, 140), gpu(2, 55.1, 140)];
        let p = plan_roles(&gpus, &ModelNeeds::default(), &RoleOverrides::default(), R).unwrap();
        assert_eq!(p.stream, 2);
        assert_eq!(p.attention, 2, "not MLA: attention stays with the experts");
        assert_eq!(p.tiers.iter().map(|t| t.0).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(p.tiers[0].1, (140 << 30) - R);
        assert!(p.why[0].contains("fastest host-to-device link"), "{:?}", p.why);
    }

    #[test]
    fn mla_attention_moves_to_the_roomiest_spare_card() {
        let gpus = [gpu(0, 55.0, 80), gpu(1, 50.0, 120), gpu(2, 50.0, 100)];
        let needs = ModelNeeds { mla: true, attention_bytes: 30 << 30 };
        let p = plan_roles(&gpus, &needs, &RoleOverrides::default(), R).unwrap();
        assert_eq!((p.stream, p.attention), (0, 1));
        assert_eq!(p.tiers, vec![(2, (100 << 30) - R)]);
        // Too big for every spare card: it stays.
        let p = plan_roles(&gpus, &ModelNeeds { mla: true, attention_bytes: 200 << 30 }, &RoleOverrides::default(), R).unwrap();
        assert_eq!(p.attention, 0);
    }

    #[test]
    fn overrides_win_and_bad_ones_are_errors() {
        let gpus = [gpu(0, 55.0, 80), gpu(1, 50.0, 120)];
        let ov = RoleOverrides { stream_gpu: Some(1), attn_gpu: Some(0), no_tiers: true };
        let p = plan_roles(&gpus, &ModelNeeds::default(), &ov, R).unwrap();
        assert_eq!((p.stream, p.attention), (1, 0));
        assert!(p.tiers.is_empty());
        let bad = RoleOverrides { stream_gpu: Some(5), ..RoleOverrides::default() };
        let e = plan_roles(&gpus, &ModelNeeds::default(), &bad, R).unwrap_err();
        assert!(e.to_string().contains("GPU 5"), "{e}");
        let ov = RoleOverrides { no_tiers: true, ..RoleOverrides::default() };
        let p = plan_roles(&[gpu(0, 55.0, 80), gpu(1, 50.0, 120), gpu(2, 1.0, 10)], &ModelNeeds::default(), &ov, R).unwrap();
        assert!(p.tiers.is_empty() && p.why.iter().any(|w| w.contains("tiers off")));
        assert_eq!(plan_roles(&[], &ModelNeeds::default(), &RoleOverrides::default(), R), Err(RoleError::NoGpu));
    }

    #[test]
    fn mla_families_are_known() {
        assert!(is_mla_family("deepseek2"));
        assert!(!is_mla_family("qwen3moe"));
    }
}
