//! End to end: the resolve API over generated shard files with a tiny host
//! budget gives exactly the bytes of the fully resident (mmap) mode, keeps
//! the budget at every step, and prefetches in the background.

mod common;

use std::sync::Arc;

use common::{write_model, Model};
use pulsar_store::sim::{SimRng, ZipfRouter};
use pulsar_store::{
    DiskReader, ExpertStore, PrefetchLimits, ReaderOptions, Selection, ShardBytes, SlabId, SlabKind, StoreConfig, StoreError, TripleBytes,
};

const KINDS: [SlabKind; 4] = [SlabKind::Gate, SlabKind::Up, SlabKind::Down, SlabKind::GateUp];

fn mapped(m: &Model) -> ExpertStore {
    let maps: Vec<Arc<dyn ShardBytes>> = m
        .catalog
        .files()
        .iter()
        .map(|p| {
            let f = std::fs::File::open(p).unwrap();
            Arc::new(unsafe { memmap2::Mmap::map(&f).unwrap() }) as Arc<dyn ShardBytes>
        })
        .collect();
    let cat = pulsar_store::Catalog::new(m.catalog.files().to_vec(), m.catalog.slabs().to_vec()).unwrap();
    ExpertStore::mapped(Arc::new(cat), maps).unwrap()
}

fn cached(m: &Model, budget: u64, prefetch: Option<PrefetchLimits>) -> ExpertStore {
    let cat = pulsar_store::Catalog::new(m.catalog.files().to_vec(), m.catalog.slabs().to_vec()).unwrap();
    let mut cfg = StoreConfig::new(budget);
    cfg.prefetch = prefetch;
    cfg.reader.max_read_bytes = 4096; // several pieces per slab
    ExpertStore::open(Arc::new(cat), cfg).unwrap()
}

/// Cache bytes of the largest `k` triples of any layer: one step's worth.
fn step_cost(m: &Model, k: usize) -> u64 {
    let r = DiskReader::open(&m.catalog, &ReaderOptions::default()).unwrap();
    m.catalog
        .layers()
        .map(|l| {
            let mut v: Vec<u64> = m.catalog.experts(l).map(|e| m.catalog.triple(l, e).unwrap().slabs().map(|id| r.buffer_len(m.catalog.get(id).unwrap().bytes) as u64).sum()).collect();
            v.sort_unstable_by(|a, b| b.cmp(a));
            v.iter().take(k).sum::<u64>()
        })
        .max()
        .unwrap()
}

fn selections(experts: &[u32]) -> Vec<Selection> {
    experts.iter().enumerate().map(|(slot, &expert)| Selection { token: 0, slot: slot as u32, expert }).collect()
}

