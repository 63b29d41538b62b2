//! Synthetic models: valid GGUFs of a real family's geometry with random,
//! well-scaled weights, for benchmarks and for the built-in default model.
//! Each family's file is written in the dialect of llama.cpp's converter
//! (the keys and tensor names of the parity fixtures, `layout.rs`), so a
//! real model's file and its synthetic twin differ only in values.
//!
//! Weights are uniform with the variance of a 1/sqrt(fan_in) init, so
//! activations stay O(1) through any number of layers; norms are 1. Every
//! row is generated from its own seed (tensor index, row), so the output does
//! not depend on the thread count. The vocabulary is GPT-2 byte-level: 256
//! byte tokens plus three specials, no merges, so any tool can tokenize.

use std::path::Path;

use anyhow::Context;
use pulsar_gguf::{GgmlType, GgufWriter, Value};
use rayon::prelude::*;

use crate::sample::Rng;

mod layout;
pub use layout::{DeltaNet, Mla, YarnSpec, FAMILIES};

#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    pub arch: String,
    pub n_layers: u32,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_ff_exp: u32,
    pub expert_type: GgmlType,
    /// Attention, embedding and output weights.
    pub dense_type: GgmlType,
    pub n_ctx: u32,
    pub seed: u64,
    /// Routing skew: expert e's popularity falls roughly as (e+1)^-skew
    /// (Zipf exponent); 0 = uniform.
    pub skew: f32,
    /// The vocabulary: 259 byte-level tokens, padded with unused ones up to
    /// this (a real model's size, so embedding and output weigh what its do).
    pub n_vocab: u32,
    /// Leading layers with a dense FFN of `n_ff` (0: every layer MoE).
    pub n_dense: u32,
    pub n_ff: u32,
    /// Shared experts (each `n_ff_exp` wide) beside the routed ones.
    pub n_shared: u32,
    /// Rotated dims per head (0: all).
    pub n_rot: u32,
    pub rope_base: f32,
    /// Multiplier on the routing weights (`expert_weights_scale`).
    pub weights_scale: f32,
    /// Expert groups and the groups a token may use (1, 1: none).
    pub n_group: u32,
    pub n_group_used: u32,
    /// deepseek2's multi-head latent attention.
    pub mla: Option<Mla>,
    pub yarn: Option<YarnSpec>,
    /// qwen35moe's gated delta net, its layer pattern and MTP blocks.
    pub delta: Option<DeltaNet>,
    /// `tokenizer.ggml.pre` (the byte-level vocabulary splits the same under any).
    pub tok_pre: &'static str,
}

/// Named geometries of real models.
pub fn preset(name: &str) -> anyhow::Result<SynthSpec> {
    let base = |n_layers, n_embd, n_head, n_kv_head, head_dim, n_expert, n_expert_used, n_ff_exp| SynthSpec {
        arch: "qwen3moe".into(),
        n_layers,
        n_embd,
        n_head,
        n_kv_head,
        head_dim,
        n_expert,
        n_expert_used,
        n_ff_exp,
        expert_type: GgmlType::Q4_K,
        dense_type: GgmlType::Q8_0,
        n_ctx: 4096,
        seed: 1,
        skew: 0.0,
        n_vocab: BYTE_VOCAB,
        n_dense: 0,
        n_ff: 0,
        n_shared: 0,
        n_rot: 0,
        rope_base: 1_000_000.0,
        weights_scale: 1.0,
        n_group: 1,
        n_group_used: 1,
        mla: None,
        yarn: None,
        delta: None,
        tok_pre: "qwen2",
    };
    Ok(match name {
        // The built-in default: small enough to create in a second on first use.
        "tiny" => SynthSpec { expert_type: GgmlType::Q8_0, ..base(4, 128, 4, 2, 32, 16, 4, 64) },
        "qwen3-30b-a3b" => base(48, 2048, 32, 4, 128, 128, 8, 768),
        "qwen3-235b-a22b" => base(94, 4096, 64, 4, 128, 128, 8, 1536),
        other => match layout::preset(other, base(0, 0, 0, 0, 0, 0, 0, 0)) {
            Some(s) => s,
            None => anyhow::bail!("unknown preset `{other}` (known: {})", PRESETS.join(", ")),
        },
    })
}

