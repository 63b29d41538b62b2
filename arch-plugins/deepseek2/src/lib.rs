//! DeepSeek-V3 and Kimi K2, `general.architecture = deepseek2`.
//!
//! Reference: HF transformers `models/deepseek_v3/modeling_deepseek_v3.py`
//! (`DeepseekV3ForCausalLM`; Kimi K2.5's `Kimi_K25ForConditionalGeneration`
//! wraps the same text model), in llama.cpp's GGUF dialect
//! (`tools/refgen/check_numpy.py` states the maths the fixtures are checked
//! with).
//!
//! Features: MLA in the absorbed form over a compact per-token cache (the
//! normed latent `c` and the shared rope key, `key_length` = kv_lora + rope
//! wide, `c` read back as the values; `attn_k_b` folded into the queries,
//! `attn_v_b` applied to the attention's output); q_lora; interleaved YaRN
//! RoPE with YaRN's attention gain in the softmax scale (`mscale²`,
//! `mscale = 1 + yarn_log_multiplier · ln(factor)`, llama.cpp's rule);
//! leading dense SwiGLU layers; MoE layers with softmax or sigmoid scores, a
//! selection-only bias, group-limited top-k (`expert_group_count` /
//! `expert_group_used_count`: a group scores the sum of its two best biased
//! experts), renormalisation and `expert_weights_scale`, plus shared experts.
//!
//! The graph is written from primitives; the CUDA backend has no kernels yet
//! for its YaRN rope and grouped routing and refuses it at load (the fused
//! `attention_mla` and the grouped router are the next steps).

use pulsar_plugin_api::blocks::{Ffn, Router, Scores};
use pulsar_plugin_api::{
    Act, Attention, ChatSpec, Dim, Experts, FamilyPlugin, Graph, OpenCx, PluginError, Role, Rope, RopeMode, ThinkingMarkers, Val, Wt, Yarn,
};

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub n_layers: u32,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_ff: u32,
    pub q_lora: Option<u32>,
    pub kv_lora: u32,
    pub n_rot: u32,
    pub nope: u32,
    pub v_head: u32,
    pub n_dense: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_group: u32,
    pub n_group_used: u32,
    pub n_ff_exp: u32,
    pub n_shared: u32,
    pub gating: Scores,
    pub weights_norm: bool,
    pub weights_scale: f32,
    pub eps: f32,
    pub rope_base: f32,
    pub yarn: Option<Yarn>,
    pub attn_scale: f32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
}

