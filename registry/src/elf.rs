//! A pre-flight check of a shared library before `dlopen`.
//!
//! The dynamic loader maps segments without checking them against the file's
//! length, so a truncated library "loads" and then kills the process with
//! SIGBUS on first touch. We read the ELF header and program headers ourselves
//! and refuse files whose loadable segments or tables run past the end.

use std::io::Read;
use std::path::Path;

const ET_DYN: u16 = 3;
const PT_LOAD: u32 = 1;

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

fn host_machine() -> Option<u16> {
    match std::env::consts::ARCH {
        "x86_64" => Some(62),
        "aarch64" => Some(183),
        _ => None,
    }
}

/// `Ok` when the file looks like a complete 64-bit little-endian shared object
/// for this machine; otherwise a one-line reason.
pub fn check_shared_object(path: &Path) -> Result<(), String> {
    let len = std::fs::metadata(path).map_err(|e| format!("cannot stat: {e}"))?.len();
    let mut head = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(64 * 1024).read_to_end(&mut head))
        .map_err(|e| format!("cannot read: {e}"))?;
    if head.len() < 64 || &head[..4] != b"\x7fELF" {
        return Err("not an ELF shared library".into());
    }
    if head[4] != 2 || head[5] != 1 {
        return Err("not a 64-bit little-endian ELF library".into());
    }
    let bad = || "corrupt ELF header".to_string();
    let e_type = u16_at(&head, 16).ok_or_else(bad)?;
    let machine = u16_at(&head, 18).ok_or_else(bad)?;
    if e_type != ET_DYN {
        return Err("ELF file is not a shared library".into());
    }
    if let Some(m) = host_machine() {
        if machine != m {
            return Err(format!("built for another processor (ELF machine {machine})"));
        }
    }
    let phoff = u64_at(&head, 32).ok_or_else(bad)?;
    let shoff = u64_at(&head, 40).ok_or_else(bad)?;
    let phentsize = u16_at(&head, 54).ok_or_else(bad)? as u64;
    let phnum = u16_at(&head, 56).ok_or_else(bad)? as u64;
    let shentsize = u16_at(&head, 58).ok_or_else(bad)? as u64;
    let shnum = u16_at(&head, 60).ok_or_else(bad)? as u64;
    let truncated = |what: &str| format!("truncated: {what} runs past the end of the {len}-byte file");
    let ph_end = phentsize.checked_mul(phnum).and_then(|n| n.checked_add(phoff)).ok_or_else(bad)?;
    if phentsize < 56 || ph_end > len {
        return Err(truncated("the program header table"));
    }
    let sh_end = shentsize.checked_mul(shnum).and_then(|n| n.checked_add(shoff)).ok_or_else(bad)?;
    if shnum > 0 && sh_end > len {
        return Err(truncated("the section header table"));
    }
    // Program headers usually sit right after the ELF header; read them whole.
    let mut ph = vec![0u8; (ph_end - phoff) as usize];
    {
        use std::io::{Seek, SeekFrom};
        let mut f = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
        f.seek(SeekFrom::Start(phoff)).and_then(|_| f.read_exact(&mut ph)).map_err(|_| truncated("the program header table"))?;
    }
    for i in 0..phnum as usize {
        let o = i * phentsize as usize;
        if u32_at(&ph, o) != Some(PT_LOAD) {
            continue;
        }
        let off = u64_at(&ph, o + 8).ok_or_else(bad)?;
        let filesz = u64_at(&ph, o + 32).ok_or_else(bad)?;
        if off.checked_add(filesz).is_none_or(|end| end > len) {
            return Err(truncated("a loadable segment"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_non_elf_and_truncated_and_accepts_a_real_library() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.so");
        std::fs::write(&p, b"hello").unwrap();
        assert!(check_shared_object(&p).unwrap_err().contains("not an ELF"));
        // The C library this test binary links against is a complete shared object.
        let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6"]
            .into_iter()
            .map(Path::new)
            .find(|p| p.is_file());
        if let Some(libc) = libc {
            assert_eq!(check_shared_object(libc), Ok(()));
            let bytes = std::fs::read(libc).unwrap();
            for cut in [64usize, 1000, bytes.len() / 2, bytes.len() - 1] {
                std::fs::write(&p, &bytes[..cut]).unwrap();
                let e = check_shared_object(&p).unwrap_err();
                assert!(e.contains("truncated"), "cut {cut}: {e}");
            }
        }
    }
}
