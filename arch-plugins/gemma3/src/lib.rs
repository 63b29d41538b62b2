//! Gemma 3 (text), `general.architecture = gemma3`.
//!
//! Reference: HF transformers `models/gemma3/modeling_gemma3.py`
//! (`Gemma3ForCausalLM`), in the GGUF dialect of llama.cpp's converter:
//! norm weights are stored with the `1 +` already folded in, the output head is
//! tied to `token_embd`.
//!
//! Features: 5 sliding-window layers to 1 global (pattern from
//! `gemma3.attention.sliding_window_pattern` when present, else 6), two RoPE
//! bases (10 000 local, `rope.freq_base` global, linear scaling on global
//! layers only), GELU-tanh GLU, sandwich norms (pre and post of both blocks),
//! per-head q/k RMS norms, embeddings scaled by sqrt(n_embd).

use pulsar_plugin_api::blocks::Ffn;
use pulsar_plugin_api::{Act, Attention, ChatSpec, FamilyPlugin, Graph, OpenCx, PluginError, Role, Rope, RopeMode, Val, Wt};

/// The configuration, parsed once.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub n_layers: u32,
    pub n_embd: u32,
    pub n_ff: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
    pub eps: f32,
    pub rope_base_global: f32,
    pub rope_base_local: f32,
    pub rope_scale_global: f32,
    pub window: u32,
    /// Every `swa_pattern`-th layer is global.
    pub swa_pattern: u32,
    pub attn_scale: f32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
}

impl Config {
    pub fn is_global(&self, layer: u32) -> bool {
        (layer + 1) % self.swa_pattern == 0
    }

