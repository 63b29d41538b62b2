//! Qwen4-Exp (CYBER-FROST 180B): `general.architecture = qwen4exp`.
//!
//! Reference: HF transformers 5.24 `models/qwen4_exp/modeling_qwen4_exp.py`
//! (`Qwen4ExpForCausalLM`), text path, in llama.cpp's GGUF dialect (every
//! zero-centred norm weight stored as `1 + w` but the GDN's gated one,
//! `ssm_a = -exp(A_log)`, the GDN value heads tiled, the PLE shards joined
//! into `per_layer_token_embd.weight` and its hash constants as `ple.*`
//! metadata, the indexer's q|k projection split in two, no MTP head).
//!
//! The Qwen3.5 MoE hybrid (see the qwen35 plugin) with:
//! - 4-stream low-rank hyper-connections in place of the layer norms: the
//!   residual is `hc` streams `[T, hc, E]`; before each block a mixer norms
//!   every stream, gates it with `sigmoid(up · silu(down · xn / hc))` and
//!   averages the streams into the block's input; the block's output is added
//!   to each stream times `2 · sigmoid(inject · xn / hc)`. A last mixer (no
//!   inject) feeds `output.weight`; there is no output norm.
//! - per-layer n-gram hash embeddings (PLE) on one GDN layer, before its
//!   mixer: hashed 2..n-gram ids of the sequence's tokens (an EOS resets the
//!   window) index one table; a key per stream and one value, a
//!   `sigmoid(sign(s)·sqrt(|s|))` gate of each stream's scaled key·query, and
//!   a dilated depthwise conv (dilation `ngram_size`) of the gated values,
//!   added to every stream. The token history and the conv's inputs are rows
//!   states (host-owned, so truncation and rollback are the host's).
//! - QSA sparse attention on the full layers: an indexer (its own q heads
//!   and one raw key per token, cached) scores mean-pooled blocks of
//!   `compress_ratio` keys (normed, rotated at the block's first position) by
//!   `Σ_h relu(q_h·k)/sqrt(D)`; each query attends to the best
//!   `top_k / ratio` complete blocks plus the open tail (`pooled_select`),
//!   over k/v rows states (attention composed from primitives).
//! - GDN's gated norm: HF's `output_gate_type or hidden_act`. The GGUF
//!   carries no key for it; HF's default (unset) is `hidden_act`, SiLU, which
//!   the fixture uses, so SiLU here (llama.cpp hard-codes sigmoid).

use pulsar_plugin_api::blocks::{DeltaDims, Ffn, GatedDeltaNet, Router, Scores};
use pulsar_plugin_api::{
    Act, ChatSpec, Dim, Experts, FamilyPlugin, Graph, MetaValue, OpenCx, PluginError, Role, Rope, RopeMode, ThinkingMarkers, Val, Wt,
};

/// HF's clamp of the PLE gate's magnitude before its square root.
const PLE_GATE_MIN: f32 = 1e-6;

#[derive(Debug, Clone, PartialEq)]
pub struct Ple {
    /// 0-based layer.
    pub layer: u32,
    pub ngram: u32,
    pub heads: u32,
    pub conv_kernel: u32,
    pub eos: i64,
    /// Width of one head's embedding row.
    pub head_dim: u32,
    pub mult: Vec<i64>,
    pub offsets: Vec<i64>,
    pub vocab: Vec<i64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub n_layers: u32,
    pub recurrent: Vec<bool>,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
    pub n_rot: u32,
    pub rope_base: f32,
    pub eps: f32,
    pub conv_kernel: u32,
    pub hk: u32,
    pub hv: u32,
    pub dk: u32,
    pub dv: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_ff_exp: u32,
    pub n_ff_shexp: u32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
    /// Hyper-connection streams and the mixer's rank.
    pub hc: u32,
    pub hc_rank: u32,
    /// QSA: index heads, index head dim, blocks chosen, block size.
    pub idx_heads: u32,
    pub idx_dim: u32,
    pub idx_blocks: u32,
    pub ratio: u32,
    pub ple: Option<Ple>,
}