impl Config {
    pub fn parse(cx: &OpenCx<'_>) -> Result<Config, PluginError> {
        let n_head = cx.u32(&cx.key("attention.head_count"))?;
        let bad = |key: &str, why: String| PluginError::BadValue { key: cx.key(key), why };
        if cx.opt_u32(&cx.key("attention.head_count_kv"))?.unwrap_or(1) != 1 {
            return Err(bad("attention.head_count_kv", "MLA files hold one latent KV head (1)".into()));
        }
        let kv_lora = cx.u32(&cx.key("attention.kv_lora_rank"))?;
        let n_rot = cx.u32(&cx.key("rope.dimension_count"))?;
        let key_len = cx.u32(&cx.key("attention.key_length"))?;
        let val_len = cx.u32(&cx.key("attention.value_length"))?;
        if key_len != kv_lora + n_rot || val_len != kv_lora {
            return Err(bad("attention.key_length", format!("{key_len}/{val_len} is not the absorbed MLA layout (kv_lora {kv_lora} + rope {n_rot} / kv_lora)")));
        }
        let k_mla = cx.u32(&cx.key("attention.key_length_mla"))?;
        if k_mla <= n_rot || n_rot % 2 != 0 {
            return Err(bad("attention.key_length_mla", format!("{k_mla} per-head key dims for {n_rot} rotated")));
        }
        let v_head = cx.u32(&cx.key("attention.value_length_mla"))?;
        let n_expert = cx.u32(&cx.key("expert_count"))?;
        let n_expert_used = cx.u32(&cx.key("expert_used_count"))?;
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(bad("expert_used_count", format!("{n_expert_used} experts used of {n_expert}")));
        }
        let n_group = cx.opt_u32(&cx.key("expert_group_count"))?.unwrap_or(1).max(1);
        let n_group_used = cx.opt_u32(&cx.key("expert_group_used_count"))?.unwrap_or(n_group);
        if n_expert % n_group != 0 || n_group_used == 0 || n_group_used > n_group || (n_group > 1 && n_expert / n_group < 2) {
            return Err(bad("expert_group_count", format!("{n_group} groups ({n_group_used} used) of {n_expert} experts")));
        }
        if n_group_used * (n_expert / n_group) < n_expert_used {
            return Err(bad("expert_group_used_count", format!("{n_group_used} groups hold fewer than the {n_expert_used} experts a token uses")));
        }
        // llama.cpp: no key means softmax (DeepSeek-V2).
        let gating = match cx.opt_u32(&cx.key("expert_gating_func"))? {
            None | Some(1) => Scores::Softmax,
            Some(2) => Scores::Sigmoid,
            Some(g) => return Err(bad("expert_gating_func", format!("gating {g} (1 softmax, 2 sigmoid)"))),
        };
        let weights_norm = match cx.meta(&cx.key("expert_weights_norm")) {
            Some(_) => cx.bool(&cx.key("expert_weights_norm"))?,
            None => false,
        };
        let weights_scale = cx.opt_f32(&cx.key("expert_weights_scale"))?.unwrap_or(1.0);
        if !(weights_scale.is_finite() && weights_scale > 0.0) {
            return Err(bad("expert_weights_scale", format!("{weights_scale} is not a positive scale")));
        }
        let scaling = match cx.meta(&cx.key("rope.scaling.type")) {
            Some(_) => cx.string(&cx.key("rope.scaling.type"))?,
            None => "none".into(),
        };
        let mut attn_scale = 1.0 / (k_mla as f32).sqrt();
        let yarn = match scaling.as_str() {
            "none" => None,
            "yarn" => {
                let factor = cx.f32(&cx.key("rope.scaling.factor"))?;
                let mscale = 1.0 + cx.opt_f32(&cx.key("rope.scaling.yarn_log_multiplier"))?.unwrap_or(0.0) * factor.ln();
                attn_scale *= mscale * mscale;
                Some(Yarn {
                    factor,
                    orig_ctx: cx.f32(&cx.key("rope.scaling.original_context_length"))?,
                    beta_fast: cx.opt_f32(&cx.key("rope.scaling.yarn_beta_fast"))?.unwrap_or(32.0),
                    beta_slow: cx.opt_f32(&cx.key("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
                })
            }
            other => return Err(PluginError::Unsupported(format!("rope scaling `{other}` ({})", cx.key("rope.scaling.type")))),
        };
        Ok(Config {
            n_layers: cx.u32(&cx.key("block_count"))?,
            n_embd: cx.u32(&cx.key("embedding_length"))?,
            n_head,
            n_ff: cx.u32(&cx.key("feed_forward_length"))?,
            q_lora: cx.opt_u32(&cx.key("attention.q_lora_rank"))?.filter(|&r| r > 0),
            kv_lora,
            n_rot,
            nope: k_mla - n_rot,
            v_head,
            n_dense: cx.opt_u32(&cx.key("leading_dense_block_count"))?.unwrap_or(0),
            n_expert,
            n_expert_used,
            n_group,
            n_group_used,
            n_ff_exp: cx.u32(&cx.key("expert_feed_forward_length"))?,
            n_shared: cx.opt_u32(&cx.key("expert_shared_count"))?.unwrap_or(0),
            gating,
            weights_norm,
            weights_scale,
            eps: cx.f32(&cx.key("attention.layer_norm_rms_epsilon"))?,
            rope_base: cx.f32(&cx.key("rope.freq_base"))?,
            yarn,
            attn_scale,
            n_vocab: cx.n_vocab("token_embd.weight")?,
            n_ctx_train: cx.u32(&cx.key("context_length"))?,
        })
    }
}

enum Query {
    /// q_lora: `attn_q_a`, its norm, `attn_q_b`.
    Lora { a: Wt, norm: Wt, b: Wt },
    Full(Wt),
}

struct Moe {
    router: Wt,
    bias: Option<Wt>,
    gate_exps: Wt,
    up_exps: Wt,
    down_exps: Wt,
    shared: Option<Ffn>,
}

enum Mlp {
    Dense(Ffn),
    Moe(Moe),
}

struct Layer {
    attn_norm: Wt,
    q: Query,
    kv_a: Wt,
    kv_norm: Wt,
    k_b: Wt,
    v_b: Wt,
    wo: Wt,
    ffn_norm: Wt,
    ffn: Mlp,
    kv: u32,
}

pub struct Deepseek2 {
    pub cfg: Config,
    /// Kimi K2's turn format (`tokenizer.ggml.pre = kimi-k2`), else DeepSeek's.
    kimi: bool,
    tok_embd: Wt,
    output_norm: Wt,
    output: Wt,
    layers: Vec<Layer>,
}

impl FamilyPlugin for Deepseek2 {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let c = Config::parse(cx)?;
        let (e, h) = (c.n_embd as u64, c.n_head as u64);
        let (kvl, rot, nope, vh) = (c.kv_lora as u64, c.n_rot as u64, c.nope as u64, c.v_head as u64);
        let (nx, ffx) = (c.n_expert as u64, c.n_ff_exp as u64);
        let tok_embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, c.n_vocab as u64])?;
        let output_norm = cx.weight_shaped("output_norm.weight", Role::Norm, None, &[e])?;
        let output = match cx.opt_weight("output.weight", Role::Output, None)? {
            Some(_) => cx.weight_shaped("output.weight", Role::Output, None, &[e, c.n_vocab as u64])?,
            None => tok_embd,
        };
        let mut layers = Vec::with_capacity(c.n_layers as usize);
        for l in 0..c.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let has_bias = cx.tensor(&n("exp_probs_b.bias")).is_some();
            let mut w = |s: &str, role: Role, dims: &[u64]| cx.weight_shaped(&n(s), role, Some(l), dims);
            let attn_norm = w("attn_norm.weight", Role::Norm, &[e])?;
            let q = match c.q_lora {
                Some(r) => Query::Lora {
                    a: w("attn_q_a.weight", Role::Attention, &[e, r as u64])?,
                    norm: w("attn_q_a_norm.weight", Role::Norm, &[r as u64])?,
                    b: w("attn_q_b.weight", Role::Attention, &[r as u64, h * (nope + rot)])?,
                },
                None => Query::Full(w("attn_q.weight", Role::Attention, &[e, h * (nope + rot)])?),
            };
            let kv_a = w("attn_kv_a_mqa.weight", Role::Attention, &[e, kvl + rot])?;
            let kv_norm = w("attn_kv_a_norm.weight", Role::Norm, &[kvl])?;
            let k_b = w("attn_k_b.weight", Role::Attention, &[nope, kvl, h])?;
            let v_b = w("attn_v_b.weight", Role::Attention, &[kvl, vh, h])?;
            let wo = w("attn_output.weight", Role::Attention, &[h * vh, e])?;
            let ffn_norm = w("ffn_norm.weight", Role::Norm, &[e])?;
            let ffn = if l < c.n_dense {
                let ff = c.n_ff as u64;
                Mlp::Dense(Ffn { gate: w("ffn_gate.weight", Role::Dense, &[e, ff])?, up: w("ffn_up.weight", Role::Dense, &[e, ff])?, down: w("ffn_down.weight", Role::Dense, &[ff, e])? })
            } else {
                let shared = if c.n_shared > 0 {
                    let s = ffx * c.n_shared as u64;
                    Some(Ffn {
                        gate: w("ffn_gate_shexp.weight", Role::SharedExpert, &[e, s])?,
                        up: w("ffn_up_shexp.weight", Role::SharedExpert, &[e, s])?,
                        down: w("ffn_down_shexp.weight", Role::SharedExpert, &[s, e])?,
                    })
                } else {
                    None
                };
                Mlp::Moe(Moe {
                    router: w("ffn_gate_inp.weight", Role::Router, &[e, nx])?,
                    bias: if has_bias { Some(w("exp_probs_b.bias", Role::Router, &[nx])?) } else { None },
                    gate_exps: w("ffn_gate_exps.weight", Role::RoutedExpert, &[e, ffx, nx])?,
                    up_exps: w("ffn_up_exps.weight", Role::RoutedExpert, &[e, ffx, nx])?,
                    down_exps: w("ffn_down_exps.weight", Role::RoutedExpert, &[ffx, e, nx])?,
                    shared,
                })
            };
            // The compact latent cache: [c, k_pe] per token as the keys, c as the values.
            let kv = cx.kv_cache(l, 1, c.kv_lora + c.n_rot, c.kv_lora, 0);
            layers.push(Layer { attn_norm, q, kv_a, kv_norm, k_b, v_b, wo, ffn_norm, ffn, kv });
        }
        cx.set_dims(c.n_layers, c.n_embd, c.n_vocab, c.n_ctx_train);
        let kimi = matches!(cx.meta("tokenizer.ggml.pre"), Some(pulsar_plugin_api::MetaValue::Str(s)) if s.as_str() == "kimi-k2");
        Ok(Deepseek2 { cfg: c, kimi, tok_embd, output_norm, output, layers })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let rope = Rope { yarn: c.yarn, ..Rope::new(c.n_rot, c.rope_base, RopeMode::Interleaved) };
        let ids = g.tokens()?;
        let mut x = g.embed(self.tok_embd, ids, 1.0)?;
        for (il, w) in self.layers.iter().enumerate() {
            let l = il as u32;
            let h = g.rms_norm(x, Some(w.attn_norm), c.eps)?;
            let a = self.mla(g, w, h, rope)?;
            let a = g.name(a, "attn_out", Some(l));
            x = g.add(x, a)?;
            let h = g.rms_norm(x, Some(w.ffn_norm), c.eps)?;
            let f = match &w.ffn {
                Mlp::Dense(d) => d.swiglu(g, h)?,
                Mlp::Moe(m) => {
                    let routed = self.routed(g, m, l, h)?;
                    let routed = g.name(routed, "ffn_moe_out", Some(l));
                    match &m.shared {
                        Some(s) => {
                            let shared = s.swiglu(g, h)?;
                            g.add(routed, shared)?
                        }
                        None => routed,
                    }
                }
            };
            let f = g.name(f, "ffn_out", Some(l));
            x = g.add(x, f)?;
            x = g.name(x, "l_out", Some(l));
        }
        pulsar_plugin_api::blocks::lm_head(g, x, self.output_norm, self.output, c.eps)
    }

    fn chat(&self) -> ChatSpec {
        let (tpl, stop) = if self.kimi { (KIMI_TEMPLATE, "<|im_end|>") } else { (DEEPSEEK_TEMPLATE, "<｜end▁of▁sentence｜>") };
        ChatSpec {
            fallback_template: Some(tpl.into()).into(),
            stop_markers: vec![stop.into()].into(),
            thinking: Some(ThinkingMarkers { open: "<think>".into(), close: "</think>".into() }).into(),
        }
    }
}

