//! The transcendental functions of the forward pass, written out in IEEE
//! operations only (`+ - * /` and exact bit manipulation, no FMA, no libm), so
//! that the CUDA kernels compute the very same bits: their twins are the
//! `*_c` functions in kernels/cuda/common.cuh, which spell every operation with
//! a round-to-nearest intrinsic (`__fadd_rn`, `__fmul_rn`, `__fdiv_rn`, and the
//! `__d*_rn` ones) so NVRTC cannot contract or reorder them. Rust never
//! contracts `a * b + c`, and evaluates left to right as written.
//!
//! libm's `expf`/`tanhf`/`sinf` and CUDA's differ in the last bit, and the q8
//! re-quantisation of activations amplifies such differences into different
//! greedy tokens; one shared formula removes them.
//!
//! Accuracy: `exp`, `ln` and `tanh` are Cephes' single-precision algorithms (about
//! 1-2 ulp); the RoPE helpers work in f64 (errors near 1e-16, then one rounding
//! to f32, so they are almost always the correctly rounded f32).
//!
//! Every constant is given by its bits, as in common.cuh, so a decimal literal
//! can never round differently on the two sides.

#![allow(clippy::excessive_precision)]

const fn f(bits: u32) -> f32 {
    f32::from_bits(bits)
}

const LOG2E: f32 = f(0x3fb8_aa3b);
/// ln 2 in two parts (Cody-Waite): C1 has few bits, so `n * C1` is exact.
const C1: f32 = f(0x3f31_8000);
const C2: f32 = f(0xb95e_8083);
/// The expf polynomial of Cephes.
const P: [f32; 6] = [f(0x3950_6967), f(0x3ab7_43ce), f(0x3c08_8908), f(0x3d2a_a9c1), f(0x3e2a_aaaa), f(0x3f00_0000)];
/// Above: exp overflows; below: it is 0.
const MAXLOG: f32 = f(0x42b1_7218);
const MINLOG: f32 = f(0xc2cf_f1b4);
/// 1.5 * 2^23: `(v + MAGIC) - MAGIC` rounds v to the nearest integer (ties to even).
const MAGIC: f32 = 12_582_912.0;
/// The tanhf polynomial of Cephes (|x| < 0.625).
const T: [f32; 5] = [f(0xbbba_f0ea), f(0x3ca9_134e), f(0xbd5c_1e2d), f(0x3e08_8393), f(0xbeaa_aa99)];
/// The logf polynomial of Cephes, and sqrt(1/2), where its mantissa range splits.
const L: [f32; 9] = [
    f(0x3d90_21bb),
    f(0xbdeb_d1b8),
    f(0x3def_251a),
    f(0xbdfe_5d4f),
    f(0x3e11_e9bf),
    f(0xbe2a_ae50),
    f(0x3e4c_ceac),
    f(0xbe7f_fffc),
    f(0x3eaa_aaaa),
];
const SQRTHF: f32 = f(0x3f35_04f3);
/// sqrt(2 / pi) and the cubic coefficient of the tanh GELU.
const GELU_S: f32 = f(0x3f4c_422a);
const GELU_C: f32 = f(0x3d37_2713);

/// 2^k for k in [-126, 127].
#[inline(always)]
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// `y * 2^n` for n in [-150, 128], one rounding (only a subnormal result rounds).
#[inline(always)]
fn ldexp(y: f32, n: i32) -> f32 {
    if n > 127 {
        y * pow2(127) * pow2(n - 127)
    } else if n < -126 {
        y * pow2(n + 100) * pow2(-100)
    } else {
        y * pow2(n)
    }
}

/// e^x (Cephes `expf`): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-7
/// polynomial, scaled by 2^n. exp(0) = 1 exactly; NaN gives NaN.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x != x {
        return x;
    }
    if x > MAXLOG {
        return f32::INFINITY;
    }
    if x < MINLOG {
        return 0.0;
    }
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    // n from the bits of t (t = MAGIC + n exactly): no float-to-int conversion,
    // whose NaN behaviour differs between the two sides.
    let ni = (t.to_bits() as i32).wrapping_sub(0x4b40_0000);
    let r = x - n * C1;
    let r = r - n * C2;
    let z = r * r;
    let p = ((((P[0] * r + P[1]) * r + P[2]) * r + P[3]) * r + P[4]) * r + P[5];
    let y = p * z + r + 1.0;
    ldexp(y, ni.clamp(-150, 128))
}

