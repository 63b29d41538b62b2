//! Shared by the integration tests: the fixtures and the real gemma-3 vocabulary.
#![allow(dead_code)] // each test binary uses its own part

use pulsar_tokenizer::{Tokenizer, VocabSpec};
use serde_json::Value;
use std::path::{Path, PathBuf};

pub fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id array")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

pub fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .expect("a string array")
        .iter()
        .map(|x| x.as_str().expect("a string").to_string())
        .collect()
}

/// The gemma-3-270m GGUF: `PULSAR_GEMMA_GGUF`, or where scripts/fetch-gemma.sh puts it.
pub fn gemma_path() -> PathBuf {
    if let Some(p) = std::env::var_os("PULSAR_GEMMA_GGUF") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/pulsar/models/gemma-3-270m-Q4_K_M.gguf")
}

/// The vocabulary of the real gemma-3 GGUF, read with pulsar-gguf. A missing file fails the
/// test: the gold comparison is the point of these tests.
pub fn gemma_spec() -> VocabSpec {
    let path = gemma_path();
    if !path.is_file() {
        panic!(
            "{} not found: run scripts/fetch-gemma.sh (or set PULSAR_GEMMA_GGUF to the gemma-3-270m Q4_K_M GGUF)",
            path.display()
        );
    }
    let file =
        pulsar_gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let m = file.metadata();
    VocabSpec {
        model: ok(&path, m.require_str("tokenizer.ggml.model")).to_string(),
        pre: ok(&path, m.get_str("tokenizer.ggml.pre")).map(str::to_string),
        architecture: ok(&path, m.get_str("general.architecture")).map(str::to_string),
        tokens: ok(&path, m.require_str_array("tokenizer.ggml.tokens")).to_vec(),
        scores: ok(&path, m.get_f32_array("tokenizer.ggml.scores")).map(<[f32]>::to_vec),
        token_types: ok(&path, m.get_i32_array("tokenizer.ggml.token_type")).map(<[i32]>::to_vec),
        merges: ok(&path, m.get_str_array("tokenizer.ggml.merges")).map(<[String]>::to_vec),
        bos: ok(&path, m.get_u32("tokenizer.ggml.bos_token_id")),
        eos: ok(&path, m.get_u32("tokenizer.ggml.eos_token_id")),
        unk: ok(&path, m.get_u32("tokenizer.ggml.unknown_token_id")),
        pad: ok(&path, m.get_u32("tokenizer.ggml.padding_token_id")),
        eot: ok(&path, m.get_u32("tokenizer.ggml.eot_token_id")),
        add_bos: ok(&path, m.get_bool("tokenizer.ggml.add_bos_token")),
        add_eos: ok(&path, m.get_bool("tokenizer.ggml.add_eos_token")),
        add_space_prefix: ok(&path, m.get_bool("tokenizer.ggml.add_space_prefix")),
    }
}

fn ok<T>(path: &Path, r: pulsar_gguf::Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn gemma() -> Tokenizer {
    Tokenizer::new(gemma_spec()).expect("gemma-3's vocabulary builds a tokenizer")
}

/// The small byte-level vocabulary of tests/fixtures/bpe_vocab.json, with a pre-tokenizer.
pub fn bpe_spec(pre: &str) -> VocabSpec {
    let v = fixture("bpe_vocab.json");
    VocabSpec {
        model: v["model"].as_str().unwrap().to_string(),
        pre: Some(pre.to_string()),
        tokens: strings(&v["tokens"]),
        token_types: Some(
            v["token_types"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap() as i32)
                .collect(),
        ),
        merges: Some(strings(&v["merges"])),
        eos: Some(v["eos"].as_u64().unwrap() as u32),
        eot: Some(v["eot"].as_u64().unwrap() as u32),
        ..VocabSpec::default()
    }
}
