//! The step graph's primitives on the GPU: each op of [`crate::cpu::prim::eval`]
//! as launches of kernels/cuda/prim.cu (and the fused norm, rope and GLU
//! kernels). The CUDA step runs the ops it has no fused path for through
//! here, and the Ops harness ([`crate::opcheck`]) checks each against the
//! CPU's. Values are contiguous row-major buffers of 4-byte words: f32, or
//! i32 ids in the same buffer type.

use cudarc::driver::CudaStream;
use pulsar_cuda::{CudaDevice, DeviceBuf, PrimShape};
use pulsar_kernels::ops::{RopeKind, RopeParams};
use pulsar_plugin_api::graph::{Binary, Op, Reduce, Rope, RopeMode, Unary};
use pulsar_plugin_api::Wt;

use crate::cpu::act_of;
// One definition of numpy broadcasting for both backends.
use crate::cpu::prim::broadcast_strides;

type R<T> = Result<T, String>;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// An input value: its buffer and its dims.
#[derive(Clone, Copy)]
pub struct DIn<'b> {
    pub buf: &'b DeviceBuf<f32>,
    pub dims: &'b [usize],
}

/// What a primitive reads from its step besides its inputs.
pub struct DevCx<'b> {
    pub positions: &'b DeviceBuf<u32>,
    pub tokens: &'b DeviceBuf<u32>,
    /// Rows of the step (the positions that count).
    pub n_tok: usize,
    /// A resident weight's f32 values.
    pub weight: &'b dyn Fn(Wt) -> R<&'b DeviceBuf<f32>>,
    /// A YaRN rope's inverse frequencies.
    pub rope_freq: &'b dyn Fn(&Rope) -> R<&'b DeviceBuf<f32>>,
    /// The Ops harness's negative control: reductions sum in the wrong order.
    pub sabotage: bool,
}

/// `Unary`'s declaration index (prim.cu's op codes).
fn unary_code(f: Unary) -> u32 {
    use Unary::*;
    [Neg, Exp, Log, Sqrt, Rsqrt, Recip, Square, Abs, Sigmoid, Softplus, Tanh, Relu, Silu, Gelu, GeluTanh].iter().position(|&u| u == f).expect("every unary op has a code") as u32
}

fn binary_code(f: Binary) -> u32 {
    use Binary::*;
    [Add, Sub, Mul, Div, Max, Min].iter().position(|&b| b == f).expect("every binary op has a code") as u32
}

fn reduce_code(k: Reduce) -> u32 {
    match k {
        Reduce::Sum => 0,
        Reduce::Mean => 1,
        Reduce::Max => 2,
    }
}

fn axis(a: i64, rank: usize) -> R<usize> {
    crate::cpu::prim::axis(a, rank)
}

fn rope_params(r: &Rope, head_dim: usize) -> RopeParams {
    let kind = match r.mode {
        RopeMode::Neox => RopeKind::Neox,
        RopeMode::Interleaved => RopeKind::Interleaved,
    };
    RopeParams { head_dim, n_rot: r.n_rot as usize, base: r.base, linear_factor: r.linear_factor, kind }
}

/// Whether [`eval`] runs `op`.
pub fn runs(op: &Op) -> bool {
    matches!(
        op,
        Op::Tokens
            | Op::Positions
            | Op::Reshape(_)
            | Op::Permute(_)
            | Op::Slice { .. }
            | Op::Concat { .. }
            | Op::Unary(_)
            | Op::Scale(_)
            | Op::Clamp { .. }
            | Op::Binary(_)
            | Op::Softmax { .. }
            | Op::Cumsum { .. }
            | Op::Reduce { .. }
            | Op::TopK { .. }
            | Op::TakeAlong
            | Op::Gather
            | Op::Matmul
            | Op::Mask { .. }
            | Op::RmsNorm { .. }
            | Op::Rope(_)
            | Op::Glu(_)
            | Op::BlockSelect { .. }
            | Op::ToF32
            | Op::NgramHash { .. }
            | Op::ConvRows { .. }
            | Op::PooledSelect { rope: Rope { yarn: None, .. }, .. }
    )
}