fn int_array(cx: &OpenCx<'_>, key: &str) -> Result<Vec<i64>, PluginError> {
    match cx.meta(key) {
        Some(MetaValue::U64s(a)) => a.iter().map(|&v| i64::try_from(v).map_err(|_| PluginError::BadValue { key: key.into(), why: format!("{v} does not fit i64") })).collect(),
        Some(MetaValue::I64s(a)) => Ok(a.to_vec()),
        Some(other) => Err(PluginError::WrongType { key: key.into(), expected: "an array of integers", found: format!("{other:?}") }),
        None => Err(PluginError::MissingKey(key.into())),
    }
}

impl Config {
    pub fn parse(cx: &OpenCx<'_>) -> Result<Config, PluginError> {
        let bad = |key: &str, why: String| PluginError::BadValue { key: cx.key(key), why };
        let n_layers = cx.u32(&cx.key("block_count"))?;
        if let Some(n) = cx.opt_u32(&cx.key("nextn_predict_layers"))? {
            if n > 0 {
                return Err(bad("nextn_predict_layers", format!("{n} MTP blocks (qwen4exp GGUFs carry none; this plugin does not run them)")));
            }
        }
        let recurrent: Vec<bool> = match cx.meta(&cx.key("attention.recurrent_layers")) {
            Some(MetaValue::Bools(b)) if b.len() == n_layers as usize => b.to_vec(),
            Some(MetaValue::Bools(b)) => return Err(bad("attention.recurrent_layers", format!("has {} entries for {n_layers} blocks", b.len()))),
            Some(other) => return Err(PluginError::WrongType { key: cx.key("attention.recurrent_layers"), expected: "an array of bools", found: format!("{other:?}") }),
            None => {
                let every = cx.u32(&cx.key("full_attention_interval"))?;
                if every == 0 {
                    return Err(bad("full_attention_interval", "0".into()));
                }
                (0..n_layers).map(|l| (l + 1) % every != 0).collect()
            }
        };
        if recurrent.iter().all(|&r| r) {
            return Err(bad("attention.recurrent_layers", "every layer is recurrent: the hybrid needs a full-attention layer".into()));
        }
        let n_embd = cx.u32(&cx.key("embedding_length"))?;
        let (n_head, n_kv_head) = cx.gqa_heads()?;
        let head_dim = cx.u32(&cx.key("attention.key_length"))?;
        let dv_attn = cx.u32(&cx.key("attention.value_length"))?;
        if dv_attn != head_dim {
            return Err(bad("attention.value_length", format!("{dv_attn} != key_length {head_dim}")));
        }
        let n_rot = cx.u32(&cx.key("rope.dimension_count"))?;
        if n_rot == 0 || n_rot > head_dim || n_rot % 2 != 0 {
            return Err(bad("rope.dimension_count", format!("{n_rot} does not fit head_dim {head_dim}")));
        }
        let DeltaDims { hk, hv, dk, dv, conv_kernel } = DeltaDims::parse(cx)?;
        let n_expert = cx.u32(&cx.key("expert_count"))?;
        let n_expert_used = cx.u32(&cx.key("expert_used_count"))?;
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(bad("expert_used_count", format!("{n_expert_used} experts used of {n_expert}")));
        }
        let hc = cx.u32(&cx.key("hyper_connection.count"))?;
        if hc < 2 {
            return Err(bad("hyper_connection.count", format!("{hc} (Qwen4-Exp needs more than one stream)")));
        }
        let hc_rank = cx.u32(&cx.key("hyper_connection.low_rank"))?;
        if hc_rank == 0 {
            return Err(bad("hyper_connection.low_rank", "0".into()));
        }
        // QSA on every full layer, one compress ratio for all of them.
        let ratios = cx.u32_per_layer(&cx.key("attention.compress_ratios"), n_layers)?;
        let mut ratio = 0;
        for (l, (&r, &rec)) in ratios.iter().zip(&recurrent).enumerate() {
            match (rec, r) {
                (true, 0) => {}
                (true, _) => return Err(bad("attention.compress_ratios", format!("layer {l} is recurrent but has ratio {r}"))),
                (false, 0) => return Err(bad("attention.compress_ratios", format!("full layer {l} has no QSA ratio (plain full attention is not a qwen4exp layer)"))),
                (false, r) if ratio != 0 && r != ratio => return Err(bad("attention.compress_ratios", format!("layer {l} has ratio {r}, another {ratio}"))),
                (false, r) => ratio = r,
            }
        }
        let idx_heads = cx.u32(&cx.key("attention.indexer.head_count"))?;
        let idx_dim = cx.u32(&cx.key("attention.indexer.key_length"))?;
        let budget = cx.u32(&cx.key("attention.indexer.top_k"))?;
        if idx_heads == 0 {
            return Err(bad("attention.indexer.head_count", "0".into()));
        }
        if n_rot > idx_dim {
            return Err(bad("attention.indexer.key_length", format!("{idx_dim} is narrower than the rotary dims {n_rot}")));
        }
        if budget == 0 || budget % ratio != 0 {
            return Err(bad("attention.indexer.top_k", format!("a budget of {budget} tokens is not a positive multiple of the compress ratio {ratio}")));
        }
        let n_vocab = cx.n_vocab("token_embd.weight")?;
        let ple = match cx.meta(&cx.key("ple.layers")) {
            None => None,
            Some(_) => {
                let layers = int_array(cx, &cx.key("ple.layers"))?;
                let layer = match layers.as_slice() {
                    [] => None,
                    [l] if *l >= 0 && (*l as u32) < n_layers && recurrent[*l as usize] => Some(*l as u32),
                    [l] => return Err(bad("ple.layers", format!("layer {l} is not a recurrent layer of {n_layers}"))),
                    more => return Err(bad("ple.layers", format!("{} PLE layers: one set of hash constants serves only one", more.len()))),
                };
                match layer {
                    None => None,
                    Some(layer) => {
                        let ngram = cx.u32(&cx.key("ple.ngram_size"))?;
                        if ngram < 2 {
                            return Err(bad("ple.ngram_size", format!("{ngram} (n-grams of 2 or more)")));
                        }
                        let heads = cx.u32(&cx.key("ple.heads_per_ngram"))?;
                        if heads == 0 {
                            return Err(bad("ple.heads_per_ngram", "0".into()));
                        }
                        let nh = ((ngram - 1) * heads) as usize;
                        let conv_kernel = cx.u32(&cx.key("ple.conv_kernel"))?;
                        if conv_kernel == 0 {
                            return Err(bad("ple.conv_kernel", "0".into()));
                        }
                        let eos = cx.u32(&cx.key("ple.eos_token_id"))? as i64;
                        let head_dim = cx.u32(&cx.key("embedding_length_per_layer_input"))?;
                        let mult = int_array(cx, &cx.key("ple.layer_multipliers"))?;
                        if mult.len() != ngram as usize || mult.iter().any(|&m| m <= 0) {
                            return Err(bad("ple.layer_multipliers", format!("{mult:?}: need {ngram} positive multipliers")));
                        }
                        let offsets = int_array(cx, &cx.key("ple.head_offsets"))?;
                        if offsets.len() != nh {
                            return Err(bad("ple.head_offsets", format!("has {} entries for {nh} heads", offsets.len())));
                        }
                        let vocab = int_array(cx, &cx.key("ple.head_vocab_sizes"))?;
                        if vocab.len() != nh || vocab.iter().any(|&v| v <= 0) {
                            return Err(bad("ple.head_vocab_sizes", format!("{vocab:?}: need {nh} positive sizes")));
                        }
                        // No product of a token and a multiplier may overflow i64 (HF's bound).
                        if let Some(m) = mult.iter().find(|&&m| m.checked_mul(n_vocab as i64).is_none()) {
                            return Err(bad("ple.layer_multipliers", format!("{m} times the vocabulary {n_vocab} overflows 64 bits")));
                        }
                        Some(Ple { layer, ngram, heads, conv_kernel, eos, head_dim, mult, offsets, vocab })
                    }
                }
            }
        };
        if ple.is_some() && n_vocab > 1 << 24 {
            return Err(PluginError::Unsupported(format!("a vocabulary of {n_vocab}: the PLE token history holds ids as f32 (exact below 2^24)")));
        }
        Ok(Config {
            n_layers,
            recurrent,
            n_embd,
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
            n_expert,
            n_expert_used,
            n_ff_exp: cx.u32(&cx.key("expert_feed_forward_length"))?,
            n_ff_shexp: cx.u32(&cx.key("expert_shared_feed_forward_length"))?,
            n_vocab,
            n_ctx_train: cx.u32(&cx.key("context_length"))?,
            hc,
            hc_rank,
            idx_heads,
            idx_dim,
            idx_blocks: budget / ratio,
            ratio,
            ple,
        })
    }
}

