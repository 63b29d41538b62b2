use super::*;
use pulsar_plugin_api::testing::{count_ops, FakeModel};
use pulsar_plugin_api::{FamilyBox, StepKind};

const A: &str = "qwen4exp";

/// The fixture's geometry: GDN, GDN (with PLE), GDN, QSA attention.
fn model() -> FakeModel {
    let (e, hd, nh, nkv, v) = (16u64, 8u64, 4u64, 2u64, 40u64);
    let (hk, hv, dk, dv, kc) = (2u64, 4u64, 4u64, 4u64, 4u64);
    let (ch, nx, ff, hc, rank) = (2 * hk * dk + hv * dv, 8u64, 12u64, 4u64, 6u64);
    let (ih, id, epl) = (2u64, 8u64, 4u64);
    let hw = hc * e;
    let k = |s: &str| format!("{A}.{s}");
    let ints = |v: &[u64]| MetaValue::U64s(v.to_vec().into());
    let mut m = FakeModel::new()
        .u(&k("block_count"), 4)
        .kv(&k("attention.recurrent_layers"), MetaValue::Bools(vec![true, true, true, false].into()))
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
        .u(&k("context_length"), 256)
        .u(&k("hyper_connection.count"), hc)
        .u(&k("hyper_connection.low_rank"), rank)
        .u(&k("attention.indexer.head_count"), ih)
        .u(&k("attention.indexer.key_length"), id)
        .u(&k("attention.indexer.top_k"), 8)
        .kv(&k("attention.compress_ratios"), ints(&[0, 0, 0, 4]))
        .kv(&k("ple.layers"), ints(&[1]))
        .u(&k("ple.ngram_size"), 3)
        .u(&k("ple.heads_per_ngram"), 2)
        .u(&k("ple.conv_kernel"), 4)
        .u(&k("ple.eos_token_id"), 39)
        .u(&k("embedding_length_per_layer_input"), epl)
        .kv(&k("ple.layer_multipliers"), ints(&[11, 13, 17]))
        .kv(&k("ple.head_offsets"), ints(&[0, 7, 18, 31]))
        .kv(&k("ple.head_vocab_sizes"), ints(&[7, 11, 13, 17]))
        .t("token_embd.weight", &[e, v])
        .t("output.weight", &[e, v])
        .t("output_hc_norm.weight", &[hw])
        .t("output_hc_down.weight", &[hw, rank])
        .t("output_hc_up.weight", &[rank, hw])
        .t("per_layer_token_embd.weight", &[epl, 48]);
    for l in 0..4 {
        let t = |s: &str| format!("blk.{l}.{s}");
        for p in ["hc_attn", "hc_ffn"] {
            m = m.t(&t(&format!("{p}_norm.weight")), &[hw]).t(&t(&format!("{p}_down.weight")), &[hw, rank]);
            m = m.t(&t(&format!("{p}_up.weight")), &[rank, hw]).t(&t(&format!("{p}_inject.weight")), &[hw, hc]);
        }
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
                .t(&t("indexer.q_proj.weight"), &[e, ih * id])
                .t(&t("indexer.k_proj.weight"), &[e, id])
                .t(&t("indexer.q_norm.weight"), &[id])
                .t(&t("indexer.k_norm.weight"), &[id])
        };
        if l == 1 {
            m = m
                .t(&t("ple_key.weight"), &[4 * epl, hw])
                .t(&t("ple_value.weight"), &[4 * epl, e])
                .t(&t("ple_norm_key.weight"), &[hw])
                .t(&t("ple_norm_query.weight"), &[hw])
                .t(&t("ple_norm_conv.weight"), &[hw])
                .t(&t("ple_conv1d.weight"), &[4, hw]);
        }
        m = m
            .t(&t("ffn_gate_inp.weight"), &[e, nx])
            .t(&t("ffn_gate_exps.weight"), &[e, ff, nx])
            .t(&t("ffn_up_exps.weight"), &[e, ff, nx])
            .t(&t("ffn_down_exps.weight"), &[ff, e, nx])
            .t(&t("ffn_gate_shexp.weight"), &[e, ff])
            .t(&t("ffn_up_shexp.weight"), &[e, ff])
            .t(&t("ffn_down_shexp.weight"), &[ff, e])
            .t(&t("ffn_gate_inp_shexp.weight"), &[e, 1]);
    }
    m
}

