//! The Ops harness: every op the CUDA backend runs on N-D values, on random
//! shapes and inputs, against the CPU reference (in the spirit of
//! llama.cpp's `test-backend-ops`). Each op's tests are registered with
//! `inventory` ([`OpTest`]); `pulsar-host opcheck` runs them all on a GPU.
//!
//! Equality: the primitives compute each element with the CPU's operations
//! in the CPU's order, so most tests demand the CPU's bits (`tol` 0). The
//! functions whose CPU side calls libm (log, softplus, erf GELU) have a
//! stated relative tolerance. A negative control runs the sum with a kernel
//! deliberately summing in the wrong order: it must fail, or the harness
//! cannot see a wrong kernel.
//!
//! Covered elsewhere, against the same CPU twins: `linear` (every weight
//! format, GEMV and GEMM), `embed`, `attention`, `experts` and the fused
//! router in `pulsar-cuda`'s self-test; `weight`, `output_rows` and the
//! tokens are buffer copies the parity runs check end to end.

use pulsar_plugin_api::graph::{Act, Binary, Op, Reduce, Rope, RopeMode, Unary, Yarn};
use pulsar_plugin_api::Wt;
use pulsar_kernels::ops::DELTA_NET_CHUNK;

use crate::cpu::prim::{self, PrimCx, TData, Tensor};

type R<T> = Result<T, String>;

/// One drawn test: an op, its inputs, the step's positions, the output's dims.
#[derive(Clone, Debug)]
pub struct Case {
    pub op: Op,
    pub ins: Vec<Tensor>,
    pub positions: Vec<u32>,
    pub out: Vec<usize>,
    /// Weights the op reads, by `Wt` index (rms_norm's).
    pub weights: Vec<Vec<f32>>,
    /// The state a `scan` (recurrent) or `state_rows` (its cache) starts from.
    pub state: Vec<f32>,
}

/// A registered op test: `make` draws a case. `tol`: the bound on
/// `max |cuda - cpu| / max |cpu|` (0: bit for bit).
pub struct OpTest {
    pub name: &'static str,
    pub tol: f64,
    pub make: fn(&mut Gen) -> Case,
    /// A negative control: run with the deliberately wrong kernel; passes when the comparison fails.
    pub negative: bool,
}

inventory::collect!(OpTest);

/// Every registered test, by name.
pub fn tests() -> Vec<&'static OpTest> {
    let mut t: Vec<&OpTest> = inventory::iter::<OpTest>.into_iter().collect();
    t.sort_by_key(|t| t.name);
    t
}

/// A small deterministic generator (splitmix64).
pub struct Gen(u64);

