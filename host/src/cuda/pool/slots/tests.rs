//! The slot book without a GPU: where each slab of a fill lands, what the
//! prefetch leaves where, and the numbers the pool steers by.
//!
//! The fixture: 8 experts a layer, 48 slots of 1 KiB: 24 hot, 24 scratch
//! (slots 24..48). With prefetch on, a decode step's window is 12 slots:
//! 24..36 on even layers, 36..48 on odd ones. Heat never decays (infinite
//! half-life), so a slab touched as often as the residents never displaces
//! one, and one touched twice always does (the admission margin is 25%).

use super::*;

const SLOT: usize = 1024;
const K: [SlabKind; 3] = [SlabKind::Gate, SlabKind::Up, SlabKind::Down];
/// The slots' device address in these tests.
const BASE: u64 = 0x7000_0000;
/// A slab's host bytes (every slab alike).
static SLAB: [u8; 512] = [0; 512];

type Bytes<'b> = &'b dyn Fn(usize, u32) -> Result<&'b [u8], String>;

fn book() -> SlotBook {
    SlotBook::new(SLOT, 48, 8, f64::INFINITY).unwrap()
}

fn req<'a>(layer: u32, experts: &'a [u32], decode: bool) -> LayerRequest<'a> {
    LayerRequest { layer, kinds: K, experts, touched: experts, zero_copy: &[], cpu: &[], heads: &[], decode }
}

fn slab_bytes(_: usize, _: u32) -> Result<&'static [u8], String> {
    Ok(&SLAB)
}

fn id(layer: u32, ki: usize, e: u32) -> SlabId {
    SlabId::new(layer, K[ki], e)
}

/// A book whose hot set is full of layer 0's eight experts (all 24 hot
/// slots), with decode prefetch on or off.
fn warmed(prefetch: bool) -> (SlotBook, PoolStats) {
    let (mut b, mut st) = (book(), PoolStats::default());
    if prefetch {
        b.enable_prefetch(2, true);
    }
    let all: Vec<u32> = (0..8).collect();
    b.plan_layer(&req(0, &all, true), &mut st);
    assert_eq!(st.admissions, 24);
    (b, st)
}

/// A fill as `ExpertPool::assign_layer` runs it, minus the device: every
/// slab's place, kind-major (gate of each expert, then up, then down).
fn fill<'b>(b: &mut SlotBook, r: &LayerRequest<'_>, bytes: Option<Bytes<'b>>, zc: &dyn Fn(&[u8]) -> Option<u64>, st: &mut PoolStats) -> Result<Vec<Place<'b>>, CudaBackendError> {
    b.begin_fill(r);
    let mut out = Vec::new();
    for ki in 0..3 {
        for &e in r.experts {
            out.push(b.place(r, ki, e, bytes, zc, st)?);
        }
    }
    Ok(out)
}

fn no_zero_copy(_: &[u8]) -> Option<u64> {
    None
}

/// A fill with bytes at hand and nothing registered for zero-copy.
fn fill_all(b: &mut SlotBook, r: &LayerRequest<'_>, st: &mut PoolStats) -> Vec<Place<'static>> {
    fill(b, r, Some(&slab_bytes), &no_zero_copy, st).unwrap()
}

/// A prefetch as `ExpertPool::prefetch_layer` runs it, minus the device,
/// every slab's bytes page-locked (`len` each): the (slab, slot) copied.
fn prefetch(b: &mut SlotBook, layer: u32, decode: bool, experts: &[u32], lane: &[(u32, LaneShare)], len: usize, st: &mut PoolStats) -> Vec<(SlabId, usize)> {
    let mut out = Vec::new();
    let Some((copied, cap)) = b.begin_prefetch(layer, decode, experts, lane, true) else {
        return out;
    };
    'outer: for &(e, head_bytes) in &copied {
        for ki in 0..3 {
            let slot = match b.ahead_slot(id(layer, ki, e), cap) {
                AheadSlot::Skip => continue,
                AheadSlot::Full => break 'outer,
                AheadSlot::Slot(s) => s,
            };
            let head = head_len(ki, head_bytes, len);
            b.add_ahead(id(layer, ki, e), Ahead { slot, len, head }, st);
            out.push((id(layer, ki, e), slot));
        }
    }
    out
}

