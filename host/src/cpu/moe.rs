//! The routed-expert block on the CPU: router, top-k, and each selected
//! expert's FFN on the tokens routed to it, summed per token in selection
//! order (so the result does not depend on batching).

use std::sync::Arc;

use pulsar_kernels::ops;
use pulsar_plugin_api::{Gating, MoeSpec, Val};

use super::{act_of, CpuStep, Mat, R};
use crate::model::{Model, Weight};

/// Bytes of one expert slab: borrowed from a mapping, or shared from a cache.
pub enum SlabBytes<'a> {
    Borrowed(&'a [u8]),
    Shared(Arc<dyn AsRef<[u8]> + Send + Sync>),
}

impl SlabBytes<'_> {
    pub fn bytes(&self) -> &[u8] {
        match self {
            SlabBytes::Borrowed(b) => b,
            SlabBytes::Shared(a) => (**a).as_ref(),
        }
    }
}

/// Where the MoE op gets expert bytes: straight from the file mapping, or
/// through the expert store's tiers.
pub trait ExpertSource: Sync {
    /// One expert's slice of a `*_exps` weight.
    fn slab<'a>(&'a self, model: &'a Model, w: &Weight, expert: u32) -> R<SlabBytes<'a>>;
    /// Called once per MoE layer and step with the experts about to be used,
    /// before any `slab` call for them (lets a store load them together).
    fn prepare(&self, _model: &Model, _layer: u32, _experts: &[u32]) -> R<()> {
        Ok(())
    }
}

/// Every expert served from the memory-mapped file.
pub struct MappedExperts;

impl ExpertSource for MappedExperts {
    fn slab<'a>(&'a self, model: &'a Model, w: &Weight, expert: u32) -> R<SlabBytes<'a>> {
        let t = model.tensor(w);
        let range = model.file.expert_slab(t, expert as u64).map_err(|e| e.to_string())?;
        Ok(SlabBytes::Borrowed(model.file.bytes(&range).map_err(|e| e.to_string())?))
    }
}

/// Routing of one row: selected experts and their weights, in selection order.
pub fn route(logits: &[f32], spec: &MoeSpec) -> (Vec<u32>, Vec<f32>) {
    let k = spec.top_k as usize;
    let mut p = logits.to_vec();
    match spec.gating {
        Gating::Softmax => ops::softmax_in_place(&mut p),
        Gating::Sigmoid => p.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
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
    for r in 0..xm.rows {
        sel.push(route(&logits.data[r * ne..(r + 1) * ne], spec));
    }
    // Rows routed to each expert, as (row, slot).
    let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); ne];
    for (r, (experts, _)) in sel.iter().enumerate() {
        for (s, &e) in experts.iter().enumerate() {
            by_expert[e as usize].push((r, s));
        }
    }
    let used: Vec<u32> = (0..ne as u32).filter(|&e| !by_expert[e as usize].is_empty()).collect();
    step.experts.prepare(step.model, spec.layer, &used)?;
    let (gate_w, up_w, down_w) = (step.weight(spec.gate_exps)?, step.weight(spec.up_exps)?, step.weight(spec.down_exps)?);
    let n_embd = xm.cols;
    // Expert outputs per (row, slot), summed after in slot order.
    let mut outs = vec![0f32; xm.rows * k * n_embd];
    let act = act_of(spec.act);
    for &e in &used {
        let rows = &by_expert[e as usize];
        let mut xe = Mat { rows: rows.len(), cols: n_embd, data: Vec::with_capacity(rows.len() * n_embd) };
        for &(r, _) in rows {
            xe.data.extend_from_slice(&xm.data[r * n_embd..(r + 1) * n_embd]);
        }
        let (g, u, d) = (
            step.experts.slab(step.model, gate_w, e)?,
            step.experts.slab(step.model, up_w, e)?,
            step.experts.slab(step.model, down_w, e)?,
        );
        let mut h = step.matmul(gate_w, g.bytes(), &xe)?;
        let up = step.matmul(up_w, u.bytes(), &xe)?;
        ops::glu_rows(&mut h.data, &up.data, act);
        let y = step.matmul(down_w, d.bytes(), &h)?;
        if y.cols != n_embd {
            return Err(format!("moe layer {}: expert down projection gives width {}", spec.layer, y.cols));
        }
        for (i, &(r, s)) in rows.iter().enumerate() {
            outs[(r * k + s) * n_embd..(r * k + s + 1) * n_embd].copy_from_slice(&y.data[i * n_embd..(i + 1) * n_embd]);
        }
    }
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
