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
//! - qwen35moe (Qwen3.5 / Qwen3.6 35B-A3B): a hybrid of gated delta-net
//!   layers and gated full attention (q carries a per-head output gate, q/k
//!   norms, partial rotary with M-RoPE sections), every layer MoE with a
//!   softmax router (no selection bias) and a sigmoid-gated shared expert;
//!   the MTP block (`nextn`) after the trunk, counted in `block_count`.
//! - qwen35 (Qwen3.6 27B): the same hybrid with a dense SwiGLU FFN in every
//!   layer (`ffn_gate` / `ffn_up` / `ffn_down`) and no expert keys.

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

/// qwen35moe's gated delta net and its layer pattern.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaNet {
    /// Every `full_every`-th layer is full attention, the others delta nets.
    pub full_every: u32,
    pub conv_kernel: u32,
    /// Key heads and value heads, and their dims.
    pub k_heads: u32,
    pub v_heads: u32,
    pub k_dim: u32,
    pub v_dim: u32,
    /// MTP blocks after the trunk (in `block_count`, out of `n_layers`).
    pub n_mtp: u32,
}

impl DeltaNet {
    fn recurrent(&self, l: u32) -> bool {
        (l + 1) % self.full_every != 0
    }
}

/// The architectures `synth` writes.
pub const FAMILIES: [&str; 6] = ["qwen3moe", "deepseek2", "hy_v3", "minimax-m2", "qwen35moe", "qwen35"];

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
        // transformers' Qwen3_5MoeTextConfig defaults (its checkpoint
        // Qwen/Qwen3.5-35B-A3B; Qwen3.6-35B-A3B is the same qwen3_5_moe
        // geometry): 40 layers, full attention every 4th, 16 q / 2 kv heads of
        // 256, partial rotary 0.25 (64 dims), delta net 16 k / 32 v heads of
        // 128 with a 4-tap conv, 256 experts of 512 (8 used), one shared of
        // 512, vocab 248320. From the released config.json (not the class):
        // rope_theta 1e7 and one MTP layer (mtp_num_hidden_layers).
        "qwen3.6-35b-a3b" => SynthSpec {
            arch: "qwen35moe".into(),
            n_layers: 40,
            n_embd: 2048,
            n_head: 16,
            n_kv_head: 2,
            head_dim: 256,
            n_expert: 256,
            n_expert_used: 8,
            n_ff_exp: 512,
            n_vocab: 248320,
            n_shared: 1,
            n_rot: 64,
            rope_base: 10_000_000.0,
            delta: Some(DeltaNet { full_every: 4, conv_kernel: 4, k_heads: 16, v_heads: 32, k_dim: 128, v_dim: 128, n_mtp: 1 }),
            tok_pre: "qwen35",
            ..base.clone()
        },
        // Qwen3.6-27B's released config (qwen3_5 text): 64 layers of 5120, full
        // attention every 4th with 24 q / 4 kv heads of 256 (64 rotated), delta
        // net 16 k / 48 v heads of 128, a dense FFN of 17408, one MTP layer.
        "qwen3.6-27b" => SynthSpec {
            arch: "qwen35".into(),
            n_layers: 64,
            n_embd: 5120,
            n_head: 24,
            n_kv_head: 4,
            n_expert: 0,
            n_expert_used: 0,
            n_ff_exp: 0,
            n_ff: 17408,
            n_shared: 0,
            delta: Some(DeltaNet { full_every: 4, conv_kernel: 4, k_heads: 16, v_heads: 48, k_dim: 128, v_dim: 128, n_mtp: 1 }),
            ..preset("qwen3.6-35b-a3b", base.clone())?
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
        "tiny-minimax-m2" => tiny(SynthSpec { n_layers: 3, n_embd: 128, n_head: 4, n_kv_head: 2, head_dim: 32, n_expert: 16, n_ff_exp: 64, n_rot: 16, n_vocab: 300, ..preset("minimax-m2-230b", base.clone())? }),
        // Delta, full, delta, full attention, then the MTP block.
        "tiny-qwen35moe" => tiny(SynthSpec {
            n_layers: 4,
            n_embd: 128,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 32,
            n_rot: 8,
            n_expert: 16,
            n_ff_exp: 64,
            n_vocab: 300,
            delta: Some(DeltaNet { full_every: 2, conv_kernel: 4, k_heads: 2, v_heads: 4, k_dim: 32, v_dim: 32, n_mtp: 1 }),
            ..preset("qwen3.6-35b-a3b", base.clone())?
        }),
        // The dense sibling of the same shape.
        "tiny-qwen35" => {
            SynthSpec { arch: "qwen35".into(), n_expert: 0, n_expert_used: 0, n_ff_exp: 0, n_shared: 0, n_ff: 128, ..preset("tiny-qwen35moe", base)? }
        }
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
    if a == "qwen35moe" {
        // Its converter writes no dense FFN width (qwen35's is its FFN).
        let ff = format!("{a}.feed_forward_length");
        kv.retain(|(k, _)| *k != ff);
    }
    let mut put = |k: &str, v: Value| set(kv, a, k, v);
    if s.n_ff > 0 {
        put(".feed_forward_length", s.n_ff.into());
    }
    // qwen35moe routes by softmax and its converter writes no gating func;
    // qwen35 has no router.
    if a != "qwen35moe" && a != "qwen35" {
        put(".expert_gating_func", 2u32.into());
    }
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
        "qwen35moe" | "qwen35" => {
            let d = s.delta.expect("qwen35 presets carry the delta net's widths");
            let n_blocks = s.n_layers + d.n_mtp;
            put(".block_count", n_blocks.into());
            if s.n_expert > 0 {
                put(".expert_shared_feed_forward_length", (s.n_ff_exp * s.n_shared).into());
            }
            put(".nextn_predict_layers", d.n_mtp.into());
            put(".ssm.conv_kernel", d.conv_kernel.into());
            put(".ssm.state_size", d.k_dim.into());
            put(".ssm.group_count", d.k_heads.into());
            put(".ssm.time_step_rank", d.v_heads.into());
            put(".ssm.inner_size", (d.v_heads * d.v_dim).into());
            // One per block; the MTP blocks are full attention.
            put(".attention.recurrent_layers", (0..n_blocks).map(|l| l < s.n_layers && d.recurrent(l)).collect::<Vec<bool>>().into());
            put(".full_attention_interval", d.full_every.into());
            // M-RoPE's t/h/w sections over the rotated half (HF's [11, 11, 10] of 32), the remainder to the first.
            let half = s.n_rot as i32 / 2;
            let sec = |i: i32| half / 3 + i32::from(i < half % 3);
            put(".rope.dimension_sections", vec![sec(0), sec(1), sec(2), 0].into());
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
    if let Some(d) = s.delta {
        return hybrid_tensors(s, d, n_vocab);
    }
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

/// qwen35moe's tensors: delta-net and full-attention layers, each with the
/// MoE FFN (qwen35: a dense one), then the MTP blocks (a full-attention
/// block plus `nextn.*`).
/// The delta net stays stable under random weights: its decay `ssm_a` is
/// negative (-exp(A_log) as the converter stores it), `ssm_dt.bias` small,
/// the gated norm 1, the 4-tap conv scaled by its fan-in.
fn hybrid_tensors(s: &SynthSpec, d: DeltaNet, n_vocab: u64) -> Vec<TensorPlan> {
    let (e, hd, h, hkv) = (s.n_embd as u64, s.head_dim as u64, s.n_head as u64, s.n_kv_head as u64);
    let (nx, ffx, fs, ff) = (s.n_expert as u64, s.n_ff_exp as u64, (s.n_ff_exp * s.n_shared) as u64, s.n_ff as u64);
    let (hv, nv, kc) = (d.v_heads as u64, (d.v_heads * d.v_dim) as u64, d.conv_kernel as u64);
    let ch = 2 * (d.k_heads * d.k_dim) as u64 + nv;
    let lin = |fan_in: u64| (3.0 / fan_in as f32).sqrt();
    let damp = residual_damp(s.n_layers);
    let t = |name: String, dims: Vec<u64>, ty: GgmlType, amp: f32| TensorPlan { ty: fit(ty, dims[0]), name, dims, amp, constant: false, role: PlanRole::Plain };
    let f32 = |name: String, dims: Vec<u64>, amp: f32, constant: bool| TensorPlan { name, dims, ty: GgmlType::F32, amp, constant, role: PlanRole::Plain };
    let norm = |name: String, n: u64| f32(name, vec![n], 1.0, true);
    let (dt, xt) = (s.dense_type, s.expert_type);
    let mut v = vec![
        TensorPlan { role: PlanRole::Embedding, ..t("token_embd.weight".into(), vec![e, n_vocab], dt, 1.0) },
        norm("output_norm.weight".into(), e),
        t("output.weight".into(), vec![e, n_vocab], dt, lin(e)),
    ];
    for l in 0..s.n_layers + d.n_mtp {
        let n = |x: &str| format!("blk.{l}.{x}");
        v.push(norm(n("attn_norm.weight"), e));
        if l < s.n_layers && d.recurrent(l) {
            v.push(t(n("attn_qkv.weight"), vec![e, ch], dt, lin(e)));
            v.push(t(n("attn_gate.weight"), vec![e, nv], dt, lin(e)));
            v.push(t(n("ssm_beta.weight"), vec![e, hv], dt, lin(e)));
            v.push(t(n("ssm_alpha.weight"), vec![e, hv], dt, lin(e)));
            // softplus(alpha + 0.1·u) ~ 0.8, times ssm_a -1: each step keeps about half the state.
            v.push(f32(n("ssm_dt.bias"), vec![hv], 0.1, false));
            v.push(f32(n("ssm_a"), vec![hv], -1.0, true));
            // Rows of `conv_kernel` taps: no block format holds them.
            v.push(f32(n("ssm_conv1d.weight"), vec![kc, ch], lin(kc), false));
            v.push(norm(n("ssm_norm.weight"), d.v_dim as u64));
            v.push(t(n("ssm_out.weight"), vec![nv, e], dt, lin(nv) * damp));
        } else {
            // Per head [q | output gate].
            v.push(t(n("attn_q.weight"), vec![e, 2 * h * hd], dt, lin(e)));
            v.push(t(n("attn_k.weight"), vec![e, hkv * hd], dt, lin(e)));
            v.push(t(n("attn_v.weight"), vec![e, hkv * hd], dt, lin(e)));
            v.push(t(n("attn_output.weight"), vec![h * hd, e], dt, lin(h * hd) * damp));
            v.push(norm(n("attn_q_norm.weight"), hd));
            v.push(norm(n("attn_k_norm.weight"), hd));
        }
        // The FFN's pre-norm.
        v.push(norm(n("post_attention_norm.weight"), e));
        if nx == 0 {
            v.push(t(n("ffn_gate.weight"), vec![e, ff], dt, lin(e)));
            v.push(t(n("ffn_up.weight"), vec![e, ff], dt, lin(e)));
            v.push(t(n("ffn_down.weight"), vec![ff, e], dt, lin(ff) * damp));
        } else {
            v.push(TensorPlan { role: PlanRole::Router, ..f32(n("ffn_gate_inp.weight"), vec![e, nx], lin(e), false) });
            v.push(t(n("ffn_gate_exps.weight"), vec![e, ffx, nx], xt, lin(e)));
            v.push(t(n("ffn_up_exps.weight"), vec![e, ffx, nx], xt, lin(e)));
            v.push(t(n("ffn_down_exps.weight"), vec![ffx, e, nx], xt, lin(ffx) * damp));
            v.push(t(n("ffn_gate_shexp.weight"), vec![e, fs], dt, lin(e)));
            v.push(t(n("ffn_up_shexp.weight"), vec![e, fs], dt, lin(e)));
            v.push(t(n("ffn_down_shexp.weight"), vec![fs, e], dt, lin(fs) * damp));
            // The shared expert's sigmoid gate.
            v.push(f32(n("ffn_gate_inp_shexp.weight"), vec![e, 1], lin(e), false));
        }
        if l >= s.n_layers {
            v.push(t(n("nextn.eh_proj.weight"), vec![2 * e, e], dt, lin(2 * e)));
            for x in ["nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"] {
                v.push(norm(n(x), e));
            }
        }
    }
    v
}
