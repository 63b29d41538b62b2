//! Tier 2: the VRAM hot set, as policy. The CUDA backend owns the memory and
//! carries out the decisions returned here.
//!
//! A fixed pool of slots, one slab each. Every touch adds to a slab's heat;
//! heat decays exponentially (half-life in steps) so the set follows drifting
//! routing. A slab earns a slot only by being hotter than the coldest
//! resident by `admit_margin` (hysteresis against two near-equal slabs
//! swapping every step); a one-off touch, as in a scan, never beats a
//! resident that keeps being used. Residents touched in the current step
//! are never evicted by it.
//!
//! Decay is lazy: instead of scaling every heat each step, the increment
//! grows by `2^(1/half_life)` per step, and everything is renormalised when
//! it gets large. Comparisons are unaffected.
//!
//! A step costs time in the slabs it touches, not in the pool's size (a
//! 16 GB card holds thousands of slots and a decode token makes one step per
//! MoE layer): free slots are a stack, and the coldest resident comes from a
//! lazy min-heap. Stored heats only grow between renormalisations, so an
//! entry's key is never above its slab's heat; a popped entry whose key is
//! current is the true minimum, and a stale one is re-keyed and pushed back.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::catalog::{Catalog, SlabId};
use crate::census::Census;

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct HotSetConfig {
    pub slots: usize,
    /// Steps after which an untouched slab's heat has halved.
    pub half_life_steps: f64,
    /// A candidate must be this much hotter (fraction) than the coldest resident.
    pub admit_margin: f64,
}

impl HotSetConfig {
    pub fn new(slots: usize) -> HotSetConfig {
        HotSetConfig { slots, half_life_steps: 512.0, admit_margin: 0.25 }
    }
}

/// Load `slab` into `slot`; `evicted` was there before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    pub slab: SlabId,
    pub slot: u32,
    pub evicted: Option<SlabId>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HotSetCounters {
    pub steps: u64,
    /// Touched slabs (distinct per step) found resident.
    pub hits: u64,
    pub misses: u64,
    pub admissions: u64,
    pub evictions: u64,
}

#[derive(Debug)]
pub struct HotSet {
    cfg: HotSetConfig,
    slots: Vec<Option<SlabId>>,
    resident: HashMap<SlabId, u32>,
    heat: HashMap<SlabId, f64>,
    inc: f64,
    growth: f64,
    counters: HotSetCounters,
    /// Free slots, highest first (so the lowest is used first).
    free: Vec<u32>,
    /// (heat bits, slot) of residents; keys are positive floats' bits, which order like the floats.
    cold: BinaryHeap<Reverse<(u64, u32)>>,
    /// The key of each slot's one live heap entry (others are stale).
    key: Vec<u64>,
}

const RENORMALISE_AT: f64 = 1e100;

impl HotSet {
    pub fn new(cfg: HotSetConfig) -> HotSet {
        let half = if cfg.half_life_steps.is_finite() && cfg.half_life_steps > 0.0 { cfg.half_life_steps } else { f64::INFINITY };
        HotSet {
            cfg,
            slots: vec![None; cfg.slots],
            resident: HashMap::new(),
            heat: HashMap::new(),
            inc: 1.0,
            growth: 2f64.powf(1.0 / half),
            counters: HotSetCounters::default(),
            free: (0..cfg.slots as u32).rev().collect(),
            cold: BinaryHeap::new(),
            key: vec![u64::MAX; cfg.slots],
        }
    }

    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    pub fn slot_of(&self, id: SlabId) -> Option<u32> {
        self.resident.get(&id).copied()
    }

    /// What each slot holds.
    pub fn occupancy(&self) -> &[Option<SlabId>] {
        &self.slots
    }

    /// Current heat in "touches now" units.
    pub fn heat(&self, id: SlabId) -> f64 {
        self.heat.get(&id).map_or(0.0, |h| h / self.inc)
    }

    pub fn counters(&self) -> HotSetCounters {
        self.counters
    }

    /// Record one step's touches (a slab may repeat: each use counts) and
    /// return the admissions to carry out before the next step.
    pub fn step(&mut self, touched: &[SlabId]) -> Vec<Admission> {
        self.counters.steps += 1;
        let mut distinct: Vec<SlabId> = Vec::with_capacity(touched.len());
        let mut in_step: HashSet<SlabId> = HashSet::with_capacity(touched.len());
        for &id in touched {
            *self.heat.entry(id).or_insert(0.0) += self.inc;
            if in_step.insert(id) {
                distinct.push(id);
            }
        }
        let mut candidates: Vec<(f64, SlabId)> = Vec::new();
        for &id in &distinct {
            if self.resident.contains_key(&id) {
                self.counters.hits += 1;
            } else {
                self.counters.misses += 1;
                candidates.push((self.heat[&id], id));
            }
        }
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut out = Vec::new();
        // Residents touched in this step, set aside while looking for a victim.
        let mut aside = Vec::new();
        for (h, id) in candidates {
            let (slot, evicted) = if let Some(s) = self.free.pop() {
                (s, None)
            } else {
                match self.coldest(&in_step, &mut aside) {
                    Some((ch, s)) if h > ch * (1.0 + self.cfg.admit_margin) => (s, self.slots[s as usize]),
                    Some((ch, s)) => {
                        self.cold.push(Reverse((ch.to_bits(), s)));
                        break; // later candidates are colder still
                    }
                    None => break,
                }
            };
            self.place(id, slot, evicted, &mut out);
        }
        self.cold.extend(aside);
        self.advance();
        out
    }

