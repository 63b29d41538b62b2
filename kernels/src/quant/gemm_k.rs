//! Prefill GEMM for q4_K and q6_K against q8_K activations, as
//! [`super::gemm32`] does it for the 32-value blocks: a tile of rows is
//! decoded and repacked once, sixteen rows to a vector, then dotted against
//! every token of the chunk.
//!
//! Exactness: the reference's integers (`sumi = sum_j sc_j * sum_sub(q y)`,
//! with q6_K's `- 32 * bsum_j` inside, and q4_K's `summ = sum_j m_j *
//! pair_bsum_j`) are exact in any order, and the float expression per
//! superblock (`(dx * d) * sumi`, minus `(dx * dmin) * summ` for q4_K) is
//! formed lane-wise with separate `mul`/`sub`/`add`, each (row, token) taking
//! its superblocks in order. So every output is the scalar `dot`'s bits.
//!
//! Repacked layout per group of 16 rows and superblock: 64 vectors of levels
//! (vector c lane j: bytes `4c..4c+4` of row j's 256 unsigned levels), the
//! sub-block scales as one i32 vector per sub-block, q4_K's mins likewise,
//! then `d` (and q4_K's `dmin`) as f32 vectors.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use pulsar_gguf::GgmlType;

use super::{q4_k, q6_k, q8_k};
use crate::simd::*;

pub(crate) mod avx2;

/// Rows per repacked group (matmul sizes tasks by gemm32's, the same).
pub(crate) const GROUP: usize = 16;
const _: () = assert!(GROUP == super::gemm32::GROUP);
/// Tokens dotted against one load of a sub-block's weight vectors.
const TOKENS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fmt {
    Q4K,
    Q6K,
}

impl Fmt {
    pub(crate) fn of(ty: GgmlType) -> Option<Fmt> {
        match ty {
            GgmlType::Q4_K => Some(Fmt::Q4K),
            GgmlType::Q6_K => Some(Fmt::Q6K),
            _ => None,
        }
    }
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Fmt::Q4K => q4_k::BYTES,
            Fmt::Q6K => q6_k::BYTES,
        }
    }
    /// Sub-blocks per superblock (each with its own scale).
    fn subs(self) -> usize {
        match self {
            Fmt::Q4K => 8,
            Fmt::Q6K => 16,
        }
    }
    fn mins(self) -> bool {
        self == Fmt::Q4K
    }
    /// Offsets within a repacked group-superblock.
    fn scales_at(self) -> usize {
        64 * 64
    }
    fn mins_at(self) -> usize {
        self.scales_at() + 64 * self.subs()
    }
    fn d_at(self) -> usize {
        self.mins_at() + if self.mins() { 64 * 8 } else { 0 }
    }
    fn packed(self) -> usize {
        self.d_at() + if self.mins() { 128 } else { 64 }
    }
    /// Row `b`'s 256 unsigned levels, its sub-block scales and mins, `d`, `dmin`.
    /// Always inlined: called from the `target_feature` repacks, a separate
    /// function would be compiled for baseline x86-64 (it was 35% of a q30
    /// pp128 at SSE width).
    #[inline(always)]
    fn decode(self, b: &[u8], lv: &mut [u8; 256], sc: &mut [i32; 16], mn: &mut [i32; 8]) -> (f32, f32) {
        match self {
            Fmt::Q4K => {
                let (s, m) = q4_k::scales_mins(&b[4..16]);
                for j in 0..8 {
                    sc[j] = s[j] as i32;
                    mn[j] = m[j] as i32;
                }
                for c in 0..4 {
                    for l in 0..32 {
                        let q = b[16 + 32 * c + l];
                        lv[64 * c + l] = q & 0x0f;
                        lv[64 * c + 32 + l] = q >> 4;
                    }
                }
                (super::rd_f16(b, 0), super::rd_f16(b, 2))
            }
            Fmt::Q6K => {
                for (j, s) in sc.iter_mut().enumerate() {
                    *s = b[q6_k::SC + j] as i8 as i32;
                }
                // q6_k::level, written per half so the loop vectorizes.
                for c in 0..2 {
                    for l in 0..32 {
                        let (ql0, ql1, qh) = (b[64 * c + l], b[64 * c + 32 + l], b[128 + 32 * c + l]);
                        lv[128 * c + l] = (ql0 & 15) | ((qh & 3) << 4);
                        lv[128 * c + 32 + l] = (ql1 & 15) | (((qh >> 2) & 3) << 4);
                        lv[128 * c + 64 + l] = (ql0 >> 4) | (((qh >> 4) & 3) << 4);
                        lv[128 * c + 96 + l] = (ql1 >> 4) | (((qh >> 6) & 3) << 4);
                    }
                }
                debug_assert!((0..256).all(|e| lv[e] == q6_k::level(b, e)));
                (super::rd_f16(b, q6_k::D), 0.0)
            }
        }
    }
}

