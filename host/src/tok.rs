//! The tokenizer a GGUF describes, built from its `tokenizer.ggml.*` keys.

use pulsar_gguf::{Array, GgufFile};
use pulsar_tokenizer::{Tokenizer, VocabSpec};

fn str_array(f: &GgufFile, key: &str) -> anyhow::Result<Option<Vec<String>>> {
    Ok(match f.get(key) {
        None => None,
        Some(v) => match v.as_array() {
            Some(Array::String(s)) => Some(s.clone()),
            _ => anyhow::bail!("metadata key `{key}`: expected an array of strings"),
        },
    })
}

fn u32_key(f: &GgufFile, key: &str) -> anyhow::Result<Option<u32>> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => match v.as_i128() {
            Some(n) if (0..=u32::MAX as i128).contains(&n) => Ok(Some(n as u32)),
            _ => anyhow::bail!("metadata key `{key}`: expected a token id"),
        },
    }
}

fn bool_key(f: &GgufFile, key: &str) -> anyhow::Result<Option<bool>> {
    Ok(f.metadata().get_bool(key)?)
}

pub fn vocab_spec(f: &GgufFile) -> anyhow::Result<VocabSpec> {
    let model = f
        .metadata()
        .get_str("tokenizer.ggml.model")?
        .ok_or_else(|| anyhow::anyhow!("the model has no tokenizer (metadata key `tokenizer.ggml.model` is missing)"))?
        .to_string();
    let tokens = str_array(f, "tokenizer.ggml.tokens")?
        .ok_or_else(|| anyhow::anyhow!("metadata key `tokenizer.ggml.tokens` is missing"))?;
    let scores = match f.get("tokenizer.ggml.scores").and_then(|v| v.as_array()) {
        Some(Array::F32(s)) => Some(s.clone()),
        Some(_) => anyhow::bail!("metadata key `tokenizer.ggml.scores`: expected an array of f32"),
        None => None,
    };
    let token_types = match f.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
        Some(Array::I32(t)) => Some(t.clone()),
        Some(Array::U32(t)) => Some(t.iter().map(|&x| x as i32).collect()),
        Some(_) => anyhow::bail!("metadata key `tokenizer.ggml.token_type`: expected an array of i32"),
        None => None,
    };
    Ok(VocabSpec {
        model,
        pre: f.metadata().get_str("tokenizer.ggml.pre")?.map(str::to_string),
        architecture: f.metadata().get_str("general.architecture")?.map(str::to_string),
        tokens,
        scores,
        token_types,
        merges: str_array(f, "tokenizer.ggml.merges")?,
        bos: u32_key(f, "tokenizer.ggml.bos_token_id")?,
        eos: u32_key(f, "tokenizer.ggml.eos_token_id")?,
        unk: u32_key(f, "tokenizer.ggml.unknown_token_id")?,
        pad: u32_key(f, "tokenizer.ggml.padding_token_id")?,
        eot: u32_key(f, "tokenizer.ggml.eot_token_id")?,
        add_bos: bool_key(f, "tokenizer.ggml.add_bos_token")?,
        add_eos: bool_key(f, "tokenizer.ggml.add_eos_token")?,
        add_space_prefix: bool_key(f, "tokenizer.ggml.add_space_prefix")?,
    })
}

pub fn load(f: &GgufFile) -> anyhow::Result<Tokenizer> {
    Ok(Tokenizer::new(vocab_spec(f)?)?)
}