    /// The coldest resident not in `in_step`, popped from the heap (the
    /// caller pushes it back if it is not evicted).
    fn coldest(&mut self, in_step: &HashSet<SlabId>, aside: &mut Vec<Reverse<(u64, u32)>>) -> Option<(f64, u32)> {
        while let Some(Reverse((bits, s))) = self.cold.pop() {
            if self.key[s as usize] != bits {
                continue; // superseded entry
            }
            let Some(id) = self.slots[s as usize] else { continue };
            let cur = self.heat[&id];
            if cur.to_bits() != bits {
                self.key[s as usize] = cur.to_bits();
                self.cold.push(Reverse((cur.to_bits(), s)));
                continue;
            }
            if in_step.contains(&id) {
                aside.push(Reverse((bits, s)));
                continue;
            }
            return Some((cur, s));
        }
        None
    }

    fn rebuild_heap(&mut self) {
        self.cold.clear();
        for (s, r) in self.slots.iter().enumerate() {
            if let Some(id) = r {
                let b = self.heat[id].to_bits();
                self.key[s] = b;
                self.cold.push(Reverse((b, s as u32)));
            }
        }
    }

    /// Fill free slots with the hottest whole triples of `census`, seeding
    /// their heat from the counts. Never evicts.
    pub fn warm_load(&mut self, catalog: &Catalog, census: &Census) -> Vec<Admission> {
        let mut out = Vec::new();
        for (layer, expert, count) in census.hottest() {
            let Some(t) = catalog.triple(layer, expert) else { continue };
            let slabs: Vec<SlabId> = t.slabs().filter(|id| !self.resident.contains_key(id)).collect();
            if slabs.len() > self.free.len() {
                continue; // whole triples only; a smaller (fused) one may still fit
            }
            for id in slabs {
                let h = self.heat.entry(id).or_insert(0.0);
                *h = h.max(count as f64 * self.inc);
                let slot = self.free.pop().expect("checked above");
                self.place(id, slot, None, &mut out);
            }
        }
        out
    }

    fn place(&mut self, id: SlabId, slot: u32, evicted: Option<SlabId>, out: &mut Vec<Admission>) {
        if let Some(old) = evicted {
            self.resident.remove(&old);
            self.counters.evictions += 1;
        }
        self.slots[slot as usize] = Some(id);
        self.resident.insert(id, slot);
        let b = self.heat.get(&id).copied().unwrap_or(0.0).to_bits();
        self.key[slot as usize] = b;
        self.cold.push(Reverse((b, slot)));
        self.counters.admissions += 1;
        out.push(Admission { slab: id, slot, evicted });
    }