impl Gen {
    pub fn new(seed: u64) -> Gen {
        Gen(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn int(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    /// Uniform in `[lo, hi)`.
    pub fn float(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    pub fn dims(&mut self, rank: usize, max: usize) -> Vec<usize> {
        (0..rank).map(|_| self.int(1, max)).collect()
    }
    pub fn tensor(&mut self, dims: &[usize], lo: f32, hi: f32) -> Tensor {
        let n = dims.iter().product();
        Tensor::f32(dims.to_vec(), (0..n).map(|_| self.float(lo, hi)).collect())
    }
    /// Values on a coarse grid, so ties happen (top-k's order on them is checked).
    pub fn coarse(&mut self, dims: &[usize]) -> Tensor {
        let n = dims.iter().product();
        Tensor::f32(dims.to_vec(), (0..n).map(|_| self.int(0, 6) as f32 * 0.5 - 1.5).collect())
    }
    pub fn ids(&mut self, dims: &[usize], below: usize) -> Tensor {
        let n = dims.iter().product();
        Tensor::i32(dims.to_vec(), (0..n).map(|_| self.int(0, below - 1) as i32).collect())
    }
}

fn case(op: Op, ins: Vec<Tensor>, out: Vec<usize>) -> Case {
    Case { op, ins, positions: Vec::new(), out, weights: Vec::new(), state: Vec::new() }
}

/// Positions of a step of `n` rows after `past` cached ones.
fn positions(past: usize, n: usize) -> Vec<u32> {
    (past..past + n).map(|p| p as u32).collect()
}

/// The CPU reference of a case.
pub fn cpu(c: &Case) -> R<Tensor> {
    let ins: Vec<&Tensor> = c.ins.iter().collect();
    match c.op {
        Op::Scan { .. } => {
            let mut s = if c.positions.first() == Some(&0) { vec![0f32; c.state.len()] } else { c.state.clone() };
            Ok(Tensor::f32(c.out.clone(), prim::scan_rows(&mut s, ins[0].f()?, ins[1].f()?)))
        }
        Op::ShortConv { .. } => {
            let mut win = if c.positions.first() == Some(&0) { vec![0f32; c.state.len()] } else { c.state.clone() };
            let (w, ch) = (&c.weights[0], c.out[1]);
            Ok(Tensor::f32(c.out.clone(), prim::short_conv_rows(&mut win, w, ins[0].f()?, w.len() / ch, ch)))
        }
        Op::DeltaNet { scale, .. } => {
            let mut s = if c.positions.first() == Some(&0) { vec![0f32; c.state.len()] } else { c.state.clone() };
            let d = prim::DeltaDims { hk: ins[0].dims[1], hv: ins[2].dims[1], dk: ins[0].dims[2], dv: ins[2].dims[2] };
            let f = |i: usize| ins[i].f();
            Ok(Tensor::f32(c.out.clone(), prim::delta_net_rows(&mut s, d, scale, f(0)?, f(1)?, f(2)?, f(3)?, f(4)?, None)))
        }
        Op::StateRows { .. } => {
            let x = ins[0].f()?;
            let w = x.len() / c.positions.len().max(1);
            let mut cache = c.state.clone();
            for (i, &p) in c.positions.iter().enumerate() {
                cache[p as usize * w..(p as usize + 1) * w].copy_from_slice(&x[i * w..(i + 1) * w]);
            }
            cache.truncate(c.out[0] * w);
            Ok(Tensor::f32(c.out.clone(), cache))
        }
        _ => {
            let weight = |w: Wt| c.weights.get(w.0 as usize).cloned().ok_or_else(|| format!("no weight {}", w.0));
            let cx = PrimCx { tokens: &[], positions: &c.positions, weight: &weight };
            prim::eval(&c.op, &ins, &c.out, &cx).ok_or_else(|| format!("{} is not a primitive", c.op.name()))?
        }
    }
}

/// The words of a value (f32 bits or i32).
pub fn words(t: &Tensor) -> Vec<u32> {
    match &t.data {
        TData::F32(d) => d.iter().map(|v| v.to_bits()).collect(),
        TData::I32(d) => d.iter().map(|&v| v as u32).collect(),
    }
}

/// One line of the harness's table.
#[derive(Clone, Debug)]
pub struct Row {
    pub name: &'static str,
    pub shape: String,
    /// Largest |difference| over the largest |reference| (f32), or the
    /// fraction of differing words (ids, and every bit-for-bit test).
    pub err: f64,
    pub tol: f64,
    pub pass: bool,
    pub note: String,
}

/// Compare a backend's words with the CPU's: bit for bit when `tol` is 0 or
/// the value holds ids, else within `tol` of the largest |reference|.
pub fn compare(name: &'static str, c: &Case, cpu: &Tensor, got: &[u32], tol: f64, negative: bool) -> Row {
    let want = words(cpu);
    let shape = format!("{:?} -> {:?}", c.ins.iter().map(|t| t.dims.clone()).collect::<Vec<_>>(), c.out);
    let ids = matches!(cpu.data, TData::I32(_));
    let (err, ok) = if got.len() != want.len() {
        (f64::INFINITY, false)
    } else if tol == 0.0 || ids {
        let diff = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        (diff as f64 / want.len().max(1) as f64, diff == 0)
    } else {
        let scale = want.iter().map(|&w| f32::from_bits(w).abs() as f64).filter(|v| v.is_finite()).fold(1e-30, f64::max);
        let mut worst = 0f64;
        let mut same_specials = true;
        for (&g, &w) in got.iter().zip(&want) {
            let (g, w) = (f32::from_bits(g), f32::from_bits(w));
            if !w.is_finite() || !g.is_finite() {
                same_specials &= g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
                continue;
            }
            worst = worst.max((g as f64 - w as f64).abs());
        }
        (worst / scale, same_specials && worst <= tol * scale)
    };
    let pass = ok != negative;
    let note = match (negative, ok) {
        (true, false) => "negative control: the wrong kernel was caught".to_string(),
        (true, true) => "negative control PASSED: the harness cannot see a wrong order".to_string(),
        _ => String::new(),
    };
    Row { name, shape, err, tol, pass, note }
}

/// The table as Markdown.
pub fn markdown(rows: &[Row]) -> String {
    let mut s = String::from("| op | shape | err | tol | pass | note |\n|---|---|---|---|---|---|\n");
    for r in rows {
        s += &format!("| {} | {} | {:.3e} | {:.0e} | {} | {} |\n", r.name, r.shape, r.err, r.tol, if r.pass { "yes" } else { "**NO**" }, r.note);
    }
    s
}

// ---- the tests, one registration per op (and per variant worth its own row) ----

macro_rules! op_test {
    ($name:literal, $tol:expr, $make:expr) => {
        inventory::submit! { OpTest { name: $name, tol: $tol, make: $make, negative: false } }
    };
}

fn permute_case(g: &mut Gen) -> Case {
    let rank = g.int(2, 4);
    let dims = g.dims(rank, 7);
    let mut perm: Vec<u32> = (0..rank as u32).collect();
    for i in (1..rank).rev() {
        perm.swap(i, g.int(0, i));
    }
    let out = perm.iter().map(|&a| dims[a as usize]).collect();
    case(Op::Permute(perm), vec![g.tensor(&dims, -2.0, 2.0)], out)
}
op_test!("permute", 0.0, permute_case);

fn slice_case(g: &mut Gen) -> Case {
    let rank = g.int(1, 4);
    let dims = g.dims(rank, 8);
    let axis = g.int(0, rank - 1);
    let start = g.int(0, dims[axis] - 1);
    let len = g.int(1, dims[axis] - start);
    let mut out = dims.clone();
    out[axis] = len;
    let a = if g.int(0, 1) == 0 { axis as i64 } else { axis as i64 - rank as i64 };
    case(Op::Slice { axis: a, start: start as u64, len: len as u64 }, vec![g.tensor(&dims, -2.0, 2.0)], out)
}
op_test!("slice", 0.0, slice_case);

fn concat_case(g: &mut Gen) -> Case {
    let rank = g.int(1, 4);
    let dims = g.dims(rank, 6);
    let axis = g.int(0, rank - 1);
    let parts = g.int(2, 3);
    let mut ins = Vec::new();
    let mut out = dims.clone();
    out[axis] = 0;
    for _ in 0..parts {
        let mut d = dims.clone();
        d[axis] = g.int(1, 5);
        out[axis] += d[axis];
        ins.push(g.tensor(&d, -2.0, 2.0));
    }
    case(Op::Concat { axis: axis as i64 }, ins, out)
}
op_test!("concat", 0.0, concat_case);

fn reshape_case(g: &mut Gen) -> Case {
    let dims = g.dims(3, 6);
    let out = vec![dims[0] * dims[1] * dims[2]];
    case(Op::Reshape(vec![]), vec![g.tensor(&dims, -2.0, 2.0)], out)
}
op_test!("reshape (a copy)", 0.0, reshape_case);

/// A unary op on an input range where it is defined.
fn unary(g: &mut Gen, f: Unary, lo: f32, hi: f32) -> Case {
    let rank = g.int(1, 3);
    let dims = g.dims(rank, 40);
    case(Op::Unary(f), vec![g.tensor(&dims, lo, hi)], dims)
}
op_test!("unary neg", 0.0, |g| unary(g, Unary::Neg, -4.0, 4.0));
op_test!("unary exp", 0.0, |g| unary(g, Unary::Exp, -30.0, 30.0));
op_test!("unary log", 0.0, |g| unary(g, Unary::Log, 1e-3, 50.0));
op_test!("unary sqrt", 0.0, |g| unary(g, Unary::Sqrt, 0.0, 50.0));
op_test!("unary rsqrt", 0.0, |g| unary(g, Unary::Rsqrt, 1e-3, 50.0));
op_test!("unary recip", 0.0, |g| unary(g, Unary::Recip, 0.01, 9.0));
op_test!("unary square", 0.0, |g| unary(g, Unary::Square, -9.0, 9.0));
op_test!("unary abs", 0.0, |g| unary(g, Unary::Abs, -9.0, 9.0));
op_test!("unary sigmoid", 0.0, |g| unary(g, Unary::Sigmoid, -20.0, 20.0));
op_test!("unary softplus", 0.0, |g| unary(g, Unary::Softplus, -25.0, 25.0));
op_test!("unary tanh", 0.0, |g| unary(g, Unary::Tanh, -6.0, 6.0));
op_test!("unary relu", 0.0, |g| unary(g, Unary::Relu, -4.0, 4.0));
op_test!("unary silu", 0.0, |g| unary(g, Unary::Silu, -12.0, 12.0));
op_test!("unary gelu (erf)", 2e-7, |g| unary(g, Unary::Gelu, -6.0, 6.0));
op_test!("unary gelu_tanh", 0.0, |g| unary(g, Unary::GeluTanh, -6.0, 6.0));

op_test!("scale", 0.0, |g| {
    let dims = g.dims(2, 30);
    let s = g.float(-3.0, 3.0);
    case(Op::Scale(s), vec![g.tensor(&dims, -4.0, 4.0)], dims)
});
op_test!("clamp", 0.0, |g| {
    let dims = g.dims(2, 30);
    case(Op::Clamp { lo: -1.0, hi: 0.5 }, vec![g.tensor(&dims, -3.0, 3.0)], dims)
});

/// Two shapes that broadcast to a third: axes of one side set to 1, or dropped in front.
fn broadcast_pair(g: &mut Gen) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let rank = g.int(1, 4);
    let out = g.dims(rank, 6);
    let side = |g: &mut Gen| -> Vec<usize> {
        let drop = g.int(0, rank - 1);
        out[drop..].iter().map(|&d| if g.int(0, 2) == 0 { 1 } else { d }).collect()
    };
    let (a, b) = (side(g), side(g));
    // The output is the broadcast of the two (an axis both set to 1 stays 1).
    let r = a.len().max(b.len());
    let pad = |d: &[usize]| -> Vec<usize> { std::iter::repeat_n(1, r - d.len()).chain(d.iter().copied()).collect() };
    let (pa, pb) = (pad(&a), pad(&b));
    let out = pa.iter().zip(&pb).map(|(&x, &y)| x.max(y)).collect();
    (a, b, out)
}
fn binary(g: &mut Gen, f: Binary) -> Case {
    let (a, b, out) = broadcast_pair(g);
    let lo = if f == Binary::Div { 0.25 } else { -3.0 };
    let (ta, tb) = (g.tensor(&a, -3.0, 3.0), g.tensor(&b, lo, 3.0));
    case(Op::Binary(f), vec![ta, tb], out)
}
op_test!("binary add", 0.0, |g| binary(g, Binary::Add));
op_test!("binary sub", 0.0, |g| binary(g, Binary::Sub));
op_test!("binary mul", 0.0, |g| binary(g, Binary::Mul));
op_test!("binary div", 0.0, |g| binary(g, Binary::Div));
op_test!("binary max", 0.0, |g| binary(g, Binary::Max));
op_test!("binary min", 0.0, |g| binary(g, Binary::Min));

/// An op along a random axis of a random shape (the axis kept for reductions).
fn along(g: &mut Gen, make: fn(i64) -> Op, keep: bool) -> Case {
    let rank = g.int(1, 4);
    let dims = g.dims(rank, 9);
    let axis = g.int(0, rank - 1);
    let mut out = dims.clone();
    if keep {
        out[axis] = 1;
    }
    case(make(axis as i64), vec![g.tensor(&dims, -5.0, 5.0)], out)
}
op_test!("softmax", 0.0, |g| along(g, |axis| Op::Softmax { axis }, false));
op_test!("cumsum", 0.0, |g| along(g, |axis| Op::Cumsum { axis }, false));
op_test!("reduce sum", 0.0, |g| along(g, |axis| Op::Reduce { kind: Reduce::Sum, axis }, true));
op_test!("reduce mean", 0.0, |g| along(g, |axis| Op::Reduce { kind: Reduce::Mean, axis }, true));
op_test!("reduce max", 0.0, |g| along(g, |axis| Op::Reduce { kind: Reduce::Max, axis }, true));
fn long_sum(g: &mut Gen) -> Case {
    // Long lanes of mixed magnitudes: summing them backwards rounds differently.
    let dims = vec![g.int(2, 6), g.int(200, 400)];
    let x = g.tensor(&dims, -1.0, 1.0);
    let x = Tensor::f32(dims.clone(), x.f().expect("f32").iter().enumerate().map(|(i, v)| if i % 7 == 0 { v * 1e4 } else { *v }).collect());
    case(Op::Reduce { kind: Reduce::Sum, axis: 1 }, vec![x], vec![dims[0], 1])
}
inventory::submit! { OpTest { name: "reduce sum, wrong order (negative control)", tol: 0.0, make: long_sum, negative: true } }

op_test!("top_k (with ties)", 0.0, |g| {
    let dims = vec![g.int(1, 6), g.int(1, 40)];
    let k = g.int(1, dims[1].min(9));
    let x = if g.int(0, 1) == 0 { g.coarse(&dims) } else { g.tensor(&dims, -1.0, 1.0) };
    case(Op::TopK { k: k as u32 }, vec![x], vec![dims[0], k])
});
op_test!("take_along", 0.0, |g| {
    let (rows, n, k) = (g.int(1, 6), g.int(1, 30), g.int(1, 8));
    let x = g.tensor(&[rows, n], -2.0, 2.0);
    case(Op::TakeAlong, vec![x, g.ids(&[rows, k], n)], vec![rows, k])
});
op_test!("gather", 0.0, |g| {
    let (rows, w, n) = (g.int(1, 12), g.int(1, 9), g.int(1, 10));
    let x = g.tensor(&[rows, w, 2], -2.0, 2.0);
    case(Op::Gather, vec![x, g.ids(&[n], rows)], vec![n, w, 2])
});
op_test!("matmul (batched, broadcast)", 0.0, |g| {
    let (m, k, n) = (g.int(1, 6), g.int(1, 40), g.int(1, 7));
    let rank = g.int(0, 2);
    let batch = g.dims(rank, 4);
    let bb: Vec<usize> = batch.iter().map(|&d| if g.int(0, 1) == 0 { 1 } else { d }).collect();
    let a: Vec<usize> = batch.iter().copied().chain([m, k]).collect();
    let b: Vec<usize> = bb.iter().copied().chain([k, n]).collect();
    let out = batch.iter().copied().chain([m, n]).collect();
    case(Op::Matmul, vec![g.tensor(&a, -1.0, 1.0), g.tensor(&b, -1.0, 1.0)], out)
});
op_test!("mask", 0.0, |g| {
    let (past, n) = (g.int(0, 20), g.int(1, 6));
    let window = if g.int(0, 1) == 0 { 0 } else { g.int(1, 8) as u32 };
    Case { positions: positions(past, n), ..case(Op::Mask { window }, vec![], vec![n, past + n]) }
});
op_test!("positions", 0.0, |g| {
    let (past, n) = (g.int(0, 20), g.int(1, 6));
    Case { positions: positions(past, n), ..case(Op::Positions, vec![], vec![n]) }
});

op_test!("rms_norm (weighted)", 0.0, |g| {
    let (rows, heads, d) = (g.int(1, 5), g.int(1, 4), g.int(1, 300));
    let w = g.tensor(&[d], 0.5, 1.5).f().expect("f32").to_vec();
    Case { weights: vec![w], ..case(Op::RmsNorm { weight: Some(Wt(0)), eps: 1e-6 }, vec![g.tensor(&[rows, heads, d], -3.0, 3.0)], vec![rows, heads, d]) }
});
op_test!("rms_norm", 0.0, |g| {
    let (rows, d) = (g.int(1, 5), g.int(1, 2000));
    case(Op::RmsNorm { weight: None, eps: 1e-5 }, vec![g.tensor(&[rows, d], -3.0, 3.0)], vec![rows, d])
});
fn rope(g: &mut Gen, yarn: bool) -> Case {
    let (n, heads) = (g.int(1, 5), g.int(1, 3));
    let d = 2 * g.int(2, 40);
    let n_rot = 2 * g.int(1, d / 2);
    let mode = if g.int(0, 1) == 0 { RopeMode::Neox } else { RopeMode::Interleaved };
    let y = yarn.then_some(Yarn { factor: 40.0, orig_ctx: 4096.0, beta_fast: 32.0, beta_slow: 1.0 });
    let r = Rope { yarn: y, ..Rope::new(n_rot as u32, 10000.0, mode) };
    let past = g.int(0, 5000);
    Case { positions: positions(past, n), ..case(Op::Rope(r), vec![g.tensor(&[n, heads, d], -2.0, 2.0)], vec![n, heads, d]) }
}
op_test!("rope", 0.0, |g| rope(g, false));
op_test!("rope (YaRN)", 0.0, |g| rope(g, true));
fn glu(g: &mut Gen, a: Act) -> Case {
    let dims = g.dims(2, 50);
    case(Op::Glu(a), vec![g.tensor(&dims, -6.0, 6.0), g.tensor(&dims, -2.0, 2.0)], dims)
}
op_test!("glu silu", 0.0, |g| glu(g, Act::Silu));
op_test!("glu gelu_tanh", 0.0, |g| glu(g, Act::GeluTanh));
// Gate and up both cross swiglu_oai's clamp at 7.
op_test!("glu swiglu_oai", 0.0, |g| {
    let dims = g.dims(2, 50);
    case(Op::Glu(Act::SwigluOai), vec![g.tensor(&dims, -12.0, 12.0), g.tensor(&dims, -12.0, 12.0)], dims)
});
op_test!("block_select", 0.0, |g| {
    // Causally masked scores (future keys -inf), coarse half the time so blocks tie.
    let (heads, past, n) = (g.int(1, 3), g.int(0, 40), g.int(1, 5));
    let c = past + n + g.int(0, 3);
    let dims = [heads, n, c];
    let x = if g.int(0, 1) == 0 { g.coarse(&dims) } else { g.tensor(&dims, -4.0, 4.0) };
    let mut d = x.f().expect("f32").to_vec();
    for (r, row) in d.chunks_mut(c).enumerate() {
        row.iter_mut().skip(past + r % n + 1).for_each(|v| *v = f32::NEG_INFINITY);
    }
    let x = Tensor::f32(dims.to_vec(), d);
    let block = g.int(1, 8) as u32;
    let top_k = g.int(1, 6) as u32;
    let local = g.int(0, top_k as usize) as u32;
    Case { positions: positions(past, n), ..case(Op::BlockSelect { block, top_k, local }, vec![x], dims.to_vec()) }
});

op_test!("to_f32", 0.0, |g| {
    let dims = g.dims(2, 40);
    let n: usize = dims.iter().product();
    // Ids of any size up to 2^24 (exact), and larger ones that round.
    let x = Tensor::i32(dims.clone(), (0..n).map(|_| g.int(0, 1 << 26) as i32 - (1 << 20)).collect());
    case(Op::ToF32, vec![x], dims)
});
op_test!("ngram_hash", 0.0, |g| {
    // A token history with frequent EOS (id 7), steps starting anywhere in it.
    let (n, heads, past) = (g.int(2, 4), g.int(1, 3), g.int(0, 12));
    let t = g.int(1, 5);
    let c = past + t;
    let hist: Vec<f32> = (0..c).map(|_| if g.int(0, 3) == 0 { 7.0 } else { g.int(0, 250_000) as f32 }).collect();
    let mult: Vec<i64> = (0..n).map(|_| 2 * (g.next() % (i64::MAX as u64 / 250_000 / 2)) as i64 + 1).collect();
    let nh = (n - 1) * heads;
    let vocab: Vec<i64> = (0..nh).map(|_| g.int(1, 2_000_000) as i64).collect();
    let offsets: Vec<i64> = vocab.iter().scan(0i64, |o, v| Some(std::mem::replace(o, *o + v))).collect();
    let op = Op::NgramHash { n: n as u32, heads: heads as u32, eos: 7, mult, offsets, vocab };
    Case { positions: positions(past, t), ..case(op, vec![Tensor::f32(vec![c, 1], hist)], vec![t, nh]) }
});
op_test!("conv_rows", 0.0, |g| {
    let (t, w, k, dilation, past) = (g.int(1, 6), g.int(1, 12), g.int(1, 5), g.int(1, 4), g.int(0, 14));
    let c = past + t;
    let cache = g.tensor(&[c, w], -2.0, 2.0);
    let taps = g.tensor(&[w, k], -1.0, 1.0).f().expect("f32").to_vec();
    let op = Op::ConvRows { weight: Wt(0), dilation: dilation as u32 };
    Case { positions: positions(past, t), weights: vec![taps], ..case(op, vec![cache], vec![t, w]) }
});

op_test!("pooled_select", 0.0, |g| {
    // Index heads over cached raw keys; coarse queries half the time, so block scores tie.
    let (t, nh, block, top_k) = (g.int(1, 5), g.int(1, 3), g.int(1, 6), g.int(1, 4));
    let d = 2 * g.int(1, 20);
    let past = g.int(0, 40);
    let c = past + t;
    let q = if g.int(0, 1) == 0 { g.coarse(&[t, nh, d]) } else { g.tensor(&[t, nh, d], -2.0, 2.0) };
    let keys = g.tensor(&[c, d], -2.0, 2.0);
    let w = g.tensor(&[d], 0.5, 1.5).f().expect("f32").to_vec();
    let mode = if g.int(0, 1) == 0 { RopeMode::Neox } else { RopeMode::Interleaved };
    let rope = Rope::new(2 * g.int(1, d / 2) as u32, 10000.0, mode);
    let op = Op::PooledSelect { block: block as u32, top_k: top_k as u32, key_norm: Wt(0), eps: 1e-6, scale: 0.25, rope };
    Case { positions: positions(past, t), weights: vec![w], ..case(op, vec![q, keys], vec![t, c]) }
});
op_test!("scan", 0.0, |g| {
    let (n, s) = (g.int(1, 6), g.dims(2, 5));
    let dims: Vec<usize> = std::iter::once(n).chain(s.iter().copied()).collect();
    let past = if g.int(0, 1) == 0 { 0 } else { g.int(1, 9) };
    let state = g.tensor(&s, -1.0, 1.0).f().expect("f32").to_vec();
    let (a, b) = (g.tensor(&dims, 0.0, 1.0), g.tensor(&dims, -1.0, 1.0));
    Case { positions: positions(past, n), state, ..case(Op::Scan { state: 0 }, vec![a, b], dims) }
});
op_test!("short_conv", 0.0, |g| {
    let (n, ch, k) = (g.int(1, 6), g.int(1, 12), g.int(2, 5));
    let past = if g.int(0, 1) == 0 { 0 } else { g.int(1, 9) };
    let state = g.tensor(&[k - 1, ch], -1.0, 1.0).f().expect("f32").to_vec();
    let w = g.tensor(&[ch, k], -1.0, 1.0).f().expect("f32").to_vec();
    let x = g.tensor(&[n, ch], -2.0, 2.0);
    Case { positions: positions(past, n), state, weights: vec![w], ..case(Op::ShortConv { state: 0, weight: Wt(0) }, vec![x], vec![n, ch]) }
});
op_test!("delta_net", 0.0, |g| {
    // Decode (1 token, the recurrent form), short runs, and runs over several
    // chunks of the chunked form; value dims over one CUDA column group.
    let n = match g.int(0, 2) {
        0 => g.int(1, 5),
        1 => g.int(6, 20),
        _ => g.int(DELTA_NET_CHUNK - 4, 2 * DELTA_NET_CHUNK + 9),
    };
    let (hk, dk) = (g.int(1, 3), g.int(1, 9));
    let dv = if g.int(0, 1) == 0 { g.int(1, 9) } else { g.int(30, 40) };
    let hv = hk * g.int(1, 3);
    let past = if g.int(0, 1) == 0 { 0 } else { g.int(1, 9) };
    let state = g.tensor(&[hv, dk, dv], -1.0, 1.0).f().expect("f32").to_vec();
    // Unit-ish q/k (the family L2-normalises them), log-decays <= 0, beta in (0, 1).
    let (q, k) = (g.tensor(&[n, hk, dk], -0.6, 0.6), g.tensor(&[n, hk, dk], -0.6, 0.6));
    let (v, gl, beta) = (g.tensor(&[n, hv, dv], -2.0, 2.0), g.tensor(&[n, hv], -3.0, 0.0), g.tensor(&[n, hv], 0.0, 1.0));
    let scale = 1.0 / (dk as f32).sqrt();
    Case { positions: positions(past, n), state, ..case(Op::DeltaNet { state: 0, scale }, vec![q, k, v, gl, beta], vec![n, hv, dv]) }
});
op_test!("state_rows", 0.0, |g| {
    let (past, n, w) = (g.int(0, 9), g.int(1, 5), g.int(1, 20));
    let cap = past + n + g.int(0, 4);
    let state = g.tensor(&[cap, w], -1.0, 1.0).f().expect("f32").to_vec();
    Case { positions: positions(past, n), state, ..case(Op::StateRows { state: 0 }, vec![g.tensor(&[n, w], -2.0, 2.0)], vec![past + n, w]) }
});

#[cfg(test)]
mod tests {
    use super::*;

    /// Every op of the vocabulary (as `Op::name` spells it), and whether
    /// this harness or another check covers it. A new op must be added
    /// here, with a test or a reason.
    const VOCABULARY: &[(&str, Option<&str>)] = &[
        ("tokens", Some("a copy of the step's ids (parity runs)")),
        ("positions", None),
        ("weight", Some("the resident f32 copy itself (parity runs)")),
        ("embed", Some("pulsar-cuda self-test: embed rows of every format")),
        ("linear", Some("pulsar-cuda self-test: GEMV / GEMM of every format")),
        ("output_rows", Some("a row copy (parity runs)")),
        ("reshape", None),
        ("permute", None),
        ("concat", None),
        ("slice", None),
        ("unary", None),
        ("scale", None),
        ("clamp", None),
        ("binary", None),
        ("softmax", None),
        ("reduce", None),
        ("top_k", None),
        ("take_along", None),
        ("gather", None),
        ("cumsum", None),
        ("matmul", None),
        ("rms_norm", None),
        ("rope", None),
        ("glu", None),
        ("attention", Some("pulsar-cuda self-test: attention rows (decode, prefill, windows, softcap)")),
        ("experts", Some("pulsar-cuda self-test: moe rows; parity runs on the given-routing path")),
        ("state_rows", None),
        ("mask", None),
        ("scan", None),
        ("block_select", None),
        ("short_conv", None),
        ("delta_net", None),
        ("to_f32", None),
        ("ngram_hash", None),
        ("conv_rows", None),
        ("pooled_select", None),
    ];

    #[test]
    fn every_op_is_tested_here_or_named_as_covered_elsewhere() {
        let mut g = Gen::new(1);
        let names: std::collections::BTreeSet<&str> = tests().iter().map(|t| (t.make)(&mut g).op.name()).collect();
        for (op, elsewhere) in VOCABULARY {
            assert!(names.contains(op) || elsewhere.is_some(), "op {op} has no harness test and no other check");
        }
        for n in &names {
            assert!(VOCABULARY.iter().any(|(op, _)| op == n), "a test of {n}, which the vocabulary list lacks");
        }
    }

    #[test]
    fn every_case_runs_on_the_cpu_with_the_dims_it_declares() {
        for t in tests() {
            for seed in 0..16 {
                let c = (t.make)(&mut Gen::new(seed));
                let y = cpu(&c).unwrap_or_else(|e| panic!("{} seed {seed}: {e}", t.name));
                assert_eq!(y.dims, c.out, "{} seed {seed}", t.name);
                // The CPU against itself passes (the comparison is sane).
                let row = compare(t.name, &c, &y, &words(&y), t.tol, false);
                assert!(row.pass, "{}: {row:?}", t.name);
            }
        }
    }

    #[test]
    fn the_comparison_sees_one_wrong_bit_and_tolerates_within_tol() {
        let c = case(Op::Scale(1.0), vec![Tensor::f32(vec![2], vec![1.0, 2.0])], vec![2]);
        let y = Tensor::f32(vec![2], vec![1.0, 2.0]);
        let off = [1f32.to_bits(), 2f32.to_bits() + 1];
        assert!(!compare("x", &c, &y, &off, 0.0, false).pass);
        assert!(compare("x", &c, &y, &off, 1e-6, false).pass);
        // A negative control passes only when the comparison fails.
        assert!(compare("x", &c, &y, &off, 0.0, true).pass);
        assert!(!compare("x", &c, &y, &words(&y), 0.0, true).pass);
    }

    #[test]
    fn the_negative_control_really_changes_the_sum() {
        // Summed backwards on the CPU, the control's lanes differ from the
        // in-order sum: the GPU kernel's wrong order is visible to the harness.
        let c = long_sum(&mut Gen::new(3));
        let x = c.ins[0].f().unwrap();
        let n = c.ins[0].dims[1];
        let fwd: Vec<f32> = x.chunks(n).map(|l| l.iter().fold(0f32, |s, v| s + v)).collect();
        let bwd: Vec<f32> = x.chunks(n).map(|l| l.iter().rev().fold(0f32, |s, v| s + v)).collect();
        assert_ne!(fwd, bwd);
    }
}