/// The first (rows) dim of `x`: `T`, or `O` after `output_rows`.
fn rows(g: &Graph<'_>, x: Val) -> Result<Dim, PluginError> {
    Ok(g.shape(x)?.dims[0])
}

/// A hyper-connection mixer's weights (`inject` absent on the final one).
struct Mixer {
    norm: Wt,
    down: Wt,
    up: Wt,
    inject: Option<Wt>,
}

struct AttnLayer {
    wq: Wt,
    wk: Wt,
    wv: Wt,
    wo: Wt,
    q_norm: Wt,
    k_norm: Wt,
    iq: Wt,
    ik: Wt,
    iq_norm: Wt,
    ik_norm: Wt,
    /// Rows states: keys, values, raw index keys.
    ks: u32,
    vs: u32,
    idx: u32,
}

enum Block {
    Delta(GatedDeltaNet),
    Attn(AttnLayer),
}

struct PleLayer {
    table: Wt,
    key: Wt,
    value: Wt,
    norm_key: Wt,
    norm_query: Wt,
    norm_conv: Wt,
    conv: Wt,
    /// Rows states: the token ids, the conv's inputs.
    tokens: u32,
    conv_rows: u32,
}

struct Moe {
    router: Wt,
    gate_exps: Wt,
    up_exps: Wt,
    down_exps: Wt,
    shared: Ffn,
    shared_gate: Wt,
}