/// Repack `n_rows` rows (`rb` bytes, `nb` superblocks each) into `out`, in
/// groups of 16 (missing rows are zero, their lanes unused).
///
/// # Safety
/// AVX-512 F; `w` holds `n_rows` rows of `rb` bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn repack(fmt: Fmt, w: &[u8], n_rows: usize, rb: usize, out: &mut Vec<u8>) {
    let nb = rb / fmt.block_bytes();
    let pb = fmt.packed();
    let groups = n_rows.div_ceil(GROUP);
    out.clear();
    out.resize(groups * nb * pb, 0);
    let mut lv = [[0u8; 256]; GROUP];
    let (mut sc, mut mn) = ([0i32; 16], [0i32; 8]);
    let put = |dst: &mut [u8], at: usize, v: [u8; 4]| dst[at..at + 4].copy_from_slice(&v);
    for g in 0..groups {
        let rows = (n_rows - g * GROUP).min(GROUP);
        // A whole q4_K group gathers its level vectors straight from the
        // nibbles: no byte-per-level decode, half the gathers.
        let direct = fmt == Fmt::Q4K && rows == GROUP;
        for i in 0..nb {
            let dst = &mut out[(g * nb + i) * pb..][..pb];
            let blk0 = g * GROUP * rb + i * fmt.block_bytes();
            // The group's rows are one contiguous run: stream the next
            // group's run into L2 a slice per superblock, so the gathers (or
            // the row decodes) find their lines there, not in DRAM.
            let span = GROUP * rb / nb;
            // SAFETY: prefetching has no effect on memory, at any address.
            unsafe { prefetch_lines::<false>(w, (g + 1) * GROUP * rb + i * span, span.div_ceil(64)) };
            if direct {
                // SAFETY: a whole group: rows g*16..g*16+16 exist, each
                // holding this superblock's 144 bytes.
                unsafe { q4k_direct(&w[blk0..], rb, dst) };
                continue;
            }
            for (j, l) in lv.iter_mut().enumerate() {
                if j >= rows {
                    *l = [0; 256];
                    continue;
                }
                let b = &w[blk0 + j * rb..][..fmt.block_bytes()];
                let (d, dmin) = fmt.decode(b, l, &mut sc, &mut mn);
                for s in 0..fmt.subs() {
                    put(dst, fmt.scales_at() + 64 * s + 4 * j, sc[s].to_le_bytes());
                }
                if fmt.mins() {
                    for s in 0..8 {
                        put(dst, fmt.mins_at() + 64 * s + 4 * j, mn[s].to_le_bytes());
                    }
                    put(dst, fmt.d_at() + 64 + 4 * j, dmin.to_le_bytes());
                }
                put(dst, fmt.d_at() + 4 * j, d.to_le_bytes());
            }
            // The 16 x 64 dword transpose: vector c gathers dword c of each row.
            // SAFETY: every gathered index (j * 64 + c < 1024) lies in `lv`, and
            // every store in the 64 level vectors at the start of `dst`.
            unsafe {
                let rows_idx = _mm512_mullo_epi32(
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                    _mm512_set1_epi32(64),
                );
                for c in 0..64 {
                    let idx = _mm512_add_epi32(rows_idx, _mm512_set1_epi32(c as i32));
                    let v = _mm512_i32gather_epi32::<4>(idx, lv.as_ptr() as *const i32);
                    _mm512_storeu_si512(dst.as_mut_ptr().add(64 * c) as *mut __m512i, v);
                }
            }
        }
    }
}

