//! The routed-expert block on the CPU: router, top-k, and each selected
//! expert's FFN on the tokens routed to it, summed per token in selection
//! order (so the result does not depend on batching or on where the expert
//! bytes came from).

use pulsar_kernels::ops;
use pulsar_plugin_api::{Gating, MoeSpec, Role, Val};
use pulsar_store::{Selection, SlabKind};

use super::{act_of, CpuStep, Mat, R};
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

/// Routing of one row: selected experts and their weights, in selection order.
pub fn route(logits: &[f32], spec: &MoeSpec) -> (Vec<u32>, Vec<f32>) {
    let k = spec.top_k as usize;
    let mut p = logits.to_vec();
    match spec.gating {
        Gating::Softmax => ops::softmax_in_place(&mut p),
        Gating::Sigmoid => p.iter_mut().for_each(|v| *v = ops::math::sigmoid(*v)),
    }
    let sel = ops::top_k(&p, k);
    let mut w: Vec<f32> = sel.iter().map(|&e| p[e]).collect();
    if spec.norm_topk {
        let s: f32 = w.iter().sum();
        if s > 0.0 {
            w.iter_mut().for_each(|v| *v /= s);
        }
    }
    w.iter_mut().for_each(|v| *v *= spec.weights_scale);
    (sel.into_iter().map(|e| e as u32).collect(), w)
}

/// The next layer's router weight, if the plan declares one.
fn next_router<'m>(model: &'m Model, layer: u32) -> Option<&'m Weight> {
    model.weights.iter().find(|w| w.role == Role::Router && w.layer == Some(layer + 1))
}

pub(super) fn run(step: &mut CpuStep<'_>, x: Val, spec: &MoeSpec) -> R<Mat> {
    let xm = step.get(x)?.clone();
    let router = step.weight(spec.router)?;
    let logits = step.matmul(router, step.model.data(router), &xm)?;
    let ne = spec.n_expert as usize;
    if logits.cols != ne {
        return Err(format!("moe layer {}: router gives {} scores for {ne} experts", spec.layer, logits.cols));
    }
    let k = spec.top_k as usize;
    let mut sel = Vec::with_capacity(xm.rows);
    let mut selections = Vec::with_capacity(xm.rows * k);
    for r in 0..xm.rows {
        let (experts, w) = route(&logits.data[r * ne..(r + 1) * ne], spec);
        for (s, &e) in experts.iter().enumerate() {
            selections.push(Selection { token: r as u32, slot: s as u32, expert: e });
        }
        sel.push((experts, w));
    }
    // Cross-layer prefetch for decode: the next layer's router on this
    // layer's input predicts its experts well enough to start reading them.
    if xm.rows == 1 {
        if let Some(next) = next_router(step.model, spec.layer) {
            if let Ok(nl) = step.matmul(next, step.model.data(next), &xm) {
                let (pred, _) = route(&nl.data, spec);
                step.experts.prefetch(spec.layer + 1, &pred);
            }
        }
    }
    // Rows routed to each expert, as (row, slot).
    let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); ne];
    for (r, (experts, _)) in sel.iter().enumerate() {
        for (s, &e) in experts.iter().enumerate() {
            by_expert[e as usize].push((r, s));
        }
    }
    let (gate_w, up_w, down_w) = (step.weight(spec.gate_exps)?, step.weight(spec.up_exps)?, step.weight(spec.down_exps)?);
    let n_embd = xm.cols;
    // Expert outputs per (row, slot), summed after in slot order.
    let mut outs = vec![0f32; xm.rows * k * n_embd];
    let act = act_of(spec.act);
    let this: &CpuStep<'_> = step;
    this.experts.with_layer(this.model, spec.layer, &selections, &mut |slabs: &dyn SlabLookup, experts: &[u32]| {
        for &e in experts {
            let rows = &by_expert[e as usize];
            let mut xe = Mat { rows: rows.len(), cols: n_embd, data: Vec::with_capacity(rows.len() * n_embd) };
            for &(r, _) in rows {
                xe.data.extend_from_slice(&xm.data[r * n_embd..(r + 1) * n_embd]);
            }
            let mut h = this.matmul(gate_w, slabs.slab(gate_w, e)?, &xe)?;
            let up = this.matmul(up_w, slabs.slab(up_w, e)?, &xe)?;
            ops::glu_rows(&mut h.data, &up.data, act);
            let y = this.matmul(down_w, slabs.slab(down_w, e)?, &h)?;
            if y.cols != n_embd {
                return Err(format!("moe layer {}: expert down projection gives width {}", spec.layer, y.cols));
            }
            for (i, &(r, s)) in rows.iter().enumerate() {
                outs[(r * k + s) * n_embd..(r * k + s + 1) * n_embd].copy_from_slice(&y.data[i * n_embd..(i + 1) * n_embd]);
            }
        }
        Ok(())
    })?;
    let mut out = vec![0f32; xm.rows * n_embd];
    for (r, (_, w)) in sel.iter().enumerate() {
        let o = &mut out[r * n_embd..(r + 1) * n_embd];
        for (s, &ws) in w.iter().enumerate() {
            let y = &outs[(r * k + s) * n_embd..(r * k + s + 1) * n_embd];
            o.iter_mut().zip(y).for_each(|(a, &b)| *a += ws * b);
        }
    }
    Ok(Mat { rows: xm.rows, cols: n_embd, data: out })
}
