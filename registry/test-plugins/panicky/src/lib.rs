//! A plugin that panics on purpose, to prove the host survives it: `open`
//! panics when the model's `panicky.at` key is `"open"`, `forward` always does.
use pulsar_plugin_api::{FamilyPlugin, Graph, OpenCx, PluginError, Val};

pub struct Panicky;

impl FamilyPlugin for Panicky {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        if cx.string("panicky.at").ok().as_deref() == Some("open") {
            panic!("open exploded on purpose");
        }
        Ok(Panicky)
    }
    fn forward(&self, _g: &mut Graph<'_>) -> Result<Val, PluginError> {
        panic!("forward exploded on purpose")
    }
}

pulsar_plugin_api::export_plugin! {
    name: "panicky",
    families: { "panicky" => Panicky },
}
