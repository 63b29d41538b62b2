use rayon::prelude::*;
use rayon::ThreadPool;

use super::kv::KvRows;
use super::math;

/// Causal attention of a step's queries over a layer's cached keys/values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub scale: f32,
    /// 0 = full; else a query at p sees keys at positions > p - window.
    pub window: usize,
    /// 0 = none; else scores become cap * tanh(score / cap).
    pub softcap: f32,
}

/// The attention's float loops at the widest level this CPU has (the same
/// bits at every level: see `float_dot::dot_f32_avx512`): 2 = AVX-512,
/// 1 = AVX2, 0 = portable.
#[derive(Clone, Copy)]
struct Wide(u8);

impl Wide {
    fn detect() -> Wide {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            if avx2 && is_x86_feature_detected!("avx512f") {
                return Wide(2);
            }
            Wide(avx2 as u8)
        }
        #[cfg(not(target_arch = "x86_64"))]
        Wide(0)
    }
    #[inline(always)]
    fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        match self.0 {
            // SAFETY: detect() saw AVX-512 F and AVX2.
            2 => return unsafe { crate::quant::float_dot::dot_f32_avx512(a, b) },
            // SAFETY: detect() saw AVX2, FMA and F16C.
            1 => return unsafe { crate::quant::float_dot::dot_f32_avx2(a, b) },
            _ => {}
        }
        crate::quant::float_dot::dot_f32(a, b)
    }
    /// `y[i] += w * x[i]`.
    #[inline(always)]
    fn axpy(self, y: &mut [f32], w: f32, x: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        match self.0 {
            // SAFETY: detect() saw AVX-512 F.
            2 => return unsafe { crate::quant::float_dot::axpy_avx512(y, w, x) },
            // SAFETY: detect() saw AVX2.
            1 => return unsafe { crate::quant::float_dot::axpy_avx2(y, w, x) },
            _ => {}
        }
        y.iter_mut().zip(x).for_each(|(a, &b)| *a += w * b);
    }
}

/// Keys per split of the CUDA attention (`ATT_CHUNK` in host/cuda/src/ops.rs):
/// the CPU splits the same way, so both round the same partial sums.
pub const ATT_CHUNK: usize = 256;
/// Threads of one CUDA attention block (`ATT_THREADS` in attention.cu), whose
/// order of the softmax denominator's additions the CPU reproduces.
const ATT_THREADS: usize = 128;

