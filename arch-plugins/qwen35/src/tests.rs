use super::*;
use pulsar_plugin_api::testing::{count_ops, FakeModel};
use pulsar_plugin_api::{Dim, FamilyBox, StepKind};

/// Four trunk layers (delta, delta, delta, attention) and one MTP block.
fn model(arch: &str) -> FakeModel {
    let (e, hd, nh, nkv, v) = (16u64, 8u64, 4u64, 2u64, 40u64);
    let (hk, hv, dk, dv, kc) = (2u64, 4u64, 4u64, 4u64, 4u64);
    let (ch, nx, ff) = (2 * hk * dk + hv * dv, 8u64, 12u64);
    let k = |s: &str| format!("{arch}.{s}");
    let mut m = FakeModel::new()
        .u(&k("block_count"), 5)
        .u(&k("nextn_predict_layers"), 1)
        .kv(&k("attention.recurrent_layers"), MetaValue::Bools(vec![true, true, true, false, false].into()))
        .u(&k("embedding_length"), e)
        .u(&k("attention.head_count"), nh)
        .u(&k("attention.head_count_kv"), nkv)
        .u(&k("attention.key_length"), hd)
        .u(&k("attention.value_length"), hd)
        .u(&k("rope.dimension_count"), 4)
        .f(&k("rope.freq_base"), 1e7)
        .f(&k("attention.layer_norm_rms_epsilon"), 1e-6)
        .u(&k("ssm.conv_kernel"), kc)
        .u(&k("ssm.state_size"), dk)
        .u(&k("ssm.group_count"), hk)
        .u(&k("ssm.time_step_rank"), hv)
        .u(&k("ssm.inner_size"), hv * dv)
        .u(&k("expert_count"), nx)
        .u(&k("expert_used_count"), 2)
        .u(&k("expert_feed_forward_length"), ff)
        .u(&k("expert_shared_feed_forward_length"), ff)
        .u(&k("feed_forward_length"), ff)
        .u(&k("context_length"), 256)
        .t("token_embd.weight", &[e, v])
        .t("output_norm.weight", &[e])
        .t("output.weight", &[e, v]);
    for l in 0..5 {
        let t = |s: &str| format!("blk.{l}.{s}");
        m = m.t(&t("attn_norm.weight"), &[e]).t(&t("post_attention_norm.weight"), &[e]);
        m = if l < 3 {
            m.t(&t("attn_qkv.weight"), &[e, ch])
                .t(&t("attn_gate.weight"), &[e, hv * dv])
                .t(&t("ssm_beta.weight"), &[e, hv])
                .t(&t("ssm_alpha.weight"), &[e, hv])
                .t(&t("ssm_dt.bias"), &[hv])
                .t(&t("ssm_a"), &[hv])
                .t(&t("ssm_conv1d.weight"), &[kc, ch])
                .t(&t("ssm_norm.weight"), &[dv])
                .t(&t("ssm_out.weight"), &[hv * dv, e])
        } else {
            m.t(&t("attn_q.weight"), &[e, 2 * nh * hd])
                .t(&t("attn_k.weight"), &[e, nkv * hd])
                .t(&t("attn_v.weight"), &[e, nkv * hd])
                .t(&t("attn_output.weight"), &[nh * hd, e])
                .t(&t("attn_q_norm.weight"), &[hd])
                .t(&t("attn_k_norm.weight"), &[hd])
        };
        m = if arch == "qwen35moe" {
            m.t(&t("ffn_gate_inp.weight"), &[e, nx])
                .t(&t("ffn_gate_exps.weight"), &[e, ff, nx])
                .t(&t("ffn_up_exps.weight"), &[e, ff, nx])
                .t(&t("ffn_down_exps.weight"), &[ff, e, nx])
                .t(&t("ffn_gate_shexp.weight"), &[e, ff])
                .t(&t("ffn_up_shexp.weight"), &[e, ff])
                .t(&t("ffn_down_shexp.weight"), &[ff, e])
                .t(&t("ffn_gate_inp_shexp.weight"), &[e, 1])
        } else {
            m.t(&t("ffn_gate.weight"), &[e, ff]).t(&t("ffn_up.weight"), &[e, ff]).t(&t("ffn_down.weight"), &[ff, e])
        };
    }
    m.t("blk.4.nextn.eh_proj.weight", &[2 * e, e])
        .t("blk.4.nextn.enorm.weight", &[e])
        .t("blk.4.nextn.hnorm.weight", &[e])
        .t("blk.4.nextn.shared_head_norm.weight", &[e])
}

fn open(arch: &str, m: &FakeModel) -> Result<FamilyBox, String> {
    (plugin_module().open())(arch.into(), m.view()).into_result().map_err(|e| e.into_string())
}

#[test]
fn the_hybrid_graph_is_shape_consistent_for_both_archs() {
    for (arch, experts) in [("qwen35moe", 4), ("qwen35", 0)] {
        let m = model(arch);
        let fam = open(arch, &m).unwrap();
        let plan = fam.plan();
        // Per delta layer a conv window and a delta state; one KV cache.
        assert_eq!(plan.states.len(), 3 * 2 + 1, "{arch}");
        assert_eq!(plan.n_layers, 4, "{arch}: the MTP block is not a trunk layer");
        // The MTP block's tensors are declared (resident), never streamed.
        let mtp: Vec<_> = plan.weights.iter().filter(|w| w.name.starts_with("blk.4.")).collect();
        assert!(mtp.iter().any(|w| w.name.as_str() == "blk.4.nextn.eh_proj.weight"), "{arch}");
        assert!(mtp.iter().all(|w| w.role == Role::Other), "{arch}");
        for kind in [StepKind::Decode, StepKind::Prefill] {
            let g = m.check_graph(&fam, kind).unwrap();
            assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(40)]);
            assert_eq!(count_ops(&g, "delta_net"), 3);
            assert_eq!(count_ops(&g, "short_conv"), 3);
            assert_eq!(count_ops(&g, "attention"), 1);
            assert_eq!(count_ops(&g, "experts"), experts, "{arch}");
        }
    }
}

#[test]
fn bad_configs_fail_at_open_naming_the_key() {
    let e = open("qwen35moe", &model("qwen35moe").u("qwen35moe.ssm.group_count", 3)).err().unwrap();
    assert!(e.contains("qwen35moe.ssm.group_count"), "{e}");
    let e = open("qwen35moe", &model("qwen35moe").u("qwen35moe.ssm.inner_size", 15)).err().unwrap();
    assert!(e.contains("qwen35moe.ssm.inner_size"), "{e}");
    let short = MetaValue::Bools(vec![true, false].into());
    let e = open("qwen35", &model("qwen35").kv("qwen35.attention.recurrent_layers", short)).err().unwrap();
    assert!(e.contains("qwen35.attention.recurrent_layers") && e.contains("2 entries"), "{e}");
    let e = open("qwen35", &model("qwen35").u("qwen35.ssm.conv_kernel", 1)).err().unwrap();
    assert!(e.contains("conv_kernel"), "{e}");
    let e = open("qwen35", &model("qwen35").t("blk.1.ssm_conv1d.weight", &[4, 31])).err().unwrap();
    assert!(e.contains("blk.1.ssm_conv1d.weight"), "{e}");
    let e = open("qwen35moe", &model("qwen35moe").u("qwen35moe.expert_used_count", 9)).err().unwrap();
    assert!(e.contains("qwen35moe.expert_used_count"), "{e}");
}
