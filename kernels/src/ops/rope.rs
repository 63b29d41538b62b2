/// Which pairs of a head are rotated together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// (x[i], x[i + n_rot/2]) — GPT-NeoX, HF `rotate_half`.
    Neox,
    /// (x[2i], x[2i+1]) — original llama, GPT-J.
    Interleaved,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    pub head_dim: usize,
    pub n_rot: usize,
    pub base: f32,
    /// Positions are divided by this (linear scaling); 1 = none.
    pub linear_factor: f32,
    pub kind: RopeKind,
}

/// Rotate every head of every row; row `r` sits at position `positions[r]`.
/// The inverse frequencies and each angle's cos/sin come from the shared
/// f64 formulas of [`super::math`] (`rope_inv_freq`, `rope_cos_sin`), which the
/// CUDA `rope` kernel evaluates identically; the angle itself is the f32
/// product `(pos / linear_factor) * inv_freq`, as in HF's float32 tables.
pub fn rope_rows(x: &mut [f32], width: usize, positions: &[u32], p: RopeParams) {
    let inv_freq: Vec<f32> = (0..p.n_rot / 2).map(|i| super::math::rope_inv_freq(p.base, i, p.n_rot)).collect();
    rope_rows_with(x, width, positions, p, &inv_freq);
}

/// YaRN's inverse frequencies for `n_rot` rotated dims (ggml's
/// `rope_yarn_corr_dims` and ramp, magnitude left at 1): pair `i`'s plain
/// frequency `f` becomes `f / factor · (1 - r) + f · r`, `r` falling from 1
/// to 0 between the correction dims of `beta_fast` and `beta_slow`. Computed
/// in f64, rounded once.
pub fn yarn_inv_freq(base: f32, n_rot: usize, factor: f32, orig_ctx: f32, beta_fast: f32, beta_slow: f32) -> Vec<f32> {
    let (b, n) = (base as f64, n_rot as f64);
    let corr = |beta: f64| n * (orig_ctx as f64 / (beta * 2.0 * std::f64::consts::PI)).ln() / (2.0 * b.ln());
    let low = corr(beta_fast as f64).floor().max(0.0);
    let high = corr(beta_slow as f64).ceil().min(n - 1.0);
    (0..n_rot / 2)
        .map(|i| {
            let f = b.powf(-((2 * i) as f64) / n);
            let r = 1.0 - ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
            ((f / factor as f64) * (1.0 - r) + f * r) as f32
        })
        .collect()
}

/// [`rope_rows`] with the pairs' inverse frequencies given (`n_rot / 2` of them).
pub fn rope_rows_with(x: &mut [f32], width: usize, positions: &[u32], p: RopeParams, inv_freq: &[f32]) {
    assert!(p.head_dim > 0 && width % p.head_dim == 0 && p.n_rot <= p.head_dim && p.n_rot % 2 == 0);
    assert_eq!(x.len(), width * positions.len(), "rope: rows vs positions");
    let half = p.n_rot / 2;
    assert_eq!(inv_freq.len(), half, "rope: one frequency a pair");
    let mut cos = vec![0f32; half];
    let mut sin = vec![0f32; half];
    for (row, &pos) in x.chunks_exact_mut(width).zip(positions) {
        let t = pos as f32 / p.linear_factor;
        for i in 0..half {
            (cos[i], sin[i]) = super::math::rope_cos_sin(t * inv_freq[i]);
        }
        for head in row.chunks_exact_mut(p.head_dim) {
            for i in 0..half {
                let (a, b) = match p.kind {
                    RopeKind::Neox => (i, i + half),
                    RopeKind::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_rotation_preserves_norm() {
        let p = RopeParams { head_dim: 4, n_rot: 4, base: 10000.0, linear_factor: 1.0, kind: RopeKind::Neox };
        let orig = vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
        let mut x = orig.clone();
        rope_rows(&mut x, 4, &[0, 7], p);
        assert_eq!(&x[..4], &orig[..4]);
        let n0: f32 = orig[4..].iter().map(|v| v * v).sum();
        let n1: f32 = x[4..].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        // Neox pairs (0,2): at pos 7 with inv_freq 1 the pair rotates by 7 rad.
        let (c, s) = (7f32.cos(), 7f32.sin());
        assert!((x[4] - (1.0 * c - 3.0 * s)).abs() < 1e-5);
        assert!((x[6] - (1.0 * s + 3.0 * c)).abs() < 1e-5);
    }

    #[test]
    fn yarn_keeps_fast_pairs_and_slows_the_slow_ones_by_the_factor() {
        // base 1e4, 16 dims, factor 40, 128 trained positions, betas 32 / 1.
        let f = yarn_inv_freq(10_000.0, 16, 40.0, 128.0, 32.0, 1.0);
        let plain: Vec<f32> = (0..8).map(|i| crate::ops::math::rope_inv_freq(10_000.0, i, 16)).collect();
        assert!((f[0] - plain[0]).abs() < 1e-6, "the fastest pair is not scaled");
        assert!((f[7] - plain[7] / 40.0).abs() < 1e-9, "the slowest pair is divided by the factor");
        assert!(f.windows(2).all(|w| w[1] < w[0]));
    }

    #[test]
    fn partial_rotary_leaves_the_tail() {
        let p = RopeParams { head_dim: 4, n_rot: 2, base: 10000.0, linear_factor: 1.0, kind: RopeKind::Interleaved };
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        rope_rows(&mut x, 4, &[5], p);
        assert_eq!(&x[2..], &[3.0, 4.0]);
        assert_ne!(x[0], 1.0);
    }
}
