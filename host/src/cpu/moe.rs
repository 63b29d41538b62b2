//! The `experts` op on the CPU: each selected expert's FFN on the tokens
//! routed to it, summed per token in selection order (so the result does not
//! depend on batching or on where the expert bytes came from).

use pulsar_kernels::{ops, ActFormat, Activations};
use pulsar_plugin_api::graph::Experts;
use pulsar_store::{Selection, SlabKind};

use rayon::prelude::*;

use super::{act_of, linear, linear_acts, CpuStep, Mat, Tensor, R};
use crate::graph::{moe::route, StepPlan};
use crate::model::{Model, Weight};

/// Expert bytes, borrowed for one layer's step.
pub type SlabBytes<'a> = &'a [u8];

/// Which slab of an expert a `*_exps` weight holds, from its GGUF name.
pub fn slab_kind(name: &str) -> Option<SlabKind> {
    let stem = name.strip_suffix(".weight").unwrap_or(name);
    if stem.ends_with("ffn_gate_up_exps") {
        Some(SlabKind::GateUp)
    } else if stem.ends_with("ffn_gate_exps") {
        Some(SlabKind::Gate)
    } else if stem.ends_with("ffn_up_exps") {
        Some(SlabKind::Up)
    } else if stem.ends_with("ffn_down_exps") {
        Some(SlabKind::Down)
    } else {
        None
    }
}

/// The slabs of one layer's step.
pub trait SlabLookup {
    fn slab(&self, w: &Weight, expert: u32) -> R<SlabBytes<'_>>;
}

/// Where the MoE op gets expert bytes: straight from the file mapping, or
/// through the expert store's tiers.
pub trait ExpertSource: Sync {
    /// Make the experts of `selections` available to `f`, then release them.
    /// `f` may be called several times, each with the experts (ascending) its
    /// lookup serves, when they do not all fit in memory at once; together
    /// the calls cover every selected expert exactly once.
    fn with_layer(&self, model: &Model, layer: u32, selections: &[Selection], f: &mut dyn FnMut(&dyn SlabLookup, &[u32]) -> R<()>) -> R<()>;
    /// A hint: these experts of `layer` will probably be needed soon.
    fn prefetch(&self, _layer: u32, _experts: &[u32]) {}
}

/// Every expert served from the memory-mapped file.
pub struct MappedExperts;

struct MappedLookup<'m>(&'m Model);

impl SlabLookup for MappedLookup<'_> {
    fn slab(&self, w: &Weight, expert: u32) -> R<SlabBytes<'_>> {
        let t = self.0.tensor(w);
        let range = self.0.file.expert_slab(t, expert as u64).map_err(|e| e.to_string())?;
        self.0.file.bytes(&range).map_err(|e| e.to_string())
    }
}

impl ExpertSource for MappedExperts {
    fn with_layer(&self, model: &Model, _layer: u32, sel: &[Selection], f: &mut dyn FnMut(&dyn SlabLookup, &[u32]) -> R<()>) -> R<()> {
        f(&MappedLookup(model), &experts_of(sel))
    }
}

/// The distinct experts of `sel`, ascending.
pub fn experts_of(sel: &[Selection]) -> Vec<u32> {
    let mut e: Vec<u32> = sel.iter().map(|s| s.expert).collect();
    e.sort_unstable();
    e.dedup();
    e
}

