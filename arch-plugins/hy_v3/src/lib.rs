//! Hy3 (Hunyuan 3), `general.architecture = hy_v3`.
//!
//! Reference: HF transformers `models/hy_v3/modeling_hy_v3.py`
//! (`HYV3ForCausalLM`), in llama.cpp's GGUF dialect (the selection bias is
//! `blk.N.exp_probs_b`, no suffix; `tools/refgen/check_numpy.py` states the
//! maths the fixture is checked with).
//!
//! Features: GQA with per-head q/k RMS norms, NeoX RoPE; leading dense SwiGLU
//! layers (a layer is dense when it has `ffn_gate` and no router); MoE layers
//! with a sigmoid router whose selection-only bias chooses the top-k (the
//! weights are the unbiased scores), renormalised when
//! `expert_weights_norm`, scaled by `expert_weights_scale`, plus one shared
//! SwiGLU expert. `expert_gating_func` 1 (softmax) is accepted too. A GGUF
//! without `tokenizer.chat_template` has no chat fallback here: Hy3's
//! published template is not bundled.

use pulsar_plugin_api::blocks::{Ffn, Router, Scores};
use pulsar_plugin_api::{
    Act, Attention, ChatSpec, Experts, FamilyPlugin, Graph, OpenCx, PluginError, Role, Rope, RopeMode, ThinkingMarkers, Val, Wt,
};

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub n_layers: u32,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
    pub n_ff: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_ff_exp: u32,
    pub n_ff_shexp: u32,
    pub gating: Scores,
    pub weights_norm: bool,
    pub weights_scale: f32,
    pub eps: f32,
    pub rope_base: f32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
}

impl Config {
    pub fn parse(cx: &OpenCx<'_>) -> Result<Config, PluginError> {
        let (n_head, n_kv_head) = cx.gqa_heads()?;
        let n_embd = cx.u32(&cx.key("embedding_length"))?;
        let head_dim = cx.opt_u32(&cx.key("attention.key_length"))?.unwrap_or(n_embd / n_head);
        if let Some(dv) = cx.opt_u32(&cx.key("attention.value_length"))? {
            if dv != head_dim {
                return Err(PluginError::Unsupported(format!("key_length {head_dim} != value_length {dv}")));
            }
        }
        let n_expert = cx.u32(&cx.key("expert_count"))?;
        let n_expert_used = cx.u32(&cx.key("expert_used_count"))?;
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(PluginError::BadValue { key: cx.key("expert_used_count"), why: format!("{n_expert_used} experts used of {n_expert}") });
        }
        let gating = match cx.opt_u32(&cx.key("expert_gating_func"))? {
            Some(2) => Scores::Sigmoid,
            Some(1) => Scores::Softmax,
            None => return Err(PluginError::MissingKey(cx.key("expert_gating_func"))),
            Some(g) => return Err(PluginError::BadValue { key: cx.key("expert_gating_func"), why: format!("gating {g} (1 softmax, 2 sigmoid)") }),
        };
        let weights_norm = match cx.meta(&cx.key("expert_weights_norm")) {
            Some(_) => cx.bool(&cx.key("expert_weights_norm"))?,
            None => false,
        };
        let weights_scale = cx.opt_f32(&cx.key("expert_weights_scale"))?.unwrap_or(1.0);
        if !(weights_scale.is_finite() && weights_scale > 0.0) {
            return Err(PluginError::BadValue { key: cx.key("expert_weights_scale"), why: format!("{weights_scale} is not a positive scale") });
        }
        Ok(Config {
            n_layers: cx.u32(&cx.key("block_count"))?,
            n_embd,
            n_head,
            n_kv_head,
            head_dim,
            n_ff: cx.u32(&cx.key("feed_forward_length"))?,
            n_expert,
            n_expert_used,
            n_ff_exp: cx.u32(&cx.key("expert_feed_forward_length"))?,
            n_ff_shexp: cx.u32(&cx.key("expert_shared_feed_forward_length"))?,
            gating,
            weights_norm,
            weights_scale,
            eps: cx.f32(&cx.key("attention.layer_norm_rms_epsilon"))?,
            rope_base: cx.f32(&cx.key("rope.freq_base"))?,
            n_vocab: cx.n_vocab("token_embd.weight")?,
            n_ctx_train: cx.u32(&cx.key("context_length"))?,
        })
    }
}