fn scratch_slots(p: &[Place<'_>]) -> Vec<usize> {
    p.iter()
        .map(|p| match p {
            Place::Scratch { slot } => *slot,
            other => panic!("not a scratch slot: {other:?}"),
        })
        .collect()
}

#[test]
fn admitted_slabs_upload_into_their_hot_slot_then_hit() {
    let (mut b, mut st) = (book(), PoolStats::default());
    let r = req(3, &[1, 4], true);
    let plan = b.plan_layer(&r, &mut st);
    // Admitted slabs need their bytes, but they are not cold.
    assert_eq!((plan.need, plan.cold), (vec![1, 4], vec![]));
    assert_eq!(st.admissions, 6);
    let first = fill_all(&mut b, &r, &mut st);
    let mut slots = Vec::new();
    for (i, p) in first.iter().enumerate() {
        let s = b.hot.slot_of(id(3, i / 2, r.experts[i % 2])).unwrap() as usize;
        assert_eq!(*p, Place::Upload { slot: s });
        assert!(s < 24, "hot slot {s}");
        slots.push(s);
    }
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), 6);
    assert_eq!(st.hits, 0);
    // The next step finds them all in place: nothing to read.
    let plan = b.plan_layer(&r, &mut st);
    assert!(plan.need.is_empty() && plan.cold.is_empty());
    let second = fill_all(&mut b, &r, &mut st);
    for (p, q) in first.iter().zip(&second) {
        let Place::Upload { slot } = *p else { unreachable!() };
        assert_eq!(*q, Place::Hit { slot });
        assert_eq!(b.addr(BASE, *q), BASE + (slot * SLOT) as u64);
    }
    assert_eq!((st.hits, st.admissions), (6, 6));
}

#[test]
fn windows_by_parity_with_prefetch_and_by_direction_without() {
    let mut b = book();
    b.enable_prefetch(2, true);
    let slots = |w: Window| (0..w.cap).map(|i| w.slot(i)).collect::<Vec<_>>();
    // Decode with prefetch: halves by layer parity, both bottom-up.
    assert_eq!(slots(b.window(true, 4)), (24..36).collect::<Vec<_>>());
    assert_eq!(slots(b.window(true, 5)), (36..48).collect::<Vec<_>>());
    // Prefill: all 24, even layers up, odd layers down.
    assert_eq!(slots(b.window(false, 4)), (24..48).collect::<Vec<_>>());
    assert_eq!(slots(b.window(false, 5)), (24..48).rev().collect::<Vec<_>>());
    // Decode without prefetch uses the whole scratch, as prefill does.
    let off = book();
    assert_eq!(slots(off.window(true, 5)), (24..48).rev().collect::<Vec<_>>());
    assert_eq!(slots(off.window(true, 4)), (24..48).collect::<Vec<_>>());
}

#[test]
fn cold_slabs_take_their_window_in_order() {
    let (mut b, mut st) = warmed(true);
    let mut cold = |b: &mut SlotBook, layer: u32, decode: bool| {
        let r = req(layer, &[2, 5], decode);
        let plan = b.plan_layer(&r, &mut st);
        assert_eq!((plan.need, plan.cold), (vec![2, 5], vec![2, 5]));
        let p = fill_all(b, &r, &mut st);
        assert_eq!(b.addr(BASE, p[0]), b.slot_addr(BASE, scratch_slots(&p)[0]));
        scratch_slots(&p)
    };
    // (A layer each: touched twice, a slab would be admitted.)
    assert_eq!(cold(&mut b, 1, true), vec![36, 37, 38, 39, 40, 41]);
    assert_eq!(cold(&mut b, 2, true), vec![24, 25, 26, 27, 28, 29]);
    assert_eq!(cold(&mut b, 3, false), vec![47, 46, 45, 44, 43, 42]);
    assert_eq!(cold(&mut b, 4, false), vec![24, 25, 26, 27, 28, 29]);
    assert_eq!(st.admissions, 24, "equal heat displaced a resident");
}

