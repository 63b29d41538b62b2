#!/usr/bin/env python3
"""Generate the golden parity fixtures: fixtures/parity/<arch>/.

For each family in families.py:
  1. train a tiny tokenizer (tok.py) and build a tiny random HF model
     (transformers, float32, fixed seed, init rescaled so activations are O(1));
  2. save the HF model dir, convert it with llama.cpp's convert_hf_to_gguf.py
     (through convert_wrapper.py) to model-f32.gguf and model-q8_0.gguf, or
     with a hand-written converter (custom_convert.py) where llama.cpp has none;
  3. reload the saved HF dir, run the fixed prompt and save the logits of
     every position (logits.npy, float32 [n_tokens, vocab]);
  4. read the GGUFs back, check no weight was dropped, and write meta.json
     (config, features, token ids, GGUF tensor names and metadata keys).

usage: gen.py --family NAME|all [--keep-work]
See README.md for the environment (venv + llama.cpp sdist).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT_ROOT = REPO / "fixtures" / "parity"
WORK_ROOT = Path(os.environ.get("REFGEN_WORK", "/root/.cache/pulsar/refgen-work"))
LLAMACPP = Path(os.environ.get(
    "REFGEN_LLAMACPP",
    "/root/.cache/pulsar/llamacpp-sdist/llama_cpp_python-0.3.36/vendor/llama.cpp"))

# Deterministic CPU math, and a shared 2-core machine: one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

sys.path.insert(0, str(HERE))
from families import FAMILIES, Family  # noqa: E402
import tok  # noqa: E402


def log(*a):
    print("[refgen]", *a, flush=True)


# --------------------------------------------------------------------------
# model

def reinit(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Rescale HF's random init so a 64-wide model has O(1) activations.

    HF initialises linears with std 0.02, tuned for d_model in the thousands;
    at width 64 every residual branch (and so every MoE expert) would
    contribute ~nothing and all positions would predict the same token.
    Rules, applied in sorted parameter order with one generator:
      - nn.Embedding: N(0, 1); N(0, 1/hidden) when tied to the output, so the
        logits stay O(1) (Gemma multiplies the input side by sqrt(hidden));
      - any other >=2-D weight (linear, 3-D expert stacks, convs): N(0, 1/fan_in)
        with fan_in = last dim (transformers keeps weights as [.., out, in]);
      - 1-D parameters (norm weights, biases, router biases, A_log, ...): their
        HF init value plus N(0, 0.1^2) noise. HF inits a plain RMSNorm weight to
        1 and a zero-centred one (Gemma, Qwen3.5: x*(1+w)) to 0, so this keeps
        each norm near its identity whatever the convention;
      - saved float buffers (router selection biases, per-layer scalars): the
        1-D rule.
    """
    embed_params = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out = model.get_output_embeddings()
    tied = out is not None and id(out.weight) in embed_params
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if id(p) in embed_params:
                std = 1.0 / math.sqrt(p.shape[-1]) if tied and p is out.weight else 1.0
                p.copy_(std * torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        # Saved float buffers are weights too (e.g. the router's selection-only
        # e_score_correction_bias, HF-initialised to 0): same 1-D rule.
        saved = set(model.state_dict().keys())
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name in saved and b.is_floating_point():
                b.add_(0.1 * torch.randn(b.shape, generator=gen))


def model_class(fam: Family):
    import transformers
    if fam.model_class:
        return getattr(transformers, fam.model_class)
    return transformers.AutoModelForCausalLM


def build_hf(fam: Family, hf_dir: Path) -> tuple[dict, dict, torch.Tensor]:
    """Tokenizer + random model saved to hf_dir; returns (token info, config dict, logits)."""
    from transformers import AutoConfig

    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    hf_dir.mkdir(parents=True)

    if fam.tokenizer == "spm":
        tinfo = tok.build_spm(hf_dir, fam.config["vocab_size"], fam.specials)
    elif fam.tokenizer == "spm_hf":
        tinfo = tok.build_spm_hf(hf_dir, fam.config["vocab_size"], fam.specials)
    else:
        tinfo = tok.build_bpe(hf_dir, fam.tokenizer_vocab or fam.config["vocab_size"], fam.specials, bos=fam.bos,
                              eos=fam.eos,
                              add_bos=fam.add_bos, chat_template=fam.chat_template)

    if fam.wrapper_config:
        cfg = AutoConfig.for_model(fam.model_type, **fam.wrapper_config(fam.config))
    else:
        cfg = AutoConfig.for_model(fam.model_type, **fam.config)
    torch.manual_seed(fam.seed)
    cls = model_class(fam)
    # Auto* classes have from_config, model classes _from_config; both pick
    # the same kernels (attention, experts) as from_pretrained does below.
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    model = make(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(fam.seed)
    reinit(model, gen)
    if fam.post_init:
        fam.post_init(model, gen)
    model.eval()
    model.save_pretrained(hf_dir)

    if fam.extra_tensors:
        from safetensors.torch import load_file, save_file
        st = hf_dir / "model.safetensors"
        tensors = load_file(str(st))
        extra = fam.extra_tensors(tensors, cfg, gen)
        clash = set(extra) & set(tensors)
        assert not clash, clash
        tensors.update({k: v.contiguous() for k, v in extra.items()})
        save_file(dict(sorted(tensors.items())), str(st), metadata={"format": "pt"})
    if fam.post_save:
        fam.post_save(hf_dir)

    if fam.prefix:
        pre = [tinfo["special_ids"][s] for s in fam.prefix]
        at = 1 if fam.add_bos else 0
        tinfo["ids"] = tinfo["ids"][:at] + pre + tinfo["ids"][at:]
    ids = tinfo["ids"]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float()
    return tinfo, cfg.to_dict(), ref


def run_logits(fam: Family, hf_dir: Path, ids: list[int]) -> np.ndarray:
    """Logits from the model as reloaded from disk: what the GGUF was made from."""
    model = model_class(fam).from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


# --------------------------------------------------------------------------
# conversion + read-back

def convert(fam: Family, hf_dir: Path, out_dir: Path) -> None:
    for outtype in ("f32", "q8_0"):
        dst = out_dir / f"model-{outtype}.gguf"
        if fam.custom_convert:
            log(f"custom converter for {fam.arch} ({outtype})")
            fam.custom_convert(fam, hf_dir, dst, outtype, LLAMACPP)
            continue
        src = hf_dir
        if fam.convert_input:
            src = fam.convert_input(hf_dir, hf_dir.parent / f"convert-input-{outtype}" / hf_dir.name, outtype)
        cmd = [sys.executable, str(HERE / "convert_wrapper.py"), "--llamacpp", str(LLAMACPP),
               "--pre", fam.tokpre, str(src), "--outtype", outtype, "--outfile", str(dst)]
        if fam.raw_config_keys:
            cmd.append("--raw-config-keys")
        if fam.raw_config_prefer:
            cmd += ["--raw-config-prefer", ",".join(fam.raw_config_prefer)]
        log(" ".join(cmd[1:]))
        r = subprocess.run(cmd, capture_output=True, text=True)
        (hf_dir.parent / f"convert-{outtype}.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            sys.stderr.write(r.stdout[-4000:] + r.stderr[-8000:])
            raise RuntimeError(f"converter failed for {fam.name} ({outtype}); log in {hf_dir.parent}")


def fam_custom_converter(fam: Family):
    return fam.custom_convert


def gguf_module():
    sys.path.insert(0, str(LLAMACPP / "gguf-py"))
    import gguf
    return gguf


def read_gguf(path: Path) -> dict:
    gguf = gguf_module()
    r = gguf.GGUFReader(str(path))
    meta = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = f.types[0] if f.types else None
        if vtype == gguf.GGUFValueType.ARRAY:
            n = len(f.data)
            if n > 64:
                meta[key] = {"array_len": n, "elem": f.types[-1].name}
                continue
        meta[key] = f.contents()
    tensors = [{"name": t.name, "shape": [int(x) for x in t.shape], "type": t.tensor_type.name}
               for t in r.tensors]
    numel = int(sum(int(t.n_elements) for t in r.tensors))
    return {"metadata": meta, "tensors": tensors, "numel": numel}


def hf_numel(hf_dir: Path, ignore: tuple[str, ...]) -> tuple[int, list[str], list[str]]:
    """Element count of the saved checkpoint, minus tensors under `ignore`."""
    from safetensors import safe_open
    total, names, ignored = 0, [], []
    for st in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(st), "pt") as f:
            for k in f.keys():
                if k.startswith(ignore):
                    ignored.append(k)
                    continue
                total += int(np.prod(f.get_slice(k).get_shape()))
                names.append(k)
    return total, sorted(names), sorted(ignored)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    return str(x)


# --------------------------------------------------------------------------

def generate(fam: Family, keep_work: bool) -> None:
    import transformers

    fixture = fam.fixture_dir or fam.arch
    work = WORK_ROOT / fixture
    hf_dir = work / f"tiny-{fixture}"
    out_dir = OUT_ROOT / fixture
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"{fam.name}: building HF model in {hf_dir}")
    tinfo, cfg_dict, ref_logits = build_hf(fam, hf_dir)
    ids = tinfo["ids"]

    logits = run_logits(fam, hf_dir, ids)
    # The reloaded model must compute what the built one did. Bit-equality
    # holds for most families; the gated-delta-net ones differ by ~1e-6 (a
    # different reduction order between the two instances), so allow float32
    # noise and record it. logits.npy is always the reloaded model's.
    reload_diff = float(np.abs(logits - ref_logits.numpy()).max())
    if reload_diff > 1e-5 * max(1.0, float(np.abs(logits).max())):
        raise RuntimeError(f"{fam.name}: logits of the reloaded checkpoint differ from the in-memory model "
                           f"(max |d| = {reload_diff}): save/load is lossy")
    argmax = logits.argmax(-1)
    n_distinct = int(len(set(argmax.tolist())))
    log(f"{fam.name}: {len(ids)} tokens, logits std {logits.std():.3f}, distinct argmax {n_distinct}")
    if not np.isfinite(logits).all():
        raise RuntimeError(f"{fam.name}: non-finite logits")

    convert(fam, hf_dir, out_dir)

    g32 = read_gguf(out_dir / "model-f32.gguf")
    g8 = read_gguf(out_dir / "model-q8_0.gguf")
    hf_total, hf_names, hf_ignored = hf_numel(hf_dir, fam.hf_ignore_prefixes)
    delta = g32["numel"] - hf_total
    if delta != fam.numel_delta:
        raise RuntimeError(f"{fam.name}: GGUF holds {g32['numel']} weights, HF checkpoint {hf_total} "
                           f"(delta {delta}, expected {fam.numel_delta}): a tensor was dropped or added")
    if [t["name"] for t in g32["tensors"]] != [t["name"] for t in g8["tensors"]]:
        raise RuntimeError(f"{fam.name}: f32 and q8_0 files have different tensor lists")
    arch_key = g32["metadata"].get("general.architecture")
    if arch_key != fam.arch:
        raise RuntimeError(f"{fam.name}: general.architecture is {arch_key!r}, expected {fam.arch!r}")

    np.save(out_dir / "logits.npy", logits.astype(np.float32))
    meta = {
        "family": fam.name,
        "arch": fam.arch,
        "hf_model_type": fam.model_type,
        "hf_architectures": cfg_dict.get("architectures"),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "llama_cpp_converter": "llama-cpp-python 0.3.36 sdist (vendor/llama.cpp)"
                     if not fam_custom_converter(fam) else "tools/refgen/custom_convert.py"},
        "seed": fam.seed,
        "config": _jsonable(fam.config),
        "hf_config_resolved": _jsonable(cfg_dict),
        "features": fam.features,
        "notes": fam.notes,
        "tokenizer": {"kind": tinfo["kind"], "ggml_pre": fam.tokpre, "prompt": tok.PROMPT,
                      "bos_id": tinfo["bos_id"], "eos_id": tinfo["eos_id"], "add_bos": fam.add_bos},
        "tokens": ids,
        "n_tokens": len(ids),
        "logits": {"file": "logits.npy", "shape": list(logits.shape), "dtype": "float32",
                   "std": round(float(logits.std()), 4), "distinct_argmax": n_distinct,
                   "argmax": argmax.tolist(), "max_diff_built_vs_reloaded": reload_diff},
        "hf_tensors": hf_names,
        "hf_tensors_not_in_gguf": hf_ignored,
        "hf_numel": hf_total,
        "numel_delta": delta,
        "numel_delta_why": fam.numel_delta_why,
        "gguf": {
            "files": {
                "model-f32.gguf": {"sha256": sha256(out_dir / "model-f32.gguf"),
                                   "bytes": (out_dir / "model-f32.gguf").stat().st_size},
                "model-q8_0.gguf": {"sha256": sha256(out_dir / "model-q8_0.gguf"),
                                    "bytes": (out_dir / "model-q8_0.gguf").stat().st_size},
            },
            "n_tensors": len(g32["tensors"]),
            "tensors_f32": g32["tensors"],
            "tensor_types_q8_0": {t["name"]: t["type"] for t in g8["tensors"]},
            "metadata": _jsonable(g32["metadata"]),
        },
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    log(f"{fam.name}: wrote {out_dir} ({len(g32['tensors'])} tensors, "
        f"f32 {(out_dir / 'model-f32.gguf').stat().st_size} B)")
    if not keep_work:
        shutil.rmtree(work)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True, help="family name or 'all': " + ", ".join(FAMILIES))
    ap.add_argument("--keep-work", action="store_true", help="keep the HF dir and converter logs")
    args = ap.parse_args()
    if not (LLAMACPP / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"llama.cpp converter not found at {LLAMACPP}: run tools/refgen/fetch_llamacpp.sh "
                 "or set REFGEN_LLAMACPP")
    names = list(FAMILIES) if args.family == "all" else args.family.split(",")
    failed = []
    for n in names:
        if n not in FAMILIES:
            sys.exit(f"unknown family {n!r}; known: {', '.join(FAMILIES)}")
        try:
            generate(FAMILIES[n], args.keep_work)
        except Exception as e:  # keep going: one broken family must not block the rest
            if len(names) == 1:
                raise
            log(f"{n}: FAILED: {e}")
            failed.append(n)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
