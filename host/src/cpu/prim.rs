//! The primitive ops on the CPU: N-D, row-major, f32 and i32 tensors. These
//! are the reference semantics every backend's primitives are checked
//! against; each computes one output element with one fixed order of
//! operations (reductions run in index order), whatever the batch.

use std::sync::Arc;

use pulsar_kernels::ops::{self, math, Activation, RopeKind, RopeParams, DELTA_NET_CHUNK};
use pulsar_plugin_api::graph::{Binary, Op, Reduce, Rope, RopeMode, Unary};
use pulsar_plugin_api::Wt;

type R<T> = Result<T, String>;

/// A step value on the CPU. Data is shared, so a reshape copies nothing.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub dims: Vec<usize>,
    pub data: TData,
}

#[derive(Clone, Debug)]
pub enum TData {
    F32(Arc<Vec<f32>>),
    I32(Arc<Vec<i32>>),
}

impl Tensor {
    pub fn f32(dims: Vec<usize>, data: Vec<f32>) -> Tensor {
        Tensor { dims, data: TData::F32(Arc::new(data)) }
    }
    pub fn i32(dims: Vec<usize>, data: Vec<i32>) -> Tensor {
        Tensor { dims, data: TData::I32(Arc::new(data)) }
    }
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn f(&self) -> R<&[f32]> {
        match &self.data {
            TData::F32(d) => Ok(d),
            TData::I32(_) => Err("expected an f32 value, got i32".into()),
        }
    }
    pub fn ids(&self) -> R<&[i32]> {
        match &self.data {
            TData::I32(d) => Ok(d),
            TData::F32(_) => Err("expected i32 indices, got f32".into()),
        }
    }
    /// The f32 data, copied only when another value shares it.
    pub fn into_f32(self) -> R<Vec<f32>> {
        match self.data {
            TData::F32(d) => Ok(Arc::try_unwrap(d).unwrap_or_else(|d| (*d).clone())),
            TData::I32(_) => Err("expected an f32 value, got i32".into()),
        }
    }
    /// (rows, cols): the first axis, and the product of the others.
    pub fn rows_cols(&self) -> (usize, usize) {
        match self.dims.split_first() {
            Some((r, rest)) => (*r, rest.iter().product()),
            None => (1, 1),
        }
    }
    /// The same elements with other dims.
    pub fn reshaped(&self, dims: Vec<usize>) -> R<Tensor> {
        if dims.iter().product::<usize>() != self.len() {
            return Err(format!("cannot view {:?} as {dims:?}", self.dims));
        }
        Ok(Tensor { dims, data: self.data.clone() })
    }
    fn map_data(&self, f32s: impl Fn(&[f32]) -> Vec<f32>, i32s: impl Fn(&[i32]) -> Vec<i32>, dims: Vec<usize>) -> Tensor {
        match &self.data {
            TData::F32(d) => Tensor::f32(dims, f32s(d)),
            TData::I32(d) => Tensor::i32(dims, i32s(d)),
        }
    }
}

/// Row-major strides of `dims`.
fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// Visit every index of `dims` in row-major order with the offsets of each
/// of `st` (strides, 0 on broadcast axes).
fn each_index<const N: usize>(dims: &[usize], st: [&[usize]; N], mut f: impl FnMut([usize; N])) {
    let n: usize = dims.iter().product();
    let mut idx = vec![0usize; dims.len()];
    let mut off = [0usize; N];
    for _ in 0..n {
        f(off);
        for a in (0..dims.len()).rev() {
            idx[a] += 1;
            for k in 0..N {
                off[k] += st[k][a];
            }
            if idx[a] < dims[a] {
                break;
            }
            for k in 0..N {
                off[k] -= st[k][a] * dims[a];
            }
            idx[a] = 0;
        }
    }
}

/// Strides of `dims` seen as broadcast to `out` (right-aligned; 0 where a
/// dim is 1 or missing).
pub fn broadcast_strides(dims: &[usize], out: &[usize]) -> Vec<usize> {
    let s = strides(dims);
    let pad = out.len() - dims.len();
    (0..out.len()).map(|i| if i < pad || dims[i - pad] == 1 { 0 } else { s[i - pad] }).collect()
}

pub fn unary_fn(f: Unary) -> fn(f32) -> f32 {
    match f {
        Unary::Neg => |x| -x,
        Unary::Exp => math::exp,
        Unary::Log => math::ln,
        Unary::Sqrt => f32::sqrt,
        Unary::Rsqrt => |x| 1.0 / x.sqrt(),
        Unary::Recip => |x| 1.0 / x,
        Unary::Square => |x| x * x,
        Unary::Abs => f32::abs,
        Unary::Sigmoid => math::sigmoid,
        // PyTorch's threshold: above 20, softplus(x) = x in f32.
        Unary::Softplus => math::softplus,
        Unary::Tanh => math::tanh,
        Unary::Relu => |x| if x > 0.0 { x } else { 0.0 },
        Unary::Silu => math::silu,
        Unary::Gelu => ops::gelu,
        Unary::GeluTanh => math::gelu_tanh,
    }
}

pub fn binary_fn(f: Binary) -> fn(f32, f32) -> f32 {
    match f {
        Binary::Add => |a, b| a + b,
        Binary::Sub => |a, b| a - b,
        Binary::Mul => |a, b| a * b,
        Binary::Div => |a, b| a / b,
        Binary::Max => f32::max,
        Binary::Min => f32::min,
    }
}

/// `f(a, b)` with numpy broadcasting into `out_dims`.
pub fn binary(a: &Tensor, b: &Tensor, out_dims: &[usize], f: fn(f32, f32) -> f32) -> R<Tensor> {
    let (da, db) = (a.f()?, b.f()?);
    if a.dims == b.dims {
        return Ok(Tensor::f32(a.dims.clone(), da.iter().zip(db).map(|(&x, &y)| f(x, y)).collect()));
    }
    let (sa, sb) = (broadcast_strides(&a.dims, out_dims), broadcast_strides(&b.dims, out_dims));
    let mut out = Vec::with_capacity(out_dims.iter().product());
    each_index(out_dims, [&sa, &sb], |[i, j]| out.push(f(da[i], db[j])));
    Ok(Tensor::f32(out_dims.to_vec(), out))
}