#[test]
fn a_prefetched_slab_moves_into_its_admitted_hot_slot() {
    let (mut b, mut st) = warmed(true);
    let ahead = prefetch(&mut b, 1, true, &[5], &[], 300, &mut st);
    assert_eq!(ahead.iter().map(|a| a.1).collect::<Vec<_>>(), vec![36, 37, 38]);
    assert_eq!(st.prefetched, 3);
    // Touched twice: hotter than the residents, so admitted.
    let r = LayerRequest { touched: &[5, 5], ..req(1, &[5], true) };
    let plan = b.plan_layer(&r, &mut st);
    assert!(plan.need.is_empty(), "prefetched slabs need no host bytes: {plan:?}");
    let p = fill_all(&mut b, &r, &mut st);
    for (ki, p) in p.iter().enumerate() {
        let to = b.hot.slot_of(id(1, ki, 5)).expect("admitted") as usize;
        assert_eq!(*p, Place::Move { from: 36 + ki, to, len: 300, head: None });
        assert_eq!(b.addr(BASE, *p), b.slot_addr(BASE, to));
    }
    assert_eq!((st.prefetch_hits, st.hits), (3, 0));
}

#[test]
fn a_prefetched_slab_not_admitted_is_read_in_scratch() {
    let (mut b, mut st) = warmed(true);
    prefetch(&mut b, 1, true, &[5], &[], 300, &mut st);
    let r = req(1, &[5], true);
    assert!(b.plan_layer(&r, &mut st).need.is_empty());
    let p = fill_all(&mut b, &r, &mut st);
    assert_eq!(p, (36..39).map(|slot| Place::Ahead { slot, head: None }).collect::<Vec<_>>());
    assert_eq!(st.prefetch_hits, 3);
    // A prefill step does not use a decode step's prefetch.
    prefetch(&mut b, 3, true, &[5], &[], 300, &mut st);
    let r = req(3, &[5], false);
    assert_eq!(b.plan_layer(&r, &mut st).need, vec![5]);
    assert_eq!(scratch_slots(&fill_all(&mut b, &r, &mut st)), vec![47, 46, 45]);
}

#[test]
fn heads_left_to_the_lane_are_completed_only_where_the_lane_does_not_compute_them() {
    let lane = [(6, LaneShare::Head { rows: 2, bytes: 100 })];
    let pf = || {
        let (mut b, mut st) = warmed(true);
        prefetch(&mut b, 1, true, &[6], &lane, 300, &mut st);
        (b, st)
    };
    // The lane computes the heads: gate and up are read as prefetched.
    let (mut b1, mut st1) = pf();
    assert_eq!(b1.heads_ready(1, K, &[6]), vec![(6, 2)]);
    let r = LayerRequest { heads: &[6], ..req(1, &[6], true) };
    let plan = b1.plan_layer(&r, &mut st1);
    assert!(plan.need.is_empty() && plan.cold.is_empty(), "{plan:?}");
    let p = fill_all(&mut b1, &r, &mut st1);
    assert_eq!(p, (36..39).map(|slot| Place::Ahead { slot, head: None }).collect::<Vec<_>>());
    // It does not: the head bytes (gate and up only) complete the slabs.
    let (mut b2, mut st2) = pf();
    let r = req(1, &[6], true);
    b2.plan_layer(&r, &mut st2);
    let p = fill_all(&mut b2, &r, &mut st2);
    assert_eq!(p[0], Place::Ahead { slot: 36, head: Some(&SLAB[..100]) });
    assert_eq!(p[1], Place::Ahead { slot: 37, head: Some(&SLAB[..100]) });
    assert_eq!(p[2], Place::Ahead { slot: 38, head: None });
    // Without bytes at hand, a headless slab is copied whole instead.
    let (mut b3, mut st3) = pf();
    b3.plan_layer(&r, &mut st3);
    b3.begin_fill(&r);
    let p = b3.place(&r, 0, 6, None, no_zero_copy, &mut st3).unwrap();
    assert!(matches!(p, Place::Scratch { .. }), "{p:?}");
    // Admitted: the hot set takes it whole, head fixed after the move,
    // though the lane was to compute the heads; its host bytes are needed.
    let (mut b4, mut st4) = pf();
    let r = LayerRequest { touched: &[6, 6], heads: &[6], ..req(1, &[6], true) };
    let plan = b4.plan_layer(&r, &mut st4);
    assert_eq!((plan.need, plan.cold), (vec![6], vec![]));
    assert!(b4.heads_ready(1, K, &[6]).is_empty(), "admitted heads left to the lane");
    let p = fill_all(&mut b4, &r, &mut st4);
    let to = |ki| b4.hot.slot_of(id(1, ki, 6)).unwrap() as usize;
    assert_eq!(p[0], Place::Move { from: 36, to: to(0), len: 300, head: Some(&SLAB[..100]) });
    assert_eq!(p[2], Place::Move { from: 38, to: to(2), len: 300, head: None });
}

