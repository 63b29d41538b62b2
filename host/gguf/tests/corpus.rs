//! Broken files: each must give an `Err` that says what is wrong and where,
//! never a panic. The corpus is small (a few thousand parses of a ~1 KB file).

mod common;

use common::{broken_files, small_valid_file, Asm};
use proptest::prelude::*;
use pulsar_gguf::{parse_header, GgufError, GgufFile};

#[test]
fn every_broken_file_is_an_error_naming_the_problem() {
    for (name, bytes, want) in broken_files() {
        let e = match parse_header(&bytes[..], 0) {
            Ok(_) => panic!("{name}: parsed a broken file"),
            Err(e) => e.to_string(),
        };
        for w in &want {
            assert!(e.contains(w), "{name}: error {e:?} does not mention {w:?}");
        }
        assert!(GgufFile::from_bytes(bytes).is_err(), "{name}");
    }
}

#[test]
fn errors_from_files_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    std::fs::write(&p, Asm::header(3, 1, 0).tensor("blk.7.w", &[4], 0, 64).data(16).done()).unwrap();
    let e = GgufFile::open(&p).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("bad.gguf") && msg.contains("tensor 'blk.7.w'") && msg.contains("past the end"), "{msg}");
    assert!(matches!(e.innermost(), GgufError::Malformed { .. }), "{e:?}");
    let e = GgufFile::open(dir.path().join("absent.gguf")).unwrap_err().to_string();
    assert!(e.contains("absent.gguf"), "{e}");
    std::fs::write(&p, b"").unwrap();
    assert!(GgufFile::open(&p).unwrap_err().to_string().contains("magic"));
}

#[test]
fn every_truncation_of_a_valid_file_fails_until_the_data_is_complete() {
    let bytes = small_valid_file();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    let data_end = f.tensors().iter().map(|t| t.offset + t.n_bytes).max().unwrap() as usize;
    assert!(data_end <= bytes.len());
    for cut in 0..=bytes.len() {
        let r = parse_header(&bytes[..cut], 0);
        if cut < data_end {
            let e = r.expect_err(&format!("truncated at {cut} parsed")).to_string();
            assert!(e.contains("offset") || e.contains("magic"), "cut {cut}: {e}");
        } else {
            // Only the alignment padding after the last tensor is missing.
            assert!(r.is_ok(), "cut {cut}: {:?}", r.err());
        }
    }
}

#[test]
fn flipped_bits_in_the_header_never_panic_and_flipped_counts_fail() {
    let bytes = small_valid_file();
    let header_len = parse_header(&bytes[..], 0).unwrap().header_len as usize;
    let mut errors = 0;
    for i in 0..header_len {
        for bit in 0..8 {
            let mut b = bytes.clone();
            b[i] ^= 1 << bit;
            match parse_header(&b[..], 0) {
                Err(e) => {
                    errors += 1;
                    assert!(!e.to_string().is_empty());
                }
                Ok(h) => {
                    // Magic and version: only v3 -> v2 is still valid.
                    assert!(i >= 8 || (i, bit) == (4, 0), "flip of byte {i} bit {bit} parsed");
                    // A count that grows always fails (the entries are not there); one
                    // that shrinks can leave a shorter valid directory (as llama.cpp
                    // would read it too), but never a longer one.
                    if (8..24).contains(&i) {
                        let grew = bytes[i] & (1 << bit) == 0;
                        assert!(!grew, "count grew by flipping byte {i} bit {bit} and still parsed");
                        assert!(h.tensors.len() <= 3 && h.metadata.len() <= 9);
                    }
                }
            }
        }
    }
    assert!(errors > header_len, "most header bit flips must be detected ({errors})");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Random overwrites anywhere in a valid file (a poor man's fuzzer that
    /// runs in `cargo test`): whatever the result, no panic.
    #[test]
    fn random_corruption_never_panics(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
                                      cut in any::<prop::sample::Index>()) {
        let mut b = small_valid_file();
        for (at, v) in edits {
            let i = at.index(b.len());
            b[i] = v;
        }
        let n = cut.index(b.len() + 1);
        let _ = parse_header(&b[..n], 0);
        let _ = GgufFile::from_bytes(b[..n].to_vec()).map(|f| pulsar_gguf::report::report(&f));
    }
}
