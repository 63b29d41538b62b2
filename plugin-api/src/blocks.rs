//! Blocks many families share, written from the graph's ops (the way
//! llama.cpp's `build_moe_ffn` composes routing): a SwiGLU FFN and the
//! top-k router. A family uses them or writes its own; the host sees the
//! same ops either way.

use crate::abi::{Val, Wt};
use crate::graph::Act;
use crate::sdk::{Graph, PluginError};

/// How a router turns its logits into scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scores {
    Softmax,
    Sigmoid,
}

/// A top-k router: `linear(weight, h)` → scores → (scores + `bias`, for
/// choosing only) → top-k → the chosen unbiased scores (÷ their sum) (× scale).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Router {
    pub weight: Wt,
    pub scores: Scores,
    /// A selection-only bias `[n_expert]` (DeepSeek's `e_score_correction_bias`).
    pub bias: Option<Wt>,
    pub top_k: u32,
    pub renormalize: bool,
    pub scale: f32,
}

impl Router {
    /// The experts each row chooses (i32 `[T, k]`) and their weights (`[T, k]`).
    pub fn route(&self, g: &mut Graph<'_>, h: Val) -> Result<(Val, Val), PluginError> {
        self.route_limited(g, h, |_, choice| Ok(choice))
    }

    /// [`Router::route`] with `limit` applied to the choosing scores before the
    /// top-k (group-limited routing adds its penalty there).
    pub fn route_limited(
        &self,
        g: &mut Graph<'_>,
        h: Val,
        limit: impl FnOnce(&mut Graph<'_>, Val) -> Result<Val, PluginError>,
    ) -> Result<(Val, Val), PluginError> {
        let logits = g.linear(self.weight, h)?;
        let scores = match self.scores {
            Scores::Softmax => g.softmax(logits, -1)?,
            Scores::Sigmoid => g.sigmoid(logits)?,
        };
        let choice = match self.bias {
            Some(b) => {
                let b = g.weight(b)?;
                g.add(scores, b)?
            }
            None => scores,
        };
        let choice = limit(g, choice)?;
        let ids = g.top_k(choice, self.top_k)?;
        let mut w = g.take_along(scores, ids)?;
        if self.renormalize {
            let total = g.sum(w, -1)?;
            w = g.div(w, total)?;
        }
        if self.scale != 1.0 {
            w = g.scale(w, self.scale)?;
        }
        Ok((ids, w))
    }
}

/// A gated FFN's weights: gate, up, down.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ffn {
    pub gate: Wt,
    pub up: Wt,
    pub down: Wt,
}

impl Ffn {
    /// `down(act(gate(h)) * up(h))`.
    pub fn glu(&self, g: &mut Graph<'_>, h: Val, act: Act) -> Result<Val, PluginError> {
        let gate = g.linear(self.gate, h)?;
        let up = g.linear(self.up, h)?;
        let a = g.glu(gate, up, act)?;
        g.linear(self.down, a)
    }

    /// The SwiGLU FFN: [`Ffn::glu`] with SiLU.
    pub fn swiglu(&self, g: &mut Graph<'_>, h: Val) -> Result<Val, PluginError> {
        self.glu(g, h, Act::Silu)
    }
}

/// The language-model head every family ends with: the rows the host wants,
/// the final RMS norm, the output projection, named `logits`.
pub fn lm_head(g: &mut Graph<'_>, x: Val, norm: Wt, output: Wt, eps: f32) -> Result<Val, PluginError> {
    let x = g.output_rows(x)?;
    let x = g.rms_norm(x, Some(norm), eps)?;
    let logits = g.linear(output, x)?;
    Ok(g.name(logits, "logits", None))
}

/// ChatML, Qwen's turn format: the fallback for Qwen GGUFs without
/// `tokenizer.chat_template`.
pub const CHATML_TEMPLATE: &str = r#"{% for m in messages %}{{ '<|im_start|>' ~ m['role'] ~ '\n' ~ m['content'] ~ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"#;
