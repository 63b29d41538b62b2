//! Cache policy on simulated routing traces. Hit rates are printed
//! (`cargo test -- --nocapture`); assertions compare against naive policies
//! and bounds, and check budgets at every step.

use std::collections::{HashSet, VecDeque};

use pulsar_store::sim::{scan_token, ZipfRouter};
use pulsar_store::{HotSet, HotSetConfig, LfuPolicy, SlabId, SlabKind};

const KINDS: [SlabKind; 3] = [SlabKind::Gate, SlabKind::Up, SlabKind::Down];

fn slabs(layer: u32, experts: &[u32]) -> Vec<SlabId> {
    experts.iter().flat_map(|&e| KINDS.iter().map(move |&k| SlabId::new(layer, k, e))).collect()
}

/// Slab cost varies by layer (different quant types in one model).
fn cost(id: SlabId) -> u64 {
    1000 + 250 * u64::from(id.layer % 3)
}

/// Drive the real LFU policy like a step would: pin hits, evict to insert
/// misses (pinned), unpin at step end. Returns the hit rate.
fn run_lfu(trace: &[Vec<Vec<u32>>], budget: u64) -> f64 {
    let mut p = LfuPolicy::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for token in trace {
        for (layer, experts) in token.iter().enumerate() {
            let step = slabs(layer as u32, experts);
            for &id in &step {
                total += 1;
                if p.hit(id) {
                    hits += 1;
                    p.pin(id);
                } else {
                    while p.bytes() + cost(id) > budget {
                        p.evict().expect("a step must fit in the budget");
                    }
                    p.insert(id, cost(id), true);
                }
                assert!(p.bytes() <= budget, "budget exceeded");
            }
            assert!(p.pinned_bytes() <= budget);
            for &id in &step {
                p.unpin(id);
            }
            assert_eq!(p.pinned_bytes(), 0);
        }
    }
    hits as f64 / total as f64
}

/// Recency baselines: LRU, or FIFO (insertion order, hits do not refresh).
fn run_recency(trace: &[Vec<Vec<u32>>], budget: u64, refresh: bool) -> f64 {
    let mut order: VecDeque<SlabId> = VecDeque::new();
    let mut set: HashSet<SlabId> = HashSet::new();
    let mut bytes = 0;
    let (mut hits, mut total) = (0u64, 0u64);
    for token in trace {
        for (layer, experts) in token.iter().enumerate() {
            let step = slabs(layer as u32, experts);
            let in_step: HashSet<SlabId> = step.iter().copied().collect();
            for &id in &step {
                total += 1;
                if set.contains(&id) {
                    hits += 1;
                    if refresh {
                        order.retain(|&x| x != id);
                        order.push_back(id);
                    }
                    continue;
                }
                while bytes + cost(id) > budget {
                    let pos = order.iter().position(|x| !in_step.contains(x)).unwrap();
                    let v = order.remove(pos).unwrap();
                    set.remove(&v);
                    bytes -= cost(v);
                }
                order.push_back(id);
                set.insert(id);
                bytes += cost(id);
            }
        }
    }
    hits as f64 / total as f64
}

fn zipf_trace(tokens: usize, layers: u32, experts: u32, locality: f64, seed: u64) -> Vec<Vec<Vec<u32>>> {
    let mut r = ZipfRouter::new(layers, experts, 8, 1.0, locality, seed);
    (0..tokens).map(|_| r.next_token()).collect()
}

fn total_bytes(layers: u32, experts: u32) -> u64 {
    (0..layers).flat_map(|l| slabs(l, &(0..experts).collect::<Vec<_>>())).map(cost).sum()
}

#[test]
fn host_cache_lfu_beats_naive_bounds_on_zipf_with_locality() {
    let (layers, experts) = (4, 128);
    let trace = zipf_trace(3000, layers, experts, 0.3, 17);
    for frac in [0.1, 0.25, 0.5] {
        let budget = (total_bytes(layers, experts) as f64 * frac) as u64;
        let lfu = run_lfu(&trace, budget);
        let lru = run_recency(&trace, budget, true);
        let fifo = run_recency(&trace, budget, false);
        println!("host cache, budget {:>3.0}% of experts: LFU-DA {:.3}  LRU {:.3}  FIFO {:.3}  capacity fraction {:.3}", frac * 100.0, lfu, lru, fifo, frac);
        // A popularity-blind cache hits about its capacity fraction.
        assert!(lfu > frac + 0.15, "LFU {lfu} barely beats the capacity fraction {frac}");
        assert!(lfu > fifo, "LFU {lfu} <= FIFO {fifo}");
        assert!(lfu >= lru - 0.01, "LFU {lfu} worse than LRU {lru}");
    }
}