#[test]
fn tiny_budget_gives_the_same_bytes_as_resident_mode_and_keeps_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (layers, experts) = (4u32, 32u32);
    let m = write_model(dir.path(), layers, experts, 40, 2, 99);
    // Room for one step of 8 experts plus a little: constant eviction.
    let budget = step_cost(&m, 8) * 5 / 4;
    let store = cached(&m, budget, Some(PrefetchLimits { max_requests: 24, max_bytes: budget / 2 }));
    let reference = mapped(&m);
    let mut router = ZipfRouter::new(layers, experts, 8, 1.0, 0.3, 5);
    let mut rng = SimRng::new(77);
    for token in 0..150 {
        let routes = router.next_token();
        for layer in 0..layers {
            let sel = selections(&routes[layer as usize]);
            let got = store.resolve(layer, &sel).unwrap();
            let want = reference.resolve(layer, &sel).unwrap();
            for kind in KINDS {
                assert_eq!(got.per_selection(kind), want.per_selection(kind), "token {token} layer {layer} {kind:?}");
            }
            for s in &sel {
                // And against the file itself.
                for id in m.catalog.triple(layer, s.expert).unwrap().slabs() {
                    assert_eq!(got.slab(id).unwrap(), m.bytes(id), "{id}");
                }
                match got.triple(s.expert).unwrap() {
                    TripleBytes::Separate { gate, .. } => assert_eq!(gate, m.bytes(SlabId::new(layer, SlabKind::Gate, s.expert))),
                    TripleBytes::Fused { gate_up, .. } => assert_eq!(gate_up, m.bytes(SlabId::new(layer, SlabKind::GateUp, s.expert))),
                }
            }
            assert!(got.pointers(SlabKind::Down).iter().all(|p| !p.is_null()));
            let c = store.stats().cache.unwrap();
            assert!(c.held_bytes <= budget && c.peak_held_bytes <= budget, "budget exceeded: {c:?}");
            drop(got);
            // Predict the next layer: right half the time, random otherwise.
            if layer + 1 < layers {
                let next: Vec<u32> = if token % 2 == 0 { routes[layer as usize + 1].clone() } else { (0..8).map(|_| rng.below(experts as u64) as u32).collect() };
                store.prefetch(layer + 1, &next);
            }
        }
        if token % 10 == 0 {
            store.wait_prefetch_idle();
        }
    }
    store.wait_prefetch_idle();
    let s = store.stats();
    println!("{}", serde_json::to_string_pretty(&s).unwrap());
    let t = s.total;
    assert_eq!(s.steps, 150 * layers as u64);
    assert!(t.disk.slabs > 0 && t.host.slabs > 0, "{t:?}");
    assert!(t.host_prefetched.slabs > 0, "prefetch never helped: {:?}", s.prefetch);
    assert!(s.prefetch.read > 0 && s.prefetch.predicted > 0);
    // Half the predictions are exact, half random: precision in between.
    let p = s.prefetch.precision();
    assert!(p > 0.5 && p < 1.0, "precision {p}");
    assert!(s.cache.unwrap().peak_held_bytes <= budget);
    assert_eq!(store.census().total(), 150 * layers as u64 * 8);
    assert_eq!(reference.stats().total.mapped.slabs, t.host.slabs + t.disk.slabs);
}

#[test]
fn a_step_bigger_than_the_budget_is_an_error_and_the_store_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), 1, 16, 40, 1, 3);
    let budget = step_cost(&m, 2);
    let store = cached(&m, budget, None);
    let err = store.resolve(0, &selections(&[0, 1, 2, 3, 4, 5, 6, 7])).err().expect("8 experts cannot fit");
    assert!(matches!(err, StoreError::StepOverBudget { layer: 0, .. }), "{err}");
    // Nothing stays pinned or reserved after the failure.
    let g = store.resolve(0, &selections(&[9, 10])).unwrap();
    assert_eq!(g.slab(SlabId::new(0, SlabKind::Up, 10)).unwrap(), m.bytes(SlabId::new(0, SlabKind::Up, 10)));
    drop(g);
    let g = store.resolve(0, &selections(&[3])).unwrap();
    assert_eq!(g.experts(), &[3]);
    assert!(store.stats().cache.unwrap().peak_held_bytes <= budget);
}

#[test]
fn a_slab_larger_than_the_whole_budget_is_an_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), 1, 4, 40, 1, 4);
    let store = cached(&m, 1000, Some(PrefetchLimits::default()));
    store.prefetch(0, &[1]);
    store.wait_prefetch_idle();
    let err = store.resolve(0, &selections(&[1])).err().unwrap();
    assert!(matches!(err, StoreError::SlabOverBudget { budget: 1000, .. }), "{err}");
    assert!(err.to_string().contains("blk.0.ffn_gate_exps[1]"), "{err}");
    assert_eq!(store.stats().prefetch.failed, 3);
}

#[test]
fn a_read_failure_surfaces_from_resolve_and_never_yields_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), 2, 8, 40, 1, 5);
    let store = cached(&m, 1 << 20, None);
    // Truncate the shard under the open store: the tail slabs now hit EOF.
    let last = m.catalog.slabs().iter().max_by_key(|e| e.1.offset).unwrap().0;
    let loc = *m.catalog.get(last).unwrap();
    std::fs::OpenOptions::new().write(true).open(&m.catalog.files()[0]).unwrap().set_len(loc.offset + 10).unwrap();
    for _ in 0..2 {
        let err = store.resolve(last.layer, &selections(&[last.expert])).err().expect("truncated slab must fail");
        assert!(matches!(&err, StoreError::UnexpectedEof { slab, .. } if *slab == last), "{err}");
        assert!(err.to_string().contains("model-00000.gguf"), "{err}");
    }
    // Other slabs still resolve.
    let ok = store.resolve(0, &selections(&[0])).unwrap();
    assert_eq!(ok.slab(SlabId::new(0, SlabKind::Down, 0)).unwrap(), m.bytes(SlabId::new(0, SlabKind::Down, 0)));
}

