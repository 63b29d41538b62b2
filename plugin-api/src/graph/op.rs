//! The op vocabulary of a step graph: every op's attributes, how it crosses
//! the boundary (an opcode and two attribute lists, see [`crate::abi::Node`])
//! and its shape rule. Plain Rust, no I/O: the SDK records with it, the host
//! decodes and validates with it, and both agree by construction.
//!
//! Opcodes are stable. A new op is a new opcode; a new optional attribute is
//! appended to an op's lists, and decoding gives it its old meaning when an
//! older plugin leaves it out.

use super::shape::{broadcast, DType, Dim, Shape};
use crate::abi::{StateSpec, Wt, STATE_KV, STATE_RECURRENT, STATE_ROWS};

/// Activation of a gated unit (`glu`, `experts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Act {
    Silu,
    /// GELU with the tanh approximation (gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// Exact (erf) GELU.
    Gelu,
    /// GPT-OSS's clamped SwiGLU (MiniMax M3 too): the gated unit is
    /// `(clamp(up, -7, 7) + 1) · (g · σ(1.702 g))` with `g = min(gate, 7)`.
    /// Its constants are fixed, as llama.cpp fixes them (no GGUF key).
    SwigluOai,
}

/// Elementwise functions of one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Square,
    Abs,
    Sigmoid,
    Softplus,
    Tanh,
    Relu,
    Silu,
    Gelu,
    GeluTanh,
}

/// Elementwise functions of two values (numpy broadcasting).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
}

/// Reductions along one axis (the axis is kept, with size 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduce {
    Sum,
    Mean,
    Max,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeMode {
    /// Rotate pairs (x[i], x[i + n_rot/2]): GPT-NeoX, HF `rotate_half`.
    Neox,
    /// Rotate adjacent pairs (x[2i], x[2i+1]): original llama, GPT-J.
    Interleaved,
}

/// Rotary embedding of `[T, heads, head_dim]` at the host's positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Rotated dimensions per head (the rest pass through).
    pub n_rot: u32,
    pub base: f32,
    /// Linear position scaling: positions are divided by it (1 = none).
    pub linear_factor: f32,
    pub mode: RopeMode,
    /// YaRN frequency blending (None: plain frequencies). Appended to the
    /// float attributes, so a graph without it decodes as before.
    pub yarn: Option<Yarn>,
}

impl Rope {
    /// Plain frequencies, no position scaling (add `linear_factor` / `yarn`
    /// with struct update syntax: `Rope { yarn: Some(y), ..Rope::new(..) }`).
    pub fn new(n_rot: u32, base: f32, mode: RopeMode) -> Rope {
        Rope { n_rot, base, linear_factor: 1.0, mode, yarn: None }
    }
}

/// YaRN (ggml's `rope_yarn` with the magnitude left at 1): pair `i`'s
/// frequency `f` becomes `f / factor · (1 - r) + f · r`, with the ramp
/// `r = 1 - clamp((i - low) / max(0.001, high - low), 0, 1)` between the
/// correction dims of `beta_fast` (low, floored) and `beta_slow` (high,
/// ceiled) for `orig_ctx` trained positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub orig_ctx: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// Causal attention over a KV state: q `[T, H, Dk]`, k `[T, Hkv, Dk]`, v
/// `[T, Hkv, Dv]` (k and v are appended to the state at the step's
/// positions first), giving `[T, H, Dv]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attention {
    /// Index of the KV state in the plan's states.
    pub state: u32,
    /// Multiplier on q·k.
    pub scale: f32,
    /// 0 = full; else each query sees the last `window` positions (itself included).
    pub window: u32,
    /// 0 = none; else scores become `cap * tanh(score / cap)`.
    pub softcap: f32,
}

/// The selected routed experts' gated FFNs, resolved through the expert
/// store: x `[T, E]`, ids `[T, K]` (i32), weights `[T, K]`, giving
/// `Σ_k weights[t,k] · down(act(gate(x)) · up(x))` summed in slot order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Experts {
    pub layer: u32,
    /// `*_exps` weights, ggml dims `[E, ff, n_expert]` (gate, up) and `[ff, E, n_expert]` (down).
    pub gate: Wt,
    pub up: Wt,
    pub down: Wt,
    pub act: Act,
}

/// One op of a step graph, decoded.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// The step's token ids, i32 `[T]`.
    Tokens,
    /// The step's positions, i32 `[T]`.
    Positions,
    /// A resident weight as a value (f32, row-major: ggml dims reversed).
    Weight(Wt),
    /// Rows of an embedding table for i32 ids `[..]`, times `scale`: `[.., E]`.
    Embed { table: Wt, scale: f32 },
    /// `x · Wᵀ` over the last axis, for a weight of any quant format.
    Linear(Wt),
    /// Keep the rows (first axis) whose logits the host wants: `[T, ..]` to `[O, ..]`.
    OutputRows,
    /// Same elements, new dims (symbols keep their order).
    Reshape(Vec<Dim>),
    /// Axes reordered: output axis i is input axis `perm[i]`.
    Permute(Vec<u32>),
    /// Two or more values joined along an axis.
    Concat { axis: i64 },
    /// `len` entries from `start` along a fixed-size axis.
    Slice { axis: i64, start: u64, len: u64 },
    Unary(Unary),
    /// `x * s`.
    Scale(f32),
    /// `min(max(x, lo), hi)`.
    Clamp { lo: f32, hi: f32 },
    Binary(Binary),
    Softmax { axis: i64 },
    Reduce { kind: Reduce, axis: i64 },
    /// Indices of the `k` largest entries along the last axis, largest first
    /// (ties: the lower index first), i32.
    TopK { k: u32 },
    /// `x[..., ids[..., j]]` along the last axis (numpy `take_along_axis`).
    TakeAlong,
    /// Rows of `x` (first axis) by i32 ids `[..]`: `[.., x's other dims]`.
    Gather,
    Cumsum { axis: i64 },
    /// `[.., m, k] · [.., k, n]`, batch dims broadcast.
    Matmul,
    /// RMS norm over the last axis, times the weight if given.
    RmsNorm { weight: Option<Wt>, eps: f32 },
    Rope(Rope),
    /// `act(gate) * up`.
    Glu(Act),
    Attention(Attention),
    Experts(Experts),
    /// Block-sparse key selection (MiniMax M3's indexer), from per-key scores
    /// `[.., T, C]` (-inf where masked): keys in blocks of `block` (the last
    /// one may be short), a block scored by its best key; per row, the
    /// query's own block and the `local - 1` before it (at the step's
    /// positions) always taken, then the best blocks up to `top_k` in all
    /// (ties: the lower block), never a block whose score is -inf. Gives the
    /// additive mask `[.., T, C]`: 0 on the chosen blocks' keys, -inf elsewhere.
    BlockSelect { block: u32, top_k: u32, local: u32 },
    /// Append the step's rows `[T, W]` to a rows state (at the step's
    /// positions) and read the whole cache back: `[C, W]`.
    StateRows { state: u32 },
    /// The causal mask of the step's queries over the cache, `[T, C]`: 0
    /// where a query may see a key (at or before it, and within `window`
    /// when it is not 0), -inf elsewhere.
    Mask { window: u32 },
    /// A linear recurrence over the step's rows on a recurrent state `S`:
    /// `S_t = a_t * S_{t-1} + b_t` elementwise, with `a`, `b` `[T, ..S]`;
    /// gives every `S_t` (`[T, ..S]`) and keeps the last.
    Scan { state: u32 },
    /// A depthwise causal convolution over the step's rows `[T, C]` with
    /// `weight` (ggml dims `[K, C]`: channel c's K taps, oldest first), on a
    /// recurrent state `[K - 1, C]` holding the inputs before the step (zero
    /// at position 0): `y_t[c] = Σ_j w[c, j] · x_{t-K+1+j}[c]`. Keeps the
    /// last K - 1 inputs. The gated delta net's short conv.
    ShortConv { state: u32, weight: Wt },
    /// The gated delta rule (Qwen3-Next / Qwen3.5 linear attention) on a
    /// recurrent state `S` `[Hv, Dk, Dv]`, from q, k `[T, Hk, Dk]`, v
    /// `[T, Hv, Dv]`, g (log decay) and beta `[T, Hv]`; v head j reads k
    /// head `j mod Hk`. Per token and v head: `S ← S·exp(g)`,
    /// `S ← S + k ⊗ β(v − kᵀS)`, `o = (scale·q)ᵀS`. Gives o `[T, Hv, Dv]`.
    DeltaNet { state: u32, scale: f32 },
    /// i32 values as f32 (exact below 2^24): a step's token ids as rows for
    /// a rows state (the history [`Op::NgramHash`] reads).
    ToF32,
    /// Hashed n-gram ids (Qwen4-Exp's per-layer embeddings) from the
    /// sequence's token history `hist` `f32[C, 1]` (a rows state of the
    /// ids, [`Op::ToF32`]): for the step's row at position p, `s_0 = tok[p]`
    /// and, for j ≥ 1, `s_j = tok[p − j]` while no `eos` lies in
    /// `tok[p − j ..= p − 1]` and `p − j ≥ 0`, else `eos` (an EOS, or the
    /// sequence's start, resets the window). For each order `g` in
    /// `2..=n`: `m = ⊕_{j<g} s_j · mult[j]` (i64, wrapping) and, for each
    /// of its `heads` heads h (i = (g − 2)·heads + h),
    /// `rem_euclid(m, vocab[i]) + offsets[i]`. Gives `i32[T, (n − 1)·heads]`.
    NgramHash { n: u32, heads: u32, eos: i64, mult: Vec<i64>, offsets: Vec<i64>, vocab: Vec<i64> },
    /// A depthwise dilated causal conv over a rows cache `f32[C, W]` (a rows
    /// state read back) at the step's positions: for the row at position p,
    /// `y[c] = Σ_k w[c, k] · x[p − (K − 1 − k)·dilation][c]`, taps oldest
    /// first (`weight` ggml `[K, W]`), zero before position 0, summed in tap
    /// order. Gives `f32[T, W]`. Qwen4-Exp's PLE conv.
    ConvRows { weight: Wt, dilation: u32 },
    /// Pooled block selection (Qwen4-Exp's QSA indexer), from index queries
    /// `q` `f32[T, H, D]` (normed and rotated) and the cache of raw index
    /// keys `keys` `f32[C, D]` (one per position). For the row at position
    /// p: the `(p + 1) / block` complete blocks of keys before it, each
    /// mean-pooled (summed in order, divided by `block`), RMS-normed with
    /// `key_norm` (`eps`) and rotated (`rope`) at its first key's position,
    /// scored `scale · Σ_h relu(q_h · k_b)`; the best `top_k` blocks (ties:
    /// the lower block) and the open tail after the last complete block are
    /// chosen. Gives the additive mask `f32[T, C]`: 0 on the chosen keys,
    /// -inf elsewhere (it is causal).
    PooledSelect { block: u32, top_k: u32, key_norm: Wt, eps: f32, scale: f32, rope: Rope },
}

