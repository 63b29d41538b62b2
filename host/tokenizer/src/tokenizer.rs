//! Building a tokenizer from a [`VocabSpec`], and encoding and decoding with it.

use crate::byte_level::ByteAlphabet;
use crate::merge::{Merge, MergeTable, Scratch};
use crate::pretok::PreTokenizer;
use crate::spec::{TokenType, VocabKind, VocabSpec};
use crate::special::{Fragment, SpecialMatcher};
use crate::stream::StreamDecoder;
use crate::TokenizerError;
use rustc_hash::FxHashMap;

/// SentencePiece's visible space.
const SPACE_MARK: char = '▁';

/// Architectures whose `llama` vocabularies get Hugging Face's gemma treatment (its
/// `GGUF_SENTENCEPIECE_BUILDERS`): whitespace tokens stored with real spaces are spelled with
/// `▁`, and merges rank by file order because these files' scores do not follow merge order.
const GEMMA_ARCHITECTURES: &[&str] = &["gemma", "gemma2", "gemma3"];

/// End-of-turn token texts, best first, for files that do not name `tokenizer.ggml.eot_token_id`
/// (llama.cpp finds them the same way).
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts of tokens that end generation (llama.cpp's end-of-generation list).
const STOP_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
];

#[derive(Debug)]
enum Engine {
    SentencePiece {
        /// Single-character tokens, the starting symbols.
        chars: FxHashMap<char, u32>,
        /// `<0xXX>` tokens by byte, for characters with no token.
        byte_tokens: [Option<u32>; 256],
    },
    ByteLevel {
        pre: PreTokenizer,
        alphabet: Box<ByteAlphabet>,
        /// The token spelling each single byte, the starting symbols.
        byte_tokens: [Option<u32>; 256],
    },
}

/// A tokenizer for one vocabulary. Immutable once built; share it freely across threads.
#[derive(Debug)]
pub struct Tokenizer {
    kind: VocabKind,
    engine: Engine,
    texts: Vec<String>,
    types: Vec<TokenType>,
    /// Token by the spelling the encoder looks up (the stored text, except gemma's whitespace
    /// tokens, which are spelled with `▁`).
    pieces: FxHashMap<Box<str>, u32>,
    /// Stored texts that differ from their spelling in `pieces`.
    aliases: FxHashMap<Box<str>, u32>,
    merges: MergeTable,
    specials: SpecialMatcher,
    /// Every token's decoded bytes, back to back; token `i` is `bytes[offsets[i]..offsets[i+1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    ignore_merges: bool,
    stop: Vec<u32>,
}

fn check_len<T>(
    key: &'static str,
    values: &Option<Vec<T>>,
    expected: usize,
) -> Result<(), TokenizerError> {
    match values {
        Some(v) if v.len() != expected => Err(TokenizerError::LengthMismatch {
            key,
            expected,
            got: v.len(),
        }),
        _ => Ok(()),
    }
}

fn check_id(
    key: &'static str,
    id: Option<u32>,
    vocab_size: usize,
) -> Result<Option<u32>, TokenizerError> {
    match id {
        Some(id) if id as usize >= vocab_size => Err(TokenizerError::IdOutOfRange {
            key,
            id,
            vocab_size,
        }),
        _ => Ok(id),
    }
}

/// `<0xXX>` (upper-case hex, as SentencePiece writes them) to its byte.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Python's `str.isspace`, which Hugging Face's gemma respelling uses (it also counts the
/// ASCII separators U+001C..U+001F).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