/// `experts(x, ids, weights)`: x `[T, E]`, ids and weights `[T, K]`.
pub(super) fn run_experts(step: &CpuStep<'_>, plan: &StepPlan, x: &Tensor, ids: &Tensor, weights: &Tensor, spec: &Experts) -> R<Mat> {
    let (rows, n_embd) = x.rows_cols();
    let xd = x.f()?;
    let (ids, wts) = (ids.ids()?, weights.f()?);
    let k = ids.len() / rows.max(1);
    let (gate_w, up_w, down_w) = (step.weight(spec.gate)?, step.weight(spec.up)?, step.weight(spec.down)?);
    let ne = gate_w.dims.get(2).copied().unwrap_or(0) as usize;
    let mut selections = Vec::with_capacity(rows * k);
    // Rows routed to each expert, as (row, slot).
    let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); ne];
    for r in 0..rows {
        for s in 0..k {
            let e = ids[r * k + s];
            let eu = usize::try_from(e).ok().filter(|&e| e < ne).ok_or_else(|| format!("expert id {e} is outside 0..{ne}"))?;
            selections.push(Selection { token: r as u32, slot: s as u32, expert: eu as u32 });
            by_expert[eu].push((r, s));
        }
    }
    // Cross-layer prefetch for decode: the next layer's router on this
    // layer's input predicts its experts well enough to start reading them.
    if rows == 1 {
        if let Some(next) = plan.moe_of_layer(spec.layer + 1) {
            let nw = step.weight(next.spec.router)?;
            let bias = next.spec.bias.map(|b| step.weight_f32(b)).transpose()?;
            if let Ok(nl) = step.matmul(nw, step.model.data(nw), xd, n_embd) {
                let (pred, _) = route(&nl.data, &next.spec, bias.as_deref());
                step.experts.prefetch(spec.layer + 1, &pred);
            }
        }
    }
    // Expert outputs per (row, slot), summed after in slot order.
    let mut outs = vec![0f32; rows * k * n_embd];
    let act = act_of(spec.act);
    let cpu = step.cpu;
    step.experts.with_layer(step.model, spec.layer, &selections, &mut |slabs: &dyn SlabLookup, experts: &[u32]| {
        // Every expert of the call in one job on the pool (each expert's
        // matmuls split their rows further), not three jobs per expert: a
        // decode step's experts are small, and waking the pool for each of
        // them cost more than their arithmetic. Each output is still its
        // rows' dots, so nothing depends on the scheduling.
        let jobs = experts
            .iter()
            .map(|&e| Ok((e, [slabs.slab(gate_w, e)?, slabs.slab(up_w, e)?, slabs.slab(down_w, e)?])))
            .collect::<R<Vec<_>>>()?;
        // Gate and up dot against the same quantized rows (when their types
        // pair with one activation format); a one-row step's experts all
        // share the layer's one row, quantized once for all of them.
        let fmt = ActFormat::for_weight(gate_w.ty).filter(|&f| ActFormat::for_weight(up_w.ty) == Some(f));
        let shared = match fmt {
            Some(f) if rows == 1 => Some(Activations::quantize(f, xd, n_embd).map_err(|e| format!("{}: {e}", gate_w.name))?),
            _ => None,
        };
        let ffn = |&(e, [g, u, d]): &(u32, [SlabBytes<'_>; 3])| -> R<Vec<f32>> {
            let routed = &by_expert[e as usize];
            let (mut h, up) = if let Some(a) = &shared {
                (linear_acts(cpu, gate_w, g, a)?, linear_acts(cpu, up_w, u, a)?)
            } else {
                let mut xe = Vec::with_capacity(routed.len() * n_embd);
                for &(r, _) in routed {
                    xe.extend_from_slice(&xd[r * n_embd..(r + 1) * n_embd]);
                }
                match fmt {
                    Some(f) => {
                        let a = Activations::quantize(f, &xe, n_embd).map_err(|e| format!("{}: {e}", gate_w.name))?;
                        (linear_acts(cpu, gate_w, g, &a)?, linear_acts(cpu, up_w, u, &a)?)
                    }
                    None => (linear(cpu, gate_w, g, &xe, n_embd)?, linear(cpu, up_w, u, &xe, n_embd)?),
                }
            };
            ops::glu_rows(&mut h.data, &up.data, act);
            let y = linear(cpu, down_w, d, &h.data, h.cols)?;
            if y.cols != n_embd {
                return Err(format!("moe layer {}: expert down projection gives width {}", spec.layer, y.cols));
            }
            Ok(y.data)
        };
        let ys: Vec<R<Vec<f32>>> = cpu.pool.install(|| jobs.par_iter().map(ffn).collect());
        for (&(e, _), y) in jobs.iter().zip(ys) {
            let y = y?;
            for (i, &(r, s)) in by_expert[e as usize].iter().enumerate() {
                outs[(r * k + s) * n_embd..(r * k + s + 1) * n_embd].copy_from_slice(&y[i * n_embd..(i + 1) * n_embd]);
            }
        }
        Ok(())
    })?;
    let mut out = vec![0f32; rows * n_embd];
    for r in 0..rows {
        let o = &mut out[r * n_embd..(r + 1) * n_embd];
        for s in 0..k {
            let ws = wts[r * k + s];
            let y = &outs[(r * k + s) * n_embd..(r * k + s + 1) * n_embd];
            o.iter_mut().zip(y).for_each(|(a, &b)| *a += ws * b);
        }
    }
    Ok(Mat { rows, cols: n_embd, data: out })
}