fn open(m: &FakeModel) -> Result<FamilyBox, String> {
    (plugin_module().open())(A.into(), m.view()).into_result().map_err(|e| e.into_string())
}

#[test]
fn the_graph_is_shape_consistent_with_ple_and_qsa() {
    let m = model();
    let fam = open(&m).unwrap();
    let plan = fam.plan();
    // 3 GDN layers x (conv window, delta state), PLE's 2 rows states, QSA's 3.
    assert_eq!(plan.states.len(), 3 * 2 + 2 + 3);
    let table = plan.weights.iter().find(|w| w.name.as_str() == "per_layer_token_embd.weight").unwrap();
    assert_eq!(table.role, Role::Embedding, "the PLE table may live in host RAM");
    for kind in [StepKind::Decode, StepKind::Prefill] {
        let g = m.check_graph(&fam, kind).unwrap();
        assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(40)]);
        assert_eq!(count_ops(&g, "delta_net"), 3);
        assert_eq!(count_ops(&g, "ngram_hash"), 1);
        assert_eq!(count_ops(&g, "conv_rows"), 1);
        assert_eq!(count_ops(&g, "pooled_select"), 1);
        assert_eq!(count_ops(&g, "attention"), 0, "QSA attention is composed");
        assert_eq!(count_ops(&g, "experts"), 4);
    }
}

#[test]
fn bad_configs_fail_at_open_naming_the_key() {
    let k = |s: &str| format!("{A}.{s}");
    let ints = |v: &[u64]| MetaValue::U64s(v.to_vec().into());
    let cases: Vec<(FakeModel, &str)> = vec![
        (model().u(&k("hyper_connection.count"), 1), "hyper_connection.count"),
        (model().without_key(&k("hyper_connection.low_rank")), "hyper_connection.low_rank"),
        (model().kv(&k("attention.compress_ratios"), ints(&[0, 0, 0, 0])), "attention.compress_ratios"),
        (model().kv(&k("attention.compress_ratios"), ints(&[0, 4, 0, 4])), "attention.compress_ratios"),
        (model().u(&k("attention.indexer.top_k"), 6), "attention.indexer.top_k"),
        (model().u(&k("attention.indexer.key_length"), 2), "attention.indexer.key_length"),
        (model().kv(&k("ple.layers"), ints(&[3])), "ple.layers"),
        (model().kv(&k("ple.layers"), ints(&[0, 1])), "ple.layers"),
        (model().u(&k("ple.ngram_size"), 1), "ple.ngram_size"),
        (model().kv(&k("ple.layer_multipliers"), ints(&[11, 13])), "ple.layer_multipliers"),
        (model().kv(&k("ple.head_offsets"), ints(&[0, 7])), "ple.head_offsets"),
        (model().kv(&k("ple.head_vocab_sizes"), ints(&[7, 11, 0, 17])), "ple.head_vocab_sizes"),
        (model().without_key(&k("ple.eos_token_id")), "ple.eos_token_id"),
        (model().u(&k("nextn_predict_layers"), 1), "nextn_predict_layers"),
        (model().u(&k("ssm.group_count"), 3), "ssm.group_count"),
        (model().t("per_layer_token_embd.weight", &[4, 40]), "per_layer_token_embd.weight"),
        (model().t("blk.1.ple_conv1d.weight", &[4, 63]), "blk.1.ple_conv1d.weight"),
        (model().without_tensor("blk.3.indexer.k_norm.weight"), "blk.3.indexer.k_norm.weight"),
    ];
    for (m, key) in cases {
        let e = open(&m).err().unwrap_or_else(|| panic!("{key}: opened"));
        assert!(e.contains(key), "{key}: {e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
}
