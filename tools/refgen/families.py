"""One entry per model family: the tiny geometry, its tokenizer, and what it
exercises. gen.py turns each entry into fixtures/parity/<arch>/.

Geometry rules (see README.md): hidden 64, 2-4 heads, few layers, vocab 384,
>= 8 routed experts with top-k >= 2, and every layer type of the family
present. Widths that feed a matmul's inner dimension are multiples of 32 so
the q8_0 file quantizes them (q8_0 blocks are 32 wide; the converter keeps
any other width in f16/f32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

VOCAB = 384

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class Family:
    name: str                 # key for --family
    arch: str                 # GGUF general.architecture (also the fixture dir)
    model_type: str           # HF transformers model_type
    config: dict              # kwargs for the HF config
    features: list[str]       # what this fixture exercises (goes to meta.json)
    tokenizer: str = "bpe"    # "bpe" (tokenizer.json) or "spm" (tokenizer.model)
    tokpre: str = "qwen2"     # tokenizer.ggml.pre the family's real GGUFs carry
    specials: list[str] = field(default_factory=lambda: list(QWEN_SPECIALS))
    bos: str | None = None
    eos: str = "<|endoftext|>"
    add_bos: bool = False
    chat_template: str | None = QWEN_TEMPLATE
    notes: list[str] = field(default_factory=list)
    seed: int = 1234
    # Extra tensors written into the checkpoint next to the HF ones (e.g. MTP
    # layers that transformers does not instantiate):
    # fn(saved tensors, config, gen) -> dict of new tensors.
    extra_tensors: Callable | None = None
    # Known, explained difference between the HF and GGUF element counts.
    numel_delta: int = 0
    numel_delta_why: str = ""
    # Model class override (default AutoModelForCausalLM).
    model_class: str | None = None
    # Per-family init tweak after the generic one: fn(model, gen).
    post_init: Callable | None = None
    # Edit the saved HF dir before conversion (e.g. add the checkpoint's legacy
    # config keys a converter reads): fn(hf_dir).
    post_save: Callable | None = None
    # HF tensors deliberately left out of the text GGUF (vision towers):
    # excluded from the element-count check, listed in meta.json.
    hf_ignore_prefixes: tuple[str, ...] = ()
    # Full model config kwargs for multimodal wrappers (text_config inside);
    # when None, `config` is the model's config.
    wrapper_config: Callable | None = None
    # Build the converter's input dir from the saved HF dir, per outtype, when
    # the converter wants another checkpoint layout: fn(hf_dir, out_dir, outtype) -> dir.
    convert_input: Callable | None = None
    # Pass --raw-config-keys to convert_wrapper.py (see there).
    raw_config_keys: bool = False
    # ... and --raw-config-prefer with these keys.
    raw_config_prefer: tuple[str, ...] = ()
    # Special tokens put before the prompt (after BOS if any), e.g. GLM's
    # "[gMASK]<sop>" that its chat template opens with.
    prefix: list[str] = field(default_factory=list)
    # Hand-written converter (no llama.cpp converter for the arch):
    # fn(fam, hf_dir, dst, outtype, llamacpp_dir).
    custom_convert: Callable | None = None
    # Size of the trained tokenizer when smaller than vocab_size (padded vocab).
    tokenizer_vocab: int | None = None
    # fixtures/parity/<fixture_dir>; defaults to arch (a second fixture of one
    # arch, e.g. a Kimi variant of deepseek2, needs its own).
    fixture_dir: str | None = None


FAMILIES: dict[str, Family] = {}


def register(f: Family) -> Family:
    FAMILIES[f.name] = f
    return f


register(Family(
    name="qwen3moe", arch="qwen3moe", model_type="qwen3_moe",
    config=dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=381, pad_token_id=381,
    ),
    features=["GQA (4 q heads, 2 kv heads, head_dim 32 != hidden/heads)", "q/k RMSNorm per head",
              "softmax top-k router, top-2 of 8, weights renormalised (norm_topk_prob)",
              "SwiGLU experts", "untied output", "no BOS (Qwen)"],
))


register(Family(
    name="gemma3", arch="gemma3", model_type="gemma3_text",
    config=dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, hidden_activation="gelu_pytorch_tanh",
        # llama.cpp hard-codes gemma3's 5:1 pattern (every 6th layer full) and
        # its attention scale 1/sqrt(head_dim): the HF config must agree.
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"],
        sliding_window=8, query_pre_attn_scalar=16,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, final_logit_softcapping=None, attn_logit_softcapping=None,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    ),
    tokenizer="spm", tokpre="default",
    specials=["<start_of_turn>", "<end_of_turn>"], bos="<bos>", eos="<eos>", add_bos=True,
    chat_template=None,
    features=["5:1 sliding/full attention (layers 0-4 and 6 sliding, window 8; layer 5 full)",
              "two RoPE bases (1e6 full, 1e4 sliding)", "GELU-tanh gated FFN",
              "sandwich norms (pre+post attention, pre+post FFN)", "q/k RMSNorm",
              "embeddings scaled by sqrt(hidden)", "MQA (4 q heads, 1 kv head)",
              "tied embeddings", "SPM tokenizer with byte fallback, BOS first",
              "zero-centred RMSNorm weights (HF computes x*(1+w))"],
    notes=["llama.cpp's converter stores every *norm.weight as w+1 (GGUF norm weights are the plain multiplier).",
           "GGUF has no lm_head: output uses token_embd (tied)."],
))


def _gemma4_post_init(model, gen):
    # layer_scalar is a buffer HF initialises to 1; real checkpoints carry other
    # values, so make it differ per layer to exercise it.
    import torch
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))


register(Family(
    name="gemma4", arch="gemma4", model_type="gemma4_text", model_class="Gemma4ForCausalLM",
    config=dict(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        # full-attention layers: wider heads, fewer kv heads, K reused as V
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        intermediate_size=64, hidden_activation="gelu_pytorch_tanh",
        # HF forces the last layer to be full; S S F covers S->S and S->F.
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1_000_000.0},
        },
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0,
        final_logit_softcapping=30.0,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    ),
    tokenizer="spm_hf", tokpre="default",
    specials=["<|turn>", "<turn|>"], bos="<bos>", eos="<eos>", add_bos=True, chat_template=None,
    post_init=_gemma4_post_init,
    numel_delta=16, numel_delta_why="rope_freqs.weight [global_head_dim/2 = 16] generated by the converter",
    features=["interleaved sliding window (S S F, window 8; the pattern is a per-layer GGUF array)",
              "full layers: head_dim 32, 1 kv head, K used as V (attention_k_eq_v), proportional RoPE on 1/4 of dims",
              "sliding layers: head_dim 16, 2 kv heads, RoPE 1e4", "q/k RMSNorm, scale-free v norm",
              "dense GELU-tanh FFN in parallel with a MoE block on every layer (8 experts, top-2, fused gate_up)",
              "router: scale-free RMSNorm, learned scale, softmax, renormalised top-k, per-expert scale",
              "per-layer output scalar (layer_scalar)", "final logit soft-capping 30",
              "tied embeddings scaled by sqrt(hidden)", "BOS first"],
    notes=["gemma4 norm weights are NOT shifted by the converter (Gemma4RMSNorm multiplies by w).",
           "The converter adds rope_freqs.weight (1 for rotated pairs, 1e30 for the rest) for the full layers' proportional RoPE: ggml's neox RoPE rotates the first pairs only.",
           "No per-layer-input embeddings (hidden_size_per_layer_input=0, as in the 26B-A4B MoE)."],
))


register(Family(
    name="hy_v3", arch="hy_v3", model_type="hy_v3",
    config=dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1, router_scaling_factor=2.826,
        mlp_layer_types=["dense", "sparse", "sparse"],
        max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=381, pad_token_id=381,
    ),
    tokpre="hy_v4",
    features=["GQA (4 q heads, 2 kv heads)", "q/k RMSNorm", "leading dense layer (layer 0), MoE layers 1-2",
              "sigmoid router with selection-only bias (e_score_correction_bias), top-2 of 8, renormalised, scaled by 2.826",
              "one shared expert", "SwiGLU", "untied output"],
    notes=["tokenizer.ggml.pre: llama.cpp lists no pre-tokenizer for Hy3; 'hy_v4' (Tencent's next family) is a guess.",
           "No MTP block: transformers' HYV3 model has none (the converter would export num_nextn_predict_layers if present).",
           "The selection bias is blk.N.exp_probs_b (no .weight/.bias suffix) in GGUF; it only chooses experts, weights come from the unbiased sigmoid."],
))


register(Family(
    name="minimax_m2", arch="minimax-m2", model_type="minimax_m2",
    config=dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        # HF reads partial_rotary_factor; the converter (like MiniMax's own
        # config.json) reads rotary_dim. Both say: rotate 16 of 32 head dims.
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
        rotary_dim=16,
        # MiniMax's config.json keys (HF keeps them as plain attributes); the
        # converter turns scoring_func into expert_gating_func.
        scoring_func="sigmoid", use_routing_bias=True,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=381, pad_token_id=381,
    ),
    tokpre="minimax-m2",
    features=["GQA (4 q heads, 2 kv heads, head_dim 32)", "partial rotary (16 of 32 dims, NeoX style)",
              "q/k RMSNorm over the whole projection (all heads together, not per head)",
              "sigmoid router with selection-only bias, top-2 of 8, renormalised", "SwiGLU experts, all layers MoE",
              "untied output"],
    notes=["The HF checkpoint is saved in MiniMax's original layout (block_sparse_moe.experts.N.w1/w2/w3); the converter stacks them into ffn_{gate,down,up}_exps."],
))


def _m3_wrapper(text: dict) -> dict:
    # transformers has M3 only as the VL model; a 1-layer vision tower rides
    # along (the text converter drops it). Saving the VL model writes MiniMax's
    # original checkpoint layout, which is what llama.cpp's converter reads.
    return dict(
        text_config=dict(text, model_type="minimax_m3_vl_text"),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=56, patch_size=14),
        projector_hidden_size=64, image_token_index=382, video_token_index=383,
        tie_word_embeddings=False,
    )


def _m3_post_init(model, gen):
    # llama.cpp hard-codes swiglu_oai's clamp at 7 (alpha 1.702): make the
    # gate/up pre-activations large enough (std ~4) that the clamp really bites.
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "gate_up_proj" in name:
                p.mul_(4.0)


def _m3_post_save(hf_dir):
    # The converter reads MiniMax's own config keys, which transformers maps
    # onto its flat ones on load but does not write back: add them (same values).
    import json
    p = hf_dir / "config.json"
    c = json.loads(p.read_text())
    t = c["text_config"]
    t["n_shared_experts"] = 1
    t["scoring_func"] = "sigmoid"
    t["sparse_attention_config"] = {
        "sparse_num_index_heads": t["index_n_heads"], "sparse_index_dim": t["index_head_dim"],
        "sparse_topk_blocks": t["index_topk_blocks"], "sparse_block_size": t["index_block_size"],
        "sparse_local_block": t["index_local_blocks"],
        "sparse_attention_freq": [int(x == "minimax_m3_sparse") for x in t["layer_types"]],
    }
    t["moe_layer_freq"] = [int(x == "sparse") for x in t["mlp_layer_types"]]
    p.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


register(Family(
    name="minimax_m3", arch="minimax-m3", model_type="minimax_m3_vl",
    model_class="MiniMaxM3SparseForConditionalGeneration", wrapper_config=_m3_wrapper,
    config=dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rotary_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                        "partial_rotary_factor": 0.5},
        intermediate_size=32, dense_intermediate_size=64, shared_intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0,
        swiglu_alpha=1.702, swiglu_limit=7.0,
        mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        # one indexer head per kv head (llama.cpp asserts it); blocks of 4 keys,
        # top-2 blocks + the local one: with ~30 tokens attention really is sparse
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=381, pad_token_id=381,
    ),
    tokpre="minimax-m2",
    post_init=_m3_post_init, post_save=_m3_post_save, raw_config_keys=True,
    hf_ignore_prefixes=("vision_tower.", "multi_modal_projector.", "patch_merge_mlp."),
    features=["leading dense layer (layer 0, full attention), MoE layers 1-2 with MiniMax sparse attention",
              "lightning indexer: 2 heads (one per kv head), head_dim 16, blocks of 4 keys, top-2 blocks + 1 local block",
              "partial rotary (16 of 32 dims), per-head q/k RMSNorm", "swiglu_oai (alpha 1.702, clamp 7, (up+1)*glu) in dense, routed and shared FFNs; clamp active",
              "sigmoid router with selection bias, top-2 of 8, renormalised, scaled by 2.0", "one shared expert",
              "zero-centred (1+w) RMSNorm weights", "untied output"],
    notes=["Text-only fixture from the VL model; the vision tower's tensors are not in the GGUF (hf_tensors_not_in_gguf).",
           "The converter stores every *norm.weight as w+1 (plain multiplier), like Gemma.",
           "llama.cpp M3 uses fixed swiglu_oai constants (alpha 1.702, limit 7); there is no GGUF key for them.",
           "No MTP: llama.cpp notes MTP is not in the released weights."],
))


DS_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
DS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
               "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")

# DeepSeek-V3 geometry shared by deepseek2 (and the Kimi K2.5 variant).
DSV3_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4,
    # MLA: q through a rank-32 bottleneck, kv compressed to a rank-32 latent
    # plus one shared 16-dim RoPE key
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    intermediate_size=64, moe_intermediate_size=32,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    rope_interleave=True,
    # keys of DeepSeek's config.json that HF ignores but the converter reads:
    # without scoring_func no expert_gating_func is written and llama.cpp
    # falls back to softmax (the DeepSeek-V2 behaviour)
    scoring_func="sigmoid", topk_method="noaux_tc",
    rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0,
                     "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
    max_position_embeddings=5120, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=380, eos_token_id=381, pad_token_id=381,
)

DSV3_FEATURES = [
    "MLA: q_lora_rank 32, kv_lora_rank 32, qk_nope 16 + qk_rope 16 per head, v_head 16, 4 heads",
    "YaRN RoPE (factor 40, original ctx 128, mscale_all_dim 1 -> attention scale mscale^2), interleaved rope layout",
    "leading dense layer (first_k_dense_replace=1), MoE layers 1-2",
    "sigmoid router with selection bias, group-limited top-k (4 groups of 2, top-2 groups, top-2 experts), "
    "renormalised, scaled by 2.5",
    "one shared expert", "SwiGLU", "untied output", "BOS first",
]
DSV3_NOTES = [
    "The converter splits kv_b_proj into attn_k_b (per head [kv_lora_rank, qk_nope], i.e. transposed for the "
    "absorbed-MLA form) and attn_v_b; it writes head_count_kv=1 and key_length = kv_lora_rank + qk_rope "
    "(MQA over the latent), with key_length_mla / value_length_mla the per-head dims before absorption.",
    "rope.scaling.yarn_log_multiplier is 0.1 * mscale_all_dim (llama.cpp's legacy deepseek2 convention).",
]

register(Family(
    name="deepseek_v3", arch="deepseek2", model_type="deepseek_v3",
    config=dict(DSV3_CONFIG),
    tokpre="deepseek-v3", specials=DS_SPECIALS, bos=DS_SPECIALS[0], eos=DS_SPECIALS[1], add_bos=True,
    chat_template=DS_TEMPLATE,
    features=DSV3_FEATURES,
    notes=DSV3_NOTES + ["No MTP block: transformers' DeepseekV3 has none, and llama.cpp's deepseek2 converter "
                        "drops layers past num_hidden_layers anyway."],
))


def _kimi_wrapper(text: dict) -> dict:
    # Kimi K2.5 is DeepSeek-V3's text model inside a VL wrapper; a 1-layer
    # vision tower rides along and is dropped by the text converter.
    return dict(
        text_config=dict(text, model_type="deepseek_v3"),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2),
        projection_hidden_size=32, image_token_id=382, video_token_id=383,
        vision_start_token_id=382, vision_end_token_id=383, tie_word_embeddings=False,
    )


def _kimi_post_save(hf_dir):
    # Moonshot's checkpoints name the class KimiK25ForConditionalGeneration
    # (remote code); transformers' port is Kimi_K25...; the converter knows
    # only the former.
    import json
    p = hf_dir / "config.json"
    c = json.loads(p.read_text())
    c["architectures"] = ["KimiK25ForConditionalGeneration"]
    p.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    # transformers 5.24 saves the language model's decoder layers as
    # language_model.model.blocks.N (its reverse of the vision tower's
    # blocks->layers rename is applied to every key); Moonshot's checkpoints
    # say layers.N. Undo it so the file looks like theirs.
    from safetensors.torch import load_file, save_file
    st = hf_dir / "model.safetensors"
    t = load_file(str(st))
    t = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in t.items()}
    save_file(dict(sorted(t.items())), str(st), metadata={"format": "pt"})


register(Family(
    name="kimi_k25", arch="deepseek2", fixture_dir="deepseek2-kimi_k25", model_type="kimi_k25",
    model_class="Kimi_K25ForConditionalGeneration", wrapper_config=_kimi_wrapper,
    # Kimi K2 routes without expert groups (n_group 1) over DeepSeek-V3's layout.
    config=dict(DSV3_CONFIG, n_group=1, topk_group=1, routed_scaling_factor=2.827),
    tokpre="kimi-k2", specials=["[BOS]", "[EOS]", "<|im_user|>", "<|im_assistant|>"], bos="[BOS]", eos="[EOS]",
    add_bos=True, chat_template=None, post_save=_kimi_post_save,
    hf_ignore_prefixes=("model.vision_tower.", "model.mm_projector.", "vision_tower.", "mm_projector.",
                        "multi_modal_projector."),
    features=[f for f in DSV3_FEATURES if not f.startswith("sigmoid")] + [
        "sigmoid router with selection bias, no expert groups (n_group 1), top-2 of 8, renormalised, scaled by 2.827",
        "checkpoint in the VL wrapper layout (language_model.*), converted by the same deepseek2 path"],
    notes=DSV3_NOTES + ["Same GGUF arch as deepseek2/: this variant checks the Kimi wrapper and kimi-k2 "
                        "tokenizer.ggml.pre; the vision tower is not in the GGUF."],
))


GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]

register(Family(
    name="glm_moe_dsa", arch="glm-dsa", model_type="glm_moe_dsa",
    config=dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        # DSA lightning indexer: 4 heads of 32, each query keeps its top 8 keys
        # (fewer than the ~30 positions, so the selection matters); layer 1
        # reuses layer 0's selection, layer 2 runs its own
        index_n_heads=4, index_head_dim=32, index_topk=8, indexer_types=["full", "shared", "full"],
        scoring_func="sigmoid", topk_method="noaux_tc",
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=377, pad_token_id=377,
    ),
    tokpre="glm4", specials=GLM_SPECIALS, eos="<|endoftext|>", add_bos=False, chat_template=None,
    prefix=["[gMASK]", "<sop>"],
    features=["MLA (q_lora 32, kv_lora 32, qk_nope 16 + qk_rope 16, v 16, 4 heads)",
              "DSA lightning indexer: 4 heads x 32, top-8 keys per query; per-layer indexer_types full/shared/full "
              "(layer 1 reuses layer 0's top-k)",
              "leading dense layer, MoE layers 1-2, sigmoid router with selection bias, no groups, top-2 of 8, "
              "renormalised, scaled by 2.5", "one shared expert", "untied output",
              "prompt opens with [gMASK]<sop> (GLM's template), no BOS token"],
    notes=["Same MLA conventions as deepseek2 (attn_k_b/attn_v_b split, head_count_kv 1).",
           "No MTP/NextN block: transformers' GlmMoeDsa has none (the converter exports num_nextn_predict_layers when present)."],
))


def qwen35_mtp(saved: dict, cfg, gen) -> dict:
    """A Qwen3.5-style MTP block, as Qwen's checkpoints carry it: mtp.fc
    [H, 2H], mtp.pre_fc_norm_{embedding,hidden}, mtp.norm and mtp.layers.0.*,
    one full-attention decoder layer. transformers does not model MTP (it
    ignores mtp.* on load), so the block is random and absent from the logits;
    its layer is shaped like the model's last (full-attention) layer, with the
    same init rule as gen.reinit (norms zero-centred, as Qwen3.5's are)."""
    import math
    import torch
    n = cfg.num_hidden_layers
    assert cfg.layer_types[n - 1] == "full_attention"
    src = f"model.layers.{n - 1}."
    h = cfg.hidden_size
    out = {}

    def rnd(shape):
        t = torch.randn(shape, generator=gen)
        return 0.1 * t if len(shape) == 1 else t / math.sqrt(shape[-1])

    for k in sorted(saved):
        if k.startswith(src):
            out["mtp.layers.0." + k[len(src):]] = rnd(tuple(saved[k].shape))
    out["mtp.fc.weight"] = rnd((h, 2 * h))
    for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{k}.weight"] = rnd((h,))
    return out


QWEN35_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    # gated delta net: 2 key heads, 4 value heads (v heads grouped per k head,
    # which the converter reorders), head dims 16, conv kernel 4
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    # interleaved M-RoPE on 1/4 of head_dim (8 dims = 4 pairs, sections 2+1+1);
    # text-only positions make it plain RoPE on those dims
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    mtp_num_hidden_layers=1,
    max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=381, pad_token_id=381,
)
QWEN35_FEATURES = [
    "gated delta net (linear attention) on layers 0-2, gated full attention on layer 3 (3 of 4)",
    "GDN: 2 k heads / 4 v heads x 16, short conv (kernel 4) over q/k/v, SiLU, gated RMSNorm output, A_log/dt_bias decay",
    "full attention: 4 q heads, 2 kv heads, head_dim 32, q/k RMSNorm, sigmoid output gate from q_proj",
    "partial interleaved M-RoPE (8 of 32 dims, sections [2,1,1])",
    "MTP block (1 layer) in the GGUF as blk.4 nextn tensors; random, not part of logits",
    "zero-centred (1+w) RMSNorm weights", "untied output", "no BOS (Qwen)",
]
QWEN35_NOTES = [
    "Converter rewrites: A_log -> ssm_a = -exp(A_log); dt_bias -> ssm_dt.bias; conv1d weight squeezed to "
    "[channels, kernel]; every *norm.weight +1 except the GDN's gated norm (linear_attn.norm, stored as is).",
    "Converter reorders GDN value heads from HF's grouped order (per k head, its v heads) to tiled order "
    "(in_proj_qkv V rows, in_proj_z, in_proj_a/b, A_log, dt_bias, conv1d V channels, out_proj columns).",
    "MTP: logits.npy comes from the trunk only (transformers ignores mtp.*); block_count includes the MTP layer "
    "and nextn_predict_layers=1.",
]

