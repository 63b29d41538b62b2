//! Throughput of building tokenizers and encoding ~100 KB of varied text.
//! `cargo bench -p pulsar-tokenizer` (release), or `--profile dev` for debug-build numbers.
//! Needs the gemma-3 GGUF (scripts/fetch-gemma.sh); prints one line per measurement.

#[path = "../tests/common/mod.rs"]
mod common;

use pulsar_tokenizer::Tokenizer;
use std::time::{Duration, Instant};

fn corpus_100k() -> String {
    let texts = common::strings(&common::fixture("bpe_gold.json")["texts"]);
    let mut text = String::new();
    while text.len() < 100_000 {
        for t in &texts {
            text.push_str(t);
            text.push('\n');
        }
    }
    text
}

fn time<T>(what: &str, bytes: usize, mut f: impl FnMut() -> T) -> T {
    let start = Instant::now();
    let mut runs = 0u32;
    let mut out;
    loop {
        out = f();
        runs += 1;
        if start.elapsed() > Duration::from_secs(2) || runs >= 50 {
            break;
        }
    }
    let per = start.elapsed() / runs;
    let rate = if bytes > 0 {
        format!(", {:.1} MB/s", bytes as f64 / per.as_secs_f64() / 1e6)
    } else {
        String::new()
    };
    println!("{what}: {per:?} per run over {runs} runs{rate}");
    out
}

fn main() {
    let text = corpus_100k();
    let long_word = "x".repeat(100_000);
    let gemma = time(
        "gemma-3 build (262k tokens, merges derived)",
        0,
        common::gemma,
    );
    let ids = time("gemma-3 encode 100 KB", text.len(), || {
        gemma.encode(&text, true, true)
    });
    println!("  {} tokens", ids.len());
    time(
        "gemma-3 encode a 100 KB run of one letter",
        long_word.len(),
        || gemma.encode(&long_word, false, false),
    );
    time("gemma-3 decode", text.len(), || gemma.decode(&ids));
    for pre in ["gpt-2", "llama-bpe", "qwen2", "deepseek-v3"] {
        let t = Tokenizer::new(common::bpe_spec(pre)).unwrap();
        time(&format!("bpe {pre} encode 100 KB"), text.len(), || {
            t.encode(&text, false, true)
        });
        time(
            &format!("bpe {pre} encode a 100 KB word"),
            long_word.len(),
            || t.encode(&long_word, false, true),
        );
    }
}
