/// Softmax in place (max-subtracted, f32): `e_i = exp(x_i - max)` with the
/// shared [`super::math::exp`], their sum in index order, then `e_i * (1 / sum)`;
/// the CUDA router (`route_topk`) computes the same bits.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = super::math::exp(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Indices of the `k` largest values, largest first; ties go to the lower
/// index (deterministic, matches a stable descending sort).
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_and_topk() {
        let mut x = vec![1.0, 2.0, 3.0];
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0]);
        assert_eq!(top_k(&[0.1, 0.5, 0.5, 0.2], 3), vec![1, 2, 3]);
    }
}