/// Every preset name, with its architecture.
pub const PRESETS: [&str; 15] = [
    "tiny",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "deepseek-v3-671b",
    "kimi-k2-1t",
    "hy3-295b",
    "minimax-m2-230b",
    "qwen3.6-35b-a3b",
    "qwen3.6-27b",
    "tiny-deepseek2",
    "tiny-kimi-k2",
    "tiny-hy3",
    "tiny-minimax-m2",
    "tiny-qwen35moe",
    "tiny-qwen35",
];

/// 256 byte tokens and the three specials.
pub const BYTE_VOCAB: u32 = 256 + SPECIALS.len() as u32;

/// GPT-2's printable spelling of each byte.
fn byte_token(b: u8) -> String {
    let printable = |c: u8| (b'!'..=b'~').contains(&c) || (0xA1..=0xAC).contains(&c) || (0xAE..=0xFF).contains(&c);
    if printable(b) {
        return char::from(b).to_string();
    }
    let n = (0..b).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + n).expect("valid code point").to_string()
}

pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

pub(crate) struct TensorPlan {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    /// Values are uniform in [-a, a] (or exactly `a` for norms).
    amp: f32,
    constant: bool,
    role: PlanRole,
}

/// How routing skew is built: every token embedding carries the same offset
/// `EMBED_OFFSET` in column 0, so after the RMS norm each hidden state has a
/// nearly constant component h0 = `H0` there; router row e adds
/// -skew·ln(e+1)/H0 in that column, which shifts expert e's logit by
/// -skew·ln(e+1), i.e. its softmax weight by (e+1)^-skew. The residual
/// updates (attention output, expert down projections) are kept small so
/// the stream stays close to the token's own embedding and routing varies
/// token to token instead of collapsing onto a few experts.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum PlanRole {
    Plain,
    Embedding,
    Router,
}

const EMBED_OFFSET: f32 = 2.0;
/// Uniform [-1, 1] entries have mean square 1/3; with the offset the RMS norm
/// divides by sqrt(1/3 + offset^2/n) ~ sqrt(1/3) for wide models.
const H0: f32 = EMBED_OFFSET * 1.732_050_8;
/// Residual updates are this much smaller than a 1/sqrt(fan_in) init, over
/// the layer count: with random weights, attention outputs share a
/// token-independent part (the average over positions) that adds up
/// coherently layer after layer; scaled by 1/layers its sum stays below the
/// token's own embedding, so deep layers still route by token.
pub(crate) fn residual_damp(n_layers: u32) -> f32 {
    (0.25 / n_layers.max(1) as f32).min(0.2)
}

fn tensors(s: &SynthSpec, n_vocab: u64) -> Vec<TensorPlan> {
    if s.arch != "qwen3moe" {
        return layout::tensors(s, n_vocab);
    }
    let (e, hd) = (s.n_embd as u64, s.head_dim as u64);
    let (nq, nkv, nx, ff) = (s.n_head as u64 * hd, s.n_kv_head as u64 * hd, s.n_expert as u64, s.n_ff_exp as u64);
    // Uniform [-a, a] has variance a^2/3: a = sqrt(3/fan_in) gives variance 1/fan_in.
    let lin = |fan_in: u64| (3.0 / fan_in as f32).sqrt();
    let t = |name: String, dims: Vec<u64>, ty: GgmlType, amp: f32| TensorPlan { name, dims, ty, amp, constant: false, role: PlanRole::Plain };
    let norm = |name: String, n: u64| TensorPlan { name, dims: vec![n], ty: GgmlType::F32, amp: 1.0, constant: true, role: PlanRole::Plain };
    let mut v = vec![
        TensorPlan { role: PlanRole::Embedding, ..t("token_embd.weight".into(), vec![e, n_vocab], s.dense_type, 1.0) },
        norm("output_norm.weight".into(), e),
        t("output.weight".into(), vec![e, n_vocab], s.dense_type, lin(e)),
    ];
    for l in 0..s.n_layers {
        let n = |x: &str| format!("blk.{l}.{x}.weight");
        v.push(norm(n("attn_norm"), e));
        v.push(t(n("attn_q"), vec![e, nq], s.dense_type, lin(e)));
        v.push(t(n("attn_k"), vec![e, nkv], s.dense_type, lin(e)));
        v.push(t(n("attn_v"), vec![e, nkv], s.dense_type, lin(e)));
        v.push(t(n("attn_output"), vec![nq, e], s.dense_type, lin(nq) * residual_damp(s.n_layers)));
        v.push(norm(n("attn_q_norm"), hd));
        v.push(norm(n("attn_k_norm"), hd));
        v.push(norm(n("ffn_norm"), e));
        v.push(TensorPlan { role: PlanRole::Router, ..t(n("ffn_gate_inp"), vec![e, nx], GgmlType::F32, lin(e)) });
        v.push(t(n("ffn_gate_exps"), vec![e, ff, nx], s.expert_type, lin(e)));
        v.push(t(n("ffn_up_exps"), vec![e, ff, nx], s.expert_type, lin(e)));
        v.push(t(n("ffn_down_exps"), vec![ff, e, nx], s.expert_type, lin(ff) * residual_damp(s.n_layers)));
    }
    v
}