impl Tokenizer {
    /// Checks the vocabulary and builds the tokenizer it describes.
    pub fn new(spec: VocabSpec) -> Result<Tokenizer, TokenizerError> {
        let kind = match spec.model.as_str() {
            "llama" => VocabKind::SentencePiece,
            "gpt2" => VocabKind::ByteLevelBpe,
            other => return Err(TokenizerError::UnknownModel(other.to_string())),
        };
        let n = spec.tokens.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        if n > u32::MAX as usize {
            return Err(TokenizerError::VocabTooLarge(n));
        }
        check_len("tokenizer.ggml.scores", &spec.scores, n)?;
        check_len("tokenizer.ggml.token_type", &spec.token_types, n)?;
        let types = match &spec.token_types {
            None => vec![TokenType::Normal; n],
            Some(values) => values
                .iter()
                .enumerate()
                .map(|(id, &value)| {
                    TokenType::from_gguf(value).ok_or(TokenizerError::BadTokenType {
                        id: id as u32,
                        value,
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        let bos = check_id("tokenizer.ggml.bos_token_id", spec.bos, n)?;
        let eos = check_id("tokenizer.ggml.eos_token_id", spec.eos, n)?;
        let unk = check_id("tokenizer.ggml.unknown_token_id", spec.unk, n)?;
        let pad = check_id("tokenizer.ggml.padding_token_id", spec.pad, n)?;
        let eot = check_id("tokenizer.ggml.eot_token_id", spec.eot, n)?;

        let pre = match kind {
            VocabKind::ByteLevelBpe => Some(PreTokenizer::for_name(
                spec.pre.as_deref().unwrap_or("default"),
            )?),
            VocabKind::SentencePiece => None,
        };
        let (default_add_bos, ignore_merges) = match &pre {
            Some(p) => (p.add_bos, p.ignore_merges),
            None => (true, false),
        };
        // A default only applies where there is a token to add; a file that asks for one it
        // does not name is an error.
        let add_bos = spec.add_bos.unwrap_or(default_add_bos && bos.is_some());
        let add_eos = spec.add_eos.unwrap_or(false);
        let add_space_prefix =
            kind == VocabKind::SentencePiece && spec.add_space_prefix.unwrap_or(true);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                flag: "tokenizer.ggml.add_bos_token",
                key: "tokenizer.ggml.bos_token_id",
            });
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                flag: "tokenizer.ggml.add_eos_token",
                key: "tokenizer.ggml.eos_token_id",
            });
        }
        let gemma = kind == VocabKind::SentencePiece
            && spec
                .architecture
                .as_deref()
                .is_some_and(|a| GEMMA_ARCHITECTURES.contains(&a));

        let (pieces, aliases, spelled_differently) = piece_maps(&spec.tokens, gemma)?;

        for (id, &t) in types.iter().enumerate() {
            if t == TokenType::Byte
                && parse_byte_token(&spec.tokens[id]).is_none()
                && kind == VocabKind::SentencePiece
            {
                return Err(TokenizerError::BadByteToken {
                    id: id as u32,
                    text: spec.tokens[id].clone(),
                });
            }
        }

        let alphabet = ByteAlphabet::new();
        let (bytes, offsets) = decoded_bytes(kind, &spec.tokens, &types, &alphabet);

        // Texts cut out before tokenizing. Gemma's respelled whitespace tokens are left to the
        // merges instead, as Hugging Face does (it no longer knows them by their stored text).
        let mut specials = SpecialMatcher::new();
        for (id, text) in spec.tokens.iter().enumerate() {
            let t = types[id];
            if (t.is_special() || t == TokenType::UserDefined) && !spelled_differently[id] {
                specials.insert(text, id as u32, t.is_special());
            }
        }

        let merges = match (&spec.merges, kind) {
            (Some(lines), _) => merges_from_file(lines, &pieces)?,
            (None, VocabKind::SentencePiece) => {
                let order = if gemma {
                    SpmOrder::FilePosition
                } else {
                    SpmOrder::Score(spec.scores.as_deref())
                };
                merges_from_vocab(&pieces, n, &types, order)
            }
            (None, VocabKind::ByteLevelBpe) => return Err(TokenizerError::MissingMerges),
        };

        let engine = match pre {
            None => {
                let mut chars = FxHashMap::default();
                for (spelling, &id) in &pieces {
                    let mut it = spelling.chars();
                    if let (Some(c), None) = (it.next(), it.next()) {
                        chars.insert(c, id);
                    }
                }
                let mut byte_tokens = [None; 256];
                for (b, slot) in byte_tokens.iter_mut().enumerate() {
                    *slot = pieces.get(format!("<0x{b:02X}>").as_str()).copied();
                }
                Engine::SentencePiece { chars, byte_tokens }
            }
            Some(pre) => {
                let mut byte_tokens = [None; 256];
                for (b, slot) in byte_tokens.iter_mut().enumerate() {
                    *slot = pieces
                        .get(alphabet.char_of(b as u8).to_string().as_str())
                        .copied();
                }
                Engine::ByteLevel {
                    pre,
                    alphabet: Box::new(alphabet),
                    byte_tokens,
                }
            }
        };

        let by_text = |t: &str| {
            pieces
                .get(t)
                .copied()
                .filter(|&id| spec.tokens[id as usize] == t)
        };
        let eot = eot.or_else(|| EOT_TEXTS.iter().find_map(|t| by_text(t)));
        let mut stop: Vec<u32> = eos
            .into_iter()
            .chain(eot)
            .chain(STOP_TEXTS.iter().filter_map(|t| by_text(t)))
            .collect();
        // gpt-oss style vocabularies end a message with <|end|> but a turn with <|return|> or
        // <|call|>; there <|end|> must not stop generation (llama.cpp's rule).
        if by_text("<|return|>").is_some() && by_text("<|call|>").is_some() {
            if let Some(end) = by_text("<|end|>") {
                stop.retain(|&id| id != end || Some(id) == eos || Some(id) == spec.eot);
            }
        }
        stop.sort_unstable();
        stop.dedup();

        Ok(Tokenizer {
            kind,
            engine,
            texts: spec.tokens,
            types,
            pieces,
            aliases,
            merges,
            specials,
            bytes,
            offsets,
            bos,
            eos,
            eot,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            ignore_merges,
            stop,
        })
    }