/// Call `f` on every lane along `axis` (gathered into a contiguous buffer
/// and written back), in row-major order of the other axes.
fn along_axis(dims: &[usize], axis: usize, data: &mut [f32], mut f: impl FnMut(&mut [f32])) {
    let n = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let outer: usize = dims[..axis].iter().product();
    if inner == 1 {
        data.chunks_mut(n.max(1)).for_each(f);
        return;
    }
    let mut lane = vec![0f32; n];
    for o in 0..outer {
        for i in 0..inner {
            let base = o * n * inner + i;
            for j in 0..n {
                lane[j] = data[base + j * inner];
            }
            f(&mut lane);
            for j in 0..n {
                data[base + j * inner] = lane[j];
            }
        }
    }
}

pub fn softmax(x: Tensor, axis: usize) -> R<Tensor> {
    let dims = x.dims.clone();
    let mut d = x.into_f32()?;
    along_axis(&dims, axis, &mut d, ops::softmax_in_place);
    Ok(Tensor::f32(dims, d))
}

pub fn cumsum(x: Tensor, axis: usize) -> R<Tensor> {
    let dims = x.dims.clone();
    let mut d = x.into_f32()?;
    along_axis(&dims, axis, &mut d, |lane| {
        let mut s = 0f32;
        for v in lane.iter_mut() {
            s += *v;
            *v = s;
        }
    });
    Ok(Tensor::f32(dims, d))
}

/// A reduction along `axis` (kept with size 1), in index order.
pub fn reduce(x: &Tensor, kind: Reduce, axis: usize) -> R<Tensor> {
    let d = x.f()?;
    let n = x.dims[axis];
    let inner: usize = x.dims[axis + 1..].iter().product();
    let outer: usize = x.dims[..axis].iter().product();
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let lane = (0..n).map(|j| d[o * n * inner + j * inner + i]);
            out.push(match kind {
                Reduce::Sum => lane.fold(0f32, |s, v| s + v),
                Reduce::Mean => lane.fold(0f32, |s, v| s + v) / n as f32,
                Reduce::Max => lane.fold(f32::NEG_INFINITY, f32::max),
            });
        }
    }
    let mut dims = x.dims.clone();
    dims[axis] = 1;
    Ok(Tensor::f32(dims, out))
}

pub fn top_k(x: &Tensor, k: usize) -> R<Tensor> {
    let d = x.f()?;
    let n = *x.dims.last().ok_or("top_k of a scalar")?;
    let mut out = Vec::with_capacity(d.len() / n.max(1) * k);
    for row in d.chunks(n.max(1)) {
        out.extend(ops::top_k(row, k).into_iter().map(|i| i as i32));
    }
    let mut dims = x.dims.clone();
    *dims.last_mut().expect("rank >= 1") = k;
    Ok(Tensor::i32(dims, out))
}

fn index(i: i32, n: usize, what: &str) -> R<usize> {
    usize::try_from(i).ok().filter(|&i| i < n).ok_or_else(|| format!("{what}: index {i} is outside 0..{n}"))
}

pub fn take_along(x: &Tensor, ids: &Tensor) -> R<Tensor> {
    let n = *x.dims.last().ok_or("take_along of a scalar")?;
    let k = *ids.dims.last().ok_or("take_along with scalar indices")?;
    let ix = ids.ids()?;
    let pick = |r: usize, j: usize| index(ix[r * k + j], n, "take_along").map(|i| r * n + i);
    let rows = ix.len() / k.max(1);
    let positions: Vec<usize> = (0..rows).flat_map(|r| (0..k).map(move |j| (r, j))).map(|(r, j)| pick(r, j)).collect::<R<_>>()?;
    Ok(match &x.data {
        TData::F32(d) => Tensor::f32(ids.dims.clone(), positions.iter().map(|&p| d[p]).collect()),
        TData::I32(d) => Tensor::i32(ids.dims.clone(), positions.iter().map(|&p| d[p]).collect()),
    })
}

pub fn gather(x: &Tensor, ids: &Tensor) -> R<Tensor> {
    let (rows, width) = x.rows_cols();
    let ix = ids.ids()?;
    let picks: Vec<usize> = ix.iter().map(|&i| index(i, rows, "gather")).collect::<R<_>>()?;
    let mut dims = ids.dims.clone();
    dims.extend_from_slice(&x.dims[1..]);
    let rows_of = |d: &[f32]| picks.iter().flat_map(|&r| d[r * width..(r + 1) * width].iter().copied()).collect();
    let rows_of_i = |d: &[i32]| picks.iter().flat_map(|&r| d[r * width..(r + 1) * width].iter().copied()).collect();
    Ok(x.map_data(rows_of, rows_of_i, dims))
}

pub fn permute(x: &Tensor, perm: &[u32]) -> R<Tensor> {
    let s = strides(&x.dims);
    let dims: Vec<usize> = perm.iter().map(|&a| x.dims[a as usize]).collect();
    let st: Vec<usize> = perm.iter().map(|&a| s[a as usize]).collect();
    let order = |n: usize| {
        let mut o = Vec::with_capacity(n);
        each_index(&dims, [&st], |[i]| o.push(i));
        o
    };
    let o = order(x.len());
    Ok(x.map_data(|d| o.iter().map(|&i| d[i]).collect(), |d| o.iter().map(|&i| d[i]).collect(), dims.clone()))
}

/// `outer` runs of each part in turn (the part's `run` elements each).
fn join<T: Copy>(parts: &[(&[T], usize)], outer: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.0.len()).sum());
    for o in 0..outer {
        for &(p, run) in parts {
            out.extend_from_slice(&p[o * run..(o + 1) * run]);
        }
    }
    out
}

pub fn concat(xs: &[&Tensor], axis: usize) -> R<Tensor> {
    let first = xs[0];
    let outer: usize = first.dims[..axis].iter().product();
    let inner: usize = first.dims[axis + 1..].iter().product();
    let mut dims = first.dims.clone();
    dims[axis] = xs.iter().map(|t| t.dims[axis]).sum();
    let run = |t: &Tensor| t.dims[axis] * inner;
    Ok(match &first.data {
        TData::F32(_) => Tensor::f32(dims, join(&xs.iter().map(|t| Ok((t.f()?, run(t)))).collect::<R<Vec<_>>>()?, outer)),
        TData::I32(_) => Tensor::i32(dims, join(&xs.iter().map(|t| Ok((t.ids()?, run(t)))).collect::<R<Vec<_>>>()?, outer)),
    })
}