register(Family(
    name="qwen3_5_moe", arch="qwen35moe", model_type="qwen3_5_moe_text", model_class="Qwen3_5MoeForCausalLM",
    config=dict(QWEN35_COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                num_experts=8, num_experts_per_tok=2),
    tokpre="qwen35",
    extra_tensors=qwen35_mtp,
    features=QWEN35_FEATURES + ["MoE on every layer: softmax top-2 of 8 (renormalised), one shared expert "
                                "with a sigmoid gate (shared_expert_gate)"],
    notes=QWEN35_NOTES,
))

register(Family(
    name="qwen3_5", arch="qwen35", model_type="qwen3_5_text", model_class="Qwen3_5ForCausalLM",
    config=dict(QWEN35_COMMON, intermediate_size=64),
    tokpre="qwen35",
    extra_tensors=qwen35_mtp,
    features=QWEN35_FEATURES + ["dense SwiGLU FFN"],
    notes=QWEN35_NOTES,
))


register(Family(
    name="laguna", arch="laguna", model_type="laguna",
    config=dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        # heads vary per layer as in Laguna-XS.2
        num_attention_heads_per_layer=[4, 2, 4, 4],
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500_000.0, "partial_rotary_factor": 0.5,
                               "factor": 8.0, "original_max_position_embeddings": 512,
                               "beta_fast": 32.0, "beta_slow": 1.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0},
        },
        gating=True,  # per-head sigmoid output gate (g_proj)
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, moe_routed_scaling_factor=2.5,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=381, pad_token_id=381,
    ),
    tokpre="laguna",
    features=["full attention on layer 3 (every 4th), sliding window 8 on layers 0-2",
              "YaRN (factor 8) + partial rotary (8 of 16 dims) on the full layer only; plain RoPE 1e4 on all dims of sliding layers",
              "per-head sigmoid output gate (g_proj -> attn_gate [hidden, n_head])", "per-layer head counts [4, 2, 4, 4], 2 kv heads", "q/k RMSNorm",
              "leading dense layer, MoE layers 1-3: sigmoid router with selection bias, top-2 of 8, renormalised, "
              "scaled by 2.5", "one shared expert", "untied output"],
    notes=["The GGUF has no per-layer sliding pattern key: llama.cpp's laguna makes every 4th layer full, "
           "which is what layer_types here says.",
           "YaRN parameters (rope.scaling.*) apply to full layers only; sliding layers use rope.freq_base_swa "
           "and rope.dimension_count_swa."],
))