    /// Which algorithm this vocabulary uses.
    pub fn kind(&self) -> VocabKind {
        self.kind
    }

    /// Token ids for `text`. `add_special`: put BOS/EOS around it where the vocabulary asks for
    /// them (`add_bos`, `add_eos`). `parse_special`: control-token texts in `text` (such as
    /// `<start_of_turn>`) become their ids; otherwise they are tokenized as plain text.
    /// User-defined tokens are always matched whole, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut fragments = Vec::new();
        if self.specials.is_empty() {
            if !text.is_empty() {
                fragments.push(Fragment::Text(text));
            }
        } else {
            self.specials.split(text, parse_special, &mut fragments);
        }
        let mut scratch = Scratch::default();
        let mut ids = Vec::new();
        let mut after_special = true;
        for fragment in fragments {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    match &self.engine {
                        Engine::SentencePiece { chars, byte_tokens } => {
                            // llama.cpp prefixes a space at the start and after each special token.
                            let mut escaped = String::with_capacity(t.len() + 3);
                            if self.add_space_prefix && after_special {
                                escaped.push(SPACE_MARK);
                            }
                            escaped
                                .extend(t.chars().map(|c| if c == ' ' { SPACE_MARK } else { c }));
                            self.spm_symbols(&escaped, chars, byte_tokens, &mut ids);
                            self.merges.apply(&mut ids, &mut scratch);
                            out.extend_from_slice(&ids);
                        }
                        Engine::ByteLevel {
                            pre,
                            alphabet,
                            byte_tokens,
                        } => {
                            let mut words = Vec::new();
                            pre.split(t, &mut words);
                            let mut spelled = String::new();
                            for word in words {
                                if self.ignore_merges {
                                    spelled.clear();
                                    alphabet.spell(word.as_bytes(), &mut spelled);
                                    if let Some(&id) = self.pieces.get(spelled.as_str()) {
                                        out.push(id);
                                        continue;
                                    }
                                }
                                ids.clear();
                                // A byte with no token is dropped, as both references do.
                                ids.extend(word.bytes().filter_map(|b| byte_tokens[b as usize]));
                                self.merges.apply(&mut ids, &mut scratch);
                                out.extend_from_slice(&ids);
                            }
                        }
                    }
                    after_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Starting symbols of an escaped SentencePiece text: one per character, or its `<0xXX>`
    /// byte tokens when it has no token (all of them, or else one unknown token per run).
    fn spm_symbols(
        &self,
        text: &str,
        chars: &FxHashMap<char, u32>,
        byte_tokens: &[Option<u32>; 256],
        ids: &mut Vec<u32>,
    ) {
        ids.clear();
        let mut last_unknown = false;
        let mut utf8 = [0u8; 4];
        for c in text.chars() {
            if let Some(&id) = chars.get(&c) {
                ids.push(id);
                last_unknown = false;
                continue;
            }
            let encoded = c.encode_utf8(&mut utf8).as_bytes();
            if encoded.iter().all(|&b| byte_tokens[b as usize].is_some()) {
                ids.extend(encoded.iter().filter_map(|&b| byte_tokens[b as usize]));
                last_unknown = false;
            } else if let Some(unk) = self.unk {
                if !last_unknown {
                    ids.push(unk);
                }
                last_unknown = true;
            }
        }
    }

    /// The text of `ids`, special tokens included (as Hugging Face's `decode` by default).
    /// Ids outside the vocabulary are skipped; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_inner(ids, false)
    }

    /// The text of `ids` without control and unknown tokens: what a user should see.
    pub fn decode_skip_special(&self, ids: &[u32]) -> String {
        self.decode_inner(ids, true)
    }

