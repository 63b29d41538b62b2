//! The expert store behind the CPU MoE op: a host cache far smaller than the
//! experts gives logits bit-identical to everything resident, while the disk
//! tier does the work.

use std::path::Path;

use pulsar_host::cpu::{CpuBackend, ExpertSource, MappedExperts};
use pulsar_host::engine::Engine;
use pulsar_host::experts::StoreExperts;
use pulsar_host::model::Model;

fn logits(model: &Model, source: &dyn ExpertSource, prompt: &[u32], decode: usize) -> Vec<Vec<f32>> {
    let cpu = CpuBackend::new(2).unwrap();
    let mut eng = Engine::new(model, &cpu, source, 256);
    let mut rows = eng.forward(prompt, true).unwrap();
    for _ in 0..decode {
        let next = pulsar_host::sample::argmax(rows.last().unwrap());
        rows.extend(eng.forward(&[next], false).unwrap());
    }
    rows
}

fn check(path: &Path, budget_fraction: f64) {
    let model = Model::open(path, "qwen3moe", pulsar_arch_qwen3moe::plugin_module()).unwrap();
    let expert_bytes = model.memory_plan().expert_bytes;
    let prompt: Vec<u32> = (0..24u32).map(|i| (i * 37 + 11) % 200).collect();
    let want = logits(&model, &MappedExperts, &prompt, 8);

    let resident = StoreExperts::mapped(&model).unwrap();
    assert_eq!(logits(&model, &resident, &prompt, 8), want, "mapped store differs");

    let budget = (expert_bytes as f64 * budget_fraction) as u64;
    let cached = StoreExperts::open(&model, budget).unwrap();
    let got = logits(&model, &cached, &prompt, 8);
    assert_eq!(got, want, "host cache of {budget} bytes over {expert_bytes} changed the logits");
    let s = cached.store.stats();
    println!("{}: budget {budget} of {expert_bytes} expert bytes: {}", path.display(), serde_json::to_string(&s.total).unwrap());
    assert!(s.total.disk.bytes > 0, "the disk tier did no work");
    assert!(s.total.disk.bytes > expert_bytes / 2, "too few disk reads for a budget this small");
    let c = s.cache.unwrap();
    assert!(c.peak_held_bytes <= budget, "peak {} over budget {budget}", c.peak_held_bytes);
}

#[test]
fn tiny_host_cache_is_bit_identical_on_a_synthetic_model() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.gguf");
    let spec = pulsar_host::synth::SynthSpec { n_layers: 3, ..pulsar_host::synth::preset("tiny").unwrap() };
    pulsar_host::synth::write(&spec, &p, false).unwrap();
    check(&p, 0.45);
}

#[test]
fn tiny_host_cache_is_bit_identical_on_the_qwen3moe_fixture() {
    for variant in ["f32", "q8_0"] {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../fixtures/parity/qwen3moe/model-{variant}.gguf"));
        check(&p, 0.7);
    }
}

#[test]
fn census_sidecar_is_written_and_a_corrupt_one_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.gguf");
    let spec = pulsar_host::synth::SynthSpec { n_layers: 2, ..pulsar_host::synth::preset("tiny").unwrap() };
    pulsar_host::synth::write(&spec, &p, false).unwrap();
    let model = Model::open(&p, "qwen3moe", pulsar_arch_qwen3moe::plugin_module()).unwrap();
    let side = pulsar_store::sidecar_path(&p);
    std::fs::write(&side, b"garbage").unwrap();
    let st = StoreExperts::mapped(&model).unwrap();
    let _ = logits(&model, &st, &[1, 2, 3, 4], 2);
    st.save_census(&p, &model).unwrap();
    match pulsar_store::load_sidecar(&side, &model.file.fingerprint()) {
        pulsar_store::SidecarLoad::Loaded(c) => assert!(!c.hottest().is_empty()),
        _ => panic!("sidecar not readable after save"),
    }
}

/// Expert popularity over layer 0 after prefilling pseudo-random tokens.
fn popularity(skew: f32) -> Vec<u64> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.gguf");
    let spec = pulsar_host::synth::SynthSpec { n_layers: 2, skew, ..pulsar_host::synth::preset("tiny").unwrap() };
    pulsar_host::synth::write(&spec, &p, false).unwrap();
    let model = Model::open(&p, "qwen3moe", pulsar_arch_qwen3moe::plugin_module()).unwrap();
    let st = StoreExperts::mapped(&model).unwrap();
    let prompt: Vec<u32> = (0..128u32).map(|i| (i.wrapping_mul(2654435761) >> 7) % 256).collect();
    let _ = logits(&model, &st, &prompt, 0);
    let c = st.store.census();
    (0..spec.n_expert).map(|e| c.count(0, e)).collect()
}

#[test]
fn synthetic_routing_skew_is_controllable() {
    let uniform = popularity(0.0);
    let skewed = popularity(3.0);
    let share = |v: &[u64]| v[..4].iter().sum::<u64>() as f64 / v.iter().sum::<u64>() as f64;
    println!("skew 0: {uniform:?} (top-4 share {:.2}); skew 3: {skewed:?} (top-4 share {:.2})", share(&uniform), share(&skewed));
    assert!(uniform.iter().filter(|&&c| c > 0).count() >= 14, "skew 0 should use nearly every expert: {uniform:?}");
    assert!(share(&uniform) < 0.45, "skew 0 is not close to uniform: {uniform:?}");
    assert!(share(&skewed) > share(&uniform) + 0.2, "skew 3 does not concentrate routing: {skewed:?}");
}