#[test]
fn host_cache_lfu_adapts_when_popularity_shifts() {
    // Two phases with different hot experts back to back: the second
    // phase's favourites must displace the first's about as fast as a
    // cache starting cold would fill with them.
    let (layers, experts) = (2, 128);
    let first = zipf_trace(3000, layers, experts, 0.2, 1);
    let second = zipf_trace(3000, layers, experts, 0.2, 2);
    let budget = total_bytes(layers, experts) / 4;
    let mut both = first.clone();
    both.extend(second.iter().cloned());
    // Phase-two hit rate = 2 x (rate over both) - (rate over phase one).
    let phase2 = 2.0 * run_lfu(&both, budget) - run_lfu(&first, budget);
    let cold = run_lfu(&second, budget);
    println!("popularity shift: phase-2 hit rate {phase2:.3}, cold start on phase 2 alone {cold:.3}");
    assert!(phase2 > cold - 0.04, "LFU stuck on old favourites: {phase2} vs cold {cold}");
}

struct HotSetRun {
    hit_rate: f64,
    admissions: u64,
}

/// Feed tokens (each layer one step) and measure hits on the `measured` part.
fn hot_steps(h: &mut HotSet, tokens: &[Vec<Vec<u32>>], measure: impl Fn(&SlabId) -> bool) -> HotSetRun {
    let before = h.counters().admissions;
    let (mut hits, mut total) = (0u64, 0u64);
    for token in tokens {
        for (layer, experts) in token.iter().enumerate() {
            let step = slabs(layer as u32, experts);
            for id in step.iter().filter(|id| measure(id)) {
                total += 1;
                hits += u64::from(h.slot_of(*id).is_some());
            }
            let decisions = h.step(&step);
            // Decisions must be consistent: each slot holds what was admitted.
            for d in &decisions {
                assert_eq!(h.occupancy()[d.slot as usize], Some(d.slab));
            }
            assert!(h.occupancy().iter().flatten().count() <= h.slots());
        }
    }
    HotSetRun { hit_rate: hits as f64 / total.max(1) as f64, admissions: h.counters().admissions - before }
}

/// Always-admit LRU hot set: the naive policy that thrashes under a scan.
fn lru_hot_admissions(slots: usize, tokens: &[Vec<Vec<u32>>]) -> u64 {
    let mut order: VecDeque<SlabId> = VecDeque::new();
    let mut admissions = 0;
    for token in tokens {
        for (layer, experts) in token.iter().enumerate() {
            for id in slabs(layer as u32, experts) {
                if let Some(p) = order.iter().position(|&x| x == id) {
                    order.remove(p);
                } else {
                    admissions += 1;
                    if order.len() == slots {
                        order.pop_front();
                    }
                }
                order.push_back(id);
            }
        }
    }
    admissions
}

