//! [`GgufFile`]: one GGUF file or a split shard set, as one virtual view.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memmap2::Mmap;

use crate::error::{GgufError, Result};
use crate::metadata::Metadata;
use crate::parse::{parse_header, Header};
use crate::sha256::Sha256;
use crate::split::{parse_shard_name, shard_path, split_keys, SplitKeys, SPLIT_TENSORS_COUNT};
use crate::tensor::{ByteRange, TensorInfo};

/// Facts about one file of the set.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ShardInfo {
    /// Where it was opened from (`None` for in-memory input).
    pub path: Option<PathBuf>,
    /// File length in bytes.
    pub len: u64,
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Data alignment of this shard.
    pub alignment: u64,
    /// Bytes of magic + counts + metadata + tensor directory.
    pub header_len: u64,
    /// Start of the data section.
    pub data_offset: u64,
    /// Tensors whose data lives in this shard.
    pub n_tensors: usize,
}

enum Backing {
    /// `map` is `None` only for an empty file (which never parses).
    /// `modified` is the mtime at open (see `GgufFile::changed_in_place`).
    File { file: File, map: Option<Mmap>, modified: Option<std::time::SystemTime> },
    Memory(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::File { map: Some(m), .. } => m,
            Backing::File { map: None, .. } => &[],
            Backing::Memory(v) => v,
        }
    }
}

struct Shard {
    info: ShardInfo,
    backing: Backing,
}

/// A parsed, validated GGUF file or split shard set.
///
/// Files are memory-mapped read-only; nothing is read whole. The mapping
/// assumes the files are not truncated or rewritten while open (as every
/// mmap-based model loader does); bounds were checked at open time, and
/// [`GgufFile::changed_in_place`] tells a long-running caller (the server,
/// before each step) that the assumption broke.
pub struct GgufFile {
    shards: Vec<Shard>,
    paths: Vec<PathBuf>,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    fingerprint: OnceLock<[u8; 32]>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("shards", &self.shards.iter().map(|s| &s.info).collect::<Vec<_>>())
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

fn in_file(path: &Path, e: GgufError) -> GgufError {
    match e {
        e @ GgufError::InFile { .. } => e,
        e => GgufError::InFile { path: path.to_path_buf(), error: Box::new(e) },
    }
}

/// Opens and parses one file; `Ok(None)` when it does not exist.
fn load_file(path: &Path, shard: usize) -> Result<Option<(Backing, Header)>> {
    // Opening a FIFO or a device would block or read forever: refuse what is
    // not a regular file before opening it (symlinks are followed).
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            let what = if m.is_dir() { "a directory" } else { "not a regular file (a pipe, socket or device?)" };
            return Err(GgufError::io(format!("opening {}", path.display()), io::Error::new(io::ErrorKind::InvalidInput, format!("it is {what}"))));
        }
        _ => {}
    }
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(GgufError::io(format!("opening {}", path.display()), e)),
    };
    let meta = file.metadata().map_err(|e| GgufError::io(format!("reading the length of {}", path.display()), e))?;
    let (len, modified) = (meta.len(), meta.modified().ok());
    let map = if len == 0 {
        None
    } else {
        // SAFETY: the map is read-only and we never hand out mutable access.
        // Another process truncating the file while it is open could fault a
        // read (SIGBUS); that is the documented contract of GgufFile.
        let m = unsafe { Mmap::map(&file) }
            .map_err(|e| GgufError::io(format!("memory-mapping {}", path.display()), e))?;
        Some(m)
    };
    let backing = Backing::File { file, map, modified };
    let header = parse_header(backing.bytes(), shard).map_err(|e| in_file(path, e))?;
    Ok(Some((backing, header)))
}