struct Moe {
    router: Wt,
    bias: Wt,
    gate_exps: Wt,
    up_exps: Wt,
    down_exps: Wt,
    shared: Ffn,
}

enum Mlp {
    Dense(Ffn),
    Moe(Moe),
}

struct Layer {
    attn_norm: Wt,
    wq: Wt,
    wk: Wt,
    wv: Wt,
    wo: Wt,
    q_norm: Wt,
    k_norm: Wt,
    ffn_norm: Wt,
    ffn: Mlp,
    kv: u32,
}

pub struct HyV3 {
    pub cfg: Config,
    tok_embd: Wt,
    output_norm: Wt,
    output: Wt,
    layers: Vec<Layer>,
}

impl FamilyPlugin for HyV3 {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let cfg = Config::parse(cx)?;
        let (e, hd) = (cfg.n_embd as u64, cfg.head_dim as u64);
        let (nq, nkv) = (cfg.n_head as u64 * hd, cfg.n_kv_head as u64 * hd);
        let (nx, ff, ffx, ffs) = (cfg.n_expert as u64, cfg.n_ff as u64, cfg.n_ff_exp as u64, cfg.n_ff_shexp as u64);
        let tok_embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, cfg.n_vocab as u64])?;
        let output_norm = cx.weight_shaped("output_norm.weight", Role::Norm, None, &[e])?;
        let output = match cx.opt_weight("output.weight", Role::Output, None)? {
            Some(_) => cx.weight_shaped("output.weight", Role::Output, None, &[e, cfg.n_vocab as u64])?,
            None => tok_embd,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers as usize);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let moe_layer = cx.tensor(&n("ffn_gate_inp.weight")).is_some();
            let mut w = |s: &str, role: Role, dims: &[u64]| cx.weight_shaped(&n(s), role, Some(l), dims);
            let attn_norm = w("attn_norm.weight", Role::Norm, &[e])?;
            let wq = w("attn_q.weight", Role::Attention, &[e, nq])?;
            let wk = w("attn_k.weight", Role::Attention, &[e, nkv])?;
            let wv = w("attn_v.weight", Role::Attention, &[e, nkv])?;
            let wo = w("attn_output.weight", Role::Attention, &[nq, e])?;
            let q_norm = w("attn_q_norm.weight", Role::Norm, &[hd])?;
            let k_norm = w("attn_k_norm.weight", Role::Norm, &[hd])?;
            let ffn_norm = w("ffn_norm.weight", Role::Norm, &[e])?;
            let ffn = if moe_layer {
                Mlp::Moe(Moe {
                    router: w("ffn_gate_inp.weight", Role::Router, &[e, nx])?,
                    bias: w("exp_probs_b", Role::Router, &[nx])?,
                    gate_exps: w("ffn_gate_exps.weight", Role::RoutedExpert, &[e, ffx, nx])?,
                    up_exps: w("ffn_up_exps.weight", Role::RoutedExpert, &[e, ffx, nx])?,
                    down_exps: w("ffn_down_exps.weight", Role::RoutedExpert, &[ffx, e, nx])?,
                    shared: Ffn {
                        gate: w("ffn_gate_shexp.weight", Role::SharedExpert, &[e, ffs])?,
                        up: w("ffn_up_shexp.weight", Role::SharedExpert, &[e, ffs])?,
                        down: w("ffn_down_shexp.weight", Role::SharedExpert, &[ffs, e])?,
                    },
                })
            } else {
                Mlp::Dense(Ffn {
                    gate: w("ffn_gate.weight", Role::Dense, &[e, ff])?,
                    up: w("ffn_up.weight", Role::Dense, &[e, ff])?,
                    down: w("ffn_down.weight", Role::Dense, &[ff, e])?,
                })
            };
            let kv = cx.kv_cache(l, cfg.n_kv_head, cfg.head_dim, cfg.head_dim, 0);
            layers.push(Layer { attn_norm, wq, wk, wv, wo, q_norm, k_norm, ffn_norm, ffn, kv });
        }
        if !layers.iter().any(|l| matches!(l.ffn, Mlp::Moe(_))) {
            return Err(PluginError::Unsupported("no layer has a router (`blk.N.ffn_gate_inp.weight`): not a MoE model".into()));
        }
        cx.set_dims(cfg.n_layers, cfg.n_embd, cfg.n_vocab, cfg.n_ctx_train);
        Ok(HyV3 { cfg, tok_embd, output_norm, output, layers })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let rope = Rope::new(c.head_dim, c.rope_base, RopeMode::Neox);
        let ids = g.tokens()?;
        let mut x = g.embed(self.tok_embd, ids, 1.0)?;
        for (il, w) in self.layers.iter().enumerate() {
            let l = il as u32;
            let h = g.rms_norm(x, Some(w.attn_norm), c.eps)?;
            let q = g.linear(w.wq, h)?;
            let k = g.linear(w.wk, h)?;
            let v = g.linear(w.wv, h)?;
            let q = g.split_heads(q, c.n_head, c.head_dim)?;
            let k = g.split_heads(k, c.n_kv_head, c.head_dim)?;
            let v = g.split_heads(v, c.n_kv_head, c.head_dim)?;
            let q = g.rms_norm(q, Some(w.q_norm), c.eps)?;
            let k = g.rms_norm(k, Some(w.k_norm), c.eps)?;
            let q = g.rope(q, rope)?;
            let k = g.rope(k, rope)?;
            let spec = Attention { state: w.kv, scale: 1.0 / (c.head_dim as f32).sqrt(), window: 0, softcap: 0.0 };
            let a = g.attention(q, k, v, spec)?;
            let a = g.merge_heads(a)?;
            let a = g.linear(w.wo, a)?;
            let a = g.name(a, "attn_out", Some(l));
            x = g.add(x, a)?;
            let h = g.rms_norm(x, Some(w.ffn_norm), c.eps)?;
            let f = match &w.ffn {
                Mlp::Dense(d) => d.swiglu(g, h)?,
                Mlp::Moe(m) => {
                    let routed = self.routed(g, m, l, h)?;
                    let routed = g.name(routed, "ffn_moe_out", Some(l));
                    let shared = m.shared.swiglu(g, h)?;
                    g.add(routed, shared)?
                }
            };
            let f = g.name(f, "ffn_out", Some(l));
            x = g.add(x, f)?;
            x = g.name(x, "l_out", Some(l));
        }
        pulsar_plugin_api::blocks::lm_head(g, x, self.output_norm, self.output, c.eps)
    }

    fn chat(&self) -> ChatSpec {
        ChatSpec {
            fallback_template: Some(FALLBACK_TEMPLATE.into()).into(),
            stop_markers: vec!["<｜hy_eos:opensource｜>".into()].into(),
            thinking: Some(ThinkingMarkers { open: "<think:opensource>".into(), close: "</think:opensource>".into() }).into(),
        }
    }
}

