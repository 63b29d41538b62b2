//! GPT-2's byte alphabet: every byte spelled as one printable character, so that byte-level
//! vocabularies can be stored as text. Printable Latin-1 bytes stand for themselves; the other
//! 68 bytes take the characters from U+0100 up, in byte order.

/// Byte to the character that spells it, and back.
#[derive(Debug)]
pub(crate) struct ByteAlphabet {
    to_char: [char; 256],
    /// Indexed by code point; every spelling character is below U+0144.
    from_char: [Option<u8>; 0x144],
}

impl ByteAlphabet {
    pub(crate) fn new() -> ByteAlphabet {
        let mut to_char = ['\0'; 256];
        let mut next = 256u32;
        for (byte, slot) in to_char.iter_mut().enumerate() {
            let b = byte as u32;
            let printable = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            let code = if printable {
                b
            } else {
                next += 1;
                next - 1
            };
            *slot = char::from_u32(code).expect("U+0000..U+0143 are all scalar values");
        }
        let mut from_char = [None; 0x144];
        for (byte, c) in to_char.iter().enumerate() {
            from_char[*c as usize] = Some(byte as u8);
        }
        ByteAlphabet { to_char, from_char }
    }

    pub(crate) fn char_of(&self, byte: u8) -> char {
        self.to_char[byte as usize]
    }

    /// The byte a character spells, if it is one of the 256.
    pub(crate) fn byte_of(&self, c: char) -> Option<u8> {
        self.from_char.get(c as usize).copied().flatten()
    }

    /// Bytes to their spelling.
    pub(crate) fn spell(&self, bytes: &[u8], out: &mut String) {
        out.extend(bytes.iter().map(|&b| self.char_of(b)));
    }

    /// A spelled text back to bytes, or `None` if a character is outside the alphabet.
    pub(crate) fn unspell(&self, text: &str) -> Option<Vec<u8>> {
        text.chars().map(|c| self.byte_of(c)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_spellings() {
        let a = ByteAlphabet::new();
        assert_eq!(a.char_of(b' '), 'Ġ');
        assert_eq!(a.char_of(b'\n'), 'Ċ');
        assert_eq!(a.char_of(b'A'), 'A');
        assert_eq!(a.char_of(0), '\u{100}');
        assert_eq!(a.char_of(0xAD), '\u{143}');
    }

    #[test]
    fn every_byte_round_trips_and_nothing_else_maps() {
        let a = ByteAlphabet::new();
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = a.char_of(b);
            assert!(seen.insert(c), "{c:?} spells two bytes");
            assert_eq!(a.byte_of(c), Some(b));
        }
        assert_eq!(a.byte_of(' '), None);
        assert_eq!(a.byte_of('\u{144}'), None);
        assert_eq!(a.unspell("ĠhiĊ"), Some(b" hi\n".to_vec()));
        assert_eq!(a.unspell("▁"), None);
    }
}