/// Total bytes the file's tensors will take.
pub fn tensor_bytes(s: &SynthSpec) -> u64 {
    tensors(s, s.n_vocab.max(BYTE_VOCAB) as u64).iter().map(|t| pulsar_gguf::tensor_bytes(t.ty, &t.dims).unwrap_or(0)).sum()
}

/// The file's metadata and its tensors' (name, ggml dims, type), as
/// [`write`] writes them: what a plugin sees before any weight is read.
pub fn header(s: &SynthSpec) -> anyhow::Result<(Vec<(String, Value)>, Vec<(String, Vec<u64>, GgmlType)>)> {
    let (kv, plan) = plan(s)?;
    Ok((kv, plan.into_iter().map(|t| (t.name, t.dims, t.ty)).collect()))
}

fn plan(s: &SynthSpec) -> anyhow::Result<(Vec<(String, Value)>, Vec<TensorPlan>)> {
    // A dense model (qwen35) has no experts and a dense FFN width instead.
    let experts_ok = if s.n_expert == 0 { s.n_expert_used == 0 && s.n_ff > 0 } else { s.n_expert_used > 0 && s.n_expert_used <= s.n_expert };
    if s.n_kv_head == 0 || s.n_head % s.n_kv_head != 0 || !experts_ok {
        anyhow::bail!("inconsistent geometry: {s:?}");
    }
    let mut tokens: Vec<String> = (0..=255u8).map(byte_token).collect();
    tokens.extend(SPECIALS.iter().map(|s| s.to_string()));
    let mut types = vec![1i32; 256];
    types.extend([3, 3, 3]);
    // Padding up to the real vocabulary: unused tokens (type 5) nothing produces.
    for i in tokens.len()..s.n_vocab as usize {
        tokens.push(format!("<|synth_unused_{i}|>"));
        types.push(5);
    }
    let n_vocab = tokens.len() as u64;
    let a = &s.arch;
    let mut kv: Vec<(String, Value)> = vec![
        ("general.architecture".into(), a.as_str().into()),
        ("general.name".into(), format!("synthetic {a} {}L", s.n_layers).as_str().into()),
        (format!("{a}.block_count"), s.n_layers.into()),
        (format!("{a}.context_length"), s.n_ctx.into()),
        (format!("{a}.embedding_length"), s.n_embd.into()),
        (format!("{a}.feed_forward_length"), (s.n_ff_exp * s.n_expert_used).into()),
        (format!("{a}.attention.head_count"), s.n_head.into()),
        (format!("{a}.attention.head_count_kv"), s.n_kv_head.into()),
        (format!("{a}.attention.key_length"), s.head_dim.into()),
        (format!("{a}.attention.value_length"), s.head_dim.into()),
        (format!("{a}.attention.layer_norm_rms_epsilon"), 1e-6f32.into()),
        (format!("{a}.rope.freq_base"), s.rope_base.into()),
        ("tokenizer.ggml.model".into(), "gpt2".into()),
        ("tokenizer.ggml.pre".into(), s.tok_pre.into()),
        ("tokenizer.ggml.tokens".into(), Value::from(tokens.iter().map(String::as_str).collect::<Vec<&str>>())),
        ("tokenizer.ggml.token_type".into(), Value::from(types)),
        ("tokenizer.ggml.merges".into(), Value::from(Vec::<&str>::new())),
        ("tokenizer.ggml.eos_token_id".into(), 256u32.into()),
        ("tokenizer.ggml.bos_token_id".into(), 256u32.into()),
        ("tokenizer.ggml.add_bos_token".into(), false.into()),
    ];
    if s.n_expert > 0 {
        let at = kv.iter().position(|(k, _)| k.starts_with("tokenizer.")).unwrap_or(kv.len());
        kv.splice(
            at..at,
            [
                (format!("{a}.expert_count"), s.n_expert.into()),
                (format!("{a}.expert_used_count"), s.n_expert_used.into()),
                (format!("{a}.expert_feed_forward_length"), s.n_ff_exp.into()),
            ],
        );
    }
    if s.arch != "qwen3moe" {
        layout::metadata(s, &mut kv);
    }
    Ok((kv, tensors(s, n_vocab)))
}