/// DeepSeek-V3.1's turns in non-thinking mode, for GGUFs without
/// `tokenizer.chat_template` (it renders plain conversations as the
/// published template does: `host/tests/parity.rs` checks it).
pub const DEEPSEEK_TEMPLATE: &str = r#"{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' ~ m['content'] }}{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜><think></think>' ~ m['content'] ~ '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think></think>' }}{% endif %}"#;

/// Kimi K2's turns (its default system turn when there is none).
pub const KIMI_TEMPLATE: &str = r#"{% set ns = namespace(sys=false) %}{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.sys = true %}{% endif %}{% endfor %}{% if not ns.sys %}{{ '<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>' }}{% endif %}{% for m in messages %}{% if m['role'] == 'system' %}{{ '<|im_system|>system<|im_middle|>' ~ m['content'] ~ '<|im_end|>' }}{% elif m['role'] == 'user' %}{{ '<|im_user|>user<|im_middle|>' ~ m['content'] ~ '<|im_end|>' }}{% elif m['role'] == 'assistant' %}{{ '<|im_assistant|>assistant<|im_middle|>' ~ m['content'] ~ '<|im_end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"#;

impl Deepseek2 {
    /// Absorbed MLA: queries carry `attn_k_b`, the cache holds [c, k_pe].
    fn mla(&self, g: &mut Graph<'_>, w: &Layer, h: Val, rope: Rope) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let q = match w.q {
            Query::Lora { a, norm, b } => {
                let qa = g.linear(a, h)?;
                let qa = g.rms_norm(qa, Some(norm), c.eps)?;
                g.linear(b, qa)?
            }
            Query::Full(wq) => g.linear(wq, h)?,
        };
        let q = g.split_heads(q, c.n_head, c.nope + c.n_rot)?;
        let qn = g.slice(q, -1, 0, c.nope as u64)?;
        let qp = g.slice(q, -1, c.nope as u64, c.n_rot as u64)?;
        let qp = g.rope(qp, rope)?;
        let kv = g.linear(w.kv_a, h)?; // [T, kv_lora + rope]
        let lat = g.slice(kv, -1, 0, c.kv_lora as u64)?;
        let lat = g.rms_norm(lat, Some(w.kv_norm), c.eps)?;
        let lat = g.reshape(lat, &[Dim::T, Dim::N(1), Dim::N(c.kv_lora as u64)])?;
        let kp = g.slice(kv, -1, c.kv_lora as u64, c.n_rot as u64)?;
        let kp = g.reshape(kp, &[Dim::T, Dim::N(1), Dim::N(c.n_rot as u64)])?;
        let kp = g.rope(kp, rope)?;
        // q_nope · attn_k_b per head: [H, T, nope] · [H, nope, kv_lora].
        let wk = g.weight(w.k_b)?; // [H, kv_lora, nope]
        let wk = g.permute(wk, &[0, 2, 1])?;
        let qb = g.permute(qn, &[1, 0, 2])?;
        let qb = g.matmul(qb, wk)?;
        let qb = g.permute(qb, &[1, 0, 2])?; // [T, H, kv_lora]
        let qq = g.concat(&[qb, qp], -1)?;
        let kk = g.concat(&[lat, kp], -1)?;
        let spec = Attention { state: w.kv, scale: c.attn_scale, window: 0, softcap: 0.0 };
        let o = g.attention(qq, kk, lat, spec)?; // [T, H, kv_lora]
        // attn_v_b per head: [H, T, kv_lora] · [H, kv_lora, v].
        let wv = g.weight(w.v_b)?; // [H, v, kv_lora]
        let wv = g.permute(wv, &[0, 2, 1])?;
        let o = g.permute(o, &[1, 0, 2])?;
        let o = g.matmul(o, wv)?;
        let o = g.permute(o, &[1, 0, 2])?; // [T, H, v]
        let o = g.merge_heads(o)?;
        g.linear(w.wo, o)
    }

    /// Scores, the bias for choosing, group-limited top-k, the chosen
    /// unbiased scores renormalised and scaled.
    fn routed(&self, g: &mut Graph<'_>, m: &Moe, layer: u32, h: Val) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let router = Router { weight: m.router, scores: c.gating, bias: m.bias, top_k: c.n_expert_used, renormalize: c.weights_norm, scale: c.weights_scale };
        let grouped = c.n_group > 1 && c.n_group_used < c.n_group;
        let (sel, sw) = router.route_limited(g, h, |g, s| if grouped { group_limit(g, s, c.n_expert, c.n_group, c.n_group_used) } else { Ok(s) })?;
        let spec = Experts { layer, gate: m.gate_exps, up: m.up_exps, down: m.down_exps, act: Act::Silu };
        g.experts(h, sel, sw, spec)
    }
}

