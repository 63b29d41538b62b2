//! `expert_slab` returns exactly one expert's bytes of a written 3-D tensor.

use pulsar_gguf::{GgmlType, GgufFile, GgufWriter};

/// The byte at (`expert`, `row`, `i` within the row): distinct across experts
/// and rows, so any off-by-one slab shows.
fn byte(expert: u64, row: u64, i: u64) -> u8 {
    ((expert * 97 + row * 13 + i) % 251) as u8
}

fn expected(dims: &[u64], ty: GgmlType, expert: u64) -> Vec<u8> {
    let row_bytes = ty.row_bytes(dims[0]).unwrap();
    (0..dims[1]).flat_map(|r| (0..row_bytes).map(move |i| byte(expert, r, i))).collect()
}

/// Writes the tensors with the callback path (chunked by whole rows).
fn write(tensors: &[(&str, Vec<u64>, GgmlType)], max_shard: Option<u64>) -> (tempfile::TempDir, GgufFile) {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "moe-test").unwrap();
    for (name, dims, ty) in tensors {
        w.add_tensor(*name, dims, *ty).unwrap();
    }
    if let Some(n) = max_shard {
        w.set_max_shard_bytes(n);
    }
    w.set_chunk_bytes(64);
    let dir = tempfile::tempdir().unwrap();
    let mut d = w.create(dir.path().join("moe.gguf")).unwrap();
    for (name, dims, ty) in tensors {
        let row_bytes = ty.row_bytes(dims[0]).unwrap();
        let rows = dims[1..].iter().product::<u64>();
        d.write_tensor_with(name, |at, buf| {
            assert_eq!(at % row_bytes, 0, "chunks are whole rows");
            for (k, b) in buf.iter_mut().enumerate() {
                let pos = at + k as u64;
                let (row_global, i) = (pos / row_bytes, pos % row_bytes);
                let (expert, row) = (row_global / dims[1], row_global % dims[1]);
                assert!(row_global < rows);
                *b = byte(expert, row, i);
            }
            Ok(())
        })
        .unwrap();
    }
    let paths = d.shard_paths().to_vec();
    d.finish().unwrap();
    let f = GgufFile::open(&paths[0]).unwrap();
    (dir, f)
}

#[test]
fn slabs_of_q8_0_width_96_and_fused_gate_up() {
    let ff = 3;
    let tensors = [
        ("blk.0.ffn_down_exps.weight", vec![96, 5, 4], GgmlType::Q8_0),
        ("blk.0.ffn_gate_up_exps.weight", vec![256, 2 * ff, 3], GgmlType::Q4_K),
        ("blk.1.ffn_up_exps.weight", vec![64, 1, 7], GgmlType::Q5_1),
        ("blk.0.attn_q.weight", vec![32, 4], GgmlType::F32),
    ];
    for max_shard in [None, Some(1000)] {
        let (_dir, f) = write(&tensors, max_shard);
        if max_shard.is_some() {
            assert!(f.n_shards() > 1);
        }
        for (name, dims, ty) in &tensors[..3] {
            let t = f.tensor(name).unwrap();
            let n_expert = dims[2];
            let mut covered = 0;
            for e in 0..n_expert {
                let r = f.expert_slab(t, e).unwrap();
                assert_eq!(r.shard, t.shard);
                assert_eq!(r.len, ty.row_bytes(dims[0]).unwrap() * dims[1], "{name}");
                let got = f.bytes(&r).unwrap();
                assert_eq!(got, &expected(dims, *ty, e)[..], "{name} expert {e}");
                let mut via_pread = vec![0; r.len as usize];
                f.read_at(r.shard, r.offset, &mut via_pread).unwrap();
                assert_eq!(got, &via_pread[..]);
                covered += r.len;
            }
            assert_eq!(covered, t.n_bytes, "{name}: slabs tile the tensor");
            let e = f.expert_slab(t, n_expert).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains("out of range"), "{e}");
        }
        // The fused gate_up slab holds the gate rows then the up rows of that expert.
        let t = f.tensor("blk.0.ffn_gate_up_exps.weight").unwrap();
        let r = f.expert_slab(t, 2).unwrap();
        let s = f.bytes(&r).unwrap();
        assert_eq!(s.len() as u64, 2 * ff * 144);
        assert_eq!(s[(ff * 144) as usize], byte(2, ff, 0), "first up row");

        let e = f.expert_slab(f.tensor("blk.0.attn_q.weight").unwrap(), 0).unwrap_err().to_string();
        assert!(e.contains("blk.0.attn_q.weight") && e.contains("3-D"), "{e}");
    }
}

#[test]
fn report_sums_expert_bytes_per_layer() {
    let tensors = [
        ("blk.0.ffn_down_exps.weight", vec![96, 5, 4], GgmlType::Q8_0),
        ("blk.0.ffn_gate_up_exps.weight", vec![256, 6, 4], GgmlType::Q4_K),
        ("blk.1.ffn_up_exps.weight", vec![64, 1, 7], GgmlType::Q5_1),
        ("blk.1.ffn_up_shexp.weight", vec![64, 1], GgmlType::Q5_1),
    ];
    let (_dir, f) = write(&tensors, None);
    let s = pulsar_gguf::report::Summary::of(&f);
    assert_eq!(s.expert_layers.len(), 2);
    let l0 = &s.expert_layers[0];
    assert_eq!((l0.layer, l0.n_expert, l0.n_tensors), (0, 4, 2));
    assert_eq!(l0.bytes_per_expert, 3 * 34 * 5 + 6 * 144);
    assert_eq!(l0.bytes, 4 * l0.bytes_per_expert);
    let l1 = &s.expert_layers[1];
    assert_eq!((l1.layer, l1.n_expert, l1.bytes_per_expert), (1, 7, 2 * 24));
    let text = s.to_text();
    assert!(text.contains("expert bytes per layer"), "{text}");
    assert!(text.contains(&format!("{} bytes per expert", l0.bytes_per_expert)), "{text}");
}