struct Layer {
    attn_hc: Mixer,
    ple: Option<PleLayer>,
    block: Block,
    ffn_hc: Mixer,
    moe: Moe,
}

pub struct Qwen4Exp {
    pub cfg: Config,
    tok_embd: Wt,
    output_hc: Mixer,
    output: Wt,
    layers: Vec<Layer>,
}

impl Qwen4Exp {
    fn mixer(cx: &mut OpenCx<'_>, prefix: &str, layer: Option<u32>, c: &Config, inject: bool) -> Result<Mixer, PluginError> {
        let (w, r, hc) = ((c.hc * c.n_embd) as u64, c.hc_rank as u64, c.hc as u64);
        Ok(Mixer {
            norm: cx.weight_shaped(&format!("{prefix}_norm.weight"), Role::Norm, layer, &[w])?,
            down: cx.weight_shaped(&format!("{prefix}_down.weight"), Role::Dense, layer, &[w, r])?,
            up: cx.weight_shaped(&format!("{prefix}_up.weight"), Role::Dense, layer, &[r, w])?,
            inject: if inject { Some(cx.weight_shaped(&format!("{prefix}_inject.weight"), Role::Dense, layer, &[w, hc])?) } else { None },
        })
    }

    fn declare_layer(cx: &mut OpenCx<'_>, c: &Config, l: u32) -> Result<Layer, PluginError> {
        let (e, hd) = (c.n_embd as u64, c.head_dim as u64);
        let w = |cx: &mut OpenCx<'_>, s: &str, role: Role, dims: &[u64]| cx.weight_shaped(&format!("blk.{l}.{s}"), role, Some(l), dims);
        let attn_hc = Self::mixer(cx, &format!("blk.{l}.hc_attn"), Some(l), c, true)?;
        let ffn_hc = Self::mixer(cx, &format!("blk.{l}.hc_ffn"), Some(l), c, true)?;
        let ple = match &c.ple {
            Some(p) if p.layer == l => {
                let (nh, hw) = (((p.ngram - 1) * p.heads) as u64, (c.hc * c.n_embd) as u64);
                let rows = p.offsets.iter().zip(&p.vocab).map(|(o, v)| o + v).max().unwrap_or(0) as u64;
                let table = cx.weight("per_layer_token_embd.weight", Role::Embedding, Some(l))?;
                let td = cx.tensor("per_layer_token_embd.weight").map(|t| t.dims.to_vec()).unwrap_or_default();
                if td.len() != 2 || td[0] != p.head_dim as u64 || td[1] < rows {
                    return Err(PluginError::BadShape { name: "per_layer_token_embd.weight".into(), expected: vec![p.head_dim as u64, rows], found: td });
                }
                let emb = nh * p.head_dim as u64;
                Some(PleLayer {
                    table,
                    key: w(cx, "ple_key.weight", Role::Attention, &[emb, hw])?,
                    value: w(cx, "ple_value.weight", Role::Attention, &[emb, e])?,
                    norm_key: w(cx, "ple_norm_key.weight", Role::Norm, &[hw])?,
                    norm_query: w(cx, "ple_norm_query.weight", Role::Norm, &[hw])?,
                    norm_conv: w(cx, "ple_norm_conv.weight", Role::Norm, &[hw])?,
                    conv: w(cx, "ple_conv1d.weight", Role::Attention, &[p.conv_kernel as u64, hw])?,
                    tokens: cx.rows_state(l, 1),
                    conv_rows: cx.rows_state(l, c.hc * c.n_embd),
                })
            }
            _ => None,
        };
        let block = if c.recurrent[l as usize] {
            let dims = (c.hk, c.hv, c.dk, c.dv);
            let (window, state) = GatedDeltaNet::state_dims(dims, c.conv_kernel as u64);
            let states = (cx.recurrent_state(l, &window), cx.recurrent_state(l, &state));
            let decl = GatedDeltaNet::declare(|n, r, dm| w(cx, n, r, dm), states, e, dims, c.conv_kernel as u64, c.eps)?;
            Block::Delta(decl)
        } else {
            let (nq, nkv) = (c.n_head as u64 * hd, c.n_kv_head as u64 * hd);
            let (ih, id) = (c.idx_heads as u64, c.idx_dim as u64);
            Block::Attn(AttnLayer {
                wq: w(cx, "attn_q.weight", Role::Attention, &[e, 2 * nq])?,
                wk: w(cx, "attn_k.weight", Role::Attention, &[e, nkv])?,
                wv: w(cx, "attn_v.weight", Role::Attention, &[e, nkv])?,
                wo: w(cx, "attn_output.weight", Role::Attention, &[nq, e])?,
                q_norm: w(cx, "attn_q_norm.weight", Role::Norm, &[hd])?,
                k_norm: w(cx, "attn_k_norm.weight", Role::Norm, &[hd])?,
                iq: w(cx, "indexer.q_proj.weight", Role::Attention, &[e, ih * id])?,
                ik: w(cx, "indexer.k_proj.weight", Role::Attention, &[e, id])?,
                iq_norm: w(cx, "indexer.q_norm.weight", Role::Norm, &[id])?,
                ik_norm: w(cx, "indexer.k_norm.weight", Role::Norm, &[id])?,
                ks: cx.rows_state(l, (nkv) as u32),
                vs: cx.rows_state(l, (nkv) as u32),
                idx: cx.rows_state(l, c.idx_dim),
            })
        };
        let (nx, ffx, ffs) = (c.n_expert as u64, c.n_ff_exp as u64, c.n_ff_shexp as u64);
        let moe = Moe {
            router: w(cx, "ffn_gate_inp.weight", Role::Router, &[e, nx])?,
            gate_exps: w(cx, "ffn_gate_exps.weight", Role::RoutedExpert, &[e, ffx, nx])?,
            up_exps: w(cx, "ffn_up_exps.weight", Role::RoutedExpert, &[e, ffx, nx])?,
            down_exps: w(cx, "ffn_down_exps.weight", Role::RoutedExpert, &[ffx, e, nx])?,
            shared: Ffn {
                gate: w(cx, "ffn_gate_shexp.weight", Role::SharedExpert, &[e, ffs])?,
                up: w(cx, "ffn_up_shexp.weight", Role::SharedExpert, &[e, ffs])?,
                down: w(cx, "ffn_down_shexp.weight", Role::SharedExpert, &[ffs, e])?,
            },
            shared_gate: w(cx, "ffn_gate_inp_shexp.weight", Role::SharedExpert, &[e, 1])?,
        };
        Ok(Layer { attn_hc, ple, block, ffn_hc, moe })
    }

