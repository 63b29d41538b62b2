//! Hotlists: the (layer, expert) pairs to warm first, keyed by family, for a
//! first run that has no census sidecar yet.
//!
//! Text format (what `pulsar-host hotlist` prints):
//!
//! ```text
//! # pulsar hotlist v1
//! family qwen3moe
//! # layer expert, hottest first
//! 3 17
//! 3 5
//! ```

use serde::{Deserialize, Serialize};

use crate::census::Census;
use crate::error::{Result, StoreError};

const HEADER: &str = "# pulsar hotlist v1";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hotlist {
    /// `general.architecture` of the models it is for.
    pub family: String,
    /// (layer, expert), hottest first, no duplicates.
    pub entries: Vec<(u32, u32)>,
}

/// The `top_n` hottest (layer, expert) pairs overall (counts are comparable
/// across layers: every layer routes every token). `family` is left empty
/// for the caller to fill in.
pub fn hotlist_from_census(census: &Census, top_n: usize) -> Hotlist {
    Hotlist { family: String::new(), entries: census.hottest().into_iter().take(top_n).map(|(l, e, _)| (l, e)).collect() }
}

/// Hotlists shipped with this build, by family. None are measured yet; a
/// family's list is added here from `pulsar-host hotlist` output.
const BUILTIN: &[(&str, &str)] = &[];

/// The shipped hotlist for a family, if any.
pub fn builtin_hotlist(family: &str) -> Option<Hotlist> {
    BUILTIN.iter().find(|(f, _)| *f == family).and_then(|(_, text)| Hotlist::parse(text).ok())
}

impl Hotlist {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn to_text(&self) -> String {
        let mut s = format!("{HEADER}\nfamily {}\n# layer expert, hottest first\n", self.family);
        for (l, e) in &self.entries {
            s.push_str(&format!("{l} {e}\n"));
        }
        s
    }

    pub fn parse(text: &str) -> Result<Hotlist> {
        let err = |line: usize, reason: String| StoreError::Hotlist { line, reason };
        let mut family = None;
        let mut entries = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (i, raw) in text.lines().enumerate() {
            let n = i + 1;
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(f) = line.strip_prefix("family") {
                let f = f.trim();
                if family.is_some() || f.is_empty() || f.contains(char::is_whitespace) {
                    return Err(err(n, format!("bad or repeated family line {line:?}")));
                }
                family = Some(f.to_owned());
                continue;
            }
            if family.is_none() {
                return Err(err(n, "entries before the `family NAME` line".into()));
            }
            let mut parts = line.split_whitespace();
            let (Some(l), Some(e), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(err(n, format!("expected `layer expert`, got {line:?}")));
            };
            let (Ok(l), Ok(e)) = (l.parse::<u32>(), e.parse::<u32>()) else {
                return Err(err(n, format!("expected two integers, got {line:?}")));
            };
            if !seen.insert((l, e)) {
                return Err(err(n, format!("layer {l} expert {e} listed twice")));
            }
            entries.push((l, e));
        }
        let family = family.ok_or_else(|| err(0, "no `family NAME` line".into()))?;
        Ok(Hotlist { family, entries })
    }

    /// As a census (rank-derived counts, hottest highest) so a hotlist seeds
    /// the hot sets through the same path as a sidecar.
    pub fn to_census(&self) -> Census {
        let mut c = Census::new();
        let n = self.entries.len() as u64;
        for (i, &(l, e)) in self.entries.iter().enumerate() {
            c.record(l, e, n - i as u64);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_census_text_round_trip_and_census_order() {
        let mut c = Census::new();
        c.record(0, 1, 10);
        c.record(2, 7, 30);
        c.record(1, 4, 20);
        c.record(1, 5, 1);
        let mut h = hotlist_from_census(&c, 3);
        assert_eq!(h.entries, vec![(2, 7), (1, 4), (0, 1)]);
        h.family = "qwen3moe".into();
        let text = h.to_text();
        assert!(text.starts_with(HEADER));
        assert_eq!(Hotlist::parse(&text).unwrap(), h);
        let back = hotlist_from_census(&h.to_census(), 10);
        assert_eq!(back.entries, h.entries);
    }

    #[test]
    fn parse_errors_name_the_line() {
        for (text, line) in [
            ("1 2\n", 1),
            ("family a\n1 x\n", 2),
            ("family a\n1 2 3\n", 2),
            ("family a\n\n1 2\n1 2\n", 4),
            ("family a\nfamily b\n", 2),
            ("# only comments\n", 0),
        ] {
            match Hotlist::parse(text) {
                Err(StoreError::Hotlist { line: l, .. }) => assert_eq!(l, line, "{text:?}"),
                other => panic!("{text:?} gave {other:?}"),
            }
        }
        assert_eq!(builtin_hotlist("no-such-family"), None);
    }
}