/// ln x (Cephes `logf`): x = m 2^e with m in [sqrt(1/2), sqrt 2), ln m by a
/// degree-9 polynomial in m - 1, plus e ln 2 in two parts. ln 1 = 0 exactly;
/// ln 0 = -inf, ln of a negative number or NaN is NaN, ln inf = inf.
#[inline]
pub fn ln(x: f32) -> f32 {
    if x != x || x < 0.0 {
        return f32::NAN;
    }
    if x == 0.0 {
        return f32::NEG_INFINITY;
    }
    if x == f32::INFINITY {
        return x;
    }
    let (mut bits, mut e) = (x.to_bits(), 0i32);
    if bits < 0x0080_0000 {
        // Subnormal: scale into the normal range (exact).
        bits = (x * pow2(23)).to_bits();
        e = -23;
    }
    e += ((bits >> 23) & 0xff) as i32 - 126;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f00_0000);
    if m < SQRTHF {
        e -= 1;
        m = m + m - 1.0;
    } else {
        m -= 1.0;
    }
    let z = m * m;
    let mut y = L[0];
    for &c in &L[1..] {
        y = y * m + c;
    }
    y = y * m * z;
    let fe = e as f32;
    if e != 0 {
        y = y + fe * C2;
    }
    y = y - 0.5 * z;
    let r = m + y;
    if e != 0 {
        r + fe * C1
    } else {
        r
    }
}

/// `ln(1 + e^x)`, and x itself above 20 (PyTorch's threshold).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        ln(1.0 + exp(x))
    }
}

/// tanh (Cephes `tanhf`): an odd polynomial below 0.625, else
/// `1 - 2 / (e^{2|x|} + 1)` with x's sign.
#[inline]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    if a >= 0.625 {
        let s = exp(a + a);
        let t = 1.0 - 2.0 / (s + 1.0);
        return if x < 0.0 { -t } else { t };
    }
    if x == 0.0 {
        return x;
    }
    let z = x * x;
    let p = (((T[0] * z + T[1]) * z + T[2]) * z + T[3]) * z + T[4];
    p * z * x + x
}

/// The logistic function `1 / (1 + e^-x)` (sigmoid routers).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `x / (1 + e^-x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// GELU, tanh approximation (PyTorch `approximate="tanh"`):
/// `(0.5 x) (1 + tanh(s (x + ((c x) x) x)))`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(GELU_S * (x + GELU_C * x * x * x)))
}

// ---- f64 helpers of RoPE ----

/// 1.5 * 2^52: `(v + MAGIC52) - MAGIC52` rounds |v| < 2^51 to an integer.
const MAGIC52: f64 = 6_755_399_441_055_744.0;
const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
const LOG2E_D: f64 = f64::from_bits(0x3ff7_1547_652b_82fe);
/// pi/2 in three parts (fdlibm's pio2_1, pio2_2 of 33 bits, pio2_2t): `k * part`
/// is exact for the first two when |k| < 2^20.
const PIO2_1: f64 = f64::from_bits(0x3ff9_21fb_5440_0000);
const PIO2_2: f64 = f64::from_bits(0x3dd0_b461_1a60_0000);
const PIO2_3: f64 = f64::from_bits(0x3ba3_198a_2e03_7073);
const TWO_OVER_PI: f64 = f64::from_bits(0x3fe4_5f30_6dc9_c883);

/// 2^k for k in [-1022, 1023].
#[inline(always)]
fn pow2_d(k: i64) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// e^y for |y| < 700: y = n ln2 + r, e^r by its Taylor series to r^13
/// (|r| <= 0.35: the remainder is below 1e-17), times 2^n.
fn exp_d(y: f64) -> f64 {
    let t = y * LOG2E_D + MAGIC52;
    let n = t - MAGIC52;
    let r = y - n * LN2_HI - n * LN2_LO;
    // sum_{k>=2} r^k / k! = r^2 (1/2! + r/3! + ... + r^11/13!), Horner.
    let mut p = EXP_C[0];
    for &c in &EXP_C[1..] {
        p = p * r + c;
    }
    let e = (p * r * r + r) + 1.0;
    e * pow2_d(n as i64)
}

