//! Chat templates: the GGUF's `tokenizer.chat_template` (Jinja) rendered with
//! minijinja in Python-compatible mode, else the plugin's fallback.

use minijinja::{context, Environment};
use serde::Serialize;

#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    pub source: &'static str,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// `gguf_template` wins over `fallback`; `source` says which was used.
    pub fn new(gguf_template: Option<&str>, fallback: Option<&str>, bos: &str, eos: &str) -> anyhow::Result<ChatTemplate> {
        let (text, source) = match (gguf_template, fallback) {
            (Some(t), _) => (t.to_string(), "gguf"),
            (None, Some(f)) => (f.to_string(), "plugin fallback"),
            (None, None) => anyhow::bail!("the model has no chat template and its plugin supplies none"),
        };
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_fmt: String| -> String { String::new() });
        env.add_template_owned("chat", text).map_err(|e| anyhow::anyhow!("chat template ({source}) does not parse: {e}"))?;
        Ok(ChatTemplate { env, source, bos: bos.to_string(), eos: eos.to_string() })
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> anyhow::Result<String> {
        let t = self.env.get_template("chat")?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| anyhow::anyhow!("chat template ({}) failed: {e}", self.source))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs() -> Vec<Message> {
        vec![
            Message { role: "system".into(), content: "Be brief.".into() },
            Message { role: "user".into(), content: "Hi".into() },
        ]
    }

    #[test]
    fn renders_gemma_fallback_with_system_folded_in() {
        let t = ChatTemplate::new(None, Some(pulsar_arch_gemma3::FALLBACK_TEMPLATE), "<bos>", "<eos>").unwrap();
        let s = t.render(&msgs(), true).unwrap();
        assert_eq!(s, "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
    }

    #[test]
    fn python_methods_work_and_gguf_template_wins() {
        let tpl = "{% for m in messages %}{{ m['content'].upper() }}|{% endfor %}";
        let t = ChatTemplate::new(Some(tpl), Some("ignored"), "", "").unwrap();
        assert_eq!(t.source, "gguf");
        assert_eq!(t.render(&msgs(), false).unwrap(), "BE BRIEF.|HI|");
        assert!(ChatTemplate::new(Some("{% for %}"), None, "", "").is_err());
    }
}
