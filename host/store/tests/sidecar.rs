//! The census sidecar on disk: round trip, merge without ratcheting, damaged
//! files ignored with one warning, and a crash mid-write.

mod common;

use common::with_captured_logs;
use pulsar_store::census::{sidecar_temp_path, SIDECAR_MAGIC};
use pulsar_store::{load_sidecar, save_sidecar, sidecar_path, Census, SidecarLoad};

const FP: [u8; 32] = [0xA5; 32];

fn census(seed: u64) -> Census {
    let mut c = Census::new();
    for l in 0..4 {
        for e in 0..16 {
            c.record(l, e, (u64::from(l * 16 + e) * 2654435761 + seed) % 1000);
        }
    }
    c
}

#[test]
fn round_trip_and_merge_decays_old_counts() {
    let dir = tempfile::tempdir().unwrap();
    let path = sidecar_path(&dir.path().join("m.gguf"));
    assert_eq!(load_sidecar(&path, &FP), SidecarLoad::Missing);
    let a = census(1);
    assert_eq!(save_sidecar(&path, &FP, &a).unwrap(), a);
    assert_eq!(load_sidecar(&path, &FP), SidecarLoad::Loaded(a.clone()));

    let b = census(2);
    let merged = save_sidecar(&path, &FP, &b).unwrap();
    for (l, e, c) in merged.iter() {
        assert_eq!(c, a.count(l, e) / 2 + b.count(l, e));
    }
    // The same run's counts saved over and over converge to 2x, never grow past it.
    let mut last = merged;
    for _ in 0..40 {
        last = save_sidecar(&path, &FP, &b).unwrap();
    }
    for (l, e, c) in last.iter() {
        assert!(c <= 2 * b.count(l, e), "ratcheted: {c} vs run {}", b.count(l, e));
    }
    assert_eq!(load_sidecar(&path, &FP).into_census(), last);
    // No temp files left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

fn assert_ignored_once(path: &std::path::Path, fp: &[u8; 32], why: &str) {
    let (r, logs) = with_captured_logs(|| load_sidecar(path, fp));
    match r {
        SidecarLoad::Ignored(reason) => assert!(reason.contains(why), "{reason}"),
        other => panic!("damaged sidecar accepted: {other:?}"),
    }
    assert_eq!(logs.count("ignoring census sidecar"), 1, "{}", logs.text());
    assert!(logs.text().contains("WARN"));
}

#[test]
fn truncated_bitflipped_and_foreign_sidecars_are_ignored_with_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    let path = sidecar_path(&dir.path().join("m.gguf"));
    save_sidecar(&path, &FP, &census(3)).unwrap();
    let good = std::fs::read(&path).unwrap();

    std::fs::write(&path, &good[..good.len() - 13]).unwrap();
    assert_ignored_once(&path, &FP, "truncated or corrupt");

    let mut flipped = good.clone();
    flipped[100] ^= 0x10;
    std::fs::write(&path, &flipped).unwrap();
    assert_ignored_once(&path, &FP, "checksum");

    std::fs::write(&path, &good).unwrap();
    assert_ignored_once(&path, &[0u8; 32], "fingerprint");

    std::fs::write(&path, b"hello").unwrap();
    assert_ignored_once(&path, &FP, "truncated");

    // Saving over a damaged sidecar starts clean: just this run's counts.
    std::fs::write(&path, &flipped).unwrap();
    let run = census(4);
    assert_eq!(save_sidecar(&path, &FP, &run).unwrap(), run);
}

#[test]
fn crash_mid_write_leaves_old_sidecar_intact_and_next_save_works() {
    let dir = tempfile::tempdir().unwrap();
    let path = sidecar_path(&dir.path().join("m.gguf"));
    let old = census(5);
    save_sidecar(&path, &FP, &old).unwrap();

    // A save that died after writing part of its temp file, before rename
    // (its name is unpredictable: this is one such name).
    let tmp = sidecar_temp_path(&path);
    let mut partial = SIDECAR_MAGIC.to_vec();
    partial.extend_from_slice(&[1, 0, 0, 0, 0, 0]);
    std::fs::write(&tmp, &partial).unwrap();

    let (r, logs) = with_captured_logs(|| load_sidecar(&path, &FP));
    assert_eq!(r, SidecarLoad::Loaded(old.clone()));
    assert_eq!(logs.count("WARN"), 0, "{}", logs.text());

    // The next save writes a temp file of its own (never opening one that is
    // there: it could be a planted link) and merges with the intact old file;
    // the dead save's leftover stays as it was.
    let run = census(6);
    let merged = save_sidecar(&path, &FP, &run).unwrap();
    let mut expect = old.decayed();
    expect.merge(&run);
    assert_eq!(merged, expect);
    assert_eq!(std::fs::read(&tmp).unwrap(), partial);
    assert_eq!(load_sidecar(&path, &FP), SidecarLoad::Loaded(expect));
}
