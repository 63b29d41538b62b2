//! The input: a plain mirror of a GGUF file's `tokenizer.ggml.*` metadata.

/// A vocabulary as a GGUF file describes it. Each field is the GGUF key named in its doc; a
/// field left `None` means the key is absent, and then llama.cpp's default for that model
/// applies (stated per field).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VocabSpec {
    /// `tokenizer.ggml.model`: `"llama"` (SentencePiece-style) or `"gpt2"` (byte-level BPE).
    /// Anything else is [`crate::TokenizerError::UnknownModel`].
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer of a `gpt2` vocabulary (`"default"`, `"gpt-2"`,
    /// `"llama-bpe"`, `"qwen2"`, `"deepseek-v3"`, ...; see [`crate::SUPPORTED_PRE`]). Absent means
    /// `"default"`, as in llama.cpp. Ignored for `llama` vocabularies, which have none.
    pub pre: Option<String>,
    /// `general.architecture`. Only read for `llama` vocabularies: `gemma`, `gemma2` and `gemma3`
    /// files get the two corrections Hugging Face applies to them (whitespace tokens stored as
    /// real spaces are looked up as `▁`s, and merges are ranked by file order, not by score).
    pub architecture: Option<String>,
    /// `tokenizer.ggml.tokens`: token texts, indexed by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`: merge priority of each token in a `llama` vocabulary (higher
    /// merges first). Absent: all 0. Must have one entry per token when present.
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`: 0 undefined, 1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte. Absent: all normal. One entry per token.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs, best first. Required for `gpt2`; for
    /// `llama`, when present they replace the merges derived from the vocabulary.
    pub merges: Option<Vec<String>>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`: what a `llama` vocabulary emits for a character that has
    /// neither a token nor byte tokens.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`. Absent: found by text (`<end_of_turn>`, `<|im_end|>`,
    /// `<|eot_id|>`, ...), as llama.cpp does.
    pub eot: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`. Absent: true for `llama` and for the llama3 family of
    /// pre-tokenizers, false otherwise (llama.cpp's defaults).
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`. Absent: false.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix`: put a space before the text (and after each special
    /// token), SentencePiece's dummy prefix. Absent: true for `llama`. Ignored for `gpt2`.
    pub add_space_prefix: Option<bool>,
}

/// `tokenizer.ggml.token_type` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    /// The type a GGUF `token_type` value stands for, or `None` outside 0..=6.
    pub fn from_gguf(value: i32) -> Option<TokenType> {
        Some(match value {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }

    /// Control and unknown tokens: matched in text only when asked to parse special tokens,
    /// never built by merges, left out of decoded text on request.
    pub fn is_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::Unknown)
    }
}

/// Which algorithm a vocabulary uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    /// `tokenizer.ggml.model = "llama"`: SentencePiece-style merges over characters, spaces as
    /// `▁`, byte-fallback tokens `<0xXX>`.
    SentencePiece,
    /// `tokenizer.ggml.model = "gpt2"`: a regex pre-tokenizer, then ranked merges over bytes
    /// spelled in GPT-2's printable byte alphabet.
    ByteLevelBpe,
}