/// Run `op` on `ins` into a new buffer of `want`'s size from `alloc`;
/// `None` when `op` is not one of [`crate::cpu::prim::eval`]'s (or a
/// `weight`, which the step serves from the resident copy).
pub fn eval(dev: &CudaDevice, stream: &CudaStream, op: &Op, ins: &[DIn<'_>], want: &[usize], cx: &DevCx<'_>, alloc: &mut dyn FnMut(usize) -> R<DeviceBuf<f32>>) -> Option<R<DeviceBuf<f32>>> {
    if !runs(op) {
        return None;
    }
    let n_out: usize = want.iter().product();
    let rank = ins.first().map_or(0, |x| x.dims.len());
    let contiguous = |d: &[usize]| pulsar_cuda::ops::strides(d);
    let mut y = match alloc(n_out) {
        Ok(y) => y,
        Err(e) => return Some(Err(e)),
    };
    let r = (|| -> R<()> {
        match op {
            Op::Tokens => dev.prim_ids(stream, cx.tokens, &mut y).map_err(err)?,
            Op::Positions => dev.prim_ids(stream, cx.positions, &mut y).map_err(err)?,
            Op::Reshape(_) => {
                let s = PrimShape::new(&[n_out], &[1], 0, &[1], 0).map_err(err)?;
                dev.prim_copy(stream, ins[0].buf, &mut y, &s).map_err(err)?;
            }
            Op::Permute(p) => {
                let st = contiguous(ins[0].dims);
                let src: Vec<usize> = p.iter().map(|&a| st[a as usize]).collect();
                let s = PrimShape::new(want, &src, 0, &contiguous(want), 0).map_err(err)?;
                dev.prim_copy(stream, ins[0].buf, &mut y, &s).map_err(err)?;
            }
            Op::Slice { axis: a, start, .. } => {
                let a = axis(*a, rank)?;
                let st = contiguous(ins[0].dims);
                let s = PrimShape::new(want, &st, *start as usize * st[a], &contiguous(want), 0).map_err(err)?;
                dev.prim_copy(stream, ins[0].buf, &mut y, &s).map_err(err)?;
            }
            Op::Concat { axis: a } => {
                let a = axis(*a, rank)?;
                let out_st = contiguous(want);
                let mut at = 0;
                for x in ins {
                    let s = PrimShape::new(x.dims, &contiguous(x.dims), 0, &out_st, at * out_st[a]).map_err(err)?;
                    dev.prim_copy(stream, x.buf, &mut y, &s).map_err(err)?;
                    at += x.dims[a];
                }
            }
            Op::Unary(f) => dev.prim_unary(stream, ins[0].buf, &mut y, unary_code(*f), 0.0, 0.0).map_err(err)?,
            Op::Scale(s) => dev.prim_unary(stream, ins[0].buf, &mut y, 15, *s, 0.0).map_err(err)?,
            Op::Clamp { lo, hi } => dev.prim_unary(stream, ins[0].buf, &mut y, 16, *lo, *hi).map_err(err)?,
            Op::Binary(f) => {
                let s = PrimShape::new(want, &broadcast_strides(ins[0].dims, want), 0, &broadcast_strides(ins[1].dims, want), 0).map_err(err)?;
                dev.prim_binary(stream, ins[0].buf, ins[1].buf, &mut y, &s, binary_code(*f)).map_err(err)?;
            }
            Op::Softmax { axis: a } => dev.prim_softmax(stream, ins[0].buf, &mut y, pulsar_cuda::ops::lanes(ins[0].dims, axis(*a, rank)?)).map_err(err)?,
            Op::Cumsum { axis: a } => dev.prim_cumsum(stream, ins[0].buf, &mut y, pulsar_cuda::ops::lanes(ins[0].dims, axis(*a, rank)?)).map_err(err)?,
            Op::Reduce { kind, axis: a } => {
                let l = pulsar_cuda::ops::lanes(ins[0].dims, axis(*a, rank)?);
                dev.prim_reduce(stream, ins[0].buf, &mut y, l, reduce_code(*kind), cx.sabotage).map_err(err)?
            }
            Op::TopK { k } => dev.prim_topk(stream, ins[0].buf, &mut y, *ins[0].dims.last().ok_or("top_k of a scalar")?, *k as usize).map_err(err)?,
            Op::TakeAlong => {
                let (n, k) = (*ins[0].dims.last().ok_or("take_along of a scalar")?, *ins[1].dims.last().ok_or("take_along of scalar ids")?);
                dev.prim_take_along(stream, ins[0].buf, ins[1].buf, &mut y, n, k).map_err(err)?
            }
            Op::Gather => {
                let width: usize = ins[0].dims.iter().skip(1).product();
                dev.prim_gather(stream, ins[0].buf, ins[1].buf, &mut y, width).map_err(err)?
            }
            Op::Matmul => {
                let (a, b) = (ins[0].dims, ins[1].dims);
                let (ra, rb, ro) = (a.len(), b.len(), want.len());
                let (m, k, n) = (a[ra - 2], a[ra - 1], b[rb - 1]);
                let batch = &want[..ro - 2];
                let sa: Vec<usize> = broadcast_strides(&a[..ra - 2], batch).iter().map(|s| s * m * k).collect();
                let sb: Vec<usize> = broadcast_strides(&b[..rb - 2], batch).iter().map(|s| s * k * n).collect();
                let s = PrimShape::new(batch, &sa, 0, &sb, 0).map_err(err)?;
                dev.prim_matmul(stream, ins[0].buf, ins[1].buf, &mut y, &s, m, k, n).map_err(err)?
            }
            Op::Mask { window } => dev.prim_mask(stream, cx.positions, &mut y, cx.n_tok, want[1], *window).map_err(err)?,
            Op::RmsNorm { weight, eps } => {
                let w = weight.map(|w| (cx.weight)(w)).transpose()?;
                let g = *want.last().ok_or("rms_norm of a scalar")?;
                dev.rms_norm(stream, ins[0].buf, &mut y, w, g, *eps).map_err(err)?
            }
            Op::Rope(r) => {
                let hd = *want.last().ok_or("rope of a scalar")?;
                let width: usize = want.iter().skip(1).product();
                let p = rope_params(r, hd);
                match r.yarn {
                    None => dev.rope(stream, ins[0].buf, &mut y, width, cx.positions, &p).map_err(err)?,
                    Some(_) => dev.prim_rope_freq(stream, ins[0].buf, &mut y, width, cx.positions, (cx.rope_freq)(r)?, &p).map_err(err)?,
                }
            }
            Op::Glu(a) => dev.glu(stream, ins[0].buf, ins[1].buf, &mut y, act_of(*a)).map_err(err)?,
            Op::BlockSelect { block, top_k, local } => {
                let c = *want.last().ok_or("block_select of a scalar")?;
                dev.prim_block_select(stream, ins[0].buf, &mut y, cx.positions, cx.n_tok, c, *block as usize, *top_k as usize, *local as usize).map_err(err)?
            }
            Op::ToF32 => dev.prim_to_f32(stream, ins[0].buf, &mut y).map_err(err)?,
            Op::NgramHash { eos, mult, offsets, vocab, .. } => dev.prim_ngram_hash(stream, ins[0].buf, &mut y, cx.positions, cx.n_tok, *eos, mult, offsets, vocab).map_err(err)?,
            Op::ConvRows { weight, dilation } => {
                let w = (cx.weight)(*weight)?;
                dev.prim_conv_rows(stream, ins[0].buf, w, &mut y, cx.positions, cx.n_tok, want[1], *dilation as usize).map_err(err)?
            }
            Op::PooledSelect { block, top_k, key_norm, eps, scale, rope } => {
                let (nh, d, c) = (ins[0].dims[1], ins[0].dims[2], want[1]);
                let w = (cx.weight)(*key_norm)?;
                let mut pooled = alloc((c / *block as usize).max(1) * d)?;
                let r = (rope.n_rot as usize, rope.mode == RopeMode::Neox, rope.base, rope.linear_factor);
                let dims = [cx.n_tok, nh, d, c];
                dev.prim_pooled_select(stream, ins[0].buf, ins[1].buf, w, &mut pooled, &mut y, cx.positions, dims, *block as usize, *top_k as usize, *eps, *scale, r).map_err(err)?
            }
            _ => unreachable!("runs() lists the ops above"),
        }
        Ok(())
    })();
    // On an error the buffer is freed, not pooled: the step fails anyway.
    Some(r.map(|()| y))
}
