//! NVRTC: kernel source to CUBIN for one architecture, with an on-disk cache.
//!
//! cudarc's safe NVRTC API returns PTX only, so this goes through the raw
//! functions: `nvrtcCompileProgram` with `--gpu-architecture=sm_XY` (a real
//! architecture, so NVRTC emits SASS), then `nvrtcGetCUBIN`.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nv, sys as nvsys};

use crate::error::CudaError;
use crate::kernels::Family;

/// Whether the NVRTC shared library can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { nvsys::is_culib_present() }
}

fn require_nvrtc() -> Result<(), CudaError> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(CudaError::Unavailable(
            "libnvrtc not found (install the CUDA toolkit or the nvidia-cuda-nvrtc wheel; \
             tools/nvrtc/setup.sh does the latter)"
                .into(),
        ))
    }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the out-pointers are valid.
    unsafe { nvsys::nvrtcVersion(&mut major, &mut minor) }.result()?;
    Ok((major, minor))
}

/// The `sm_XY` name of a compute capability.
pub fn arch_name(cc: (i32, i32)) -> String {
    format!("sm_{}{}", cc.0, cc.1)
}

/// NVRTC options besides the architecture (part of the cache key).
const OPTIONS: [&str; 3] = ["--std=c++17", "--fmad=true", "-default-device"];

/// Compile one family's source for `arch` (e.g. `sm_90`) to a CUBIN image.
/// `include_dirs` are passed as `-I` (the sources need none; kept for headers
/// a future kernel may include).
pub fn compile_cubin(
    family: Family,
    arch: &str,
    include_dirs: &[PathBuf],
) -> Result<Vec<u8>, CudaError> {
    require_nvrtc()?;
    let src = CString::new(family.source()).map_err(|_| CudaError::Compile {
        source_name: family.file(),
        arch: arch.to_string(),
        log: "source holds a NUL byte".into(),
    })?;
    let name = CString::new(family.file()).expect("file names hold no NUL");
    let mut opts = vec![format!("--gpu-architecture={arch}")];
    opts.extend(OPTIONS.iter().map(|o| o.to_string()));
    for d in include_dirs {
        opts.push(format!("-I{}", d.display()));
    }
    let prog = nv::create_program(&src, Some(&name))?;
    // SAFETY: `prog` is live until destroy_program below; src/name outlive it.
    unsafe {
        let compiled = nv::compile_program(prog, &opts);
        let result = match compiled {
            Ok(()) => cubin(prog),
            Err(_) => {
                let log = nv::get_program_log(prog)
                    .map(log_string)
                    .unwrap_or_default();
                Err(CudaError::Compile {
                    source_name: family.file(),
                    arch: arch.to_string(),
                    log,
                })
            }
        };
        let _ = nv::destroy_program(prog);
        result
    }
}

/// # Safety
/// `prog` must be a live, successfully compiled program.
unsafe fn cubin(prog: nvsys::nvrtcProgram) -> Result<Vec<u8>, CudaError> {
    let mut size = 0usize;
    unsafe { nvsys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut buf = vec![0u8; size];
    unsafe { nvsys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char) }.result()?;
    Ok(buf)
}

fn log_string(v: Vec<c_char>) -> String {
    let bytes: Vec<u8> = v
        .into_iter()
        .take_while(|&c| c != 0)
        .map(|c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// FNV-1a, 64 bit: a stable hash for cache keys (std's hasher may change between releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The default cache folder: `$XDG_CACHE_HOME/pulsar/kernels` or `~/.cache/pulsar/kernels`.
/// Read once when a device opens, never on a hot path.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("pulsar").join("kernels"))
}

/// Cache file of one family for one arch and NVRTC version: `<hash>.cubin`.
pub fn cache_path(dir: &Path, family: Family, arch: &str, nvrtc: (i32, i32)) -> PathBuf {
    let ver = format!("{}.{}", nvrtc.0, nvrtc.1);
    let opts = OPTIONS.join(" ");
    let h = fnv1a(&[
        family.source().as_bytes(),
        arch.as_bytes(),
        ver.as_bytes(),
        opts.as_bytes(),
    ]);
    dir.join(format!("{h:016x}.cubin"))
}

/// A CUBIN from the cache, else compiled and written to it (best effort: a
/// cache that cannot be written costs a compile next time, nothing more).
pub fn cubin_cached(
    family: Family,
    arch: &str,
    cache_dir: Option<&Path>,
) -> Result<Vec<u8>, CudaError> {
    let ver = nvrtc_version()?;
    let path = cache_dir.map(|d| cache_path(d, family, arch, ver));
    if let Some(p) = &path {
        if let Ok(b) = std::fs::read(p) {
            if b.starts_with(b"\x7fELF") {
                return Ok(b);
            }
        }
    }
    compile_and_store(family, arch, cache_dir)
}

/// Compile afresh and (best effort) replace the cache entry: for a cached
/// image the driver refused to load.
pub fn compile_and_store(
    family: Family,
    arch: &str,
    cache_dir: Option<&Path>,
) -> Result<Vec<u8>, CudaError> {
    let ver = nvrtc_version()?;
    let path = cache_dir.map(|d| cache_path(d, family, arch, ver));
    let bin = compile_cubin(family, arch, &[])?;
    if let (Some(p), Some(dir)) = (&path, cache_dir) {
        if std::fs::create_dir_all(dir).is_ok() {
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &bin).is_ok() && std::fs::rename(&tmp, p).is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
        }
    }
    Ok(bin)
}

/// Whether the ELF image names `entry` (its symbol table holds the name).
pub fn cubin_has_symbol(cubin: &[u8], entry: &str) -> bool {
    let mut pat = entry.as_bytes().to_vec();
    pat.push(0);
    cubin.windows(pat.len()).any(|w| w == pat.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_depends_on_arch_version_and_source() {
        let d = Path::new("/c");
        let a = cache_path(d, Family::Act, "sm_90", (13, 0));
        assert_ne!(a, cache_path(d, Family::Act, "sm_89", (13, 0)));
        assert_ne!(a, cache_path(d, Family::Act, "sm_90", (13, 1)));
        assert_ne!(a, cache_path(d, Family::Moe, "sm_90", (13, 0)));
        assert_eq!(a, cache_path(d, Family::Act, "sm_90", (13, 0)));
        assert_eq!(arch_name((8, 6)), "sm_86");
    }
}
