#!/usr/bin/env python3
"""Expected chat-template renders for pulsar's minijinja setup, from transformers.

For each chat template the model authors publish for deepseek2 / hy_v3 / minimax / qwen35 models
(as llama.cpp carries them: scripts/fetch-templates.sh caches them from the llama-cpp-python
0.3.36 sdist on PyPI), renders a fixed set of conversations with transformers'
`render_jinja_template` (what `apply_chat_template` runs: Python jinja2, sandboxed, trim_blocks,
lstrip_blocks, loop controls, its own `tojson`) and writes the conversations and the renders
(or the template's error) to host/tests/fixtures/chat/renders.json. The templates themselves
are not committed.

Usage: python tools/chatgold/gen.py [TEMPLATES_DIR]   (default: scripts/fetch-templates.sh's)
Versions: tools/chatgold/requirements.txt.
"""

import json
import subprocess
import sys
from pathlib import Path

import jinja2
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "host" / "tests" / "fixtures" / "chat" / "renders.json"

TEMPLATES = [
    "deepseek-ai-DeepSeek-V3.1",
    "deepseek-ai-DeepSeek-V3.2",
    "moonshotai-Kimi-K2",
    "Kimi-K2-Instruct",
    "Kimi-K2-Thinking",
    "tencent-Hy3",
    "MiniMax-M2",
    "MiniMax-M3",
    "Qwen3.5-4B",
    "Qwen3-Coder",
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}

CASES = [
    {
        "name": "system and two turns, generation prompt",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello! Who are you?"},
            {"role": "assistant", "content": "An assistant."},
            {"role": "user", "content": "Say « bonjour » twice: ✓"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "one turn, no generation prompt",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
        "add_generation_prompt": False,
    },
    {
        "name": "a tool list",
        "messages": [{"role": "system", "content": "Use tools when they help."}, {"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "add_generation_prompt": True,
    },
    {
        "name": "a tool call and its result",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
        ],
        "tools": [WEATHER],
        "add_generation_prompt": True,
    },
    {
        "name": "an empty tool list",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [],
        "add_generation_prompt": True,
    },
    {
        "name": "a thinking turn",
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "reasoning_content": "Two and two make four.", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        "add_generation_prompt": True,
        "kwargs": {"thinking": True, "enable_thinking": True},
    },
]

BOS, EOS = "<|bos|>", "<|eos|>"


def conversation(case):
    # The template variables as one JSON text, keys in order (a JSON parser that sorts keys
    # would reorder the tools' schemas that templates print with tojson).
    c = {"messages": case["messages"]}
    if "tools" in case:
        c["tools"] = case["tools"]
    c["add_generation_prompt"] = case["add_generation_prompt"]
    c.update(case.get("kwargs", {}))
    return json.dumps(c, ensure_ascii=False)


def render(template, case):
    kwargs = dict(case.get("kwargs", {}))
    try:
        out, _ = render_jinja_template(
            conversations=[case["messages"]],
            tools=case.get("tools"),
            chat_template=template,
            add_generation_prompt=case["add_generation_prompt"],
            bos_token=BOS,
            eos_token=EOS,
            **kwargs,
        )
        return {"render": out[0]}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}


def main():
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(subprocess.check_output([REPO / "scripts" / "fetch-templates.sh"], text=True).strip())
    out = {
        "reference": "transformers.utils.chat_template_utils.render_jinja_template (apply_chat_template's renderer); see tools/chatgold/gen.py",
        "versions": {"transformers": transformers.__version__, "jinja2": jinja2.__version__},
        "bos_token": BOS,
        "eos_token": EOS,
        "cases": [{"name": c["name"], "conversation": conversation(c)} for c in CASES],
        "templates": {},
    }
    for name in TEMPLATES:
        t = (d / f"{name}.jinja").read_text()
        out["templates"][name] = [render(t, c) for c in CASES]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(REPO)} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
