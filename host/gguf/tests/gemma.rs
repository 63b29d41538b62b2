//! The real gemma-3-270m Q4_K_M file (llama.cpp-written) opens and agrees
//! with facts taken from the `gguf` Python package's reader.

use std::collections::BTreeSet;
use std::path::PathBuf;

use pulsar_gguf::{parse_header, FileSource, GgmlType, GgufFile};

fn gemma_path() -> PathBuf {
    let p = std::env::var_os("PULSAR_GEMMA_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root/.cache/pulsar/models/gemma-3-270m-Q4_K_M.gguf"));
    assert!(
        p.is_file(),
        "gemma-3-270m GGUF not found at {}: run scripts/fetch-gemma.sh (or set PULSAR_GEMMA_GGUF)",
        p.display()
    );
    p
}

#[test]
fn gemma_opens_with_the_expected_directory_and_metadata() {
    let path = gemma_path();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.n_shards(), 1);
    assert_eq!(f.shard_paths(), std::slice::from_ref(&path));
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.architecture().unwrap(), "gemma3");
    assert_eq!(f.tensors().len(), 236);
    let types: BTreeSet<GgmlType> = f.tensors().iter().map(|t| t.ty).collect();
    let want: BTreeSet<GgmlType> =
        [GgmlType::F32, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0].into();
    assert_eq!(types, want);
    // Facts from gguf-py's GGUFReader: 33 KVs, data section at 6525120, the
    // first tensor is output_norm.weight [640] f32 at the start of the data.
    assert_eq!(f.metadata().len(), 33);
    let info = f.shard_infos().next().unwrap();
    assert_eq!(info.data_offset, 6525120);
    let first = &f.tensors()[0];
    assert_eq!((first.name.as_str(), first.dims.as_slice(), first.ty), ("output_norm.weight", &[640u64][..], GgmlType::F32));
    assert_eq!(first.offset, 6525120);

    // The vocabulary is stored compactly and is consistent with the embedding.
    let md = f.metadata();
    let tokens = md.require_str_array("tokenizer.ggml.tokens").unwrap();
    let scores = md.require_f32_array("tokenizer.ggml.scores").unwrap();
    let kinds = md.require_i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(tokens.len(), scores.len());
    assert_eq!(tokens.len(), kinds.len());
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dims, [md.require_u64("gemma3.embedding_length").unwrap(), tokens.len() as u64]);
    assert_eq!(md.require_u32("gemma3.block_count").unwrap(), 18);
    assert!(md.require_f32("gemma3.attention.layer_norm_rms_epsilon").unwrap() > 0.0);
    assert!(md.require_bool("tokenizer.ggml.add_bos_token").unwrap());
    let e = md.require_u32("tokenizer.ggml.model").unwrap_err().to_string();
    assert!(e.contains("'tokenizer.ggml.model'") && e.contains("found string"), "{e}");

    // Directory: in bounds, aligned, non-overlapping, together filling the data section.
    let mut ranges: Vec<_> = f.tensors().iter().map(|t| (t.offset, t.n_bytes)).collect();
    ranges.sort();
    for w in ranges.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "overlap at {}", w[1].0);
    }
    let (last_off, last_len) = *ranges.last().unwrap();
    assert!(last_off + last_len <= info.len && info.len - (last_off + last_len) < 32);
    assert!(f.tensors().iter().all(|t| t.offset % 32 == 0));

    // mmap slice and pread agree.
    let t = f.tensor("blk.0.attn_q.weight").unwrap();
    let mut buf = vec![0u8; t.n_bytes as usize];
    f.read_at(t.shard, t.offset, &mut buf).unwrap();
    assert_eq!(f.data(t), &buf[..]);
    assert!(f.read_at(0, info.len - 4, &mut [0u8; 8]).is_err());
}

#[test]
fn gemma_parses_identically_through_pread() {
    let path = gemma_path();
    let f = GgufFile::open(&path).unwrap();
    let src = FileSource::new(std::fs::File::open(&path).unwrap()).unwrap();
    let h = parse_header(&src, 0).unwrap();
    assert_eq!(&h.metadata, f.metadata());
    assert_eq!(h.tensors, f.tensors());
}

#[test]
fn gemma_report_and_fingerprint() {
    let f = GgufFile::open(gemma_path()).unwrap();
    let text = pulsar_gguf::report::report(&f);
    assert!(text.starts_with("GGUF v3, alignment 32, 1 shard"), "{}", &text[..200]);
    assert!(text.contains(r#"[262144 x string] "<pad>", "<eos>", "<bos>", ..."#), "vocab line missing");
    assert!(text.contains("token_embd.weight"));
    assert!(text.contains("tensors (236):"));
    let s = pulsar_gguf::report::Summary::of(&f);
    assert_eq!(s.types.iter().map(|t| t.count).sum::<usize>(), 236);
    assert_eq!(s.tensor_bytes, f.tensors().iter().map(|t| t.n_bytes).sum::<u64>());
    assert!(s.expert_layers.is_empty(), "gemma3 is dense");
    serde_json::to_string(&s).unwrap();
    // Stable across opens.
    let again = GgufFile::open(gemma_path()).unwrap();
    assert_eq!(f.fingerprint(), again.fingerprint());
    assert_eq!(f.fingerprint_hex().len(), 64);
}