/// Keep only the experts of the `used` groups whose two best scores sum
/// highest: the others get -1e30 added (exactly 0 for the kept). A group
/// tied with the weakest kept one is kept too (the reference keeps the lower
/// index); only exact ties differ.
fn group_limit(g: &mut Graph<'_>, s: Val, n_expert: u32, n_group: u32, used: u32) -> Result<Val, PluginError> {
    let (ng, per) = (n_group as u64, (n_expert / n_group) as u64);
    let gs = g.reshape(s, &[Dim::T, Dim::N(ng), Dim::N(per)])?;
    let best2 = g.top_k(gs, 2)?;
    let top = g.take_along(gs, best2)?;
    let score = g.sum(top, -1)?;
    let score = g.reshape(score, &[Dim::T, Dim::N(ng)])?;
    let keep = g.top_k(score, used)?;
    let weakest = g.slice(keep, -1, used as u64 - 1, 1)?;
    let kth = g.take_along(score, weakest)?; // [T, 1]
    let pen = g.sub(score, kth)?; // >= 0 kept, < 0 dropped
    let pen = g.scale(pen, 1e30)?;
    let pen = g.clamp(pen, -1.0, 0.0)?;
    let pen = g.scale(pen, 1e30)?;
    let pen = g.reshape(pen, &[Dim::T, Dim::N(ng), Dim::N(1)])?;
    let gs = g.add(gs, pen)?;
    g.reshape(gs, &[Dim::T, Dim::N(n_expert as u64)])
}

