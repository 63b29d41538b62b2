/// Threads of the CUDA `rms_norm` block (`NORM_THREADS` in norm_rope.cu),
/// whose order of additions the CPU reproduces.
const NORM_THREADS: usize = 256;

/// RMS norm of each `group`-wide slice of `x` (rows laid end to end), times
/// `weight` (length `group`) when given: `y = (x * scale) * w` with
/// `scale = 1 / sqrt(sum(x^2) / group + eps)` in f64, rounded to f32.
///
/// The sum of squares (each exact in f64) is added in the CUDA kernel's order,
/// so both give the same bits: partial `t` of 256 sums values `t, t + 256, ...`;
/// each run of 32 partials (a warp) is halved by the xor-butterfly; the eight
/// warp sums are added in order. The result does not depend on row count.
pub fn rms_norm_rows(x: &mut [f32], group: usize, weight: Option<&[f32]>, eps: f32) {
    assert!(group > 0 && x.len() % group == 0, "rms_norm: group {group} does not divide {}", x.len());
    if let Some(w) = weight {
        assert_eq!(w.len(), group, "rms_norm: weight length");
    }
    for g in x.chunks_exact_mut(group) {
        let ss = sum_squares(g);
        let scale = (1.0 / ((ss / group as f64) + eps as f64).sqrt()) as f32;
        match weight {
            Some(w) => g.iter_mut().zip(w).for_each(|(v, &w)| *v = *v * scale * w),
            None => g.iter_mut().for_each(|v| *v *= scale),
        }
    }
}

/// `sum(v^2)` in f64 in the order of the CUDA block (see [`rms_norm_rows`]).
fn sum_squares(g: &[f32]) -> f64 {
    super::math::block_sum::<f64, NORM_THREADS>(g.iter().map(|&v| (v as f64) * (v as f64)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_each_group() {
        let mut x = vec![3.0, 4.0, 0.0, 0.0, 1.0, 1.0];
        rms_norm_rows(&mut x, 2, Some(&[1.0, 2.0]), 1e-9);
        let r = (12.5f32).sqrt();
        assert!((x[0] - 3.0 / r).abs() < 1e-5 && (x[1] - 8.0 / r).abs() < 1e-5);
        assert_eq!(&x[2..4], &[0.0, 0.0]);
        assert!((x[4] - 1.0).abs() < 1e-5 && (x[5] - 2.0).abs() < 1e-5);
    }
}
