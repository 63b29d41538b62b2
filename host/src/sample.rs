//! Sampling: greedy by default; temperature, top-k, top-p and min-p with a
//! seeded generator (same seed, same text); the repetition, presence and
//! frequency penalties as llama.cpp applies them (on the logits, before any
//! of the above, over the last `repeat_last_n` tokens of prompt and reply).

use std::collections::{HashMap, VecDeque};

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    pub seed: u64,
    /// 1 = off. A logit of a recent token is divided by it (multiplied where negative).
    #[serde(default = "one")]
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at (0 = off).
    #[serde(default = "sixty_four")]
    pub repeat_last_n: usize,
    /// 0 = off. Subtracted once from the logit of every recent token.
    #[serde(default)]
    pub presence_penalty: f32,
    /// 0 = off. Subtracted from a recent token's logit once per occurrence.
    #[serde(default)]
    pub frequency_penalty: f32,
}

fn one() -> f32 {
    1.0
}

fn sixty_four() -> usize {
    64
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0x5eed,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplerConfig {
    /// llama-server's defaults: what a request without sampling fields gets
    /// when the GGUF names none (`general.sampling.*`).
    pub fn llama_server() -> SamplerConfig {
        SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, ..SamplerConfig::default() }
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return Err(format!("repeat_penalty must be > 0 (1 = off), got {}", self.repeat_penalty));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }

    fn penalizes(&self) -> bool {
        self.repeat_last_n > 0 && (self.repeat_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0)
    }
}

/// xoshiro256** seeded by splitmix64: small, fast, reproducible everywhere.
#[derive(Clone, Debug)]
pub struct Rng([u64; 4]);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Rng([next(), next(), next(), next()])
    }
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let r = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        r
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    pub cfg: SamplerConfig,
    rng: Rng,
    /// The last `repeat_last_n` tokens and how often each occurs among them
    /// (kept only when a penalty is on).
    recent: VecDeque<u32>,
    counts: HashMap<u32, u32>,
    penalized: Vec<f32>,
}