/// Opcodes (stable across versions).
pub mod code {
    pub const TOKENS: u32 = 0;
    pub const POSITIONS: u32 = 1;
    pub const WEIGHT: u32 = 2;
    pub const EMBED: u32 = 3;
    pub const LINEAR: u32 = 4;
    pub const OUTPUT_ROWS: u32 = 5;
    pub const RESHAPE: u32 = 10;
    pub const PERMUTE: u32 = 11;
    pub const CONCAT: u32 = 12;
    pub const SLICE: u32 = 13;
    pub const UNARY: u32 = 20;
    pub const SCALE: u32 = 21;
    pub const CLAMP: u32 = 22;
    pub const BINARY: u32 = 23;
    pub const SOFTMAX: u32 = 24;
    pub const REDUCE: u32 = 25;
    pub const TOP_K: u32 = 26;
    pub const TAKE_ALONG: u32 = 27;
    pub const GATHER: u32 = 28;
    pub const CUMSUM: u32 = 29;
    pub const MATMUL: u32 = 30;
    pub const RMS_NORM: u32 = 40;
    pub const ROPE: u32 = 41;
    pub const GLU: u32 = 42;
    pub const ATTENTION: u32 = 43;
    pub const EXPERTS: u32 = 44;
    pub const STATE_ROWS: u32 = 50;
    pub const MASK: u32 = 51;
    pub const SCAN: u32 = 52;
    pub const BLOCK_SELECT: u32 = 53;
    pub const SHORT_CONV: u32 = 54;
    pub const DELTA_NET: u32 = 55;
    pub const TO_F32: u32 = 56;
    pub const NGRAM_HASH: u32 = 57;
    pub const CONV_ROWS: u32 = 58;
    pub const POOLED_SELECT: u32 = 59;
}

const ACTS: [Act; 4] = [Act::Silu, Act::GeluTanh, Act::Gelu, Act::SwigluOai];
const UNARIES: [Unary; 15] = [
    Unary::Neg,
    Unary::Exp,
    Unary::Log,
    Unary::Sqrt,
    Unary::Rsqrt,
    Unary::Recip,
    Unary::Square,
    Unary::Abs,
    Unary::Sigmoid,
    Unary::Softplus,
    Unary::Tanh,
    Unary::Relu,
    Unary::Silu,
    Unary::Gelu,
    Unary::GeluTanh,
];
const BINARIES: [Binary; 6] = [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div, Binary::Max, Binary::Min];
const REDUCES: [Reduce; 3] = [Reduce::Sum, Reduce::Mean, Reduce::Max];
const ROPE_MODES: [RopeMode; 2] = [RopeMode::Neox, RopeMode::Interleaved];

fn index_of<T: PartialEq>(table: &[T], v: &T) -> i64 {
    table.iter().position(|x| x == v).expect("every variant is in its table") as i64
}

fn from_table<T: Copy>(table: &[T], code: i64, what: &str) -> Result<T, String> {
    usize::try_from(code).ok().and_then(|i| table.get(i).copied()).ok_or_else(|| format!("unknown {what} code {code}"))
}

/// An op's boundary form: opcode, integer and float attributes.
pub struct Encoded {
    pub code: u32,
    pub ints: Vec<i64>,
    pub floats: Vec<f32>,
}

fn wt(v: i64) -> Result<Wt, String> {
    u32::try_from(v).map(Wt).map_err(|_| format!("weight index {v} is out of range"))
}

fn u32_of(v: i64, what: &str) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!("{what} {v} is out of range"))
}

