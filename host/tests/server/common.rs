//! Shared by the server tests: the qwen3moe plugin from the staged plugin
//! folder, and a tiny synthetic qwen3moe model.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use pulsar_host::model::Model;
use pulsar_plugin_api::PluginModRef;
use pulsar_registry::{Registry, SearchPath};

/// The plugin libraries as `scripts/stage-plugins.sh` lays them out next to
/// the binary (two plugins cannot be linked into one test binary).
fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let dir = exe.parent().and_then(Path::parent).unwrap().join("plugins");
        assert!(dir.is_dir(), "{} is missing: run `cargo build --workspace && scripts/stage-plugins.sh` (scripts/test.sh does)", dir.display());
        Registry::discover(&SearchPath::only(&[dir]))
    })
}

pub fn plugin(arch: &str) -> (String, PluginModRef) {
    let (p, _) = registry().select(arch, None).unwrap_or_else(|e| panic!("no {arch} plugin staged: {e}"));
    (p.name(), p.module().expect("loaded"))
}

/// A 2-layer tiny synthetic qwen3moe (byte-level vocab, ChatML fallback template).
pub fn tiny_path() -> &'static Path {
    static P: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &P.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tiny-qwen3moe.gguf");
        let s = pulsar_host::synth::SynthSpec { n_layers: 2, ..pulsar_host::synth::preset("tiny").unwrap() };
        pulsar_host::synth::write(&s, &p, false).unwrap();
        (dir, p)
    })
    .1
}

pub fn tiny_model() -> Model {
    let (name, module) = plugin("qwen3moe");
    Model::open(tiny_path(), &name, module).unwrap()
}