/// One superblock of 16 q4_K rows (`w` at row 0's superblock, rows `rb`
/// bytes apart) repacked into `dst` as [`repack`] lays it out, straight from
/// the bytes with gathers (lane j = row j) instead of row by row:
/// - level vector `16c + k` holds levels `64c + 4k..+4` of each row: the low
///   nibbles (k < 8) or the high nibbles (k >= 8) of quant bytes
///   `32c + 4(k % 8)..+4`, so one gather feeds two vectors;
/// - the scales and mins are `q4_k::scales_mins` lane-wise on the three
///   dwords of the 12 scale bytes;
/// - `d` and `dmin` are the two f16 halves of the first dword, widened
///   exactly.
///
/// # Safety
/// AVX-512 F/BW; `w` holds 16 rows of `rb` bytes from the superblock; `dst`
/// holds `Fmt::Q4K.packed()` bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4k_direct(w: &[u8], rb: usize, dst: &mut [u8]) {
    let fmt = Fmt::Q4K;
    debug_assert!(w.len() >= 15 * rb + q4_k::BYTES && dst.len() >= fmt.packed());
    let rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(rb as i32));
    let m4 = _mm512_set1_epi8(0x0f);
    // SAFETY (every block below): each gather reads one dword within the
    // first 144 bytes of each of the 16 rows' superblocks; each store lies in
    // the first `packed()` bytes of `dst`.
    let gather = |off: usize| unsafe { _mm512_i32gather_epi32::<1>(rows, w.as_ptr().add(off) as *const i32) };
    let dp = dst.as_mut_ptr();
    let store = |at: usize, v: __m512i| unsafe { _mm512_storeu_si512(dp.add(at) as *mut __m512i, v) };
    // The quant bytes by an in-register transpose (`transpose_16x8`), not
    // by gathers: sixteen row loads per 32 quant bytes, where a gather per
    // dword was the repack's whole cost.
    for c in 0..4 {
        let off = 16 + 32 * c;
        // SAFETY: rows p and p + 8 hold quant bytes off..off + 32 (< 144).
        let r: [__m512i; 8] = std::array::from_fn(|p| unsafe { join256(load256(w, p * rb + off), load256(w, (p + 8) * rb + off)) });
        for (k, v) in transpose_16x8(r).into_iter().enumerate() {
            store(64 * (16 * c + k), _mm512_and_si512(v, m4));
            store(64 * (16 * c + 8 + k), _mm512_and_si512(_mm512_srli_epi32::<4>(v), m4));
        }
    }
    let (u0, u1, u2) = (gather(4), gather(8), gather(12));
    let byte = |u: __m512i, sh: u32, mask: i32| _mm512_and_si512(_mm512_srlv_epi32(u, _mm512_set1_epi32(sh as i32)), _mm512_set1_epi32(mask));
    for j in 0..4u32 {
        let (sc_lo, mn_lo) = (byte(u0, 8 * j, 63), byte(u1, 8 * j, 63));
        let sc_hi = _mm512_or_si512(byte(u2, 8 * j, 0xf), _mm512_slli_epi32::<4>(byte(u0, 8 * j + 6, 3)));
        let mn_hi = _mm512_or_si512(byte(u2, 8 * j + 4, 0xf), _mm512_slli_epi32::<4>(byte(u1, 8 * j + 6, 3)));
        let j = j as usize;
        store(fmt.scales_at() + 64 * j, sc_lo);
        store(fmt.scales_at() + 64 * (j + 4), sc_hi);
        store(fmt.mins_at() + 64 * j, mn_lo);
        store(fmt.mins_at() + 64 * (j + 4), mn_hi);
    }
    let dd = gather(0);
    // The f16 to f32 widening is exact, as `rd_f16`'s.
    let (d, dmin) = (_mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd))));
    store(fmt.d_at(), _mm512_castps_si512(d));
    store(fmt.d_at() + 64, _mm512_castps_si512(dmin));
}