def _dsv4_post_init(model, gen):
    import dsv4
    dsv4.round_experts_to_mxfp4(model, gen)


def _dsv4_convert_input(hf_dir, out_dir, outtype):
    import dsv4
    return dsv4.convert_input(hf_dir, out_dir, outtype)


register(Family(
    name="deepseek_v4", arch="deepseek4", model_type="deepseek_v4",
    config=dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
        q_lora_rank=32, o_groups=2, o_lora_rank=32,
        # one layer of each attention kind: sliding-window only, compressed
        # sparse (CSA, every 4 keys pooled, indexer top-4), heavily compressed
        # (HCA; 8 instead of 128 so ~30 tokens fill some compressed slots)
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=4,
        rope_theta=10_000.0, compress_rope_theta=160_000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        # token-id hash routing on the first two layers, learned routing after
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
        # real models clamp at 10; 2 makes the clamp bite at O(1) activations
        # (the GGUF carries the value per layer: swiglu_clamp_exp / _shexp)
        swiglu_limit=2.0,
        num_nextn_predict_layers=0,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=380, eos_token_id=381, pad_token_id=381,
    ),
    tokpre="deepseek-v3", specials=DS_SPECIALS, bos=DS_SPECIALS[0], eos=DS_SPECIALS[1], add_bos=True,
    chat_template=None,
    post_init=_dsv4_post_init, convert_input=_dsv4_convert_input,
    features=["4-stream hyper-connections (hc_mult 4) with Sinkhorn-normalised mixing (20 iterations), "
              "per-layer attn/ffn hc fn/base/scale and the final hc_head",
              "attention: q_lora 32, a single shared kv head of 32 (MQA), partial rotary 8 of 32 dims, "
              "learned attention sinks, grouped low-rank output (o_groups 2, o_lora 32)",
              "layer 0 sliding window 8 only; layers 1 and 3 compressed sparse attention (ratio 4, lightning "
              "indexer 2x16, top-4 compressed blocks) + window; layer 2 heavily compressed (ratio 8) + window",
              "plain RoPE 1e4 on sliding layers, YaRN (factor 16) RoPE 1.6e5 on compressed layers",
              "token-id hash routing (tid2eid) on layers 0-1, sqrt-softplus router with selection bias on 2-3, "
              "top-2 of 8, renormalised, scaled by 1.5",
              "one shared expert", "SwiGLU with clamp (limit 2, active)", "routed experts in MXFP4 (as released)",
              "untied output", "BOS first"],
    notes=["llama.cpp's deepseek4 converter reads only DeepSeek's release layout; tools/refgen/dsv4.py writes it "
           "from the HF checkpoint (original tensor names, experts packed MXFP4, config keys compress_ratios / "
           "num_hash_layers / qk_rope_head_dim / rope_scaling).",
           "Routed experts are MXFP4 in BOTH GGUFs (the converter always repacks them; there is no f32 path). "
           "The HF weights were rounded to the MXFP4 grid before the logits were taken, so the f32 file is still "
           "exact: MXFP4 dequantization is lossless for these values.",
           "model-q8_0.gguf: the 2-D attention/compressor/indexer/shared-expert projections were handed to the "
           "converter as FP8 e4m3 (E8M0 128x128 block scales) like the release, dequantized and stored Q8_0; "
           "embed/head as BF16 (stored BF16). It is therefore further from logits.npy than other q8_0 files.",
           "model-f32.gguf: everything but the experts F32 (the converter keeps float32 sources F32 whatever "
           "--outtype says).",
           "No MTP block (num_nextn_predict_layers 0): the converter leaves MTP out of the main GGUF anyway."],
))