#[test]
fn the_fill_scratch_starts_after_the_layers_prefetch() {
    let (mut b, mut st) = warmed(true);
    prefetch(&mut b, 1, true, &[5], &[], 300, &mut st);
    let r = req(1, &[2, 5], true);
    b.plan_layer(&r, &mut st);
    let p = fill_all(&mut b, &r, &mut st);
    let cold: Vec<Place<'_>> = p.iter().step_by(2).copied().collect();
    assert_eq!(scratch_slots(&cold), vec![39, 40, 41]);
    // Another layer's prefetch does not hold slots back.
    prefetch(&mut b, 3, true, &[5], &[], 300, &mut st);
    let r = req(1, &[3], true);
    b.plan_layer(&r, &mut st);
    assert_eq!(scratch_slots(&fill_all(&mut b, &r, &mut st)), vec![36, 37, 38]);
}

#[test]
fn the_cpu_lane_gets_a_null_pointer_only_for_slabs_not_hot() {
    let (mut b, mut st) = warmed(false);
    let r = LayerRequest { cpu: &[1], ..req(0, &[1], true) };
    b.plan_layer(&r, &mut st);
    assert!(fill_all(&mut b, &r, &mut st).iter().all(|p| matches!(p, Place::Hit { .. })));
    assert_eq!(st.cpu_lane, 0);
    let r = LayerRequest { cpu: &[2], ..req(1, &[2, 3], true) };
    b.plan_layer(&r, &mut st);
    let p = fill_all(&mut b, &r, &mut st);
    for ki in 0..3 {
        assert_eq!(p[2 * ki], Place::Lane);
        assert_eq!(b.addr(BASE, p[2 * ki]), 0);
        assert!(matches!(p[2 * ki + 1], Place::Scratch { .. }));
    }
    // The lane's slabs take no scratch slot.
    assert_eq!(scratch_slots(&[p[1], p[3], p[5]]), vec![47, 46, 45]);
    assert_eq!(st.cpu_lane, 3);
}

#[test]
fn zero_copy_only_when_requested_and_registered() {
    let (mut b, mut st) = warmed(false);
    let registered = |bytes: &[u8]| Some(0xF000_0000 + bytes.len() as u64);
    let r = LayerRequest { zero_copy: &[2], ..req(1, &[2, 3], true) };
    b.plan_layer(&r, &mut st);
    let p = fill(&mut b, &r, Some(&slab_bytes), &registered, &mut st).unwrap();
    for ki in 0..3 {
        assert_eq!(p[2 * ki], Place::ZeroCopy { addr: 0xF000_0000 + 512 });
        assert_eq!(b.addr(BASE, p[2 * ki]), 0xF000_0000 + 512);
        assert!(matches!(p[2 * ki + 1], Place::Scratch { .. }), "not requested: {:?}", p[2 * ki + 1]);
    }
    assert_eq!((st.zero_copy, st.zero_copy_bytes), (3, 3 * 512));
    // Not registered, or no bytes to look at: uploaded to scratch.
    let p = fill(&mut b, &r, Some(&slab_bytes), &no_zero_copy, &mut st).unwrap();
    assert_eq!(scratch_slots(&p).len(), 6);
    let p = fill(&mut b, &r, None, &registered, &mut st).unwrap();
    assert_eq!(scratch_slots(&p).len(), 6);
    assert_eq!(st.zero_copy, 3);
}