impl Op {
    /// A short name for errors and dumps.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Tokens => "tokens",
            Op::Positions => "positions",
            Op::Weight(_) => "weight",
            Op::Embed { .. } => "embed",
            Op::Linear(_) => "linear",
            Op::OutputRows => "output_rows",
            Op::Reshape(_) => "reshape",
            Op::Permute(_) => "permute",
            Op::Concat { .. } => "concat",
            Op::Slice { .. } => "slice",
            Op::Unary(_) => "unary",
            Op::Scale(_) => "scale",
            Op::Clamp { .. } => "clamp",
            Op::Binary(_) => "binary",
            Op::Softmax { .. } => "softmax",
            Op::Reduce { .. } => "reduce",
            Op::TopK { .. } => "top_k",
            Op::TakeAlong => "take_along",
            Op::Gather => "gather",
            Op::Cumsum { .. } => "cumsum",
            Op::Matmul => "matmul",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Rope(_) => "rope",
            Op::Glu(_) => "glu",
            Op::Attention(_) => "attention",
            Op::Experts(_) => "experts",
            Op::StateRows { .. } => "state_rows",
            Op::Mask { .. } => "mask",
            Op::Scan { .. } => "scan",
            Op::BlockSelect { .. } => "block_select",
            Op::ShortConv { .. } => "short_conv",
            Op::ToF32 => "to_f32",
            Op::NgramHash { .. } => "ngram_hash",
            Op::ConvRows { .. } => "conv_rows",
            Op::PooledSelect { .. } => "pooled_select",
            Op::DeltaNet { .. } => "delta_net",
        }
    }

    pub fn encode(&self) -> Encoded {
        let (code, ints, floats): (u32, Vec<i64>, Vec<f32>) = match self {
            Op::Tokens => (code::TOKENS, vec![], vec![]),
            Op::Positions => (code::POSITIONS, vec![], vec![]),
            Op::Weight(w) => (code::WEIGHT, vec![w.0 as i64], vec![]),
            Op::Embed { table, scale } => (code::EMBED, vec![table.0 as i64], vec![*scale]),
            Op::Linear(w) => (code::LINEAR, vec![w.0 as i64], vec![]),
            Op::OutputRows => (code::OUTPUT_ROWS, vec![], vec![]),
            Op::Reshape(dims) => (code::RESHAPE, dims.iter().map(|d| d.encode()).collect(), vec![]),
            Op::Permute(p) => (code::PERMUTE, p.iter().map(|&a| a as i64).collect(), vec![]),
            Op::Concat { axis } => (code::CONCAT, vec![*axis], vec![]),
            Op::Slice { axis, start, len } => (code::SLICE, vec![*axis, *start as i64, *len as i64], vec![]),
            Op::Unary(u) => (code::UNARY, vec![index_of(&UNARIES, u)], vec![]),
            Op::Scale(s) => (code::SCALE, vec![], vec![*s]),
            Op::Clamp { lo, hi } => (code::CLAMP, vec![], vec![*lo, *hi]),
            Op::Binary(b) => (code::BINARY, vec![index_of(&BINARIES, b)], vec![]),
            Op::Softmax { axis } => (code::SOFTMAX, vec![*axis], vec![]),
            Op::Reduce { kind, axis } => (code::REDUCE, vec![index_of(&REDUCES, kind), *axis], vec![]),
            Op::TopK { k } => (code::TOP_K, vec![*k as i64], vec![]),
            Op::TakeAlong => (code::TAKE_ALONG, vec![], vec![]),
            Op::Gather => (code::GATHER, vec![], vec![]),
            Op::Cumsum { axis } => (code::CUMSUM, vec![*axis], vec![]),
            Op::Matmul => (code::MATMUL, vec![], vec![]),
            Op::RmsNorm { weight, eps } => (code::RMS_NORM, vec![weight.map_or(-1, |w| w.0 as i64)], vec![*eps]),
            Op::Rope(r) => {
                let mut f = vec![r.base, r.linear_factor];
                if let Some(y) = r.yarn {
                    f.extend([y.factor, y.orig_ctx, y.beta_fast, y.beta_slow]);
                }
                (code::ROPE, vec![r.n_rot as i64, index_of(&ROPE_MODES, &r.mode)], f)
            }
            Op::Glu(a) => (code::GLU, vec![index_of(&ACTS, a)], vec![]),
            Op::Attention(a) => (code::ATTENTION, vec![a.state as i64, a.window as i64], vec![a.scale, a.softcap]),
            Op::Experts(e) => (
                code::EXPERTS,
                vec![e.layer as i64, e.gate.0 as i64, e.up.0 as i64, e.down.0 as i64, index_of(&ACTS, &e.act)],
                vec![],
            ),
            Op::StateRows { state } => (code::STATE_ROWS, vec![*state as i64], vec![]),
            Op::Mask { window } => (code::MASK, vec![*window as i64], vec![]),
            Op::Scan { state } => (code::SCAN, vec![*state as i64], vec![]),
            Op::BlockSelect { block, top_k, local } => (code::BLOCK_SELECT, vec![*block as i64, *top_k as i64, *local as i64], vec![]),
            Op::ShortConv { state, weight } => (code::SHORT_CONV, vec![*state as i64, weight.0 as i64], vec![]),
            Op::DeltaNet { state, scale } => (code::DELTA_NET, vec![*state as i64], vec![*scale]),
            Op::ToF32 => (code::TO_F32, vec![], vec![]),
            Op::NgramHash { n, heads, eos, mult, offsets, vocab } => {
                let mut i = vec![*n as i64, *heads as i64, *eos];
                i.extend(mult.iter().chain(offsets).chain(vocab));
                (code::NGRAM_HASH, i, vec![])
            }
            Op::ConvRows { weight, dilation } => (code::CONV_ROWS, vec![weight.0 as i64, *dilation as i64], vec![]),
            Op::PooledSelect { block, top_k, key_norm, eps, scale, rope } => {
                let mut f = vec![*eps, *scale, rope.base, rope.linear_factor];
                if let Some(y) = rope.yarn {
                    f.extend([y.factor, y.orig_ctx, y.beta_fast, y.beta_slow]);
                }
                let i = vec![*block as i64, *top_k as i64, key_norm.0 as i64, rope.n_rot as i64, index_of(&ROPE_MODES, &rope.mode)];
                (code::POOLED_SELECT, i, f)
            }
        };
        Encoded { code, ints, floats }
    }

    /// The op an encoded node stands for; an unknown opcode or missing
    /// attribute is an error naming it.
    pub fn decode(code: u32, ints: &[i64], floats: &[f32]) -> Result<Op, String> {
        let int = |i: usize| ints.get(i).copied().ok_or_else(|| format!("opcode {code}: integer attribute {i} is missing"));
        let float = |i: usize| floats.get(i).copied().ok_or_else(|| format!("opcode {code}: float attribute {i} is missing"));
        Ok(match code {
            code::TOKENS => Op::Tokens,
            code::POSITIONS => Op::Positions,
            code::WEIGHT => Op::Weight(wt(int(0)?)?),
            code::EMBED => Op::Embed { table: wt(int(0)?)?, scale: float(0)? },
            code::LINEAR => Op::Linear(wt(int(0)?)?),
            code::OUTPUT_ROWS => Op::OutputRows,
            code::RESHAPE => Op::Reshape(ints.iter().map(|&d| Dim::decode(d)).collect::<Result<_, _>>()?),
            code::PERMUTE => Op::Permute(ints.iter().map(|&a| u32_of(a, "axis")).collect::<Result<_, _>>()?),
            code::CONCAT => Op::Concat { axis: int(0)? },
            code::SLICE => Op::Slice {
                axis: int(0)?,
                start: u64::try_from(int(1)?).map_err(|_| "slice: negative start".to_string())?,
                len: u64::try_from(int(2)?).map_err(|_| "slice: negative length".to_string())?,
            },
            code::UNARY => Op::Unary(from_table(&UNARIES, int(0)?, "unary")?),
            code::SCALE => Op::Scale(float(0)?),
            code::CLAMP => Op::Clamp { lo: float(0)?, hi: float(1)? },
            code::BINARY => Op::Binary(from_table(&BINARIES, int(0)?, "binary")?),
            code::SOFTMAX => Op::Softmax { axis: int(0)? },
            code::REDUCE => Op::Reduce { kind: from_table(&REDUCES, int(0)?, "reduce")?, axis: int(1)? },
            code::TOP_K => Op::TopK { k: u32_of(int(0)?, "top_k k")? },
            code::TAKE_ALONG => Op::TakeAlong,
            code::GATHER => Op::Gather,
            code::CUMSUM => Op::Cumsum { axis: int(0)? },
            code::MATMUL => Op::Matmul,
            code::RMS_NORM => Op::RmsNorm { weight: if int(0)? < 0 { None } else { Some(wt(int(0)?)?) }, eps: float(0)? },
            code::ROPE => Op::Rope(Rope {
                n_rot: u32_of(int(0)?, "rope n_rot")?,
                mode: from_table(&ROPE_MODES, int(1)?, "rope mode")?,
                base: float(0)?,
                linear_factor: float(1)?,
                yarn: match floats.len() {
                    2 => None,
                    _ => Some(Yarn { factor: float(2)?, orig_ctx: float(3)?, beta_fast: float(4)?, beta_slow: float(5)? }),
                },
            }),
            code::GLU => Op::Glu(from_table(&ACTS, int(0)?, "activation")?),
            code::ATTENTION => Op::Attention(Attention {
                state: u32_of(int(0)?, "attention state")?,
                window: u32_of(int(1)?, "attention window")?,
                scale: float(0)?,
                softcap: float(1)?,
            }),
            code::EXPERTS => Op::Experts(Experts {
                layer: u32_of(int(0)?, "experts layer")?,
                gate: wt(int(1)?)?,
                up: wt(int(2)?)?,
                down: wt(int(3)?)?,
                act: from_table(&ACTS, int(4)?, "activation")?,
            }),
            code::STATE_ROWS => Op::StateRows { state: u32_of(int(0)?, "state")? },
            code::MASK => Op::Mask { window: u32_of(int(0)?, "mask window")? },
            code::SCAN => Op::Scan { state: u32_of(int(0)?, "state")? },
            code::BLOCK_SELECT => Op::BlockSelect {
                block: u32_of(int(0)?, "block_select block")?,
                top_k: u32_of(int(1)?, "block_select top_k")?,
                local: u32_of(int(2)?, "block_select local")?,
            },
            code::SHORT_CONV => Op::ShortConv { state: u32_of(int(0)?, "state")?, weight: wt(int(1)?)? },
            code::DELTA_NET => Op::DeltaNet { state: u32_of(int(0)?, "state")?, scale: float(0)? },
            code::TO_F32 => Op::ToF32,
            code::NGRAM_HASH => {
                let n = u32_of(int(0)?, "ngram_hash n")?;
                let heads = u32_of(int(1)?, "ngram_hash heads")?;
                let nh = (n as usize).saturating_sub(1) * heads as usize;
                if ints.len() != 3 + n as usize + 2 * nh {
                    return Err(format!("ngram_hash: {} integer attributes for n {n} and {heads} heads", ints.len()));
                }
                let (m, rest) = ints[3..].split_at(n as usize);
                let (o, v) = rest.split_at(nh);
                Op::NgramHash { n, heads, eos: int(2)?, mult: m.to_vec(), offsets: o.to_vec(), vocab: v.to_vec() }
            }
            code::CONV_ROWS => Op::ConvRows { weight: wt(int(0)?)?, dilation: u32_of(int(1)?, "conv_rows dilation")? },
            code::POOLED_SELECT => Op::PooledSelect {
                block: u32_of(int(0)?, "pooled_select block")?,
                top_k: u32_of(int(1)?, "pooled_select top_k")?,
                key_norm: wt(int(2)?)?,
                eps: float(0)?,
                scale: float(1)?,
                rope: Rope {
                    n_rot: u32_of(int(3)?, "rope n_rot")?,
                    mode: from_table(&ROPE_MODES, int(4)?, "rope mode")?,
                    base: float(2)?,
                    linear_factor: float(3)?,
                    yarn: match floats.len() {
                        4 => None,
                        _ => Some(Yarn { factor: float(4)?, orig_ctx: float(5)?, beta_fast: float(6)?, beta_slow: float(7)? }),
                    },
                },
            },
            other => return Err(format!("unknown opcode {other} (the plugin needs a newer host)")),
        })
    }

    /// How many inputs the op takes (None: two or more).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Tokens | Op::Positions | Op::Weight(_) | Op::Mask { .. } => 0,
            Op::Concat { .. } => return None,
            Op::Binary(_) | Op::TakeAlong | Op::Gather | Op::Matmul | Op::Glu(_) | Op::Scan { .. } | Op::PooledSelect { .. } => 2,
            Op::Attention(_) | Op::Experts(_) => 3,
            Op::DeltaNet { .. } => 5,
            _ => 1,
        })
    }
}