def _qwen4exp_post_save(hf_dir):
    # Qwen's checkpoints call the QSA layers "full_attention"; transformers
    # renames them "indexed_attention" and saves that. Write the checkpoint's
    # spelling back (transformers maps it again on load).
    import json
    p = hf_dir / "config.json"
    c = json.loads(p.read_text())
    c["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in c["layer_types"]]
    p.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


register(Family(
    name="qwen4_exp", arch="qwen4exp", model_type="qwen4_exp_text", model_class="Qwen4ExpForCausalLM",
    config=dict(
        QWEN35_COMMON,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True,
        hc_count=4, hc_lowrank=16,
        # PLE n-gram hash embeddings on layer 2 (1-based id; a GDN layer): 2- and
        # 3-grams x 2 hashed heads of 16 dims, small prime vocabs, 2 shards
        ple_layer_ids=[2], ple_embed_dim=64, ngram_size=3, heads_per_ngram=2, ple_conv_kernel_size=4,
        ngram_vocab_size_base=64, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
        # QSA on the full layer: 2 index heads x 16, one key head, keys pooled by 4, 8-token budget
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        mtp_num_hidden_layers=0,
    ),
    tokpre="qwen35",
    post_save=_qwen4exp_post_save, raw_config_prefer=("layer_types",),
    numel_delta=-11,
    numel_delta_why="the PLE hash constants (int64 layer_multipliers[3], ngram_heads_offsets[4], "
                    "ngram_heads_vocab_sizes[4]) become GGUF metadata arrays, not tensors",
    features=[f for f in QWEN35_FEATURES if not f.startswith("MTP")] + [
        "4-stream hyper-connections (hc_count 4, low-rank 16 input mixer) in place of the layer norms, final mixer",
        "QSA sparse attention on the full layer: indexer 2 heads x 16, 1 key head, compress ratio 4, budget 8",
        "per-layer n-gram hash embeddings (PLE) on layer 1 (0-based): table split in 2 shards, depthwise conv k=4",
        "MoE on every layer: softmax top-2 of 8 renormalised, shared expert with sigmoid gate"],
    notes=[n for n in QWEN35_NOTES if not n.startswith("MTP")] + [
        "No MTP: llama.cpp's qwen4exp converter drops the MTP head (supports_mtp_export False), so real GGUFs "
        "have none either.",
        "The converter concatenates the PLE shards into per_layer_token_embd.weight and stores the hash "
        "constants as ple.* metadata; ple.layers are 0-based. PLE/indexer norm weights get +1 (zero-centred).",
        "The converter splits indexer.index_qk_proj into indexer q and k projections.",
        "In model-q8_0.gguf the converter stores the PLE conv kernel, the PLE table and the hc up-projections F16 (rows not a multiple of 32); the GDN conv kernel stays F32. In model-f32.gguf all are F32."],
))


def _inkling_post_init(model, gen):
    # Inkling divides the final hidden state by logits_mup_width_multiplier
    # (24) before lm_head; scale lm_head up by as much so the logits are O(1).
    import torch
    with torch.no_grad():
        model.lm_head.weight.mul_(model.config.logits_mup_width_multiplier)


def _inkling_convert(fam, hf_dir, dst, outtype, llamacpp):
    import inkling_convert
    inkling_convert.convert(hf_dir, dst, outtype, llamacpp, eos_id=fam.config["eos_token_id"])


register(Family(
    name="inkling", arch="inkling", model_type="inkling_text", model_class="InklingForCausalLM",
    config=dict(
        # 380 real tokens padded to 384 rows, as Inkling pads its vocab
        vocab_size=VOCAB, unpadded_vocab_size=380, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, head_dim=16, num_key_value_heads=2,
        swa_num_attention_heads=4, swa_head_dim=16, swa_num_key_value_heads=1,
        # layers 0, 1, 3 sliding (window 8, whose bias bank is 8 wide), layer 2 full
        local_layer_ids=[0, 1, 3], sliding_window_size=8,
        d_rel=8, rel_extent=16,  # full layer's bias bank: 16 < ~30 positions, so the cut-off matters
        log_scaling_n_floor=8, log_scaling_alpha=0.1,  # active past position 8 on the full layer
        conv_kernel_size=4,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, shared_expert_sink=True, route_scale=8.0,
        logits_mup_width_multiplier=24.0,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=377, eos_token_id=377, pad_token_id=377,
    ),
    tokenizer_vocab=380, tokpre="inkling",
    specials=["<|end_of_text|>", "<|begin_message|>", "<|end_message|>"], eos="<|end_of_text|>", add_bos=False,
    chat_template=None,
    post_init=_inkling_post_init, custom_convert=_inkling_convert,
    features=["no RoPE: position enters through a learned relative-position bias (attn_r coefficients x "
              "attn_rel_proj bank, d_rel 8; bank 8 wide on sliding layers, 16 on the full layer, zero beyond)",
              "attention scale 1/head_dim (per-head q/k RMSNorm)", "sliding window 8 on layers 0, 1, 3; full on 2",
              "per-layer kv heads [1, 1, 2, 1] (4 q heads)", "log-length scaling of q and bias on the full layer past "
              "position 8 (alpha 0.1)",
              "four causal depthwise short convs per layer (k, v on the raw projections; after attention; after FFN), "
              "each conv(x)+x, kernel 4",
              "RMSNorm on the token embeddings", "leading dense layer with global scale",
              "MoE layers 1-3: sigmoid router over 8 routed + 2 shared rows, selection bias, top-2; routed and shared "
              "weights normalised together (sink), x route_scale 8 x global scale",
              "final hidden state divided by 24 (logit_scale_denom); untied output",
              "padded vocab: 380 real tokens of 384; logits.npy has 380 columns", "no BOS"],
    notes=["No llama.cpp converter exists: tools/refgen/inkling_convert.py writes the GGUF in the dialect public "
           "Inkling GGUF readers use (documented there and in README.md).",
           "logits.npy is [n_tokens, 380]: transformers drops the padding rows; GGUF readers mask ids >= "
           "inkling.unpadded_vocab_size to -inf instead.",
           "lm_head was scaled x24 at init to undo the 1/24 logit divisor (weights only; the math is Inkling's).",
           "No MTP: transformers ignores model.mtp.*, and the readers drop it too."],
))
