//! Temporary files beside user data, made safe against a planted symlink or
//! a concurrent writer: an unpredictable name in the target's directory,
//! created exclusively (never following or truncating what is there), then
//! renamed into place by the caller.

use std::collections::hash_map::RandomState;
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::path::{Path, PathBuf};

/// A fresh name beside `path`: `.{file name}.{tag}.{pid}.{16 random hex}`.
pub fn temp_name_beside(path: &Path, tag: &str) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "file".into());
    // RandomState is seeded from the OS per instance: an unguessable suffix with no dependency.
    let mut h = RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    path.with_file_name(format!(".{name}.{tag}.{}.{:016x}", std::process::id(), h.finish()))
}

/// Create a new file at `path`, failing if anything (a file, a symlink) is there.
pub fn create_exclusive(path: &Path) -> io::Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}

/// A temporary file beside `path`, created exclusively under a fresh name
/// (a few tries, should a name ever be taken).
pub fn create_temp_beside(path: &Path, tag: &str) -> io::Result<(PathBuf, File)> {
    let mut last = None;
    for _ in 0..8 {
        let p = temp_name_beside(path, tag);
        match create_exclusive(&p) {
            Ok(f) => return Ok((p, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no free temporary name")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_beside_the_target_and_differ() {
        let a = temp_name_beside(Path::new("/m/x.gguf"), "partial");
        let b = temp_name_beside(Path::new("/m/x.gguf"), "partial");
        assert_eq!(a.parent(), Some(Path::new("/m")));
        assert!(a.file_name().unwrap().to_string_lossy().starts_with(&format!(".x.gguf.partial.{}.", std::process::id())));
        assert_ne!(a, b);
    }

    #[test]
    fn an_existing_file_or_symlink_is_never_opened() {
        let dir = std::env::temp_dir().join(format!("pulsar-tmp-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let link = dir.join("link");
        let _ = std::fs::remove_file(&link);
        #[cfg(unix)]
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        #[cfg(unix)]
        assert_eq!(create_exclusive(&link).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(create_exclusive(&victim).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        let (p, _f) = create_temp_beside(&victim, "tmp").unwrap();
        assert!(p.exists() && p.parent() == Some(dir.as_path()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