/// What shape rules need to know of the model: each declared weight's ggml
/// dims and the plan's states.
pub struct ShapeCx<'a> {
    pub weights: &'a [Vec<u64>],
    pub weight_names: &'a [String],
    pub states: &'a [StateSpec],
}

impl ShapeCx<'_> {
    fn dims(&self, w: Wt) -> Result<&[u64], String> {
        self.weights.get(w.0 as usize).map(|d| d.as_slice()).ok_or_else(|| format!("weight {} was not declared", w.0))
    }
    fn state(&self, i: u32, kind: u32, what: &str) -> Result<&StateSpec, String> {
        match self.states.get(i as usize) {
            Some(s) if s.kind == kind => Ok(s),
            Some(_) => Err(format!("state {i} is not a {what}")),
            None => Err(format!("state {i} was not declared")),
        }
    }
    fn name(&self, w: Wt) -> &str {
        self.weight_names.get(w.0 as usize).map_or("?", |s| s.as_str())
    }
    /// A matrix weight's (n_in, n_out).
    fn matrix(&self, w: Wt) -> Result<(u64, u64), String> {
        match self.dims(w)? {
            [i, o] => Ok((*i, *o)),
            d => Err(format!("weight `{}` has dims {d:?}, not a matrix", self.name(w))),
        }
    }
}

fn want_f32(s: &Shape, what: &str) -> Result<(), String> {
    if s.dtype != DType::F32 {
        return Err(format!("{what} must be f32, got {s}"));
    }
    Ok(())
}

fn want_i32(s: &Shape, what: &str) -> Result<(), String> {
    if s.dtype != DType::I32 {
        return Err(format!("{what} must be i32 indices, got {s}"));
    }
    Ok(())
}

/// The last axis must be a fixed size.
fn last_fixed(s: &Shape, what: &str) -> Result<u64, String> {
    s.last().ok_or_else(|| format!("{what}: the last axis of {s} must be a fixed size"))
}

