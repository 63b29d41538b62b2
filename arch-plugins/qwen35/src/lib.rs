//! Qwen3.5 / Qwen3.6 hybrids: `general.architecture = qwen35moe` (MoE, e.g.
//! Qwen3.6-35B-A3B) and `qwen35` (dense, e.g. the 27B).
//!
//! Reference: HF transformers `models/qwen3_5_moe/modeling_qwen3_5_moe.py`
//! (`Qwen3_5MoeForCausalLM`) and `models/qwen3_5/modeling_qwen3_5.py`
//! (`Qwen3_5ForCausalLM`), text path, in llama.cpp's GGUF dialect (the
//! converter stores `ssm_a = -exp(A_log)`, adds 1 to every zero-centred norm
//! weight but the gated one, and tiles the value heads: v head j reads k
//! head `j mod Hk`).
//!
//! Features: the layers `attention.recurrent_layers` marks are a gated delta
//! net: one projection to q|k|v through a short causal conv (its window is a
//! host-owned recurrent state) and SiLU, q/k L2-normalised, decay
//! `g = ssm_a · softplus(alpha + dt_bias)`, `beta = sigmoid(beta)`, the delta
//! rule on a host-owned `[Hv, Dk, Dv]` state, an RMS norm gated by
//! `silu(z)`. The others are gated full attention: q carries a per-head
//! sigmoid output gate, q/k RMS norms, partial rotary (`rope.dimension_count`;
//! M-RoPE's sections all hold the token position on the text path, which is
//! NeoX rope). FFN: qwen35moe a softmax top-k router (renormalised) plus a
//! shared SwiGLU expert scaled by `sigmoid(ffn_gate_inp_shexp · h)`; qwen35 a
//! dense SwiGLU. The last `nextn_predict_layers` blocks are the MTP head:
//! declared (resident, so speculative decoding can use them) and left out of
//! the graph.

use pulsar_plugin_api::blocks::{DeltaDims, Ffn, GatedDeltaNet, Router, Scores};
use pulsar_plugin_api::{
    Act, Attention, ChatSpec, Experts, FamilyPlugin, Graph, MetaValue, OpenCx, PluginError, Role, Rope, RopeMode, ThinkingMarkers, Val, Wt,
};

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub moe: bool,
    /// Layers of the trunk (`block_count` less the MTP blocks).
    pub n_layers: u32,
    pub n_mtp: u32,
    pub recurrent: Vec<bool>,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
    pub n_rot: u32,
    pub rope_base: f32,
    pub eps: f32,
    /// Delta net: conv kernel, k heads, v heads, key dim, value dim.
    pub conv_kernel: u32,
    pub hk: u32,
    pub hv: u32,
    pub dk: u32,
    pub dv: u32,
    pub n_ff: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_ff_exp: u32,
    pub n_ff_shexp: u32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
}