    /// HF's grouped RMS norm (one group per stream) of `x` `[T, hc, E]`,
    /// times the `[hc·E]` weight: `[T, hc·E]`.
    fn stream_norm(&self, g: &mut Graph<'_>, x: Val, w: Wt) -> Result<Val, PluginError> {
        let r = rows(g, x)?;
        let xn = g.rms_norm(x, None, self.cfg.eps)?;
        let xn = g.reshape(xn, &[r, Dim::N((self.cfg.hc * self.cfg.n_embd) as u64)])?;
        let w = g.weight(w)?;
        g.mul(xn, w)
    }

    /// A mixer on the streams `x` `[T, hc, E]`: the block's input `[T, E]`
    /// and, with an inject weight, each stream's weight for the block's
    /// output `[T, hc, 1]`.
    fn mix(&self, g: &mut Graph<'_>, m: &Mixer, x: Val) -> Result<(Val, Option<Val>), PluginError> {
        let c = &self.cfg;
        let (hc, e) = (c.hc as u64, c.n_embd as u64);
        let inv = 1.0 / c.hc as f32;
        let r = rows(g, x)?;
        let xn = self.stream_norm(g, x, m.norm)?;
        let lo = g.linear(m.down, xn)?;
        let lo = g.scale(lo, inv)?;
        let lo = g.silu(lo)?;
        let gt = g.linear(m.up, lo)?;
        let gt = g.sigmoid(gt)?;
        let mx = g.mul(xn, gt)?;
        let mx = g.reshape(mx, &[r, Dim::N(hc), Dim::N(e)])?;
        let mx = g.mean(mx, 1)?;
        let h = g.reshape(mx, &[r, Dim::N(e)])?;
        let w = match m.inject {
            None => None,
            Some(inj) => {
                let w = g.linear(inj, xn)?;
                let w = g.scale(w, inv)?;
                let w = g.sigmoid(w)?;
                let w = g.scale(w, 2.0)?;
                Some(g.reshape(w, &[r, Dim::N(hc), Dim::N(1)])?)
            }
        };
        Ok((h, w))
    }

