//! MiniMax M2 and M3, `general.architecture = minimax-m2 | minimax-m3`.
//!
//! References: HF transformers `models/minimax_m2/modeling_minimax_m2.py`
//! (`MiniMaxM2ForCausalLM`) and `models/minimax_m3_vl/modeling_minimax_m3_vl.py`
//! (`MiniMaxM3SparseForConditionalGeneration`, its text model), in
//! llama.cpp's GGUF dialect (`tools/refgen/check_numpy.py` states the maths
//! the fixtures are checked with).
//!
//! Features: GQA; q/k RMS norms over the whole projection (all heads
//! together, before the heads are split); partial NeoX RoPE
//! (`rope.dimension_count` of `key_length` dims); every layer MoE with a
//! sigmoid router whose selection-only bias (`exp_probs_b.bias`) chooses the
//! top-k, the chosen unbiased scores renormalised (llama.cpp fixes that for
//! this architecture; `expert_weights_norm` may say otherwise) and scaled by
//! `expert_weights_scale` when the file has one; SwiGLU experts.
//!
//! M3's differences: per-head q/k norms (after the split); leading dense
//! layers (`leading_dense_block_count`); swiglu_oai (GPT-OSS's clamped
//! SwiGLU, fixed constants) in the dense, routed and shared FFNs; one shared
//! expert added to the routed ones; and on the layers with an indexer
//! (`blk.N.indexer.*`) MiniMax sparse attention: a lightning indexer scores
//! every cached key per index head (one a KV head), blocks of
//! `attention.indexer.block_size` keys are chosen per query (its own block
//! and `local_blocks - 1` before it, then the best up to
//! `attention.indexer.top_k`), and the query heads of each KV group attend
//! the chosen blocks only. That attention is composed (k, v and the index
//! keys live in rows states; matmul, mask, `block_select`, softmax), since
//! the fused attention op takes no mask. The norm weights of M3 files are
//! already `1 + w` (the converter bakes Gemma's offset in).

use pulsar_plugin_api::blocks::{Ffn, Router, Scores};
use pulsar_plugin_api::{Act, Attention, ChatSpec, Dim, Experts, FamilyPlugin, Graph, OpenCx, PluginError, Role, Rope, RopeMode, ThinkingMarkers, Val, Wt};

/// Which MiniMax generation a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gen {
    M2,
    M3,
}

/// M3's lightning indexer (`attention.indexer.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Indexer {
    pub n_head: u32,
    pub head_dim: u32,
    pub block: u32,
    pub top_k: u32,
    pub local: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub gen: Gen,
    pub n_layers: u32,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
    pub n_rot: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_ff_exp: u32,
    pub weights_norm: bool,
    pub weights_scale: f32,
    pub eps: f32,
    pub rope_base: f32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
    /// M3: layers below this run a dense FFN of `n_ff`.
    pub n_dense: u32,
    pub n_ff: u32,
    /// M3: shared experts (0 or 1) and their width.
    pub n_shared: u32,
    pub n_ff_shexp: u32,
    pub indexer: Option<Indexer>,
}