pub fn slice(x: &Tensor, axis: usize, start: usize, len: usize) -> R<Tensor> {
    let n = x.dims[axis];
    if start + len > n {
        return Err(format!("slice [{start}, {}) of an axis of {n}", start + len));
    }
    let outer: usize = x.dims[..axis].iter().product();
    let inner: usize = x.dims[axis + 1..].iter().product();
    let mut dims = x.dims.clone();
    dims[axis] = len;
    let take = |o: usize| (o * n + start) * inner..(o * n + start + len) * inner;
    Ok(x.map_data(
        |d| (0..outer).flat_map(|o| d[take(o)].iter().copied()).collect(),
        |d| (0..outer).flat_map(|o| d[take(o)].iter().copied()).collect(),
        dims.clone(),
    ))
}

/// `[.., m, k] · [.., k, n]`, batch dims broadcast; each dot sums k in order.
pub fn matmul(a: &Tensor, b: &Tensor, out_dims: &[usize]) -> R<Tensor> {
    let (da, db) = (a.f()?, b.f()?);
    let (ra, rb) = (a.dims.len(), b.dims.len());
    let (m, k, n) = (a.dims[ra - 2], a.dims[ra - 1], b.dims[rb - 1]);
    let batch = &out_dims[..out_dims.len() - 2];
    // Strides over the batch axes, in whole matrices.
    let sa = broadcast_strides(&a.dims[..ra - 2], batch);
    let sb = broadcast_strides(&b.dims[..rb - 2], batch);
    let mut out = Vec::with_capacity(out_dims.iter().product());
    each_index(batch, [&sa, &sb], |[ia, ib]| {
        let (ma, mb) = (&da[ia * m * k..(ia + 1) * m * k], &db[ib * k * n..(ib + 1) * k * n]);
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f32;
                for t in 0..k {
                    s += ma[i * k + t] * mb[t * n + j];
                }
                out.push(s);
            }
        }
    });
    Ok(Tensor::f32(out_dims.to_vec(), out))
}

/// What a primitive reads from its step besides its inputs.
pub struct PrimCx<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    /// A resident weight's f32 values (`weight` ops, norm weights).
    pub weight: &'a dyn Fn(Wt) -> R<Vec<f32>>,
}

/// `a` as an index into `rank` axes (negative: from the end).
pub fn axis(a: i64, rank: usize) -> R<usize> {
    let r = rank as i64;
    let i = if a < 0 { a + r } else { a };
    if i < 0 || i >= r {
        return Err(format!("axis {a} is outside a rank-{r} value"));
    }
    Ok(i as usize)
}

/// The ops that read only their inputs, the step's tokens and positions and
/// resident weights, giving a value of dims `want`; `None` for the ops that
/// need more of the step (linear products, attention, experts, states,
/// embedding, output rows). The CPU step runs these through here, and the
/// Ops harness checks every backend's against them.
pub fn eval(op: &Op, ins: &[&Tensor], want: &[usize], cx: &PrimCx<'_>) -> Option<R<Tensor>> {
    let rank = || ins.first().map_or(0, |t| t.dims.len());
    let ax = |a: i64| axis(a, rank());
    let r = (|| -> R<Tensor> {
        Ok(match op {
            Op::Tokens => Tensor::i32(want.to_vec(), cx.tokens.iter().map(|&t| t as i32).collect()),
            Op::Positions => Tensor::i32(want.to_vec(), cx.positions.iter().map(|&p| p as i32).collect()),
            Op::Weight(w) => Tensor::f32(want.to_vec(), (cx.weight)(*w)?),
            Op::Reshape(_) => ins[0].reshaped(want.to_vec())?,
            Op::Permute(p) => permute(ins[0], p)?,
            Op::Concat { axis: a } => concat(ins, ax(*a)?)?,
            Op::Slice { axis: a, start, len } => slice(ins[0], ax(*a)?, *start as usize, *len as usize)?,
            Op::Unary(f) => {
                let f = unary_fn(*f);
                Tensor::f32(want.to_vec(), ins[0].f()?.iter().map(|&v| f(v)).collect())
            }
            Op::Scale(s) => Tensor::f32(want.to_vec(), ins[0].f()?.iter().map(|&v| v * s).collect()),
            Op::Clamp { lo, hi } => Tensor::f32(want.to_vec(), ins[0].f()?.iter().map(|&v| v.max(*lo).min(*hi)).collect()),
            Op::Binary(f) => binary(ins[0], ins[1], want, binary_fn(*f))?,
            Op::Softmax { axis: a } => softmax(ins[0].clone(), ax(*a)?)?,
            Op::Reduce { kind, axis: a } => reduce(ins[0], *kind, ax(*a)?)?,
            Op::TopK { k } => top_k(ins[0], *k as usize)?,
            Op::TakeAlong => take_along(ins[0], ins[1])?,
            Op::Gather => gather(ins[0], ins[1])?,
            Op::Cumsum { axis: a } => cumsum(ins[0].clone(), ax(*a)?)?,
            Op::Matmul => matmul(ins[0], ins[1], want)?,
            Op::Mask { window } => Tensor::f32(want.to_vec(), mask(cx.positions, *window as usize, want[1])),
            Op::RmsNorm { weight, eps } => {
                let w = weight.map(|w| (cx.weight)(w)).transpose()?;
                let g = *want.last().ok_or("rms_norm of a scalar")?;
                let mut d = ins[0].clone().into_f32()?;
                ops::rms_norm_rows(&mut d, g, w.as_deref(), *eps);
                Tensor::f32(want.to_vec(), d)
            }
            Op::Rope(r) => rope(ins[0], r, want, cx.positions)?,
            Op::Glu(a) => binary(ins[0], ins[1], want, match super::act_of(*a) {
                Activation::Silu => |g, u| Activation::Silu.unit(g, u),
                Activation::GeluTanh => |g, u| Activation::GeluTanh.unit(g, u),
                Activation::Gelu => |g, u| Activation::Gelu.unit(g, u),
                Activation::SwigluOai => |g, u| Activation::SwigluOai.unit(g, u),
            })?,
            Op::BlockSelect { block, top_k, local } => block_select(ins[0], *block as usize, *top_k as usize, *local as usize, cx.positions)?,
            Op::ToF32 => Tensor::f32(want.to_vec(), ins[0].ids()?.iter().map(|&v| v as f32).collect()),
            Op::NgramHash { n, heads, eos, mult, offsets, vocab } => {
                let h = NgramHash { n: *n as usize, heads: *heads as usize, eos: *eos, mult, offsets, vocab };
                Tensor::i32(want.to_vec(), ngram_hash(ins[0].f()?, &h, cx.positions)?)
            }
            Op::ConvRows { weight, dilation } => {
                let w = (cx.weight)(*weight)?;
                Tensor::f32(want.to_vec(), conv_rows(ins[0].f()?, &w, want[1], *dilation as usize, cx.positions)?)
            }
            Op::PooledSelect { block, top_k, key_norm, eps, scale, rope } => {
                let w = (cx.weight)(*key_norm)?;
                let p = PooledSelect { block: *block as usize, top_k: *top_k as usize, eps: *eps, scale: *scale, rope };
                Tensor::f32(want.to_vec(), pooled_select(ins[0], ins[1].f()?, &w, &p, want[1], cx.positions)?)
            }
            _ => return Err(String::new()),
        })
    })();
    match r {
        Err(e) if e.is_empty() => None,
        r => Some(r),
    }
}

