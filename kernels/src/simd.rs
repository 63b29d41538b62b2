//! x86-64 helpers shared by the AVX2 / AVX-512 kernels. Every function here is
//! `#[inline(always)]` and only called from inside a `#[target_feature]`
//! function, so it compiles with that function's features.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

/// Sum of the eight i32 lanes (exact; wraps only on overflow, which the
/// callers' bounds exclude).
#[inline(always)]
pub(crate) unsafe fn hsum_i32(v: __m256i) -> i32 {
    unsafe {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }
}

/// Sum of the eight f32 lanes, in a fixed order.
#[inline(always)]
pub(crate) unsafe fn hsum_f32(v: __m256) -> f32 {
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// Eight per-block integer sums at once: lane k of the result is the sum of
/// the eight i32 lanes of `v[k]` (exact; integer addition in any order).
/// The 32-value block dots turn eight blocks' `vpdpbusd` lanes into one
/// vector of block sums, so the per-block float values can be formed lane-wise.
#[inline(always)]
pub(crate) unsafe fn hsum8_i32(v: &[__m256i; 8]) -> __m256i {
    unsafe {
        // Per 128-bit half: [v0 v1 v2 v3] pair sums, then quad sums.
        let a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        let b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
        // a = [s0 s1 s2 s3 | t0 t1 t2 t3] (low / high half of each block's lanes).
        let lo = _mm256_permute2x128_si256::<0x20>(a, b);
        let hi = _mm256_permute2x128_si256::<0x31>(a, b);
        _mm256_add_epi32(lo, hi)
    }
}

/// The f16 fields at `p[off + k * stride]` for k = 0..8 as eight f32 lanes
/// (exact). Lanes past `n` are zero and read nothing.
///
/// # Safety
/// `off + (n - 1) * stride + 2 <= p.len()` for `n = min(n, 8) > 0`.
#[inline(always)]
pub(crate) unsafe fn f16x8_strided(p: &[u8], off: usize, stride: usize, n: usize) -> __m256 {
    unsafe {
        let mut h = [0u16; 8];
        for (k, hk) in h.iter_mut().enumerate().take(n) {
            *hk = ld_u16(p, off + k * stride);
        }
        _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i))
    }
}

/// `acc + v[0] + v[1] + ... + v[n - 1]`, one rounding at a time, left to
/// right: the order in which the scalar reference adds its block values.
#[inline(always)]
pub(crate) unsafe fn add_lanes(mut acc: f32, v: __m256, n: usize) -> f32 {
    unsafe {
        let mut a = [0f32; 8];
        _mm256_storeu_ps(a.as_mut_ptr(), v);
        for &ak in a.iter().take(n) {
            acc += ak;
        }
        acc
    }
}

/// One f16 (as bits) to f32 with F16C; exact, like `half`.
#[inline(always)]
pub(crate) unsafe fn f16_to_f32(bits: u16) -> f32 {
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16))) }
}

/// Unchecked little-endian field reads for the SIMD kernels, whose callers
/// checked the whole buffer's length once (a checked read per byte costs more
/// than the arithmetic in the IQ kernels).
///
/// # Safety
/// `off + 2 <= p.len()` (`+ 4` for the 32-bit reads).
#[inline(always)]
pub(crate) unsafe fn ld_u16(p: &[u8], off: usize) -> u16 {
    debug_assert!(off + 2 <= p.len());
    unsafe { u16::from_le(p.as_ptr().add(off).cast::<u16>().read_unaligned()) }
}
#[inline(always)]
pub(crate) unsafe fn ld_u32(p: &[u8], off: usize) -> u32 {
    debug_assert!(off + 4 <= p.len());
    unsafe { u32::from_le(p.as_ptr().add(off).cast::<u32>().read_unaligned()) }
}
#[inline(always)]
pub(crate) unsafe fn ld_f32(p: &[u8], off: usize) -> f32 {
    unsafe { f32::from_bits(ld_u32(p, off)) }
}
#[inline(always)]
pub(crate) unsafe fn ld_u8(p: &[u8], off: usize) -> u8 {
    debug_assert!(off < p.len());
    unsafe { *p.get_unchecked(off) }
}

