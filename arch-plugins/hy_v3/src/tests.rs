use super::*;
use pulsar_plugin_api::testing::{count_ops, FakeModel};
use pulsar_plugin_api::{Dim, FamilyBox, StepKind};

/// Three layers: a dense lead layer, then two MoE layers.
fn model() -> FakeModel {
    let (e, hd, nh, nkv, ff, ffx, nx, v) = (16u64, 8u64, 4u64, 2u64, 24u64, 12u64, 8u64, 40u64);
    let mut m = FakeModel::new()
        .u("hy_v3.block_count", 3)
        .u("hy_v3.embedding_length", e)
        .u("hy_v3.feed_forward_length", ff)
        .u("hy_v3.attention.head_count", nh)
        .u("hy_v3.attention.head_count_kv", nkv)
        .u("hy_v3.attention.key_length", hd)
        .u("hy_v3.attention.value_length", hd)
        .u("hy_v3.expert_count", nx)
        .u("hy_v3.expert_used_count", 2)
        .u("hy_v3.expert_feed_forward_length", ffx)
        .u("hy_v3.expert_shared_feed_forward_length", ffx)
        .u("hy_v3.expert_gating_func", 2)
        .kv("hy_v3.expert_weights_norm", pulsar_plugin_api::MetaValue::Bool(true))
        .f("hy_v3.expert_weights_scale", 2.826)
        .f("hy_v3.attention.layer_norm_rms_epsilon", 1e-5)
        .f("hy_v3.rope.freq_base", 1e4)
        .u("hy_v3.context_length", 256)
        .t("token_embd.weight", &[e, v])
        .t("output_norm.weight", &[e])
        .t("output.weight", &[e, v]);
    for l in 0..3 {
        let t = |s: &str| format!("blk.{l}.{s}");
        m = m
            .t(&t("attn_norm.weight"), &[e])
            .t(&t("attn_q.weight"), &[e, nh * hd])
            .t(&t("attn_k.weight"), &[e, nkv * hd])
            .t(&t("attn_v.weight"), &[e, nkv * hd])
            .t(&t("attn_output.weight"), &[nh * hd, e])
            .t(&t("attn_q_norm.weight"), &[hd])
            .t(&t("attn_k_norm.weight"), &[hd])
            .t(&t("ffn_norm.weight"), &[e]);
        m = if l == 0 {
            m.t(&t("ffn_gate.weight"), &[e, ff]).t(&t("ffn_up.weight"), &[e, ff]).t(&t("ffn_down.weight"), &[ff, e])
        } else {
            m.t(&t("ffn_gate_inp.weight"), &[e, nx])
                .t(&t("exp_probs_b"), &[nx])
                .t(&t("ffn_gate_exps.weight"), &[e, ffx, nx])
                .t(&t("ffn_up_exps.weight"), &[e, ffx, nx])
                .t(&t("ffn_down_exps.weight"), &[ffx, e, nx])
                .t(&t("ffn_gate_shexp.weight"), &[e, ffx])
                .t(&t("ffn_up_shexp.weight"), &[e, ffx])
                .t(&t("ffn_down_shexp.weight"), &[ffx, e])
        };
    }
    m
}

fn open(m: &FakeModel) -> Result<FamilyBox, String> {
    (plugin_module().open())("hy_v3".into(), m.view()).into_result().map_err(|e| e.into_string())
}

#[test]
fn a_dense_lead_layer_then_biased_sigmoid_moe_with_a_shared_expert() {
    let m = model();
    let fam = open(&m).unwrap();
    let plan = fam.plan();
    assert_eq!(plan.weights.iter().filter(|w| w.role == Role::RoutedExpert).count(), 6);
    assert_eq!(plan.weights.iter().filter(|w| w.role == Role::SharedExpert).count(), 6);
    assert_eq!(plan.weights.iter().filter(|w| w.role == Role::Dense).count(), 3);
    for kind in [StepKind::Decode, StepKind::Prefill] {
        let g = m.check_graph(&fam, kind).unwrap();
        assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(40)]);
        assert_eq!(count_ops(&g, "experts"), 2);
        assert_eq!(count_ops(&g, "top_k"), 2);
        assert_eq!(count_ops(&g, "weight"), 2, "the selection bias of each MoE layer");
        assert_eq!(count_ops(&g, "attention"), 3);
    }
}

#[test]
fn bad_configs_fail_at_open_naming_the_key_or_tensor() {
    let e = open(&model().u("hy_v3.expert_gating_func", 3)).err().unwrap();
    assert!(e.contains("hy_v3.expert_gating_func"), "{e}");
    let e = open(&model().without_key("hy_v3.expert_gating_func")).err().unwrap();
    assert!(e.contains("hy_v3.expert_gating_func"), "{e}");
    let e = open(&model().without_tensor("blk.2.exp_probs_b")).err().unwrap();
    assert!(e.contains("blk.2.exp_probs_b"), "{e}");
    let e = open(&model().f("hy_v3.expert_weights_scale", -1.0)).err().unwrap();
    assert!(e.contains("hy_v3.expert_weights_scale"), "{e}");
    let e = open(&model().u("hy_v3.expert_used_count", 9)).err().unwrap();
    assert!(e.contains("hy_v3.expert_used_count"), "{e}");
}