#[test]
fn hot_set_serves_zipf_and_does_not_thrash_on_a_scan() {
    let (layers, experts) = (4u32, 64u32);
    let all = (layers * experts * 3) as usize;
    let slots = all / 4;
    let mut h = HotSet::new(HotSetConfig::new(slots));
    // One router throughout: the same experts stay popular.
    let trace = zipf_trace(3500, layers, experts, 0.3, 5);
    let base = hot_steps(&mut h, &trace[..2000], |_| true);
    let zipf_more = &trace[2000..];
    let steady = hot_steps(&mut h, &zipf_more[..500], |_| true);
    println!("hot set {slots}/{all} slots: Zipf hit rate {:.3} (warm-up {:.3}), {} admissions over 500 tokens", steady.hit_rate, base.hit_rate, steady.admissions);
    assert!(steady.hit_rate > 0.25 + 0.2, "hot set barely beats its slot fraction: {}", steady.hit_rate);

    // Adversarial scan mixed into live traffic: every token also sweeps the
    // experts in order (think: a prefill touching everything once).
    let scan: Vec<Vec<Vec<u32>>> = (0..500).map(|s| scan_token(s, layers, experts, 8)).collect();
    let mixed: Vec<Vec<Vec<u32>>> = zipf_more[500..1000]
        .iter()
        .zip(&scan)
        .map(|(z, s)| z.iter().zip(s).map(|(a, b)| a.iter().chain(b).copied().collect::<HashSet<u32>>().into_iter().collect()).collect())
        .collect();
    let residents_before: HashSet<SlabId> = h.occupancy().iter().flatten().copied().collect();
    let zipf_ids: Vec<HashSet<SlabId>> = zipf_more[500..1000].iter().map(|t| t.iter().enumerate().flat_map(|(l, e)| slabs(l as u32, e)).collect()).collect();
    let mut hits = 0u64;
    let mut total = 0u64;
    let before = h.counters().admissions;
    for (token, zset) in mixed.iter().zip(&zipf_ids) {
        for (layer, experts) in token.iter().enumerate() {
            let step = slabs(layer as u32, experts);
            for id in step.iter().filter(|id| zset.contains(id)) {
                total += 1;
                hits += u64::from(h.slot_of(*id).is_some());
            }
            h.step(&step);
        }
    }
    let mixed_admissions = h.counters().admissions - before;
    let mixed_hit = hits as f64 / total as f64;
    let kept = h.occupancy().iter().flatten().filter(|id| residents_before.contains(id)).count();
    let lru_adm = lru_hot_admissions(slots, &mixed);
    let touches: usize = mixed.iter().flatten().map(|e| e.len() * 3).sum();
    println!(
        "scan mixed in: Zipf-part hit rate {mixed_hit:.3} (steady {:.3}); admissions {mixed_admissions} of {touches} touches (always-admit LRU: {lru_adm}); {kept}/{slots} residents kept",
        steady.hit_rate
    );
    assert!(mixed_hit > steady.hit_rate - 0.1, "residents stopped serving under the scan");
    assert!(mixed_admissions * 20 < lru_adm, "admission thrashes: {mixed_admissions} vs LRU {lru_adm}");
    assert!(kept * 10 >= slots * 7, "scan flushed the hot set: kept {kept}/{slots}");

    // Pure scan: a burst of uniform traffic. At most about one turnover of the
    // pool, never a swap per touch.
    let before = h.counters().admissions;
    let pure: Vec<Vec<Vec<u32>>> = (500..1000).map(|s| scan_token(s, layers, experts, 8)).collect();
    hot_steps(&mut h, &pure, |_| true);
    let pure_adm = h.counters().admissions - before;
    let lru_pure = lru_hot_admissions(slots, &pure);
    println!("pure scan: {pure_adm} admissions (always-admit LRU: {lru_pure})");
    assert!(pure_adm <= slots as u64 + slots as u64 / 4, "pure scan thrashes: {pure_adm} admissions for {slots} slots");
}

#[test]
fn hot_set_warm_load_from_a_census_serves_from_the_first_step() {
    use pulsar_gguf::GgmlType;
    use pulsar_store::{Catalog, Census, SlabLoc};
    let (layers, experts) = (2u32, 64u32);
    let trace = zipf_trace(1500, layers, experts, 0.3, 8);
    let mut census = Census::new();
    for token in &trace[..1000] {
        for (l, es) in token.iter().enumerate() {
            for &e in es {
                census.record(l as u32, e, 1);
            }
        }
    }
    let loc = SlabLoc { file: 0, offset: 0, bytes: 34, ty: GgmlType::Q8_0, rows: 1, cols: 32 };
    let entries = (0..layers).flat_map(|l| slabs(l, &(0..experts).collect::<Vec<_>>())).map(|id| (id, loc)).collect();
    let cat = Catalog::new(vec!["m.gguf".into()], entries).unwrap();
    let slots = (layers * experts * 3 / 4 / 3) as usize;
    let mut warm = HotSet::new(HotSetConfig::new(slots));
    let placed = warm.warm_load(&cat, &census);
    assert_eq!(placed.len(), slots / 3 * 3, "whole triples fill the pool");
    let mut cold = HotSet::new(HotSetConfig::new(slots));
    // What the same hot set reaches after learning online from the census' tokens.
    let mut learned = HotSet::new(HotSetConfig::new(slots));
    hot_steps(&mut learned, &trace[..1000], |_| true);
    let w = hot_steps(&mut warm, &trace[1000..1020], |_| true);
    let c = hot_steps(&mut cold, &trace[1000..1020], |_| true);
    let l = hot_steps(&mut learned, &trace[1000..1020], |_| true);
    println!("first 20 tokens, {slots} slots: warm-loaded hit rate {:.3}, cold start {:.3}, learned online {:.3}", w.hit_rate, c.hit_rate, l.hit_rate);
    assert!(w.hit_rate > c.hit_rate + 0.05);
    assert!(w.hit_rate > l.hit_rate - 0.03, "warm load worse than learning online");
}

