//! pulsar-tokenizer: the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata.
//!
//! Two vocabulary kinds, chosen by `tokenizer.ggml.model`:
//! - `llama`, SentencePiece-style (gemma, llama 2, ...): spaces become `▁`, the whole text is
//!   merged pair by pair (best pair first, by token score, or by file order for gemma files as
//!   Hugging Face does), characters with no token fall back to `<0xXX>` byte tokens.
//! - `gpt2`, byte-level BPE (llama 3, qwen, deepseek, ...): a regex pre-tokenizer picked by
//!   `tokenizer.ggml.pre` cuts the text into words, then ranked merges run over each word's
//!   bytes, spelled in GPT-2's printable byte alphabet.
//!
//! In both, control and user-defined token texts (`<start_of_turn>`, `<|im_end|>`) are cut out
//! of the text first; control ones only when asked to parse special tokens.
//!
//! ```no_run
//! # fn spec() -> pulsar_tokenizer::VocabSpec { unimplemented!() }
//! let tok = pulsar_tokenizer::Tokenizer::new(spec())?;
//! let ids = tok.encode("<start_of_turn>user\nhi", true, true);
//! let mut out = tok.stream_decoder(true);
//! for &id in &ids {
//!     print!("{}", out.push(id));
//! }
//! print!("{}", out.finish());
//! # Ok::<(), pulsar_tokenizer::TokenizerError>(())
//! ```

mod byte_level;
mod error;
mod merge;
mod pretok;
mod spec;
mod special;
mod stream;
mod tokenizer;

pub use error::TokenizerError;
pub use pretok::SUPPORTED as SUPPORTED_PRE;
pub use spec::{TokenType, VocabKind, VocabSpec};
pub use stream::StreamDecoder;
pub use tokenizer::Tokenizer;
