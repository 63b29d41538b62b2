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

/// [`dot_f32`] with AVX-512: the 32 running sums are two vectors, the tail
/// adds only its own lanes (masked, so a `-0.0` sum is kept as the scalar
/// keeps it), and the butterfly halves vectors as [`halve`] does. Same bits.
///
/// # Safety
/// AVX-512 F (and AVX2 for the last halvings).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
pub(crate) unsafe fn dot_f32_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    assert_eq!(a.len(), b.len());
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    // SAFETY: every load is inside a and b (full chunks, then masked lanes).
    unsafe {
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + LANES <= n {
            s0 = _mm512_add_ps(s0, _mm512_mul_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i))));
            s1 = _mm512_add_ps(s1, _mm512_mul_ps(_mm512_loadu_ps(pa.add(i + 16)), _mm512_loadu_ps(pb.add(i + 16))));
            i += LANES;
        }
        let rem = n - i;
        if rem > 0 {
            let m0: __mmask16 = if rem >= 16 { 0xffff } else { (1u16 << rem) - 1 };
            let p0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, pa.add(i)), _mm512_maskz_loadu_ps(m0, pb.add(i)));
            s0 = _mm512_mask_add_ps(s0, m0, s0, p0);
            if rem > 16 {
                let m1: __mmask16 = if rem == 32 { 0xffff } else { (1u16 << (rem - 16)) - 1 };
                let p1 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m1, pa.add(i + 16)), _mm512_maskz_loadu_ps(m1, pb.add(i + 16)));
                s1 = _mm512_mask_add_ps(s1, m1, s1, p1);
            }
        }
        // halve(): o = 16 (the two vectors), o = 8 (their halves), then 4, 2, 1.
        let v = _mm512_add_ps(s0, s1);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
        crate::simd::hsum_f32(h)
    }
}

/// `y[i] += w * x[i]` (the product rounded, then the add), AVX-512 wide.
///
/// # Safety
/// AVX-512 F; `x.len() == y.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn axpy_avx512(y: &mut [f32], w: f32, x: &[f32]) {
    use std::arch::x86_64::*;
    assert_eq!(x.len(), y.len());
    let n = x.len();
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    // SAFETY: every access is inside x and y (masked for the tail).
    unsafe {
        let wv = _mm512_set1_ps(w);
        let mut i = 0;
        while i < n {
            let m: __mmask16 = if n - i >= 16 { 0xffff } else { (1u16 << (n - i)) - 1 };
            let p = _mm512_mul_ps(wv, _mm512_maskz_loadu_ps(m, px.add(i)));
            _mm512_mask_storeu_ps(py.add(i), m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, py.add(i)), p));
            i += 16;
        }
    }
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

/// [`dot_f32`] with AVX2 (for the attention's scores on CPUs without
/// AVX-512): the canonical order through [`dot_avx2`]; `b[i] * a[i]` rounds
/// as `a[i] * b[i]` does. Same bits.
///
/// # Safety
/// AVX2 + FMA + F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    assert_eq!(a.len(), b.len());
    let pb = b.as_ptr();
    // SAFETY: `dot_avx2` loads only full chunks of eight inside `a` and `b`.
    unsafe { dot_avx2(a, |i| _mm256_loadu_ps(pb.add(i)), |i| b[i]) }
}

/// `y[i] += w * x[i]` (the product rounded, then the add), AVX2 wide; the
/// tail as the scalar loop does it.
///
/// # Safety
/// AVX2; `x.len() == y.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn axpy_avx2(y: &mut [f32], w: f32, x: &[f32]) {
    use std::arch::x86_64::*;
    assert_eq!(x.len(), y.len());
    let n = x.len();
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    // SAFETY: every vector access is a full chunk of eight inside x and y.
    unsafe {
        let wv = _mm256_set1_ps(w);
        while i + 8 <= n {
            let p = _mm256_mul_ps(wv, _mm256_loadu_ps(px.add(i)));
            _mm256_storeu_ps(py.add(i), _mm256_add_ps(_mm256_loadu_ps(py.add(i)), p));
            i += 8;
        }
    }
    for j in i..n {
        y[j] += w * x[j];
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod wide_tests {
    use super::*;

    #[test]
    fn avx512_dot_and_axpy_give_the_scalar_bits() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx2")) {
            return;
        }
        let f = |i: usize| ((i * 7919 + 13) % 201) as f32 / 37.0 - 2.7;
        for n in 0..140 {
            let a: Vec<f32> = (0..n).map(f).collect();
            let b: Vec<f32> = (0..n).map(|i| f(i + 61) * 1e-3).collect();
            // SAFETY: the features were checked above.
            let got = unsafe { dot_f32_avx512(&a, &b) };
            assert_eq!(got.to_bits(), dot_f32(&a, &b).to_bits(), "n={n}");
            let mut y: Vec<f32> = (0..n).map(|i| f(i + 5)).collect();
            let mut want = y.clone();
            want.iter_mut().zip(&a).for_each(|(y, &x)| *y += 0.37 * x);
            unsafe { axpy_avx512(&mut y, 0.37, &a) };
            assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "axpy n={n}");
        }
        // A lane whose running sum is -0.0 keeps it through a short tail.
        let a = [-0.0f32; 40];
        let b = [1.0f32; 40];
        assert_eq!(unsafe { dot_f32_avx512(&a, &b) }.to_bits(), dot_f32(&a, &b).to_bits());
    }

    #[test]
    fn avx2_dot_and_axpy_give_the_scalar_bits() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            return;
        }
        let f = |i: usize| ((i * 7919 + 13) % 201) as f32 / 37.0 - 2.7;
        for n in 0..140 {
            let a: Vec<f32> = (0..n).map(f).collect();
            let b: Vec<f32> = (0..n).map(|i| f(i + 61) * 1e-3).collect();
            // SAFETY: the features were checked above.
            let got = unsafe { dot_f32_avx2(&a, &b) };
            assert_eq!(got.to_bits(), dot_f32(&a, &b).to_bits(), "n={n}");
            let mut y: Vec<f32> = (0..n).map(|i| f(i + 5)).collect();
            let mut want = y.clone();
            want.iter_mut().zip(&a).for_each(|(y, &x)| *y += 0.37 * x);
            unsafe { axpy_avx2(&mut y, 0.37, &a) };
            assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "axpy n={n}");
        }
        let a = [-0.0f32; 40];
        let b = [1.0f32; 40];
        assert_eq!(unsafe { dot_f32_avx2(&a, &b) }.to_bits(), dot_f32(&a, &b).to_bits());
    }
}
