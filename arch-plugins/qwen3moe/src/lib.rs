//! Qwen3-MoE, `general.architecture = qwen3moe`.
//!
//! Reference: HF transformers `models/qwen3_moe/modeling_qwen3_moe.py`
//! (`Qwen3MoeForCausalLM`), in llama.cpp's GGUF dialect.
//!
//! Features: GQA with per-head q/k RMS norms, NeoX RoPE, every layer a MoE
//! block with a softmax top-k router whose selected weights are renormalised
//! (llama.cpp fixes `norm_topk_prob = true` for this arch; GGUF has no key).
//! Configurations with dense layers (`decoder_sparse_step != 1`,
//! `mlp_only_layers`) cannot be expressed in GGUF and are refused by shape
//! checks on the expert tensors.

use pulsar_plugin_api::blocks::{Router, Scores};
use pulsar_plugin_api::{
    Act, Attention, ChatSpec, Experts, FamilyPlugin, Graph, OpenCx, PluginError, Role, Rope, RopeMode, ThinkingMarkers,
    Val, Wt,
};

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub n_layers: u32,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_ff_exp: u32,
    pub eps: f32,
    pub rope_base: f32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
}

impl Config {
    pub fn parse(cx: &OpenCx<'_>) -> Result<Config, PluginError> {
        let (n_head, n_kv_head) = cx.gqa_heads()?;
        let n_embd = cx.u32(&cx.key("embedding_length"))?;
        let head_dim = match cx.opt_u32(&cx.key("attention.key_length"))? {
            Some(d) => d,
            None => n_embd / n_head,
        };
        if let Some(dv) = cx.opt_u32(&cx.key("attention.value_length"))? {
            if dv != head_dim {
                return Err(PluginError::Unsupported(format!("key_length {head_dim} != value_length {dv}")));
            }
        }
        let n_expert = cx.u32(&cx.key("expert_count"))?;
        let n_expert_used = cx.u32(&cx.key("expert_used_count"))?;
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(PluginError::BadValue {
                key: cx.key("expert_used_count"),
                why: format!("{n_expert_used} experts used of {n_expert}"),
            });
        }
        let n_vocab = cx.n_vocab("token_embd.weight")?;
        Ok(Config {
            n_layers: cx.u32(&cx.key("block_count"))?,
            n_embd,
            n_head,
            n_kv_head,
            head_dim,
            n_expert,
            n_expert_used,
            n_ff_exp: cx.u32(&cx.key("expert_feed_forward_length"))?,
            eps: cx.f32(&cx.key("attention.layer_norm_rms_epsilon"))?,
            rope_base: cx.f32(&cx.key("rope.freq_base"))?,
            n_vocab,
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
    gate_exps: Wt,
    up_exps: Wt,
    down_exps: Wt,
    /// The layer's KV state.
    kv: u32,
}

pub struct Qwen3Moe {
    pub cfg: Config,
    tok_embd: Wt,
    output_norm: Wt,
    output: Wt,
    layers: Vec<Layer>,
}

impl FamilyPlugin for Qwen3Moe {
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
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let mut w = |s: &str, role: Role, dims: &[u64]| cx.weight_shaped(&n(s), role, Some(l), dims);
            layers.push(Layer {
                attn_norm: w("attn_norm", Role::Norm, &[e])?,
                wq: w("attn_q", Role::Attention, &[e, nq])?,
                wk: w("attn_k", Role::Attention, &[e, nkv])?,
                wv: w("attn_v", Role::Attention, &[e, nkv])?,
                wo: w("attn_output", Role::Attention, &[nq, e])?,
                q_norm: w("attn_q_norm", Role::Norm, &[hd])?,
                k_norm: w("attn_k_norm", Role::Norm, &[hd])?,
                ffn_norm: w("ffn_norm", Role::Norm, &[e])?,
                router: w("ffn_gate_inp", Role::Router, &[e, nx])?,
                gate_exps: w("ffn_gate_exps", Role::RoutedExpert, &[e, ff, nx])?,
                up_exps: w("ffn_up_exps", Role::RoutedExpert, &[e, ff, nx])?,
                down_exps: w("ffn_down_exps", Role::RoutedExpert, &[ff, e, nx])?,
                kv: cx.kv_cache(l, cfg.n_kv_head, cfg.head_dim, cfg.head_dim, 0),
            });
        }
        cx.set_dims(cfg.n_layers, cfg.n_embd, cfg.n_vocab, cfg.n_ctx_train);
        Ok(Qwen3Moe { cfg, tok_embd, output_norm, output, layers })
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
            // Softmax router, top-k, the selected weights renormalised.
            let router = Router { weight: w.router, scores: Scores::Softmax, bias: None, top_k: c.n_expert_used, renormalize: true, scale: 1.0 };
            let (sel, sw) = router.route(g, h)?;
            let spec = Experts { layer: l, gate: w.gate_exps, up: w.up_exps, down: w.down_exps, act: Act::Silu };
            let f = g.experts(h, sel, sw, spec)?;
            let f = g.name(f, "ffn_moe_out", Some(l));
            x = g.add(x, f)?;
            x = g.name(x, "l_out", Some(l));
        }
        pulsar_plugin_api::blocks::lm_head(g, x, self.output_norm, self.output, c.eps)
    }

    fn chat(&self) -> ChatSpec {
        ChatSpec {
            fallback_template: Some(FALLBACK_TEMPLATE.into()).into(),
            stop_markers: vec!["<|im_end|>".into(), "<|endoftext|>".into()].into(),
            thinking: Some(ThinkingMarkers { open: "<think>".into(), close: "</think>".into() }).into(),
        }
    }
}