/// [`Op::BlockSelect`]: rows of C keys, the second-to-last axis the step's
/// queries (row r's query is `r % T`).
pub fn block_select(x: &Tensor, block: usize, top_k: usize, local: usize, positions: &[u32]) -> R<Tensor> {
    let d = x.f()?;
    let c = *x.dims.last().ok_or("block_select of a scalar")?;
    let t = positions.len();
    if x.dims.len() < 2 || x.dims[x.dims.len() - 2] != t {
        return Err(format!("block_select: scores {:?} for {t} queries", x.dims));
    }
    let nb = c.div_ceil(block);
    let mut out = vec![f32::NEG_INFINITY; d.len()];
    let mut score = vec![0f32; nb];
    for (r, row) in d.chunks(c.max(1)).enumerate() {
        for (b, s) in score.iter_mut().enumerate() {
            *s = row[b * block..((b + 1) * block).min(c)].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        }
        // The query's own block and the local ones before it win first.
        let qb = positions[r % t] as usize / block;
        for l in 0..local {
            if let Some(s) = score.get_mut(qb.saturating_sub(l)) {
                *s = f32::INFINITY;
            }
        }
        for b in ops::top_k(&score, top_k.min(nb)) {
            if score[b] == f32::NEG_INFINITY {
                continue;
            }
            out[r * c + b * block..(r * c + (b + 1) * block).min((r + 1) * c)].iter_mut().for_each(|v| *v = 0.0);
        }
    }
    Ok(Tensor::f32(x.dims.clone(), out))
}

/// [`Op::NgramHash`]'s attributes.
pub struct NgramHash<'a> {
    pub n: usize,
    pub heads: usize,
    pub eos: i64,
    pub mult: &'a [i64],
    pub offsets: &'a [i64],
    pub vocab: &'a [i64],
}

/// [`Op::NgramHash`]: `hist` holds the sequence's token ids (f32, one per
/// position); one row of `(n − 1)·heads` ids per step position.
pub fn ngram_hash(hist: &[f32], h: &NgramHash<'_>, positions: &[u32]) -> R<Vec<i32>> {
    let nh = (h.n - 1) * h.heads;
    let mut out = Vec::with_capacity(positions.len() * nh);
    let mut s = vec![0i64; h.n];
    for &p in positions {
        let p = p as usize;
        if p >= hist.len() {
            return Err(format!("position {p} is past the token history of {}", hist.len()));
        }
        s[0] = hist[p] as i64;
        let mut reset = false;
        for j in 1..h.n {
            // An EOS at p − j resets the window from there back, as does the start.
            reset = reset || j > p || hist[p - j] as i64 == h.eos;
            s[j] = if reset { h.eos } else { hist[p - j] as i64 };
        }
        for g in 2..=h.n {
            let m = (0..g).fold(0i64, |m, j| m ^ s[j].wrapping_mul(h.mult[j]));
            for k in 0..h.heads {
                let i = (g - 2) * h.heads + k;
                out.push((m.rem_euclid(h.vocab[i]) + h.offsets[i]) as i32);
            }
        }
    }
    Ok(out)
}

/// [`Op::ConvRows`]: `cache` `[C, w]`, `taps` `[w, K]` (each channel's taps,
/// oldest first); one output row per step position, taps summed in order.
pub fn conv_rows(cache: &[f32], taps: &[f32], w: usize, dilation: usize, positions: &[u32]) -> R<Vec<f32>> {
    let k = taps.len() / w.max(1);
    let c = cache.len() / w.max(1);
    let mut out = vec![0f32; positions.len() * w];
    for (i, &p) in positions.iter().enumerate() {
        let p = p as usize;
        if p >= c {
            return Err(format!("position {p} is past the cache of {c} rows"));
        }
        let y = &mut out[i * w..(i + 1) * w];
        for (ch, y) in y.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                let back = (k - 1 - j) * dilation;
                if back <= p {
                    acc += taps[ch * k + j] * cache[(p - back) * w + ch];
                }
            }
            *y = acc;
        }
    }
    Ok(out)
}

/// [`Op::PooledSelect`]'s attributes.
pub struct PooledSelect<'a> {
    pub block: usize,
    pub top_k: usize,
    pub eps: f32,
    pub scale: f32,
    pub rope: &'a Rope,
}

/// [`Op::PooledSelect`]: `q` `[T, H, D]`, `keys` `[C, D]`; the mask `[T, c]`.
pub fn pooled_select(q: &Tensor, keys: &[f32], key_norm: &[f32], s: &PooledSelect<'_>, c: usize, positions: &[u32]) -> R<Vec<f32>> {
    let (nh, d) = (q.dims[1], q.dims[2]);
    let qd = q.f()?;
    let r = s.block;
    // Every complete block of the cache: pooled, normed, rotated at its first key.
    let nb = c.min(keys.len() / d.max(1)) / r;
    let mut pooled = vec![0f32; nb * d];
    for b in 0..nb {
        let row = &mut pooled[b * d..(b + 1) * d];
        for t in 0..r {
            for (x, &k) in row.iter_mut().zip(&keys[(b * r + t) * d..(b * r + t + 1) * d]) {
                *x += k;
            }
        }
        row.iter_mut().for_each(|x| *x /= r as f32);
    }
    ops::rms_norm_rows(&mut pooled, d, Some(key_norm), s.eps);
    let starts: Vec<u32> = (0..nb).map(|b| (b * r) as u32).collect();
    let kind = match s.rope.mode {
        RopeMode::Neox => RopeKind::Neox,
        RopeMode::Interleaved => RopeKind::Interleaved,
    };
    let rp = RopeParams { head_dim: d, n_rot: s.rope.n_rot as usize, base: s.rope.base, linear_factor: s.rope.linear_factor, kind };
    match rope_freq(s.rope) {
        None => ops::rope_rows(&mut pooled, d, &starts, rp),
        Some(f) => ops::rope_rows_with(&mut pooled, d, &starts, rp, &f),
    }
    let mut out = vec![f32::NEG_INFINITY; positions.len() * c];
    let mut score = Vec::with_capacity(nb);
    for (i, &p) in positions.iter().enumerate() {
        let p = p as usize;
        if p >= c {
            return Err(format!("position {p} is past the cache of {c} keys"));
        }
        let full = (p + 1) / r;
        score.clear();
        for b in 0..full {
            let k = &pooled[b * d..(b + 1) * d];
            let mut sc = 0f32;
            for h in 0..nh {
                let qh = &qd[(i * nh + h) * d..(i * nh + h + 1) * d];
                let dot = qh.iter().zip(k).fold(0f32, |a, (&x, &y)| a + x * y);
                sc += dot.max(0.0);
            }
            score.push(sc * s.scale);
        }
        let row = &mut out[i * c..(i + 1) * c];
        for b in ops::top_k(&score, s.top_k.min(full)) {
            row[b * r..(b + 1) * r].iter_mut().for_each(|v| *v = 0.0);
        }
        row[full * r..=p].iter_mut().for_each(|v| *v = 0.0);
    }
    Ok(out)
}