    /// The streams after a block's output `y` `[T, E]` is injected.
    fn inject(&self, g: &mut Graph<'_>, x: Val, w: Val, y: Val) -> Result<Val, PluginError> {
        let y = g.reshape(y, &[Dim::T, Dim::N(1), Dim::N(self.cfg.n_embd as u64)])?;
        let y = g.mul(w, y)?;
        g.add(x, y)
    }

    /// PLE's addition to the streams `x` `[T, hc, E]`.
    fn ple(&self, g: &mut Graph<'_>, p: &PleLayer, x: Val) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let cp = c.ple.as_ref().expect("a PLE layer has its config");
        let (hc, e) = (c.hc as u64, c.n_embd as u64);
        let streams = [Dim::T, Dim::N(hc), Dim::N(e)];
        let ids = g.tokens()?;
        let ids = g.to_f32(ids)?;
        let ids = g.reshape(ids, &[Dim::T, Dim::N(1)])?;
        let hist = g.state_rows(p.tokens, ids)?;
        let rows = g.ngram_hash(hist, cp.ngram, cp.heads, cp.eos, &cp.mult, &cp.offsets, &cp.vocab)?;
        let emb = g.embed(p.table, rows, 1.0)?;
        let emb = g.merge_heads(emb)?;
        let key = g.linear(p.key, emb)?;
        let key = g.reshape(key, &streams)?;
        let key = self.stream_norm(g, key, p.norm_key)?;
        let key = g.reshape(key, &streams)?;
        let q = self.stream_norm(g, x, p.norm_query)?;
        let q = g.reshape(q, &streams)?;
        let s = g.mul(key, q)?;
        let s = g.sum(s, -1)?;
        let s = g.scale(s, 1.0 / (e as f32).sqrt())?;
        // sign(s) · sqrt(max(|s|, 1e-6)), as HF writes it.
        let a = g.unary(s, pulsar_plugin_api::Unary::Abs)?;
        let mag = g.clamp(a, PLE_GATE_MIN, f32::INFINITY)?;
        let mag = g.unary(mag, pulsar_plugin_api::Unary::Sqrt)?;
        let den = g.clamp(a, f32::MIN_POSITIVE, f32::INFINITY)?;
        let sign = g.div(s, den)?;
        let gate = g.mul(mag, sign)?;
        let gate = g.sigmoid(gate)?;
        let v = g.linear(p.value, emb)?;
        let v = g.reshape(v, &[Dim::T, Dim::N(1), Dim::N(e)])?;
        let gv = g.mul(gate, v)?;
        let cn = self.stream_norm(g, gv, p.norm_conv)?;
        let cache = g.state_rows(p.conv_rows, cn)?;
        let cv = g.conv_rows(p.conv, cp.ngram, cache)?;
        let cv = g.silu(cv)?;
        let cv = g.reshape(cv, &streams)?;
        let out = g.add(gv, cv)?;
        let out = g.name(out, "ple_out", Some(cp.layer));
        g.add(x, out)
    }