impl Config {
    pub fn parse(cx: &OpenCx<'_>) -> Result<Config, PluginError> {
        let moe = cx.arch() == "qwen35moe";
        let bad = |key: &str, why: String| PluginError::BadValue { key: cx.key(key), why };
        let n_blocks = cx.u32(&cx.key("block_count"))?;
        let n_mtp = cx.opt_u32(&cx.key("nextn_predict_layers"))?.unwrap_or(0);
        if n_mtp >= n_blocks {
            return Err(bad("nextn_predict_layers", format!("{n_mtp} MTP blocks of {n_blocks}")));
        }
        let n_layers = n_blocks - n_mtp;
        let recurrent: Vec<bool> = match cx.meta(&cx.key("attention.recurrent_layers")) {
            Some(MetaValue::Bools(b)) if b.len() == n_blocks as usize => b[..n_layers as usize].to_vec(),
            Some(MetaValue::Bools(b)) => return Err(bad("attention.recurrent_layers", format!("has {} entries for {n_blocks} blocks", b.len()))),
            Some(other) => return Err(PluginError::WrongType { key: cx.key("attention.recurrent_layers"), expected: "an array of bools", found: format!("{other:?}") }),
            None => {
                let every = cx.u32(&cx.key("full_attention_interval"))?;
                if every == 0 {
                    return Err(bad("full_attention_interval", "0".into()));
                }
                (0..n_layers).map(|l| (l + 1) % every != 0).collect()
            }
        };
        let (n_head, n_kv_head) = cx.gqa_heads()?;
        let head_dim = cx.u32(&cx.key("attention.key_length"))?;
        if let Some(dv) = cx.opt_u32(&cx.key("attention.value_length"))? {
            if dv != head_dim {
                return Err(PluginError::Unsupported(format!("key_length {head_dim} != value_length {dv}")));
            }
        }
        let n_rot = cx.opt_u32(&cx.key("rope.dimension_count"))?.unwrap_or(head_dim);
        if n_rot == 0 || n_rot > head_dim || n_rot % 2 != 0 {
            return Err(bad("rope.dimension_count", format!("{n_rot} does not fit head_dim {head_dim}")));
        }
        let DeltaDims { hk, hv, dk, dv, conv_kernel } = DeltaDims::parse(cx)?;
        let (mut n_ff, mut n_expert, mut n_expert_used, mut n_ff_exp, mut n_ff_shexp) = (0, 0, 0, 0, 0);
        if moe {
            n_expert = cx.u32(&cx.key("expert_count"))?;
            n_expert_used = cx.u32(&cx.key("expert_used_count"))?;
            if n_expert_used == 0 || n_expert_used > n_expert {
                return Err(bad("expert_used_count", format!("{n_expert_used} experts used of {n_expert}")));
            }
            n_ff_exp = cx.u32(&cx.key("expert_feed_forward_length"))?;
            n_ff_shexp = cx.u32(&cx.key("expert_shared_feed_forward_length"))?;
        } else {
            n_ff = cx.u32(&cx.key("feed_forward_length"))?;
        }
        Ok(Config {
            moe,
            n_layers,
            n_mtp,
            recurrent,
            n_embd: cx.u32(&cx.key("embedding_length"))?,
            n_head,
            n_kv_head,
            head_dim,
            n_rot,
            rope_base: cx.f32(&cx.key("rope.freq_base"))?,
            eps: cx.f32(&cx.key("attention.layer_norm_rms_epsilon"))?,
            conv_kernel,
            hk,
            hv,
            dk,
            dv,
            n_ff,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp,
            n_vocab: cx.n_vocab("token_embd.weight")?,
            n_ctx_train: cx.u32(&cx.key("context_length"))?,
        })
    }
}


struct AttnLayer {
    wq: Wt,
    wk: Wt,
    wv: Wt,
    wo: Wt,
    q_norm: Wt,
    k_norm: Wt,
    kv: u32,
}

enum Mixer {
    Delta(GatedDeltaNet),
    Attn(AttnLayer),
}

struct Moe {
    router: Wt,
    gate_exps: Wt,
    up_exps: Wt,
    down_exps: Wt,
    shared: Ffn,
    shared_gate: Wt,
}

enum Mlp {
    Dense(Ffn),
    Moe(Moe),
}

struct Layer {
    attn_norm: Wt,
    mixer: Mixer,
    ffn_norm: Wt,
    ffn: Mlp,
}

pub struct Qwen35 {
    pub cfg: Config,
    tok_embd: Wt,
    output_norm: Wt,
    output: Wt,
    layers: Vec<Layer>,
    /// The MTP blocks' weights (resident, out of the graph).
    pub mtp: Vec<Wt>,
}

/// Declares one block's tensors in the file's names.
struct Decl<'c, 'a> {
    cx: &'c mut OpenCx<'a>,
    l: u32,
    /// MTP blocks: every weight resident (`Role::Other`).
    mtp: bool,
    got: Vec<Wt>,
}

impl Decl<'_, '_> {
    fn w(&mut self, s: &str, role: Role, dims: &[u64]) -> Result<Wt, PluginError> {
        let role = if self.mtp { Role::Other } else { role };
        let w = self.cx.weight_shaped(&format!("blk.{}.{s}", self.l), role, Some(self.l), dims)?;
        self.got.push(w);
        Ok(w)
    }
}

