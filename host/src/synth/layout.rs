//! The families' synthetic twins: each real model's geometry (from its HF
//! config) and its GGUF dialect as llama.cpp's converter writes it (the
//! keys and tensor names of the fixtures under `fixtures/parity/`, which
//! the plugins read).
//!
//! - deepseek2 (DeepSeek-V3 671B, Kimi K2 1T): MLA in the absorbed layout
//!   (`attn_k_b` / `attn_v_b` split out of `kv_b`, one latent KV head),
//!   q_lora, YaRN keys, leading dense layers, expert groups, one shared
//!   expert, sigmoid routing with a selection bias (`exp_probs_b.bias`).
//! - hy_v3 (Hy3 295B): GQA with per-head q/k norms, one leading dense layer,
//!   a shared expert, sigmoid routing with a bias named `exp_probs_b`.
//! - minimax-m2 (MiniMax M2 230B): GQA with q/k norms over the whole
//!   projection, partial rotary, every layer MoE, sigmoid routing with a bias.

use pulsar_gguf::{GgmlType, Value};

use super::{residual_damp, PlanRole, SynthSpec, TensorPlan};

/// Multi-head latent attention's widths.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mla {
    pub q_lora: u32,
    pub kv_lora: u32,
    /// Per-head key dims without rotation, and value dims.
    pub nope: u32,
    pub v_head: u32,
}

/// YaRN's GGUF keys (`rope.scaling.*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnSpec {
    pub factor: f32,
    pub orig_ctx: u32,
    pub log_multiplier: f32,
}

/// The architectures `synth` writes.
pub const FAMILIES: [&str; 4] = ["qwen3moe", "deepseek2", "hy_v3", "minimax-m2"];

/// The named geometries of the families other than qwen3moe. `base` is a
/// qwen3moe-shaped spec whose defaults the presets override.
pub fn preset(name: &str, base: SynthSpec) -> Option<SynthSpec> {
    let ds = |n_layers, n_embd, n_head, n_expert, n_dense, n_group, n_group_used, weights_scale, n_vocab, rope_base, factor| SynthSpec {
        arch: "deepseek2".into(),
        n_layers,
        n_embd,
        n_head,
        n_kv_head: 1,
        head_dim: 0,
        n_expert,
        n_expert_used: 8,
        n_ff_exp: 2048,
        n_ctx: 4096,
        n_vocab,
        n_dense,
        n_ff: 18432,
        n_shared: 1,
        n_rot: 64,
        rope_base,
        weights_scale,
        n_group,
        n_group_used,
        mla: Some(Mla { q_lora: 1536, kv_lora: 512, nope: 128, v_head: 128 }),
        yarn: Some(YarnSpec { factor, orig_ctx: 4096, log_multiplier: 0.1 }),
        tok_pre: "deepseek-v3",
        ..base.clone()
    };
    let tiny = |s: SynthSpec| SynthSpec { expert_type: GgmlType::Q8_0, n_ctx: 512, ..s };
    Some(match name {
        // DeepseekV3Config's defaults (the 671B model): 61 layers, 3 dense, 256
        // experts in 8 groups of which 4 are used, YaRN x40 over 4096.
        "deepseek-v3-671b" => ds(61, 7168, 128, 256, 3, 8, 4, 2.5, 129280, 10000.0, 40.0),
        // Kimi K2: 384 experts, no groups, 1 dense layer, 64 heads.
        "kimi-k2-1t" => SynthSpec { tok_pre: "kimi-k2", ..ds(61, 7168, 64, 384, 1, 1, 1, 2.827, 163840, 50000.0, 32.0) },
        // HyV3Config's defaults (tencent/Hy3-preview): 80 layers, the first dense.
        "hy3-295b" => SynthSpec {
            arch: "hy_v3".into(),
            n_layers: 80,
            n_embd: 4096,
            n_head: 64,
            n_kv_head: 8,
            head_dim: 128,
            n_expert: 192,
            n_expert_used: 8,
            n_ff_exp: 1536,
            n_vocab: 120832,
            n_dense: 1,
            n_ff: 13312,
            n_shared: 1,
            rope_base: 11_158_840.0,
            weights_scale: 2.826,
            tok_pre: "hy_v4",
            ..base.clone()
        },
        // MiniMaxM2Config's defaults with the released rotary_dim 64.
        "minimax-m2-230b" => SynthSpec {
            arch: "minimax-m2".into(),
            n_layers: 62,
            n_embd: 3072,
            n_head: 48,
            n_kv_head: 8,
            head_dim: 128,
            n_expert: 256,
            n_expert_used: 8,
            n_ff_exp: 1536,
            n_vocab: 200064,
            n_rot: 64,
            rope_base: 5_000_000.0,
            tok_pre: "minimax-m2",
            ..base.clone()
        },
        // Small twins of the same dialects, for tests and quick runs.
        "tiny-deepseek2" => tiny(SynthSpec {
            n_ff_exp: 64,
            n_ff: 128,
            n_rot: 16,
            mla: Some(Mla { q_lora: 64, kv_lora: 64, nope: 32, v_head: 32 }),
            ..ds(4, 128, 4, 16, 1, 4, 2, 2.5, 300, 10000.0, 40.0)
        }),
        "tiny-kimi-k2" => tiny(SynthSpec {
            n_ff_exp: 64,
            n_ff: 128,
            n_rot: 16,
            tok_pre: "kimi-k2",
            mla: Some(Mla { q_lora: 64, kv_lora: 64, nope: 32, v_head: 32 }),
            ..ds(3, 128, 4, 16, 1, 1, 1, 2.827, 300, 50000.0, 32.0)
        }),
        "tiny-hy3" => tiny(SynthSpec { n_layers: 3, n_embd: 128, n_head: 4, n_kv_head: 2, head_dim: 32, n_expert: 16, n_ff_exp: 64, n_ff: 128, n_vocab: 300, ..preset("hy3-295b", base.clone())? }),
        "tiny-minimax-m2" => tiny(SynthSpec { n_layers: 3, n_embd: 128, n_head: 4, n_kv_head: 2, head_dim: 32, n_expert: 16, n_ff_exp: 64, n_rot: 16, n_vocab: 300, ..preset("minimax-m2-230b", base)? }),
        _ => return None,
    })
}

