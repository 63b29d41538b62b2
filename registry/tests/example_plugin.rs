//! The out-of-tree example plugin builds on its own (as a third party would
//! build it) and loads through the registry.

use std::path::Path;
use std::process::Command;

use pulsar_plugin_api::testing::FakeModel;
use pulsar_plugin_api::{Dim, StepKind};
use pulsar_registry::{Registry, SearchPath, Status};

#[test]
fn example_plugin_builds_out_of_tree_and_loads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let example = root.join("examples/hello-family");
    // Its own target dir: it is not a workspace member and must not wait on our build lock.
    let target = root.join("target/example-plugin");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "--manifest-path"])
        .arg(example.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building the example plugin failed");

    let dir = tempfile::tempdir().unwrap();
    let lib = target.join("debug/libpulsar_example_hello.so");
    std::fs::copy(&lib, dir.path().join("libpulsar_example_hello.so")).unwrap();
    std::fs::copy(example.join("plugin.toml"), dir.path().join("plugin.toml")).unwrap();
    let reg = Registry::discover(&SearchPath::only(&[dir.path().to_path_buf()]));
    let p = reg.plugins.iter().find(|p| p.name() == "hello-bigram").expect("listed");
    assert_eq!(p.status, Status::Ok, "{}", p.line());
    let (sel, _) = reg.select("hello-bigram", None).unwrap();

    let model = FakeModel::new()
        .u("hello-bigram.embedding_length", 8)
        .t("token_embd.weight", &[8, 20])
        .t("output_norm.weight", &[8])
        .t("output.weight", &[8, 20]);
    let fam = (sel.module().unwrap().open())("hello-bigram".into(), model.view()).into_result().unwrap();
    let g = model.check_graph(&fam, StepKind::Prefill).unwrap();
    assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(20)]);
}
