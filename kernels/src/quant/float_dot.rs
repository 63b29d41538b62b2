//! The one summation order of every float-weight dot (f32, f16, bf16 weights
//! against f32 activations), shared by the scalar reference, the AVX2 path and
//! the CUDA `gemv_*`/`gemm_*` kernels (kernels/cuda/gemv_float.cu), so all of
//! them give the same bits:
//!
//! - 32 running sums; value `i` goes to sum `i % 32`, in increasing `i`, as
//!   `sum = sum + w_i * x_i` (the product rounded, then the add: no FMA);
//! - then the sums are halved as a warp's xor-butterfly does it:
//!   `s[l] = s[l] + s[l + o]` for `o = 16, 8, 4, 2, 1`, and `s[0]` is the dot.
//!
//! On the GPU the 32 sums are the 32 lanes of a warp (lane `l` strides over
//! `l, l + 32, ...`) and the halving is `warp_sum`.

/// Lanes of the canonical float dot (a CUDA warp).
pub(crate) const LANES: usize = 32;

/// The xor-butterfly's result: `s[l] += s[l + o]` for `o = 16, 8, 4, 2, 1`.
#[inline(always)]
pub(crate) fn halve(mut s: [f32; LANES]) -> f32 {
    let mut o = LANES / 2;
    while o > 0 {
        for l in 0..o {
            s[l] += s[l + o];
        }
        o /= 2;
    }
    s[0]
}

/// Scalar reference: weight `i` is `w(i)`.
#[inline(always)]
pub(crate) fn dot_lanes(x: &[f32], w: impl Fn(usize) -> f32) -> f32 {
    let mut s = [0f32; LANES];
    for (i, xi) in x.iter().enumerate() {
        s[i % LANES] += w(i) * xi;
    }
    halve(s)
}

/// [`dot_lanes`] of two f32 slices of one length (attention scores: the CUDA
/// kernel's `q . k` is a warp's lane-strided sum too). Written over chunks of
/// 32 so the compiler vectorizes the lanes without reordering anything.
#[inline]
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut s = [0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..LANES {
            s[l] += x[l] * y[l];
        }
    }
    for l in 0..ar.len() {
        s[l] += ar[l] * br[l];
    }
    halve(s)
}

/// The AVX2 form of [`dot_lanes`]: four vectors hold the 32 sums; `ld(i)` loads
/// weights `i..i + 8` as f32, `w(i)` gives one weight for the tail.
///
/// # Safety
/// AVX2 + F16C (as `ld` needs); `ld` and `w` valid for every index below `x.len()`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn dot_avx2(
    x: &[f32],
    ld: impl Fn(usize) -> std::arch::x86_64::__m256,
    w: impl Fn(usize) -> f32,
) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len();
    let xp = x.as_ptr();
    let mut i = 0;
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        while i + LANES <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * k;
                *a = _mm256_add_ps(*a, _mm256_mul_ps(ld(o), _mm256_loadu_ps(xp.add(o))));
            }
            i += LANES;
        }
        if i < n {
            // The tail: values i.. go to lanes 0.. (i is a multiple of 32).
            let mut s = [0f32; LANES];
            for (k, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(s.as_mut_ptr().add(8 * k), *a);
            }
            for (l, j) in (i..n).enumerate() {
                s[l] += w(j) * x[j];
            }
            return halve(s);
        }
        // halve() on vectors: 16 (lanes 0-15 + 16-31), 8, then 4, 2, 1 in hsum_f32.
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
        crate::simd::hsum_f32(v)
    }
}