pulsar_plugin_api::export_plugin! {
    name: "deepseek2",
    families: { "deepseek2" => Deepseek2 },
}

#[cfg(test)]
mod tests {
    use super::*;
    use pulsar_plugin_api::testing::{count_ops, FakeModel};
    use pulsar_plugin_api::{FamilyBox, MetaValue, StepKind};

    /// The fixture's geometry: 4 heads, kv_lora 32, rope 16, nope 16, v 16;
    /// one dense layer then two MoE layers with 4 groups of 2 experts.
    fn model() -> FakeModel {
        let (e, h, kvl, rot, nope, vh, ffx, nx, v) = (64u64, 4u64, 32u64, 16u64, 16u64, 16u64, 32u64, 8u64, 100u64);
        let mut m = FakeModel::new()
            .u("deepseek2.block_count", 3)
            .u("deepseek2.embedding_length", e)
            .u("deepseek2.feed_forward_length", 64)
            .u("deepseek2.attention.head_count", h)
            .u("deepseek2.attention.head_count_kv", 1)
            .u("deepseek2.attention.key_length", kvl + rot)
            .u("deepseek2.attention.value_length", kvl)
            .u("deepseek2.attention.key_length_mla", nope + rot)
            .u("deepseek2.attention.value_length_mla", vh)
            .u("deepseek2.attention.q_lora_rank", 32)
            .u("deepseek2.attention.kv_lora_rank", kvl)
            .u("deepseek2.rope.dimension_count", rot)
            .s("deepseek2.rope.scaling.type", "yarn")
            .f("deepseek2.rope.scaling.factor", 40.0)
            .u("deepseek2.rope.scaling.original_context_length", 128)
            .f("deepseek2.rope.scaling.yarn_log_multiplier", 0.1)
            .f("deepseek2.rope.freq_base", 1e4)
            .f("deepseek2.attention.layer_norm_rms_epsilon", 1e-6)
            .u("deepseek2.expert_count", nx)
            .u("deepseek2.expert_used_count", 2)
            .u("deepseek2.expert_group_count", 4)
            .u("deepseek2.expert_group_used_count", 2)
            .u("deepseek2.expert_gating_func", 2)
            .u("deepseek2.leading_dense_block_count", 1)
            .u("deepseek2.expert_feed_forward_length", ffx)
            .u("deepseek2.expert_shared_count", 1)
            .f("deepseek2.expert_weights_scale", 2.5)
            .kv("deepseek2.expert_weights_norm", MetaValue::Bool(true))
            .u("deepseek2.context_length", 5120)
            .t("token_embd.weight", &[e, v])
            .t("output_norm.weight", &[e])
            .t("output.weight", &[e, v]);
        for l in 0..3 {
            let t = |s: &str| format!("blk.{l}.{s}");
            m = m
                .t(&t("attn_norm.weight"), &[e])
                .t(&t("attn_q_a.weight"), &[e, 32])
                .t(&t("attn_q_a_norm.weight"), &[32])
                .t(&t("attn_q_b.weight"), &[32, h * (nope + rot)])
                .t(&t("attn_kv_a_mqa.weight"), &[e, kvl + rot])
                .t(&t("attn_kv_a_norm.weight"), &[kvl])
                .t(&t("attn_k_b.weight"), &[nope, kvl, h])
                .t(&t("attn_v_b.weight"), &[kvl, vh, h])
                .t(&t("attn_output.weight"), &[h * vh, e])
                .t(&t("ffn_norm.weight"), &[e]);
            m = if l == 0 {
                m.t(&t("ffn_gate.weight"), &[e, 64]).t(&t("ffn_up.weight"), &[e, 64]).t(&t("ffn_down.weight"), &[64, e])
            } else {
                m.t(&t("ffn_gate_inp.weight"), &[e, nx])
                    .t(&t("exp_probs_b.bias"), &[nx])
                    .t(&t("ffn_gate_exps.weight"), &[e, ffx, nx])
                    .t(&t("ffn_up_exps.weight"), &[e, ffx, nx])
                    .t(&t("ffn_down_exps.weight"), &[ffx, e, nx])
                    .t(&t("ffn_gate_shexp.weight"), &[e, ffx])
                    .t(&t("ffn_up_shexp.weight"), &[e, ffx])
                    .t(&t("ffn_down_shexp.weight"), &[ffx, e])
            };
        }
        m
    }

