//! Split shard sets: `<prefix>-00001-of-00003.gguf` and the `split.*` keys.
//!
//! Conventions (llama.cpp's gguf-split and the `gguf` Python writer agree):
//! file names number shards from 1, `split.no` numbers them from 0; every
//! shard carries `split.no` (u16), `split.count` (u16) and
//! `split.tensors.count` (i32, the total over all shards); the model's
//! metadata is in the first shard only.

use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result};
use crate::metadata::Metadata;

/// 0-based index of this shard.
pub const SPLIT_NO: &str = "split.no";
/// Number of shards in the set.
pub const SPLIT_COUNT: &str = "split.count";
/// Tensors in the whole set.
pub const SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// The path of shard `index` (0-based) of `count`, for a base path such as
/// `dir/model.gguf` (or `dir/model`): `dir/model-00001-of-00003.gguf`.
pub fn shard_path(base: &Path, index: usize, count: usize) -> PathBuf {
    let name = base.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = name.strip_suffix(".gguf").unwrap_or(&name);
    base.with_file_name(format!("{stem}-{:05}-of-{:05}.gguf", index + 1, count))
}

/// A path that follows the shard naming scheme, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardName {
    /// The base path, `dir/model.gguf` for `dir/model-00002-of-00003.gguf`.
    pub base: PathBuf,
    /// 0-based shard index (the name's number minus one).
    pub index: usize,
    /// Number of shards the name claims.
    pub count: usize,
}

/// Decodes `<prefix>-NNNNN-of-MMMMM.gguf` (at least five digits each, as
/// printed with `%05d`); `None` for any other name.
pub fn parse_shard_name(path: &Path) -> Option<ShardName> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_suffix(".gguf")?;
    let (rest, count) = split_number(rest)?;
    let rest = rest.strip_suffix("-of-")?;
    let (prefix, no) = split_number(rest)?;
    let prefix = prefix.strip_suffix('-')?;
    if prefix.is_empty() || no == 0 || no > count {
        return None;
    }
    Some(ShardName { base: path.with_file_name(format!("{prefix}.gguf")), index: no - 1, count })
}

/// Splits a trailing run of ≥ 5 ASCII digits off `s`.
fn split_number(s: &str) -> Option<(&str, usize)> {
    let digits = s.bytes().rev().take_while(u8::is_ascii_digit).count();
    if digits < 5 {
        return None;
    }
    let (head, num) = s.split_at(s.len() - digits);
    Some((head, num.parse().ok()?))
}

/// What a shard's metadata says about its place in a set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitKeys {
    /// `split.no`, 0-based.
    pub no: usize,
    /// `split.count`.
    pub count: usize,
    /// `split.tensors.count`, when present.
    pub tensors: Option<usize>,
}

/// Reads the `split.*` keys; `None` when the file is not part of a set
/// (no `split.count`, or a count of 1).
pub fn split_keys(md: &Metadata) -> Result<Option<SplitKeys>> {
    let Some(count) = md.get_usize(SPLIT_COUNT)? else {
        if md.contains_key(SPLIT_NO) {
            return Err(GgufError::Split(format!("'{SPLIT_NO}' is present but '{SPLIT_COUNT}' is not")));
        }
        return Ok(None);
    };
    let no = md.get_usize(SPLIT_NO)?.unwrap_or(0);
    let tensors = md.get_usize(SPLIT_TENSORS_COUNT)?;
    if count == 0 || count > usize::from(u16::MAX) {
        return Err(GgufError::Split(format!("'{SPLIT_COUNT}' is {count} (must be 1..=65535)")));
    }
    if no >= count {
        return Err(GgufError::Split(format!("'{SPLIT_NO}' is {no} but '{SPLIT_COUNT}' is {count}")));
    }
    if count == 1 {
        return Ok(None);
    }
    Ok(Some(SplitKeys { no, count, tensors }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Value;

    #[test]
    fn names_round_trip() {
        let base = Path::new("/m/kimi.gguf");
        let p = shard_path(base, 1, 3);
        assert_eq!(p, Path::new("/m/kimi-00002-of-00003.gguf"));
        assert_eq!(shard_path(Path::new("/m/kimi"), 0, 2), Path::new("/m/kimi-00001-of-00002.gguf"));
        let n = parse_shard_name(&p).unwrap();
        assert_eq!(n, ShardName { base: base.to_path_buf(), index: 1, count: 3 });
        assert_eq!(parse_shard_name(Path::new("/m/a-123456-of-123456.gguf")).unwrap().count, 123456);
        for bad in ["/m/kimi.gguf", "/m/kimi-0001-of-00003.gguf", "/m/kimi-00004-of-00003.gguf",
                    "/m/kimi-00000-of-00003.gguf", "/m/-00001-of-00003.gguf", "/m/k-00001-of-00003.bin"] {
            assert_eq!(parse_shard_name(Path::new(bad)), None, "{bad}");
        }
    }

    #[test]
    fn keys() {
        let mut md = Metadata::new();
        assert_eq!(split_keys(&md).unwrap(), None);
        md.insert(SPLIT_NO, Value::U16(2));
        assert!(split_keys(&md).is_err(), "split.no without split.count");
        md.insert(SPLIT_COUNT, Value::U16(3));
        md.insert(SPLIT_TENSORS_COUNT, Value::I32(7));
        assert_eq!(split_keys(&md).unwrap(), Some(SplitKeys { no: 2, count: 3, tensors: Some(7) }));
        let mut md2 = Metadata::new();
        md2.insert(SPLIT_COUNT, Value::U16(2));
        md2.insert(SPLIT_NO, Value::U16(2));
        assert!(split_keys(&md2).unwrap_err().to_string().contains("split.no"));
    }
}