/// Query row i (at position p) sees key j iff j <= p and, with a window,
/// j > p - window (attention's rule).
pub fn mask(positions: &[u32], window: usize, c: usize) -> Vec<f32> {
    let mut m = vec![f32::NEG_INFINITY; positions.len() * c];
    for (i, &p) in positions.iter().enumerate() {
        let p = p as usize;
        let lo = if window == 0 { 0 } else { (p + 1).saturating_sub(window) };
        for j in lo..=p.min(c.saturating_sub(1)) {
            m[i * c + j] = 0.0;
        }
    }
    m
}

/// Rotary embedding of rows at `positions` (YaRN frequencies when `r` has them).
pub fn rope(x: &Tensor, r: &Rope, want: &[usize], positions: &[u32]) -> R<Tensor> {
    let (rows, cols) = x.rows_cols();
    if rows != positions.len() {
        return Err(format!("{rows} rows for {} positions", positions.len()));
    }
    let kind = match r.mode {
        RopeMode::Neox => RopeKind::Neox,
        RopeMode::Interleaved => RopeKind::Interleaved,
    };
    let hd = *want.last().ok_or("rope of a scalar")?;
    let p = RopeParams { head_dim: hd, n_rot: r.n_rot as usize, base: r.base, linear_factor: r.linear_factor, kind };
    let mut d = x.clone().into_f32()?;
    match r.yarn {
        None => ops::rope_rows(&mut d, cols, positions, p),
        Some(_) => ops::rope_rows_with(&mut d, cols, positions, p, &rope_freq(r).expect("a YaRN rope")),
    }
    Ok(Tensor::f32(want.to_vec(), d))
}

/// A YaRN rope's inverse frequencies (None: plain frequencies).
pub fn rope_freq(r: &Rope) -> Option<Vec<f32>> {
    r.yarn.map(|y| ops::yarn_inv_freq(r.base, r.n_rot as usize, y.factor, y.orig_ctx, y.beta_fast, y.beta_slow))
}

/// `S = a_t * S + b_t` along the rows of `a`, `b` (each row `s.len()`
/// entries): every `S_t`, `s` left at the last.
pub fn scan_rows(s: &mut [f32], a: &[f32], b: &[f32]) -> Vec<f32> {
    let w = s.len().max(1);
    let mut out = Vec::with_capacity(a.len());
    for (ra, rb) in a.chunks(w).zip(b.chunks(w)) {
        for ((s, &x), &y) in s.iter_mut().zip(ra).zip(rb) {
            *s = x * *s + y;
        }
        out.extend_from_slice(s);
    }
    out
}

/// One sequence's rows through a depthwise causal conv ([`Op::ShortConv`]):
/// `x` `[n, c]`, `w` `[c, k]` (each channel's taps, oldest first), `window`
/// `[k - 1, c]` the inputs before the run (oldest first), updated to the
/// last `k - 1` inputs. Each output sums its taps in order from the oldest.
pub fn short_conv_rows(window: &mut [f32], w: &[f32], x: &[f32], k: usize, c: usize) -> Vec<f32> {
    let n = x.len() / c.max(1);
    let m = k - 1;
    // Row r of the inputs, counting the window's rows as r < 0.
    let at = |win: &[f32], r: isize, ch: usize| if r < 0 { win[(m as isize + r) as usize * c + ch] } else { x[r as usize * c + ch] };
    let mut y = vec![0f32; n * c];
    for t in 0..n {
        for ch in 0..c {
            let mut acc = 0f32;
            for j in 0..k {
                acc += w[ch * k + j] * at(window, t as isize - m as isize + j as isize, ch);
            }
            y[t * c + ch] = acc;
        }
    }
    // Ascending rows read the old window ahead of where they write.
    for r in 0..m {
        let src = n as isize - m as isize + r as isize;
        for ch in 0..c {
            window[r * c + ch] = at(window, src, ch);
        }
    }
    y
}

/// Head counts and sizes of a [`Op::DeltaNet`].
#[derive(Clone, Copy, Debug)]
pub struct DeltaDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// One sequence's rows through the gated delta rule ([`Op::DeltaNet`]) on
/// its state `s` `[hv, dk, dv]`; the outputs `[n, hv, dv]`. One token runs the
/// recurrent form ([`delta_net_head`]), more the chunked one
/// ([`delta_net_head_chunked`]): the same maths in another order, so a prefill
/// and token-by-token decode agree to rounding, not bit for bit. The v heads
/// are independent, so they run on `pool` when one is given (the same bits
/// either way).
#[allow(clippy::too_many_arguments)]
pub fn delta_net_rows(s: &mut [f32], d: DeltaDims, scale: f32, q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], pool: Option<&rayon::ThreadPool>) -> Vec<f32> {
    use rayon::prelude::*;
    let DeltaDims { hv, dk, dv, .. } = d;
    let n = g.len() / hv.max(1);
    // A run of one token (decode) takes the recurrent form; a longer run the
    // chunked one, the same rule as the CUDA launcher's.
    let run = |(j, sj): (usize, &mut [f32])| match n {
        1 => delta_net_head(sj, j, d, scale, q, k, v, g, beta),
        _ => delta_net_head_chunked(sj, j, d, scale, q, k, v, g, beta),
    };
    let heads: Vec<Vec<f32>> = match pool {
        Some(p) if hv > 1 => p.install(|| s.par_chunks_mut(dk * dv).enumerate().map(run).collect()),
        _ => s.chunks_mut(dk * dv).enumerate().map(run).collect(),
    };
    let mut out = vec![0f32; n * hv * dv];
    for (j, o) in heads.iter().enumerate() {
        for t in 0..n {
            out[(t * hv + j) * dv..][..dv].copy_from_slice(&o[t * dv..][..dv]);
        }
    }
    out
}

