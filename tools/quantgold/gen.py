#!/usr/bin/env python3
"""Golden fixtures for pulsar-kernels' quant formats.

Writes kernels/tests/fixtures/*.bin: for each format a few blocks and the f32
values the `gguf` package's numpy dequantizer gives for them, and for the
formats the package can quantize, an f32 input and the bytes it quantizes to.

Blocks are REAL where the test model has the type (gemma-3-270m Q4_K_M:
f32, q5_0, q4_K, q6_K, q8_0) and random otherwise (random bytes, with every
f16 scale field overwritten by a finite value of sane size, so the expected
values are finite). Real-model types also get random blocks, which reach
scale/bit patterns a trained model may not.

File layout (little-endian):
  dequant fixture  "PQG1", u32 ggml type id, u32 n_blocks, u32 n_real_blocks,
                   n_blocks * type_size bytes, n_blocks * block_size f32
  quant fixture    "PQQ1", u32 ggml type id, u32 n_values,
                   n_values f32, the quantized bytes

Usage (from the repository root):
  /root/.cache/pulsar/venv/bin/python tools/quantgold/gen.py \
      [--model /root/.cache/pulsar/models/gemma-3-270m-Q4_K_M.gguf]
"""
import argparse
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as T, quants
from gguf.constants import GGML_QUANT_SIZES

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "kernels" / "tests" / "fixtures"
DEFAULT_MODEL = Path("/root/.cache/pulsar/models/gemma-3-270m-Q4_K_M.gguf")

# Byte offsets of the f16 scale fields in one block of each format.
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ3_XXS: [0],
}
SYNTHETIC_BLOCKS_32 = 16
SYNTHETIC_BLOCKS_256 = 6
REAL_BLOCKS = 8


def sane_f16(rng, n):
    """Finite f16 scales of magnitude 2^-12 .. 2^0, either sign."""
    mag = 2.0 ** rng.uniform(-12, 0, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.float16)


def synthetic_blocks(rng, qtype, n):
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype == T.F16:
        return (rng.standard_normal(n) * 2.0).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        f = (rng.standard_normal(n) * 2.0).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype == T.F32:
        return (rng.standard_normal(n) * 2.0).astype(np.float32).view(np.uint8)
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype == T.Q8_K:
        raw[:, 0:4] = (2.0 ** rng.uniform(-12, 0, (n, 1))).astype(np.float32).view(np.uint8)
    for off in F16_FIELDS.get(qtype, []):
        raw[:, off:off + 2] = sane_f16(rng, n).reshape(n, 1).view(np.uint8)
    return raw.reshape(-1)


def expected(qtype, data):
    if qtype == T.Q8_K:
        # The gguf package has no q8_K codec: d (f32) * q (i8), written out here.
        b = data.reshape(-1, 292)
        d = b[:, 0:4].copy().view(np.float32)
        q = b[:, 4:260].view(np.int8).astype(np.float32)
        return (q * d).reshape(-1).astype(np.float32)
    return np.asarray(quants.dequantize(data, qtype), dtype=np.float32).reshape(-1)


def real_blocks(reader, qtype, n):
    """n blocks of `qtype` from the model: the first blocks of the first tensor
    of that type, then blocks from the middle of the largest one."""
    ts = [t for t in reader.tensors if t.tensor_type == qtype]
    if not ts:
        return np.zeros(0, dtype=np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype == T.F32:
        size = 4 * 32  # take runs of 32 floats so the fixture stays a few runs
    first = np.asarray(ts[0].data).view(np.uint8).reshape(-1)
    big = max(ts, key=lambda t: t.n_bytes)
    bigd = np.asarray(big.data).view(np.uint8).reshape(-1)
    h = n // 2
    mid = (bigd.size // size // 2) * size
    return np.concatenate([first[: h * size], bigd[mid: mid + (n - h) * size]])


def write_dequant(name, qtype, real, synth):
    data = np.concatenate([real, synth]).astype(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = data.size // size
    n_real = real.size // size
    vals = expected(qtype, data)
    assert vals.size == n_blocks * block, name
    assert np.all(np.isfinite(vals)), name
    with open(OUT / f"{name}.bin", "wb") as f:
        f.write(b"PQG1")
        f.write(struct.pack("<III", int(qtype), n_blocks, n_real))
        f.write(data.tobytes())
        f.write(vals.astype("<f4").tobytes())
    return n_blocks, n_real


def write_quant(name, qtype, rng, n):
    x = (rng.standard_normal(n) * rng.uniform(0.01, 3.0)).astype(np.float32)
    x[::37] *= 4.0  # a few outliers, so the block maxima vary
    if qtype == T.F16:
        q = x.astype(np.float16).view(np.uint8)
    else:
        q = np.asarray(quants.quantize(x, qtype)).view(np.uint8).reshape(-1)
    with open(OUT / f"quant_{name}.bin", "wb") as f:
        f.write(b"PQQ1")
        f.write(struct.pack("<II", int(qtype), n))
        f.write(x.astype("<f4").tobytes())
        f.write(q.tobytes())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--seed", type=int, default=20261201)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    reader = GGUFReader(str(args.model))
    OUT.mkdir(parents=True, exist_ok=True)

    formats = [
        ("f32", T.F32), ("f16", T.F16), ("bf16", T.BF16),
        ("q4_0", T.Q4_0), ("q4_1", T.Q4_1), ("q5_0", T.Q5_0), ("q5_1", T.Q5_1), ("q8_0", T.Q8_0),
        ("q2_k", T.Q2_K), ("q3_k", T.Q3_K), ("q4_k", T.Q4_K), ("q5_k", T.Q5_K), ("q6_k", T.Q6_K),
        ("q8_k", T.Q8_K), ("iq2_xxs", T.IQ2_XXS), ("iq2_xs", T.IQ2_XS), ("iq3_xxs", T.IQ3_XXS),
    ]
    for name, qtype in formats:
        block, size = GGML_QUANT_SIZES[qtype]
        real = real_blocks(reader, qtype, REAL_BLOCKS) if qtype != T.Q8_K else np.zeros(0, np.uint8)
        if block == 1:
            synth = synthetic_blocks(rng, qtype, 256)
        else:
            nsyn = SYNTHETIC_BLOCKS_32 if block == 32 else SYNTHETIC_BLOCKS_256
            synth = synthetic_blocks(rng, qtype, nsyn)
        n, nr = write_dequant(name, qtype, real, synth)
        print(f"{name:8s} {n:4d} blocks ({nr} real)")

    for name, qtype in [("f16", T.F16), ("bf16", T.BF16), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1),
                        ("q5_0", T.Q5_0), ("q5_1", T.Q5_1), ("q8_0", T.Q8_0)]:
        write_quant(name, qtype, rng, 32 * 24)
    total = sum(p.stat().st_size for p in OUT.glob("*.bin"))
    print(f"total {total} bytes in {OUT}")


if __name__ == "__main__":
    main()
