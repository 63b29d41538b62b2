//! Golden fixtures from tools/quantgold/gen.py: blocks (real gemma-3-270m blocks
//! for f32/q5_0/q4_K/q6_K/q8_0, random ones for every format) and the values the
//! `gguf` package's numpy dequantizer gives for them.
//!
//! Dequantization must be BIT-exact for every format: each value is a short
//! product of an f16 (or f32) scale and small integers, and our code performs
//! the same f32 operations in the same order as the numpy reference (e.g.
//! q4_K: `(d*sc)*q - (dmin*m)`, iq2_xxs: `((d*(0.5+ls))*0.25)*grid*sign`), so
//! there is no rounding difference to tolerate.
//!
//! Quantization fixtures (f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0) check that our
//! quantizers produce the very bytes the `gguf` package (ggml's reference
//! algorithm) produces.

use std::path::PathBuf;

use pulsar_gguf::GgmlType;
use pulsar_kernels::{dequantize, quantize};

fn fixture(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read(&p)
        .unwrap_or_else(|e| panic!("{}: {e} (run tools/quantgold/gen.py)", p.display()))
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

struct Dequant {
    ty: GgmlType,
    n_real: usize,
    blocks: Vec<u8>,
    values: Vec<f32>,
}

fn load_dequant(name: &str) -> Dequant {
    let b = fixture(&format!("{name}.bin"));
    assert_eq!(&b[..4], b"PQG1", "{name}");
    let ty = GgmlType::from_id(u32_at(&b, 4)).expect("known type");
    let (nb, n_real) = (u32_at(&b, 8) as usize, u32_at(&b, 12) as usize);
    let bytes = nb * ty.block_bytes() as usize;
    let blocks = b[16..16 + bytes].to_vec();
    let values = f32s(&b[16 + bytes..]);
    assert_eq!(values.len(), nb * ty.block_elems() as usize, "{name}");
    Dequant {
        ty,
        n_real,
        blocks,
        values,
    }
}

fn check_dequant(name: &str, ty: GgmlType, want_real: bool) {
    let f = load_dequant(name);
    assert_eq!(f.ty, ty, "{name}");
    assert_eq!(
        f.n_real > 0,
        want_real,
        "{name}: real model blocks expected: {want_real}"
    );
    let mut got = vec![f32::NAN; f.values.len()];
    dequantize(ty, &f.blocks, &mut got).unwrap();
    let be = ty.block_elems() as usize;
    for (i, (g, e)) in got.iter().zip(&f.values).enumerate() {
        assert_eq!(
            g.to_bits(),
            e.to_bits(),
            "{name}: value {i} (block {}): got {g}, want {e}",
            i / be
        );
    }
    // Every block on its own too (the API takes any whole number of blocks).
    let bb = ty.block_bytes() as usize;
    let mut one = vec![0f32; be];
    let last = f.blocks.len() / bb - 1;
    dequantize(ty, &f.blocks[last * bb..], &mut one).unwrap();
    assert_eq!(one, f.values[last * be..]);
}

#[test]
fn dequant_f32() {
    check_dequant("f32", GgmlType::F32, true);
}
#[test]
fn dequant_f16() {
    check_dequant("f16", GgmlType::F16, false);
}
#[test]
fn dequant_bf16() {
    check_dequant("bf16", GgmlType::BF16, false);
}
#[test]
fn dequant_q4_0() {
    check_dequant("q4_0", GgmlType::Q4_0, false);
}
#[test]
fn dequant_q4_1() {
    check_dequant("q4_1", GgmlType::Q4_1, false);
}
#[test]
fn dequant_q5_0() {
    check_dequant("q5_0", GgmlType::Q5_0, true);
}
#[test]
fn dequant_q5_1() {
    check_dequant("q5_1", GgmlType::Q5_1, false);
}
#[test]
fn dequant_q8_0() {
    check_dequant("q8_0", GgmlType::Q8_0, true);
}
#[test]
fn dequant_q2_k() {
    check_dequant("q2_k", GgmlType::Q2_K, false);
}
#[test]
fn dequant_q3_k() {
    check_dequant("q3_k", GgmlType::Q3_K, false);
}
#[test]
fn dequant_q4_k() {
    check_dequant("q4_k", GgmlType::Q4_K, true);
}
#[test]
fn dequant_q5_k() {
    check_dequant("q5_k", GgmlType::Q5_K, false);
}
#[test]
fn dequant_q6_k() {
    check_dequant("q6_k", GgmlType::Q6_K, true);
}
#[test]
fn dequant_q8_k() {
    check_dequant("q8_k", GgmlType::Q8_K, false);
}
#[test]
fn dequant_iq2_xxs() {
    check_dequant("iq2_xxs", GgmlType::IQ2_XXS, false);
}
#[test]
fn dequant_iq2_xs() {
    check_dequant("iq2_xs", GgmlType::IQ2_XS, false);
}
#[test]
fn dequant_iq3_xxs() {
    check_dequant("iq3_xxs", GgmlType::IQ3_XXS, false);
}

fn check_quant(name: &str, ty: GgmlType) {
    let b = fixture(&format!("quant_{name}.bin"));
    assert_eq!(&b[..4], b"PQQ1", "{name}");
    assert_eq!(GgmlType::from_id(u32_at(&b, 4)), Some(ty));
    let n = u32_at(&b, 8) as usize;
    let x = f32s(&b[12..12 + 4 * n]);
    let want = &b[12 + 4 * n..];
    let mut got = vec![0u8; want.len()];
    quantize(ty, &x, &mut got).unwrap();
    let bb = ty.block_bytes() as usize;
    for (i, (g, w)) in got.chunks(bb).zip(want.chunks(bb)).enumerate() {
        assert_eq!(
            g, w,
            "{name}: block {i} differs from the gguf package's quantizer"
        );
    }
}

#[test]
fn quant_matches_gguf_package() {
    check_quant("f16", GgmlType::F16);
    check_quant("bf16", GgmlType::BF16);
    check_quant("q4_0", GgmlType::Q4_0);
    check_quant("q4_1", GgmlType::Q4_1);
    check_quant("q5_0", GgmlType::Q5_0);
    check_quant("q5_1", GgmlType::Q5_1);
    check_quant("q8_0", GgmlType::Q8_0);
}
