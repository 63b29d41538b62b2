//! A plugin written against plugin-api 0.2.0 (the compat test builds it
//! against that version, taken from git history): the smallest family,
//! `next logits = output · norm(embed(token))`.

use pulsar_plugin_api::{FamilyPlugin, Graph, OpenCx, PluginError, Role, Val, Wt};

pub struct Old {
    embd: Wt,
    norm: Wt,
    output: Wt,
}

impl FamilyPlugin for Old {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let e = cx.u32(&cx.key("embedding_length"))? as u64;
        let v = cx.n_vocab("token_embd.weight")? as u64;
        let embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, v])?;
        let norm = cx.weight_shaped("output_norm.weight", Role::Norm, None, &[e])?;
        let output = cx.weight_shaped("output.weight", Role::Output, None, &[e, v])?;
        cx.set_dims(0, e as u32, v as u32, 512);
        Ok(Old { embd, norm, output })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let ids = g.tokens()?;
        let x = g.embed(self.embd, ids, 1.0)?;
        let x = g.output_rows(x)?;
        let x = g.rms_norm(x, Some(self.norm), 1e-6)?;
        g.linear(self.output, x)
    }
}

pulsar_plugin_api::export_plugin! {
    name: "old-0-2-0",
    families: { "old-bigram" => Old },
}