/// Write the model to `path`; `progress` shows a bar on stderr.
pub fn write(s: &SynthSpec, path: &Path, progress: bool) -> anyhow::Result<()> {
    let (kv, plan) = plan(s)?;
    let mut w = GgufWriter::new();
    for (k, v) in kv {
        w.add_kv(k, v)?;
    }
    for t in &plan {
        w.add_tensor(t.name.clone(), &t.dims, t.ty)?;
    }
    let total: u64 = plan.iter().map(|t| pulsar_gguf::tensor_bytes(t.ty, &t.dims).unwrap_or(0)).sum();
    let bar = if progress { crate::progress::bytes_bar(total, format!("synth {}", path.display())) } else { indicatif::ProgressBar::hidden() };
    if path.is_dir() {
        anyhow::bail!("{} is a directory: give the output file's name", path.display());
    }
    // A fresh, exclusively created name beside the output: concurrent writers
    // of one path never share it, and a planted symlink is never followed.
    let tmp = pulsar_gguf::tempfile::temp_name_beside(path, "partial");
    // Large chunks so every thread has rows to work on.
    w.set_chunk_bytes(64 << 20);
    let mut out = w.create_new(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    for (ti, t) in plan.iter().enumerate() {
        let cols = t.dims[0] as usize;
        let row_bytes = t.ty.row_bytes(cols as u64).context("row is not whole blocks")? as usize;
        let seed = s.seed ^ ((ti as u64) << 32);
        // Quantized weights are random blocks with their scales set for the
        // target spread (fitting random floats to K/IQ formats is far slower
        // and buys nothing for a synthetic model).
        let block_scale = if t.constant || t.ty == GgmlType::F32 || t.role != PlanRole::Plain { None } else { block_scale_for(t.ty, t.amp) };
        let skew = s.skew;
        let n_blocks = cols / t.ty.block_elems() as usize;
        out.write_tensor_with(&t.name, |offset, buf| {
            let first_row = offset as usize / row_bytes;
            buf.par_chunks_mut(row_bytes).enumerate().try_for_each(|(i, dst)| {
                let row_seed = seed.wrapping_add((first_row + i) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                if let Some(sc) = block_scale {
                    let b = pulsar_kernels::quant::random_blocks_scaled(t.ty, n_blocks, row_seed, sc)
                        .map_err(|e| std::io::Error::other(format!("{}: {e}", t.name)))?;
                    dst.copy_from_slice(&b);
                    return Ok(());
                }
                let mut rng = Rng::new(row_seed);
                let mut vals: Vec<f32> = if t.constant {
                    vec![t.amp; cols]
                } else {
                    (0..cols).map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * t.amp).collect()
                };
                let row = first_row + i;
                match t.role {
                    PlanRole::Embedding => vals[0] = EMBED_OFFSET,
                    // Router rows are experts (dims [n_embd, n_expert]).
                    PlanRole::Router => vals[0] = -skew * ((row + 1) as f32).ln() / H0,
                    PlanRole::Plain => {}
                }
                pulsar_kernels::quantize(t.ty, &vals, dst).map_err(|e| std::io::Error::other(format!("{}: {e}", t.name)))
            })?;
            bar.inc(buf.len() as u64);
            Ok(())
        })?;
    }
    out.finish()?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot move {} into place", tmp.display()))?;
    bar.finish_and_clear();
    Ok(())
}

/// The f16 scale that makes random blocks of `ty` spread like uniform
/// [-amp, amp] values (RMS amp/sqrt(3)); `None` for types without scale fields.
fn block_scale_for(ty: GgmlType, amp: f32) -> Option<f32> {
    let n = 64;
    let b = pulsar_kernels::quant::random_blocks_scaled(ty, n, 12345, 1.0).ok()?;
    let mut y = vec![0f32; n * ty.block_elems() as usize];
    pulsar_kernels::dequantize(ty, &b, &mut y).ok()?;
    let rms = (y.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / y.len() as f64).sqrt() as f32;
    (rms > 0.0).then(|| amp / 3f32.sqrt() / rms)
}

/// The built-in default model, created in the cache folder on first use.
pub fn default_model() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .filter(|x| !x.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("pulsar");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join("default-tiny-qwen3moe.gguf");
    if !path.is_file() {
        eprintln!("creating the built-in default model (a tiny synthetic qwen3moe) at {}", path.display());
        write(&preset("tiny")?, &path, true)?;
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_has_a_consistent_header() {
        for name in PRESETS {
            let s = preset(name).unwrap();
            let (kv, tensors) = header(&s).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(FAMILIES.contains(&s.arch.as_str()), "{name}");
            let n_vocab = match kv.iter().find(|(k, _)| k == "tokenizer.ggml.tokens") {
                Some((_, Value::Array(pulsar_gguf::Array::String(t)))) => t.len(),
                other => panic!("{name}: tokens are {other:?}"),
            };
            assert_eq!(n_vocab as u32, s.n_vocab.max(BYTE_VOCAB), "{name}: vocabulary size");
            assert!(tensors.iter().all(|t| t.1[0] % t.2.block_elems() as u64 == 0), "{name}: a row is not whole blocks");
        }
        assert!(preset("nope").unwrap_err().to_string().contains("deepseek-v3-671b"));
    }

    /// #28 defect 7: writers of one path shared one `.partial` name (3 of 4
    /// concurrent first runs of the default model failed), and `-o DIR` left
    /// `DIR.gguf.partial` behind.
    #[test]
    fn concurrent_writers_of_one_path_all_succeed_and_a_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        let s = SynthSpec { n_layers: 1, ..preset("tiny").unwrap() };
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..4).map(|_| sc.spawn(|| write(&s, &p, false))).collect();
            for h in hs {
                h.join().unwrap().unwrap();
            }
        });
        assert!(pulsar_gguf::GgufFile::open(&p).is_ok());
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).filter(|n| n != "m.gguf").collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
        let e = write(&s, dir.path(), false).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn byte_alphabet_is_a_bijection() {
        let all: std::collections::HashSet<String> = (0..=255u8).map(byte_token).collect();
        assert_eq!(all.len(), 256);
        assert_eq!(byte_token(b'a'), "a");
        assert_eq!(byte_token(b' '), "\u{120}");
        assert_eq!(byte_token(b'\n'), "\u{10a}");
    }

    #[test]
    fn tiny_model_writes_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        let s = SynthSpec { n_layers: 2, ..preset("tiny").unwrap() };
        write(&s, &p, false).unwrap();
        let f = pulsar_gguf::GgufFile::open(&p).unwrap();
        assert_eq!(f.architecture().unwrap(), "qwen3moe");
        assert_eq!(f.tensors().len(), 3 + 2 * 12);
        assert_eq!(f.tensors().iter().map(|t| t.n_bytes).sum::<u64>(), tensor_bytes(&s));
        // Weights are finite and not all equal.
        let t = f.tensor("blk.1.ffn_down_exps.weight").unwrap();
        let mut v = vec![0f32; t.n_elements() as usize];
        pulsar_kernels::dequantize(t.ty, f.data(t), &mut v).unwrap();
        assert!(v.iter().all(|x| x.is_finite()));
        assert!(v.iter().any(|&x| x != v[0]));
    }
}
