//! Self-test of `moe_ffn_split`, the expert FFN whose first rows of `h` come
//! from elsewhere (the CPU lane's share of a split expert): the device must
//! leave each pair's rows below its `row_lo` untouched, compute the rest with
//! exactly `moe_ffn`'s bits, and, once those rows are filled in from
//! `moe_ffn`'s own `h`, give exactly its output.

use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::Activation;
use pulsar_kernels::quant::{random_blocks, random_values};
use pulsar_kernels::{ActFormat, Activations};

use super::{compare, fmt_name, pair_expert, pair_skipped, pair_tables, poisoned, Cmp, MoeShape, Table};
use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::ops::MoePairs;

pub(super) fn cases(dev: &CudaDevice, t: &mut Table, next: &mut dyn FnMut() -> u64) {
    for (gu, dn) in [(GgmlType::Q2_K, GgmlType::Q2_K), (GgmlType::Q4_K, GgmlType::Q6_K), (GgmlType::Q8_0, GgmlType::Q8_0)] {
        t.push(
            "moe_ffn_split == moe_ffn (bits)",
            &format!("{}/{}", fmt_name(gu), fmt_name(dn)),
            "4 tok x 8 slot, d1024 ff1280, rows below row_lo filled in".into(),
            split_case(dev, gu, dn, MoeShape::WIDE, next()),
        );
    }
}

/// Pair `p`'s first device row: none, a few, past a block's rows, all.
fn row_lo(p: usize, ff: usize) -> i32 {
    [0, 1, 64, ff / 2 + 3, ff - 1, ff, 256, 37][p % 8] as i32
}

fn split_case(dev: &CudaDevice, gu: GgmlType, dn: GgmlType, shape: MoeShape, seed: u64) -> Result<Cmp, CudaError> {
    let MoeShape { d_model, ff, n_tok, n_slot, n_exp } = shape;
    let nb = |ty: GgmlType, r: usize, c: usize| r * c / ty.block_elems() as usize;
    let mats = |ty: GgmlType, r: usize, c: usize, off: u64| -> Result<Vec<Vec<u8>>, CudaError> {
        (0..n_exp).map(|e| Ok(random_blocks(ty, nb(ty, r, c), seed + off + e as u64)?)).collect()
    };
    let (gates, ups, downs) = (mats(gu, ff, d_model, 0)?, mats(gu, ff, d_model, 100)?, mats(dn, d_model, ff, 200)?);
    let x = random_values(n_tok * d_model, seed ^ 7);
    let xd = dev.upload(Activations::for_weight(gu, &x, d_model)?.as_bytes())?;
    let n_pairs = n_tok * n_slot;
    let expert = pair_expert(n_slot, n_exp);
    let (_experts, [gp, up, dp]) = pair_tables(dev, [&gates, &ups, &downs], n_pairs, &expert)?;
    let pairs = MoePairs { gate: &gp, up: &up, down: &dp, n_tok, n_slot };
    let dfmt = ActFormat::for_weight(dn).ok_or(CudaError::Unsupported { op: "moe", ty: dn })?;
    let hq_len = crate::ops::act_bytes(dfmt, n_pairs, ff)?;
    let s = dev.compute();

    let (mut h, mut hq, mut want) = (poisoned::<f32>(dev, n_pairs * ff)?, poisoned::<u8>(dev, hq_len)?, poisoned::<f32>(dev, n_pairs * d_model)?);
    dev.moe_ffn(s, gu, dn, &pairs, &xd, d_model, ff, Activation::Silu, &mut h, &mut hq, &mut want)?;
    let (want_h, want) = (dev.download(&h)?, dev.download(&want)?);

    let lo: Vec<i32> = (0..n_pairs).map(|p| row_lo(p, ff)).collect();
    let lo_d = dev.upload(&lo)?;
    let (mut h, mut hq, mut out) = (poisoned::<f32>(dev, n_pairs * ff)?, poisoned::<u8>(dev, hq_len)?, poisoned::<f32>(dev, n_pairs * d_model)?);
    // What the device wrote before the fill: rows >= lo as moe_ffn's, rows
    // below untouched (still poison); skipped pairs untouched throughout.
    let mut wrong = 0usize;
    dev.moe_ffn_split(s, gu, dn, &pairs, Some(&lo_d), &xd, d_model, ff, Activation::Silu, &mut h, &mut hq, &mut out, &mut |h| {
        let mut got = vec![0f32; n_pairs * ff];
        h.download(s, &mut got)?;
        for p in 0..n_pairs {
            for r in 0..ff {
                let i = p * ff + r;
                let expect = if pair_skipped(p) || r < lo[p] as usize { u32::MAX } else { want_h[i].to_bits() };
                wrong += (got[i].to_bits() != expect) as usize;
                if r < lo[p] as usize && !pair_skipped(p) {
                    got[i] = want_h[i];
                }
            }
        }
        h.upload(s, &got)
    })?;
    let got = dev.download(&out)?;
    let diff = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    if wrong > 0 {
        return Err(CudaError::Shape { op: "moe_ffn_split", what: format!("{wrong} values of h before the fill are not moe_ffn's or not untouched") });
    }
    let mut c = compare(&got, &want, 0.0);
    c.pass = diff == 0;
    Ok(c)
}
