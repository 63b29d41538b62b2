//! Unit tests on hand-made vocabularies; the gold comparisons with Hugging Face live in tests/.

use super::*;

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A small SentencePiece vocabulary; scores rank merges (higher first).
fn spm_spec() -> VocabSpec {
    let mut tokens = strings(&[
        "<unk>", "<s>", "</s>", "<c>", "<ud>", "▁", "a", "b", "c", "▁a", "ab", "▁ab", "<", "c>",
        ">",
    ]);
    let mut scores = vec![
        0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -1.0, -3.0, -2.0, -4.0, -1.0, -5.0, -1.0,
    ];
    let mut types = vec![2, 3, 3, 3, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];
    for b in [0xC3u8, 0xA9] {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    VocabSpec {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        bos: Some(1),
        eos: Some(2),
        unk: Some(0),
        ..VocabSpec::default()
    }
}

fn tok(spec: VocabSpec) -> Tokenizer {
    Tokenizer::new(spec).unwrap()
}

fn err(spec: VocabSpec) -> TokenizerError {
    Tokenizer::new(spec).unwrap_err()
}

fn id(t: &Tokenizer, text: &str) -> u32 {
    t.token_id(text)
        .unwrap_or_else(|| panic!("{text:?} not in vocab"))
}

#[test]
fn spm_adds_the_space_prefix_and_merges_by_score() {
    let t = tok(spm_spec());
    // "▁ab": ab (-2) beats ▁a (-3); then ▁ + ab = ▁ab.
    assert_eq!(t.encode("ab", false, false), [id(&t, "▁ab")]);
    assert_eq!(t.encode("ab", true, false), [1, id(&t, "▁ab")]);
    assert_eq!(t.decode(&t.encode("ab", true, false)), "<s>ab");
    assert_eq!(
        t.decode_skip_special(&t.encode("ab ab", true, false)),
        "ab ab"
    );
    // The prefix comes back after a special token too, as llama.cpp does.
    assert_eq!(t.encode("<c>ab", false, true), [3, id(&t, "▁ab")]);
}

#[test]
fn spm_without_space_prefix() {
    let t = tok(VocabSpec {
        add_space_prefix: Some(false),
        ..spm_spec()
    });
    assert_eq!(t.encode("ab", false, false), [id(&t, "ab")]);
    assert_eq!(t.encode(" ab", false, false), [id(&t, "▁ab")]);
    assert_eq!(t.decode(&t.encode(" ab", false, false)), " ab");
    assert_eq!(t.encode("", true, true), [1]);
    assert_eq!(t.encode("", false, true), Vec::<u32>::new());
}

#[test]
fn spm_byte_fallback_and_unknown_runs() {
    let t = tok(VocabSpec {
        add_space_prefix: Some(false),
        ..spm_spec()
    });
    let e9 = [id(&t, "<0xC3>"), id(&t, "<0xA9>")];
    assert_eq!(t.encode("é", false, false), e9);
    assert_eq!(t.decode(&e9), "é");
    assert_eq!(t.token_bytes(e9[0]), Some(&[0xC3u8][..]));
    // No byte tokens for "日" or "本": one <unk> for the run, then the known "a".
    assert_eq!(t.encode("日本a", false, false), [0, id(&t, "a")]);
}

#[test]
fn spm_special_texts_need_parse_special_and_are_never_merged_into() {
    let t = tok(VocabSpec {
        add_space_prefix: Some(false),
        ..spm_spec()
    });
    assert_eq!(t.encode("<c>", false, true), [3]);
    // As plain text "<" + "c>" would merge into the control token's text; it must not.
    assert_eq!(t.encode("<c>", false, false), [id(&t, "<"), id(&t, "c>")]);
    // User-defined tokens are matched either way.
    assert_eq!(t.encode("a<ud>a", false, false), [6, 4, 6]);
}

#[test]
fn gemma_ranks_by_file_order_and_respells_space_tokens() {
    // By score "▁a" (-1) would merge before "ab" (-2); gemma files rank by position instead.
    let spec = VocabSpec {
        model: "llama".into(),
        tokens: strings(&["<pad>", "<bos>", "  ", "ab", "▁a", "▁", "a", "b"]),
        scores: Some(vec![0.0, 0.0, -9.0, -2.0, -1.0, 0.0, 0.0, 0.0]),
        token_types: Some(vec![3, 3, 4, 1, 1, 1, 1, 1]),
        bos: Some(1),
        add_space_prefix: Some(false),
        ..VocabSpec::default()
    };
    let by_score = tok(spec.clone());
    assert_eq!(by_score.encode(" ab", false, true), [4, 7]);
    // A user-defined "  " is cut out of the text whole where it is not respelled.
    assert_eq!(by_score.encode("a  b", false, true), [6, 2, 7]);

    let gemma = tok(VocabSpec {
        architecture: Some("gemma3".into()),
        ..spec
    });
    assert_eq!(gemma.encode(" ab", false, true), [5, 3]);
    // "  " is looked up as "▁▁" and built by merges, ranked first by its position.
    assert_eq!(gemma.encode("a  b", false, true), [6, 2, 7]);
    assert_eq!(gemma.encode("   ", false, true), [2, 5]);
    assert_eq!(gemma.token_id("  "), Some(2));
    assert_eq!(gemma.token_id("▁▁"), None);
    assert_eq!(gemma.decode(&[6, 2, 7]), "a  b");
}

#[test]
fn spm_file_merges_replace_derived_ones() {
    // With merges in the file, only they apply: "▁ab" has no merge here although both halves
    // and the whole are tokens.
    let t = tok(VocabSpec {
        merges: Some(strings(&["a b", "▁ a"])),
        ..spm_spec()
    });
    assert_eq!(t.merge_count(), 2);
    assert_eq!(t.encode("ab", false, false), [id(&t, "▁"), id(&t, "ab")]);
}

#[test]
fn bos_eos_flags_and_defaults() {
    let t = tok(VocabSpec {
        add_eos: Some(true),
        ..spm_spec()
    });
    assert!(
        t.add_bos(),
        "llama vocabularies add BOS unless told otherwise"
    );
    assert_eq!(t.encode("a", true, false), [1, id(&t, "▁a"), 2]);
    assert_eq!(t.encode("a", false, false), [id(&t, "▁a")]);
    let t = tok(VocabSpec {
        add_bos: Some(false),
        ..spm_spec()
    });
    assert_eq!(t.encode("a", true, false), [id(&t, "▁a")]);
}

/// A byte-level vocabulary: the 256 byte spellings, then the merges' results.
fn bpe_spec(merges: &[&str], extra: &[(&str, i32)]) -> VocabSpec {
    let alphabet = ByteAlphabet::new();
    let mut tokens: Vec<String> = (0..=255u8)
        .map(|b| alphabet.char_of(b).to_string())
        .collect();
    let mut types = vec![1; 256];
    for m in merges {
        let merged = m.replacen(' ', "", 1);
        if !tokens.contains(&merged) {
            tokens.push(merged);
            types.push(1);
        }
    }
    for (text, kind) in extra {
        tokens.push(text.to_string());
        types.push(*kind);
    }
    VocabSpec {
        model: "gpt2".into(),
        pre: Some("gpt-2".into()),
        tokens,
        token_types: Some(types),
        merges: Some(strings(merges)),
        ..VocabSpec::default()
    }
}

#[test]
fn byte_level_merges_by_rank_within_words() {
    let t = tok(bpe_spec(
        &["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o"],
        &[("<|end|>", 3)],
    ));
    assert_eq!(t.kind(), VocabKind::ByteLevelBpe);
    let ids = t.encode("hello wo", false, false);
    assert_eq!(ids, [id(&t, "hello"), id(&t, "Ġwo")]);
    assert_eq!(t.decode(&ids), "hello wo");
    assert_eq!(t.token_bytes(id(&t, "Ġwo")), Some(&b" wo"[..]));
    // Merges never cross the pre-tokenizer's word boundaries: "hell o" is a merge, but here
    // "hell" and "o" are in different words.
    assert_eq!(
        t.encode("hell o", false, false),
        [id(&t, "hell"), id(&t, "Ġ"), id(&t, "o")]
    );
    assert_eq!(t.encode("x<|end|>", false, true), [b'x' as u32, 256 + 6]);
    assert!(t.is_control(256 + 6));
    assert_eq!(t.stop_tokens(), [256 + 6]);
    assert_eq!(t.eot(), Some(256 + 6));
    let e = t.encode("é🫨", false, false);
    assert_eq!(e.len(), 6, "one token per byte without merges");
    assert_eq!(t.decode(&e), "é🫨");
}

#[test]
fn ignore_merges_takes_whole_word_tokens() {
    // "Ġxyz" is a token no merge builds; llama3's pre-tokenizer looks whole words up first.
    let spec = bpe_spec(&["x y"], &[("Ġxyz", 1)]);
    let plain = tok(spec.clone());
    assert_eq!(plain.encode(" xyz", false, false).len(), 3);
    let llama3 = tok(VocabSpec {
        pre: Some("llama-bpe".into()),
        bos: Some(0),
        ..spec
    });
    assert!(
        llama3.add_bos(),
        "llama3 vocabularies add BOS unless told otherwise"
    );
    assert_eq!(llama3.encode(" xyz", false, false), [id(&llama3, "Ġxyz")]);
    assert_eq!(llama3.encode(" xyz", true, false), [0, id(&llama3, "Ġxyz")]);
}

#[test]
fn missing_byte_tokens_are_dropped_in_byte_level() {
    let mut spec = bpe_spec(&[], &[]);
    spec.tokens.truncate(128); // no tokens for bytes >= 0x80
    spec.token_types = None;
    let t = tok(spec);
    assert_eq!(t.encode("aé", false, false), [b'a' as u32]);
}

#[test]
fn stream_decoder_waits_for_whole_characters() {
    let t = tok(bpe_spec(&[], &[("<|im_end|>", 3)]));
    let ids = t.encode("🫨x", false, false);
    assert_eq!(ids.len(), 5);
    let mut s = t.stream_decoder(false);
    let outs: Vec<String> = ids.iter().map(|&i| s.push(i)).collect();
    assert_eq!(outs, ["", "", "", "🫨", "x"]);
    assert!(s.pending().is_empty());
    assert_eq!(s.finish(), "");

    // A byte that can never start a character comes out at once as U+FFFD.
    let mut s = t.stream_decoder(false);
    assert_eq!(s.push(0x80), "\u{FFFD}");
    // An unfinished character at the end is flushed by finish().
    assert_eq!(s.push(0xF0), "");
    assert_eq!(s.pending(), [0xF0]);
    assert_eq!(s.finish(), "\u{FFFD}");

    let end = id(&t, "<|im_end|>");
    let mut s = t.stream_decoder(true);
    assert_eq!(s.push(end), "");
    let mut s = t.stream_decoder(false);
    assert_eq!(s.push(end), "<|im_end|>");
}

#[test]
fn stream_decoder_keeps_the_leading_space_decode_drops() {
    let t = tok(spm_spec());
    let ids = t.encode("ab ab", true, false);
    assert_eq!(t.decode_skip_special(&ids), "ab ab");
    let mut s = t.stream_decoder(true);
    let streamed: String = ids.iter().map(|&i| s.push(i)).collect::<String>() + &s.finish();
    assert_eq!(streamed, " ab ab", "a continuation keeps its first space");
}

#[test]
fn stop_tokens_by_text() {
    let mut spec = spm_spec();
    spec.tokens
        .extend(strings(&["<end_of_turn>", "<|im_end|>"]));
    spec.scores.as_mut().unwrap().extend([0.0, 0.0]);
    spec.token_types.as_mut().unwrap().extend([3, 3]);
    let t = tok(spec);
    let (eot, im_end) = (id(&t, "<end_of_turn>"), id(&t, "<|im_end|>"));
    assert_eq!(t.eos(), Some(2));
    assert_eq!(
        t.eot(),
        Some(im_end),
        "<|im_end|> is earlier in the EOT list"
    );
    assert_eq!(t.stop_tokens(), [2, eot, im_end]);
    assert!(t.is_stop(eot) && !t.is_stop(1));
}

#[test]
fn errors_name_what_is_wrong() {
    let e = err(VocabSpec {
        model: "bert".into(),
        ..spm_spec()
    });
    assert_eq!(e, TokenizerError::UnknownModel("bert".into()));
    assert!(e.to_string().contains("\"bert\""));

    let e = err(VocabSpec {
        pre: Some("nonesuch".into()),
        ..bpe_spec(&[], &[])
    });
    assert!(
        e.to_string().contains("nonesuch") && e.to_string().contains("qwen2"),
        "{e}"
    );

    assert_eq!(
        err(VocabSpec {
            tokens: vec![],
            ..spm_spec()
        }),
        TokenizerError::EmptyVocab
    );

    let mut spec = spm_spec();
    spec.scores.as_mut().unwrap().pop();
    assert_eq!(
        err(spec),
        TokenizerError::LengthMismatch {
            key: "tokenizer.ggml.scores",
            expected: 17,
            got: 16
        }
    );

    let mut spec = spm_spec();
    spec.token_types.as_mut().unwrap()[7] = 9;
    assert_eq!(err(spec), TokenizerError::BadTokenType { id: 7, value: 9 });

    let mut spec = spm_spec();
    spec.tokens[8] = "a".into();
    assert_eq!(
        err(spec),
        TokenizerError::DuplicateToken {
            text: "a".into(),
            first: 6,
            second: 8
        }
    );

    let e = err(VocabSpec {
        eos: Some(99),
        ..spm_spec()
    });
    assert_eq!(
        e,
        TokenizerError::IdOutOfRange {
            key: "tokenizer.ggml.eos_token_id",
            id: 99,
            vocab_size: 17
        }
    );

    let e = err(VocabSpec {
        bos: None,
        add_bos: Some(true),
        ..spm_spec()
    });
    assert!(matches!(
        e,
        TokenizerError::MissingSpecial {
            key: "tokenizer.ggml.bos_token_id",
            ..
        }
    ));
    assert!(
        !tok(VocabSpec {
            bos: None,
            ..spm_spec()
        })
        .add_bos(),
        "the default needs a BOS to add"
    );

    let mut spec = spm_spec();
    spec.tokens[15] = "<0xZZ>".into();
    assert_eq!(
        err(spec),
        TokenizerError::BadByteToken {
            id: 15,
            text: "<0xZZ>".into()
        }
    );

    assert_eq!(
        err(VocabSpec {
            merges: None,
            ..bpe_spec(&[], &[])
        }),
        TokenizerError::MissingMerges
    );

    let e = err(bpe_spec(&["ab"], &[]));
    assert_eq!(
        e,
        TokenizerError::BadMerge {
            index: 0,
            merge: "ab".into()
        }
    );

    let mut spec = bpe_spec(&["a b"], &[]);
    spec.merges.as_mut().unwrap().push("a q".into());
    spec.tokens[b'q' as usize] = "\u{2603}".into();
    assert_eq!(
        err(spec),
        TokenizerError::MergeUnknownToken {
            index: 1,
            merge: "a q".into(),
            token: "q".into()
        }
    );
}

#[test]
fn empty_token_texts_are_kept_but_match_nothing() {
    let mut spec = spm_spec();
    spec.tokens[8] = String::new(); // "c"
    let t = tok(VocabSpec {
        add_space_prefix: Some(false),
        ..spec
    });
    assert_eq!(t.vocab_size(), 17);
    assert_eq!(t.token_bytes(8), Some(&b""[..]));
    assert_eq!(t.token_id(""), None);
    assert_eq!(
        t.encode("c", false, false),
        [0],
        "no token for c any more: <unk>"
    );
}

#[test]
fn tokenizers_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
}
