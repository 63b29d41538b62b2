//! Routing census and its sidecar file `<model>.gguf.warm`.
//!
//! The census counts how often each (layer, expert) was selected. The sidecar
//! carries it to the next run, where it seeds the hot sets. Format (all
//! little-endian):
//!
//! ```text
//!  0  magic "PLSRWARM"
//!  8  u32 format version (1)
//! 12  u32 reserved, 0
//! 16  [u8; 32] fingerprint of the GGUF (supplied by the caller)
//! 48  u64 n
//! 56  n x { u32 layer, u32 expert, u64 count }
//!  .  u64 FNV-1a-64 of every preceding byte
//! ```
//!
//! Merging on save: `written = old / 2 + this run` (integer halving, zero
//! counts dropped). Each run's contribution halves on every later save, so
//! the stored counts track recent routing and can never ratchet up past
//! twice a run's worth. Save once per run with that run's touches only.
//!
//! A sidecar that is truncated, corrupt, of another version or of another
//! GGUF is ignored with one warning and the run starts clean. Writes go to a
//! temp file in the same directory, fsync, rename, fsync the directory, so a
//! crash leaves the old sidecar intact.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Result, StoreError};

pub const SIDECAR_MAGIC: &[u8; 8] = b"PLSRWARM";
pub const SIDECAR_VERSION: u32 = 1;
const HEADER: usize = 56;
const RECORD: usize = 16;

/// Touch counts per (layer, expert).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Census {
    counts: BTreeMap<(u32, u32), u64>,
}

impl Census {
    pub fn new() -> Census {
        Census::default()
    }

    /// Add `n` touches.
    pub fn record(&mut self, layer: u32, expert: u32, n: u64) {
        if n > 0 {
            let c = self.counts.entry((layer, expert)).or_default();
            *c = c.saturating_add(n);
        }
    }

    pub fn count(&self, layer: u32, expert: u32) -> u64 {
        self.counts.get(&(layer, expert)).copied().unwrap_or(0)
    }

    /// Entries with a non-zero count.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    pub fn total(&self) -> u64 {
        self.counts.values().fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// (layer, expert, count) in (layer, expert) order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32, u64)> + '_ {
        self.counts.iter().map(|(&(l, e), &c)| (l, e, c))
    }

    /// Add every count of `other`.
    pub fn merge(&mut self, other: &Census) {
        for (l, e, c) in other.iter() {
            self.record(l, e, c);
        }
    }

    /// Every count halved (rounding down; zeros dropped).
    pub fn decayed(&self) -> Census {
        Census { counts: self.counts.iter().filter(|(_, &c)| c >= 2).map(|(&k, &c)| (k, c / 2)).collect() }
    }

    /// Entries hottest first; ties in (layer, expert) order.
    pub fn hottest(&self) -> Vec<(u32, u32, u64)> {
        let mut v: Vec<_> = self.iter().collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then((a.0, a.1).cmp(&(b.0, b.1))));
        v
    }
}

/// `<model>.warm`, next to the model (`x.gguf` -> `x.gguf.warm`).
pub fn sidecar_path(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_owned();
    s.push(".warm");
    PathBuf::from(s)
}