#[test]
fn too_many_cold_slabs_for_the_window_is_an_error() {
    let (mut b, mut st) = warmed(true);
    // Four cold experts fill the 12-slot decode window exactly.
    let r = req(1, &[1, 2, 3, 4], true);
    b.plan_layer(&r, &mut st);
    assert_eq!(scratch_slots(&fill_all(&mut b, &r, &mut st)), (36..48).collect::<Vec<_>>());
    let r = req(3, &[1, 2, 3, 4, 5], true);
    b.plan_layer(&r, &mut st);
    let e = fill(&mut b, &r, Some(&slab_bytes), &no_zero_copy, &mut st).unwrap_err();
    assert_eq!(e.to_string(), "layer 3: 13 cold slabs in one step exceed the 12 scratch slots; raise --vram-budget");
}

#[test]
fn an_expert_past_the_layers_count_is_an_error() {
    let (mut b, mut st) = (book(), PoolStats::default());
    let r = req(2, &[3, 8], true);
    b.begin_fill(&r);
    assert!(b.place(&r, 0, 3, None, no_zero_copy, &mut st).is_ok());
    let e = b.place(&r, 1, 8, None, no_zero_copy, &mut st).unwrap_err();
    assert_eq!(e.to_string(), "layer 2: expert 8 of 8");
}

#[test]
fn no_scratch_room_is_an_error() {
    let e = SlotBook::new(SLOT, 1, 8, 512.0).err().expect("one slot leaves no scratch");
    assert_eq!(e.to_string(), "the VRAM budget leaves no room for a single expert slab");
    let b = SlotBook::new(SLOT, 10, 2, 512.0).unwrap();
    assert_eq!((b.n_hot(), b.n_slots()), (5, 10));
    let b = SlotBook::new(SLOT, 100, 2, 512.0).unwrap();
    assert_eq!((b.n_hot(), b.n_slots()), (94, 100));
}

#[test]
fn plan_needs_admitted_and_cold_slabs_not_prefetched_ones() {
    let (mut b, mut st) = warmed(true);
    // 0 is hot; 5 prefetched whole; 6 prefetched without its heads; 2 cold.
    let lane = [(6, LaneShare::Head { rows: 2, bytes: 100 })];
    prefetch(&mut b, 1, true, &[5, 6], &lane, 300, &mut st);
    let plan = b.plan_layer(&req(1, &[2, 5, 6], true), &mut st);
    assert_eq!((plan.need, plan.cold), (vec![2], vec![2]));
    assert!(b.plan_layer(&req(0, &[0, 3], true), &mut st).need.is_empty());
    // Two hot slots for a triple: two slabs admitted, the third cold. The
    // expert needs bytes (then for its cold slab only) but is not cold.
    let mut b = SlotBook::new(SLOT, 4, 8, f64::INFINITY).unwrap();
    assert_eq!(b.n_hot(), 2);
    let r = req(0, &[1], true);
    for _ in 0..2 {
        let plan = b.plan_layer(&r, &mut st);
        assert_eq!((plan.need, plan.cold), (vec![1], vec![]));
    }
    let p = fill_all(&mut b, &r, &mut st);
    assert!(matches!(p[..], [Place::Hit { .. }, Place::Hit { .. }, Place::Scratch { slot: 2 }]), "{p:?}");
}

