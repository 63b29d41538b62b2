//! gemma-3's real vocabulary (read from the GGUF) against the ids Hugging Face's tokenizer gives
//! for the same file (tests/fixtures/gemma3_gold.json, made by tools/tokgold/gen.py).

mod common;

use common::{fixture, gemma, ids};
use pulsar_tokenizer::{TokenType, Tokenizer, VocabKind};
use std::sync::OnceLock;

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(gemma)
}

fn show(t: &Tokenizer, ids: &[u32]) -> String {
    let texts: Vec<String> = ids
        .iter()
        .map(|&i| format!("{i}:{:?}", t.token_text(i).unwrap_or("?")))
        .collect();
    texts.join(" ")
}

#[test]
fn ids_match_hugging_face() {
    let t = tok();
    let gold = fixture("gemma3_gold.json");
    let mut failures = Vec::new();
    let cases = gold["cases"].as_array().unwrap();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let runs = [
            ("ids", t.encode(text, false, true), &case["ids"]),
            (
                "ids_add_special",
                t.encode(text, true, true),
                &case["ids_add_special"],
            ),
            (
                "ids_no_parse_special",
                t.encode(text, false, false),
                &case["ids_no_parse_special"],
            ),
        ];
        for (what, got, want) in runs {
            let want = ids(want);
            if got != want {
                failures.push(format!(
                    "{text:?} {what}\n  got  {}\n  want {}",
                    show(t, &got),
                    show(t, &want)
                ));
            }
        }
    }
    assert!(cases.len() > 40, "the corpus is missing");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn decode_matches_hugging_face() {
    let t = tok();
    for case in fixture("gemma3_gold.json")["cases"].as_array().unwrap() {
        let want = case["decoded"].as_str().unwrap();
        assert_eq!(
            t.decode(&ids(&case["ids"])),
            want,
            "decoding the ids of {:?}",
            case["text"]
        );
    }
}

#[test]
fn round_trip() {
    let t = tok();
    for case in fixture("gemma3_gold.json")["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        if text.contains('▁') {
            continue; // a literal ▁ is a space to SentencePiece and decodes as one
        }
        for parse_special in [true, false] {
            let ids = t.encode(text, false, parse_special);
            assert_eq!(t.decode(&ids), text, "parse_special = {parse_special}");
        }
        // BOS is a control token: left out when skipping special tokens.
        assert_eq!(t.decode_skip_special(&t.encode(text, true, false)), text);
    }
}

#[test]
fn stream_decoding_holds_back_split_characters() {
    let t = tok();
    // U+1FAE8 and U+1FABF have no tokens in gemma-3: each falls back to four byte tokens.
    let text = "new emoji 🫨 and 🪿 geese";
    let ids = t.encode(text, false, true);
    let bytes: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&i| t.token_type(i) == Some(TokenType::Byte))
        .collect();
    assert_eq!(bytes.len(), 8, "{}", show(t, &ids));
    let mut stream = t.stream_decoder(true);
    let pieces: Vec<String> = ids.iter().map(|&i| stream.push(i)).collect();
    assert_eq!(
        pieces.iter().filter(|p| p.is_empty()).count(),
        6,
        "three byte tokens of each wait: {pieces:?}"
    );
    assert!(
        pieces.contains(&"🫨".to_string()) && pieces.contains(&"🪿".to_string()),
        "{pieces:?}"
    );
    assert_eq!(pieces.concat() + &stream.finish(), text);
}

#[test]
fn vocabulary_facts() {
    let t = tok();
    assert_eq!(t.kind(), VocabKind::SentencePiece);
    assert_eq!(t.vocab_size(), 262_144);
    assert_eq!(
        (t.bos(), t.eos(), t.unk(), t.pad()),
        (Some(2), Some(1), Some(3), Some(0))
    );
    assert!(t.add_bos() && !t.add_eos());
    let start = t.token_id("<start_of_turn>").unwrap();
    let end = t.token_id("<end_of_turn>").unwrap();
    assert_eq!((start, end), (105, 106));
    assert!(t.is_control(start) && !t.is_control(t.token_id("▁the").unwrap()));
    assert_eq!(t.eot(), Some(end));
    assert_eq!(t.stop_tokens(), [1, 106]);
    assert_eq!(
        t.token_bytes(t.token_id("<0x0A>").unwrap()),
        Some(&b"\n"[..])
    );
    assert_eq!(
        t.token_bytes(t.token_id("▁the").unwrap()),
        Some(&b" the"[..])
    );
    assert_eq!(
        t.token_bytes(138),
        Some(&b"  "[..]),
        "a whitespace token stored with real spaces"
    );
    assert!(
        t.merge_count() > 500_000,
        "merges are derived from the vocabulary"
    );
}

#[test]
fn long_text_round_trips() {
    let t = tok();
    let gold = fixture("gemma3_gold.json");
    let mut text = String::new();
    for case in gold["cases"].as_array().unwrap().iter().cycle() {
        let s = case["text"].as_str().unwrap();
        if !s.contains('▁') {
            text.push_str(s);
            text.push('\n');
        }
        if text.len() > 100_000 {
            break;
        }
    }
    text.push_str(&"x".repeat(20_000)); // one long run the merges must handle
    let ids = t.encode(&text, false, false);
    assert!(ids.len() > 10_000);
    assert_eq!(t.decode(&ids), text);
}
