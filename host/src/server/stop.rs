//! Stop strings over streamed text: text that may be the start of a stop
//! string is held back until it is known not to be one.

/// Feeds generated text through; says what may be sent and whether a stop matched.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    /// Add `piece`; returns the text now safe to send and whether a stop
    /// string was found (then the text is everything before it, and the
    /// generation ends).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.held), false);
        }
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(i) = first {
            let out = self.held[..i].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest tail that is a proper prefix of a stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| {
                (1..s.len().min(self.held.len() + 1))
                    .rev()
                    .find(|&n| s.is_char_boundary(n) && self.held.ends_with(&s[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The generation ended for another reason: whatever is held is text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_stops_and_cuts_at_the_first() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("hello E"), ("hello ".into(), false));
        assert_eq!(m.push("N"), ("".into(), false));
        assert_eq!(m.push("x"), ("ENx".into(), false));
        assert_eq!(m.push("a\n"), ("a".into(), false));
        assert_eq!(m.push("\nEND"), ("".into(), true));
        let mut m = StopMatcher::new(vec!["stop".into()]);
        assert_eq!(m.push("a sto"), ("a ".into(), false));
        assert_eq!(m.finish(), "sto");
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café"), ("caf".into(), false));
        assert_eq!(m.push("!"), ("".into(), true));
        let mut none = StopMatcher::new(vec![]);
        assert_eq!(none.push("abc"), ("abc".into(), false));
    }
}