/// A temp file name a save may write before renaming over `path`: beside it,
/// unpredictable (`.{name}.tmp.{pid}.{random}`), created exclusively.
pub fn sidecar_temp_path(path: &Path) -> PathBuf {
    pulsar_gguf::tempfile::temp_name_beside(path, "tmp")
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

pub fn encode_sidecar(fingerprint: &[u8; 32], census: &Census) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + census.len() * RECORD + 8);
    out.extend_from_slice(SIDECAR_MAGIC);
    out.extend_from_slice(&SIDECAR_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(fingerprint);
    out.extend_from_slice(&(census.len() as u64).to_le_bytes());
    for (l, e, c) in census.iter() {
        out.extend_from_slice(&l.to_le_bytes());
        out.extend_from_slice(&e.to_le_bytes());
        out.extend_from_slice(&c.to_le_bytes());
    }
    let sum = fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Decode and validate; the error says why the bytes are unusable.
pub fn decode_sidecar(bytes: &[u8], fingerprint: &[u8; 32]) -> std::result::Result<Census, String> {
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
    if bytes.len() < HEADER + 8 {
        return Err(format!("truncated ({} bytes)", bytes.len()));
    }
    if &bytes[..8] != SIDECAR_MAGIC {
        return Err("not a census sidecar (bad magic)".into());
    }
    let version = u32_at(8);
    if version != SIDECAR_VERSION {
        return Err(format!("format version {version}, this build reads {SIDECAR_VERSION}"));
    }
    let n = u64_at(48);
    let expected = n.checked_mul(RECORD as u64).and_then(|r| r.checked_add((HEADER + 8) as u64));
    if expected != Some(bytes.len() as u64) {
        return Err(format!("length {} does not match its {n} entries (truncated or corrupt)", bytes.len()));
    }
    let body = bytes.len() - 8;
    if fnv1a(&bytes[..body]) != u64_at(body) {
        return Err("checksum mismatch (corrupt)".into());
    }
    if &bytes[16..48] != fingerprint {
        return Err("written for a different GGUF (fingerprint mismatch)".into());
    }
    let mut census = Census::new();
    for i in 0..n as usize {
        let o = HEADER + i * RECORD;
        census.record(u32_at(o), u32_at(o + 4), u64_at(o + 8));
    }
    Ok(census)
}

/// What [`load_sidecar`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum SidecarLoad {
    Loaded(Census),
    /// No sidecar yet: a first run, nothing to warn about.
    Missing,
    /// Present but unusable (the reason was logged once as a warning).
    Ignored(String),
}

impl SidecarLoad {
    /// The census to start from (empty unless loaded).
    pub fn into_census(self) -> Census {
        match self {
            SidecarLoad::Loaded(c) => c,
            _ => Census::new(),
        }
    }
}