impl Config {
    pub fn parse(cx: &OpenCx<'_>) -> Result<Config, PluginError> {
        let gen = if cx.arch() == "minimax-m3" { Gen::M3 } else { Gen::M2 };
        let (n_head, n_kv_head) = cx.gqa_heads()?;
        let n_embd = cx.u32(&cx.key("embedding_length"))?;
        let head_dim = cx.u32(&cx.key("attention.key_length"))?;
        let dv = cx.u32(&cx.key("attention.value_length"))?;
        if dv != head_dim {
            return Err(PluginError::Unsupported(format!("key_length {head_dim} != value_length {dv}")));
        }
        let n_rot = cx.opt_u32(&cx.key("rope.dimension_count"))?.unwrap_or(head_dim);
        if n_rot == 0 || n_rot > head_dim || n_rot % 2 != 0 {
            return Err(PluginError::BadValue { key: cx.key("rope.dimension_count"), why: format!("{n_rot} rotated dims of a {head_dim}-wide head") });
        }
        let n_expert = cx.u32(&cx.key("expert_count"))?;
        let n_expert_used = cx.u32(&cx.key("expert_used_count"))?;
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(PluginError::BadValue { key: cx.key("expert_used_count"), why: format!("{n_expert_used} experts used of {n_expert}") });
        }
        match cx.opt_u32(&cx.key("expert_gating_func"))? {
            Some(2) | None => {}
            Some(g) => return Err(PluginError::BadValue { key: cx.key("expert_gating_func"), why: format!("gating {g}: MiniMax routes with a sigmoid (2)") }),
        }
        let weights_norm = match cx.meta(&cx.key("expert_weights_norm")) {
            Some(_) => cx.bool(&cx.key("expert_weights_norm"))?,
            None => true,
        };
        let weights_scale = cx.opt_f32(&cx.key("expert_weights_scale"))?.unwrap_or(1.0);
        if !(weights_scale.is_finite() && weights_scale > 0.0) {
            return Err(PluginError::BadValue { key: cx.key("expert_weights_scale"), why: format!("{weights_scale} is not a positive scale") });
        }
        let n_layers = cx.u32(&cx.key("block_count"))?;
        let (mut n_dense, mut n_ff, mut n_shared, mut n_ff_shexp, mut indexer) = (0, 0, 0, 0, None);
        if gen == Gen::M3 {
            n_dense = cx.opt_u32(&cx.key("leading_dense_block_count"))?.unwrap_or(0).min(n_layers);
            if n_dense > 0 {
                n_ff = cx.u32(&cx.key("feed_forward_length"))?;
            }
            n_shared = cx.opt_u32(&cx.key("expert_shared_count"))?.unwrap_or(0);
            if n_shared > 1 {
                return Err(PluginError::BadValue { key: cx.key("expert_shared_count"), why: format!("{n_shared} shared experts (one is supported: the file has one ffn_*_shexp per layer)") });
            }
            if let Some(n_head_i) = cx.opt_u32(&cx.key("attention.indexer.head_count"))? {
                let ix = Indexer {
                    n_head: n_head_i,
                    head_dim: cx.u32(&cx.key("attention.indexer.key_length"))?,
                    block: cx.u32(&cx.key("attention.indexer.block_size"))?,
                    top_k: cx.u32(&cx.key("attention.indexer.top_k"))?,
                    local: cx.opt_u32(&cx.key("attention.indexer.local_blocks"))?.unwrap_or(0),
                };
                if ix.n_head != n_kv_head {
                    return Err(PluginError::BadValue { key: cx.key("attention.indexer.head_count"), why: format!("{} index heads for {n_kv_head} KV heads (one a KV group)", ix.n_head) });
                }
                if ix.block == 0 || ix.top_k == 0 || ix.local > ix.top_k {
                    return Err(PluginError::BadValue { key: cx.key("attention.indexer.top_k"), why: format!("blocks of {}, top {}, {} local", ix.block, ix.top_k, ix.local) });
                }
                if ix.head_dim % 2 != 0 {
                    return Err(PluginError::BadValue { key: cx.key("attention.indexer.key_length"), why: format!("{} is odd (it is rotated)", ix.head_dim) });
                }
                indexer = Some(ix);
            }
        }
        if n_shared == 1 {
            n_ff_shexp = cx.opt_u32(&cx.key("expert_shared_feed_forward_length"))?.unwrap_or(cx.u32(&cx.key("expert_feed_forward_length"))?);
        }
        Ok(Config {
            gen,
            n_dense,
            n_ff,
            n_shared,
            n_ff_shexp,
            indexer,
            n_layers,
            n_embd,
            n_head,
            n_kv_head,
            head_dim,
            n_rot,
            n_expert,
            n_expert_used,
            n_ff_exp: cx.u32(&cx.key("expert_feed_forward_length"))?,
            weights_norm,
            weights_scale,
            eps: cx.f32(&cx.key("attention.layer_norm_rms_epsilon"))?,
            rope_base: cx.f32(&cx.key("rope.freq_base"))?,
            n_vocab: cx.n_vocab("token_embd.weight")?,
            n_ctx_train: cx.u32(&cx.key("context_length"))?,
        })
    }
}

