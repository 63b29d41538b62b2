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

/// Remove the temporary files `tag` left beside `path` by processes that no
/// longer run (a crash between create and rename): only regular files whose
/// name is `temp_name_beside`'s with a dead pid. A live writer's file, a
/// symlink, or anything else is left alone; failures are ignored (the sweep
/// only tidies). Returns how many were removed.
pub fn sweep_dead_temps(path: &Path, tag: &str) -> usize {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else { return 0 };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let prefix = format!(".{}.{tag}.", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = file.strip_prefix(&prefix) else { continue };
        let Some((pid, suffix)) = rest.split_once('.') else { continue };
        let ours = pid.parse::<u32>().is_ok() && suffix.len() == 16 && suffix.bytes().all(|b| b.is_ascii_hexdigit());
        let dead = ours && !Path::new("/proc").join(pid).exists();
        if dead && e.path().symlink_metadata().is_ok_and(|m| m.file_type().is_file()) && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// A temporary file beside `path`, created exclusively under a fresh name
/// (a few tries, should a name ever be taken), after sweeping away what dead
/// processes left under the same tag.
pub fn create_temp_beside(path: &Path, tag: &str) -> io::Result<(PathBuf, File)> {
    sweep_dead_temps(path, tag);
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

    #[test]
    fn a_dead_writers_leftover_is_swept_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("pulsar-sweep-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("m.gguf");
        // No process has pid 4294967: /proc caps pids far below it.
        let dead = dir.join(".m.gguf.warm.4294967.00112233aabbccdd");
        let live = temp_name_beside(&target, "warm");
        let other_tag = dir.join(".m.gguf.partial.4294967.00112233aabbccdd");
        let odd = dir.join(".m.gguf.warm.4294967.not-hex");
        let victim = dir.join("victim");
        for p in [&dead, &live, &other_tag, &odd, &victim] {
            std::fs::write(p, b"x").unwrap();
        }
        let link = dir.join(".m.gguf.warm.4294968.00112233aabbccdd");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert_eq!(sweep_dead_temps(&target, "warm"), 1);
        assert!(!dead.exists());
        for p in [&live, &other_tag, &odd, &victim, &link] {
            assert!(p.symlink_metadata().is_ok(), "{} was removed", p.display());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