/// 1/13!, 1/12!, ..., 1/2! (rustc folds each division exactly rounded).
const EXP_C: [f64; 12] = [
    1.0 / 6_227_020_800.0,
    1.0 / 479_001_600.0,
    1.0 / 39_916_800.0,
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40320.0,
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
];

/// 1/25, 1/23, ..., 1/3, 1: the atanh series of [`ln_d`].
const LN_C: [f64; 13] = [
    1.0 / 25.0,
    1.0 / 23.0,
    1.0 / 21.0,
    1.0 / 19.0,
    1.0 / 17.0,
    1.0 / 15.0,
    1.0 / 13.0,
    1.0 / 11.0,
    1.0 / 9.0,
    1.0 / 7.0,
    1.0 / 5.0,
    1.0 / 3.0,
    1.0,
];

/// ln b for a positive normal b: b = m 2^k with m in [sqrt(1/2), sqrt(2)),
/// ln m = 2 atanh((m - 1) / (m + 1)) by its series to the 25th power.
fn ln_d(b: f64) -> f64 {
    let bits = b.to_bits();
    let mut k = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        k += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let z = s * s;
    // 2 (s + s^3/3 + ... + s^25/25) = 2 s (1 + z/3 + z^2/5 + ... + z^12/25).
    let mut p = LN_C[0];
    for &c in &LN_C[1..] {
        p = p * z + c;
    }
    let lnm = 2.0 * s * p;
    k as f64 * LN2_HI + (k as f64 * LN2_LO + lnm)
}

/// The inverse frequency of rotary pair `i` (of `n_rot / 2`), as HF computes
/// it in float32: `1 / base^(2i / n_rot)`, the power in f64 rounded once.
pub fn rope_inv_freq(base: f32, i: usize, n_rot: usize) -> f32 {
    let e = (2 * i) as f64 / n_rot as f64;
    let p = if i == 0 { 1.0 } else { exp_d(ln_d(base as f64) * e) };
    1.0 / p as f32
}

/// (cos a, sin a) of an f32 angle, computed in f64 and rounded once each.
/// Accurate for |a| < 2^20 (positions up to about a million).
pub fn rope_cos_sin(a: f32) -> (f32, f32) {
    let x = a as f64;
    let t = x * TWO_OVER_PI + MAGIC52;
    let k = t - MAGIC52;
    let r = x - k * PIO2_1 - k * PIO2_2 - k * PIO2_3;
    let z = r * r;
    // sin r = r + r z (-1/3! + z/5! - ... - z^8/19!),
    // cos r = 1 + z (-1/2! + z/4! - ... - z^8/18!), Horner in z = r^2.
    let mut ps = SIN_C[0];
    for &c in &SIN_C[1..] {
        ps = ps * z + c;
    }
    let s = ps * z * r + r;
    let mut pc = COS_C[0];
    for &c in &COS_C[1..] {
        pc = pc * z + c;
    }
    let c = pc * z + 1.0;
    let (cos, sin) = match (k as i64) & 3 {
        0 => (c, s),
        1 => (-s, c),
        2 => (-c, -s),
        _ => (s, -c),
    };
    (cos as f32, sin as f32)
}

/// Taylor coefficients, highest power first: sin's (-1/19!, +1/17!, ...,
/// -1/3!) and cos's (-1/18!, +1/16!, ..., -1/2!).
const SIN_C: [f64; 9] = [
    -1.0 / 121_645_100_408_832_000.0,
    1.0 / 355_687_428_096_000.0,
    -1.0 / 1_307_674_368_000.0,
    1.0 / 6_227_020_800.0,
    -1.0 / 39_916_800.0,
    1.0 / 362_880.0,
    -1.0 / 5040.0,
    1.0 / 120.0,
    -1.0 / 6.0,
];
const COS_C: [f64; 9] = [
    -1.0 / 6_402_373_705_728_000.0,
    1.0 / 20_922_789_888_000.0,
    -1.0 / 87_178_291_200.0,
    1.0 / 479_001_600.0,
    -1.0 / 3_628_800.0,
    1.0 / 40320.0,
    -1.0 / 720.0,
    1.0 / 24.0,
    -0.5,
];