/// V head `j` of [`delta_net_rows`] over every token on its state `sj`
/// `[dk, dv]`; its outputs `[n, dv]`. Per token and value column, in this
/// order (the CUDA kernel's): decay the column and read `kᵀS` as it goes,
/// then `δ = (v − kᵀS)·β`, then add `k·δ` and read `(scale·q)ᵀS` as it goes;
/// every sum starts at 0 and runs over the key dim in order.
#[allow(clippy::too_many_arguments)]
pub fn delta_net_head(sj: &mut [f32], j: usize, d: DeltaDims, scale: f32, q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32]) -> Vec<f32> {
    let DeltaDims { hk, hv, dk, dv } = d;
    let n = g.len() / hv.max(1);
    let kh = j % hk;
    let mut out = vec![0f32; n * dv];
    let (mut qs, mut kv) = (vec![0f32; dk], vec![0f32; dv]);
    for t in 0..n {
        let kt = &k[(t * hk + kh) * dk..][..dk];
        for (o, &x) in qs.iter_mut().zip(&q[(t * hk + kh) * dk..][..dk]) {
            *o = x * scale;
        }
        let decay = math::exp(g[t * hv + j]);
        let b = beta[t * hv + j];
        // Row-wise over the state, one accumulator a column: each column's
        // sums still run over the key dim in order.
        kv.iter_mut().for_each(|x| *x = 0.0);
        for (row, &ki) in sj.chunks_exact_mut(dv).zip(kt) {
            for (e, acc) in row.iter_mut().zip(kv.iter_mut()) {
                *e *= decay;
                *acc += ki * *e;
            }
        }
        for (c, x) in kv.iter_mut().enumerate() {
            *x = (v[(t * hv + j) * dv + c] - *x) * b;
        }
        let o = &mut out[t * dv..][..dv];
        for ((row, &ki), &qi) in sj.chunks_exact_mut(dv).zip(kt).zip(&qs) {
            for ((e, &delta), acc) in row.iter_mut().zip(kv.iter()).zip(o.iter_mut()) {
                *e += ki * delta;
                *acc += qi * *e;
            }
        }
    }
    out
}

