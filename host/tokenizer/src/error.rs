//! The one error type: every inconsistency in a vocabulary names the GGUF key or token at fault.

/// Why a [`crate::VocabSpec`] could not become a [`crate::Tokenizer`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "unknown tokenizer model {0:?} (tokenizer.ggml.model); supported: \"llama\", \"gpt2\""
    )]
    UnknownModel(String),
    #[error("unknown pre-tokenizer {0:?} (tokenizer.ggml.pre) for a gpt2 vocabulary; supported: {supported}", supported = crate::pretok::SUPPORTED.join(", "))]
    UnknownPre(String),
    #[error("the vocabulary is empty (tokenizer.ggml.tokens)")]
    EmptyVocab,
    #[error("tokenizer.ggml.tokens has {0} entries; token ids are 32-bit")]
    VocabTooLarge(usize),
    #[error("{key} has {got} entries but tokenizer.ggml.tokens has {expected}")]
    LengthMismatch {
        key: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("token {id} has type {value} in tokenizer.ggml.token_type, which is not a GGUF token type (0..=6)")]
    BadTokenType { id: u32, value: i32 },
    #[error("token {text:?} appears twice in tokenizer.ggml.tokens, as ids {first} and {second}")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },
    #[error("{key} = {id} is outside the vocabulary of {vocab_size} tokens")]
    IdOutOfRange {
        key: &'static str,
        id: u32,
        vocab_size: usize,
    },
    #[error("{flag} is true but {key} is not set")]
    MissingSpecial {
        flag: &'static str,
        key: &'static str,
    },
    #[error("token {id} has the byte type but is spelled {text:?}, not <0xXX>")]
    BadByteToken { id: u32, text: String },
    #[error("a gpt2 vocabulary needs tokenizer.ggml.merges, and this one has none")]
    MissingMerges,
    #[error("tokenizer.ggml.merges[{index}] = {merge:?} is not two tokens separated by a space")]
    BadMerge { index: usize, merge: String },
    #[error("tokenizer.ggml.merges[{index}] = {merge:?} names {token:?}, which is not in the vocabulary")]
    MergeUnknownToken {
        index: usize,
        merge: String,
        token: String,
    },
    #[error("pre-tokenizer {pre:?}: its regex did not compile: {message}")]
    Regex { pre: String, message: String },
}