/// `outs[t][r] = dot(row r, token t)` for the rows in `packed` (the first
/// `outs[t].len()`) and the q8_K token rows `xs` of `nb` superblocks.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI; `packed` is [`repack`]'s output for at least
/// `outs[t].len()` rows of `nb` superblocks; every `xs[t]` holds `nb` superblocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn gemm(fmt: Fmt, packed: &[u8], nb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let n_rows = outs.first().map_or(0, |o| o.len());
    // One group of rows at a time against every token, so that group's
    // repacked blocks stay in L1/L2 while the tokens pass.
    // SAFETY: as the caller promises; each call stays in its tokens and groups.
    unsafe {
        for g in 0..n_rows.div_ceil(GROUP) {
            let mut t0 = 0;
            while t0 < xs.len() {
                let n = (xs.len() - t0).min(TOKENS);
                let o = &mut outs[t0..t0 + n];
                match (fmt, n) {
                    (Fmt::Q4K, 4) => group::<4, false>(fmt, packed, nb, g, &xs[t0..t0 + 4], o),
                    (Fmt::Q4K, 3) => group::<3, false>(fmt, packed, nb, g, &xs[t0..t0 + 3], o),
                    (Fmt::Q4K, 2) => group::<2, false>(fmt, packed, nb, g, &xs[t0..t0 + 2], o),
                    (Fmt::Q4K, _) => group::<1, false>(fmt, packed, nb, g, &xs[t0..t0 + 1], o),
                    (Fmt::Q6K, 4) => group::<4, true>(fmt, packed, nb, g, &xs[t0..t0 + 4], o),
                    (Fmt::Q6K, 3) => group::<3, true>(fmt, packed, nb, g, &xs[t0..t0 + 3], o),
                    (Fmt::Q6K, 2) => group::<2, true>(fmt, packed, nb, g, &xs[t0..t0 + 2], o),
                    (Fmt::Q6K, _) => group::<1, true>(fmt, packed, nb, g, &xs[t0..t0 + 1], o),
                }
                t0 += n;
            }
        }
    }
}

/// Group `g` of 16 rows against `T` tokens; `Q6` picks q6_K (16-value
/// sub-blocks, levels offset by 32, no mins) over q4_K (32-value sub-blocks, mins).
#[inline(always)]
unsafe fn group<const T: usize, const Q6: bool>(
    fmt: Fmt,
    packed: &[u8],
    nb: usize,
    g: usize,
    xs: &[&[u8]],
    outs: &mut [&mut [f32]],
) {
    let pb = fmt.packed();
    let sub = if Q6 { 16 } else { 32 };
    let words = sub / 4;
    // SAFETY: every load lies in group g's repacked superblocks or in
    // superblock i of a token's q8_K row.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); T];
        for i in 0..nb {
            let o = (g * nb + i) * pb;
            let ox = i * q8_k::BYTES;
            let mut sumi = [_mm512_setzero_si512(); T];
            for s in 0..fmt.subs() {
                let wv: [__m512i; 8] = std::array::from_fn(|c| {
                    if c < words {
                        load512(packed, o + 64 * (s * words + c))
                    } else {
                        _mm512_setzero_si512()
                    }
                });
                let sc = load512(packed, o + fmt.scales_at() + 64 * s);
                for t in 0..T {
                    let x = xs[t];
                    let mut dp = _mm512_setzero_si512();
                    for (c, w) in wv.iter().enumerate().take(words) {
                        let y = ld_u32(x, ox + q8_k::QS + s * sub + 4 * c) as i32;
                        dp = _mm512_dpbusd_epi32(dp, *w, _mm512_set1_epi32(y));
                    }
                    if Q6 {
                        let bs = ld_u16(x, ox + q8_k::BSUMS + 2 * s) as i16 as i32;
                        dp = _mm512_sub_epi32(dp, _mm512_set1_epi32(32 * bs));
                    }
                    sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(dp, sc));
                }
            }
            let d = _mm512_loadu_ps(packed.as_ptr().add(o + fmt.d_at()) as *const f32);
            for t in 0..T {
                let x = xs[t];
                let dx = _mm512_set1_ps(ld_f32(x, ox));
                let mut v = _mm512_mul_ps(_mm512_mul_ps(dx, d), _mm512_cvtepi32_ps(sumi[t]));
                if !Q6 {
                    let mut summ = _mm512_setzero_si512();
                    for s in 0..8 {
                        let p = ld_u16(x, ox + q8_k::BSUMS + 4 * s) as i16 as i32
                            + ld_u16(x, ox + q8_k::BSUMS + 4 * s + 2) as i16 as i32;
                        let m = load512(packed, o + fmt.mins_at() + 64 * s);
                        summ = _mm512_add_epi32(summ, _mm512_mullo_epi32(m, _mm512_set1_epi32(p)));
                    }
                    let dmin = _mm512_loadu_ps(packed.as_ptr().add(o + fmt.d_at() + 64) as *const f32);
                    v = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_mul_ps(dx, dmin), _mm512_cvtepi32_ps(summ)));
                }
                acc[t] = _mm512_add_ps(acc[t], v);
            }
        }
        let r0 = g * GROUP;
        for (t, out) in outs.iter_mut().enumerate() {
            let n = (out.len() - r0).min(GROUP);
            let mask: __mmask16 = if n == GROUP { 0xffff } else { (1u16 << n) - 1 };
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(r0), mask, acc[t]);
        }
    }
}