/// V head `j` of [`delta_net_rows`] in the chunked (parallel) form: the run
/// in chunks of [`DELTA_NET_CHUNK`] tokens from its first, each chunk solved
/// from the state at its start. With `G` the cumulative log decay in the
/// chunk, `A[t][s] = β_t·e^(G_t−G_s)·k_t·k_s` (s < t) and
/// `P[t][s] = e^(G_t−G_s)·(scale·q_t)·k_s` (s ≤ t), per value column:
/// `u_t = β_t(v_t − e^(G_t)·k_tᵀS)`, `δ_t = u_t − Σ_{s<t} A[t][s]·δ_s` (forward
/// substitution), `o_t = e^(G_t)·(scale·q_t)ᵀS + Σ_{s≤t} P[t][s]·δ_s`, and
/// `S ← e^(G_last)·S + Σ_s (e^(G_last−G_s)·k_s)·δ_sᵀ`. Every sum starts at 0
/// (or at its first term as written) and runs in index order, as the CUDA
/// kernel `prim_delta_net_chunked` does, so both give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn delta_net_head_chunked(sj: &mut [f32], j: usize, d: DeltaDims, scale: f32, q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32]) -> Vec<f32> {
    let DeltaDims { hk, hv, dk, dv } = d;
    let n = g.len() / hv.max(1);
    let kh = j % hk;
    let c = DELTA_NET_CHUNK;
    let mut out = vec![0f32; n * dv];
    let (mut qs, mut a, mut p) = (vec![0f32; c * dk], vec![0f32; c * c], vec![0f32; c * c]);
    let (mut gc, mut eg, mut el) = (vec![0f32; c], vec![0f32; c], vec![0f32; c]);
    let (mut delta, mut r) = (vec![0f32; c * dv], vec![0f32; dv]);
    for t0 in (0..n).step_by(c) {
        let l = c.min(n - t0);
        let key = |t: usize| &k[((t0 + t) * hk + kh) * dk..][..dk];
        let bt = |t: usize| beta[(t0 + t) * hv + j];
        for t in 0..l {
            for (o, &x) in qs[t * dk..][..dk].iter_mut().zip(&q[((t0 + t) * hk + kh) * dk..][..dk]) {
                *o = x * scale;
            }
        }
        let mut acc = 0f32;
        for t in 0..l {
            acc += g[(t0 + t) * hv + j];
            gc[t] = acc;
        }
        for t in 0..l {
            eg[t] = math::exp(gc[t]);
            el[t] = math::exp(gc[l - 1] - gc[t]);
        }
        for t in 0..l {
            let (kt, qt) = (key(t), &qs[t * dk..][..dk]);
            for s in 0..=t {
                let ks = key(s);
                let (mut kk, mut qk) = (0f32, 0f32);
                for i in 0..dk {
                    kk += kt[i] * ks[i];
                    qk += qt[i] * ks[i];
                }
                let dec = math::exp(gc[t] - gc[s]);
                a[t * c + s] = if s < t { kk * dec * bt(t) } else { 0.0 };
                p[t * c + s] = qk * dec;
            }
        }
        // u and the part of the output the chunk's starting state gives;
        // row-wise over the state, one accumulator a column.
        for t in 0..l {
            let (kt, qt) = (key(t), &qs[t * dk..][..dk]);
            let w = &mut delta[t * dv..][..dv];
            w.iter_mut().for_each(|x| *x = 0.0);
            r.iter_mut().for_each(|x| *x = 0.0);
            for ((row, &ki), &qi) in sj.chunks_exact(dv).zip(kt).zip(qt) {
                for ((&e, wc), rc) in row.iter().zip(w.iter_mut()).zip(r.iter_mut()) {
                    *wc += ki * e;
                    *rc += qi * e;
                }
            }
            let vt = &v[((t0 + t) * hv + j) * dv..][..dv];
            for (wc, &vc) in w.iter_mut().zip(vt) {
                *wc = (vc - eg[t] * *wc) * bt(t);
            }
            for (o, &rc) in out[(t0 + t) * dv..][..dv].iter_mut().zip(r.iter()) {
                *o = eg[t] * rc;
            }
        }
        for t in 1..l {
            let (done, rest) = delta.split_at_mut(t * dv);
            let dt = &mut rest[..dv];
            for s in 0..t {
                let ats = a[t * c + s];
                for (x, &y) in dt.iter_mut().zip(&done[s * dv..][..dv]) {
                    *x -= ats * y;
                }
            }
        }
        for t in 0..l {
            let o = &mut out[(t0 + t) * dv..][..dv];
            for s in 0..=t {
                let pts = p[t * c + s];
                for (x, &y) in o.iter_mut().zip(&delta[s * dv..][..dv]) {
                    *x += pts * y;
                }
            }
        }
        for (i, row) in sj.chunks_exact_mut(dv).enumerate() {
            row.iter_mut().for_each(|e| *e *= eg[l - 1]);
            for s in 0..l {
                let ke = key(s)[i] * el[s];
                for (e, &y) in row.iter_mut().zip(&delta[s * dv..][..dv]) {
                    *e += ke * y;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(dims: &[usize], v: &[f32]) -> Tensor {
        Tensor::f32(dims.to_vec(), v.to_vec())
    }

    #[test]
    fn broadcasting_binary_ops_match_numpy() {
        let a = t(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let b = t(&[3], &[10.0, 20.0, 30.0]);
        let y = binary(&a, &b, &[2, 3], binary_fn(Binary::Add)).unwrap();
        assert_eq!(y.f().unwrap(), &[11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
        let c = t(&[2, 1], &[2.0, 4.0]);
        let y = binary(&a, &c, &[2, 3], binary_fn(Binary::Div)).unwrap();
        assert_eq!(y.f().unwrap(), &[0.5, 1.0, 1.5, 1.0, 1.25, 1.5]);
    }

    #[test]
    fn axis_ops_run_along_the_right_axis() {
        let a = t(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(reduce(&a, Reduce::Sum, 0).unwrap().f().unwrap(), &[5.0, 7.0, 9.0]);
        assert_eq!(reduce(&a, Reduce::Max, 1).unwrap().f().unwrap(), &[3.0, 6.0]);
        assert_eq!(reduce(&a, Reduce::Mean, 1).unwrap().f().unwrap(), &[2.0, 5.0]);
        assert_eq!(cumsum(a.clone(), 0).unwrap().f().unwrap(), &[1.0, 2.0, 3.0, 5.0, 7.0, 9.0]);
        assert_eq!(cumsum(a.clone(), 1).unwrap().f().unwrap(), &[1.0, 3.0, 6.0, 4.0, 9.0, 15.0]);
        let s = softmax(a.clone(), 0).unwrap();
        let s = s.f().unwrap();
        assert!((s[0] + s[3] - 1.0).abs() < 1e-6 && s[3] > s[0]);
    }

    #[test]
    fn index_ops_pick_the_right_entries_and_refuse_bad_ids() {
        let a = t(&[2, 3], &[0.1, 0.7, 0.2, 0.9, 0.05, 0.05]);
        let ids = top_k(&a, 2).unwrap();
        assert_eq!(ids.ids().unwrap(), &[1, 2, 0, 1]);
        assert_eq!(take_along(&a, &ids).unwrap().f().unwrap(), &[0.7, 0.2, 0.9, 0.05]);
        let rows = gather(&a, &Tensor::i32(vec![3], vec![1, 1, 0])).unwrap();
        assert_eq!(rows.dims, vec![3, 3]);
        assert_eq!(&rows.f().unwrap()[..3], &[0.9, 0.05, 0.05]);
        assert!(gather(&a, &Tensor::i32(vec![1], vec![2])).is_err());
        assert!(take_along(&a, &Tensor::i32(vec![2, 1], vec![3, 0])).is_err());
    }

    #[test]
    fn block_select_keeps_the_local_and_best_blocks() {
        // One query at position 9, 11 keys in blocks of 3 (the last one short):
        // blocks 0..3 score 5, 1, 7 (a -inf key does not count), block 3 is the
        // query's own (local) and in the future beyond key 9.
        let ninf = f32::NEG_INFINITY;
        let s = t(&[1, 11], &[5.0, 0.0, 0.0, 1.0, ninf, 0.5, 7.0, 2.0, 2.0, 0.1, ninf]);
        let m = block_select(&s, 3, 2, 1, &[9]).unwrap();
        let kept: Vec<bool> = m.f().unwrap().iter().map(|&v| v == 0.0).collect();
        // Local block 3 (keys 9, 10) and the best other one, block 2 (keys 6..9).
        assert_eq!(kept, [false, false, false, false, false, false, true, true, true, true, true]);
        // Ties go to the lower block; a -inf block is never chosen, even with room.
        let s = t(&[1, 6], &[1.0, 1.0, 1.0, 1.0, ninf, ninf]);
        let m = block_select(&s, 2, 3, 0, &[1]).unwrap();
        assert_eq!(m.f().unwrap(), &[0.0, 0.0, 0.0, 0.0, ninf, ninf]);
        let m = block_select(&s, 2, 1, 0, &[1]).unwrap();
        assert_eq!(m.f().unwrap(), &[0.0, 0.0, ninf, ninf, ninf, ninf]);
        assert!(block_select(&s, 2, 1, 0, &[1, 2]).is_err(), "two queries for one row of scores");
    }

    #[test]
    fn layout_ops_move_elements_like_numpy() {
        let a = t(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let p = permute(&a, &[1, 0]).unwrap();
        assert_eq!((p.dims.clone(), p.f().unwrap().to_vec()), (vec![3, 2], vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]));
        let c = concat(&[&a, &t(&[2, 1], &[7.0, 8.0])], 1).unwrap();
        assert_eq!(c.f().unwrap(), &[1.0, 2.0, 3.0, 7.0, 4.0, 5.0, 6.0, 8.0]);
        let s = slice(&c, 1, 1, 2).unwrap();
        assert_eq!(s.f().unwrap(), &[2.0, 3.0, 5.0, 6.0]);
        let m = matmul(&a, &t(&[3, 1], &[1.0, 0.0, -1.0]), &[2, 1]).unwrap();
        assert_eq!(m.f().unwrap(), &[-2.0, -2.0]);
        // Batched over a broadcast axis: [2, 1, 3] x [3, 2].
        let m = matmul(&a.reshaped(vec![2, 1, 3]).unwrap(), &t(&[3, 2], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), &[2, 1, 2]).unwrap();
        assert_eq!(m.f().unwrap(), &[4.0, 5.0, 10.0, 11.0]);
    }

    #[test]
    fn ngram_hash_resets_at_eos_and_at_the_start() {
        // n = 3, one head per order; eos = 9.
        let h = NgramHash { n: 3, heads: 1, eos: 9, mult: &[1, 10, 100], offsets: &[0, 1000], vocab: &[1000, 100000] };
        let hist = [1.0, 2.0, 9.0, 3.0, 4.0];
        let out = ngram_hash(&hist, &h, &[0, 1, 2, 3, 4]).unwrap();
        let row = |s0: i64, s1: i64, s2: i64| [(s0 ^ (s1 * 10)).rem_euclid(1000) as i32, (1000 + (s0 ^ (s1 * 10) ^ (s2 * 100)).rem_euclid(100000)) as i32];
        let want: Vec<i32> = [row(1, 9, 9), row(2, 1, 9), row(9, 2, 1), row(3, 9, 9), row(4, 3, 9)].concat();
        assert_eq!(out, want);
        assert!(ngram_hash(&hist, &h, &[5]).is_err(), "a position past the history");
    }

    #[test]
    fn conv_rows_reads_dilated_taps_and_zero_before_the_start() {
        // Two channels, 3 taps, dilation 2: y_p = w0 x_{p-4} + w1 x_{p-2} + w2 x_p.
        let cache: Vec<f32> = (0..12).map(|v| v as f32).collect(); // 6 rows of 2
        let taps = [1.0, 10.0, 100.0, 2.0, 20.0, 200.0];
        let y = conv_rows(&cache, &taps, 2, 2, &[1, 5]).unwrap();
        assert_eq!(y, vec![100.0 * 2.0, 200.0 * 3.0, 2.0 + 10.0 * 6.0 + 100.0 * 10.0, 2.0 * 3.0 + 20.0 * 7.0 + 200.0 * 11.0]);
    }

    #[test]
    fn pooled_select_keeps_the_best_complete_blocks_and_the_open_tail() {
        // One head of dim 2 (all of it rotated, angle = the block's first position), blocks of 2.
        let keys = vec![-1.0, 0.0, -1.0, 0.0, 1.0, 0.0, 1.0, 0.0, -1.0, 0.0, -1.0, 0.0, 5.0, 5.0];
        let q = Tensor::f32(vec![2, 1, 2], vec![1.0, 0.0, 1.0, 0.0]);
        let rope = Rope::new(2, 1e4, RopeMode::Neox);
        let s = PooledSelect { block: 2, top_k: 1, eps: 1e-6, scale: 1.0, rope: &rope };
        let m = pooled_select(&q, &keys, &[1.0, 1.0], &s, 7, &[1, 6]).unwrap();
        let inf = f32::NEG_INFINITY;
        // Position 1: one complete block (its own), chosen. Position 6: blocks 0..3 score
        // relu(q · k): block 0 (-√2, 0) unrotated is 0, block 1 (√2, 0) rotated by 2 rad is
        // 0 (cos 2 < 0), block 2 (-√2, 0) rotated by 4 rad is √2·0.654: chosen, plus the tail [6].
        assert_eq!(&m[..7], &[0.0, 0.0, inf, inf, inf, inf, inf]);
        assert_eq!(&m[7..], &[inf, inf, inf, inf, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn short_conv_sums_its_taps_over_the_window_and_keeps_the_last_inputs() {
        // Two channels, three taps; the window holds the two inputs before.
        let w = [1.0, 10.0, 100.0, 2.0, 0.0, -1.0];
        let mut win = vec![1.0, 5.0, 2.0, 6.0];
        let y = short_conv_rows(&mut win, &w, &[3.0, 7.0, 4.0, 8.0], 3, 2);
        // ch 0: 1·1 + 10·2 + 100·3, then 1·2 + 10·3 + 100·4; ch 1: 2·5 − 7, then 2·6 − 8.
        assert_eq!(y, vec![321.0, 3.0, 432.0, 4.0]);
        assert_eq!(win, vec![3.0, 7.0, 4.0, 8.0]);
    }

    #[test]
    fn the_chunked_delta_rule_agrees_with_the_recurrent_one_and_the_conv_runs_as_single_tokens() {
        let mut g = crate::opcheck::Gen::new(7);
        // Three chunks, the last partial, on a non-zero state.
        let (n, d) = (2 * DELTA_NET_CHUNK + 13, DeltaDims { hk: 2, hv: 4, dk: 3, dv: 5 });
        let f = |g: &mut crate::opcheck::Gen, dims: &[usize], lo: f32, hi: f32| g.tensor(dims, lo, hi).f().unwrap().to_vec();
        let (q, k) = (f(&mut g, &[n, 2, 3], -0.6, 0.6), f(&mut g, &[n, 2, 3], -0.6, 0.6));
        let (v, gl, b) = (f(&mut g, &[n, 4, 5], -2.0, 2.0), f(&mut g, &[n, 4], -0.5, 0.0), f(&mut g, &[n, 4], 0.0, 1.0));
        let s0 = f(&mut g, &[4, 3, 5], -1.0, 1.0);
        let mut s_all = s0.clone();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let all = delta_net_rows(&mut s_all, d, 0.5, &q, &k, &v, &gl, &b, Some(&pool));
        let mut s_alone = s0.clone();
        assert_eq!(all, delta_net_rows(&mut s_alone, d, 0.5, &q, &k, &v, &gl, &b, None), "the thread pool changes no bit");
        assert_eq!(s_all, s_alone);
        let mut s_one = s0;
        let mut one = Vec::new();
        for t in 0..n {
            one.extend(delta_net_rows(&mut s_one, d, 0.5, &q[t * 6..][..6], &k[t * 6..][..6], &v[t * 20..][..20], &gl[t * 4..][..4], &b[t * 4..][..4], None));
        }
        let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(diff(&all, &one) < 1e-5 && diff(&s_all, &s_one) < 1e-5, "chunked vs recurrent: out {}, state {}", diff(&all, &one), diff(&s_all, &s_one));
        assert_ne!(all, one, "the two forms sum in different orders: equal bits would mean one form ran twice");
        let (x, w) = (f(&mut g, &[n, 7], -2.0, 2.0), f(&mut g, &[7, 4], -1.0, 1.0));
        let (mut win_all, mut win_one) = (vec![0f32; 3 * 7], vec![0f32; 3 * 7]);
        let all = short_conv_rows(&mut win_all, &w, &x, 4, 7);
        let one: Vec<f32> = (0..n).flat_map(|t| short_conv_rows(&mut win_one, &w, &x[t * 7..][..7], 4, 7)).collect();
        assert_eq!((all, win_all), (one, win_one));
    }
}
