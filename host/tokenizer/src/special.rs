//! Cutting special-token texts (`<start_of_turn>`, `<|im_end|>`, `</div>`, ...) out of the input
//! before it is tokenized: at each position the longest token text starting there is taken, and
//! the leftmost position wins (Hugging Face's added-token matching, leftmost-longest).

/// A piece of input: raw text to tokenize, or a token matched whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    id: u32,
    /// Matched only when the caller asks to parse special tokens (control and unknown tokens);
    /// user-defined tokens are always matched, as in llama.cpp.
    special_only: bool,
}

#[derive(Debug, Default)]
struct Node {
    /// (byte, child index), sorted by byte.
    children: Vec<(u8, u32)>,
    entry: Option<Entry>,
}

/// A byte trie over the texts of the tokens matched whole.
#[derive(Debug)]
pub(crate) struct SpecialMatcher {
    nodes: Vec<Node>,
    first_byte: [bool; 256],
}

impl SpecialMatcher {
    pub(crate) fn new() -> SpecialMatcher {
        SpecialMatcher {
            nodes: vec![Node::default()],
            first_byte: [false; 256],
        }
    }

    pub(crate) fn insert(&mut self, text: &str, id: u32, special_only: bool) {
        let Some(&first) = text.as_bytes().first() else {
            return;
        };
        self.first_byte[first as usize] = true;
        let mut node = 0usize;
        for &b in text.as_bytes() {
            node = match self.nodes[node]
                .children
                .binary_search_by_key(&b, |&(c, _)| c)
            {
                Ok(i) => self.nodes[node].children[i].1 as usize,
                Err(i) => {
                    let child = self.nodes.len();
                    self.nodes.push(Node::default());
                    self.nodes[node].children.insert(i, (b, child as u32));
                    child
                }
            };
        }
        self.nodes[node]
            .entry
            .get_or_insert(Entry { id, special_only });
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }

    /// The longest eligible token text at the start of `bytes`: (id, length).
    fn longest_at(&self, bytes: &[u8], parse_special: bool) -> Option<(u32, usize)> {
        let mut node = 0usize;
        let mut best = None;
        for (i, &b) in bytes.iter().enumerate() {
            let children = &self.nodes[node].children;
            match children.binary_search_by_key(&b, |&(c, _)| c) {
                Ok(k) => node = children[k].1 as usize,
                Err(_) => break,
            }
            if let Some(e) = self.nodes[node].entry {
                if parse_special || !e.special_only {
                    best = Some((e.id, i + 1));
                }
            }
        }
        best
    }

    /// Splits `text` into raw text and whole tokens, appending to `out`.
    pub(crate) fn split<'t>(
        &self,
        text: &'t str,
        parse_special: bool,
        out: &mut Vec<Fragment<'t>>,
    ) {
        let bytes = text.as_bytes();
        let mut start = 0; // first byte not yet emitted
        let mut i = 0;
        while i < bytes.len() {
            if self.first_byte[bytes[i] as usize] {
                // Token texts are whole UTF-8 strings, so a match can only begin on a character
                // boundary and the slices below are always valid.
                if let Some((id, len)) = self.longest_at(&bytes[i..], parse_special) {
                    if i > start {
                        out.push(Fragment::Text(&text[start..i]));
                    }
                    out.push(Fragment::Token(id));
                    i += len;
                    start = i;
                    continue;
                }
            }
            i += 1;
        }
        if start < bytes.len() {
            out.push(Fragment::Text(&text[start..]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Fragment::*;

    fn matcher() -> SpecialMatcher {
        let mut m = SpecialMatcher::new();
        m.insert("<s>", 1, true);
        m.insert("<s>x", 2, false);
        m.insert("<|im_end|>", 3, true);
        m.insert("<think>", 4, false);
        m
    }

    fn split(text: &str, parse_special: bool) -> Vec<Fragment<'_>> {
        let mut out = Vec::new();
        matcher().split(text, parse_special, &mut out);
        out
    }

    #[test]
    fn longest_match_wins() {
        assert_eq!(split("a<s>xb", true), [Text("a"), Token(2), Text("b")]);
        assert_eq!(split("<s>y", true), [Token(1), Text("y")]);
    }

    #[test]
    fn special_only_tokens_need_parse_special() {
        assert_eq!(split("<|im_end|><think>", true), [Token(3), Token(4)]);
        assert_eq!(
            split("<|im_end|><think>", false),
            [Text("<|im_end|>"), Token(4)]
        );
        // Without parse_special the longest eligible match is taken.
        assert_eq!(split("<s>x", false), [Token(2)]);
        assert_eq!(split("<s>", false), [Text("<s>")]);
    }

    #[test]
    fn partial_and_adjacent_texts() {
        assert_eq!(split("<|im_end", true), [Text("<|im_end")]);
        assert_eq!(
            split("<<|im_end|>>", true),
            [Text("<"), Token(3), Text(">")]
        );
        assert_eq!(split("", true), []);
        assert_eq!(
            split("日本<s>語", true),
            [Text("日本"), Token(1), Text("語")]
        );
    }
}
