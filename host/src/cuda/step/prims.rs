//! The CUDA step's N-D ops: the primitives of [`crate::cuda::prim`], the
//! `weight` values served from the resident f32 copies, the rows and
//! recurrent states, and the experts op on routing the graph computed.

use pulsar_cuda::DeviceBuf;
use pulsar_plugin_api::graph::{Experts, Op, Rope};
use pulsar_plugin_api::{Val, Wt};

use super::{err, CudaStep, DVal, Store, R};
use crate::cuda::CudaKv;
use crate::cuda::prim::{self, DIn, DevCx};
use crate::graph::{Gating, MoeSpec};

/// `[rows, cols]` of N-D dims (a scalar is one row of one).
fn rows_cols(dims: &[usize]) -> (usize, usize) {
    match dims.split_first() {
        Some((r, rest)) => (*r, rest.iter().product()),
        None => (1, 1),
    }
}

impl<'a> CudaStep<'a> {
    /// The live buffer of `v` among `vals` (a field borrow, so the pools
    /// stay free for the op's output).
    fn live<'v>(vals: &'v [DVal<'a>], v: Val) -> R<&'v DeviceBuf<f32>> {
        vals.get(v.0 as usize).and_then(|d| d.buf()).ok_or_else(|| format!("value {} was released before this read (the op sequence changed between steps)", v.0))
    }

    pub(super) fn run_prim(&mut self, op: &Op, ins: &[Val], in_dims: &[Vec<usize>], want: &[usize]) -> R<Val> {
        let (rows, cols) = rows_cols(want);
        let cm = self.cm;
        let dev = &cm.dev;
        let stream = dev.compute().clone();
        let n = self.positions.len();
        match op {
            Op::Weight(w) => {
                let (dw, mw) = self.weight(*w)?;
                let f = dw.f32.as_ref().ok_or_else(|| format!("{} has no f32 copy on the device", mw.name))?;
                if f.len() != rows * cols {
                    return Err(format!("{}: {} values, the graph says {want:?}", mw.name, f.len()));
                }
                self.vals.push(DVal { store: Store::Borrowed(f), rows, cols });
                Ok(Val(self.vals.len() as u32 - 1))
            }
            Op::StateRows { state } => {
                let x = Self::live(&self.vals, ins[0]).inspect_err(|_| self.released_early.set(true))?;
                let (w, cache) = one_kv(self.kvs, &self.runs)?.rows.get_mut(&(*state as usize)).ok_or_else(|| format!("state {state} is not a rows state"))?;
                let w = *w;
                if cols != w || x.len() != n * w {
                    return Err(format!("state_rows {state}: rows of {w}, the graph gives {} values for {n} rows and reads {want:?}", x.len()));
                }
                if rows * w > cache.len() {
                    return Err(format!("state_rows {state}: {rows} positions, the cache holds {}", cache.len() / w));
                }
                dev.prim_rows_write(&stream, x, cache, self.pos_buf, n, w).map_err(err)?;
                let (src, bytes) = (cache.device_ptr(), rows * w * 4);
                let y = self.new_val(rows, cols)?;
                self.copy_rows(y.device_ptr(), src, bytes)?;
                self.push(y, rows, cols)
            }
            Op::Scan { state } => {
                let mut y = self.pools.f32.take(dev, rows * cols).map_err(err)?;
                let (a, b) = (Self::live(&self.vals, ins[0]), Self::live(&self.vals, ins[1]));
                let (Ok(a), Ok(b)) = (a, b) else {
                    self.released_early.set(true);
                    return Err("scan: an input was released before this read".into());
                };
                let s = one_kv(self.kvs, &self.runs)?.recurrent.get_mut(&(*state as usize)).ok_or_else(|| format!("state {state} is not a recurrent state"))?;
                dev.prim_scan(&stream, a, b, s, &mut y, self.pos_buf, n).map_err(err)?;
                self.push(y, rows, cols)
            }
            Op::ShortConv { state, weight } => {
                let mut y = self.pools.f32.take(dev, rows * cols).map_err(err)?;
                let Ok(x) = Self::live(&self.vals, ins[0]) else {
                    self.released_early.set(true);
                    return Err("short_conv: its input was released before this read".into());
                };
                let w = cm.weights.get(weight.0 as usize).and_then(|d| d.f32.as_ref()).ok_or_else(|| format!("weight {} has no f32 copy on the device", weight.0))?;
                let s = one_kv(self.kvs, &self.runs)?.recurrent.get_mut(&(*state as usize)).ok_or_else(|| format!("state {state} is not a recurrent state"))?;
                dev.prim_short_conv(&stream, x, w, s, &mut y, self.pos_buf, n, cols).map_err(err)?;
                self.push(y, rows, cols)
            }
            Op::DeltaNet { state, scale } => {
                let mut y = self.pools.f32.take(dev, rows * cols).map_err(err)?;
                let bufs: Vec<&DeviceBuf<f32>> = match ins.iter().map(|&v| Self::live(&self.vals, v)).collect::<R<_>>() {
                    Ok(b) => b,
                    Err(e) => {
                        self.released_early.set(true);
                        return Err(e);
                    }
                };
                let (q, v) = (&in_dims[0], &in_dims[2]);
                let dims = [n, q[1], v[1], q[2], v[2]];
                let s = one_kv(self.kvs, &self.runs)?.recurrent.get_mut(&(*state as usize)).ok_or_else(|| format!("state {state} is not a recurrent state"))?;
                dev.prim_delta_net(&stream, [bufs[0], bufs[1], bufs[2], bufs[3], bufs[4]], s, &mut y, self.pos_buf, dims, *scale).map_err(err)?;
                self.push(y, rows, cols)
            }
            _ => {
                let bufs: Vec<&DeviceBuf<f32>> = match ins.iter().map(|&v| Self::live(&self.vals, v)).collect::<R<_>>() {
                    Ok(b) => b,
                    Err(e) => {
                        self.released_early.set(true);
                        return Err(e);
                    }
                };
                let dins: Vec<DIn<'_>> = bufs.iter().zip(in_dims).map(|(b, d)| DIn { buf: b, dims: d }).collect();
                let weight = |w: Wt| -> R<&DeviceBuf<f32>> { cm.weights.get(w.0 as usize).and_then(|d| d.f32.as_ref()).ok_or_else(|| format!("weight {} has no f32 copy on the device", w.0)) };
                let rope_freq = |r: &Rope| -> R<&DeviceBuf<f32>> { cm.rope_freq.iter().find(|(q, _)| q == r).map(|(_, b)| b).ok_or_else(|| "a YaRN rope without its table".to_string()) };
                let cx = DevCx { positions: self.pos_buf, tokens: self.tok_buf, n_tok: n, weight: &weight, rope_freq: &rope_freq, sabotage: false };
                let pools = &mut *self.pools;
                let mut alloc = |len: usize| pools.f32.take(dev, len).map_err(err);
                let y = prim::eval(dev, &stream, op, &dins, want, &cx, &mut alloc).ok_or_else(|| format!("{} has no CUDA primitive", op.name()))??;
                self.push(y, rows, cols)
            }
        }
    }

    /// The experts op on ids and weights the graph computed: the fused MoE
    /// op's expert path (store, pools, lanes) with its routing given.
    pub(super) fn given_experts(&mut self, x: Val, ids: Val, weights: Val, e: &Experts, top_k: u32) -> R<Val> {
        let (dw, mw) = self.weight(e.gate)?;
        let n_expert = *dw.dims.get(2).ok_or_else(|| format!("{}: not an expert tensor", mw.name))? as u32;
        // Router, gating, bias and scale are not read when the routing is given.
        let spec = MoeSpec {
            layer: e.layer,
            router: e.gate,
            gate_exps: e.gate,
            up_exps: e.up,
            down_exps: e.down,
            n_expert,
            top_k,
            gating: Gating::Softmax,
            bias: None,
            norm_topk: false,
            weights_scale: 1.0,
            act: e.act,
        };
        self.do_moe(x, &spec, Some((ids, weights)))
    }
}

/// The cache of a step's only sequence: the ops over rows and recurrent
/// states run one sequence a step (`CudaRunner::batches`).
fn one_kv<'k>(kvs: &'k mut [CudaKv], runs: &[(usize, usize, usize)]) -> R<&'k mut CudaKv> {
    match runs {
        [(_, _, s)] => kvs.get_mut(*s).ok_or_else(|| format!("sequence {s} has no cache")),
        _ => Err(format!("a state op over {} sequences in one step", runs.len())),
    }
}
