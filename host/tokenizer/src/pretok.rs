//! Pre-tokenizers of byte-level BPE vocabularies: the text is cut into words by a list of
//! regexes before merging, each regex splitting the pieces the previous one left (Hugging Face's
//! `Split(..., behavior="isolated")`: matches and the gaps between them both become pieces).
//!
//! The regexes are the ones the models' own `tokenizer.json` files carry, run by `fancy-regex`.
//! They need look-ahead (`\s+(?!\S)`) and Unicode classes (`\p{L}`, `\p{N}`, ...); a regex
//! engine runs each one exactly as written, where a hand-written scanner per family would be a
//! second, unchecked spelling of the same regex. The cost is one dependency (on `regex`).

use crate::TokenizerError;
use fancy_regex::{Regex, RegexBuilder};

/// GPT-2's regex, as Hugging Face's `ByteLevel` pre-tokenizer spells it.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// llama.cpp's fallback list for `default` (and a missing `tokenizer.ggml.pre`).
const DEFAULT: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
);
const DEEPSEEK_V3: &[&str] = &[
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    concat!(
        r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"##,
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];

/// Kimi K2's (`tokenization_kimi.py`'s tiktoken `pat_str`): Han runs alone, o200k-style cased
/// words whose letter classes exclude Han (set intersection), digits by three.
const KIMI_K2: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
);

/// How one family of `tokenizer.ggml.pre` names tokenizes.
struct Family {
    names: &'static [&'static str],
    regexes: &'static [&'static str],
    /// A word that is already a token is emitted whole, without merging (llama3's tokenizer.json
    /// sets `ignore_merges`; llama.cpp does the same for these names).
    ignore_merges: bool,
    /// llama.cpp's `add_bos` default for these names.
    add_bos: bool,
}

const FAMILIES: &[Family] = &[
    Family {
        names: &["default"],
        regexes: DEFAULT,
        ignore_merges: false,
        add_bos: false,
    },
    Family {
        names: &["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4"],
        regexes: &[GPT2],
        ignore_merges: false,
        add_bos: false,
    },
    Family {
        names: &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ],
        regexes: &[LLAMA3],
        ignore_merges: true,
        add_bos: true,
    },
    Family {
        names: &["dbrx", "smaug-bpe"],
        regexes: &[LLAMA3],
        ignore_merges: false,
        add_bos: false,
    },
    Family {
        names: &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
        ],
        regexes: &[QWEN2],
        ignore_merges: false,
        add_bos: false,
    },
    Family {
        names: &["qwen35"],
        regexes: &[QWEN35],
        ignore_merges: false,
        add_bos: false,
    },
    Family {
        names: &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        regexes: &[GPT4O],
        ignore_merges: false,
        add_bos: false,
    },
    Family {
        names: &["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        regexes: DEEPSEEK_V3,
        ignore_merges: false,
        add_bos: false,
    },
    Family {
        names: &["kimi-k2"],
        regexes: &[KIMI_K2],
        ignore_merges: false,
        add_bos: false,
    },
];

/// Every `tokenizer.ggml.pre` value a `gpt2` vocabulary may carry here.
pub const SUPPORTED: &[&str] = &[
    "default",
    "gpt-2",
    "gpt2",
    "phi-2",
    "mpt",
    "olmo",
    "jais",
    "exaone4",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "dbrx",
    "smaug-bpe",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "megrez",
    "stablelm2",
    "hunyuan",
    "solar-open",
    "qwen35",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "minimax-m2",
    "deepseek-v3",
    "hunyuan-dense",
    "joyai-llm",
    "hy_v4",
    "kimi-k2",
];

/// A compiled pre-tokenizer.
#[derive(Debug)]
pub(crate) struct PreTokenizer {
    regexes: Vec<Regex>,
    pub ignore_merges: bool,
    pub add_bos: bool,
}

impl PreTokenizer {
    pub(crate) fn for_name(pre: &str) -> Result<PreTokenizer, TokenizerError> {
        let family = FAMILIES
            .iter()
            .find(|f| f.names.contains(&pre))
            .ok_or_else(|| TokenizerError::UnknownPre(pre.to_string()))?;
        let regexes = family
            .regexes
            .iter()
            .map(|r| {
                RegexBuilder::new(r)
                    // Long whitespace runs backtrack once per character; keep the default limit
                    // from cutting a large input short.
                    .backtrack_limit(100_000_000)
                    .build()
                    .map_err(|e| TokenizerError::Regex {
                        pre: pre.to_string(),
                        message: e.to_string(),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(PreTokenizer {
            regexes,
            ignore_merges: family.ignore_merges,
            add_bos: family.add_bos,
        })
    }

    /// Cuts `text` into words, in order, together covering all of it.
    pub(crate) fn split<'t>(&self, text: &'t str, out: &mut Vec<&'t str>) {
        out.clear();
        out.push(text);
        for re in &self.regexes {
            let pieces = std::mem::take(out);
            for piece in pieces {
                split_isolated(re, piece, out);
            }
        }
    }
}

fn split_isolated<'t>(re: &Regex, text: &'t str, out: &mut Vec<&'t str>) {
    let mut last = 0;
    for found in re.find_iter(text) {
        // An engine error (backtrack limit) leaves the rest of this piece whole.
        let Ok(m) = found else { break };
        if m.start() > last {
            out.push(&text[last..m.start()]);
        }
        if m.end() > m.start() {
            out.push(m.as_str());
        }
        last = m.end();
    }
    if last < text.len() {
        out.push(&text[last..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: &str, text: &str) -> Vec<String> {
        let p = PreTokenizer::for_name(pre).unwrap();
        let mut out = Vec::new();
        p.split(text, &mut out);
        assert_eq!(out.concat(), text, "pieces must cover the text");
        out.into_iter().map(String::from).collect()
    }

    #[test]
    fn every_supported_name_compiles_and_is_listed() {
        for name in SUPPORTED {
            PreTokenizer::for_name(name).unwrap();
        }
        let listed: usize = FAMILIES.iter().map(|f| f.names.len()).sum();
        assert_eq!(listed, SUPPORTED.len());
        assert!(
            matches!(PreTokenizer::for_name("nope"), Err(TokenizerError::UnknownPre(n)) if n == "nope")
        );
    }

    #[test]
    fn gpt2_keeps_a_trailing_space_before_a_word_separate() {
        assert_eq!(words("gpt-2", "a  b"), ["a", " ", " b"]);
        assert_eq!(words("gpt-2", "it's 12"), ["it", "'s", " 12"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_qwen2_by_one() {
        assert_eq!(words("llama-bpe", "12345"), ["123", "45"]);
        assert_eq!(words("qwen2", "123"), ["1", "2", "3"]);
        assert_eq!(words("llama3", "x\n\n y"), ["x", "\n\n", " y"]);
    }

    #[test]
    fn deepseek_v3_isolates_cjk_and_digit_groups() {
        assert_eq!(
            words("deepseek-v3", "ab日本語1234"),
            ["ab", "日本語", "123", "4"]
        );
    }

    #[test]
    fn default_splits_punctuation_first() {
        assert_eq!(
            words("default", "a,b 1234"),
            ["a", ",", "b", " ", "123", "4"]
        );
    }
}
