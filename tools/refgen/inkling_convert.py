"""HF Inkling -> GGUF in the "inkling" dialect, written by hand.

llama.cpp has no Inkling converter. The dialect below is the one that public
readers of Inkling GGUFs agree on (loaders of unsloth's Inkling-Small GGUFs
and the converter of a llama.cpp fork, all found through the code search;
none of their code is used here, only the names and keys they read):

global tensors    token_embd.weight       [n_embd, n_vocab]   (ne order)
                  token_embd_norm.weight  [n_embd]            RMSNorm on the embeddings
                  output_norm.weight      [n_embd]
                  output.weight           [n_embd, n_vocab]   never tied
per layer blk.N.  attn_norm, ffn_norm     [n_embd]
                  attn_q      [n_embd, n_head*head_dim]
                  attn_k/v    [n_embd, n_kv(N)*head_dim]
                  attn_r      [n_embd, n_head*d_rel]          relative-bias coefficients
                  attn_output [n_head*head_dim, n_embd]
                  attn_q_norm / attn_k_norm [head_dim]
                  attn_rel_proj [rel_extent(N), d_rel]        HF proj [d_rel, E] as is; F32
                  shortconv_k / shortconv_v [K, n_kv(N)*head_dim]  depthwise causal conv, conv(x)+x; F32
                  shortconv_attn / shortconv_mlp [K, n_embd]
                  ffn_gscale  [1]                             the FFN's global scale (dense: mlp,
                                                              MoE: router's)
  dense layers    ffn_gate / ffn_up [n_embd, n_ff], ffn_down [n_ff, n_embd]
  MoE layers      ffn_gate_inp [n_embd, n_expert + n_shared]  router rows for routed AND shared
                  exp_probs_b.bias [n_expert]                 selection-only bias
                  ffn_gate_exps / ffn_up_exps [n_embd, n_ff_exp, n_expert], ffn_down_exps [n_ff_exp, n_embd, n_expert]
                  ffn_gate_shexp / ffn_up_shexp [n_embd, n_ff_exp, n_shared] (3-D, stacked like the routed ones)
                  ffn_down_shexp [n_ff_exp, n_embd, n_shared]

keys (inkling.*)  block_count context_length embedding_length feed_forward_length (dense)
                  attention.head_count  attention.head_count_kv (per-layer array)
                  attention.key_length attention.value_length attention.layer_norm_rms_epsilon
                  attention.sliding_window  attention.sliding_window_pattern (per layer, true = sliding)
                  expert_count expert_used_count expert_shared_count expert_feed_forward_length
                  expert_weights_scale (route_scale) expert_gating_func (2 = sigmoid)
                  d_rel rel_extent rel_extent_swa (= sliding_window) shortconv_kernel dense_block_count
                  logit_scale_denom (divide the final hidden state by it) log_scaling_n_floor
                  log_scaling_alpha unpadded_vocab_size vocab_size
                  no rope.* keys at all: Inkling has no RoPE.
tokenizer         gpt2 BPE, tokenizer.ggml.pre = "inkling", bos = eos, add_bos false; ids at or
                  past unpadded_vocab_size are [PADn] UNUSED and their logits are masked.

The q8_0 file follows llama.cpp's converter rule: 2-D+ ".weight" tensors
Q8_0 (F16 where a row is not a multiple of 32), F32 for 1-D tensors, norms,
the router, biases, and the two that the fork forces F32 (attn_rel_proj,
shortconv_*).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch


def _gguf(llamacpp: Path):
    sys.path.insert(0, str(llamacpp / "gguf-py"))
    import gguf
    return gguf


def tensors_from_hf(model, cfg) -> list[tuple[str, torch.Tensor]]:
    """(gguf name, torch tensor in HF [out, in] layout) in file order."""
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    out: list[tuple[str, torch.Tensor]] = [
        ("token_embd.weight", sd.pop("model.embed_tokens.weight")),
        ("token_embd_norm.weight", sd.pop("model.embed_tokens.embed_norm.weight")),
    ]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        g = lambda k: sd.pop(p + k)  # noqa: E731
        out += [
            (b + "attn_norm.weight", g("input_layernorm.weight")),
            (b + "attn_q.weight", g("self_attn.q_proj.weight")),
            (b + "attn_k.weight", g("self_attn.k_proj.weight")),
            (b + "attn_v.weight", g("self_attn.v_proj.weight")),
            (b + "attn_r.weight", g("self_attn.r_proj.weight")),
            (b + "attn_output.weight", g("self_attn.o_proj.weight")),
            (b + "attn_q_norm.weight", g("self_attn.q_norm.weight")),
            (b + "attn_k_norm.weight", g("self_attn.k_norm.weight")),
            (b + "attn_rel_proj.weight", g("self_attn.rel_logits_proj.proj")),
            (b + "shortconv_k.weight", g("self_attn.k_sconv.conv1d.weight").squeeze(1)),
            (b + "shortconv_v.weight", g("self_attn.v_sconv.conv1d.weight").squeeze(1)),
            (b + "shortconv_attn.weight", g("attn_sconv.conv1d.weight").squeeze(1)),
            (b + "shortconv_mlp.weight", g("mlp_sconv.conv1d.weight").squeeze(1)),
            (b + "ffn_norm.weight", g("post_attention_layernorm.weight")),
        ]
        if cfg.mlp_layer_types[i] == "dense":
            out += [
                (b + "ffn_gscale.weight", g("mlp.global_scale")),
                (b + "ffn_gate.weight", g("mlp.gate_proj.weight")),
                (b + "ffn_up.weight", g("mlp.up_proj.weight")),
                (b + "ffn_down.weight", g("mlp.down_proj.weight")),
            ]
        else:
            gate_up = g("mlp.experts.gate_up_proj")  # [E, 2I, H]: gate rows then up rows
            n_ff = gate_up.shape[1] // 2
            out += [
                (b + "ffn_gscale.weight", g("mlp.gate.global_scale")),
                (b + "ffn_gate_inp.weight", g("mlp.gate.weight")),
                (b + "exp_probs_b.bias", g("mlp.gate.e_score_correction_bias")),
                (b + "ffn_gate_exps.weight", gate_up[:, :n_ff].contiguous()),
                (b + "ffn_up_exps.weight", gate_up[:, n_ff:].contiguous()),
                (b + "ffn_down_exps.weight", g("mlp.experts.down_proj")),
                (b + "ffn_gate_shexp.weight", g("mlp.shared_experts.gate_proj")),
                (b + "ffn_up_shexp.weight", g("mlp.shared_experts.up_proj")),
                (b + "ffn_down_shexp.weight", g("mlp.shared_experts.down_proj")),
            ]
    out += [
        ("output_norm.weight", sd.pop("model.norm.weight")),
        ("output.weight", sd.pop("lm_head.weight")),
    ]
    if sd:
        raise RuntimeError(f"inkling: HF tensors not mapped to GGUF: {sorted(sd)}")
    return out


def vocab(hf_dir: Path, n_vocab: int, gguf):
    """Token list as llama.cpp's get_vocab_base makes it: ids the tokenizer lacks
    become [PADi] UNUSED; added special tokens are CONTROL."""
    j = json.loads((hf_dir / "tokenizer.json").read_text())
    rev = {i: t for t, i in j["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in j["added_tokens"]}
    tokens, types = [], []
    for i in range(n_vocab):
        if i in special:
            tokens.append(special[i])
            types.append(gguf.TokenType.CONTROL)
        elif i in rev:
            tokens.append(rev[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = j["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, types, merges


def convert(hf_dir: Path, dst: Path, outtype: str, llamacpp: Path, eos_id: int) -> None:
    import transformers

    gguf = _gguf(llamacpp)
    model = transformers.InklingForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = model.config
    arch = "inkling"
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]

    w = gguf.GGUFWriter(str(dst), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("Tiny Inkling")
    is_swa = [t == "hybrid_sliding" for t in cfg.layer_types]
    n_kv = [cfg.swa_num_key_value_heads if s else cfg.num_key_value_heads for s in is_swa]
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_scale(cfg.route_scale)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_sliding_window(cfg.sliding_window_size)
    w.add_sliding_window_pattern(is_swa)
    w.add_uint32(f"{arch}.d_rel", cfg.d_rel)
    w.add_uint32(f"{arch}.rel_extent", cfg.rel_extent)
    w.add_uint32(f"{arch}.rel_extent_swa", cfg.sliding_window_size)
    w.add_uint32(f"{arch}.shortconv_kernel", cfg.conv_kernel_size)
    w.add_uint32(f"{arch}.dense_block_count", sum(t == "dense" for t in cfg.mlp_layer_types))
    w.add_float32(f"{arch}.logit_scale_denom", cfg.logits_mup_width_multiplier)
    w.add_uint32(f"{arch}.log_scaling_n_floor", int(cfg.log_scaling_n_floor or 0))
    w.add_float32(f"{arch}.log_scaling_alpha", cfg.log_scaling_alpha)
    w.add_uint32(f"{arch}.unpadded_vocab_size", cfg.unpadded_vocab_size or cfg.vocab_size)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types, merges = vocab(hf_dir, cfg.vocab_size, gguf)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("inkling")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    # Inkling prepends no BOS; readers pin bos to eos
    w.add_eos_token_id(eos_id)
    w.add_bos_token_id(eos_id)
    w.add_add_bos_token(False)

    force_f32 = ("attn_rel_proj.weight", "_gate_inp.weight")
    for name, t in tensors_from_hf(model, cfg):
        data = t.numpy().astype(np.float32)
        if outtype == "f32" or data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
                or name.endswith(force_f32) or ".shortconv_" in name:
            w.add_tensor(name, data)
            continue
        try:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        except gguf.QuantError:
            w.add_tensor(name, data.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
