//! Blocks many families share, written from the graph's ops (the way
//! llama.cpp's `build_moe_ffn` composes routing): a SwiGLU FFN, the top-k
//! router and the Qwen3.5 hybrids' gated delta net. A family uses them or
//! writes its own; the host sees the same ops either way.

use crate::abi::{Val, Wt};
use crate::graph::Act;
use crate::sdk::{Graph, PluginError};

/// How a router turns its logits into scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scores {
    Softmax,
    Sigmoid,
}

/// A top-k router: `linear(weight, h)` → scores → (scores + `bias`, for
/// choosing only) → top-k → the chosen unbiased scores (÷ their sum) (× scale).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Router {
    pub weight: Wt,
    pub scores: Scores,
    /// A selection-only bias `[n_expert]` (DeepSeek's `e_score_correction_bias`).
    pub bias: Option<Wt>,
    pub top_k: u32,
    pub renormalize: bool,
    pub scale: f32,
}

impl Router {
    /// The experts each row chooses (i32 `[T, k]`) and their weights (`[T, k]`).
    pub fn route(&self, g: &mut Graph<'_>, h: Val) -> Result<(Val, Val), PluginError> {
        self.route_limited(g, h, |_, choice| Ok(choice))
    }

    /// [`Router::route`] with `limit` applied to the choosing scores before the
    /// top-k (group-limited routing adds its penalty there).
    pub fn route_limited(
        &self,
        g: &mut Graph<'_>,
        h: Val,
        limit: impl FnOnce(&mut Graph<'_>, Val) -> Result<Val, PluginError>,
    ) -> Result<(Val, Val), PluginError> {
        let logits = g.linear(self.weight, h)?;
        let scores = match self.scores {
            Scores::Softmax => g.softmax(logits, -1)?,
            Scores::Sigmoid => g.sigmoid(logits)?,
        };
        let choice = match self.bias {
            Some(b) => {
                let b = g.weight(b)?;
                g.add(scores, b)?
            }
            None => scores,
        };
        let choice = limit(g, choice)?;
        let ids = g.top_k(choice, self.top_k)?;
        let mut w = g.take_along(scores, ids)?;
        if self.renormalize {
            let total = g.sum(w, -1)?;
            w = g.div(w, total)?;
        }
        if self.scale != 1.0 {
            w = g.scale(w, self.scale)?;
        }
        Ok((ids, w))
    }
}

/// A gated FFN's weights: gate, up, down.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ffn {
    pub gate: Wt,
    pub up: Wt,
    pub down: Wt,
}

impl Ffn {
    /// `down(act(gate(h)) * up(h))`.
    pub fn glu(&self, g: &mut Graph<'_>, h: Val, act: Act) -> Result<Val, PluginError> {
        let gate = g.linear(self.gate, h)?;
        let up = g.linear(self.up, h)?;
        let a = g.glu(gate, up, act)?;
        g.linear(self.down, a)
    }

    /// The SwiGLU FFN: [`Ffn::glu`] with SiLU.
    pub fn swiglu(&self, g: &mut Graph<'_>, h: Val) -> Result<Val, PluginError> {
        self.glu(g, h, Act::Silu)
    }
}

/// The language-model head every family ends with: the rows the host wants,
/// the final RMS norm, the output projection, named `logits`.
pub fn lm_head(g: &mut Graph<'_>, x: Val, norm: Wt, output: Wt, eps: f32) -> Result<Val, PluginError> {
    let x = g.output_rows(x)?;
    let x = g.rms_norm(x, Some(norm), eps)?;
    let logits = g.linear(output, x)?;
    Ok(g.name(logits, "logits", None))
}

/// ChatML, Qwen's turn format: the fallback for Qwen GGUFs without
/// `tokenizer.chat_template`.
pub const CHATML_TEMPLATE: &str = r#"{% for m in messages %}{{ '<|im_start|>' ~ m['role'] ~ '\n' ~ m['content'] ~ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"#;

/// The gated delta net mixer of the Qwen3.5 hybrids (HF `Qwen3_5GatedDeltaNet`,
/// shared by qwen35moe, qwen35 and qwen4exp): the q/k/v projection through a
/// short causal conv and SiLU, L2-normed q and k heads, softplus decay gates
/// and a sigmoid `beta`, the gated delta rule on a recurrent state, then an
/// RMS norm gated by `silu(z)` and the output projection. Its conv window
/// and state are host-owned recurrent states.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatedDeltaNet {
    pub qkv: Wt,
    pub z: Wt,
    pub beta: Wt,
    pub alpha: Wt,
    pub dt_bias: Wt,
    pub a: Wt,
    pub conv: Wt,
    pub norm: Wt,
    pub out: Wt,
    pub conv_state: u32,
    pub state: u32,
    /// k heads, v heads, and their widths.
    pub hk: u32,
    pub hv: u32,
    pub dk: u32,
    pub dv: u32,
    /// The gated RMS norm's epsilon.
    pub eps: f32,
}

/// The epsilon of the q/k L2 norm (HF `l2norm`'s 1e-6).
const DELTA_L2_EPS: f32 = 1e-6;

impl GatedDeltaNet {
    /// The dims of the conv window (`[K - 1, channels]`) and of the delta
    /// rule's state (`[hv, dk, dv]`), to declare as recurrent states.
    pub fn state_dims((hk, hv, dk, dv): (u32, u32, u32, u32), conv_kernel: u64) -> ([u64; 2], [u64; 3]) {
        let ch = (2 * hk * dk + hv * dv) as u64;
        ([conv_kernel.saturating_sub(1), ch], [hv as u64, dk as u64, dv as u64])
    }

