//! MiniMax M2, `general.architecture = minimax-m2`.
//!
//! Reference: HF transformers `models/minimax_m2/modeling_minimax_m2.py`
//! (`MiniMaxM2ForCausalLM`), in llama.cpp's GGUF dialect
//! (`tools/refgen/check_numpy.py` states the maths the fixture is checked
//! with).
//!
//! Features: GQA; q/k RMS norms over the whole projection (all heads
//! together, before the heads are split); partial NeoX RoPE
//! (`rope.dimension_count` of `key_length` dims); every layer MoE with a
//! sigmoid router whose selection-only bias (`exp_probs_b.bias`) chooses the
//! top-k, the chosen unbiased scores renormalised (llama.cpp fixes that for
//! this architecture; `expert_weights_norm` may say otherwise) and scaled by
//! `expert_weights_scale` when the file has one; SwiGLU experts. MiniMax M3
//! (`minimax-m3`: swiglu_oai experts, block-sparse attention) is not served
//! yet: its ops are listed in `docs/family-graphs.md`.

use pulsar_plugin_api::blocks::{Router, Scores};
use pulsar_plugin_api::{Act, Attention, ChatSpec, Experts, FamilyPlugin, Graph, OpenCx, PluginError, Role, Rope, RopeMode, Val, Wt};

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
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
}

impl Config {
    pub fn parse(cx: &OpenCx<'_>) -> Result<Config, PluginError> {
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
        Ok(Config {
            n_layers: cx.u32(&cx.key("block_count"))?,
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

struct Layer {
    attn_norm: Wt,
    wq: Wt,
    wk: Wt,
    wv: Wt,
    wo: Wt,
    q_norm: Wt,
    k_norm: Wt,
    ffn_norm: Wt,
    router: Wt,
    bias: Wt,
    gate_exps: Wt,
    up_exps: Wt,
    down_exps: Wt,
    kv: u32,
}

pub struct MiniMaxM2 {
    pub cfg: Config,
    tok_embd: Wt,
    output_norm: Wt,
    output: Wt,
    layers: Vec<Layer>,
}

impl FamilyPlugin for MiniMaxM2 {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let cfg = Config::parse(cx)?;
        let (e, hd) = (cfg.n_embd as u64, cfg.head_dim as u64);
        let (nq, nkv) = (cfg.n_head as u64 * hd, cfg.n_kv_head as u64 * hd);
        let (nx, ff) = (cfg.n_expert as u64, cfg.n_ff_exp as u64);
        let tok_embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, cfg.n_vocab as u64])?;
        let output_norm = cx.weight_shaped("output_norm.weight", Role::Norm, None, &[e])?;
        let output = match cx.opt_weight("output.weight", Role::Output, None)? {
            Some(_) => cx.weight_shaped("output.weight", Role::Output, None, &[e, cfg.n_vocab as u64])?,
            None => tok_embd,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers as usize);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let mut w = |s: &str, role: Role, dims: &[u64]| cx.weight_shaped(&n(s), role, Some(l), dims);
            layers.push(Layer {
                attn_norm: w("attn_norm.weight", Role::Norm, &[e])?,
                wq: w("attn_q.weight", Role::Attention, &[e, nq])?,
                wk: w("attn_k.weight", Role::Attention, &[e, nkv])?,
                wv: w("attn_v.weight", Role::Attention, &[e, nkv])?,
                wo: w("attn_output.weight", Role::Attention, &[nq, e])?,
                q_norm: w("attn_q_norm.weight", Role::Norm, &[nq])?,
                k_norm: w("attn_k_norm.weight", Role::Norm, &[nkv])?,
                ffn_norm: w("ffn_norm.weight", Role::Norm, &[e])?,
                router: w("ffn_gate_inp.weight", Role::Router, &[e, nx])?,
                bias: w("exp_probs_b.bias", Role::Router, &[nx])?,
                gate_exps: w("ffn_gate_exps.weight", Role::RoutedExpert, &[e, ff, nx])?,
                up_exps: w("ffn_up_exps.weight", Role::RoutedExpert, &[e, ff, nx])?,
                down_exps: w("ffn_down_exps.weight", Role::RoutedExpert, &[ff, e, nx])?,
                kv: cx.kv_cache(l, cfg.n_kv_head, cfg.head_dim, cfg.head_dim, 0),
            });
        }
        cx.set_dims(cfg.n_layers, cfg.n_embd, cfg.n_vocab, cfg.n_ctx_train);
        Ok(MiniMaxM2 { cfg, tok_embd, output_norm, output, layers })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let rope = Rope::new(c.n_rot, c.rope_base, RopeMode::Neox);
        let ids = g.tokens()?;
        let mut x = g.embed(self.tok_embd, ids, 1.0)?;
        for (il, w) in self.layers.iter().enumerate() {
            let l = il as u32;
            let h = g.rms_norm(x, Some(w.attn_norm), c.eps)?;
            let q = g.linear(w.wq, h)?;
            let k = g.linear(w.wk, h)?;
            let v = g.linear(w.wv, h)?;
            // The q/k norms run over every head at once, before the split.
            let q = g.rms_norm(q, Some(w.q_norm), c.eps)?;
            let k = g.rms_norm(k, Some(w.k_norm), c.eps)?;
            let q = g.split_heads(q, c.n_head, c.head_dim)?;
            let k = g.split_heads(k, c.n_kv_head, c.head_dim)?;
            let v = g.split_heads(v, c.n_kv_head, c.head_dim)?;
            let q = g.rope(q, rope)?;
            let k = g.rope(k, rope)?;
            let spec = Attention { state: w.kv, scale: 1.0 / (c.head_dim as f32).sqrt(), window: 0, softcap: 0.0 };
            let a = g.attention(q, k, v, spec)?;
            let a = g.merge_heads(a)?;
            let a = g.linear(w.wo, a)?;
            let a = g.name(a, "attn_out", Some(l));
            x = g.add(x, a)?;
            let h = g.rms_norm(x, Some(w.ffn_norm), c.eps)?;
            // Sigmoid scores; the bias only chooses.
            let router = Router { weight: w.router, scores: Scores::Sigmoid, bias: Some(w.bias), top_k: c.n_expert_used, renormalize: c.weights_norm, scale: c.weights_scale };
            let (sel, sw) = router.route(g, h)?;
            let spec = Experts { layer: l, gate: w.gate_exps, up: w.up_exps, down: w.down_exps, act: Act::Silu };
            let f = g.experts(h, sel, sw, spec)?;
            let f = g.name(f, "ffn_moe_out", Some(l));
            x = g.add(x, f)?;
            x = g.name(x, "l_out", Some(l));
        }
        let x = g.output_rows(x)?;
        let x = g.rms_norm(x, Some(self.output_norm), c.eps)?;
        let logits = g.linear(self.output, x)?;
        Ok(g.name(logits, "logits", None))
    }

    fn chat(&self) -> ChatSpec {
        ChatSpec::default()
    }
}

pulsar_plugin_api::export_plugin! {
    name: "minimax",
    families: { "minimax-m2" => MiniMaxM2 },
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

    fn open(m: &FakeModel) -> Result<FamilyBox, String> {
        (plugin_module().open())("minimax-m2".into(), m.view()).into_result().map_err(|e| e.into_string())
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
