//! `hello-bigram`: the smallest useful family — a bigram language model whose
//! next-token logits are `output · norm(embed(token))`. It shows every part of
//! a plugin: a config parsed once with errors naming keys, weights declared
//! with roles and checked shapes, a step graph recorded from host ops, and a
//! chat template.

use pulsar_plugin_api::{ChatSpec, FamilyPlugin, Graph, OpenCx, PluginError, Role, Val, Wt};

pub struct HelloBigram {
    n_embd: u32,
    eps: f32,
    embd: Wt,
    norm: Wt,
    output: Wt,
}

impl FamilyPlugin for HelloBigram {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let n_embd = cx.u32(&cx.key("embedding_length"))?;
        let eps = cx.opt_f32(&cx.key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6);
        let n_vocab = cx.tensor("token_embd.weight").and_then(|t| t.dims.get(1).copied()).unwrap_or(0);
        let e = n_embd as u64;
        let embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, n_vocab])?;
        let norm = cx.weight_shaped("output_norm.weight", Role::Norm, None, &[e])?;
        let output = cx.weight_shaped("output.weight", Role::Output, None, &[e, n_vocab])?;
        cx.set_dims(0, n_embd, n_vocab as u32, 2048);
        Ok(HelloBigram { n_embd, eps, embd, norm, output })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let ids = g.tokens()?;
        let x = g.embed(self.embd, ids, 1.0)?;
        let x = g.output_rows(x)?;
        let x = g.rms_norm(x, Some(self.norm), self.eps)?;
        let logits = g.linear(self.output, x)?;
        Ok(g.name(logits, "logits", None))
    }

    fn chat(&self) -> ChatSpec {
        ChatSpec {
            fallback_template: Some(
                "{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] ~ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
                    .into(),
            )
            .into(),
            ..ChatSpec::default()
        }
    }
}

pulsar_plugin_api::export_plugin! {
    name: "hello-bigram",
    families: { "hello-bigram" => HelloBigram },
}

#[cfg(test)]
mod tests {
    use pulsar_plugin_api::testing::FakeModel;
    use pulsar_plugin_api::{Dim, StepKind};

    fn model() -> FakeModel {
        FakeModel::new()
            .u("hello-bigram.embedding_length", 8)
            .t("token_embd.weight", &[8, 20])
            .t("output_norm.weight", &[8])
            .t("output.weight", &[8, 20])
    }

    #[test]
    fn builds_a_graph_against_the_fake_host() {
        let m = model();
        let fam = (super::plugin_module().open())("hello-bigram".into(), m.view()).into_result().unwrap();
        for kind in [StepKind::Decode, StepKind::Prefill] {
            let g = m.check_graph(&fam, kind).unwrap();
            assert_eq!(g.shapes[g.output as usize].dims, vec![Dim::O, Dim::N(20)]);
        }
    }

    #[test]
    fn a_missing_key_is_named() {
        let m = model().without_key("hello-bigram.embedding_length");
        let e = (super::plugin_module().open())("hello-bigram".into(), m.view()).into_result().err().unwrap();
        assert!(e.contains("hello-bigram.embedding_length"), "{e}");
    }
}