    /// Declare the weights (llama.cpp's names, through `w`) for `n_embd`
    /// inputs and a conv of `conv_kernel` taps, with the `(conv window,
    /// state)` states declared from [`GatedDeltaNet::state_dims`].
    pub fn declare(
        mut w: impl FnMut(&str, crate::abi::Role, &[u64]) -> Result<Wt, PluginError>,
        (conv_state, state): (u32, u32),
        n_embd: u64,
        (hk, hv, dk, dv): (u32, u32, u32, u32),
        conv_kernel: u64,
        eps: f32,
    ) -> Result<GatedDeltaNet, PluginError> {
        use crate::abi::Role;
        let (e, nv, ch) = (n_embd, (hv * dv) as u64, (2 * hk * dk + hv * dv) as u64);
        Ok(GatedDeltaNet {
            qkv: w("attn_qkv.weight", Role::Attention, &[e, ch])?,
            z: w("attn_gate.weight", Role::Attention, &[e, nv])?,
            beta: w("ssm_beta.weight", Role::Attention, &[e, hv as u64])?,
            alpha: w("ssm_alpha.weight", Role::Attention, &[e, hv as u64])?,
            dt_bias: w("ssm_dt.bias", Role::Norm, &[hv as u64])?,
            a: w("ssm_a", Role::Norm, &[hv as u64])?,
            conv: w("ssm_conv1d.weight", Role::Attention, &[conv_kernel, ch])?,
            norm: w("ssm_norm.weight", Role::Norm, &[dv as u64])?,
            out: w("ssm_out.weight", Role::Attention, &[nv, e])?,
            conv_state,
            state,
            hk,
            hv,
            dk,
            dv,
            eps,
        })
    }

    /// The mixer on the normed input `h`; intermediates named for `layer`.
    pub fn forward(&self, g: &mut Graph<'_>, h: Val, layer: u32) -> Result<Val, PluginError> {
        let (kw, vw) = ((self.hk * self.dk) as u64, (self.hv * self.dv) as u64);
        let z = g.linear(self.z, h)?;
        let beta = g.linear(self.beta, h)?;
        let beta = g.sigmoid(beta)?;
        let a = g.linear(self.alpha, h)?;
        let dt = g.weight(self.dt_bias)?;
        let a = g.add(a, dt)?;
        let a = g.softplus(a)?;
        let decay = g.weight(self.a)?;
        let gl = g.mul(a, decay)?;
        let m = g.linear(self.qkv, h)?;
        let m = g.short_conv(self.conv_state, self.conv, m)?;
        let m = g.silu(m)?;
        let m = g.name(m, "conv_out", Some(layer));
        let q = g.slice(m, -1, 0, kw)?;
        let k = g.slice(m, -1, kw, kw)?;
        let v = g.slice(m, -1, 2 * kw, vw)?;
        let q = g.split_heads(q, self.hk, self.dk)?;
        let q = g.l2_norm(q, self.dk, DELTA_L2_EPS)?;
        let k = g.split_heads(k, self.hk, self.dk)?;
        let k = g.l2_norm(k, self.dk, DELTA_L2_EPS)?;
        let v = g.split_heads(v, self.hv, self.dv)?;
        let o = g.delta_net(self.state, 1.0 / (self.dk as f32).sqrt(), q, k, v, gl, beta)?;
        let o = g.name(o, "delta_out", Some(layer));
        let o = g.rms_norm(o, Some(self.norm), self.eps)?;
        let z = g.split_heads(z, self.hv, self.dv)?;
        let z = g.silu(z)?;
        let o = g.mul(o, z)?;
        let o = g.merge_heads(o)?;
        g.linear(self.out, o)
    }
}

/// A delta net's sizes from a file's `ssm.*` keys (llama.cpp's names), each
/// checked with one error naming the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaDims {
    /// k heads (`ssm.group_count`) and v heads (`ssm.time_step_rank`).
    pub hk: u32,
    pub hv: u32,
    /// Head widths: `ssm.state_size`, and `ssm.inner_size / hv`.
    pub dk: u32,
    pub dv: u32,
    /// Taps of the short conv (`ssm.conv_kernel`).
    pub conv_kernel: u32,
}

impl DeltaDims {
    pub fn parse(cx: &crate::sdk::OpenCx<'_>) -> Result<DeltaDims, PluginError> {
        let bad = |key: &str, why: String| PluginError::BadValue { key: cx.key(key), why };
        let (hk, hv) = (cx.u32(&cx.key("ssm.group_count"))?, cx.u32(&cx.key("ssm.time_step_rank"))?);
        if hk == 0 || hv == 0 || hv % hk != 0 {
            return Err(bad("ssm.group_count", format!("{hk} k heads do not divide {hv} v heads (ssm.time_step_rank)")));
        }
        let inner = cx.u32(&cx.key("ssm.inner_size"))?;
        if inner % hv != 0 {
            return Err(bad("ssm.inner_size", format!("{inner} is not a multiple of {hv} v heads")));
        }
        let conv_kernel = cx.u32(&cx.key("ssm.conv_kernel"))?;
        if conv_kernel < 2 {
            return Err(bad("ssm.conv_kernel", format!("{conv_kernel} (a short conv needs at least 2 taps)")));
        }
        let dk = cx.u32(&cx.key("ssm.state_size"))?;
        Ok(DeltaDims { hk, hv, dk, dv: inner / hv, conv_kernel })
    }

    /// `(hk, hv, dk, dv)`, as [`GatedDeltaNet::declare`] takes them.
    pub fn heads(&self) -> (u32, u32, u32, u32) {
        (self.hk, self.hv, self.dk, self.dv)
    }
}
