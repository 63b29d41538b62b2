"""DeepSeek-V4: make the HF model's checkpoint look like DeepSeek's release,
which is the only input llama.cpp's deepseek4 converter accepts.

The converter (conversion/deepseek.py: DeepseekV4Model) reads DeepSeek's own
tensor names (embed.weight, layers.N.attn.wq_a.weight, hc_head_fn, ...), their
config keys (compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling)
and routed experts only as MXFP4 (uint8 e2m1 nibble pairs + one E8M0 exponent
per 32 values), which it repacks losslessly into ggml MXFP4. So:
  - the HF model's expert weights are first rounded onto the MXFP4 grid
    (round_experts_to_mxfp4, run before the logits are computed), so the
    GGUF's MXFP4 experts hold exactly the weights the reference used;
  - convert_input() writes a converter-facing copy of the checkpoint: original
    names, experts packed, and for the q8_0 file the 2-D projections as FP8
    e4m3 with E8M0 128x128 block scales (how DeepSeek ships them; the
    converter dequantizes those and stores Q8_0) and embed/head as BF16.
    For the f32 file every non-expert tensor is given as float32, which the
    converter keeps F32.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

# e2m1 magnitudes in code order (codes 8..15 are the negatives); ggml's
# kvalues_mxfp4 use the same order.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (codes uint8 [rows, cols], e8m0 uint8 [rows, cols/32], dequantized w).

    OCP MX rule: the block exponent is floor(log2(amax)) - 2 (2 = e2m1's emax),
    values round to the nearest e2m1 magnitude, saturating at 6.
    """
    rows, cols = w.shape
    assert cols % 32 == 0, cols
    b = w.float().reshape(rows, cols // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-30))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scale = torch.exp2(exp)
    mag = (b.abs() / scale).clamp(max=6.0)
    idx = (mag.unsqueeze(-1) - E2M1).abs().argmin(-1)  # nearest magnitude (ties -> smaller)
    sign = (b < 0) & (idx > 0)
    codes = (idx + 8 * sign).to(torch.uint8)
    deq = (E2M1[idx] * torch.where(sign, -1.0, 1.0)) * scale
    e8m0 = (exp.squeeze(-1) + 127).to(torch.uint8)
    return codes.reshape(rows, cols), e8m0, deq.reshape(rows, cols)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes -> [rows, cols/2]: element 2i low nibble, 2i+1 high."""
    c = codes.reshape(codes.shape[0], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def round_experts_to_mxfp4(model, gen) -> None:  # noqa: ARG001 (post_init signature)
    """post_init hook: snap routed-expert weights to MXFP4-representable values.
    Also give the hash-routed layers a real token->experts table (HF inits it to 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and p.ndim == 3:  # [E, out, in]
                for e in range(p.shape[0]):
                    p[e].copy_(mxfp4_quant(p[e])[2])
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                vocab, k = b.shape
                n_exp = model.config.n_routed_experts
                rows = [torch.randperm(n_exp, generator=gen)[:k] for _ in range(vocab)]
                b.copy_(torch.stack(rows))


def fp8_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek FP8 layout: e4m3 weights + one E8M0 scale per 128x128 block."""
    rows, cols = w.shape
    br, bc = math.ceil(rows / 128), math.ceil(cols / 128)
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    sc = torch.empty(br, bc, dtype=torch.uint8)
    for i in range(br):
        for j in range(bc):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = float(blk.abs().max())
            e = math.ceil(math.log2(amax / 448.0)) if amax > 0 else -127
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / 2.0 ** e).to(torch.float8_e4m3fn)
            sc[i, j] = e + 127
    return out, sc


# 2-D projections DeepSeek ships in FP8 (the q8_0 fixture gives these as FP8).
FP8_RE = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|compressor\.(wkv|wgate)|indexer\.(wq_b|compressor\.(wkv|wgate)))"
                    r"|ffn\.shared_experts\.w[123])\.weight$")


def original_name(k: str) -> str:
    if k == "model.embed_tokens.weight":
        return "embed.weight"
    if k == "model.norm.weight":
        return "norm.weight"
    m = re.match(r"model\.hc_head\.hc_(fn|base|scale)$", k)
    if m:
        return f"hc_head_{m.group(1)}"
    if k.startswith("model.layers."):
        k = k[len("model."):]
        # transformers' reverse of its ".norm." -> ".kv_norm." rename (meant for
        # the compressors' norms) also hits the attention's own kv_norm
        return re.sub(r"^(layers\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", k)
    return k  # head.weight is already DeepSeek's name


def convert_input(hf_dir: Path, out_dir: Path, outtype: str) -> Path:
    from safetensors.torch import load_file, save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out_dir / f.name)

    src = load_file(str(hf_dir / "model.safetensors"))
    dst: dict[str, torch.Tensor] = {}
    for k, v in src.items():
        name = original_name(k)
        if re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", name):
            codes, e8m0, deq = mxfp4_quant(v)
            if not torch.equal(deq, v.float()):
                raise RuntimeError(f"{k} is not on the MXFP4 grid (round_experts_to_mxfp4 not applied?)")
            dst[name] = pack_nibbles(codes)
            dst[name[:-len(".weight")] + ".scale"] = e8m0
        elif outtype == "q8_0" and FP8_RE.search(name):
            w8, sc = fp8_quant(v)
            dst[name] = w8
            dst[name[:-len(".weight")] + ".scale"] = sc
        elif outtype == "q8_0" and name in ("embed.weight", "head.weight"):
            dst[name] = v.to(torch.bfloat16)
        else:
            dst[name] = v.contiguous()
    save_file(dict(sorted(dst.items())), str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    # DeepSeek's config keys the converter reads (transformers folds them
    # into layer_types / mlp_layer_types / partial_rotary_factor / rope_parameters).
    p = out_dir / "config.json"
    c = json.loads(p.read_text())
    ratio = {"sliding_attention": 0, "compressed_sparse_attention": c["compress_rates"]["compressed_sparse_attention"],
             "heavily_compressed_attention": c["compress_rates"]["heavily_compressed_attention"]}
    c["compress_ratios"] = [ratio[t] for t in c["layer_types"]]
    c["num_hash_layers"] = sum(t == "hash_moe" for t in c["mlp_layer_types"])
    c["qk_rope_head_dim"] = int(c["head_dim"] * c["partial_rotary_factor"])
    comp = c["rope_parameters"]["compress"]
    c["rope_scaling"] = {k: v for k, v in comp.items()
                         if k not in ("rope_theta", "partial_rotary_factor", "attention_factor")}
    c["rope_scaling"]["type"] = c["rope_scaling"].pop("rope_type")
    p.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    return out_dir
