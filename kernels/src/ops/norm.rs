/// RMS norm of each `group`-wide slice of `x` (rows laid end to end), times
/// `weight` (length `group`) when given. Sums in f64 for stability; the
/// result does not depend on row count.
pub fn rms_norm_rows(x: &mut [f32], group: usize, weight: Option<&[f32]>, eps: f32) {
    assert!(group > 0 && x.len() % group == 0, "rms_norm: group {group} does not divide {}", x.len());
    if let Some(w) = weight {
        assert_eq!(w.len(), group, "rms_norm: weight length");
    }
    for g in x.chunks_exact_mut(group) {
        let ss: f64 = g.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let scale = (1.0 / ((ss / group as f64) + eps as f64).sqrt()) as f32;
        match weight {
            Some(w) => g.iter_mut().zip(w).for_each(|(v, &w)| *v = *v * scale * w),
            None => g.iter_mut().for_each(|v| *v *= scale),
        }
    }
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
