/// Activation functions of the FFNs' gated units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
    Gelu,
    /// GPT-OSS's clamped SwiGLU (also MiniMax M3's), alpha 1.702 and limit 7.
    SwigluOai,
}

/// swiglu_oai's constants (llama.cpp fixes them; GGUF files carry no key).
pub const SWIGLU_OAI_ALPHA: f32 = 1.702;
pub const SWIGLU_OAI_LIMIT: f32 = 7.0;

impl Activation {
    /// The gated unit: `act(gate) * up`, or swiglu_oai's
    /// `(clamp(up, -7, 7) + 1) * (g * sigmoid(1.702 g))` with `g = min(gate, 7)`
    /// (HF's order of operations).
    #[inline(always)]
    pub fn unit(self, gate: f32, up: f32) -> f32 {
        match self {
            Activation::Silu => silu(gate) * up,
            Activation::GeluTanh => gelu_tanh(gate) * up,
            Activation::Gelu => gelu(gate) * up,
            Activation::SwigluOai => {
                let g = gate.min(SWIGLU_OAI_LIMIT);
                let u = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT);
                let glu = g * super::math::sigmoid(g * SWIGLU_OAI_ALPHA);
                (u + 1.0) * glu
            }
        }
    }
}

/// `x / (1 + e^-x)` with the shared [`super::math::exp`] (bit-identical to CUDA's `silu_f`).
#[inline]
pub fn silu(x: f32) -> f32 {
    super::math::silu(x)
}

/// GELU, tanh approximation (PyTorch `approximate="tanh"`), with the shared
/// [`super::math::tanh`] (bit-identical to CUDA's `gelu_tanh_f`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    super::math::gelu_tanh(x)
}

/// Exact GELU, `x * Phi(x)`, via an erf with |error| < 1.5e-7.
#[inline]
pub fn gelu(x: f32) -> f32 {
    let z = x as f64 / std::f64::consts::SQRT_2;
    (0.5 * x as f64 * (1.0 + erf(z))) as f32
}

/// Abramowitz–Stegun 7.1.26 refined by one Newton step is overkill here; the
/// W. J. Cody rational approximation via `erfc` is what libm does. We use the
/// Numerical Recipes `erfc` Chebyshev fit (relative error < 1.2e-7).
fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.5 * x.abs());
    let y = t
        * (-x * x - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98 + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 {
        1.0 - y
    } else {
        y - 1.0
    }
}

/// `out = act(gate) * up`, elementwise, in place into `gate`.
pub fn glu_rows(gate: &mut [f32], up: &[f32], act: Activation) {
    assert_eq!(gate.len(), up.len(), "glu: gate and up lengths");
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
        // SAFETY: the features were just checked.
        return unsafe { glu_rows_avx512(gate, up, act) };
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the feature was just checked.
        return unsafe { glu_rows_avx2(gate, up, act) };
    }
    glu_loop(gate, up, act);
}

#[inline(always)]
fn glu_loop(gate: &mut [f32], up: &[f32], act: Activation) {
    // Indexed loops, not `zip().for_each`: the iterator's `fold` is a separate
    // function the AVX-512 wrapper below does not inline, so it ran at the
    // baseline (SSE) width. One loop per activation, so each vectorizes.
    let n = gate.len().min(up.len());
    let (gate, up) = (&mut gate[..n], &up[..n]);
    macro_rules! each {
        ($a:expr) => {
            for i in 0..n {
                gate[i] = $a.unit(gate[i], up[i]);
            }
        };
    }
    match act {
        Activation::Silu => each!(Activation::Silu),
        Activation::GeluTanh => each!(Activation::GeluTanh),
        Activation::Gelu => each!(Activation::Gelu),
        Activation::SwigluOai => each!(Activation::SwigluOai),
    }
}

/// [`glu_loop`] compiled for AVX-512, which lets the compiler run it 16
/// elements at a time. The same IEEE operations in the same order (Rust never
/// contracts a multiply and an add into an FMA), so the same bits.
///
/// # Safety
/// AVX-512 F and DQ.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512dq,avx512vl,avx512bw")]
unsafe fn glu_rows_avx512(gate: &mut [f32], up: &[f32], act: Activation) {
    glu_loop(gate, up, act);
}

/// [`glu_loop`] compiled for AVX2 (8 elements at a time), as
/// [`glu_rows_avx512`].
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn glu_rows_avx2(gate: &mut [f32], up: &[f32], act: Activation) {
    glu_loop(gate, up, act);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glu_rows_is_the_unit_of_every_element_at_any_isa() {
        let mut vals: Vec<f32> = (0..4000).map(|i| ((i * 7919) % 4001) as f32 / 97.0 - 20.6).collect();
        vals.extend([0.0, -0.0, 1e-40, -1e-40, 88.8, -88.8, 100.0, -104.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 7.0, -7.0, 0.625, -0.625]);
        let up: Vec<f32> = vals.iter().rev().map(|v| v * 0.5 + 0.25).collect();
        #[allow(clippy::type_complexity)]
        let mut levels: Vec<(&str, fn(&mut [f32], &[f32], Activation))> = vec![("dispatch", glu_rows)];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the feature was just checked.
            levels.push(("avx2", |g, u, a| unsafe { glu_rows_avx2(g, u, a) }));
        }
        for (level, f) in levels {
            for act in [Activation::Silu, Activation::GeluTanh, Activation::Gelu, Activation::SwigluOai] {
                let mut got = vals.clone();
                f(&mut got, &up, act);
                for ((g, &x), &u) in got.iter().zip(&vals).zip(&up) {
                    let want = act.unit(x, u);
                    assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "{level} {act:?}({x}, {u}): {g} vs {want}");
                }
            }
        }
    }

    #[test]
    fn known_values() {
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert!((gelu(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu(-2.0) - (-0.045_500_26)).abs() < 1e-6);
        assert_eq!(silu(0.0), 0.0);
        // swiglu_oai: (clamp(u, ±7) + 1) · g σ(1.702 g), g = min(gate, 7).
        let oai = |g: f32, u: f32| (u.clamp(-7.0, 7.0) + 1.0) * (g.min(7.0) / (1.0 + (-1.702 * g.min(7.0)).exp()));
        for (g, u) in [(1.0, 0.5), (-2.0, 3.0), (9.0, -8.0), (0.0, 2.0), (7.5, 9.0)] {
            assert!((Activation::SwigluOai.unit(g, u) - oai(g, u)).abs() < 1e-5, "({g}, {u})");
        }
        assert_eq!(Activation::Silu.unit(1.5, 2.0), silu(1.5) * 2.0);
        let mut g = vec![1.0, -1.0];
        glu_rows(&mut g, &[2.0, 3.0], Activation::Silu);
        assert!((g[0] - 2.0 * 0.731_058_6).abs() < 1e-6);
    }
}