/// Set `key` (under the arch's prefix when it starts with '.') to `v`,
/// replacing a value already there.
fn set(kv: &mut Vec<(String, Value)>, arch: &str, key: &str, v: Value) {
    let key = if let Some(k) = key.strip_prefix('.') { format!("{arch}.{k}") } else { key.to_string() };
    match kv.iter_mut().find(|(k, _)| *k == key) {
        Some(e) => e.1 = v,
        None => kv.push((key, v)),
    }
}

/// The family's keys beyond (or instead of) qwen3moe's.
pub fn metadata(s: &SynthSpec, kv: &mut Vec<(String, Value)>) {
    let a = s.arch.as_str();
    let mut put = |k: &str, v: Value| set(kv, a, k, v);
    if s.n_ff > 0 {
        put(".feed_forward_length", s.n_ff.into());
    }
    put(".expert_gating_func", 2u32.into());
    if s.n_rot > 0 {
        put(".rope.dimension_count", s.n_rot.into());
    }
    match a {
        "deepseek2" => {
            put(".expert_shared_count", s.n_shared.into());
            let m = s.mla.expect("deepseek2 presets carry MLA widths");
            put(".attention.head_count_kv", 1u32.into());
            put(".attention.key_length", (m.kv_lora + s.n_rot).into());
            put(".attention.value_length", m.kv_lora.into());
            put(".attention.key_length_mla", (m.nope + s.n_rot).into());
            put(".attention.value_length_mla", m.v_head.into());
            put(".attention.q_lora_rank", m.q_lora.into());
            put(".attention.kv_lora_rank", m.kv_lora.into());
            put(".leading_dense_block_count", s.n_dense.into());
            put(".expert_group_count", s.n_group.into());
            put(".expert_group_used_count", s.n_group_used.into());
            put(".expert_weights_scale", s.weights_scale.into());
            put(".expert_weights_norm", true.into());
            put(".vocab_size", s.n_vocab.into());
            if let Some(y) = s.yarn {
                put(".rope.scaling.type", "yarn".into());
                put(".rope.scaling.factor", y.factor.into());
                put(".rope.scaling.original_context_length", y.orig_ctx.into());
                put(".rope.scaling.yarn_log_multiplier", y.log_multiplier.into());
                put(".rope.scaling.yarn_beta_fast", 32f32.into());
                put(".rope.scaling.yarn_beta_slow", 1f32.into());
            }
        }
        "hy_v3" => {
            put(".expert_shared_feed_forward_length", (s.n_ff_exp * s.n_shared).into());
            put(".expert_weights_scale", s.weights_scale.into());
            put(".expert_weights_norm", true.into());
        }
        _ => {}
    }
}

/// `ty` when rows of `cols` are whole blocks of it, else q8_0 (blocks of 32):
/// the MLA up-projections have 128-wide rows, which K formats cannot hold.
fn fit(ty: GgmlType, cols: u64) -> GgmlType {
    if cols % ty.block_elems() as u64 == 0 {
        ty
    } else {
        GgmlType::Q8_0
    }
}