/// Read the sidecar at `path` for the GGUF with `fingerprint`.
pub fn load_sidecar(path: &Path, fingerprint: &[u8; 32]) -> SidecarLoad {
    let reason = match fs::read(path) {
        Ok(bytes) => match decode_sidecar(&bytes, fingerprint) {
            Ok(c) => return SidecarLoad::Loaded(c),
            Err(why) => why,
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return SidecarLoad::Missing,
        Err(e) => format!("unreadable ({e})"),
    };
    tracing::warn!("ignoring census sidecar {}: {reason}; starting with a clean census", path.display());
    SidecarLoad::Ignored(reason)
}

/// Merge this run's census into the sidecar (old / 2 + run) and write it
/// atomically. An unusable old sidecar counts as empty and is replaced with a
/// warning. A run that routed nothing (a server started and stopped idle)
/// leaves the sidecar as it is: halving it would let idle restarts erase the
/// history. Returns what the sidecar holds afterwards.
pub fn save_sidecar(path: &Path, fingerprint: &[u8; 32], run: &Census) -> Result<Census> {
    let old = match fs::read(path) {
        Ok(bytes) => decode_sidecar(&bytes, fingerprint).unwrap_or_else(|why| {
            tracing::warn!("replacing the unusable census sidecar {}: {why}", path.display());
            Census::new()
        }),
        Err(_) => Census::new(),
    };
    if run.is_empty() {
        return Ok(old);
    }
    let mut merged = old.decayed();
    merged.merge(run);
    write_atomic(path, &encode_sidecar(fingerprint, &merged)).map_err(|source| StoreError::SidecarWrite { path: path.to_owned(), source })?;
    Ok(merged)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // Created new under a fresh name: a symlink planted beside the sidecar is never followed.
    let (tmp, mut f) = pulsar_gguf::tempfile::create_temp_beside(path, "tmp")?;
    let res = (|| {
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        // The rename itself must reach the disk.
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        File::open(dir)?.sync_all()
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn census_counts_merge_decay_and_rank() {
        let mut c = Census::new();
        c.record(0, 3, 5);
        c.record(0, 3, 2);
        c.record(1, 0, 7);
        c.record(2, 9, 1);
        c.record(2, 8, 0);
        assert_eq!((c.count(0, 3), c.len(), c.total()), (7, 3, 15));
        assert_eq!(c.hottest(), vec![(0, 3, 7), (1, 0, 7), (2, 9, 1)]);
        let d = c.decayed();
        assert_eq!((d.count(0, 3), d.count(2, 9), d.len()), (3, 0, 2));
        let mut m = d.clone();
        m.merge(&c);
        assert_eq!(m.count(1, 0), 10);
    }

    #[test]
    fn encoding_round_trips_and_rejects_damage() {
        let fp = [7u8; 32];
        let mut c = Census::new();
        for i in 0..50 {
            c.record(i % 5, i, u64::from(i) * 1000 + 1);
        }
        let bytes = encode_sidecar(&fp, &c);
        assert_eq!(decode_sidecar(&bytes, &fp).unwrap(), c);
        assert!(decode_sidecar(&bytes, &[8u8; 32]).unwrap_err().contains("fingerprint"));
        assert!(decode_sidecar(&bytes[..bytes.len() - 1], &fp).is_err());
        assert!(decode_sidecar(&bytes[..20], &fp).unwrap_err().contains("truncated"));
        // Any single bit flip anywhere is caught.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 1 << (i % 8);
            assert!(decode_sidecar(&b, &fp).is_err(), "flip at byte {i} accepted");
        }
        let mut v2 = bytes.clone();
        v2[8] = 2;
        assert!(decode_sidecar(&v2, &fp).unwrap_err().contains("version"));
    }

    /// #28 defect 5: a symlink planted at the temp name a save used to pick
    /// (`.NAME.tmp.PID`) made the save overwrite its target.
    #[cfg(unix)]
    #[test]
    fn a_save_never_follows_a_planted_symlink() {
        let dir = std::env::temp_dir().join(format!("pulsar-census-link-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        fs::write(&victim, b"precious").unwrap();
        let side = dir.join("m.gguf.warm");
        std::os::unix::fs::symlink(&victim, dir.join(format!(".m.gguf.warm.tmp.{}", std::process::id()))).unwrap();
        let mut c = Census::new();
        c.record(0, 1, 3);
        save_sidecar(&side, &[7u8; 32], &c).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert!(decode_sidecar(&fs::read(&side).unwrap(), &[7u8; 32]).is_ok());
        fs::remove_dir_all(&dir).unwrap();
    }

    /// #28 defect 7: every idle restart of the server halved the census.
    #[test]
    fn a_run_that_routed_nothing_leaves_the_sidecar_alone() {
        let dir = std::env::temp_dir().join(format!("pulsar-census-idle-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let side = dir.join("m.gguf.warm");
        let mut c = Census::new();
        c.record(0, 1, 8);
        save_sidecar(&side, &[7u8; 32], &c).unwrap();
        let before = fs::read(&side).unwrap();
        for _ in 0..3 {
            assert_eq!(save_sidecar(&side, &[7u8; 32], &Census::new()).unwrap(), c);
        }
        assert_eq!(fs::read(&side).unwrap(), before, "an idle run rewrote the sidecar");
        // A run with touches still decays the old counts.
        let mut run = Census::new();
        run.record(1, 2, 1);
        let after = save_sidecar(&side, &[7u8; 32], &run).unwrap();
        assert_eq!((after.count(0, 1), after.count(1, 2)), (4, 1));
        // A corrupt sidecar is replaced (with a warning), not merged.
        fs::write(&side, b"PLSRWARM garbage").unwrap();
        assert_eq!(save_sidecar(&side, &[7u8; 32], &run).unwrap(), run);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn paths() {
        assert_eq!(sidecar_path(Path::new("/m/x.gguf")), PathBuf::from("/m/x.gguf.warm"));
        let t = sidecar_temp_path(Path::new("/m/x.gguf.warm"));
        assert_eq!(t.parent(), Some(Path::new("/m")));
        assert!(t.file_name().unwrap().to_string_lossy().starts_with(".x.gguf.warm.tmp."));
    }
}