/// Index of the largest logit (lowest index on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = Rng::new(cfg.seed);
        Sampler { cfg, rng, recent: VecDeque::new(), counts: HashMap::new(), penalized: Vec::new() }
    }

    /// Record a token the penalties should see (the prompt's; `sample`
    /// records its own picks).
    pub fn accept(&mut self, token: u32) {
        if !self.cfg.penalizes() {
            return;
        }
        self.recent.push_back(token);
        *self.counts.entry(token).or_default() += 1;
        if self.recent.len() > self.cfg.repeat_last_n {
            let old = self.recent.pop_front().expect("non-empty");
            if let Some(c) = self.counts.get_mut(&old) {
                *c -= 1;
                if *c == 0 {
                    self.counts.remove(&old);
                }
            }
        }
    }

    /// Forget the recent tokens (a chat turn re-accepts its whole prompt).
    pub fn forget(&mut self) {
        self.recent.clear();
        self.counts.clear();
    }

    pub fn accept_all(&mut self, tokens: &[u32]) {
        tokens.iter().for_each(|&t| self.accept(t));
    }

    /// The next token from a row of logits (penalties first, then the filters).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.counts.is_empty() {
            let t = self.pick(logits);
            self.accept(t);
            return t;
        }
        let mut row = std::mem::take(&mut self.penalized);
        row.clear();
        row.extend_from_slice(logits);
        let c = &self.cfg;
        for (&tok, &n) in &self.counts {
            if let Some(l) = row.get_mut(tok as usize) {
                *l = if *l <= 0.0 { *l * c.repeat_penalty } else { *l / c.repeat_penalty };
                *l -= n as f32 * c.frequency_penalty + c.presence_penalty;
            }
        }
        let t = self.pick(&row);
        self.penalized = row;
        self.accept(t);
        t
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 || self.cfg.top_k == 1 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v)).collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        cand.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0)));
        if self.cfg.top_k > 0 {
            cand.truncate(self.cfg.top_k);
        }
        let t = self.cfg.temperature as f64;
        let max = cand[0].1 as f64;
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 as f64 - max) / t).exp()).collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        // min-p: drop candidates below min_p times the best probability.
        let mut n = probs.len();
        if self.cfg.min_p > 0.0 {
            let floor = probs[0] * self.cfg.min_p as f64;
            n = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        }
        // top-p: the smallest prefix whose mass reaches top_p.
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let mut m = 0;
            for p in &probs[..n] {
                acc += p;
                m += 1;
                if acc >= self.cfg.top_p as f64 {
                    break;
                }
            }
            n = m.max(1);
        }
        let mass: f64 = probs[..n].iter().sum();
        let mut r = self.rng.next_f64() * mass;
        for (i, p) in probs[..n].iter().enumerate() {
            r -= p;
            if r < 0.0 {
                return cand[i].0;
            }
        }
        cand[n - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded_sampling() {
        let logits = vec![0.1, 3.0, 2.9, -1.0];
        assert_eq!(Sampler::new(SamplerConfig::default()).sample(&logits), 1);
        let cfg = SamplerConfig { temperature: 1.0, seed: 7, ..Default::default() };
        let a: Vec<u32> = { let mut s = Sampler::new(cfg.clone()); (0..50).map(|_| s.sample(&logits)).collect() };
        let b: Vec<u32> = { let mut s = Sampler::new(cfg.clone()); (0..50).map(|_| s.sample(&logits)).collect() };
        assert_eq!(a, b);
        assert!(a.contains(&1) && a.contains(&2), "{a:?}");
        // top-k 2 never picks the others.
        let mut s = Sampler::new(SamplerConfig { top_k: 2, ..cfg.clone() });
        assert!((0..200).all(|_| matches!(s.sample(&logits), 1 | 2)));
        // min-p 0.5 keeps only tokens within half of the best.
        let mut s = Sampler::new(SamplerConfig { min_p: 0.5, ..cfg });
        assert!((0..200).all(|_| matches!(s.sample(&logits), 1 | 2)));
    }

    #[test]
    fn penalties_follow_llama_cpp() {
        let logits = vec![2.0, 1.9, -1.0, 0.5];
        // Off: greedy repeats token 0 for ever.
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!((0..3).map(|_| s.sample(&logits)).collect::<Vec<_>>(), [0, 0, 0]);
        // Repetition 1.1: 2.0 / 1.1 = 1.82 < 1.9, so the second pick is 1,
        // then both are penalized (1.82 vs 1.73): 0 again.
        let mut s = Sampler::new(SamplerConfig { repeat_penalty: 1.1, ..Default::default() });
        assert_eq!((0..3).map(|_| s.sample(&logits)).collect::<Vec<_>>(), [0, 1, 0]);
        // A negative logit is multiplied: -1.0 * 4 stays below 0.5 / 4.
        let mut s = Sampler::new(SamplerConfig { repeat_penalty: 4.0, ..Default::default() });
        s.accept_all(&[0, 1, 2, 3]);
        assert_eq!(s.sample(&logits), 0);
        // Frequency counts occurrences: 0 seen twice loses 2 x 0.2, 1 once loses 0.2.
        let mut s = Sampler::new(SamplerConfig { frequency_penalty: 0.2, ..Default::default() });
        s.accept_all(&[0, 0, 1]);
        assert_eq!(s.sample(&logits), 1);
        // Presence subtracts once, however often: 0 and 1 both lose 0.15.
        let mut s = Sampler::new(SamplerConfig { presence_penalty: 0.15, ..Default::default() });
        s.accept_all(&[0, 0, 0, 1]);
        assert_eq!(s.sample(&logits), 0);
        // The window forgets: with repeat_last_n 2, token 0 three tokens back is not penalized.
        let mut s = Sampler::new(SamplerConfig { presence_penalty: 1.0, repeat_last_n: 2, ..Default::default() });
        s.accept_all(&[0, 3, 3]);
        assert_eq!(s.sample(&logits), 0);
        let bad = SamplerConfig { repeat_penalty: 0.0, ..Default::default() };
        assert!(bad.validate().unwrap_err().contains("repeat_penalty"));
        let bad = SamplerConfig { presence_penalty: 2.5, ..Default::default() };
        assert!(bad.validate().unwrap_err().contains("presence_penalty"));
    }
}