/// Two adjacent f16 fields (as one u32) to f32: `(low, high)`. A 32-bit load
/// goes straight into a vector register, so unlike a 16-bit one it carries no
/// false dependency on a previous value of that register.
#[inline(always)]
pub(crate) unsafe fn f16_pair(bits: u32) -> (f32, f32) {
    unsafe {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }
}

/// Unaligned 32-byte load from `p[off..off + 32]`.
///
/// # Safety
/// `off + 32 <= p.len()`.
#[inline(always)]
pub(crate) unsafe fn load256(p: &[u8], off: usize) -> __m256i {
    debug_assert!(off + 32 <= p.len());
    unsafe { _mm256_loadu_si256(p.as_ptr().add(off) as *const __m256i) }
}

/// Unaligned 16-byte load from `p[off..off + 16]`.
///
/// # Safety
/// `off + 16 <= p.len()`.
#[inline(always)]
pub(crate) unsafe fn load128(p: &[u8], off: usize) -> __m128i {
    debug_assert!(off + 16 <= p.len());
    unsafe { _mm_loadu_si128(p.as_ptr().add(off) as *const __m128i) }
}

/// 16 packed nibble bytes -> 32 bytes: the low nibbles, then the high nibbles
/// (the element order of q4_0/q4_1/q5_0/q5_1 blocks).
#[inline(always)]
pub(crate) unsafe fn nibbles_lo_hi(b: __m128i) -> __m256i {
    unsafe {
        let m = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(b, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
        _mm256_set_m128i(hi, lo)
    }
}

/// The 32 bits of `bits` as 32 bytes: 0xFF where bit i is set, 0 elsewhere.
#[inline(always)]
pub(crate) unsafe fn bytes_from_bits(bits: u32) -> __m256i {
    unsafe {
        let v = _mm256_set1_epi32(bits as i32);
        // Byte i takes source byte i / 8 ...
        let shuf = _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0x0000000000000000,
        );
        let v = _mm256_shuffle_epi8(v, shuf);
        // ... and keeps only bit i % 8: OR in every other bit, then test for all ones.
        let others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
        _mm256_cmpeq_epi8(_mm256_or_si256(v, others), _mm256_set1_epi64x(-1))
    }
}

/// Multiply-accumulate 32 unsigned bytes `a` by 32 signed bytes `b` into eight
/// i32 lanes (each lane: four adjacent products). Two flavours: AVX2
/// (`vpmaddubsw` + `vpmaddwd`) and VNNI (`vpdpbusd`). They agree exactly as
/// long as no adjacent pair `a[2i]*b[2i] + a[2i+1]*b[2i+1]` leaves i16 range,
/// which holds for every caller: |b| <= 127 and a <= 128.
pub(crate) trait U8I8Dot {
    unsafe fn dpbusd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
    /// [`bytes_from_bits`]; AVX-512 BW/VL does it in one `vpmovm2b`.
    unsafe fn bit_bytes(bits: u32) -> __m256i;
}

pub(crate) struct Avx2Dot;
pub(crate) struct VnniDot;

impl U8I8Dot for Avx2Dot {
    #[inline(always)]
    unsafe fn dpbusd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        unsafe {
            let p = _mm256_maddubs_epi16(a, b);
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
    #[inline(always)]
    unsafe fn bit_bytes(bits: u32) -> __m256i {
        unsafe { bytes_from_bits(bits) }
    }
}

impl U8I8Dot for VnniDot {
    #[inline(always)]
    unsafe fn dpbusd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_dpbusd_epi32(acc, a, b) }
    }
    #[inline(always)]
    unsafe fn bit_bytes(bits: u32) -> __m256i {
        unsafe { _mm256_movm_epi8(bits) }
    }
}

