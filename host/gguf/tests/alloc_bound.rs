//! No input makes the parser allocate more than its size justifies. A
//! counting allocator (this test binary only, one test so nothing else runs
//! concurrently) records the peak heap growth during each parse.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(l.size(), Relaxed) + l.size();
        PEAK.fetch_max(now, Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // Counted as the new block arriving before the old one leaves.
        let now = LIVE.fetch_add(new, Relaxed) + new;
        PEAK.fetch_max(now, Relaxed);
        LIVE.fetch_sub(l.size(), Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Peak extra heap while parsing `bytes` (the result is dropped inside).
fn parse_peak(bytes: &[u8]) -> usize {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let r = pulsar_gguf::parse_header(bytes, 0);
    let peak = PEAK.load(Relaxed) - base;
    drop(r);
    peak
}

#[test]
fn parse_heap_is_bounded_by_input_size() {
    // Parsed structures may take a few times the bytes they came from (a
    // String is 24 bytes plus its text, an encoded one at least 8): allow 8x
    // plus the fixed 64 KiB read window and small constant overhead.
    let bound = |len: usize| 8 * len + 64 * 1024 + 4096;
    let mut inputs: Vec<Vec<u8>> = common::broken_files().into_iter().map(|(_, b, _)| b).collect();
    let valid = common::small_valid_file();
    inputs.extend((0..valid.len()).map(|cut| valid[..cut].to_vec()));
    for i in 0..valid.len().min(400) {
        for bit in 0..8 {
            let mut b = valid.clone();
            b[i] ^= 1 << bit;
            inputs.push(b);
        }
    }
    // Many strings/arrays that are as small as they can be: worst ratio of
    // parsed size to input size.
    let mut a = common::Asm::header(3, 0, 2);
    a.str("k.s").u32(9).u32(8).u64(20_000);
    for _ in 0..20_000 {
        a.u64(0);
    }
    a.str("k.n").u32(9).u32(9).u64(20_000);
    for _ in 0..20_000 {
        a.u32(0).u64(0);
    }
    let dense = a.done();
    assert!(pulsar_gguf::parse_header(&dense[..], 0).is_ok());
    inputs.push(dense);

    let mut worst = 0f64;
    for b in &inputs {
        let peak = parse_peak(b);
        assert!(peak <= bound(b.len()), "parsing {} bytes peaked at {peak} bytes of heap", b.len());
        worst = worst.max(peak as f64 / bound(b.len()) as f64);
    }
    // The counter is live (a parse of the dense file must register).
    assert!(worst > 0.0);

    // Big inputs whose header claims as many entries as the bytes allow but
    // whose first entry is bad: nothing is reserved for the claimed count.
    let four_mib = 4 << 20;
    let mut claims_tensors = common::Asm::header(3, (four_mib / 40) as u64, 0).done();
    claims_tensors.resize(four_mib, 0); // the first name is empty
    let mut claims_strings = common::Asm::header(3, 0, 1);
    claims_strings.str("k.s").u32(9).u32(8).u64((four_mib / 9) as u64);
    let mut claims_strings = claims_strings.done();
    claims_strings.resize(four_mib, 0xff); // the first string is absurdly long
    for b in [claims_tensors, claims_strings] {
        assert!(pulsar_gguf::parse_header(&b[..], 0).is_err());
        let peak = parse_peak(&b);
        assert!(peak < 1 << 20, "a bad first entry after a big claimed count peaked at {peak} bytes");
    }
}