/// A layer's attention: over a KV state, or M3's sparse attention over rows
/// states (k, v, index keys) with its indexer's weights.
enum Attn {
    Kv(u32),
    Sparse { k: u32, v: u32, idx: u32, iq: Wt, ik: Wt, iq_norm: Wt, ik_norm: Wt },
}

/// A layer's FFN.
enum Mlp {
    Dense(Ffn),
    Moe { router: Wt, bias: Wt, gate_exps: Wt, up_exps: Wt, down_exps: Wt, shared: Option<Ffn> },
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
    attn: Attn,
    mlp: Mlp,
}

pub struct MiniMax {
    pub cfg: Config,
    tok_embd: Wt,
    output_norm: Wt,
    output: Wt,
    layers: Vec<Layer>,
}

impl FamilyPlugin for MiniMax {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let cfg = Config::parse(cx)?;
        let m3 = cfg.gen == Gen::M3;
        let (e, hd) = (cfg.n_embd as u64, cfg.head_dim as u64);
        let (nq, nkv) = (cfg.n_head as u64 * hd, cfg.n_kv_head as u64 * hd);
        let (nx, ff) = (cfg.n_expert as u64, cfg.n_ff_exp as u64);
        // M2 norms q and k over the whole projection; M3 per head.
        let (qn, kn) = if m3 { (hd, hd) } else { (nq, nkv) };
        let tok_embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, cfg.n_vocab as u64])?;
        let output_norm = cx.weight_shaped("output_norm.weight", Role::Norm, None, &[e])?;
        let output = match cx.opt_weight("output.weight", Role::Output, None)? {
            Some(_) => cx.weight_shaped("output.weight", Role::Output, None, &[e, cfg.n_vocab as u64])?,
            None => tok_embd,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers as usize);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let ffn = |cx: &mut OpenCx<'_>, sfx: &str, role: Role, width: u64| -> Result<Ffn, PluginError> {
                Ok(Ffn {
                    gate: cx.weight_shaped(&n(&format!("ffn_gate{sfx}.weight")), role, Some(l), &[e, width])?,
                    up: cx.weight_shaped(&n(&format!("ffn_up{sfx}.weight")), role, Some(l), &[e, width])?,
                    down: cx.weight_shaped(&n(&format!("ffn_down{sfx}.weight")), role, Some(l), &[width, e])?,
                })
            };
            let mlp = if l < cfg.n_dense {
                Mlp::Dense(ffn(cx, "", Role::Dense, cfg.n_ff as u64)?)
            } else {
                let mut w = |s: &str, role: Role, dims: &[u64]| cx.weight_shaped(&n(s), role, Some(l), dims);
                let (router, bias) = (w("ffn_gate_inp.weight", Role::Router, &[e, nx])?, w("exp_probs_b.bias", Role::Router, &[nx])?);
                let (gate_exps, up_exps) = (w("ffn_gate_exps.weight", Role::RoutedExpert, &[e, ff, nx])?, w("ffn_up_exps.weight", Role::RoutedExpert, &[e, ff, nx])?);
                let down_exps = w("ffn_down_exps.weight", Role::RoutedExpert, &[ff, e, nx])?;
                let shared = if cfg.n_shared == 1 { Some(ffn(cx, "_shexp", Role::SharedExpert, cfg.n_ff_shexp as u64)?) } else { None };
                Mlp::Moe { router, bias, gate_exps, up_exps, down_exps, shared }
            };
            let sparse = match cfg.indexer {
                Some(_) => cx.opt_weight(&n("indexer.q_proj.weight"), Role::Attention, Some(l))?.is_some(),
                None => false,
            };
            let attn = match (sparse, cfg.indexer) {
                (true, Some(ix)) => {
                    let (ih, id) = (ix.n_head as u64, ix.head_dim as u64);
                    let mut w = |s: &str, role: Role, dims: &[u64]| cx.weight_shaped(&n(s), role, Some(l), dims);
                    let (iq, ik) = (w("indexer.q_proj.weight", Role::Attention, &[e, ih * id])?, w("indexer.k_proj.weight", Role::Attention, &[e, id])?);
                    let (iq_norm, ik_norm) = (w("indexer.q_norm.weight", Role::Norm, &[id])?, w("indexer.k_norm.weight", Role::Norm, &[id])?);
                    let kvw = cfg.n_kv_head * cfg.head_dim;
                    Attn::Sparse { k: cx.rows_state(l, kvw), v: cx.rows_state(l, kvw), idx: cx.rows_state(l, ix.head_dim), iq, ik, iq_norm, ik_norm }
                }
                _ => Attn::Kv(cx.kv_cache(l, cfg.n_kv_head, cfg.head_dim, cfg.head_dim, 0)),
            };
            let mut w = |s: &str, role: Role, dims: &[u64]| cx.weight_shaped(&n(s), role, Some(l), dims);
            layers.push(Layer {
                attn_norm: w("attn_norm.weight", Role::Norm, &[e])?,
                wq: w("attn_q.weight", Role::Attention, &[e, nq])?,
                wk: w("attn_k.weight", Role::Attention, &[e, nkv])?,
                wv: w("attn_v.weight", Role::Attention, &[e, nkv])?,
                wo: w("attn_output.weight", Role::Attention, &[nq, e])?,
                q_norm: w("attn_q_norm.weight", Role::Norm, &[qn])?,
                k_norm: w("attn_k_norm.weight", Role::Norm, &[kn])?,
                ffn_norm: w("ffn_norm.weight", Role::Norm, &[e])?,
                attn,
                mlp,
            });
        }
        cx.set_dims(cfg.n_layers, cfg.n_embd, cfg.n_vocab, cfg.n_ctx_train);
        Ok(MiniMax { cfg, tok_embd, output_norm, output, layers })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let m3 = c.gen == Gen::M3;
        let act = if m3 { Act::SwigluOai } else { Act::Silu };
        let rope = Rope::new(c.n_rot, c.rope_base, RopeMode::Neox);
        let ids = g.tokens()?;
        let mut x = g.embed(self.tok_embd, ids, 1.0)?;
        for (il, w) in self.layers.iter().enumerate() {
            let l = il as u32;
            let h = g.rms_norm(x, Some(w.attn_norm), c.eps)?;
            let q = g.linear(w.wq, h)?;
            let k = g.linear(w.wk, h)?;
            let v = g.linear(w.wv, h)?;
            let (q, k) = if m3 {
                let q = g.split_heads(q, c.n_head, c.head_dim)?;
                let k = g.split_heads(k, c.n_kv_head, c.head_dim)?;
                (g.rms_norm(q, Some(w.q_norm), c.eps)?, g.rms_norm(k, Some(w.k_norm), c.eps)?)
            } else {
                // M2: the q/k norms run over every head at once, before the split.
                let q = g.rms_norm(q, Some(w.q_norm), c.eps)?;
                let k = g.rms_norm(k, Some(w.k_norm), c.eps)?;
                (g.split_heads(q, c.n_head, c.head_dim)?, g.split_heads(k, c.n_kv_head, c.head_dim)?)
            };
            let v = g.split_heads(v, c.n_kv_head, c.head_dim)?;
            let q = g.rope(q, rope)?;
            let k = g.rope(k, rope)?;
            let scale = 1.0 / (c.head_dim as f32).sqrt();
            let a = match &w.attn {
                Attn::Kv(state) => {
                    let a = g.attention(q, k, v, Attention { state: *state, scale, window: 0, softcap: 0.0 })?;
                    g.merge_heads(a)?
                }
                Attn::Sparse { .. } => self.sparse_attention(g, w, h, q, k, v)?,
            };
            let a = g.linear(w.wo, a)?;
            let a = g.name(a, "attn_out", Some(l));
            x = g.add(x, a)?;
            let h = g.rms_norm(x, Some(w.ffn_norm), c.eps)?;
            let f = match &w.mlp {
                Mlp::Dense(ffn) => ffn.glu(g, h, act)?,
                Mlp::Moe { router, bias, gate_exps, up_exps, down_exps, shared } => {
                    // Sigmoid scores; the bias only chooses.
                    let r = Router { weight: *router, scores: Scores::Sigmoid, bias: Some(*bias), top_k: c.n_expert_used, renormalize: c.weights_norm, scale: c.weights_scale };
                    let (sel, sw) = r.route(g, h)?;
                    let spec = Experts { layer: l, gate: *gate_exps, up: *up_exps, down: *down_exps, act };
                    let f = g.experts(h, sel, sw, spec)?;
                    match shared {
                        Some(sh) => {
                            let s = sh.glu(g, h, act)?;
                            g.add(f, s)?
                        }
                        None => f,
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
        let (tpl, think) = match self.cfg.gen {
            Gen::M2 => (M2_TEMPLATE, ("<think>", "</think>")),
            Gen::M3 => (M3_TEMPLATE, ("<mm:think>", "</mm:think>")),
        };
        ChatSpec {
            fallback_template: Some(tpl.into()).into(),
            stop_markers: vec!["[e~[".into()].into(),
            thinking: Some(ThinkingMarkers { open: think.0.into(), close: think.1.into() }).into(),
        }
    }
}

/// MiniMax M2's turns, for GGUFs without `tokenizer.chat_template` (plain
/// conversations render as the published template renders them:
/// `host/tests/parity.rs` checks it).
pub const M2_TEMPLATE: &str = r#"{{ ']~!b[' }}{% set ns = namespace(sys='You are a helpful assistant.') %}{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% endif %}{% endfor %}{{ ']~b]system
' ~ ns.sys ~ '[e~[
' }}{% for m in messages %}{% if m['role'] == 'user' %}{{ ']~b]user
' ~ m['content'] ~ '[e~[
' }}{% elif m['role'] == 'assistant' %}{{ ']~b]ai
' ~ m['content'] ~ '[e~[
' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ ']~b]ai
<think>
' }}{% endif %}"#;

/// MiniMax M3's turn markers (the system turn as its developer turn, answers
/// after an empty thinking section). The published template also writes
/// MiniMax's own system text and thinking instructions, which this fallback
/// leaves out: M3 GGUFs carry their template.
pub const M3_TEMPLATE: &str = r#"{{ ']~!b[' }}{% for m in messages %}{% if m['role'] == 'system' %}{{ ']~b]developer
' ~ m['content'] ~ '[e~[
' }}{% elif m['role'] == 'user' %}{{ ']~b]user
' ~ m['content'] ~ '[e~[
' }}{% elif m['role'] == 'assistant' %}{{ ']~b]ai
</mm:think>' ~ m['content'] ~ '[e~[
' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ ']~b]ai
' }}{% endif %}"#;

impl MiniMax {
    /// M3's sparse attention on `q` `[T, H, D]`, `k` / `v` `[T, Hkv, D]`
    /// (normed and rotated), `h` the layer's normed input: `[T, H * D]`.
    fn sparse_attention(&self, g: &mut Graph<'_>, w: &Layer, h: Val, q: Val, k: Val, v: Val) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let (Attn::Sparse { k: ks, v: vs, idx, iq, ik, iq_norm, ik_norm }, Some(ix)) = (&w.attn, c.indexer) else {
            return Err(PluginError::Unsupported("sparse attention on a layer without an indexer".into()));
        };
        let (hkv, d, grp) = (c.n_kv_head as u64, c.head_dim as u64, (c.n_head / c.n_kv_head) as u64);
        let n = |x: u64| Dim::N(x);
        // The caches: [C, Hkv * D] each, as [Hkv, 1, D, C] (k) and [Hkv, 1, C, D] (v).
        let kf = g.merge_heads(k)?;
        let kc = g.state_rows(*ks, kf)?;
        let kc = g.reshape(kc, &[Dim::C, n(hkv), n(d)])?;
        let kc = g.permute(kc, &[1, 2, 0])?;
        let kc = g.reshape(kc, &[n(hkv), n(1), n(d), Dim::C])?;
        let vf = g.merge_heads(v)?;
        let vc = g.state_rows(*vs, vf)?;
        let vc = g.reshape(vc, &[Dim::C, n(hkv), n(d)])?;
        let vc = g.permute(vc, &[1, 0, 2])?;
        let vc = g.reshape(vc, &[n(hkv), n(1), Dim::C, n(d)])?;
        // Queries by KV group: [Hkv, G, T, D] (head h = group * G + g).
        let qg = g.reshape(q, &[Dim::T, n(hkv), n(grp), n(d)])?;
        let qg = g.permute(qg, &[1, 2, 0, 3])?;
        let s = g.matmul(qg, kc)?; // [Hkv, G, T, C]
        let s = g.scale(s, 1.0 / (d as f32).sqrt())?;
        // The indexer: per index head, q·k of every cached index key, causal.
        let rope_i = Rope::new(c.n_rot.min(ix.head_dim), c.rope_base, RopeMode::Neox);
        let iqv = g.linear(*iq, h)?;
        let iqv = g.split_heads(iqv, ix.n_head, ix.head_dim)?;
        let iqv = g.rms_norm(iqv, Some(*iq_norm), c.eps)?;
        let iqv = g.rope(iqv, rope_i)?;
        let iqv = g.permute(iqv, &[1, 0, 2])?; // [Hi, T, Di]
        let ikv = g.linear(*ik, h)?;
        let ikv = g.split_heads(ikv, 1, ix.head_dim)?;
        let ikv = g.rms_norm(ikv, Some(*ik_norm), c.eps)?;
        let ikv = g.rope(ikv, rope_i)?;
        let ikv = g.merge_heads(ikv)?; // [T, Di]
        let ikc = g.state_rows(*idx, ikv)?; // [C, Di]
        let ikc = g.permute(ikc, &[1, 0])?;
        let is = g.matmul(iqv, ikc)?; // [Hi, T, C]
        let causal = g.mask(0)?;
        let is = g.add(is, causal)?;
        let keep = g.block_select(is, ix.block, ix.top_k, ix.local)?;
        let keep = g.reshape(keep, &[n(hkv), n(1), Dim::T, Dim::C])?;
        let s = g.add(s, keep)?;
        let s = g.add(s, causal)?;
        let p = g.softmax(s, -1)?;
        let o = g.matmul(p, vc)?; // [Hkv, G, T, D]
        let o = g.permute(o, &[2, 0, 1, 3])?;
        g.reshape(o, &[Dim::T, n(c.n_head as u64 * d)])
    }
}

pulsar_plugin_api::export_plugin! {
    name: "minimax",
    families: { "minimax-m2" => MiniMax, "minimax-m3" => MiniMax },
}

#[cfg(test)]
mod tests {
    use super::*;
    use pulsar_plugin_api::testing::{count_ops, FakeModel};
use pulsar_plugin_api::{Dim, FamilyBox, StepKind};

    fn model() -> FakeModel {
        let (e, hd, nh, nkv, ff, nx, v) = (16u64, 8u64, 4u64, 2u64, 12u64, 8u64, 40u64);
        let mut m = FakeModel::new()
            .u("minimax-m2.block_count", 2)
            .u("minimax-m2.embedding_length", e)
            .u("minimax-m2.attention.head_count", nh)
            .u("minimax-m2.attention.head_count_kv", nkv)
            .u("minimax-m2.attention.key_length", hd)
            .u("minimax-m2.attention.value_length", hd)
            .u("minimax-m2.rope.dimension_count", 4)
            .u("minimax-m2.expert_count", nx)
            .u("minimax-m2.expert_used_count", 2)
            .u("minimax-m2.expert_feed_forward_length", ff)
            .u("minimax-m2.expert_gating_func", 2)
            .f("minimax-m2.attention.layer_norm_rms_epsilon", 1e-6)
            .f("minimax-m2.rope.freq_base", 5e6)
            .u("minimax-m2.context_length", 256)
            .t("token_embd.weight", &[e, v])
            .t("output_norm.weight", &[e])
            .t("output.weight", &[e, v]);
        for l in 0..2 {
            let t = |s: &str| format!("blk.{l}.{s}");
            m = m
                .t(&t("attn_norm.weight"), &[e])
                .t(&t("attn_q.weight"), &[e, nh * hd])
                .t(&t("attn_k.weight"), &[e, nkv * hd])
                .t(&t("attn_v.weight"), &[e, nkv * hd])
                .t(&t("attn_output.weight"), &[nh * hd, e])
                .t(&t("attn_q_norm.weight"), &[nh * hd])
                .t(&t("attn_k_norm.weight"), &[nkv * hd])
                .t(&t("ffn_norm.weight"), &[e])
                .t(&t("ffn_gate_inp.weight"), &[e, nx])
                .t(&t("exp_probs_b.bias"), &[nx])
                .t(&t("ffn_gate_exps.weight"), &[e, ff, nx])
                .t(&t("ffn_up_exps.weight"), &[e, ff, nx])
                .t(&t("ffn_down_exps.weight"), &[ff, e, nx]);
        }
        m
    }

    fn open_as(arch: &str, m: &FakeModel) -> Result<FamilyBox, String> {
        (plugin_module().open())(arch.into(), m.view()).into_result().map_err(|e| e.into_string())
    }

    fn open(m: &FakeModel) -> Result<FamilyBox, String> {
        open_as("minimax-m2", m)
    }

    #[test]
    fn whole_projection_norms_partial_rope_and_biased_sigmoid_routing() {
        let m = model();
        let fam = open(&m).unwrap();
        for kind in [StepKind::Decode, StepKind::Prefill] {
            let g = m.check_graph(&fam, kind).unwrap();
            assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(40)]);
            assert_eq!(count_ops(&g, "experts"), 2);
            assert_eq!(count_ops(&g, "rope"), 4);
            // The q norm runs on [T, H*D], before the split.
            let norms: Vec<usize> = g.ops.iter().enumerate().filter(|(_, o)| o.name() == "rms_norm").map(|(i, _)| g.shapes[i].rank()).collect();
            assert!(norms.iter().all(|&r| r == 2), "{norms:?}");
        }
        assert!(open(&m.clone().t("blk.1.attn_q_norm.weight", &[8])).err().unwrap().contains("blk.1.attn_q_norm.weight"));
    }

    /// An M3 file: a dense lead layer, then two MoE layers with an indexer
    /// and a shared expert.
    fn model_m3() -> FakeModel {
        let (e, hd, nh, nkv, ff, nx, v, di) = (16u64, 8u64, 4u64, 2u64, 12u64, 8u64, 40u64, 4u64);
        let a = "minimax-m3";
        let mut m = FakeModel::new()
            .s("general.architecture", a)
            .u(&format!("{a}.block_count"), 3)
            .u(&format!("{a}.embedding_length"), e)
            .u(&format!("{a}.feed_forward_length"), 20)
            .u(&format!("{a}.attention.head_count"), nh)
            .u(&format!("{a}.attention.head_count_kv"), nkv)
            .u(&format!("{a}.attention.key_length"), hd)
            .u(&format!("{a}.attention.value_length"), hd)
            .u(&format!("{a}.rope.dimension_count"), 4)
            .u(&format!("{a}.expert_count"), nx)
            .u(&format!("{a}.expert_used_count"), 2)
            .u(&format!("{a}.expert_feed_forward_length"), ff)
            .u(&format!("{a}.expert_shared_count"), 1)
            .u(&format!("{a}.expert_gating_func"), 2)
            .u(&format!("{a}.leading_dense_block_count"), 1)
            .u(&format!("{a}.attention.indexer.head_count"), nkv)
            .u(&format!("{a}.attention.indexer.key_length"), di)
            .u(&format!("{a}.attention.indexer.block_size"), 4)
            .u(&format!("{a}.attention.indexer.top_k"), 2)
            .u(&format!("{a}.attention.indexer.local_blocks"), 1)
            .f(&format!("{a}.attention.layer_norm_rms_epsilon"), 1e-6)
            .f(&format!("{a}.rope.freq_base"), 5e6)
            .u(&format!("{a}.context_length"), 256)
            .t("token_embd.weight", &[e, v])
            .t("output_norm.weight", &[e])
            .t("output.weight", &[e, v]);
        for l in 0..3 {
            let t = |s: &str| format!("blk.{l}.{s}");
            m = m
                .t(&t("attn_norm.weight"), &[e])
                .t(&t("attn_q.weight"), &[e, nh * hd])
                .t(&t("attn_k.weight"), &[e, nkv * hd])
                .t(&t("attn_v.weight"), &[e, nkv * hd])
                .t(&t("attn_output.weight"), &[nh * hd, e])
                .t(&t("attn_q_norm.weight"), &[hd])
                .t(&t("attn_k_norm.weight"), &[hd])
                .t(&t("ffn_norm.weight"), &[e]);
            m = if l == 0 {
                m.t(&t("ffn_gate.weight"), &[e, 20]).t(&t("ffn_up.weight"), &[e, 20]).t(&t("ffn_down.weight"), &[20, e])
            } else {
                m.t(&t("ffn_gate_inp.weight"), &[e, nx])
                    .t(&t("exp_probs_b.bias"), &[nx])
                    .t(&t("ffn_gate_exps.weight"), &[e, ff, nx])
                    .t(&t("ffn_up_exps.weight"), &[e, ff, nx])
                    .t(&t("ffn_down_exps.weight"), &[ff, e, nx])
                    .t(&t("ffn_gate_shexp.weight"), &[e, ff])
                    .t(&t("ffn_up_shexp.weight"), &[e, ff])
                    .t(&t("ffn_down_shexp.weight"), &[ff, e])
                    .t(&t("indexer.q_proj.weight"), &[e, nkv * di])
                    .t(&t("indexer.k_proj.weight"), &[e, di])
                    .t(&t("indexer.q_norm.weight"), &[di])
                    .t(&t("indexer.k_norm.weight"), &[di])
            };
        }
        m
    }

    fn open_m3(m: &FakeModel) -> Result<FamilyBox, String> {
        open_as("minimax-m3", m)
    }

    #[test]
    fn m3_has_sparse_attention_swiglu_oai_and_a_shared_expert() {
        let m = model_m3();
        let fam = open_m3(&m).unwrap();
        for kind in [StepKind::Decode, StepKind::Prefill] {
            let g = m.check_graph(&fam, kind).unwrap();
            assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(40)]);
            assert_eq!(count_ops(&g, "experts"), 2);
            assert_eq!(count_ops(&g, "block_select"), 2, "one a sparse layer");
            assert_eq!(count_ops(&g, "attention"), 1, "the dense lead layer's");
            assert_eq!(count_ops(&g, "state_rows"), 6, "k, v and index keys a sparse layer");
            // swiglu_oai in the dense lead FFN and both shared experts.
            let oai = g.ops.iter().filter(|o| matches!(o, pulsar_plugin_api::graph::Op::Glu(Act::SwigluOai))).count();
            assert_eq!(oai, 3);
        }
    }

    #[test]
    fn m3_bad_indexers_fail_at_open_naming_the_key() {
        let e = open_m3(&model_m3().u("minimax-m3.attention.indexer.head_count", 3)).err().unwrap();
        assert!(e.contains("minimax-m3.attention.indexer.head_count"), "{e}");
        let e = open_m3(&model_m3().u("minimax-m3.attention.indexer.local_blocks", 3)).err().unwrap();
        assert!(e.contains("minimax-m3.attention.indexer.top_k"), "{e}");
        let e = open_m3(&model_m3().without_tensor("blk.2.indexer.k_norm.weight")).err().unwrap();
        assert!(e.contains("blk.2.indexer.k_norm.weight"), "{e}");
    }

    #[test]
    fn bad_configs_fail_at_open_naming_the_key() {
        let e = open(&model().u("minimax-m2.rope.dimension_count", 9)).err().unwrap();
        assert!(e.contains("minimax-m2.rope.dimension_count"), "{e}");
        let e = open(&model().u("minimax-m2.expert_gating_func", 1)).err().unwrap();
        assert!(e.contains("minimax-m2.expert_gating_func"), "{e}");
        let e = open(&model().without_tensor("blk.0.exp_probs_b.bias")).err().unwrap();
        assert!(e.contains("blk.0.exp_probs_b.bias"), "{e}");
    }
}