/// Signed-by-signed byte dot through the unsigned form: |a| times b with a's sign.
/// Needs |b| <= 127 (true of every q8 activation) so negating b cannot overflow.
#[inline(always)]
pub(crate) unsafe fn dot_i8<D: U8I8Dot>(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    unsafe { D::dpbusd(acc, _mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)) }
}

/// `_mm256_maddubs_epi16(a, b)` then `_mm256_madd_epi16` with i16 `scales`:
/// eight i32 lanes of scaled pair sums. Used by the K/IQ kernels whose
/// sub-block scales are small integers.
#[inline(always)]
pub(crate) unsafe fn dot_u8i8_scaled(a: __m256i, b: __m256i, scales: __m256i) -> __m256i {
    unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), scales) }
}

/// i16 scale vector: `lo` for the first 16 bytes' products, `hi` for the last 16.
#[inline(always)]
pub(crate) unsafe fn scales_lo_hi(lo: i32, hi: i32) -> __m256i {
    unsafe { _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16)) }
}

/// `_mm256_shuffle_epi8` masks turning "eight i16 scales in both lanes" into
/// the scale vector of run k of 32 values: i16 scale 2k in the low lane (its
/// first 16 values), 2k + 1 in the high lane.
#[inline(always)]
pub(crate) unsafe fn pair_shuffles() -> [__m256i; 4] {
    unsafe {
        std::array::from_fn(|k| {
            let lo = (((4 * k + 1) << 8) | (4 * k)) as i16;
            let hi = (((4 * k + 3) << 8) | (4 * k + 2)) as i16;
            _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
        })
    }
}

/// Lane `c` (scales 8c..8c+8 of sixteen i16 scales) copied to both lanes.
#[inline(always)]
pub(crate) unsafe fn half_scales(sc16: __m256i, c: usize) -> __m256i {
    unsafe {
        if c == 0 {
            _mm256_permute2x128_si256::<0x00>(sc16, sc16)
        } else {
            _mm256_permute2x128_si256::<0x11>(sc16, sc16)
        }
    }
}

/// The 128 sign patterns of the IQ formats as byte masks for `_mm256_sign_epi8`:
/// byte i of entry k is -1 when bit i of `KSIGNS_IQ2XS[k]` is set, else +1.
pub(crate) static SIGNS64: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut k = 0;
    while k < 128 {
        let s = crate::quant::iq_tables::KSIGNS_IQ2XS[k];
        let mut v = 0u64;
        let mut i = 0;
        while i < 8 {
            let b: u64 = if (s >> i) & 1 == 1 { 0xff } else { 0x01 };
            v |= b << (8 * i);
            i += 1;
        }
        t[k] = v;
        k += 1;
    }
    t
};

// ---- AVX-512 helpers for the multi-row dots (`Kernels::dot_rows`) ----

/// Unaligned 64-byte load from `p[off..off + 64]`.
///
/// # Safety
/// AVX-512 F; `off + 64 <= p.len()`.
#[inline(always)]
pub(crate) unsafe fn load512(p: &[u8], off: usize) -> __m512i {
    debug_assert!(off + 64 <= p.len());
    unsafe { _mm512_loadu_si512(p.as_ptr().add(off) as *const __m512i) }
}

/// Prefetch the `n` cache lines from `p[off..]` on, to L1 (`L1`) or L2. The
/// multi-row dots read four rows at once, a pattern the hardware prefetchers
/// do not follow (on Zen 4, DRAM throughput halves); run a row group ahead,
/// this turns memory traffic back into one sequential stream. Addresses past
/// the end are fine: a prefetch is a hint, never a read of program memory.
#[inline(always)]
pub(crate) unsafe fn prefetch_lines<const L1: bool>(p: &[u8], off: usize, n: usize) {
    for k in 0..n {
        let a = p.as_ptr().wrapping_add(off + 64 * k) as *const i8;
        // SAFETY: prefetching has no effect on memory, at any address.
        unsafe {
            if L1 {
                _mm_prefetch::<_MM_HINT_T0>(a)
            } else {
                _mm_prefetch::<_MM_HINT_T1>(a)
            }
        }
    }
}