    fn decode_inner(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        let mut strip = self.add_space_prefix;
        for &id in ids {
            bytes.extend_from_slice(self.piece_for_decode(id, skip_special, &mut strip));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes `id` contributes to a decode. While `strip` is set, the first piece of text
    /// (after any leading special tokens) loses one leading space: the one SentencePiece's dummy
    /// prefix added, as Hugging Face's and llama.cpp's decoders drop it.
    pub(crate) fn piece_for_decode(&self, id: u32, skip_special: bool, strip: &mut bool) -> &[u8] {
        let (Some(bytes), Some(t)) = (self.token_bytes(id), self.token_type(id)) else {
            return &[];
        };
        if t.is_special() {
            return if skip_special { &[] } else { bytes };
        }
        if std::mem::take(strip) {
            return bytes.strip_prefix(b" ").unwrap_or(bytes);
        }
        bytes
    }

    /// A streaming decoder over this vocabulary; `skip_special` leaves control tokens out. It
    /// continues a prompt, so unlike [`decode`](Self::decode) it keeps a leading space.
    /// A streaming decoder over this vocabulary; `skip_special` leaves control tokens out.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special)
    }

    /// What token `id` stands for, as bytes: `<0xXX>` tokens are their byte, SentencePiece's `▁`
    /// is a space, byte-level spellings are undone, control tokens are their text.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let (start, end) = (*self.offsets.get(i)?, *self.offsets.get(i + 1)?);
        Some(&self.bytes[start..end])
    }

    /// The token's text as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// The token whose stored text is exactly `text` (`"<end_of_turn>"`, `"<|im_end|>"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.aliases
            .get(text)
            .or_else(|| self.pieces.get(text))
            .copied()
            .filter(|&id| self.texts[id as usize] == text)
    }

    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == Some(TokenType::Control)
    }

    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// End of turn: `tokenizer.ggml.eot_token_id`, or the first of `<|eot_id|>`, `<|im_end|>`,
    /// `<|end|>`, `<end_of_turn>`, ... present in the vocabulary.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    pub fn unk(&self) -> Option<u32> {
        self.unk
    }

    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// Whether `encode(.., add_special = true, ..)` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Tokens that end generation, sorted: EOS, EOT, and the vocabulary's tokens among
    /// llama.cpp's end-of-generation texts (`<end_of_turn>`, `<|im_end|>`, `<|eot_id|>`, ...).
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    pub fn is_stop(&self, id: u32) -> bool {
        self.stop.binary_search(&id).is_ok()
    }

    /// How many merges the vocabulary has (read from the file or derived from the tokens).
    pub fn merge_count(&self) -> usize {
        self.merges.len()
    }
}

/// Maps from token spelling to id (`pieces`) and from stored text to id where the two differ
/// (`aliases`, gemma's whitespace tokens), and which ids those are. Duplicates are an error.
type PieceMaps = (
    FxHashMap<Box<str>, u32>,
    FxHashMap<Box<str>, u32>,
    Vec<bool>,
);

fn piece_maps(tokens: &[String], gemma: bool) -> Result<PieceMaps, TokenizerError> {
    let n = tokens.len();
    let mut pieces: FxHashMap<Box<str>, u32> =
        FxHashMap::with_capacity_and_hasher(n, Default::default());
    let mut aliases: FxHashMap<Box<str>, u32> = FxHashMap::default();
    let mut spelled_differently = vec![false; n];
    for (id, text) in tokens.iter().enumerate() {
        let id = id as u32;
        if text.is_empty() {
            continue; // llama.cpp keeps such a slot but nothing can match it
        }
        let respell = gemma && text.contains(' ') && text.chars().all(py_isspace);
        let spelling: Box<str> = if respell {
            spelled_differently[id as usize] = true;
            if let Some(first) = aliases.insert(text.as_str().into(), id) {
                return Err(TokenizerError::DuplicateToken {
                    text: text.clone(),
                    first,
                    second: id,
                });
            }
            SPACE_MARK.to_string().repeat(text.chars().count()).into()
        } else {
            text.as_str().into()
        };
        if let Some(first) = pieces.insert(spelling.clone(), id) {
            return Err(TokenizerError::DuplicateToken {
                text: spelling.into(),
                first,
                second: id,
            });
        }
    }
    Ok((pieces, aliases, spelled_differently))
}