/// Every constant by name, for the test that the CUDA twin (common.cuh's
/// `#define PC_<NAME> 0x...`) holds the same bits.
/// A CUDA block's sum of `vals` over `N` threads, in the block's order:
/// thread `t` adds `vals[t], vals[t + N], ...` from zero; each warp's 32
/// partials are halved by the xor butterfly (lane 0's result); the warp sums
/// are added in warp order. The CPU twins of the GPU's block reductions
/// (attention's softmax sum, the RMS norm's sum of squares) use it.
pub fn block_sum<T: Copy + Default + std::ops::AddAssign, const N: usize>(vals: impl IntoIterator<Item = T>) -> T {
    let mut part = [T::default(); N];
    for (i, v) in vals.into_iter().enumerate() {
        part[i % N] += v;
    }
    let mut total = T::default();
    for w in part.chunks_exact_mut(32) {
        let mut o = 16;
        while o > 0 {
            for l in 0..o {
                let x = w[l + o];
                w[l] += x;
            }
            o /= 2;
        }
        total += w[0];
    }
    total
}

#[cfg(test)]
pub(crate) fn constants() -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = vec![
        ("LOG2E".into(), LOG2E.to_bits() as u64),
        ("C1".into(), C1.to_bits() as u64),
        ("C2".into(), C2.to_bits() as u64),
        ("MAXLOG".into(), MAXLOG.to_bits() as u64),
        ("MINLOG".into(), MINLOG.to_bits() as u64),
        ("MAGIC".into(), MAGIC.to_bits() as u64),
        ("GELU_S".into(), GELU_S.to_bits() as u64),
        ("GELU_C".into(), GELU_C.to_bits() as u64),
        ("MAGIC52".into(), MAGIC52.to_bits()),
        ("LN2_HI".into(), LN2_HI.to_bits()),
        ("LN2_LO".into(), LN2_LO.to_bits()),
        ("LOG2E_D".into(), LOG2E_D.to_bits()),
        ("PIO2_1".into(), PIO2_1.to_bits()),
        ("PIO2_2".into(), PIO2_2.to_bits()),
        ("PIO2_3".into(), PIO2_3.to_bits()),
        ("TWO_OVER_PI".into(), TWO_OVER_PI.to_bits()),
        ("SQRT2".into(), std::f64::consts::SQRT_2.to_bits()),
    ];
    let tables: [(&str, &[f64]); 4] = [("EXP_C", &EXP_C), ("LN_C", &LN_C), ("SIN_C", &SIN_C), ("COS_C", &COS_C)];
    for (name, t) in tables {
        for (i, c) in t.iter().enumerate() {
            v.push((format!("{name}{i}"), c.to_bits()));
        }
    }
    for (i, c) in P.iter().enumerate() {
        v.push((format!("P{i}"), c.to_bits() as u64));
    }
    for (i, c) in T.iter().enumerate() {
        v.push((format!("T{i}"), c.to_bits() as u64));
    }
    for (i, c) in L.iter().enumerate() {
        v.push((format!("L{i}"), c.to_bits() as u64));
    }
    v.push(("SQRTHF".into(), SQRTHF.to_bits() as u64));
    v
}

