//! Loads real plugin libraries built by `cargo build --workspace` (the README's
//! test command does that first) from temporary plugin folders.

use std::path::{Path, PathBuf};

use pulsar_plugin_api::testing::FakeModel;
use pulsar_registry::{Registry, SearchPath, Status};

/// `target/<profile>` of this test binary (`target/<profile>/deps/<test>`).
fn artifact_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

fn built_lib(crate_name: &str) -> PathBuf {
    let p = artifact_dir().join(format!("lib{}.so", crate_name.replace('-', "_")));
    assert!(p.is_file(), "{} is missing: run `cargo build --workspace` first (scripts/test.sh does)", p.display());
    p
}

fn manifest(name: &str, api: &str, archs: &[&str], lib: &str) -> String {
    let archs: Vec<String> = archs.iter().map(|a| format!("{a:?}")).collect();
    format!("name = {name:?}\nversion = \"0.1.0\"\napi = {api:?}\narchitectures = [{}]\nlibrary = {lib:?}\n", archs.join(", "))
}

/// Put a library (copied) and its manifest into `root/<folder>/`.
fn install(root: &Path, folder: &str, lib: &Path, manifest_text: &str) {
    let dir = root.join(folder);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(lib, dir.join(lib.file_name().unwrap())).unwrap();
    std::fs::write(dir.join("plugin.toml"), manifest_text).unwrap();
}

fn find<'a>(reg: &'a Registry, name: &str) -> &'a pulsar_registry::Plugin {
    reg.plugins.iter().find(|p| p.name() == name).unwrap_or_else(|| panic!("{name} not listed: {:?}", reg.plugins))
}

#[test]
fn two_plugins_in_one_folder_load_as_themselves() {
    let tmp = tempfile::tempdir().unwrap();
    // One plugin folder, one subfolder per plugin (each manifest is plugin.toml).
    for f in ["gemma3", "qwen3moe"] {
        let lib = built_lib(&format!("pulsar-arch-{f}"));
        let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../arch-plugins/{f}/plugin.toml"))).unwrap();
        install(tmp.path(), f, &lib, &text);
    }
    let reg = Registry::discover(&SearchPath::only(&[tmp.path().to_path_buf()]));
    let names: Vec<String> = reg.ok().map(|p| p.info.as_ref().unwrap().name.to_string()).collect();
    assert_eq!(names, vec!["gemma3".to_string(), "qwen3moe".to_string()], "{:?}", reg.plugins);
    // Each module answers with its own identity (the abi_stable per-type cache would return the first twice).
    for p in reg.ok() {
        let info = (p.module().unwrap().describe())().into_result().unwrap();
        assert_eq!(info.name.as_str(), p.name());
        assert_eq!(info.api_version.as_str(), pulsar_plugin_api::API_VERSION);
    }
    let (g, warn) = reg.select("gemma3", None).unwrap();
    assert_eq!(g.name(), "gemma3");
    assert!(warn.is_none());
    assert!(reg.select("llama", None).is_err());
}

