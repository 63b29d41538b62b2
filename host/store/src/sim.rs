//! Simulated routing for policy tests and benchmarks: Zipf-distributed
//! expert popularity with temporal locality, and an adversarial scan.

/// splitmix64: small, seedable, good enough for simulation.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Routes tokens like a trained MoE: per layer, expert popularity follows
/// Zipf(`exponent`) over a layer-specific permutation, and with probability
/// `locality` each slot keeps the previous token's choice.
#[derive(Clone, Debug)]
pub struct ZipfRouter {
    experts: u32,
    top_k: usize,
    cdf: Vec<f64>,
    perms: Vec<Vec<u32>>,
    prev: Vec<Vec<u32>>,
    locality: f64,
    rng: SimRng,
}

impl ZipfRouter {
    pub fn new(layers: u32, experts: u32, top_k: usize, exponent: f64, locality: f64, seed: u64) -> ZipfRouter {
        let mut rng = SimRng::new(seed);
        let weights: Vec<f64> = (1..=experts).map(|r| 1.0 / f64::from(r).powf(exponent)).collect();
        let sum: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights.iter().map(|w| {
            acc += w / sum;
            acc
        });
        let cdf: Vec<f64> = cdf.collect();
        let perms = (0..layers)
            .map(|_| {
                let mut p: Vec<u32> = (0..experts).collect();
                for i in (1..p.len()).rev() {
                    p.swap(i, rng.below(i as u64 + 1) as usize);
                }
                p
            })
            .collect();
        let top_k = top_k.min(experts as usize);
        ZipfRouter { experts, top_k, cdf, perms, prev: vec![Vec::new(); layers as usize], locality, rng }
    }

    /// The expert with popularity rank `rank` (0 = hottest) in `layer`.
    pub fn expert_of_rank(&self, layer: u32, rank: usize) -> u32 {
        self.perms[layer as usize][rank]
    }

    fn sample(&mut self, layer: usize) -> u32 {
        let u = self.rng.next_f64();
        let rank = self.cdf.partition_point(|&c| c < u).min(self.experts as usize - 1);
        self.perms[layer][rank]
    }

    /// One token: for each layer, `top_k` distinct experts.
    pub fn next_token(&mut self) -> Vec<Vec<u32>> {
        (0..self.perms.len())
            .map(|layer| {
                let mut chosen: Vec<u32> = Vec::with_capacity(self.top_k);
                for slot in 0..self.top_k {
                    let keep = self.prev[layer].get(slot).copied().filter(|e| !chosen.contains(e));
                    let pick = match keep {
                        Some(e) if self.rng.next_f64() < self.locality => e,
                        _ => loop {
                            let e = self.sample(layer);
                            if !chosen.contains(&e) {
                                break e;
                            }
                        },
                    };
                    chosen.push(pick);
                }
                self.prev[layer] = chosen.clone();
                chosen
            })
            .collect()
    }
}

/// Adversarial scan: token `step` uses experts `step*top_k ..` modulo the
/// expert count in every layer, so every expert is touched once per sweep.
pub fn scan_token(step: u64, layers: u32, experts: u32, top_k: usize) -> Vec<Vec<u32>> {
    let base = step * top_k as u64;
    (0..layers).map(|_| (0..top_k as u64).map(|i| ((base + i) % u64::from(experts)) as u32).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_router_is_skewed_distinct_and_deterministic() {
        let mut r = ZipfRouter::new(2, 64, 8, 1.0, 0.0, 1);
        let mut counts = vec![0u32; 64];
        for _ in 0..2000 {
            for (l, experts) in r.next_token().into_iter().enumerate() {
                let mut s = experts.clone();
                s.sort();
                s.dedup();
                assert_eq!(s.len(), 8);
                if l == 0 {
                    for e in experts {
                        counts[e as usize] += 1;
                    }
                }
            }
        }
        let hottest = counts[r.expert_of_rank(0, 0) as usize];
        let coldest = counts[r.expert_of_rank(0, 63) as usize];
        assert!(hottest > 4 * coldest, "{hottest} vs {coldest}");
        let a = ZipfRouter::new(2, 64, 8, 1.0, 0.5, 9).next_token();
        assert_eq!(a, ZipfRouter::new(2, 64, 8, 1.0, 0.5, 9).next_token());
    }

    #[test]
    fn locality_repeats_previous_choices() {
        let mut r = ZipfRouter::new(1, 128, 4, 0.5, 0.9, 3);
        let mut prev = r.next_token();
        let mut same = 0;
        for _ in 0..500 {
            let t = r.next_token();
            same += t[0].iter().filter(|e| prev[0].contains(e)).count();
            prev = t;
        }
        assert!(same > 500 * 4 * 8 / 10, "{same}");
    }

    #[test]
    fn scan_covers_every_expert_each_sweep() {
        let mut seen = std::collections::HashSet::new();
        for s in 0..16 {
            seen.extend(scan_token(s, 1, 64, 4)[0].iter().copied());
        }
        assert_eq!(seen.len(), 64);
    }
}
