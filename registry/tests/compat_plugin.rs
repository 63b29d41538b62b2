//! The compatibility promise within 0.2.x, proven with a real library: a
//! plugin built against plugin-api 0.2.0 (`tests/compat/api-0.2.0`, a frozen
//! copy of the crate as the commit that introduced 0.2 left it) loads in this
//! host and its graph checks with this host's code.
//! The other direction, an incompatible API listed with a one-line reason,
//! is `discovery.rs`'s oldapi plugin.

use std::path::Path;
use std::process::Command;

use pulsar_plugin_api::testing::FakeModel;
use pulsar_plugin_api::{Dim, StepKind};
use pulsar_registry::{Registry, SearchPath, Status};

fn run(cmd: &mut Command) {
    let st = cmd.status().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(st.success(), "{cmd:?} failed");
}

#[test]
fn a_plugin_built_against_api_0_2_0_loads_and_its_graph_checks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let work = root.join("target/compat-plugin");
    let src = work.join("src");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src).unwrap();
    let api = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/api-0.2.0");
    let plugin = src.join("old-plugin");
    std::fs::create_dir_all(plugin.join("src")).unwrap();
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/old_plugin.rs"), plugin.join("src/lib.rs")).unwrap();
    std::fs::write(
        plugin.join("Cargo.toml"),
        format!(
            "[package]\nname = \"pulsar-compat-old\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[lib]\ncrate-type = [\"cdylib\"]\n\n[dependencies]\npulsar-plugin-api = {{ path = {:?} }}\nabi_stable = \"=0.11.3\"\n\n[workspace]\n",
            api.display().to_string()
        ),
    )
    .unwrap();
    // The workspace's lock pins the same dependency versions.
    std::fs::copy(root.join("Cargo.lock"), plugin.join("Cargo.lock")).unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo).args(["build", "--quiet", "--manifest-path"]).arg(plugin.join("Cargo.toml")).arg("--target-dir").arg(work.join("target")));

    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(work.join("target/debug/libpulsar_compat_old.so"), dir.path().join("libpulsar_compat_old.so")).unwrap();
    std::fs::write(
        dir.path().join("plugin.toml"),
        "name = \"old-0-2-0\"\nversion = \"0.1.0\"\napi = \"^0.2.0\"\narchitectures = [\"old-bigram\"]\nlibrary = \"libpulsar_compat_old.so\"\n",
    )
    .unwrap();
    let reg = Registry::discover(&SearchPath::only(&[dir.path().to_path_buf()]));
    let p = reg.plugins.iter().find(|p| p.name() == "old-0-2-0").expect("listed");
    assert_eq!(p.status, Status::Ok, "{}", p.line());
    let info = p.info.as_ref().unwrap();
    assert_eq!(info.api_version.as_str(), "0.2.0", "built against the old API");
    assert_ne!(pulsar_plugin_api::API_VERSION, "0.2.0", "this host is newer");
    let model = FakeModel::new()
        .u("old-bigram.embedding_length", 8)
        .t("token_embd.weight", &[8, 20])
        .t("output_norm.weight", &[8])
        .t("output.weight", &[8, 20]);
    let fam = (p.module().unwrap().open())("old-bigram".into(), model.view()).into_result().unwrap();
    let g = model.check_graph(&fam, StepKind::Prefill).unwrap();
    assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(20)]);
}
