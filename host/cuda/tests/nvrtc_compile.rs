//! Compiles every kernel source with NVRTC for sm_80, sm_86, sm_89 and sm_90,
//! with no GPU present, and checks each CUBIN names every entry point of its
//! family's table.
//!
//! NVRTC comes from the PyPI wheel `nvidia-cuda-nvrtc`: run
//! `tools/nvrtc/setup.sh` and export what it prints (PULSAR_NVRTC_LIB_DIR), or
//! put the wheel's lib dir on LD_LIBRARY_PATH. A system CUDA install works too.

use std::path::PathBuf;

use pulsar_cuda::compile::{
    cache_path, compile_cubin, cubin_cached, cubin_has_symbol, nvrtc_available, nvrtc_version,
};
use pulsar_cuda::Family;

const ARCHS: [&str; 4] = ["sm_80", "sm_86", "sm_89", "sm_90"];

/// Load libnvrtc from PULSAR_NVRTC_LIB_DIR by full path, so that cudarc's later
/// dlopen by soname finds the already-loaded library.
fn preload_from_env() -> Result<(), String> {
    let Some(dir) = std::env::var_os("PULSAR_NVRTC_LIB_DIR") else {
        return Ok(());
    };
    let dir = PathBuf::from(dir);
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut names: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc") && n.contains(".so"))
        })
        .collect();
    // The builtins library first: libnvrtc loads it by name at compile time.
    names.sort_by_key(|p| !p.to_string_lossy().contains("builtins"));
    for p in names {
        // SAFETY: loading NVIDIA's NVRTC libraries runs no unusual initialisers.
        let lib =
            unsafe { libloading::Library::new(&p) }.map_err(|e| format!("{}: {e}", p.display()))?;
        // Keep it loaded for the life of the test process.
        std::mem::forget(lib);
    }
    Ok(())
}

#[test]
fn every_kernel_compiles_for_every_arch() {
    if let Err(e) = preload_from_env() {
        panic!("PULSAR_NVRTC_LIB_DIR is set but its libraries do not load: {e}");
    }
    assert!(
        nvrtc_available(),
        "libnvrtc not found: run tools/nvrtc/setup.sh and export the PULSAR_NVRTC_LIB_DIR it \
         prints (or put that folder on LD_LIBRARY_PATH), then run this test again"
    );
    let ver = nvrtc_version().expect("nvrtcVersion");
    eprintln!("NVRTC {}.{}", ver.0, ver.1);
    let mut failures = Vec::new();
    for family in Family::ALL {
        for arch in ARCHS {
            match compile_cubin(family, arch, &[]) {
                Ok(bin) => {
                    assert!(
                        bin.starts_with(b"\x7fELF"),
                        "{} {arch}: not an ELF image",
                        family.file()
                    );
                    for e in family.entries() {
                        if !cubin_has_symbol(&bin, e) {
                            failures.push(format!("{} {arch}: entry {e} missing", family.file()));
                        }
                    }
                }
                Err(e) => failures.push(format!("{e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn compiled_kernels_are_cached_on_disk() {
    if let Err(e) = preload_from_env() {
        panic!("PULSAR_NVRTC_LIB_DIR is set but its libraries do not load: {e}");
    }
    assert!(
        nvrtc_available(),
        "libnvrtc not found: run tools/nvrtc/setup.sh and export the PULSAR_NVRTC_LIB_DIR it prints"
    );
    let dir = std::env::temp_dir().join(format!("pulsar-cuda-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ver = nvrtc_version().unwrap();
    let path = cache_path(&dir, Family::Act, "sm_86", ver);
    let first = cubin_cached(Family::Act, "sm_86", Some(&dir)).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        first,
        "the compile is written to the cache"
    );
    // A second call is served from the file: prove it by planting a marked image.
    let mut marked = first.clone();
    marked.extend_from_slice(b"pulsar-cache-marker");
    std::fs::write(&path, &marked).unwrap();
    assert_eq!(
        cubin_cached(Family::Act, "sm_86", Some(&dir)).unwrap(),
        marked
    );
    // Something that is not an ELF image is ignored and recompiled.
    std::fs::write(&path, b"garbage").unwrap();
    assert_eq!(
        cubin_cached(Family::Act, "sm_86", Some(&dir)).unwrap(),
        first
    );
    let _ = std::fs::remove_dir_all(&dir);
}