#[test]
fn prefetch_pays_on_a_moving_average_of_copies() {
    let mut b = book();
    assert!(!b.prefetch_pays(), "off by default");
    b.enable_prefetch(5, true);
    assert!(!b.prefetch_enabled(), "two windows of 15 slabs do not fit 24");
    b.enable_prefetch(2, false);
    assert!(!b.prefetch_enabled(), "nothing page-locked to copy from");
    b.enable_prefetch(4, true);
    assert!(b.prefetch_enabled() && b.prefetch_pays(), "pays until measured");
    b.note_copied(1.0); // the first sample replaces the start
    assert!(!b.prefetch_pays());
    b.note_copied(10.0); // 0.9 + 1.0
    assert!(!b.prefetch_pays());
    b.note_copied(3.0); // 1.71 + 0.3
    assert!(b.prefetch_pays());
}

#[test]
fn heads_and_lane_reservations_only_for_the_prefetched_decode_layer() {
    let (mut b, mut st) = warmed(true);
    let lane = [(6, LaneShare::Head { rows: 2, bytes: 100 }), (4, LaneShare::Whole)];
    let copied = prefetch(&mut b, 1, true, &[4, 6, 7], &lane, 300, &mut st);
    assert!(copied.iter().all(|c| c.0.expert != 4), "the lane's whole expert was copied");
    assert_eq!(copied.len(), 6);
    assert_eq!(b.lane_reserved(1), &[4]);
    assert_eq!(b.heads_ready(1, K, &[4, 6, 7]), vec![(6, 2)]);
    assert!(b.heads_ready(1, K, &[7]).is_empty());
    assert!(b.lane_reserved(3).is_empty() && b.heads_ready(3, K, &[6]).is_empty());
    // The reserved expert takes the lane's null pointer when it comes.
    let reserved = b.lane_reserved(1).to_vec();
    let r = LayerRequest { cpu: &reserved, ..req(1, &[4], true) };
    assert_eq!(b.plan_layer(&r, &mut st).need, vec![4]);
    assert_eq!(fill_all(&mut b, &r, &mut st), vec![Place::Lane; 3]);
    // A prefill prefetch reserves nothing for the lane.
    prefetch(&mut b, 1, false, &[4, 6], &lane, 300, &mut st);
    assert!(b.lane_reserved(1).is_empty() && b.heads_ready(1, K, &[4, 6]).is_empty());
    // Nor does a decode prefetch once another layer's plan dropped it.
    prefetch(&mut b, 1, true, &[4, 6], &lane, 300, &mut st);
    b.plan_layer(&req(2, &[1], true), &mut st);
    assert!(b.lane_reserved(1).is_empty() && b.heads_ready(1, K, &[4, 6]).is_empty());
}

#[test]
fn prefill_prefetch_takes_what_the_fill_left_then_the_rest() {
    let (mut b, mut st) = warmed(false);
    // Layer 1 (odd) fills from the top; layer 2's prefetch from the bottom.
    let r = req(1, &[1, 2, 3, 4, 5, 6], false);
    b.plan_layer(&r, &mut st);
    assert_eq!(scratch_slots(&fill_all(&mut b, &r, &mut st)), (30..48).rev().collect::<Vec<_>>());
    let copied = prefetch(&mut b, 2, false, &[1, 2, 3], &[], 300, &mut st);
    assert_eq!(copied.iter().map(|c| c.1).collect::<Vec<_>>(), (24..30).collect::<Vec<_>>(), "6 slots were free");
    assert_eq!(b.rest_cap(2, true), Some(24));
    assert_eq!((b.rest_cap(2, false), b.rest_cap(3, true)), (None, None));
    // The rest, once layer 1's kernels are done with their slots.
    let rest = b.ahead_slot(id(2, 0, 3), 24);
    assert_eq!(rest, AheadSlot::Slot(30));
    assert_eq!(b.ahead_slot(id(2, 0, 1), 24), AheadSlot::Skip, "already copied");
    assert_eq!(b.ahead_slot(id(0, 0, 1), 24), AheadSlot::Skip, "hot");
    assert_eq!(b.ahead_slot(id(2, 0, 3), 6), AheadSlot::Full);
}