impl GgufFile {
    /// Opens a GGUF file. A file that is one shard of a split set (by its
    /// `split.*` keys) opens the whole set, whichever shard is named; the
    /// other shards are found by the `-NNNNN-of-NNNNN.gguf` naming scheme.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let (backing, header) = load_file(path, 0)?.ok_or_else(|| {
            GgufError::io(format!("opening {}", path.display()), io::Error::new(io::ErrorKind::NotFound, "no such file"))
        })?;
        let Some(keys) = split_keys(&header.metadata).map_err(|e| in_file(path, e))? else {
            return Self::assemble(vec![(Some(path.to_path_buf()), backing, header)]);
        };
        let name = parse_shard_name(path).ok_or_else(|| {
            in_file(
                path,
                GgufError::Split(format!(
                    "this file is shard {} of {}, but its name does not follow \
                     <name>-NNNNN-of-NNNNN.gguf, so the other shards cannot be found",
                    keys.no + 1,
                    keys.count
                )),
            )
        })?;
        if name.index != keys.no || name.count != keys.count {
            return Err(in_file(
                path,
                GgufError::Split(format!(
                    "the name says shard {} of {} but split.no/split.count say shard {} of {}",
                    name.index + 1,
                    name.count,
                    keys.no + 1,
                    keys.count
                )),
            ));
        }
        let mut given = Some((backing, header));
        let mut loaded = Vec::with_capacity(keys.count);
        for i in 0..keys.count {
            let p = shard_path(&name.base, i, keys.count);
            let (b, h) = match given.take_if(|_| i == keys.no) {
                Some(bh) => bh,
                None => load_file(&p, i)?.ok_or_else(|| GgufError::MissingShard {
                    path: p.clone(),
                    index: i,
                    count: keys.count,
                })?,
            };
            loaded.push((Some(p), b, h));
        }
        Self::assemble(loaded)
    }

    /// Parses one in-memory GGUF file (fuzzing, tests, embedded data).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::from_shard_bytes(vec![bytes])
    }

    /// Parses an in-memory split set, shards in order.
    pub fn from_shard_bytes(shards: Vec<Vec<u8>>) -> Result<GgufFile> {
        let mut loaded = Vec::with_capacity(shards.len());
        for (i, bytes) in shards.into_iter().enumerate() {
            let header = parse_header(&bytes[..], i)?;
            loaded.push((None, Backing::Memory(bytes), header));
        }
        Self::assemble(loaded)
    }

    /// Checks the split keys of every shard against its position and merges
    /// the tensor directories.
    fn assemble(loaded: Vec<(Option<PathBuf>, Backing, Header)>) -> Result<GgufFile> {
        let n = loaded.len();
        if n == 0 {
            return Err(GgufError::Split("no shards given".into()));
        }
        let mut shards = Vec::with_capacity(n);
        let mut paths = Vec::with_capacity(n);
        let mut metadata = None;
        let mut tensors: Vec<TensorInfo> = Vec::new();
        let mut by_name = HashMap::new();
        let mut set_tensors = None;
        for (i, (path, backing, header)) in loaded.into_iter().enumerate() {
            let ctx = |e: GgufError| match &path {
                Some(p) => in_file(p, e),
                None => e,
            };
            let keys = split_keys(&header.metadata).map_err(ctx)?;
            match keys {
                None if n == 1 => {}
                Some(SplitKeys { no, count, .. }) if no == i && count == n => {}
                other => {
                    let says = match other {
                        None => "says it is not part of a split set".to_string(),
                        Some(k) => format!("says it is shard {} of {}", k.no + 1, k.count),
                    };
                    return Err(ctx(GgufError::Split(format!("opened as shard {} of {n} but {says}", i + 1))));
                }
            }
            let claimed = keys.and_then(|k| k.tensors);
            if i == 0 {
                set_tensors = claimed;
            } else if claimed.is_some() && claimed != set_tensors {
                return Err(ctx(GgufError::Split(format!(
                    "'{SPLIT_TENSORS_COUNT}' is {claimed:?} here but {set_tensors:?} in the first shard"
                ))));
            }
            let n_tensors = header.tensors.len();
            // Shard index from the position in the set (a shard opened first
            // was parsed as shard 0).
            for (t, &info_off) in header.tensors.into_iter().zip(&header.info_offsets) {
                if by_name.insert(t.name.clone(), tensors.len()).is_some() {
                    return Err(ctx(GgufError::DuplicateTensor { name: t.name, shard: i, offset: info_off }));
                }
                tensors.push(TensorInfo { shard: i, ..t });
            }
            let info = ShardInfo {
                path: path.clone(),
                len: header.file_len,
                version: header.version,
                alignment: header.alignment,
                header_len: header.header_len,
                data_offset: header.data_offset,
                n_tensors,
            };
            if i == 0 {
                metadata = Some(header.metadata);
            }
            paths.extend(path);
            shards.push(Shard { info, backing });
        }
        if let Some(claimed) = set_tensors {
            if n > 1 && claimed != tensors.len() {
                return Err(GgufError::Split(format!(
                    "'{SPLIT_TENSORS_COUNT}' says {claimed} tensors but the {n} shards hold {}",
                    tensors.len()
                )));
            }
        }
        Ok(GgufFile {
            shards,
            paths,
            metadata: metadata.unwrap_or_default(),
            tensors,
            by_name,
            fingerprint: OnceLock::new(),
        })
    }

    /// The metadata (of the first shard, which holds the model's keys).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Shortcut for `metadata().get(key)`.
    pub fn get(&self, key: &str) -> Option<&crate::Value> {
        self.metadata.get(key)
    }

    /// `general.architecture`, required.
    pub fn architecture(&self) -> Result<&str> {
        self.metadata.require_str("general.architecture")
    }

    /// Every tensor, shard by shard in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// GGUF version of the first shard.
    pub fn version(&self) -> u32 {
        self.shards[0].info.version
    }

    /// Data alignment of the first shard.
    pub fn alignment(&self) -> u64 {
        self.shards[0].info.alignment
    }

    /// Number of files in the set (1 when not split).
    pub fn n_shards(&self) -> usize {
        self.shards.len()
    }

    /// Facts about each shard.
    pub fn shard_infos(&self) -> impl ExactSizeIterator<Item = &ShardInfo> + '_ {
        self.shards.iter().map(|s| &s.info)
    }

    /// The paths of the shards, in order (empty for in-memory input).
    pub fn shard_paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Total bytes of all files.
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.info.len).sum()
    }

    /// The open file of a shard (for callers doing their own I/O).
    pub fn shard_file(&self, shard: usize) -> Option<&File> {
        match &self.shards.get(shard)?.backing {
            Backing::File { file, .. } => Some(file),
            Backing::Memory(_) => None,
        }
    }

    /// Why the files behind this mapping can no longer be trusted, if they
    /// were written in place since they were opened (`cp` over a model that
    /// is being served): a shorter file faults (SIGBUS) on the first read of
    /// a page past its new end, a rewritten one serves other weights. Checked
    /// on the open descriptor, so a file replaced by rename (the safe way:
    /// the old inode stays mapped) is not a change. One `fstat` a shard.
    pub fn changed_in_place(&self) -> Option<String> {
        for s in &self.shards {
            let Backing::File { file, map, modified } = &s.backing else { continue };
            let Ok(now) = file.metadata() else { continue };
            let name = s.info.path.as_ref().map_or_else(|| "the model file".to_string(), |p| p.display().to_string());
            let mapped = map.as_ref().map_or(0, |m| m.len() as u64);
            if now.len() != mapped {
                return Some(format!("{name} was rewritten in place since it was opened ({mapped} bytes then, {} now)", now.len()));
            }
            if now.modified().ok() != *modified {
                return Some(format!("{name} was modified in place since it was opened"));
            }
        }
        None
    }

    fn check_range(&self, shard: usize, offset: u64, len: u64) -> Result<&Shard> {
        let s = self
            .shards
            .get(shard)
            .ok_or(GgufError::NoSuchShard { shard, count: self.shards.len() })?;
        let shard_len = s.info.len;
        if offset.checked_add(len).is_none_or(|end| end > shard_len) {
            return Err(GgufError::OutOfBounds { shard, offset, len, shard_len });
        }
        Ok(s)
    }

    /// The mapped bytes of a range, bounds-checked.
    pub fn bytes(&self, r: &ByteRange) -> Result<&[u8]> {
        let s = self.check_range(r.shard, r.offset, r.len)?;
        // In range of the mapping, which has exactly `len` bytes.
        Ok(&s.backing.bytes()[r.offset as usize..(r.offset + r.len) as usize])
    }

    /// A tensor's data (a slice of the mapping).
    ///
    /// # Panics
    /// If `t` is not a tensor of this file (its range cannot be outside a
    /// shard otherwise: data bounds are checked at open).
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        match self.bytes(&t.byte_range()) {
            Ok(b) => b,
            Err(e) => panic!("GgufFile::data called with a tensor of another file: {e}"),
        }
    }

    /// Reads `buf.len()` bytes at `offset` of a shard with a positional read
    /// (pread), bypassing the mapping; bounds-checked.
    pub fn read_at(&self, shard: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let s = self.check_range(shard, offset, buf.len() as u64)?;
        match &s.backing {
            Backing::File { file, .. } => file.read_exact_at(buf, offset).map_err(|e| {
                GgufError::io(format!("reading {} bytes at offset {offset} of shard {shard}", buf.len()), e)
            }),
            Backing::Memory(v) => {
                buf.copy_from_slice(&v[offset as usize..offset as usize + buf.len()]);
                Ok(())
            }
        }
    }

    /// One expert's contiguous bytes of a 3-D `[cols, rows, n_expert]`
    /// tensor (see [`TensorInfo::expert_slab`]).
    pub fn expert_slab(&self, t: &TensorInfo, expert: u64) -> Result<ByteRange> {
        t.expert_slab(expert)
    }

    /// A cheap identity of the file set, for sidecars such as the census
    /// `<model>.gguf.warm`: SHA-256 over a version tag, the shard count, and
    /// for each shard its length, its header length and its header bytes
    /// (magic, version, counts, all metadata, the tensor directory with
    /// names, shapes, types and offsets). Tensor data is not hashed: two
    /// files with identical headers and lengths but different weights share
    /// a fingerprint. Costs one pass over the header bytes (a few MB).
    pub fn fingerprint(&self) -> [u8; 32] {
        *self.fingerprint.get_or_init(|| {
            let mut h = Sha256::new();
            h.update(b"pulsar-gguf fingerprint v1\0");
            h.update(&(self.shards.len() as u64).to_le_bytes());
            for s in &self.shards {
                h.update(&s.info.len.to_le_bytes());
                h.update(&s.info.header_len.to_le_bytes());
                // header_len <= len was established by the parser.
                h.update(&s.backing.bytes()[..s.info.header_len as usize]);
            }
            h.finish()
        })
    }

    /// [`GgufFile::fingerprint`] as 64 lower-case hex digits.
    pub fn fingerprint_hex(&self) -> String {
        self.fingerprint().iter().map(|b| format!("{b:02x}")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_can_be_shared_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<GgufFile>();
    }

    /// #28 defect 2: a model file rewritten in place under a running server.
    #[test]
    fn a_file_rewritten_in_place_is_noticed_and_one_renamed_over_is_not() {
        let dir = std::env::temp_dir().join(format!("pulsar-gguf-inplace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("m.gguf");
        let bytes = crate::GgufWriter::new().in_memory().unwrap().finish().unwrap().remove(0);
        std::fs::write(&p, &bytes).unwrap();
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.changed_in_place(), None);
        // Replaced by rename: the mapped inode is untouched.
        let q = dir.join("m.gguf.new");
        std::fs::write(&q, &bytes).unwrap();
        std::fs::rename(&q, &p).unwrap();
        assert_eq!(f.changed_in_place(), None, "a rename is the safe way to replace a file");
        // Rewritten in place (what `cp other.gguf m.gguf` does): noticed.
        let g = GgufFile::open(&p).unwrap();
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(8).unwrap();
        let why = g.changed_in_place().expect("a truncated file must be noticed");
        assert!(why.contains("m.gguf") && why.contains("rewritten in place"), "{why}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn in_memory_files_have_no_paths_or_fds() {
        let bytes = crate::GgufWriter::new().in_memory().unwrap().finish().unwrap().remove(0);
        let f = GgufFile::from_bytes(bytes).unwrap();
        assert!(f.shard_paths().is_empty());
        assert!(f.shard_file(0).is_none());
        assert_eq!(f.tensors().len(), 0);
        assert_eq!(f.total_bytes(), 32, "24 header bytes padded to the alignment");
        assert!(GgufFile::from_shard_bytes(vec![]).is_err());
    }
}