/// Every token's bytes, as `Tokenizer::token_bytes` describes.
fn decoded_bytes(
    kind: VocabKind,
    texts: &[String],
    types: &[TokenType],
    alphabet: &ByteAlphabet,
) -> (Vec<u8>, Vec<usize>) {
    let mut bytes = Vec::with_capacity(texts.iter().map(String::len).sum());
    let mut offsets = Vec::with_capacity(texts.len() + 1);
    offsets.push(0);
    for (text, &t) in texts.iter().zip(types) {
        if let (TokenType::Byte, Some(b)) = (t, parse_byte_token(text)) {
            bytes.push(b);
        } else if t.is_special() {
            bytes.extend_from_slice(text.as_bytes());
        } else {
            match kind {
                VocabKind::SentencePiece => {
                    for c in text.chars() {
                        let c = if c == SPACE_MARK { ' ' } else { c };
                        bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                    }
                }
                // User-defined tokens are stored as plain text; so are the rare normal tokens
                // with characters outside the byte alphabet.
                VocabKind::ByteLevelBpe => match (t, alphabet.unspell(text)) {
                    (TokenType::UserDefined, _) | (_, None) => {
                        bytes.extend_from_slice(text.as_bytes())
                    }
                    (_, Some(raw)) => bytes.extend_from_slice(&raw),
                },
            }
        }
        offsets.push(bytes.len());
    }
    (bytes, offsets)
}

/// `"left right"` lines, best first.
fn merges_from_file(
    lines: &[String],
    pieces: &FxHashMap<Box<str>, u32>,
) -> Result<MergeTable, TokenizerError> {
    let mut table = MergeTable::with_capacity(lines.len());
    for (index, line) in lines.iter().enumerate() {
        // The separator is the first space after the first character, so a left token that is
        // a space itself still parses (llama.cpp reads them the same way).
        let first = line.chars().next().map_or(0, char::len_utf8);
        let split = line[first..].find(' ').map(|p| p + first);
        let Some(split) = split else {
            return Err(TokenizerError::BadMerge {
                index,
                merge: line.clone(),
            });
        };
        let (left, right) = (&line[..split], &line[split + 1..]);
        let lookup = |t: &str| {
            pieces
                .get(t)
                .copied()
                .ok_or_else(|| TokenizerError::MergeUnknownToken {
                    index,
                    merge: line.clone(),
                    token: t.to_string(),
                })
        };
        let (l, r) = (lookup(left)?, lookup(right)?);
        let id = lookup(&format!("{left}{right}"))?;
        table.insert(
            l,
            r,
            Merge {
                rank: index as u32,
                id,
            },
        );
    }
    Ok(table)
}

/// How a SentencePiece vocabulary without merges ranks the merges its tokens imply.
enum SpmOrder<'a> {
    /// Earlier tokens merge first (gemma).
    FilePosition,
    /// Higher-scoring tokens merge first (scores absent: all equal).
    Score(Option<&'a [f32]>),
}

/// The merges a SentencePiece vocabulary implies: every split of a token into two tokens,
/// ranked as Hugging Face's `generate_merges` ranks them (by the merged token's score or
/// position; then longer left part first; then lower merged id). Control, unknown and byte
/// tokens are never merge results, so their texts typed as plain text stay plain text.
fn merges_from_vocab(
    pieces: &FxHashMap<Box<str>, u32>,
    n: usize,
    types: &[TokenType],
    order: SpmOrder,
) -> MergeTable {
    let mut spellings: Vec<Option<&str>> = vec![None; n];
    for (s, &id) in pieces {
        spellings[id as usize] = Some(s);
    }
    // (merged, left, right, left chars, right chars)
    let mut found: Vec<(u32, u32, u32, u32, u32)> = Vec::new();
    for (merged, spelling) in spellings.iter().enumerate() {
        let Some(spelling) = spelling else { continue };
        let t = types[merged];
        if t.is_special() || t == TokenType::Byte {
            continue;
        }
        let total = spelling.chars().count() as u32;
        for (left_chars, (at, _)) in spelling.char_indices().skip(1).enumerate() {
            let (l, r) = (&spelling[..at], &spelling[at..]);
            if let (Some(&li), Some(&ri)) = (pieces.get(l), pieces.get(r)) {
                let lc = left_chars as u32 + 1;
                found.push((merged as u32, li, ri, lc, total - lc));
            }
        }
    }
    match order {
        SpmOrder::FilePosition => found.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.3.cmp(&a.3))),
        SpmOrder::Score(scores) => {
            let score = |id: u32| scores.map_or(0.0, |s| s[id as usize]);
            found.sort_unstable_by(|a, b| {
                score(b.0)
                    .total_cmp(&score(a.0))
                    .then(b.3.cmp(&a.3))
                    .then(b.4.cmp(&a.4))
                    .then(a.0.cmp(&b.0))
            });
        }
    }
    let mut table = MergeTable::with_capacity(found.len());
    for (rank, &(merged, l, r, _, _)) in found.iter().enumerate() {
        table.insert(
            l,
            r,
            Merge {
                rank: rank as u32,
                id: merged,
            },
        );
    }
    table
}

#[cfg(test)]
#[path = "tokenizer_tests.rs"]
mod tests;
