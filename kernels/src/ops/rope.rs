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
    assert!(p.head_dim > 0 && width % p.head_dim == 0 && p.n_rot <= p.head_dim && p.n_rot % 2 == 0);
    assert_eq!(x.len(), width * positions.len(), "rope: rows vs positions");
    let half = p.n_rot / 2;
    let inv_freq: Vec<f32> = (0..half).map(|i| super::math::rope_inv_freq(p.base, i, p.n_rot)).collect();
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
    fn partial_rotary_leaves_the_tail() {
        let p = RopeParams { head_dim: 4, n_rot: 2, base: 10000.0, linear_factor: 1.0, kind: RopeKind::Interleaved };
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        rope_rows(&mut x, 4, &[5], p);
        assert_eq!(&x[2..], &[3.0, 4.0]);
        assert_ne!(x[0], 1.0);
    }
}