    /// Gated attention over the QSA indexer's choice of keys.
    fn attention(&self, g: &mut Graph<'_>, w: &AttnLayer, h: Val) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let n = Dim::N;
        let (hd, hkv, grp) = (c.head_dim as u64, c.n_kv_head as u64, (c.n_head / c.n_kv_head) as u64);
        let rope = Rope::new(c.n_rot, c.rope_base, RopeMode::Neox);
        let qg = g.linear(w.wq, h)?;
        let qg = g.split_heads(qg, c.n_head, 2 * c.head_dim)?;
        let q = g.slice(qg, -1, 0, hd)?;
        let gate = g.slice(qg, -1, hd, hd)?;
        let k = g.linear(w.wk, h)?;
        let v = g.linear(w.wv, h)?;
        let k = g.split_heads(k, c.n_kv_head, c.head_dim)?;
        let q = g.rms_norm(q, Some(w.q_norm), c.eps)?;
        let k = g.rms_norm(k, Some(w.k_norm), c.eps)?;
        let q = g.rope(q, rope)?;
        let k = g.rope(k, rope)?;
        // The caches as [Hkv, 1, D, C] (k) and [Hkv, 1, C, D] (v).
        let kf = g.merge_heads(k)?;
        let kc = g.state_rows(w.ks, kf)?;
        let kc = g.reshape(kc, &[Dim::C, n(hkv), n(hd)])?;
        let kc = g.permute(kc, &[1, 2, 0])?;
        let kc = g.reshape(kc, &[n(hkv), n(1), n(hd), Dim::C])?;
        let vc = g.state_rows(w.vs, v)?;
        let vc = g.reshape(vc, &[Dim::C, n(hkv), n(hd)])?;
        let vc = g.permute(vc, &[1, 0, 2])?;
        let vc = g.reshape(vc, &[n(hkv), n(1), Dim::C, n(hd)])?;
        // Queries by KV group: [Hkv, G, T, D] (head h = group · G + g).
        let qq = g.reshape(q, &[Dim::T, n(hkv), n(grp), n(hd)])?;
        let qq = g.permute(qq, &[1, 2, 0, 3])?;
        let s = g.matmul(qq, kc)?;
        let s = g.scale(s, 1.0 / (hd as f32).sqrt())?;
        // The indexer: raw keys cached, pooled per block inside pooled_select.
        let ik = g.linear(w.ik, h)?;
        let ikc = g.state_rows(w.idx, ik)?;
        let iq = g.linear(w.iq, h)?;
        let iq = g.split_heads(iq, c.idx_heads, c.idx_dim)?;
        let iq = g.rms_norm(iq, Some(w.iq_norm), c.eps)?;
        let iq = g.rope(iq, rope)?;
        let keep = g.pooled_select(iq, ikc, c.ratio, c.idx_blocks, w.ik_norm, c.eps, 1.0 / (c.idx_dim as f32).sqrt(), rope)?;
        let s = g.add(s, keep)?;
        let p = g.softmax(s, -1)?;
        let o = g.matmul(p, vc)?; // [Hkv, G, T, D]
        let o = g.permute(o, &[2, 0, 1, 3])?;
        let o = g.reshape(o, &[Dim::T, n(c.n_head as u64), n(hd)])?;
        let gate = g.sigmoid(gate)?;
        let o = g.mul(o, gate)?;
        let o = g.merge_heads(o)?;
        g.linear(w.wo, o)
    }