/// How far ahead the multi-row decode dots prefetch (at least the next four
/// rows): far enough to hide DRAM latency. Prefetching only the next four
/// rows, the 262144 x 640 q8_0 output head of gemma-3-270m streamed at about
/// 16 GiB/s on two Zen 4 cores instead of 20-23.
const PREFETCH_BYTES: usize = 8192;

/// The byte offset, from a group of four rows of `rb` bytes, of the rows to prefetch.
#[inline(always)]
pub(crate) fn prefetch_ahead(rb: usize) -> usize {
    (PREFETCH_BYTES / rb.max(1)).max(4) * rb
}

/// Sixteen rows of eight dwords to eight vectors of sixteen: `r[p]` holds
/// row p in its low 256 bits and row p + 8 in its high; `out[k]` lane j is
/// dword k of row j. An 8 x 8 transpose in each 256-bit half (unpacks by
/// dword, then by qword), the halves' 128-bit lanes then interleaved.
#[inline(always)]
pub(crate) unsafe fn transpose_16x8(r: [__m512i; 8]) -> [__m512i; 8] {
    unsafe {
        let t: [__m512i; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            }
        });
        // u[4h + q], per 128-bit lane: dword q (low lanes) or q + 4 (high
        // lanes of each half) of rows 4h..4h + 4 (and 8 + 4h.. in the high half).
        let u: [__m512i; 8] = std::array::from_fn(|i| {
            let (h, q) = (i / 4, i % 4);
            let (a, b) = (t[4 * h + q / 2], t[4 * h + 2 + q / 2]);
            if q % 2 == 0 {
                _mm512_unpacklo_epi64(a, b)
            } else {
                _mm512_unpackhi_epi64(a, b)
            }
        });
        let lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
        let hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
        std::array::from_fn(|k| _mm512_permutex2var_epi64(u[k % 4], if k < 4 { lo } else { hi }, u[k % 4 + 4]))
    }
}

/// `[lo | hi]` as one 512-bit vector.
#[inline(always)]
pub(crate) unsafe fn join256(lo: __m256i, hi: __m256i) -> __m512i {
    unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi) }
}

/// Four vectors `t[0..4]` of sixteen i32 lanes to one vector whose 128-bit
/// lane L holds `[sum4(t0.L), sum4(t1.L), sum4(t2.L), sum4(t3.L)]`: the sum of
/// each input's lane L, lanes of the result ordered by input (exact).
#[inline(always)]
pub(crate) unsafe fn reduce4_lanes(t: &[__m512i; 4]) -> __m512i {
    unsafe {
        // Per 128-bit lane: [t0 0+2, t1 0+2, t0 1+3, t1 1+3], then quads.
        let a = _mm512_add_epi32(
            _mm512_unpacklo_epi32(t[0], t[1]),
            _mm512_unpackhi_epi32(t[0], t[1]),
        );
        let b = _mm512_add_epi32(
            _mm512_unpacklo_epi32(t[2], t[3]),
            _mm512_unpackhi_epi32(t[2], t[3]),
        );
        _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    }
}

/// The f32 values in `v`'s lanes `0..n` (`n <= 4`) stored to `out[0..n]`.
#[inline(always)]
pub(crate) unsafe fn store_lanes(v: __m128, out: &mut [f32]) {
    unsafe {
        let mut a = [0f32; 4];
        _mm_storeu_ps(a.as_mut_ptr(), v);
        out.copy_from_slice(&a[..out.len()]);
    }
}