#[test]
fn experts_placed_elsewhere_are_not_loaded_and_point_to_null() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), 1, 8, 40, 1, 6);
    for store in [cached(&m, 1 << 20, None), mapped(&m)] {
        let sel = vec![
            Selection { token: 0, slot: 0, expert: 1 },
            Selection { token: 0, slot: 1, expert: 6 },
            Selection { token: 1, slot: 0, expert: 6 },
            Selection { token: 1, slot: 1, expert: 2 },
        ];
        let g = store.resolve_with(0, &sel, &|e| e != 6).unwrap();
        assert_eq!(g.experts(), &[1, 2]);
        let ptrs = g.pointers(SlabKind::Gate);
        assert_eq!(ptrs.iter().map(|p| p.is_null()).collect::<Vec<_>>(), vec![false, true, true, false]);
        assert_eq!(g.per_selection(SlabKind::Gate)[3].unwrap(), m.bytes(SlabId::new(0, SlabKind::Gate, 2)));
        assert!(g.slab(SlabId::new(0, SlabKind::Gate, 6)).is_none());
        assert_eq!(g.stats().tiers.elsewhere.slabs, 3);
        assert_eq!(store.census().count(0, 6), 2, "routing census counts every selection");
        let err = store.resolve(0, &selections(&[99])).err().unwrap();
        assert!(matches!(err, StoreError::UnknownExpert { layer: 0, expert: 99 }));
    }
}

#[test]
fn mapped_mode_validates_its_shards() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), 1, 4, 40, 2, 7);
    let cat = Arc::new(pulsar_store::Catalog::new(m.catalog.files().to_vec(), m.catalog.slabs().to_vec()).unwrap());
    let one: Vec<Arc<dyn ShardBytes>> = vec![Arc::new(m.contents[0].clone())];
    assert!(matches!(ExpertStore::mapped(cat.clone(), one), Err(StoreError::ShardCount { expected: 2, got: 1 })));
    let short: Vec<Arc<dyn ShardBytes>> = vec![Arc::new(m.contents[0].clone()), Arc::new(m.contents[1][..100].to_vec())];
    assert!(matches!(ExpertStore::mapped(cat, short), Err(StoreError::SlabPastEof { .. })));
}

#[test]
fn prefetch_is_capped_by_requests_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), 2, 16, 40, 1, 8);
    let one = step_cost(&m, 1) / 3; // about one slab
    // Cap by requests: one call on an empty queue queues exactly the cap.
    let s = cached(&m, 1 << 22, Some(PrefetchLimits { max_requests: 4, max_bytes: u64::MAX }));
    assert_eq!(s.prefetch(0, &[0, 1, 2, 3, 4, 5, 6, 7]), 4);
    assert_eq!(s.stats().prefetch.dropped, 20);
    s.wait_prefetch_idle();
    assert_eq!(s.stats().prefetch.read, 4);
    // Resident slabs are skipped, not queued again.
    assert_eq!(s.prefetch(0, &[0]), 0);
    assert!(s.stats().prefetch.skipped >= 3);
    // Cap by bytes.
    let s = cached(&m, 1 << 22, Some(PrefetchLimits { max_requests: 1000, max_bytes: 2 * one + one / 2 }));
    assert_eq!(s.prefetch(0, &[0, 1, 2, 3]), 2);
    s.wait_prefetch_idle();
    // Prefetched slabs are served from the cache and counted as such.
    let g = s.resolve(0, &selections(&[0])).unwrap();
    assert_eq!(g.stats().tiers.host_prefetched.slabs, 2);
    assert_eq!(g.slab(SlabId::new(0, SlabKind::Gate, 0)).unwrap(), m.bytes(SlabId::new(0, SlabKind::Gate, 0)));
}