    pub fn parse(cx: &OpenCx<'_>) -> Result<Config, PluginError> {
        let n_layers = cx.u32(&cx.key("block_count"))?;
        let n_embd = cx.u32(&cx.key("embedding_length"))?;
        let (n_head, n_kv_head) = cx.gqa_heads()?;
        let head_dim = cx.u32(&cx.key("attention.key_length"))?;
        let head_dim_v = cx.u32(&cx.key("attention.value_length"))?;
        if head_dim_v != head_dim {
            return Err(PluginError::Unsupported(format!("key_length {head_dim} != value_length {head_dim_v}")));
        }
        let scaling = cx.meta(&cx.key("rope.scaling.type")).map(|_| cx.string(&cx.key("rope.scaling.type"))).transpose()?;
        let rope_scale_global = match scaling.as_deref() {
            None | Some("none") => 1.0,
            Some("linear") => cx.f32(&cx.key("rope.scaling.factor"))?,
            Some(other) => return Err(PluginError::Unsupported(format!("rope scaling `{other}`"))),
        };
        let n_vocab = cx.n_vocab("token_embd.weight")?;
        // llama.cpp's rule: the 27B model scales by 1/sqrt(n_embd / n_head)
        // (its query_pre_attn_scalar), the others by 1/sqrt(head_dim); GGUF
        // carries no key for it.
        let attn_scale = if n_layers == 62 {
            1.0 / ((n_embd / n_head) as f32).sqrt()
        } else {
            1.0 / (head_dim as f32).sqrt()
        };
        Ok(Config {
            n_layers,
            n_embd,
            n_ff: cx.u32(&cx.key("feed_forward_length"))?,
            n_head,
            n_kv_head,
            head_dim,
            eps: cx.f32(&cx.key("attention.layer_norm_rms_epsilon"))?,
            rope_base_global: cx.f32(&cx.key("rope.freq_base"))?,
            rope_base_local: 10_000.0,
            rope_scale_global,
            window: cx.u32(&cx.key("attention.sliding_window"))?,
            swa_pattern: cx.opt_u32(&cx.key("attention.sliding_window_pattern"))?.unwrap_or(6).max(1),
            attn_scale,
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
    post_attn_norm: Wt,
    ffn_norm: Wt,
    ffn: Ffn,
    post_ffn_norm: Wt,
    /// The layer's KV state.
    kv: u32,
}

pub struct Gemma3 {
    pub cfg: Config,
    tok_embd: Wt,
    output_norm: Wt,
    output: Wt,
    layers: Vec<Layer>,
}

impl FamilyPlugin for Gemma3 {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let cfg = Config::parse(cx)?;
        let (e, hd) = (cfg.n_embd as u64, cfg.head_dim as u64);
        let (nq, nkv, ff) = (cfg.n_head as u64 * hd, cfg.n_kv_head as u64 * hd, cfg.n_ff as u64);
        let tok_embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, cfg.n_vocab as u64])?;
        let output_norm = cx.weight_shaped("output_norm.weight", Role::Norm, None, &[e])?;
        let output = cx.opt_weight("output.weight", Role::Output, None)?.unwrap_or(tok_embd);
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
                post_attn_norm: w("post_attention_norm", Role::Norm, &[e])?,
                ffn_norm: w("ffn_norm", Role::Norm, &[e])?,
                ffn: Ffn { gate: w("ffn_gate", Role::Dense, &[e, ff])?, up: w("ffn_up", Role::Dense, &[e, ff])?, down: w("ffn_down", Role::Dense, &[ff, e])? },
                post_ffn_norm: w("post_ffw_norm", Role::Norm, &[e])?,
                kv: cx.kv_cache(l, cfg.n_kv_head, cfg.head_dim, cfg.head_dim, if cfg.is_global(l) { 0 } else { cfg.window }),
            });
        }
        cx.set_dims(cfg.n_layers, cfg.n_embd, cfg.n_vocab, cfg.n_ctx_train);
        Ok(Gemma3 { cfg, tok_embd, output_norm, output, layers })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let ids = g.tokens()?;
        let mut x = g.embed(self.tok_embd, ids, (c.n_embd as f32).sqrt())?;
        for (il, w) in self.layers.iter().enumerate() {
            let l = il as u32;
            let global = c.is_global(l);
            let rope = Rope {
                n_rot: c.head_dim,
                base: if global { c.rope_base_global } else { c.rope_base_local },
                linear_factor: if global { c.rope_scale_global } else { 1.0 },
                mode: RopeMode::Neox,
                yarn: None,
            };
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
            let spec = Attention { state: w.kv, scale: c.attn_scale, window: if global { 0 } else { c.window }, softcap: 0.0 };
            let a = g.attention(q, k, v, spec)?;
            let a = g.merge_heads(a)?;
            let a = g.linear(w.wo, a)?;
            let a = g.rms_norm(a, Some(w.post_attn_norm), c.eps)?;
            let a = g.name(a, "attn_out", Some(l));
            x = g.add(x, a)?;
            let h = g.rms_norm(x, Some(w.ffn_norm), c.eps)?;
            let f = w.ffn.glu(g, h, Act::GeluTanh)?;
            let f = g.rms_norm(f, Some(w.post_ffn_norm), c.eps)?;
            let f = g.name(f, "ffn_out", Some(l));
            x = g.add(x, f)?;
            x = g.name(x, "l_out", Some(l));
        }
        pulsar_plugin_api::blocks::lm_head(g, x, self.output_norm, self.output, c.eps)
    }

    fn chat(&self) -> ChatSpec {
        ChatSpec {
            fallback_template: Some(FALLBACK_TEMPLATE.into()).into(),
            stop_markers: vec!["<end_of_turn>".into()].into(),
            thinking: None.into(),
        }
    }
}

/// Gemma's turn format, used when the GGUF has no `tokenizer.chat_template`
/// (gemma-3-270m's has none). System text is folded into the first user turn,
/// as Gemma's own template does.
pub const FALLBACK_TEMPLATE: &str = r#"{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] ~ '\n\n' %}{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}{% for m in rest %}{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else 'user') ~ '\n' ~ (sys if loop.first else '') ~ (m['content'] | trim) ~ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"#;

pulsar_plugin_api::export_plugin! {
    name: "gemma3",
    families: { "gemma3" => Gemma3 },
}

#[cfg(test)]
mod tests;