#[cfg(test)]
mod tests {
    #[test]
    fn block_sum_adds_in_the_cuda_blocks_order() {
        // Lanes 0 and 16 cancel in the butterfly's first step, so lane 1's 1.0
        // survives; a sum in index order loses it (1e8 + 1 rounds to 1e8).
        let mut v = [0f32; 32];
        (v[0], v[1], v[16]) = (1e8, 1.0, -1e8);
        assert_eq!(v.iter().fold(0f32, |a, &x| a + x), 0.0);
        assert_eq!(super::block_sum::<f32, 32>(v), 1.0);
        // Thread t takes t, t + N, ...: with N = 64, values 0 and 64 meet first.
        let mut w = vec![0f32; 128];
        (w[0], w[64], w[1]) = (1e8, -1e8, 1.0);
        assert_eq!(super::block_sum::<f32, 64>(w), 1.0);
    }

    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        let (x, y) = (a.to_bits() as i32, b.to_bits() as i32);
        (x - y).unsigned_abs()
    }

    #[test]
    fn cuda_twin_holds_the_same_constants() {
        let src = include_str!("../../cuda/common.cuh");
        for (name, bits) in constants() {
            let key = format!("#define PC_{name} ");
            let line = src
                .lines()
                .find(|l| l.starts_with(&key))
                .unwrap_or_else(|| panic!("common.cuh lacks PC_{name}"));
            let hex = line[key.len()..].trim().trim_start_matches("0x").trim_end_matches("ULL").trim_end_matches('u');
            assert_eq!(u64::from_str_radix(hex, 16).unwrap(), bits, "PC_{name}");
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        let mut worst = 0;
        let mut x = -103.0f32;
        while x < 88.7 {
            let e = (x as f64).exp();
            let got = exp(x) as f64;
            if e > 1e-37 {
                let rel = ((got - e) / e).abs();
                assert!(rel < 2.5e-7, "exp({x}) = {got}, want {e}");
            }
            worst = worst.max(ulps(exp(x), (x as f64).exp() as f32));
            x += 0.00731;
        }
        assert!(worst <= 2, "worst {worst} ulp");
    }

    #[test]
    fn ln_is_within_two_ulp_of_libm() {
        assert_eq!(ln(1.0), 0.0);
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
        assert_eq!(ln(f32::INFINITY), f32::INFINITY);
        assert!(ln(-1.0).is_nan() && ln(f32::NAN).is_nan());
        let mut worst = 0;
        // Subnormals, tiny, around 1 (where m - 1 cancels), and large values.
        for &(lo, hi, step) in &[(1e-44f32, 1e-38f32, 1.37f32), (1e-38, 1e38, 1.0007), (0.5, 2.0, 1.000_003)] {
            let mut x = lo;
            while x < hi {
                worst = worst.max(ulps(ln(x), (x as f64).ln() as f32));
                x *= step;
            }
        }
        assert!(worst <= 2, "worst {worst} ulp");
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
    }

    #[test]
    fn tanh_is_accurate() {
        let mut x = -12.0f32;
        while x < 12.0 {
            let e = (x as f64).tanh();
            let got = tanh(x) as f64;
            assert!((got - e).abs() <= 2.5e-7 * e.abs().max(1e-30) + 1e-45, "tanh({x}) = {got}, want {e}");
            x += 0.000913;
        }
        assert_eq!(tanh(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(tanh(100.0), 1.0);
        assert_eq!(tanh(-100.0), -1.0);
        assert!((tanh(1e-20) - 1e-20).abs() < 1e-27);
    }

    #[test]
    fn activations_match_their_definitions() {
        for i in -400..400 {
            let x = i as f32 * 0.037;
            let xd = x as f64;
            let silu_e = xd / (1.0 + (-xd).exp());
            assert!((silu(x) as f64 - silu_e).abs() <= 3e-7 * silu_e.abs().max(1e-3));
            let g = 0.5 * xd * (1.0 + (0.7978845608 * (xd + 0.044715 * xd * xd * xd)).tanh());
            // 1 + tanh(..) cancels for negative x (in any f32 evaluation):
            // up to an ulp of 1 times |x| / 2.
            assert!((gelu_tanh(x) as f64 - g).abs() <= 4e-7 * g.abs() + 1.2e-7 * xd.abs(), "gelu {x}");
            let s = 1.0 / (1.0 + (-xd).exp());
            assert!((sigmoid(x) as f64 - s).abs() <= 3e-7 * s);
        }
    }

    #[test]
    fn rope_helpers_are_correctly_rounded_almost_always() {
        let mut off = 0;
        for &base in &[10_000.0f32, 1_000_000.0, 500_000.0, 10.0] {
            for n_rot in [64usize, 128, 256] {
                for i in 0..n_rot / 2 {
                    let want = 1.0 / ((base as f64).powf((2 * i) as f64 / n_rot as f64)) as f32;
                    let got = rope_inv_freq(base, i, n_rot);
                    assert!(ulps(got, want) <= 1, "{base} {i}/{n_rot}: {got} vs {want}");
                    off += (got != want) as usize;
                }
            }
        }
        assert!(off <= 4, "{off} inverse frequencies off by an ulp");
        let mut off = 0;
        for p in 0..20000u32 {
            let a = p as f32 * 0.913 + (p % 7) as f32 * 1e-3;
            let (c, s) = rope_cos_sin(a);
            let (ce, se) = ((a as f64).cos() as f32, (a as f64).sin() as f32);
            assert!(ulps(c, ce) <= 1 && ulps(s, se) <= 1, "{a}: {c} {s} vs {ce} {se}");
            off += (c != ce) as usize + (s != se) as usize;
        }
        assert!(off < 20, "{off} of 40000 values off by an ulp");
        assert_eq!(rope_cos_sin(0.0), (1.0, 0.0));
    }
}
