//! A small byte-level BPE vocabulary (tests/fixtures/bpe_vocab.json) under each supported
//! pre-tokenizer type, against Hugging Face `tokenizers` configured with that type's regexes
//! (tests/fixtures/bpe_gold.json, made by tools/tokgold/gen.py).

mod common;

use common::{bpe_spec, fixture, ids, strings};
use pulsar_tokenizer::Tokenizer;

fn show(t: &Tokenizer, ids: &[u32]) -> String {
    let texts: Vec<String> = ids
        .iter()
        .map(|&i| format!("{i}:{:?}", t.token_text(i).unwrap_or("?")))
        .collect();
    texts.join(" ")
}

#[test]
fn ids_match_hugging_face_for_every_pre_tokenizer() {
    let gold = fixture("bpe_gold.json");
    let texts = strings(&gold["texts"]);
    let pres = gold["pre"].as_object().unwrap();
    for required in [
        "default",
        "gpt-2",
        "llama-bpe",
        "qwen2",
        "qwen35",
        "gpt-4o",
        "deepseek-v3",
        "kimi-k2",
    ] {
        assert!(
            pres.contains_key(required),
            "gold for {required} is missing"
        );
    }
    let mut failures = Vec::new();
    for (pre, runs) in pres {
        let t = Tokenizer::new(bpe_spec(pre)).unwrap();
        for (what, parse_special) in [("ids", true), ("ids_no_parse_special", false)] {
            for (text, want) in texts.iter().zip(runs[what].as_array().unwrap()) {
                let got = t.encode(text, false, parse_special);
                let want = ids(want);
                if got != want {
                    failures.push(format!(
                        "{pre} {what} {text:?}\n  got  {}\n  want {}",
                        show(&t, &got),
                        show(&t, &want)
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn round_trip_and_streaming() {
    let texts = strings(&fixture("bpe_gold.json")["texts"]);
    for pre in [
        "default",
        "gpt-2",
        "llama-bpe",
        "qwen2",
        "qwen35",
        "gpt-4o",
        "deepseek-v3",
        "kimi-k2",
    ] {
        let t = Tokenizer::new(bpe_spec(pre)).unwrap();
        for text in &texts {
            for parse_special in [true, false] {
                let ids = t.encode(text, false, parse_special);
                assert_eq!(
                    &t.decode(&ids),
                    text,
                    "{pre}, parse_special = {parse_special}"
                );
                let mut stream = t.stream_decoder(false);
                let streamed: String = ids.iter().map(|&i| stream.push(i)).collect();
                assert_eq!(streamed + &stream.finish(), *text, "{pre}: streamed");
            }
        }
    }
}

#[test]
fn emoji_split_across_tokens_streams_whole() {
    let t = Tokenizer::new(bpe_spec("qwen2")).unwrap();
    let ids = t.encode("🫨", false, true);
    assert!(
        ids.len() > 1,
        "the fixture vocabulary has no token for this emoji"
    );
    let mut stream = t.stream_decoder(false);
    let pieces: Vec<String> = ids.iter().map(|&i| stream.push(i)).collect();
    assert!(
        pieces[..pieces.len() - 1].iter().all(String::is_empty),
        "{pieces:?}"
    );
    assert_eq!(pieces.last().unwrap(), "🫨");
}

#[test]
fn chat_markers() {
    let t = Tokenizer::new(bpe_spec("qwen2")).unwrap();
    let start = t.token_id("<|im_start|>").unwrap();
    let end = t.token_id("<|im_end|>").unwrap();
    let eot = t.token_id("<|endoftext|>").unwrap();
    assert_eq!(t.encode("<|im_start|>hi<|im_end|>", false, true)[0], start);
    assert!(t.is_control(end));
    assert_eq!((t.eos(), t.eot()), (Some(eot), Some(end)));
    assert_eq!(t.stop_tokens(), [eot, end]);
    assert_eq!(
        t.decode_skip_special(&t.encode("<|im_start|>hi<|im_end|>", false, true)),
        "hi"
    );
    // A user-defined token is matched even when special tokens are not parsed.
    let think = t.token_id("<think>").unwrap();
    assert!(t.encode("<think>x", false, false).starts_with(&[think]));
}