/// The shape of `op` applied to `ins`, or why it does not apply.
pub fn infer(op: &Op, ins: &[&Shape], cx: &ShapeCx<'_>) -> Result<Shape, String> {
    if let Some(n) = op.arity() {
        if ins.len() != n {
            return Err(format!("takes {n} inputs, got {}", ins.len()));
        }
    } else if ins.len() < 2 {
        return Err(format!("takes two or more inputs, got {}", ins.len()));
    }
    match op {
        Op::Tokens | Op::Positions => Ok(Shape::i32(vec![Dim::T])),
        Op::Weight(w) => Ok(Shape::f32(cx.dims(*w)?.iter().rev().map(|&d| Dim::N(d)).collect())),
        Op::Embed { table, .. } => {
            want_i32(ins[0], "embed ids")?;
            let (e, _) = cx.matrix(*table)?;
            let mut d = ins[0].dims.clone();
            d.push(Dim::N(e));
            Ok(Shape::f32(d))
        }
        Op::Linear(w) => {
            want_f32(ins[0], "linear input")?;
            let (n_in, n_out) = cx.matrix(*w)?;
            if ins[0].last() != Some(n_in) {
                return Err(format!("weight `{}` takes width {n_in}, input is {}", cx.name(*w), ins[0]));
            }
            let mut d = ins[0].dims.clone();
            *d.last_mut().expect("rank >= 1") = Dim::N(n_out);
            Ok(Shape { dtype: DType::F32, dims: d })
        }
        Op::OutputRows => {
            if ins[0].dims.first() != Some(&Dim::T) {
                return Err(format!("needs the step's rows first, got {}", ins[0]));
            }
            let mut d = ins[0].dims.clone();
            d[0] = Dim::O;
            Ok(Shape { dtype: ins[0].dtype, dims: d })
        }
        Op::Reshape(dims) => {
            let (na, sa) = ins[0].split();
            let out = Shape { dtype: ins[0].dtype, dims: dims.clone() };
            let (nb, sb) = out.split();
            if na != nb || sa != sb {
                return Err(format!("cannot reshape {} to {out}", ins[0]));
            }
            Ok(out)
        }
        Op::Permute(perm) => {
            let r = ins[0].rank();
            let mut seen = vec![false; r];
            for &a in perm {
                match seen.get_mut(a as usize) {
                    Some(s) if !*s => *s = true,
                    _ => return Err(format!("{perm:?} is not a permutation of {r} axes")),
                }
            }
            if perm.len() != r {
                return Err(format!("{perm:?} is not a permutation of {r} axes"));
            }
            Ok(Shape { dtype: ins[0].dtype, dims: perm.iter().map(|&a| ins[0].dims[a as usize]).collect() })
        }
        Op::Concat { axis } => {
            let a = ins[0].axis(*axis)?;
            let mut total = 0u64;
            for s in ins {
                if s.dtype != ins[0].dtype || s.rank() != ins[0].rank() {
                    return Err(format!("cannot join {s} to {}", ins[0]));
                }
                for (i, (x, y)) in s.dims.iter().zip(&ins[0].dims).enumerate() {
                    if i != a && x != y {
                        return Err(format!("cannot join {s} to {} along axis {a}", ins[0]));
                    }
                }
                total += s.dims[a].fixed().ok_or_else(|| format!("cannot join along the symbolic axis of {s}"))?;
            }
            let mut d = ins[0].dims.clone();
            d[a] = Dim::N(total);
            Ok(Shape { dtype: ins[0].dtype, dims: d })
        }
        Op::Slice { axis, start, len } => {
            let a = ins[0].axis(*axis)?;
            let n = ins[0].dims[a].fixed().ok_or_else(|| format!("cannot slice the symbolic axis of {}", ins[0]))?;
            if start + len > n || *len == 0 {
                return Err(format!("[{start}, {}) is not inside axis {a} of {}", start + len, ins[0]));
            }
            let mut d = ins[0].dims.clone();
            d[a] = Dim::N(*len);
            Ok(Shape { dtype: ins[0].dtype, dims: d })
        }
        Op::Unary(_) | Op::Scale(_) | Op::Clamp { .. } => {
            want_f32(ins[0], "input")?;
            Ok(ins[0].clone())
        }
        Op::Binary(_) => {
            want_f32(ins[0], "left input")?;
            want_f32(ins[1], "right input")?;
            Ok(Shape::f32(broadcast(&ins[0].dims, &ins[1].dims)?))
        }
        Op::Softmax { axis } | Op::Cumsum { axis } => {
            want_f32(ins[0], "input")?;
            ins[0].axis(*axis)?;
            Ok(ins[0].clone())
        }
        Op::Reduce { axis, .. } => {
            want_f32(ins[0], "input")?;
            let a = ins[0].axis(*axis)?;
            let mut d = ins[0].dims.clone();
            d[a] = Dim::N(1);
            Ok(Shape::f32(d))
        }
        Op::TopK { k } => {
            want_f32(ins[0], "input")?;
            let n = last_fixed(ins[0], "top_k")?;
            if *k == 0 || *k as u64 > n {
                return Err(format!("k = {k} of {n} entries"));
            }
            let mut d = ins[0].dims.clone();
            *d.last_mut().expect("rank >= 1") = Dim::N(*k as u64);
            Ok(Shape::i32(d))
        }
        Op::TakeAlong => {
            want_i32(ins[1], "indices")?;
            let (x, ids) = (ins[0], ins[1]);
            if x.rank() != ids.rank() || x.dims[..x.rank() - 1] != ids.dims[..ids.rank() - 1] {
                return Err(format!("indices {ids} do not index {x} along its last axis"));
            }
            last_fixed(x, "take_along")?;
            Ok(Shape { dtype: x.dtype, dims: ids.dims.clone() })
        }
        Op::Gather => {
            want_i32(ins[1], "indices")?;
            if ins[0].rank() < 1 || ins[0].dims[0].fixed().is_none() {
                return Err(format!("gathers rows of a value with a fixed first axis, got {}", ins[0]));
            }
            let mut d = ins[1].dims.clone();
            d.extend_from_slice(&ins[0].dims[1..]);
            Ok(Shape { dtype: ins[0].dtype, dims: d })
        }
        Op::Matmul => {
            want_f32(ins[0], "left input")?;
            want_f32(ins[1], "right input")?;
            let (a, b) = (ins[0], ins[1]);
            if a.rank() < 2 || b.rank() < 2 {
                return Err(format!("needs two matrices (or batches of them), got {a} and {b}"));
            }
            let (m, k) = (a.dims[a.rank() - 2], a.dims[a.rank() - 1]);
            let (k2, n) = (b.dims[b.rank() - 2], b.dims[b.rank() - 1]);
            if k != k2 {
                return Err(format!("inner dimensions of {a} and {b} differ"));
            }
            let mut d = broadcast(&a.dims[..a.rank() - 2], &b.dims[..b.rank() - 2])?;
            d.extend([m, n]);
            Ok(Shape::f32(d))
        }
        Op::RmsNorm { weight, .. } => {
            want_f32(ins[0], "input")?;
            let n = last_fixed(ins[0], "rms_norm")?;
            if let Some(w) = weight {
                if cx.dims(*w)? != [n] {
                    return Err(format!("weight `{}` has dims {:?}, the norm is over {n}", cx.name(*w), cx.dims(*w)?));
                }
            }
            Ok(ins[0].clone())
        }
        Op::Rope(r) => {
            want_f32(ins[0], "input")?;
            let x = ins[0];
            let hd = last_fixed(x, "rope")?;
            if x.rank() != 3 || x.dims[0] != Dim::T {
                return Err(format!("rotates [T, heads, head_dim], got {x}"));
            }
            if r.n_rot as u64 > hd || r.n_rot % 2 != 0 || r.n_rot == 0 {
                return Err(format!("n_rot {} does not fit head_dim {hd}", r.n_rot));
            }
            if let Some(y) = r.yarn {
                let ok = [y.factor, y.orig_ctx, y.beta_fast, y.beta_slow].iter().all(|v| v.is_finite() && *v > 0.0);
                if !ok || r.linear_factor != 1.0 {
                    return Err(format!("YaRN {y:?} needs positive finite attributes and no linear factor"));
                }
            }
            Ok(x.clone())
        }
        Op::Glu(_) => {
            want_f32(ins[0], "gate")?;
            if ins[0] != ins[1] {
                return Err(format!("gate {} and up {} differ", ins[0], ins[1]));
            }
            Ok(ins[0].clone())
        }
        Op::Attention(a) => {
            let (q, k, v) = (ins[0], ins[1], ins[2]);
            for s in [q, k, v] {
                want_f32(s, "q, k and v")?;
                if s.rank() != 3 || s.dims[0] != Dim::T || s.dims[1].fixed().is_none() || s.dims[2].fixed().is_none() {
                    return Err(format!("q, k and v are [T, heads, head_dim], got {s}"));
                }
            }
            let st = cx.states.get(a.state as usize).ok_or_else(|| format!("state {} was not declared", a.state))?;
            if st.kind != STATE_KV || st.dims.len() < 3 {
                return Err(format!("state {} is not a KV cache", a.state));
            }
            let (nkv, dk, dv) = (st.dims[0], st.dims[1], st.dims[2]);
            let n = |s: &Shape, i: usize| s.dims[i].fixed().expect("checked fixed");
            if n(k, 1) != nkv || n(v, 1) != nkv || n(q, 2) != dk || n(k, 2) != dk || n(v, 2) != dv {
                return Err(format!("q {q}, k {k}, v {v} do not fit KV state {} ({nkv} heads, {dk}/{dv})", a.state));
            }
            if nkv == 0 || n(q, 1) % nkv != 0 {
                return Err(format!("{} query heads for {nkv} KV heads", n(q, 1)));
            }
            Ok(Shape::f32(vec![Dim::T, q.dims[1], Dim::N(dv)]))
        }
        Op::Experts(e) => {
            let (x, ids, w) = (ins[0], ins[1], ins[2]);
            want_f32(x, "input")?;
            want_i32(ids, "expert ids")?;
            want_f32(w, "expert weights")?;
            let width = last_fixed(x, "experts")?;
            if x.rank() != 2 || ids.rank() != 2 || ids.dims[0] != x.dims[0] || ids != &Shape::i32(w.dims.clone()) {
                return Err(format!("x {x}, ids {ids} and weights {w} do not match"));
            }
            let gate = cx.dims(e.gate)?;
            let up = cx.dims(e.up)?;
            let down = cx.dims(e.down)?;
            let ok = gate.len() == 3 && gate[0] == width && up == gate && down == [gate[1], width, gate[2]];
            if !ok {
                return Err(format!(
                    "experts `{}` {gate:?}, `{}` {up:?}, `{}` {down:?} do not fit width {width}",
                    cx.name(e.gate),
                    cx.name(e.up),
                    cx.name(e.down)
                ));
            }
            let k = last_fixed(ids, "expert ids")?;
            if k == 0 || k > gate[2] {
                return Err(format!("{k} experts a row of {}", gate[2]));
            }
            Ok(x.clone())
        }
        Op::StateRows { state } => {
            let w = cx.state(*state, STATE_ROWS, "rows state")?.dims[0];
            let want = Shape::f32(vec![Dim::T, Dim::N(w)]);
            if *ins[0] != want {
                return Err(format!("appends {want} rows, got {}", ins[0]));
            }
            Ok(Shape::f32(vec![Dim::C, Dim::N(w)]))
        }
        Op::Mask { .. } => Ok(Shape::f32(vec![Dim::T, Dim::C])),
        Op::BlockSelect { block, top_k, local } => {
            want_f32(ins[0], "block_select scores")?;
            let r = ins[0].rank();
            if r < 2 || ins[0].dims[r - 2] != Dim::T {
                return Err(format!("block_select scores must be [.., T, keys], got {}", ins[0]));
            }
            if *block == 0 || *top_k == 0 || local > top_k {
                return Err(format!("block_select: block {block}, top_k {top_k}, local {local} (need block, top_k >= 1 and local <= top_k)"));
            }
            Ok(ins[0].clone())
        }
        Op::Scan { state } => {
            let st = cx.state(*state, STATE_RECURRENT, "recurrent state")?;
            let mut want = vec![Dim::T];
            want.extend(st.dims.iter().map(|&d| Dim::N(d)));
            let want = Shape::f32(want);
            if *ins[0] != want || *ins[1] != want {
                return Err(format!("a and b must be {want}, got {} and {}", ins[0], ins[1]));
            }
            Ok(want)
        }
        Op::ShortConv { state, weight } => {
            want_f32(ins[0], "short_conv input")?;
            let x = ins[0];
            let c = last_fixed(x, "short_conv")?;
            if x.rank() != 2 || x.dims[0] != Dim::T {
                return Err(format!("short_conv runs over rows [T, channels], got {x}"));
            }
            let k = match cx.dims(*weight)? {
                [k, ch] if *ch == c && *k >= 2 => *k,
                d => return Err(format!("weight `{}` has dims {d:?}, not [kernel >= 2, {c}]", cx.name(*weight))),
            };
            let st = cx.state(*state, STATE_RECURRENT, "recurrent state")?;
            if st.dims.as_slice() != [k - 1, c] {
                return Err(format!("state {state} has dims {:?}, a kernel of {k} over {c} channels keeps [{}, {c}]", st.dims.as_slice(), k - 1));
            }
            Ok(x.clone())
        }
        Op::DeltaNet { state, scale } => {
            let (q, k, v, g, b) = (ins[0], ins[1], ins[2], ins[3], ins[4]);
            for s in [q, k, v, g, b] {
                want_f32(s, "delta_net inputs")?;
                if s.dims.first() != Some(&Dim::T) || s.dims[1..].iter().any(|d| d.fixed().is_none()) {
                    return Err(format!("delta_net inputs run over the step's rows, got {s}"));
                }
            }
            let st = cx.state(*state, STATE_RECURRENT, "recurrent state")?;
            let [hv, dk, dv] = st.dims.as_slice() else {
                return Err(format!("state {state} has dims {:?}, not [v heads, key dim, value dim]", st.dims.as_slice()));
            };
            let (hv, dk, dv) = (*hv, *dk, *dv);
            let hk = q.dims.get(1).and_then(|d| d.fixed()).unwrap_or(0);
            let qk = Shape::f32(vec![Dim::T, Dim::N(hk), Dim::N(dk)]);
            let gb = Shape::f32(vec![Dim::T, Dim::N(hv)]);
            if *q != qk || *k != qk || *v != Shape::f32(vec![Dim::T, Dim::N(hv), Dim::N(dv)]) || *g != gb || *b != gb {
                return Err(format!("q {q}, k {k}, v {v}, g {g}, beta {b} do not fit state {state} ({hv} v heads, {dk}/{dv})"));
            }
            if hk == 0 || hv % hk != 0 {
                return Err(format!("{hv} v heads over {hk} k heads"));
            }
            if !scale.is_finite() {
                return Err(format!("scale {scale} is not finite"));
            }
            Ok(v.clone())
        }
        Op::ToF32 => {
            want_i32(ins[0], "to_f32 input")?;
            Ok(Shape::f32(ins[0].dims.clone()))
        }
        Op::NgramHash { n, heads, mult, offsets, vocab, .. } => {
            if *ins[0] != Shape::f32(vec![Dim::C, Dim::N(1)]) {
                return Err(format!("ngram_hash reads the token history f32[C, 1], got {}", ins[0]));
            }
            let nh = (*n as usize).saturating_sub(1) * *heads as usize;
            if *n < 2 || *heads == 0 || mult.len() != *n as usize || offsets.len() != nh || vocab.len() != nh {
                return Err(format!("ngram_hash: n {n}, {heads} heads, {} multipliers, {} offsets, {} vocab sizes", mult.len(), offsets.len(), vocab.len()));
            }
            if vocab.iter().any(|&v| v <= 0) || offsets.iter().any(|&o| o < 0) || offsets.iter().zip(vocab).any(|(o, v)| o + v > i32::MAX as i64) {
                return Err(format!("ngram_hash: vocab sizes {vocab:?} and offsets {offsets:?} must be positive and fit i32"));
            }
            Ok(Shape::i32(vec![Dim::T, Dim::N(nh as u64)]))
        }
        Op::ConvRows { weight, dilation } => {
            let x = ins[0];
            want_f32(x, "conv_rows input")?;
            let w = last_fixed(x, "conv_rows")?;
            if x.rank() != 2 || x.dims[0] != Dim::C {
                return Err(format!("conv_rows reads a rows cache [C, width], got {x}"));
            }
            match cx.dims(*weight)? {
                [k, ch] if *ch == w && *k >= 1 => {}
                d => return Err(format!("weight `{}` has dims {d:?}, not [kernel, {w}]", cx.name(*weight))),
            }
            if *dilation == 0 {
                return Err("conv_rows: dilation 0".into());
            }
            Ok(Shape::f32(vec![Dim::T, Dim::N(w)]))
        }
        Op::PooledSelect { block, top_k, key_norm, rope, .. } => {
            let (q, k) = (ins[0], ins[1]);
            want_f32(q, "pooled_select queries")?;
            want_f32(k, "pooled_select keys")?;
            let d = last_fixed(q, "pooled_select")?;
            if q.rank() != 3 || q.dims[0] != Dim::T || q.dims[1].fixed().is_none() {
                return Err(format!("pooled_select queries must be [T, heads, dim], got {q}"));
            }
            if *k != Shape::f32(vec![Dim::C, Dim::N(d)]) {
                return Err(format!("pooled_select keys must be the cache f32[C, {d}], got {k}"));
            }
            if cx.dims(*key_norm)? != [d] {
                return Err(format!("weight `{}` has dims {:?}, not [{d}]", cx.name(*key_norm), cx.dims(*key_norm)?));
            }
            if *block == 0 || *top_k == 0 || rope.n_rot == 0 || rope.n_rot as u64 > d || rope.n_rot % 2 != 0 {
                return Err(format!("pooled_select: block {block}, top_k {top_k}, rope n_rot {} over dim {d}", rope.n_rot));
            }
            Ok(Shape::f32(vec![Dim::T, Dim::C]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_op() -> Vec<Op> {
        vec![
            Op::Tokens,
            Op::Positions,
            Op::Weight(Wt(3)),
            Op::Embed { table: Wt(0), scale: 2.5 },
            Op::Linear(Wt(7)),
            Op::OutputRows,
            Op::Reshape(vec![Dim::T, Dim::N(4), Dim::N(8)]),
            Op::Permute(vec![1, 0, 2]),
            Op::Concat { axis: -1 },
            Op::Slice { axis: 2, start: 3, len: 5 },
            Op::Unary(Unary::Softplus),
            Op::Scale(0.125),
            Op::Clamp { lo: -7.0, hi: 7.0 },
            Op::Binary(Binary::Div),
            Op::Softmax { axis: -1 },
            Op::Reduce { kind: Reduce::Mean, axis: 1 },
            Op::TopK { k: 8 },
            Op::TakeAlong,
            Op::Gather,
            Op::Cumsum { axis: 0 },
            Op::Matmul,
            Op::RmsNorm { weight: None, eps: 1e-6 },
            Op::RmsNorm { weight: Some(Wt(2)), eps: 1e-5 },
            Op::Rope(Rope { n_rot: 64, base: 1e6, linear_factor: 8.0, mode: RopeMode::Interleaved, yarn: None }),
            Op::Rope(Rope {
                n_rot: 16,
                base: 1e4,
                linear_factor: 1.0,
                mode: RopeMode::Interleaved,
                yarn: Some(Yarn { factor: 40.0, orig_ctx: 4096.0, beta_fast: 32.0, beta_slow: 1.0 }),
            }),
            Op::Glu(Act::GeluTanh),
            Op::Glu(Act::SwigluOai),
            Op::Attention(Attention { state: 4, scale: 0.1, window: 512, softcap: 50.0 }),
            Op::Experts(Experts { layer: 3, gate: Wt(10), up: Wt(11), down: Wt(12), act: Act::Silu }),
            Op::Experts(Experts { layer: 1, gate: Wt(10), up: Wt(11), down: Wt(12), act: Act::SwigluOai }),
            Op::BlockSelect { block: 64, top_k: 16, local: 1 },
            Op::StateRows { state: 2 },
            Op::Mask { window: 16 },
            Op::Scan { state: 1 },
            Op::ShortConv { state: 3, weight: Wt(9) },
            Op::DeltaNet { state: 5, scale: 0.25 },
            Op::ToF32,
            Op::NgramHash { n: 3, heads: 2, eos: 381, mult: vec![7, 1 << 40, 9], offsets: vec![0, 67, 138, 211], vocab: vec![67, 71, 73, 79] },
            Op::ConvRows { weight: Wt(4), dilation: 3 },
            Op::PooledSelect { block: 4, top_k: 2, key_norm: Wt(1), eps: 1e-6, scale: 0.25, rope: Rope::new(8, 1e7, RopeMode::Neox) },
            Op::PooledSelect {
                block: 64,
                top_k: 8,
                key_norm: Wt(1),
                eps: 1e-5,
                scale: 1.0,
                rope: Rope { n_rot: 16, base: 1e4, linear_factor: 1.0, mode: RopeMode::Interleaved, yarn: Some(Yarn { factor: 4.0, orig_ctx: 4096.0, beta_fast: 32.0, beta_slow: 1.0 }) },
            },
        ]
    }

    #[test]
    fn qwen4exp_ops_shape_rules() {
        let weights = vec![vec![4, 6], vec![8], vec![3, 5]];
        let names: Vec<String> = ["conv", "knorm", "bad"].iter().map(|s| s.to_string()).collect();
        let states = vec![];
        let cx = ShapeCx { weights: &weights, weight_names: &names, states: &states };
        let ids = Shape::i32(vec![Dim::T]);
        assert_eq!(infer(&Op::ToF32, &[&ids], &cx), Ok(Shape::f32(vec![Dim::T])));
        assert!(infer(&Op::ToF32, &[&Shape::f32(vec![Dim::T])], &cx).is_err());
        let hist = Shape::f32(vec![Dim::C, Dim::N(1)]);
        let ng = Op::NgramHash { n: 3, heads: 2, eos: 1, mult: vec![1, 3, 5], offsets: vec![0, 7, 18, 31], vocab: vec![7, 11, 13, 17] };
        assert_eq!(infer(&ng, &[&hist], &cx), Ok(Shape::i32(vec![Dim::T, Dim::N(4)])));
        assert!(infer(&ng, &[&Shape::f32(vec![Dim::T, Dim::N(1)])], &cx).unwrap_err().contains("history"));
        let short = Op::NgramHash { n: 3, heads: 2, eos: 1, mult: vec![1, 3], offsets: vec![0, 7, 18, 31], vocab: vec![7, 11, 13, 17] };
        assert!(infer(&short, &[&hist], &cx).unwrap_err().contains("multipliers"));
        let rows = Shape::f32(vec![Dim::C, Dim::N(6)]);
        assert_eq!(infer(&Op::ConvRows { weight: Wt(0), dilation: 3 }, &[&rows], &cx), Ok(Shape::f32(vec![Dim::T, Dim::N(6)])));
        assert!(infer(&Op::ConvRows { weight: Wt(2), dilation: 3 }, &[&rows], &cx).unwrap_err().contains("bad"));
        assert!(infer(&Op::ConvRows { weight: Wt(0), dilation: 0 }, &[&rows], &cx).is_err());
        assert!(infer(&Op::ConvRows { weight: Wt(0), dilation: 1 }, &[&Shape::f32(vec![Dim::T, Dim::N(6)])], &cx).is_err());
        let ps = Op::PooledSelect { block: 4, top_k: 2, key_norm: Wt(1), eps: 1e-6, scale: 1.0, rope: Rope::new(8, 1e4, RopeMode::Neox) };
        let q = Shape::f32(vec![Dim::T, Dim::N(2), Dim::N(8)]);
        let keys = Shape::f32(vec![Dim::C, Dim::N(8)]);
        assert_eq!(infer(&ps, &[&q, &keys], &cx), Ok(Shape::f32(vec![Dim::T, Dim::C])));
        assert!(infer(&ps, &[&q, &Shape::f32(vec![Dim::C, Dim::N(6)])], &cx).unwrap_err().contains("keys"));
        let ps_bad = Op::PooledSelect { block: 4, top_k: 2, key_norm: Wt(0), eps: 1e-6, scale: 1.0, rope: Rope::new(8, 1e4, RopeMode::Neox) };
        assert!(infer(&ps_bad, &[&q, &keys], &cx).unwrap_err().contains("conv"));
    }

    #[test]
    fn every_op_round_trips_through_its_encoding() {
        for op in every_op() {
            let e = op.encode();
            assert_eq!(Op::decode(e.code, &e.ints, &e.floats).as_ref(), Ok(&op), "{}", op.name());
        }
    }

    #[test]
    fn unknown_opcodes_and_missing_attributes_are_named() {
        let e = Op::decode(999, &[], &[]).unwrap_err();
        assert!(e.contains("999") && e.contains("newer host"), "{e}");
        let e = Op::decode(code::ROPE, &[64], &[1e4, 1.0]).unwrap_err();
        assert!(e.contains("attribute 1"), "{e}");
        // A rope recorded before YaRN existed (two floats) decodes without it.
        let old = Op::decode(code::ROPE, &[64, 0], &[1e4, 1.0]).unwrap();
        assert!(matches!(old, Op::Rope(Rope { yarn: None, .. })));
        assert!(Op::decode(code::ROPE, &[64, 0], &[1e4, 1.0, 40.0]).is_err());
        assert!(Op::decode(code::UNARY, &[99], &[]).unwrap_err().contains("unary"));
        assert!(Op::decode(code::LINEAR, &[-4], &[]).is_err());
    }

    fn cx<'a>(weights: &'a [Vec<u64>], names: &'a [String], states: &'a [StateSpec]) -> ShapeCx<'a> {
        ShapeCx { weights, weight_names: names, states }
    }

    #[test]
    fn shape_rules_accept_good_inputs_and_name_bad_ones() {
        let weights = vec![vec![16, 40], vec![16], vec![16, 8, 4], vec![8, 16, 4]];
        let names: Vec<String> = ["embd", "norm", "gate", "down"].iter().map(|s| s.to_string()).collect();
        let states = vec![StateSpec::kv(0, 2, 4, 4, 0), StateSpec::rows(0, 6), StateSpec::recurrent(0, &[2, 3])];
        let cx = cx(&weights, &names, &states);
        let x = Shape::f32(vec![Dim::T, Dim::N(16)]);
        let ids = Shape::i32(vec![Dim::T]);
        assert_eq!(infer(&Op::Embed { table: Wt(0), scale: 1.0 }, &[&ids], &cx), Ok(x.clone()));
        assert_eq!(infer(&Op::Linear(Wt(0)), &[&x], &cx), Ok(Shape::f32(vec![Dim::T, Dim::N(40)])));
        let e = infer(&Op::Linear(Wt(0)), &[&Shape::f32(vec![Dim::T, Dim::N(15)])], &cx).unwrap_err();
        assert!(e.contains("embd") && e.contains("16"), "{e}");
        let h = infer(&Op::Reshape(vec![Dim::T, Dim::N(4), Dim::N(4)]), &[&x], &cx).unwrap();
        assert!(infer(&Op::Reshape(vec![Dim::N(4), Dim::N(4), Dim::T]), &[&x], &cx).is_ok());
        assert!(infer(&Op::Reshape(vec![Dim::T, Dim::N(5)]), &[&x], &cx).is_err());
        let kv = Shape::f32(vec![Dim::T, Dim::N(2), Dim::N(4)]);
        let att = Op::Attention(Attention { state: 0, scale: 0.5, window: 0, softcap: 0.0 });
        assert_eq!(infer(&att, &[&h, &kv, &kv], &cx), Ok(h.clone()));
        assert!(infer(&att, &[&h, &h, &h], &cx).unwrap_err().contains("KV state 0"));
        let k = infer(&Op::TopK { k: 2 }, &[&x], &cx).unwrap();
        assert_eq!(k, Shape::i32(vec![Dim::T, Dim::N(2)]));
        let w = infer(&Op::TakeAlong, &[&x, &k], &cx).unwrap();
        assert_eq!(w, Shape::f32(vec![Dim::T, Dim::N(2)]));
        let s = infer(&Op::Reduce { kind: Reduce::Sum, axis: -1 }, &[&w], &cx).unwrap();
        assert_eq!(infer(&Op::Binary(Binary::Div), &[&w, &s], &cx), Ok(w.clone()));
        let ex = Op::Experts(Experts { layer: 0, gate: Wt(2), up: Wt(2), down: Wt(3), act: Act::Silu });
        assert_eq!(infer(&ex, &[&x, &k, &w], &cx), Ok(x.clone()));
        assert!(infer(&ex, &[&x, &w, &w], &cx).is_err());
        assert!(infer(&Op::TopK { k: 17 }, &[&x], &cx).is_err());
        let o = infer(&Op::OutputRows, &[&x], &cx).unwrap();
        assert_eq!(o.dims, vec![Dim::O, Dim::N(16)]);
        assert!(infer(&Op::OutputRows, &[&o], &cx).is_err());
        assert!(infer(&Op::Binary(Binary::Add), &[&x, &o], &cx).is_err());
        let m = infer(&Op::Matmul, &[&Shape::f32(vec![Dim::N(4), Dim::T, Dim::N(8)]), &Shape::f32(vec![Dim::N(4), Dim::N(8), Dim::N(3)])], &cx);
        assert_eq!(m, Ok(Shape::f32(vec![Dim::N(4), Dim::T, Dim::N(3)])));
        let c = infer(&Op::Concat { axis: -1 }, &[&x, &w], &cx).unwrap();
        assert_eq!(c.dims, vec![Dim::T, Dim::N(18)]);
        assert!(infer(&Op::Concat { axis: 0 }, &[&x, &x], &cx).is_err());
        assert_eq!(infer(&Op::Slice { axis: 1, start: 4, len: 4 }, &[&x], &cx).unwrap().dims, vec![Dim::T, Dim::N(4)]);
        assert!(infer(&Op::Slice { axis: 1, start: 14, len: 4 }, &[&x], &cx).is_err());
        assert_eq!(infer(&Op::Permute(vec![1, 0]), &[&x], &cx).unwrap().dims, vec![Dim::N(16), Dim::T]);
        assert!(infer(&Op::Permute(vec![0, 0]), &[&x], &cx).is_err());
        assert!(infer(&Op::RmsNorm { weight: Some(Wt(1)), eps: 1e-6 }, &[&h], &cx).is_err());
        assert!(infer(&Op::Linear(Wt(0)), &[], &cx).unwrap_err().contains("takes 1 inputs"));
        let rows = Shape::f32(vec![Dim::T, Dim::N(6)]);
        assert_eq!(infer(&Op::StateRows { state: 1 }, &[&rows], &cx).unwrap().dims, vec![Dim::C, Dim::N(6)]);
        assert!(infer(&Op::StateRows { state: 0 }, &[&rows], &cx).unwrap_err().contains("not a rows state"));
        assert!(infer(&Op::StateRows { state: 1 }, &[&x], &cx).is_err());
        let ab = Shape::f32(vec![Dim::T, Dim::N(2), Dim::N(3)]);
        assert_eq!(infer(&Op::Scan { state: 2 }, &[&ab, &ab], &cx), Ok(ab.clone()));
        assert!(infer(&Op::Scan { state: 2 }, &[&ab, &x], &cx).is_err());
        assert!(infer(&Op::Scan { state: 9 }, &[&ab, &ab], &cx).unwrap_err().contains("not declared"));
        assert_eq!(infer(&Op::Mask { window: 0 }, &[], &cx).unwrap().dims, vec![Dim::T, Dim::C]);
    }

    #[test]
    fn the_delta_net_ops_check_their_states_and_weights() {
        // conv weight [K 4, C 6]; conv window [3, 6]; delta state [Hv 4, Dk 2, Dv 3].
        let weights = vec![vec![4, 6], vec![3, 6]];
        let names: Vec<String> = ["conv", "short"].iter().map(|s| s.to_string()).collect();
        let states = vec![StateSpec::recurrent(0, &[3, 6]), StateSpec::recurrent(0, &[4, 2, 3]), StateSpec::kv(0, 2, 4, 4, 0)];
        let cx = cx(&weights, &names, &states);
        let x = Shape::f32(vec![Dim::T, Dim::N(6)]);
        assert_eq!(infer(&Op::ShortConv { state: 0, weight: Wt(0) }, &[&x], &cx), Ok(x.clone()));
        assert!(infer(&Op::ShortConv { state: 0, weight: Wt(1) }, &[&x], &cx).unwrap_err().contains("state 0"));
        assert!(infer(&Op::ShortConv { state: 1, weight: Wt(0) }, &[&x], &cx).is_err());
        assert!(infer(&Op::ShortConv { state: 2, weight: Wt(0) }, &[&x], &cx).unwrap_err().contains("not a recurrent"));
        let x5 = Shape::f32(vec![Dim::T, Dim::N(5)]);
        assert!(infer(&Op::ShortConv { state: 0, weight: Wt(0) }, &[&x5], &cx).unwrap_err().contains("conv"));
        let q = Shape::f32(vec![Dim::T, Dim::N(2), Dim::N(2)]);
        let v = Shape::f32(vec![Dim::T, Dim::N(4), Dim::N(3)]);
        let g = Shape::f32(vec![Dim::T, Dim::N(4)]);
        let dn = Op::DeltaNet { state: 1, scale: 0.5 };
        assert_eq!(infer(&dn, &[&q, &q, &v, &g, &g], &cx), Ok(v.clone()));
        assert!(infer(&dn, &[&q, &q, &v, &g], &cx).unwrap_err().contains("takes 5"));
        assert!(infer(&dn, &[&q, &q, &v, &x, &g], &cx).is_err());
        let q3 = Shape::f32(vec![Dim::T, Dim::N(3), Dim::N(2)]);
        assert!(infer(&dn, &[&q3, &q3, &v, &g, &g], &cx).unwrap_err().contains("v heads over 3"));
        assert!(infer(&Op::DeltaNet { state: 0, scale: 0.5 }, &[&q, &q, &v, &g, &g], &cx).is_err());
        assert!(infer(&Op::DeltaNet { state: 1, scale: f32::NAN }, &[&q, &q, &v, &g, &g], &cx).is_err());
    }
}