#[test]
fn prediction_accuracy_is_scored_against_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), 2, 16, 40, 1, 9);
    for store in [cached(&m, 1 << 22, Some(PrefetchLimits::default())), cached(&m, 1 << 22, None), mapped(&m)] {
        store.prefetch(0, &[1, 2, 3, 4, 4, 99]); // duplicates and unknown experts ignored
        store.wait_prefetch_idle();
        drop(store.resolve(0, &selections(&[3, 4, 5])).unwrap());
        // A layer without a prediction does not count.
        drop(store.resolve(1, &selections(&[3])).unwrap());
        let p = store.stats().prefetch;
        assert_eq!((p.predicted, p.predicted_used, p.used), (4, 2, 3), "{p:?}");
        assert!((p.precision() - 0.5).abs() < 1e-9 && (p.recall() - 2.0 / 3.0).abs() < 1e-9);
    }
}

#[test]
fn concurrent_steps_and_prefetch_share_one_small_cache() {
    fn assert_sync<T: Send + Sync>() {}
    assert_sync::<ExpertStore>();
    let dir = tempfile::tempdir().unwrap();
    let (layers, experts) = (3u32, 24u32);
    let m = write_model(dir.path(), layers, experts, 40, 2, 10);
    let budget = step_cost(&m, 8) * 3;
    let store = cached(&m, budget, Some(PrefetchLimits { max_requests: 48, max_bytes: budget }));
    std::thread::scope(|s| {
        for seed in 0..2u64 {
            let (store, m) = (&store, &m);
            s.spawn(move || {
                let mut router = ZipfRouter::new(layers, experts, 8, 1.0, 0.2, 40 + seed);
                for _ in 0..60 {
                    let routes = router.next_token();
                    for layer in 0..layers {
                        if layer + 1 < layers {
                            store.prefetch(layer + 1, &routes[layer as usize + 1]);
                        }
                        let g = store.resolve(layer, &selections(&routes[layer as usize])).unwrap();
                        for &e in g.experts() {
                            for id in m.catalog.triple(layer, e).unwrap().slabs() {
                                assert_eq!(g.slab(id).unwrap(), m.bytes(id), "{id}");
                            }
                        }
                    }
                }
            });
        }
    });
    store.wait_prefetch_idle();
    let c = store.stats().cache.unwrap();
    assert!(c.peak_held_bytes <= budget, "{c:?}");
    assert_eq!(store.stats().steps, 2 * 60 * layers as u64);
}

#[test]
fn streaming_resolve_hands_over_every_slab_once_with_its_bytes_and_stops_on_a_consumer_error() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), 2, 8, 40, 1, 9);
    // A budget of a few triples: the second step mixes host-cache hits and disk reads.
    for store in [cached(&m, step_cost(&m, 6), None), mapped(&m)] {
        for experts in [vec![1u32, 3, 5], vec![3, 5, 7, 0]] {
            let mut seen: Vec<(SlabId, Vec<u8>)> = Vec::new();
            let g = store
                .resolve_streaming(1, &selections(&experts), &|_| true, &mut |id, b| {
                    seen.push((id, b.to_vec()));
                    Ok(())
                })
                .unwrap();
            let mut ids: Vec<SlabId> = seen.iter().map(|s| s.0).collect();
            ids.sort_unstable();
            let n = ids.len();
            ids.dedup();
            assert_eq!(ids.len(), n, "each slab handed over once");
            let want: usize = experts.iter().map(|&e| store.catalog().triple(1, e).unwrap().slabs().count()).sum();
            assert_eq!(n, want);
            for (id, b) in &seen {
                assert_eq!(g.slab(*id).unwrap(), &b[..], "{id}: the guard's bytes");
                assert_eq!(&b[..], m.bytes(*id), "{id}: the file's bytes");
            }
        }
        let mut calls = 0;
        let err = store
            .resolve_streaming(0, &selections(&[2, 4]), &|_| true, &mut |_, _| {
                calls += 1;
                Err("the GPU is gone".into())
            })
            .err()
            .unwrap();
        assert_eq!(calls, 1, "the first failure ends the step");
        assert!(matches!(err, StoreError::Consumer { .. }), "{err}");
        // The store still serves the same slabs afterwards.
        let ok = store.resolve(0, &selections(&[2, 4])).unwrap();
        assert_eq!(ok.slab(SlabId::new(0, SlabKind::Down, 4)).unwrap(), m.bytes(SlabId::new(0, SlabKind::Down, 4)));
    }
}