/// Hy3's turns with reasoning off, for GGUFs without `tokenizer.chat_template`
/// (plain conversations render as the published template renders them:
/// `host/tests/parity.rs` checks it; an assistant turn that ends the
/// conversation has no end-of-sentence, as there).
pub const FALLBACK_TEMPLATE: &str = r#"{{ '<｜hy_begin_of_sentence:opensource｜>' }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}{{ '<｜reasoning_mode:opensource｜>reasoning_effort:no_think' }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜hy_User:opensource｜>' ~ m['content'] }}{% elif m['role'] == 'assistant' %}{{ '<｜hy_Assistant:opensource｜><think:opensource></think:opensource>' ~ m['content'] }}{% if not loop.last %}{{ '<｜hy_eos:opensource｜>' }}{% endif %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜hy_Assistant:opensource｜><think:opensource></think:opensource>' }}{% endif %}"#;

impl HyV3 {
    /// Scores (sigmoid or softmax), top-k chosen on scores + bias, the
    /// chosen unbiased scores (renormalised, scaled) as the experts' weights.
    fn routed(&self, g: &mut Graph<'_>, m: &Moe, layer: u32, h: Val) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let router = Router { weight: m.router, scores: c.gating, bias: Some(m.bias), top_k: c.n_expert_used, renormalize: c.weights_norm, scale: c.weights_scale };
        let (sel, sw) = router.route(g, h)?;
        let spec = Experts { layer, gate: m.gate_exps, up: m.up_exps, down: m.down_exps, act: Act::Silu };
        g.experts(h, sel, sw, spec)
    }
}

pulsar_plugin_api::export_plugin! {
    name: "hy_v3",
    families: { "hy_v3" => HyV3 },
}

#[cfg(test)]
mod tests;