/// ChatML, Qwen's turn format, for GGUFs without `tokenizer.chat_template`.
pub const FALLBACK_TEMPLATE: &str = pulsar_plugin_api::blocks::CHATML_TEMPLATE;

pulsar_plugin_api::export_plugin! {
    name: "qwen3moe",
    families: { "qwen3moe" => Qwen3Moe },
}

#[cfg(test)]
mod tests {
    use super::*;
    use pulsar_plugin_api::testing::{count_ops, FakeModel};
use pulsar_plugin_api::{Dim, FamilyBox, StepKind};

    fn model() -> FakeModel {
        let (e, hd, nh, nkv, ff, nx, v) = (16u64, 8u64, 4u64, 2u64, 12u64, 8u64, 40u64);
        let mut m = FakeModel::new()
            .u("qwen3moe.block_count", 2)
            .u("qwen3moe.embedding_length", e)
            .u("qwen3moe.attention.head_count", nh)
            .u("qwen3moe.attention.head_count_kv", nkv)
            .u("qwen3moe.attention.key_length", hd)
            .u("qwen3moe.attention.value_length", hd)
            .u("qwen3moe.expert_count", nx)
            .u("qwen3moe.expert_used_count", 2)
            .u("qwen3moe.expert_feed_forward_length", ff)
            .f("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
            .f("qwen3moe.rope.freq_base", 1e6)
            .u("qwen3moe.context_length", 256)
            .t("token_embd.weight", &[e, v])
            .t("output_norm.weight", &[e])
            .t("output.weight", &[e, v]);
        for l in 0..2 {
            let t = |s: &str| format!("blk.{l}.{s}.weight");
            m = m
                .t(&t("attn_norm"), &[e])
                .t(&t("attn_q"), &[e, nh * hd])
                .t(&t("attn_k"), &[e, nkv * hd])
                .t(&t("attn_v"), &[e, nkv * hd])
                .t(&t("attn_output"), &[nh * hd, e])
                .t(&t("attn_q_norm"), &[hd])
                .t(&t("attn_k_norm"), &[hd])
                .t(&t("ffn_norm"), &[e])
                .t(&t("ffn_gate_inp"), &[e, nx])
                .t(&t("ffn_gate_exps"), &[e, ff, nx])
                .t(&t("ffn_up_exps"), &[e, ff, nx])
                .t(&t("ffn_down_exps"), &[ff, e, nx]);
        }
        m
    }

    fn open(m: &FakeModel) -> Result<FamilyBox, String> {
        (plugin_module().open())("qwen3moe".into(), m.view()).into_result().map_err(|e| e.into_string())
    }

    #[test]
    fn graph_is_shape_consistent_and_routes_experts() {
        let m = model();
        let fam = open(&m).unwrap();
        let plan = fam.plan();
        assert_eq!(plan.weights.iter().filter(|w| w.role == Role::RoutedExpert).count(), 6);
        assert_eq!(plan.states.len(), 2);
        for kind in [StepKind::Decode, StepKind::Prefill] {
            let g = m.check_graph(&fam, kind).unwrap();
            assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(40)]);
            assert_eq!(count_ops(&g, "experts"), 2);
            assert_eq!(count_ops(&g, "attention"), 2);
        }
    }

    #[test]
    fn bad_configs_fail_at_open_naming_the_key() {
        let e = open(&model().u("qwen3moe.expert_used_count", 9)).err().unwrap();
        assert!(e.contains("qwen3moe.expert_used_count"), "{e}");
        let e = open(&model().u("qwen3moe.attention.head_count_kv", 3)).err().unwrap();
        assert!(e.contains("head_count_kv"), "{e}");
        let e = open(&model().t("blk.1.ffn_down_exps.weight", &[12, 16, 7])).err().unwrap();
        assert!(e.contains("blk.1.ffn_down_exps.weight"), "{e}");
    }
}
