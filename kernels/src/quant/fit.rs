//! Shared search used by the K-quant quantizers: the best affine fit of a run
//! of values onto integer levels.

/// Fit `x ~= s * L - b` with integer levels `L` in `0..=nmax`, `s >= 0`, `b >= 0`
/// (the shape of q2_K/q4_K sub-blocks: a scale and a subtracted minimum).
/// Tries a few level spacings around the min/max one, refits `(s, b)` by least
/// squares for each assignment, and keeps the smallest squared error.
pub(crate) fn fit_scale_min(x: &[f32], nmax: i32) -> (f32, f32) {
    let lo = x.iter().fold(0f32, |m, &v| m.min(v));
    let hi = x.iter().fold(f32::MIN, |m, &v| m.max(v));
    if hi <= lo {
        return (0.0, -lo);
    }
    let n = x.len() as f32;
    let nm = nmax as f32;
    let mut best = ((hi - lo) / nm, -lo);
    let mut best_err = err(x, best.0, best.1, nmax);
    for t in -10..=10 {
        let iscale = (nm + 0.1 * t as f32) / (hi - lo);
        let (mut sl, mut sl2, mut sx, mut sxl) = (0f32, 0f32, 0f32, 0f32);
        for &v in x {
            let l = ((v - lo) * iscale).round().clamp(0.0, nm);
            sl += l;
            sl2 += l * l;
            sx += v;
            sxl += v * l;
        }
        let det = n * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let mut s = (n * sxl - sl * sx) / det;
        let mut c = (sl2 * sx - sl * sxl) / det;
        if c > 0.0 {
            // The format cannot add an offset: refit the scale alone.
            c = 0.0;
            s = sxl / sl2;
        }
        if s.is_nan() || s <= 0.0 || !s.is_finite() {
            continue;
        }
        let e = err(x, s, -c, nmax);
        if e < best_err {
            best_err = e;
            best = (s, -c);
        }
    }
    best
}

/// Squared error of `x` against its nearest levels for `(s, b)`.
fn err(x: &[f32], s: f32, b: f32, nmax: i32) -> f32 {
    x.iter()
        .map(|&v| {
            let l = if s > 0.0 {
                ((v + b) / s).round().clamp(0.0, nmax as f32)
            } else {
                0.0
            };
            let e = s * l - b - v;
            e * e
        })
        .sum()
}

/// Level of `v` for a quantized scale `s` and minimum `b`, clamped to `0..=nmax`.
#[inline]
pub(crate) fn level(v: f32, s: f32, b: f32, nmax: i32) -> u8 {
    if s > 0.0 {
        ((v + b) / s).round().clamp(0.0, nmax as f32) as u8
    } else {
        0
    }
}

/// Scale-of-scales for a superblock: `max / nmax` rounded through f16, and
/// the integer code of each sub-block value under it.
pub(crate) fn quantize_scales(v: &[f32], nmax: i32, codes: &mut [u8]) -> f32 {
    let max = v.iter().fold(0f32, |m, &s| m.max(s));
    let d = half::f16::from_f32(max / nmax as f32).to_f32();
    for (c, &s) in codes.iter_mut().zip(v) {
        *c = if d > 0.0 {
            (s / d).round().clamp(0.0, nmax as f32) as u8
        } else {
            0
        };
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_grids_are_found() {
        // Values already on a grid of step 0.5 starting at -1: the fit is exact.
        let x: Vec<f32> = (0..32).map(|i| (i % 16) as f32 * 0.5 - 1.0).collect();
        let (s, b) = fit_scale_min(&x, 15);
        assert!((s - 0.5).abs() < 1e-5 && (b - 1.0).abs() < 1e-5, "{s} {b}");
        assert_eq!(err(&x, s, b, 15), 0.0);
        // The search never does worse than the plain min/max spacing, and never
        // asks for a negative minimum (the format can only subtract).
        let x = [1.0, 2.0, 3.0, 4.0, 0.3, 3.3];
        let (s, b) = fit_scale_min(&x, 3);
        assert!(b >= 0.0 && s > 0.0);
        assert!(err(&x, s, b, 3) <= err(&x, 4.0 / 3.0, 0.0, 3));
        // Constant negative run: scale 0, minimum carries the value.
        assert_eq!(fit_scale_min(&[-2.0; 8], 3), (0.0, 2.0));
    }
}
