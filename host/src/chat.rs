//! Chat templates: the GGUF's `tokenizer.chat_template` (Jinja) rendered with
//! minijinja in Python-compatible mode, else the plugin's fallback.
//!
//! The environment is transformers' (`apply_chat_template`): trim_blocks and
//! lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, and a
//! `tojson` that writes what Python's `json.dumps` writes (no HTML escaping,
//! `", "` and `": "` separators, `indent`, `sort_keys`, `ensure_ascii`);
//! maps keep their insertion order, as Python dicts do. Messages with a
//! reasoning field get it under `reasoning_content` and `thinking` too, as
//! transformers aliases them. `tests/chat_templates.rs` checks the renders
//! of the model authors' templates against transformers'.

use minijinja::value::{Kwargs, Value};
use minijinja::{context, Environment};
use serde::Serialize;

#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// minijinja's instruction budget for one render: the published templates
/// spend a few thousand on a long conversation with tools; a template that
/// loops a billion times stops with an error instead of hanging a server.
pub const RENDER_FUEL: u64 = 5_000_000;

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's own text.
    text: String,
    pub source: &'static str,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    pub fn text(&self) -> &str {
        &self.text
    }

    /// `gguf_template` wins over `fallback`; `source` says which was used.
    pub fn new(gguf_template: Option<&str>, fallback: Option<&str>, bos: &str, eos: &str) -> anyhow::Result<ChatTemplate> {
        let (text, source) = match (gguf_template, fallback) {
            (Some(t), _) => (t.to_string(), "gguf"),
            (None, Some(f)) => (f.to_string(), "plugin fallback"),
            (None, None) => anyhow::bail!("the model has no chat template and its plugin supplies none"),
        };
        let mut env = Environment::new();
        // A template from a GGUF is untrusted: bound what one render may do.
        env.set_fuel(Some(RENDER_FUEL));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_fmt: String| -> String { String::new() });
        env.add_template_owned("chat", text.clone()).map_err(|e| anyhow::anyhow!("chat template ({source}) does not parse: {e}"))?;
        Ok(ChatTemplate { env, text, source, bos: bos.to_string(), eos: eos.to_string() })
    }

    /// Render a conversation given as JSON: `{"messages": [...], "tools":
    /// [...]?, "add_generation_prompt": bool, ...}` (any other keys are
    /// template variables, e.g. `thinking`); messages may carry `tool_calls`,
    /// `tool_call_id`, `name`, `reasoning_content`.
    pub fn render_json(&self, conversation: &str) -> anyhow::Result<String> {
        let v: Value = serde_json::from_str(conversation).map_err(|e| anyhow::anyhow!("conversation is not JSON: {e}"))?;
        let mut vars: Vec<(String, Value)> = Vec::new();
        let keys = v.try_iter().map_err(|e| anyhow::anyhow!("conversation is not an object: {e}"))?;
        for k in keys {
            let key = k.as_str().unwrap_or_default().to_string();
            let val = v.get_item(&k).unwrap_or_default();
            let val = if key == "messages" { alias_reasoning(&val)? } else { val };
            vars.push((key, val));
        }
        vars.push(("bos_token".into(), Value::from(self.bos.as_str())));
        vars.push(("eos_token".into(), Value::from(self.eos.as_str())));
        let ctx: Value = vars.into_iter().collect();
        let t = self.env.get_template("chat")?;
        t.render(ctx).map_err(|e| anyhow::anyhow!("chat template ({}) failed: {e}", self.source))
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

/// transformers' reasoning aliases: a message whose reasoning comes under
/// `reasoning_content`, `thinking` or `reasoning` gets it under the first
/// two as well (`thinking` placed first, as its dict does).
fn alias_reasoning(messages: &Value) -> anyhow::Result<Value> {
    let mut out = Vec::new();
    for m in messages.try_iter().map_err(|e| anyhow::anyhow!("messages are not a list: {e}"))? {
        let reasoning = ["reasoning_content", "thinking", "reasoning"].iter().map(|f| m.get_attr(f).unwrap_or_default()).find(|r| !r.is_undefined() && !r.is_none());
        let Some(r) = reasoning.filter(|_| m.kind() == minijinja::value::ValueKind::Map) else {
            out.push(m);
            continue;
        };
        let mut fields: Vec<(Value, Value)> = vec![(Value::from("thinking"), r.clone())];
        for k in m.try_iter().map_err(|e| anyhow::anyhow!("{e}"))? {
            if k.as_str() != Some("thinking") && k.as_str() != Some("reasoning_content") {
                fields.push((k.clone(), m.get_item(&k).unwrap_or_default()));
            } else if k.as_str() == Some("thinking") {
                // Its own value stands where the dict had it first: keep it.
                fields[0].1 = m.get_item(&k).unwrap_or_default();
            }
        }
        fields.push((Value::from("reasoning_content"), r));
        out.push(fields.into_iter().collect());
    }
    Ok(Value::from(out))
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, transformers' `tojson`.
fn tojson(v: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        Some(i) if i.is_none() || i.is_undefined() => None,
        Some(i) => Some(match i.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(i64::try_from(i).map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson indent: {e}")))?.max(0) as usize),
        }),
        None => None,
    };
    let (item_sep, key_sep) = match separators.filter(|s| !s.is_none() && !s.is_undefined()) {
        Some(s) => {
            let a = s.get_item_by_index(0).ok().and_then(|x| x.as_str().map(str::to_string)).unwrap_or_else(|| ", ".into());
            let b = s.get_item_by_index(1).ok().and_then(|x| x.as_str().map(str::to_string)).unwrap_or_else(|| ": ".into());
            (a, b)
        }
        // Python: (', ', ': '), or (',', ': ') with an indent.
        None => (if indent.is_some() { ",".into() } else { ", ".into() }, ": ".into()),
    };
    let mut out = String::new();
    py_json(&v, &mut out, indent.as_deref(), &item_sep, &key_sep, ensure_ascii.unwrap_or(false), sort_keys.unwrap_or(false), 0)?;
    Ok(Value::from_safe_string(out))
}

#[allow(clippy::too_many_arguments)]
fn py_json(v: &Value, out: &mut String, indent: Option<&str>, item_sep: &str, key_sep: &str, ascii: bool, sort: bool, depth: usize) -> Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, d: usize| {
        if let Some(ind) = indent {
            out.push('\n');
            for _ in 0..d {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match (i64::try_from(v.clone()), f64::try_from(v.clone())) {
            (Ok(i), _) if v.as_i64().is_some() => out.push_str(&i.to_string()),
            (_, Ok(f)) if f.is_finite() => out.push_str(&py_float(f)),
            (_, Ok(f)) if f.is_nan() => out.push_str("NaN"),
            (_, Ok(f)) => out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" }),
            _ => out.push_str(&v.to_string()),
        },
        ValueKind::String => py_str(v.as_str().unwrap_or_default(), out, ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                py_json(x, out, indent, item_sep, key_sep, ascii, sort, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if sort {
                keys.sort_by(|a, b| a.to_string().cmp(&b.to_string()));
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                py_str(&k.to_string(), out, ascii);
                out.push_str(key_sep);
                py_json(&v.get_item(k)?, out, indent, item_sep, key_sep, ascii, sort, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => py_str(&v.to_string(), out, ascii),
    }
    Ok(())
}

/// Python's float repr (shortest round trip, a `.0` on integral values, exponent form past 1e16).
fn py_float(f: f64) -> String {
    let s = format!("{f:?}");
    if f.abs() >= 1e16 || (f != 0.0 && f.abs() < 1e-4) {
        let e = format!("{f:e}");
        let (m, x) = e.split_once('e').unwrap_or((&e, "0"));
        let m = if m.contains('.') { m.to_string() } else { format!("{m}.0") };
        let x: i32 = x.parse().unwrap_or(0);
        return format!("{}e{}{:02}", m.trim_end_matches(".0"), if x < 0 { '-' } else { '+' }, x.abs());
    }
    s
}

/// A JSON string as Python's json module writes it.
fn py_str(s: &str, out: &mut String, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && (c as u32) > 0x7f) => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", u));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
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

    /// #28 defect 6: a hostile template in a GGUF cannot hang the server.
    #[test]
    fn a_runaway_template_stops_with_an_error() {
        let t = ChatTemplate::new(Some("{% for i in range(50000) %}{% for j in range(50000) %}x{% endfor %}{% endfor %}"), None, "", "").unwrap();
        let start = std::time::Instant::now();
        let e = t.render(&msgs(), true).unwrap_err().to_string();
        assert!(start.elapsed() < std::time::Duration::from_secs(20), "took {:?}", start.elapsed());
        assert!(e.contains("fuel"), "{e}");
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
