//! Parses arbitrary bytes as a GGUF file, then uses everything the parse
//! returned. Any panic, abort, hang or sanitizer report is a bug: the parser
//! must turn every input into `Ok` or a `GgufError`.
//!
//! cargo +nightly fuzz run parse fuzz/corpus/parse fuzz/seeds/parse
#![no_main]

use libfuzzer_sys::fuzz_target;
use pulsar_gguf::{parse_header, GgufFile};

fuzz_target!(|data: &[u8]| {
    let _ = parse_header(data, 0);
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else { return };
    for t in f.tensors() {
        // Bounds were validated at parse time: these must not fail.
        assert_eq!(f.data(t).len() as u64, t.n_bytes);
        if let Some(n) = t.n_experts() {
            for e in [0, n - 1] {
                let r = f.expert_slab(t, e).expect("in-range expert");
                f.bytes(&r).expect("slab inside the file");
            }
            assert!(f.expert_slab(t, n).is_err());
        }
        assert_eq!(f.tensor(&t.name), Some(t));
    }
    let _ = pulsar_gguf::report::report(&f);
    let _ = f.fingerprint();
    for (k, _) in f.metadata().iter() {
        let _ = f.metadata().get_u32(k);
        let _ = f.metadata().get_str_array(k);
        let _ = f.metadata().get_u64_vec(k);
    }
});