#[test]
fn broken_and_incompatible_plugins_are_one_line_each_and_good_ones_still_load() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let good = built_lib("pulsar-testplugin-panicky");
    install(root, "good", &good, &manifest("panicky", "^0.2", &["panicky"], "libpulsar_testplugin_panicky.so"));
    let old = built_lib("pulsar-testplugin-oldapi");
    // Honest manifest: refused by the semver check before any code runs.
    install(root, "old-honest", &old, &manifest("oldapi", "^0.9", &["old"], "libpulsar_testplugin_oldapi.so"));
    // Lying manifest: caught by abi_stable's version check at load.
    install(root, "old-lying", &old, &manifest("oldapi-lying", "^0.2", &["old"], "libpulsar_testplugin_oldapi.so"));
    let noroot = built_lib("pulsar-testplugin-noroot");
    install(root, "noroot", &noroot, &manifest("noroot", "^0.2", &["x"], "libpulsar_testplugin_noroot.so"));
    // A truncated copy of a good library.
    std::fs::create_dir_all(root.join("truncated")).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(root.join("truncated/libtrunc.so"), &bytes[..bytes.len().min(6000)]).unwrap();
    std::fs::write(root.join("truncated/plugin.toml"), manifest("trunc", "^0.2", &["t"], "libtrunc.so")).unwrap();
    // Random bytes named .so.
    std::fs::create_dir_all(root.join("random")).unwrap();
    let noise: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::write(root.join("random/librandom.so"), noise).unwrap();
    std::fs::write(root.join("random/plugin.toml"), manifest("random", "^0.2", &["r"], "librandom.so")).unwrap();
    // A manifest that does not parse.
    std::fs::create_dir_all(root.join("badmanifest")).unwrap();
    std::fs::write(root.join("badmanifest/plugin.toml"), "name = [unclosed").unwrap();
    // A stray library with no manifest.
    std::fs::write(root.join("libstray.so"), b"not even elf").unwrap();

    let reg = Registry::discover(&SearchPath::only(&[root.to_path_buf()]));
    assert_eq!(find(&reg, "panicky").status, Status::Ok);

    let expect = |name: &str, label: &str, needle: &str| {
        let p = find(&reg, name);
        assert_eq!(p.status.label(), label, "{name}: {:?}", p.status);
        let line = p.line();
        assert!(!line.contains('\n'), "{name}: multi-line: {line}");
        assert!(line.len() < 400, "{name}: too long: {line}");
        assert!(line.contains(needle), "{name}: {line} lacks {needle}");
        assert!(line.contains(&*root.to_string_lossy()), "{name}: {line} does not name the file");
    };
    expect("oldapi", "incompatible", "requires plugin-api ^0.9");
    expect("oldapi-lying", "incompatible", "ABI layout differs");
    expect("noroot", "failed", "no root module");
    expect("trunc", "failed", "cannot load library");
    expect("random", "failed", "cannot load library");
    expect("plugin.toml", "failed", "does not parse");
    expect("libstray.so", "failed", "no plugin.toml");
    // The lying plugin keeps abi_stable's long report for --verbose only.
    assert!(find(&reg, "oldapi-lying").detail.is_some());
    // Selection skips unusable plugins and says why.
    let e = reg.select("old", None).unwrap_err().to_string();
    assert!(e.contains("unusable"), "{e}");
}

#[test]
fn missing_or_empty_plugin_folders_are_not_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let reg = Registry::discover(&SearchPath::only(&[tmp.path().join("does-not-exist"), tmp.path().to_path_buf()]));
    assert!(reg.plugins.is_empty());
    assert_eq!(reg.searched.len(), 2);
    assert!(!reg.searched[0].1 && reg.searched[1].1);
}

#[test]
fn panics_in_a_loaded_plugin_become_errors() {
    let tmp = tempfile::tempdir().unwrap();
    install(tmp.path(), "p", &built_lib("pulsar-testplugin-panicky"), &manifest("panicky", "^0.2", &["panicky"], "libpulsar_testplugin_panicky.so"));
    let reg = Registry::discover(&SearchPath::only(&[tmp.path().to_path_buf()]));
    let module = find(&reg, "panicky").module().unwrap();
    let model = FakeModel::new().s("panicky.at", "open");
    let e = (module.open())("panicky".into(), model.view()).into_result().err().unwrap();
    assert!(e.contains("panicked") && e.contains("open exploded"), "{e}");

    let calm = FakeModel::new();
    let fam = (module.open())("panicky".into(), calm.view()).into_result().unwrap();
    let e = fam.build(pulsar_plugin_api::StepKind::Decode).into_result().err().unwrap();
    assert!(e.contains("forward exploded"), "{e}");
}

#[test]
fn two_plugins_claiming_one_arch_pick_the_earlier_folder_with_a_warning() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let lib = built_lib("pulsar-testplugin-panicky");
    install(a.path(), "x", &lib, &manifest("panicky", "^0.2", &["panicky"], "libpulsar_testplugin_panicky.so"));
    install(b.path(), "y", &lib, &manifest("panicky", "^0.2", &["panicky"], "libpulsar_testplugin_panicky.so"));
    let reg = Registry::discover(&SearchPath::only(&[b.path().to_path_buf(), a.path().to_path_buf()]));
    let (p, warn) = reg.select("panicky", None).unwrap();
    assert!(p.path.starts_with(b.path()));
    assert!(warn.unwrap().contains("2 plugins claim"));
    let e = reg.select("panicky", Some("nope")).unwrap_err().to_string();
    assert!(e.contains("nope"));
}