    fn moe(&self, g: &mut Graph<'_>, m: &Moe, l: u32, h: Val) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let router = Router { weight: m.router, scores: Scores::Softmax, bias: None, top_k: c.n_expert_used, renormalize: true, scale: 1.0 };
        let (ids, w) = router.route(g, h)?;
        let spec = Experts { layer: l, gate: m.gate_exps, up: m.up_exps, down: m.down_exps, act: Act::Silu };
        let routed = g.experts(h, ids, w, spec)?;
        let shared = m.shared.swiglu(g, h)?;
        let sg = g.linear(m.shared_gate, h)?;
        let sg = g.sigmoid(sg)?;
        let shared = g.mul(shared, sg)?;
        g.add(routed, shared)
    }
}

impl FamilyPlugin for Qwen4Exp {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let cfg = Config::parse(cx)?;
        let (e, v) = (cfg.n_embd as u64, cfg.n_vocab as u64);
        let tok_embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, v])?;
        let output = cx.weight_shaped("output.weight", Role::Output, None, &[e, v])?;
        let output_hc = Self::mixer(cx, "output_hc", None, &cfg, false)?;
        let mut layers = Vec::with_capacity(cfg.n_layers as usize);
        for l in 0..cfg.n_layers {
            layers.push(Self::declare_layer(cx, &cfg, l)?);
        }
        cx.set_dims(cfg.n_layers, cfg.n_embd, cfg.n_vocab, cfg.n_ctx_train);
        Ok(Qwen4Exp { cfg, tok_embd, output_hc, output, layers })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let c = &self.cfg;
        let (hc, e) = (c.hc as usize, c.n_embd as u64);
        let ids = g.tokens()?;
        let x0 = g.embed(self.tok_embd, ids, 1.0)?;
        let x0 = g.reshape(x0, &[Dim::T, Dim::N(1), Dim::N(e)])?;
        let mut x = g.concat(&vec![x0; hc], 1)?;
        for (il, w) in self.layers.iter().enumerate() {
            let l = il as u32;
            if let Some(p) = &w.ple {
                x = self.ple(g, p, x)?;
            }
            let (h, wi) = self.mix(g, &w.attn_hc, x)?;
            let a = match &w.block {
                Block::Delta(d) => d.forward(g, h, l)?,
                Block::Attn(at) => self.attention(g, at, h)?,
            };
            let a = g.name(a, "attn_out", Some(l));
            x = self.inject(g, x, wi.expect("a block mixer injects"), a)?;
            let (h, wi) = self.mix(g, &w.ffn_hc, x)?;
            let f = self.moe(g, &w.moe, l, h)?;
            let f = g.name(f, "ffn_out", Some(l));
            x = self.inject(g, x, wi.expect("a block mixer injects"), f)?;
            x = g.name(x, "l_out", Some(l));
        }
        let x = g.output_rows(x)?;
        let (h, _) = self.mix(g, &self.output_hc, x)?;
        g.linear(self.output, h)
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
    name: "qwen4exp",
    families: { "qwen4exp" => Qwen4Exp },
}

#[cfg(test)]
mod tests;