    fn open(m: &FakeModel) -> Result<FamilyBox, String> {
        (plugin_module().open())("deepseek2".into(), m.view()).into_result().map_err(|e| e.into_string())
    }

    #[test]
    fn absorbed_mla_over_a_compact_cache_and_group_limited_routing() {
        let m = model();
        let fam = open(&m).unwrap();
        let plan = fam.plan();
        // [c, k_pe] per token as keys, c as values: 48 / 32 wide, one head.
        assert!(plan.states.iter().all(|s| s.as_kv() == Some((1, 48, 32, 0))));
        for kind in [StepKind::Decode, StepKind::Prefill] {
            let g = m.check_graph(&fam, kind).unwrap();
            assert_eq!(count_ops(&g, "experts"), 2);
            assert_eq!(count_ops(&g, "attention"), 3);
            // Two top_k a MoE layer for the groups, one for the experts.
            assert_eq!(count_ops(&g, "top_k"), 6);
            assert_eq!(count_ops(&g, "matmul"), 6);
        }
    }

    #[test]
    fn inconsistent_mla_and_group_configs_fail_at_open_naming_the_key() {
        let e = open(&model().u("deepseek2.attention.key_length", 40)).err().unwrap();
        assert!(e.contains("deepseek2.attention.key_length"), "{e}");
        let e = open(&model().u("deepseek2.expert_group_count", 3)).err().unwrap();
        assert!(e.contains("deepseek2.expert_group_count"), "{e}");
        let e = open(&model().u("deepseek2.expert_group_used_count", 0)).err().unwrap();
        assert!(e.contains("deepseek2.expert_group_count"), "{e}");
        let e = open(&model().s("deepseek2.rope.scaling.type", "longrope")).err().unwrap();
        assert!(e.contains("longrope"), "{e}");
        let e = open(&model().u("deepseek2.attention.head_count_kv", 4)).err().unwrap();
        assert!(e.contains("deepseek2.attention.head_count_kv"), "{e}");
    }
}