/// `q`: `[n_q, n_head*dk]` at positions `positions`; `k_cache`/`v_cache`:
/// rows `[0, n_ctx)` of `[n_kv_head*dk]` / `[n_kv_head*dv]` (already holding
/// this step's rows). Writes `[n_q, n_head*dv]` to `out`. Work is split over
/// (query, head) pairs; each pair runs the same fixed-order loop whatever the
/// batch, so prefill and decode agree bit for bit.
///
/// The arithmetic is the CUDA kernels' (attention.cu), operation for
/// operation, so both give the same bits. A query's keys `[start, pos]` are
/// split into chunks of [`ATT_CHUNK`] from `start`. Per chunk: each score is
/// the canonical 32-lane dot `q . k` (a warp's lane-strided sum and
/// butterfly), times `scale`, then `cap * tanh(s / cap)` when soft-capped; `m`
/// its maximum; `e_i = exp(s_i - m)`; `l = sum e_i` as 128 strided partials,
/// each warp's 32 halved by the butterfly, the four warp sums added in order;
/// `o = sum_i e_i v_i` in key order. The chunks combine as
/// `M = max m_c`, `L = sum_c exp(m_c - M) l_c`, `out = (sum_c exp(m_c - M) o_c) / L`,
/// chunk by chunk. `exp`/`tanh` are the shared [`super::math`] ones. A
/// 16-bit cache is read widened (exactly), so it gives the bits an f32 cache
/// of the rounded values gives.
pub fn attend_rows<'a>(
    pool: &ThreadPool,
    p: &AttnParams,
    q: &[f32],
    positions: &[u32],
    k_cache: impl Into<KvRows<'a>>,
    v_cache: impl Into<KvRows<'a>>,
    out: &mut [f32],
) {
    let (k_cache, v_cache) = (k_cache.into(), v_cache.into());
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    let (kw, vw) = (p.n_kv_head * dk, p.n_kv_head * dv);
    let n_q = positions.len();
    assert_eq!(q.len(), n_q * p.n_head * dk);
    assert_eq!(out.len(), n_q * p.n_head * dv);
    assert!(p.n_kv_head > 0 && p.n_head % p.n_kv_head == 0);
    let group = p.n_head / p.n_kv_head;
    let n_ctx = k_cache.len() / kw;
    let wide = Wide::detect();
    let work = |(i, o): (usize, &mut [f32])| {
        let (t, h) = (i / p.n_head, i % p.n_head);
        let pos = positions[t] as usize;
        assert!(pos < n_ctx, "attention: position {pos} beyond cache {n_ctx}");
        let start = if p.window > 0 { (pos + 1).saturating_sub(p.window) } else { 0 };
        let qh = &q[(t * p.n_head + h) * dk..][..dk];
        let kvh = h / group;
        let n_chunks = (pos + 1 - start).div_ceil(ATT_CHUNK);
        // Per chunk: (m, l) and the unnormalised output.
        let mut ml = Vec::with_capacity(n_chunks);
        let mut oc = vec![0f32; n_chunks * dv];
        let mut e = Vec::with_capacity(ATT_CHUNK.min(pos + 1 - start));
        let (mut kb, mut vb) = (vec![0f32; dk], vec![0f32; dv]);
        for (c, oc) in oc.chunks_exact_mut(dv).enumerate() {
            let j0 = start + c * ATT_CHUNK;
            let j1 = (pos + 1).min(j0 + ATT_CHUNK);
            e.clear();
            e.extend((j0..j1).map(|j| {
                let kh = k_cache.get(j * kw + kvh * dk, &mut kb);
                let s = wide.dot(qh, kh) * p.scale;
                if p.softcap > 0.0 {
                    p.softcap * math::tanh(s / p.softcap)
                } else {
                    s
                }
            }));
            let m = e.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            e.iter_mut().for_each(|v| *v = math::exp(*v - m));
            ml.push((m, math::block_sum::<f32, ATT_THREADS>(e.iter().copied())));
            for (j, w) in (j0..j1).zip(&e) {
                wide.axpy(oc, *w, v_cache.get(j * vw + kvh * dv, &mut vb));
            }
        }
        let big_m = ml.iter().map(|&(m, _)| m).fold(f32::NEG_INFINITY, f32::max);
        let mut big_l = 0f32;
        for &(m, l) in &ml {
            if m != f32::NEG_INFINITY {
                big_l += math::exp(m - big_m) * l;
            }
        }
        o.fill(0.0);
        for (&(m, _), oc) in ml.iter().zip(oc.chunks_exact(dv)) {
            if m != f32::NEG_INFINITY {
                let f = math::exp(m - big_m);
                o.iter_mut().zip(oc).for_each(|(a, &b)| *a += f * b);
            }
        }
        o.iter_mut().for_each(|a| *a /= big_l);
    };
    let chunks = out.chunks_exact_mut(dv).enumerate();
    if n_q * p.n_head * (positions.iter().max().copied().unwrap_or(0) as usize + 1) < 4096 {
        chunks.for_each(work);
    } else {
        pool.install(|| out.par_chunks_exact_mut(dv).enumerate().for_each(work));
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap()
    }

    #[test]
    fn single_key_returns_its_value_and_window_limits_the_view() {
        let p = AttnParams { n_head: 2, n_kv_head: 1, head_dim_k: 2, head_dim_v: 2, scale: 1.0, window: 0, softcap: 0.0 };
        let k = vec![1.0, 0.0, 0.0, 1.0, 5.0, 5.0];
        let v = vec![1.0, 2.0, 3.0, 4.0, 9.0, 9.0];
        let q = vec![1.0, 0.0, 0.0, 1.0];
        let mut out = vec![0.0; 4];
        attend_rows(&pool(), &p, &q, &[0], &k, &v, &mut out);
        assert_eq!(out, vec![1.0, 2.0, 1.0, 2.0]);
        // With window 1 the query at position 2 only sees itself.
        let pw = AttnParams { window: 1, ..p };
        attend_rows(&pool(), &pw, &q, &[2], &k, &v, &mut out);
        assert_eq!(out, vec![9.0, 9.0, 9.0, 9.0]);
    }

    #[test]
    fn batched_equals_one_at_a_time() {
        let p = AttnParams { n_head: 4, n_kv_head: 2, head_dim_k: 8, head_dim_v: 8, scale: 0.3, window: 3, softcap: 5.0 };
        let n = 6;
        let f = |i: usize| ((i * 7919) % 23) as f32 / 7.0 - 1.5;
        let k: Vec<f32> = (0..n * 16).map(f).collect();
        let v: Vec<f32> = (0..n * 16).map(|i| f(i + 3)).collect();
        let q: Vec<f32> = (0..n * 32).map(|i| f(i + 11)).collect();
        let pos: Vec<u32> = (0..n as u32).collect();
        let mut all = vec![0.0; n * 32];
        attend_rows(&pool(), &p, &q, &pos, &k, &v, &mut all);
        for t in 0..n {
            let mut one = vec![0.0; 32];
            attend_rows(&pool(), &p, &q[t * 32..(t + 1) * 32], &pos[t..t + 1], &k, &v, &mut one);
            assert_eq!(&all[t * 32..(t + 1) * 32], &one[..]);
        }
    }
    #[test]
    fn split_keys_combine_to_the_plain_softmax() {
        // 700 keys: three chunks of up to 256, combined; checked against f64.
        for (window, softcap) in [(0usize, 0.0f32), (300, 0.0), (0, 20.0)] {
            let p = AttnParams { n_head: 2, n_kv_head: 1, head_dim_k: 40, head_dim_v: 24, scale: 0.2, window, softcap };
            let n = 700;
            let f = |i: usize| ((i * 7919 + 13) % 101) as f32 / 25.0 - 2.0;
            let k: Vec<f32> = (0..n * 40).map(f).collect();
            let v: Vec<f32> = (0..n * 24).map(|i| f(i + 5)).collect();
            let q: Vec<f32> = (0..2 * 40).map(|i| f(i + 17)).collect();
            let pos = n as u32 - 1;
            let mut out = vec![0.0; 2 * 24];
            attend_rows(&pool(), &p, &q, &[pos], &k, &v, &mut out);
            let start = if window > 0 { n - window } else { 0 };
            for h in 0..2 {
                let s: Vec<f64> = (start..n)
                    .map(|j| {
                        let d: f64 = (0..40).map(|c| q[h * 40 + c] as f64 * k[j * 40 + c] as f64).sum::<f64>() * 0.2;
                        if softcap > 0.0 { softcap as f64 * (d / softcap as f64).tanh() } else { d }
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = e.iter().sum();
                for d in 0..24 {
                    let want: f64 = (start..n).zip(&e).map(|(j, w)| w * v[j * 24 + d] as f64).sum::<f64>() / l;
                    let got = out[h * 24 + d] as f64;
                    assert!((got - want).abs() < 2e-5, "window {window} cap {softcap} h{h} d{d}: {got} vs {want}");
                }
            }
        }
    }
}