impl Qwen35 {
    fn declare_layer(d: &mut Decl<'_, '_>, c: &Config, recurrent: bool) -> Result<Layer, PluginError> {
        let (e, hd) = (c.n_embd as u64, c.head_dim as u64);
        let attn_norm = d.w("attn_norm.weight", Role::Norm, &[e])?;
        let mixer = if recurrent {
            let dims = (c.hk, c.hv, c.dk, c.dv);
            let (window, state) = GatedDeltaNet::state_dims(dims, c.conv_kernel as u64);
            let states = (d.cx.recurrent_state(d.l, &window), d.cx.recurrent_state(d.l, &state));
            Mixer::Delta(GatedDeltaNet::declare(|n, r, dm| d.w(n, r, dm), states, e, dims, c.conv_kernel as u64, c.eps)?)
        } else {
            let (nq, nkv) = (c.n_head as u64 * hd, c.n_kv_head as u64 * hd);
            Mixer::Attn(AttnLayer {
                wq: d.w("attn_q.weight", Role::Attention, &[e, 2 * nq])?,
                wk: d.w("attn_k.weight", Role::Attention, &[e, nkv])?,
                wv: d.w("attn_v.weight", Role::Attention, &[e, nkv])?,
                wo: d.w("attn_output.weight", Role::Attention, &[nq, e])?,
                q_norm: d.w("attn_q_norm.weight", Role::Norm, &[hd])?,
                k_norm: d.w("attn_k_norm.weight", Role::Norm, &[hd])?,
                // An MTP block's cache belongs to a speculative decoder, not to this graph.
                kv: if d.mtp { u32::MAX } else { d.cx.kv_cache(d.l, c.n_kv_head, c.head_dim, c.head_dim, 0) },
            })
        };
        let ffn_norm = d.w("post_attention_norm.weight", Role::Norm, &[e])?;
        let ffn = if c.moe {
            let (nx, ffx, ffs) = (c.n_expert as u64, c.n_ff_exp as u64, c.n_ff_shexp as u64);
            Mlp::Moe(Moe {
                router: d.w("ffn_gate_inp.weight", Role::Router, &[e, nx])?,
                gate_exps: d.w("ffn_gate_exps.weight", Role::RoutedExpert, &[e, ffx, nx])?,
                up_exps: d.w("ffn_up_exps.weight", Role::RoutedExpert, &[e, ffx, nx])?,
                down_exps: d.w("ffn_down_exps.weight", Role::RoutedExpert, &[ffx, e, nx])?,
                shared: Ffn {
                    gate: d.w("ffn_gate_shexp.weight", Role::SharedExpert, &[e, ffs])?,
                    up: d.w("ffn_up_shexp.weight", Role::SharedExpert, &[e, ffs])?,
                    down: d.w("ffn_down_shexp.weight", Role::SharedExpert, &[ffs, e])?,
                },
                shared_gate: d.w("ffn_gate_inp_shexp.weight", Role::SharedExpert, &[e, 1])?,
            })
        } else {
            let ff = c.n_ff as u64;
            Mlp::Dense(Ffn {
                gate: d.w("ffn_gate.weight", Role::Dense, &[e, ff])?,
                up: d.w("ffn_up.weight", Role::Dense, &[e, ff])?,
                down: d.w("ffn_down.weight", Role::Dense, &[ff, e])?,
            })
        };
        Ok(Layer { attn_norm, mixer, ffn_norm, ffn })
    }

    /// The gated full attention mixer on the normed input `h`.
    fn attention(&self, g: &mut Graph<'_>, w: &AttnLayer, h: Val) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let hd = c.head_dim as u64;
        let rope = Rope::new(c.n_rot, c.rope_base, RopeMode::Neox);
        let qg = g.linear(w.wq, h)?;
        let qg = g.split_heads(qg, c.n_head, 2 * c.head_dim)?;
        let q = g.slice(qg, -1, 0, hd)?;
        let gate = g.slice(qg, -1, hd, hd)?;
        let k = g.linear(w.wk, h)?;
        let v = g.linear(w.wv, h)?;
        let k = g.split_heads(k, c.n_kv_head, c.head_dim)?;
        let v = g.split_heads(v, c.n_kv_head, c.head_dim)?;
        let q = g.rms_norm(q, Some(w.q_norm), c.eps)?;
        let k = g.rms_norm(k, Some(w.k_norm), c.eps)?;
        let q = g.rope(q, rope)?;
        let k = g.rope(k, rope)?;
        let spec = Attention { state: w.kv, scale: 1.0 / (c.head_dim as f32).sqrt(), window: 0, softcap: 0.0 };
        let a = g.attention(q, k, v, spec)?;
        let gate = g.sigmoid(gate)?;
        let a = g.mul(a, gate)?;
        let a = g.merge_heads(a)?;
        g.linear(w.wo, a)
    }

