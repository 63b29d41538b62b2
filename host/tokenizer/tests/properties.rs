//! Properties over arbitrary text: encoding never panics, and decoding gives the text back
//! (byte-level BPE is lossless; gemma-3 has all 256 byte tokens, so only a literal `▁`, which
//! SentencePiece reads as a space, does not come back).

mod common;

use proptest::prelude::*;
use pulsar_tokenizer::Tokenizer;
use std::sync::OnceLock;

fn gemma() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(common::gemma)
}

fn bpe() -> &'static [Tokenizer] {
    static TOKS: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    TOKS.get_or_init(|| {
        ["default", "llama-bpe", "qwen2", "deepseek-v3"]
            .iter()
            .map(|pre| Tokenizer::new(common::bpe_spec(pre)).unwrap())
            .collect()
    })
}

/// Arbitrary text, weighted towards what tokenizers find hard: whitespace runs, digits,
/// special-token fragments, combining marks.
fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        any::<String>(),
        "[ \t\n\r]{1,6}",
        "[0-9]{1,12}",
        Just("<start_of_turn>".to_string()),
        Just("<|im_end|>".to_string()),
        Just("<think>".to_string()),
        "[a-zA-Z'\u{300}-\u{36f}]{1,8}",
    ];
    prop::collection::vec(piece, 0..8).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn byte_level_round_trips(s in text(), parse_special: bool) {
        for t in bpe() {
            prop_assert_eq!(t.decode(&t.encode(&s, false, parse_special)), s.clone());
        }
    }

    #[test]
    fn gemma_round_trips_without_the_space_mark(s in text(), parse_special: bool) {
        let s = s.replace('▁', "_");
        let t = gemma();
        let ids = t.encode(&s, true, parse_special);
        prop_assert_eq!(ids[0], t.bos().unwrap());
        prop_assert_eq!(t.decode(&ids[1..]), s);
    }
}
