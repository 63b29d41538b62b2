//! The chat templates the model authors publish for deepseek2, Kimi, hy_v3,
//! MiniMax and Qwen3.5 / Qwen3-Coder models (llama.cpp's copies, fetched and cached by
//! `scripts/fetch-templates.sh`, not committed) render with our minijinja
//! setup exactly as transformers' `apply_chat_template` renders them:
//! system + multi-turn, with and without a generation prompt, a tool list, a
//! tool call and its result, an empty tool list, a thinking turn. The
//! conversations and transformers' renders are in
//! `fixtures/chat/renders.json` (made by `tools/chatgold/gen.py`); where
//! transformers' sandbox refuses a template (Kimi-K2-Instruct's tool-call
//! turn appends to a list), ours must refuse too.
//!
//! `scripts/test.sh` sets `PULSAR_TEMPLATES`; without it the test says so and
//! checks nothing (a plain `cargo test` on a machine that never fetched them).

use pulsar_host::chat::ChatTemplate;
use serde_json::Value;

#[test]
fn published_templates_render_as_transformers_renders_them() {
    let Ok(dir) = std::env::var("PULSAR_TEMPLATES") else {
        eprintln!("PULSAR_TEMPLATES is not set (scripts/fetch-templates.sh prints it): the chat templates are not checked");
        return;
    };
    let gold: Value = serde_json::from_str(include_str!("fixtures/chat/renders.json")).unwrap();
    let (bos, eos) = (gold["bos_token"].as_str().unwrap(), gold["eos_token"].as_str().unwrap());
    let cases = gold["cases"].as_array().unwrap();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (name, renders) in gold["templates"].as_object().unwrap() {
        let path = std::path::Path::new(&dir).join(format!("{name}.jinja"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-templates.sh)", path.display()));
        let t = ChatTemplate::new(Some(&text), None, bos, eos).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (case, want) in cases.iter().zip(renders.as_array().unwrap()) {
            // The conversation as JSON text, its keys in the order they were written.
            let got = t.render_json(case["conversation"].as_str().unwrap());
            let what = format!("{name} / {}", case["name"].as_str().unwrap());
            match (want.get("render").and_then(Value::as_str), got) {
                (Some(w), Ok(g)) if g == w => {}
                (Some(w), Ok(g)) => {
                    let at = w.chars().zip(g.chars()).take_while(|(a, b)| a == b).count();
                    let ctx = |s: &str| s.chars().skip(at.saturating_sub(40)).take(120).collect::<String>();
                    failures.push(format!("{what}: renders differ at char {at}\n  want …{:?}\n  got  …{:?}", ctx(w), ctx(&g)));
                }
                (Some(_), Err(e)) => failures.push(format!("{what}: {e}")),
                (None, Err(_)) => {}
                (None, Ok(_)) => failures.push(format!("{what}: transformers refuses it ({}), we rendered it", want["error"])),
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{} of {checked} renders differ:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(checked, 60);
}