    fn ffn(&self, g: &mut Graph<'_>, f: &Mlp, l: u32, h: Val) -> Result<Val, PluginError> {
        let c = &self.cfg;
        match f {
            Mlp::Dense(d) => d.swiglu(g, h),
            Mlp::Moe(m) => {
                let router = Router { weight: m.router, scores: Scores::Softmax, bias: None, top_k: c.n_expert_used, renormalize: true, scale: 1.0 };
                let (ids, w) = router.route(g, h)?;
                let spec = Experts { layer: l, gate: m.gate_exps, up: m.up_exps, down: m.down_exps, act: Act::Silu };
                let routed = g.experts(h, ids, w, spec)?;
                let routed = g.name(routed, "ffn_moe_out", Some(l));
                let shared = m.shared.swiglu(g, h)?;
                let sg = g.linear(m.shared_gate, h)?;
                let sg = g.sigmoid(sg)?;
                let shared = g.mul(shared, sg)?;
                g.add(routed, shared)
            }
        }
    }
}

impl FamilyPlugin for Qwen35 {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let cfg = Config::parse(cx)?;
        let (e, v) = (cfg.n_embd as u64, cfg.n_vocab as u64);
        let tok_embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, v])?;
        let output_norm = cx.weight_shaped("output_norm.weight", Role::Norm, None, &[e])?;
        let output = match cx.opt_weight("output.weight", Role::Output, None)? {
            Some(_) => cx.weight_shaped("output.weight", Role::Output, None, &[e, v])?,
            None => tok_embd,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers as usize);
        for l in 0..cfg.n_layers {
            let mut d = Decl { cx, l, mtp: false, got: Vec::new() };
            layers.push(Self::declare_layer(&mut d, &cfg, cfg.recurrent[l as usize])?);
        }
        if cfg.recurrent.iter().all(|&r| r) {
            return Err(PluginError::Unsupported("every layer is recurrent: the hybrid needs a full-attention layer".into()));
        }
        // The MTP blocks: a full-attention block plus the nextn projections.
        let mut mtp = Vec::new();
        for l in cfg.n_layers..cfg.n_layers + cfg.n_mtp {
            let mut d = Decl { cx, l, mtp: true, got: Vec::new() };
            Self::declare_layer(&mut d, &cfg, false)?;
            d.w("nextn.eh_proj.weight", Role::Other, &[2 * e, e])?;
            for n in ["nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"] {
                d.w(n, Role::Other, &[e])?;
            }
            mtp.extend(d.got);
        }
        cx.set_dims(cfg.n_layers, cfg.n_embd, cfg.n_vocab, cfg.n_ctx_train);
        Ok(Qwen35 { cfg, tok_embd, output_norm, output, layers, mtp })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let ids = g.tokens()?;
        let mut x = g.embed(self.tok_embd, ids, 1.0)?;
        for (il, w) in self.layers.iter().enumerate() {
            let l = il as u32;
            let h = g.rms_norm(x, Some(w.attn_norm), c.eps)?;
            let a = match &w.mixer {
                Mixer::Delta(d) => d.forward(g, h, l)?,
                Mixer::Attn(at) => self.attention(g, at, h)?,
            };
            let a = g.name(a, "attn_out", Some(l));
            x = g.add(x, a)?;
            let h = g.rms_norm(x, Some(w.ffn_norm), c.eps)?;
            let f = self.ffn(g, &w.ffn, l, h)?;
            let f = g.name(f, "ffn_out", Some(l));
            x = g.add(x, f)?;
            x = g.name(x, "l_out", Some(l));
        }
        pulsar_plugin_api::blocks::lm_head(g, x, self.output_norm, self.output, c.eps)
    }

    fn chat(&self) -> ChatSpec {
        ChatSpec {
            fallback_template: Some(FALLBACK_TEMPLATE.into()).into(),
            stop_markers: vec!["<|im_end|>".into()].into(),
            thinking: Some(ThinkingMarkers { open: "<think>".into(), close: "</think>".into() }).into(),
        }
    }
}

/// ChatML, Qwen's turn format, for GGUFs without `tokenizer.chat_template`.
pub const FALLBACK_TEMPLATE: &str = pulsar_plugin_api::blocks::CHATML_TEMPLATE;

pulsar_plugin_api::export_plugin! {
    name: "qwen35",
    families: { "qwen35moe" => Qwen35, "qwen35" => Qwen35 },
}

#[cfg(test)]
mod tests;