#[test]
fn a_layer_whose_cold_slabs_overflow_the_scratch_fills_in_passes() {
    // 24 scratch slots hold 8 cold experts (3 slabs each): 8 fit in one
    // pass, 9 take two. A small book (12 slots: 6 scratch) shows the split.
    let (mut b, mut st) = (SlotBook::new(SLOT, 12, 8, f64::INFINITY).unwrap(), PoolStats::default());
    let all: Vec<u32> = (0..8).collect();
    let r = req(1, &all, false);
    b.plan_layer(&r, &mut st);
    // The empty hot set admits six slabs (uploads into hot slots: no
    // scratch); the other 18 cold slabs need three passes or more.
    assert_eq!(st.admissions, 6);
    let p = b.passes(&r).unwrap();
    assert!(p.len() >= 3, "{p:?}");
    assert!(p.first().unwrap().start == 0 && p.last().unwrap().end == 8 && p.windows(2).all(|w| w[0].end == w[1].start && w[0].start < w[0].end), "{p:?}");
    // Each pass's fill fits the window (no overflow error), and a pass with
    // the next expert added would not.
    for (i, range) in p.iter().enumerate() {
        let pass = req(1, &all[range.clone()], false);
        let places = fill_all(&mut b, &pass, &mut st);
        let scratch = places.iter().filter(|pl| matches!(pl, Place::Scratch { .. })).count();
        assert!((1..=6).contains(&scratch), "pass {i}: {places:?}");
        if range.end < all.len() {
            let more = req(1, &all[range.start..range.end + 1], false);
            assert!(fill(&mut b, &more, Some(&slab_bytes), &no_zero_copy, &mut st).is_err(), "pass {i} plus one");
        }
    }
    // The whole layer in one fill overflows, as it did before passes.
    assert!(fill(&mut b, &r, Some(&slab_bytes), &no_zero_copy, &mut st).is_err());
    // Hot slabs take no scratch: the warmed book's layer 0 is one pass.
    let (mut b, _) = warmed(false);
    assert_eq!(b.passes(&req(0, &all, false)).unwrap(), vec![0..8]);
    // Too few scratch slots for one expert's three slabs: the overflow error.
    let (mut tiny, mut st) = (SlotBook::new(SLOT, 4, 8, f64::INFINITY).unwrap(), PoolStats::default());
    tiny.plan_layer(&req(2, &all, false), &mut st);
    let e = tiny.passes(&req(2, &all, false)).unwrap_err().to_string();
    assert!(e.contains("'s 3 cold slabs exceed the 2 scratch slots; raise --vram-budget"), "{e}");
}

#[test]
fn passes_drop_a_prefetch_that_holds_the_scratch_they_need() {
    // A prefill prefetch of layer 1 takes the whole 6-slot window; the
    // layer then needs more than one pass, so the prefetch is dropped
    // (before: "exceed the 0 scratch slots").
    let (mut b, mut st) = (SlotBook::new(SLOT, 12, 8, f64::INFINITY).unwrap(), PoolStats::default());
    let all: Vec<u32> = (0..8).collect();
    let copied = prefetch(&mut b, 1, false, &all, &[], 512, &mut st);
    assert_eq!(copied.len(), 6, "{copied:?}");
    let r = req(1, &all, false);
    b.plan_layer(&r, &mut st);
    let p = b.passes(&r).unwrap();
    assert!(p.len() > 1, "{p:?}");
    assert!(copied.iter().all(|(id, _)| b.prefetched(1, *id).is_none()), "the prefetch was kept");
    for range in &p {
        fill_all(&mut b, &req(1, &all[range.clone()], false), &mut st);
    }
    // A layer that fits in one pass keeps its prefetch.
    let (mut b, mut st) = (book(), PoolStats::default());
    let few: Vec<u32> = (0..2).collect();
    let copied = prefetch(&mut b, 1, false, &few, &[], 512, &mut st);
    b.plan_layer(&req(1, &few, false), &mut st);
    assert_eq!(b.passes(&req(1, &few, false)).unwrap(), vec![0..2]);
    assert!(!copied.is_empty() && copied.iter().all(|(id, _)| b.prefetched(1, *id).is_some()));
}
