//! The Ops harness's CUDA side: one drawn case ([`crate::opcheck::Case`])
//! through the same primitives the CUDA step runs ([`super::prim`]).

use pulsar_cuda::{CudaDevice, DeviceBuf};
use pulsar_plugin_api::graph::{Op, Rope};
use pulsar_plugin_api::Wt;

use super::prim::{self, DIn, DevCx};
use crate::opcheck::{self, words, Case, Row};

type R<T> = Result<T, String>;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn upload_words(dev: &CudaDevice, w: &[u32]) -> R<DeviceBuf<f32>> {
    let f: Vec<f32> = w.iter().map(|&b| f32::from_bits(b)).collect();
    // An empty buffer cannot be allocated: a one-word placeholder.
    dev.upload(if f.is_empty() { &[0f32][..] } else { &f }).map_err(err)
}

/// Run case `c` on the device; the output's words. `sabotage` runs the
/// deliberately wrong reduction (the negative control).
pub fn run_case(dev: &CudaDevice, c: &Case, sabotage: bool) -> R<Vec<u32>> {
    let stream = dev.compute().clone();
    let ins: Vec<DeviceBuf<f32>> = c.ins.iter().map(|t| upload_words(dev, &words(t))).collect::<R<_>>()?;
    let pos = dev.upload(if c.positions.is_empty() { &[0u32][..] } else { &c.positions }).map_err(err)?;
    let toks = dev.upload(&[0u32]).map_err(err)?;
    let n_out: usize = c.out.iter().product();
    let mut y = match c.op {
        Op::Scan { .. } => {
            let mut state = dev.upload(&c.state).map_err(err)?;
            let mut y = dev.alloc::<f32>(n_out).map_err(err)?;
            dev.prim_scan(&stream, &ins[0], &ins[1], &mut state, &mut y, &pos, c.positions.len()).map_err(err)?;
            y
        }
        Op::ShortConv { .. } => {
            let (w, mut win) = (dev.upload(&c.weights[0]).map_err(err)?, dev.upload(&c.state).map_err(err)?);
            let mut y = dev.alloc::<f32>(n_out).map_err(err)?;
            dev.prim_short_conv(&stream, &ins[0], &w, &mut win, &mut y, &pos, c.positions.len(), c.out[1]).map_err(err)?;
            y
        }
        Op::DeltaNet { scale, .. } => {
            let mut state = dev.upload(&c.state).map_err(err)?;
            let mut y = dev.alloc::<f32>(n_out).map_err(err)?;
            let (q, v) = (&c.ins[0].dims, &c.ins[2].dims);
            let dims = [c.positions.len(), q[1], v[1], q[2], v[2]];
            dev.prim_delta_net(&stream, [&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]], &mut state, &mut y, &pos, dims, scale).map_err(err)?;
            y
        }
        Op::StateRows { .. } => {
            let mut cache = dev.upload(&c.state).map_err(err)?;
            let w = c.out[1];
            dev.prim_rows_write(&stream, &ins[0], &mut cache, &pos, c.positions.len(), w).map_err(err)?;
            let mut all = vec![0f32; cache.len()];
            cache.download(&stream, &mut all).map_err(err)?;
            return Ok(all[..n_out].iter().map(|v| v.to_bits()).collect());
        }
        _ => {
            let weights: Vec<DeviceBuf<f32>> = c.weights.iter().map(|w| dev.upload(w).map_err(err)).collect::<R<_>>()?;
            let freq = match &c.op {
                Op::Rope(r) => prim_rope_table(dev, r)?,
                _ => None,
            };
            let weight = |w: Wt| -> R<&DeviceBuf<f32>> { weights.get(w.0 as usize).ok_or_else(|| format!("no weight {}", w.0)) };
            let rope_freq = |_: &Rope| -> R<&DeviceBuf<f32>> { freq.as_ref().ok_or_else(|| "no YaRN table".to_string()) };
            let cx = DevCx { positions: &pos, tokens: &toks, n_tok: c.positions.len(), weight: &weight, rope_freq: &rope_freq, sabotage };
            let dins: Vec<DIn<'_>> = ins.iter().zip(&c.ins).map(|(b, t)| DIn { buf: b, dims: &t.dims }).collect();
            let mut alloc = |n: usize| dev.alloc::<f32>(n.max(1)).map_err(err);
            prim::eval(dev, &stream, &c.op, &dins, &c.out, &cx, &mut alloc).ok_or_else(|| format!("{} has no CUDA primitive", c.op.name()))??
        }
    };
    let mut host = vec![0f32; n_out];
    y.download(&stream, &mut host).map_err(err)?;
    let _ = &mut y;
    Ok(host.iter().map(|v| v.to_bits()).collect())
}

fn prim_rope_table(dev: &CudaDevice, r: &Rope) -> R<Option<DeviceBuf<f32>>> {
    crate::cpu::prim::rope_freq(r).map(|f| dev.upload(&f).map_err(err)).transpose()
}

/// Every registered test, `seeds` draws each, on `dev` against the CPU.
pub fn run_all(dev: &CudaDevice, seeds: u64) -> Vec<Row> {
    let mut rows = Vec::new();
    for t in opcheck::tests() {
        for seed in 0..seeds {
            let c = (t.make)(&mut opcheck::Gen::new(seed));
            let row = match (opcheck::cpu(&c), run_case(dev, &c, t.negative)) {
                (Ok(want), Ok(got)) => opcheck::compare(t.name, &c, &want, &got, t.tol, t.negative),
                (Err(e), _) | (_, Err(e)) => Row { name: t.name, shape: format!("{:?}", c.out), err: f64::INFINITY, tol: t.tol, pass: false, note: e },
            };
            rows.push(row);
        }
    }
    rows
}