/// The family's tensors, in the order the converter writes them per layer.
pub fn tensors(s: &SynthSpec, n_vocab: u64) -> Vec<TensorPlan> {
    let (e, hd, h, hkv) = (s.n_embd as u64, s.head_dim as u64, s.n_head as u64, s.n_kv_head as u64);
    let (nx, ffx, ff) = (s.n_expert as u64, s.n_ff_exp as u64, s.n_ff as u64);
    let lin = |fan_in: u64| (3.0 / fan_in as f32).sqrt();
    let damp = residual_damp(s.n_layers);
    let t = |name: String, dims: Vec<u64>, ty: GgmlType, amp: f32| TensorPlan { ty: fit(ty, dims[0]), name, dims, amp, constant: false, role: PlanRole::Plain };
    let norm = |name: String, n: u64| TensorPlan { name, dims: vec![n], ty: GgmlType::F32, amp: 1.0, constant: true, role: PlanRole::Plain };
    let dt = s.dense_type;
    let mut v = vec![
        TensorPlan { role: PlanRole::Embedding, ..t("token_embd.weight".into(), vec![e, n_vocab], dt, 1.0) },
        norm("output_norm.weight".into(), e),
        t("output.weight".into(), vec![e, n_vocab], dt, lin(e)),
    ];
    let bias_name = if s.arch == "hy_v3" { "exp_probs_b" } else { "exp_probs_b.bias" };
    for l in 0..s.n_layers {
        let n = |x: &str| format!("blk.{l}.{x}");
        v.push(norm(n("attn_norm.weight"), e));
        match s.mla {
            Some(m) => {
                let (ql, kvl, rot, nope, vh) = (m.q_lora as u64, m.kv_lora as u64, s.n_rot as u64, m.nope as u64, m.v_head as u64);
                v.push(t(n("attn_q_a.weight"), vec![e, ql], dt, lin(e)));
                v.push(norm(n("attn_q_a_norm.weight"), ql));
                v.push(t(n("attn_q_b.weight"), vec![ql, h * (nope + rot)], dt, lin(ql)));
                v.push(t(n("attn_kv_a_mqa.weight"), vec![e, kvl + rot], dt, lin(e)));
                v.push(norm(n("attn_kv_a_norm.weight"), kvl));
                v.push(t(n("attn_k_b.weight"), vec![nope, kvl, h], dt, lin(nope)));
                v.push(t(n("attn_v_b.weight"), vec![kvl, vh, h], dt, lin(kvl)));
                v.push(t(n("attn_output.weight"), vec![h * vh, e], dt, lin(h * vh) * damp));
            }
            None => {
                // minimax-m2 norms q/k over the whole projection, hy_v3 per head.
                let (qn, kn) = if s.arch == "minimax-m2" { (h * hd, hkv * hd) } else { (hd, hd) };
                v.push(t(n("attn_q.weight"), vec![e, h * hd], dt, lin(e)));
                v.push(t(n("attn_k.weight"), vec![e, hkv * hd], dt, lin(e)));
                v.push(t(n("attn_v.weight"), vec![e, hkv * hd], dt, lin(e)));
                v.push(t(n("attn_output.weight"), vec![h * hd, e], dt, lin(h * hd) * damp));
                v.push(norm(n("attn_q_norm.weight"), qn));
                v.push(norm(n("attn_k_norm.weight"), kn));
            }
        }
        v.push(norm(n("ffn_norm.weight"), e));
        if l < s.n_dense {
            v.push(t(n("ffn_gate.weight"), vec![e, ff], dt, lin(e)));
            v.push(t(n("ffn_up.weight"), vec![e, ff], dt, lin(e)));
            v.push(t(n("ffn_down.weight"), vec![ff, e], dt, lin(ff) * damp));
            continue;
        }
        v.push(TensorPlan { role: PlanRole::Router, ..t(n("ffn_gate_inp.weight"), vec![e, nx], GgmlType::F32, lin(e)) });
        // The selection bias: zero, so it chooses nothing the scores do not.
        v.push(TensorPlan { name: n(bias_name), dims: vec![nx], ty: GgmlType::F32, amp: 0.0, constant: true, role: PlanRole::Plain });
        let xt = s.expert_type;
        v.push(t(n("ffn_gate_exps.weight"), vec![e, ffx, nx], xt, lin(e)));
        v.push(t(n("ffn_up_exps.weight"), vec![e, ffx, nx], xt, lin(e)));
        v.push(t(n("ffn_down_exps.weight"), vec![ffx, e, nx], xt, lin(ffx) * damp));
        if s.n_shared > 0 {
            let fs = ffx * s.n_shared as u64;
            v.push(t(n("ffn_gate_shexp.weight"), vec![e, fs], dt, lin(e)));
            v.push(t(n("ffn_up_shexp.weight"), vec![e, fs], dt, lin(e)));
            v.push(t(n("ffn_down_shexp.weight"), vec![fs, e], dt, lin(fs) * damp));
        }
    }
    v
}
