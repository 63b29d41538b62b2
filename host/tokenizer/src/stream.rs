//! Decoding one token at a time, for streaming output: a token can end in the middle of a UTF-8
//! character (byte-fallback tokens, byte-level BPE pieces), so bytes wait until they complete one.

use crate::Tokenizer;

/// Turns generated ids into text as soon as that text is valid UTF-8.
///
/// The concatenation of everything [`push`](Self::push) and [`finish`](Self::finish) return
/// equals [`Tokenizer::decode`] (or `decode_skip_special`) of the same ids, except that the
/// stream keeps the leading space `decode` drops from SentencePiece text with a dummy prefix:
/// generated text continues a prompt, and its first word needs its space.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    pub(crate) fn new(tok: &'a Tokenizer, skip_special: bool) -> StreamDecoder<'a> {
        StreamDecoder {
            tok,
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text it completes (often empty mid-character). Bytes that
    /// can never start a valid character come out as U+FFFD rather than stalling the stream.
    pub fn push(&mut self, id: u32) -> String {
        let piece = self.tok.piece_for_decode(id, self.skip_special, &mut false);
        self.pending.extend_from_slice(piece);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).expect("checked by from_utf8"));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        // An incomplete character at the end: wait for the next token.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }

    /// Ends the stream: whatever is still pending, with U+FFFD for an unfinished character.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }
}