    fn advance(&mut self) {
        if self.cold.len() > 4 * self.slots.len() + 64 {
            self.rebuild_heap(); // drop superseded entries
        }
        self.inc *= self.growth;
        if self.inc > RENORMALISE_AT {
            let k = self.inc;
            for h in self.heat.values_mut() {
                *h /= k;
            }
            // Forget what has decayed to nothing, so the table stays small.
            self.heat.retain(|id, h| *h > 1e-12 || self.resident.contains_key(id));
            self.inc = 1.0;
            self.rebuild_heap();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{SlabKind, SlabLoc};
    use pulsar_gguf::GgmlType;

    fn id(e: u32) -> SlabId {
        SlabId::new(0, SlabKind::Down, e)
    }

    #[test]
    fn admission_needs_more_heat_than_the_coldest_resident() {
        let mut h = HotSet::new(HotSetConfig { slots: 2, half_life_steps: f64::INFINITY, admit_margin: 0.0 });
        assert_eq!(h.step(&[id(1), id(1), id(2)]).len(), 2, "free slots fill at once");
        // id(3) once: not hotter than id(2) (1 touch): no admission.
        assert!(h.step(&[id(3)]).is_empty());
        // id(3) again: 2 touches > id(2)'s 1.
        let a = h.step(&[id(3)]);
        assert_eq!(a, vec![Admission { slab: id(3), slot: h.slot_of(id(3)).unwrap(), evicted: Some(id(2)) }]);
        assert!(h.slot_of(id(2)).is_none());
        assert_eq!(h.slot_of(id(1)), Some(0));
        // A resident touched in the same step is not evicted by it.
        for _ in 0..5 {
            h.step(&[id(9)]);
        }
        let a = h.step(&[id(9), id(1), id(3)]);
        assert!(a.is_empty(), "{a:?}");
    }

    #[test]
    fn decay_lets_new_favourites_in() {
        let mut h = HotSet::new(HotSetConfig { slots: 1, half_life_steps: 4.0, admit_margin: 0.25 });
        for _ in 0..20 {
            h.step(&[id(0)]);
        }
        let mut admitted_at = None;
        for step in 0..100 {
            if !h.step(&[id(1)]).is_empty() {
                admitted_at = Some(step);
                break;
            }
        }
        let at = admitted_at.expect("decay never let the new favourite in");
        assert!((2..20).contains(&at), "admitted after {at} steps");
        assert!(h.heat(id(1)) > h.heat(id(0)));
    }

    #[test]
    fn renormalisation_keeps_order() {
        let mut h = HotSet::new(HotSetConfig { slots: 1, half_life_steps: 1.0, admit_margin: 0.0 });
        for _ in 0..400 {
            h.step(&[id(0)]);
        }
        // Touched every step with half-life 1: heat settles near 1 (in units of one touch now).
        assert!((0.9..=1.1).contains(&h.heat(id(0))), "{}", h.heat(id(0)));
        assert_eq!(h.slot_of(id(0)), Some(0));
    }

    #[test]
    fn warm_load_places_whole_triples_hottest_first() {
        let loc = SlabLoc { file: 0, offset: 0, bytes: 34, ty: GgmlType::Q8_0, rows: 1, cols: 32 };
        let mut e = Vec::new();
        for x in 0..4 {
            for k in [SlabKind::Gate, SlabKind::Up, SlabKind::Down] {
                e.push((SlabId::new(0, k, x), loc));
            }
        }
        let cat = Catalog::new(vec!["f".into()], e).unwrap();
        let mut c = Census::new();
        c.record(0, 2, 50);
        c.record(0, 0, 40);
        c.record(0, 3, 1);
        c.record(7, 7, 99); // not in the catalogue: ignored
        let mut h = HotSet::new(HotSetConfig::new(7));
        let a = h.warm_load(&cat, &c);
        assert_eq!(a.len(), 6, "two whole triples; the third does not fit in one slot");
        assert!(a[..3].iter().all(|x| x.slab.expert == 2));
        assert!(a[3..].iter().all(|x| x.slab.expert == 0 && x.evicted.is_none()));
        // Seeded heat protects them from a one-off touch.
        assert!(h.step(&[SlabId::new(0, SlabKind::Gate, 1)]).len() == 1, "the free slot is used");
        assert!(h.step(&[SlabId::new(0, SlabKind::Up, 1)]).is_empty());
    }

    /// The admission rule written the slow, obvious way (sort every resident
    /// each step): the heap-based step must decide exactly the same.
    fn reference_step(h: &mut HotSet, touched: &[SlabId]) -> Vec<Admission> {
        let mut in_step = HashSet::new();
        let mut distinct = Vec::new();
        for &id in touched {
            *h.heat.entry(id).or_insert(0.0) += h.inc;
            if in_step.insert(id) {
                distinct.push(id);
            }
        }
        let mut cand: Vec<(f64, SlabId)> = distinct.iter().filter(|id| !h.resident.contains_key(id)).map(|&id| (h.heat[&id], id)).collect();
        cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut cold: Vec<(f64, u32)> =
            h.slots.iter().enumerate().filter_map(|(s, r)| r.filter(|id| !in_step.contains(id)).map(|id| (h.heat[&id], s as u32))).collect();
        cold.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
        let mut free: Vec<u32> = h.slots.iter().enumerate().filter(|(_, r)| r.is_none()).map(|(s, _)| s as u32).rev().collect();
        let mut out = Vec::new();
        for (heat, id) in cand {
            let (slot, evicted) = if let Some(s) = free.pop() {
                (s, None)
            } else {
                match cold.last() {
                    Some(&(ch, s)) if heat > ch * (1.0 + h.cfg.admit_margin) => {
                        cold.pop();
                        (s, h.slots[s as usize])
                    }
                    _ => break,
                }
            };
            if let Some(old) = evicted {
                h.resident.remove(&old);
            }
            h.slots[slot as usize] = Some(id);
            h.resident.insert(id, slot);
            out.push(Admission { slab: id, slot, evicted });
        }
        h.inc *= h.growth;
        out
    }

    #[test]
    fn heap_step_decides_like_the_reference() {
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for slots in [1usize, 3, 16] {
            let cfg = HotSetConfig { slots, half_life_steps: 8.0, admit_margin: 0.25 };
            let (mut fast, mut slow) = (HotSet::new(cfg), HotSet::new(cfg));
            for _ in 0..2000 {
                // Zipf-ish: small ids far more often, some repeats in a step.
                let n = 1 + (next() % 6) as usize;
                let t: Vec<SlabId> = (0..n).map(|_| id(((next() % 64) as f64).powf(1.5) as u32 % 40)).collect();
                assert_eq!(fast.step(&t), reference_step(&mut slow, &t));
            }
        }
    }
}
