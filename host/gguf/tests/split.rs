//! Split shard sets: opening from any shard, and every inconsistency an error
//! that names the shard or key.

use std::path::PathBuf;

use pulsar_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value};

/// One shard written by hand (a single-file writer given explicit split keys).
fn shard(no: u16, count: u16, total: Option<i32>, tensors: &[&str], extra: &[(&str, Value)]) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (k, v) in extra {
        w.add_kv(*k, v.clone()).unwrap();
    }
    w.add_kv("split.no", no).unwrap();
    w.add_kv("split.count", count).unwrap();
    if let Some(t) = total {
        w.add_kv("split.tensors.count", t).unwrap();
    }
    for t in tensors {
        w.add_tensor(*t, &[4], GgmlType::F32).unwrap();
    }
    let mut d = w.in_memory().unwrap();
    for t in tensors {
        d.write_tensor(t, &[no as u8; 16]).unwrap();
    }
    d.finish().unwrap().remove(0)
}

fn arch(a: &str) -> Vec<(&'static str, Value)> {
    vec![("general.architecture", Value::from(a))]
}

fn err(shards: Vec<Vec<u8>>) -> String {
    match GgufFile::from_shard_bytes(shards) {
        Ok(_) => panic!("inconsistent shard set opened"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn hand_built_sets_open_and_inconsistencies_fail() {
    let good = || vec![shard(0, 2, Some(3), &["a", "b"], &arch("m")), shard(1, 2, Some(3), &["c"], &arch("other"))];
    let f = GgufFile::from_shard_bytes(good()).unwrap();
    assert_eq!(f.architecture().unwrap(), "m", "metadata comes from the first shard");
    assert_eq!(f.tensor("c").unwrap().shard, 1);
    assert_eq!(f.data(f.tensor("c").unwrap()), [1u8; 16]);

    let e = err(vec![shard(0, 2, Some(3), &["a", "b"], &[]), shard(0, 2, Some(3), &["c"], &[])]);
    assert!(e.contains("opened as shard 2 of 2 but says it is shard 1 of 2"), "{e}");
    let e = err(vec![shard(0, 2, Some(3), &["a", "b"], &[]), shard(1, 3, Some(3), &["c"], &[])]);
    assert!(e.contains("shard 2 of 3"), "{e}");
    let e = err(vec![shard(0, 2, Some(4), &["a", "b"], &[]), shard(1, 2, Some(4), &["c"], &[])]);
    assert!(e.contains("split.tensors.count") && e.contains("says 4 tensors"), "{e}");
    let e = err(vec![shard(0, 2, Some(3), &["a", "b"], &[]), shard(1, 2, Some(2), &["c"], &[])]);
    assert!(e.contains("split.tensors.count"), "{e}");
    let e = err(vec![shard(0, 2, Some(3), &["a", "b"], &[]), shard(1, 2, Some(3), &["b"], &[])]);
    assert!(e.contains("duplicate tensor name 'b'") && e.contains("shard 1"), "{e}");
    let plain = GgufWriter::new().in_memory().unwrap().finish().unwrap().remove(0);
    let e = err(vec![shard(0, 2, Some(1), &["a"], &[]), plain]);
    assert!(e.contains("not part of a split set"), "{e}");
    let e = err(vec![shard(0, 3, None, &["a"], &[])]);
    assert!(e.contains("opened as shard 1 of 1 but says it is shard 1 of 3"), "{e}");
    let e = err(vec![shard(0, 0, None, &["a"], &[])]);
    assert!(e.contains("'split.count' is 0"), "{e}");
    // split.tensors.count is optional (older writers).
    assert!(GgufFile::from_shard_bytes(vec![shard(0, 2, None, &["a"], &[]), shard(1, 2, None, &["c"], &[])]).is_ok());
}

fn three_shards(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "s").unwrap();
    for i in 0..3 {
        w.add_tensor(format!("t{i}"), &[64], GgmlType::F32).unwrap();
    }
    w.set_max_shard_bytes(256);
    let mut d = w.create(dir.join("model.gguf")).unwrap();
    for i in 0..3 {
        d.write_tensor(&format!("t{i}"), &[i as u8; 256]).unwrap();
    }
    let paths = d.shard_paths().to_vec();
    d.finish().unwrap();
    assert_eq!(paths.len(), 3);
    paths
}

#[test]
fn sets_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let paths = three_shards(dir.path());
    for p in &paths {
        let f = GgufFile::open(p).unwrap();
        assert_eq!(f.shard_paths(), &paths[..]);
        assert_eq!(f.tensors().len(), 3);
        assert_eq!(f.shard_infos().map(|s| s.n_tensors).collect::<Vec<_>>(), [1, 1, 1]);
        assert_eq!(f.total_bytes(), paths.iter().map(|p| std::fs::metadata(p).unwrap().len()).sum::<u64>());
    }

    // A later shard renamed out of the scheme cannot find its set.
    let odd = dir.path().join("renamed.gguf");
    std::fs::copy(&paths[1], &odd).unwrap();
    let e = GgufFile::open(&odd).unwrap_err().to_string();
    assert!(e.contains("renamed.gguf") && e.contains("shard 2 of 3") && e.contains("does not follow"), "{e}");

    // A name that disagrees with the split keys.
    let liar = dir.path().join("other-00002-of-00003.gguf");
    std::fs::copy(&paths[0], &liar).unwrap();
    let e = GgufFile::open(&liar).unwrap_err().to_string();
    assert!(e.contains("name says shard 2 of 3") && e.contains("shard 1 of 3"), "{e}");

    // A missing shard is named.
    std::fs::remove_file(&paths[2]).unwrap();
    let e = GgufFile::open(&paths[0]).unwrap_err();
    assert!(matches!(e, GgufError::MissingShard { index: 2, count: 3, .. }), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("model-00003-of-00003.gguf") && e.contains("shard 3 of 3 is missing"), "{e}");

    // A corrupt shard is named by path.
    std::fs::write(&paths[2], b"GGUF\x03\0\0\0").unwrap();
    let e = GgufFile::open(&paths[0]).unwrap_err().to_string();
    assert!(e.contains("model-00003-of-00003.gguf") && e.contains("truncated"), "{e}");
}

#[test]
fn out_of_range_reads_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let paths = three_shards(dir.path());
    let f = GgufFile::open(&paths[0]).unwrap();
    let len = f.shard_infos().nth(1).unwrap().len;
    let mut b = [0u8; 4];
    f.read_at(1, len - 4, &mut b).unwrap();
    assert!(matches!(f.read_at(1, len - 3, &mut b), Err(GgufError::OutOfBounds { shard: 1, .. })));
    assert!(matches!(f.read_at(3, 0, &mut b), Err(GgufError::NoSuchShard { shard: 3, count: 3 })));
    assert!(f.read_at(0, u64::MAX, &mut b).is_err());
    let r = pulsar_gguf::ByteRange { shard: 0, offset: u64::MAX - 1, len: 4 };
    assert!(f.bytes(&r).is_err());
}
