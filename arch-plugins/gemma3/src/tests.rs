use super::*;
use pulsar_plugin_api::graph::Op;
use pulsar_plugin_api::testing::{count_ops, FakeModel};
use pulsar_plugin_api::{Dim, FamilyBox, StepKind};

/// A gemma3-shaped model with 7 layers: 5 local, 1 global, 1 local.
fn model() -> FakeModel {
    let (e, hd, nh, nkv, ff, v) = (16u64, 8u64, 2u64, 1u64, 32u64, 50u64);
    let mut m = FakeModel::new()
        .s("general.architecture", "gemma3")
        .u("gemma3.block_count", 7)
        .u("gemma3.embedding_length", e)
        .u("gemma3.feed_forward_length", ff)
        .u("gemma3.attention.head_count", nh)
        .u("gemma3.attention.head_count_kv", nkv)
        .u("gemma3.attention.key_length", hd)
        .u("gemma3.attention.value_length", hd)
        .f("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
        .f("gemma3.rope.freq_base", 1e6)
        .u("gemma3.attention.sliding_window", 4)
        .u("gemma3.context_length", 128)
        .t("token_embd.weight", &[e, v])
        .t("output_norm.weight", &[e]);
    for l in 0..7 {
        let t = |s: &str| format!("blk.{l}.{s}.weight");
        m = m
            .t(&t("attn_norm"), &[e])
            .t(&t("attn_q"), &[e, nh * hd])
            .t(&t("attn_k"), &[e, nkv * hd])
            .t(&t("attn_v"), &[e, nkv * hd])
            .t(&t("attn_output"), &[nh * hd, e])
            .t(&t("attn_q_norm"), &[hd])
            .t(&t("attn_k_norm"), &[hd])
            .t(&t("post_attention_norm"), &[e])
            .t(&t("ffn_norm"), &[e])
            .t(&t("ffn_gate"), &[e, ff])
            .t(&t("ffn_up"), &[e, ff])
            .t(&t("ffn_down"), &[ff, e])
            .t(&t("post_ffw_norm"), &[e]);
    }
    m
}

fn open(m: &FakeModel) -> Result<FamilyBox, String> {
    let module = plugin_module();
    (module.open())("gemma3".into(), m.view()).into_result().map_err(|e| e.into_string())
}

#[test]
fn plan_declares_every_weight_and_a_window_per_layer() {
    let m = model();
    let fam = open(&m).unwrap();
    let plan = fam.plan();
    assert_eq!(plan.n_layers, 7);
    assert_eq!(plan.n_vocab, 50);
    // 13 per layer + embedding + output norm; the output head is tied.
    assert_eq!(plan.weights.len(), 7 * 13 + 2);
    let windows: Vec<u32> = plan.states.iter().map(|k| k.as_kv().unwrap().3).collect();
    assert_eq!(windows, vec![4, 4, 4, 4, 4, 0, 4]);
}

#[test]
fn forward_builds_a_shape_consistent_graph() {
    let m = model();
    let fam = open(&m).unwrap();
    let g = m.check_graph(&fam, StepKind::Prefill).unwrap();
    assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(50)]);
    // The global layer (5) attends over its whole cache; local layers over the window.
    let windows: Vec<u32> = g.ops.iter().filter_map(|o| if let Op::Attention(a) = o { Some(a.window) } else { None }).collect();
    assert_eq!(windows, vec![4, 4, 4, 4, 4, 0, 4]);
    assert_eq!(count_ops(&g, "embed"), 1);
    assert!(matches!(g.ops[g.output as usize], Op::Linear(_)));
}

#[test]
fn missing_key_and_tensor_are_named() {
    let m = model().without_key("gemma3.attention.head_count_kv");
    let e = open(&m).err().unwrap();
    assert!(e.contains("gemma3.attention.head_count_kv"), "{e}");
    let m = model().without_tensor("blk.3.ffn_up.weight");
    let e = open(&m).err().unwrap();
    assert!(e.contains("blk.3.ffn_up.weight"), "{e}");
    let m = model().t("blk.2.attn_q_norm.weight", &[7]);
    let e = open(&m).err().unwrap();
    assert!(e.contains("blk.2.attn_q_norm.weight") && e.contains("shape"), "{e}");
}

#[test]
fn wrong_arch_is_refused() {
    let m = model();
    let e = (plugin_module().open())("llama".into(), m.view()).into_result().err().unwrap();
    assert!(e.contains("llama"));
}
