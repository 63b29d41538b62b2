"""The official `openai` Python client against a running `pulsar-host serve`.

Usage: PULSAR_SERVER_URL=http://127.0.0.1:PORT PULSAR_API_KEY=KEY python test_openai.py
Exits non-zero on the first failure.
"""

import os
import sys

import openai
from openai import OpenAI

URL = os.environ["PULSAR_SERVER_URL"].rstrip("/")
KEY = os.environ.get("PULSAR_API_KEY", "none")

client = OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=60)
messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


models = client.models.list()
ids = [m.id for m in models.data]
check(len(ids) == 1 and ids[0], f"models.list() gives one model: {ids}")
model = ids[0]
check(client.models.retrieve(model).id == model, "models.retrieve()")

r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, seed=1)
text = r.choices[0].message.content
check(isinstance(text, str), f"non-streaming chat returns text: {text!r}")
check(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason}")
check(r.usage is not None and r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 16, f"usage {r.usage}")
check(r.object == "chat.completion" and r.choices[0].message.role == "assistant", "chat.completion object")

pieces, finish, usage = [], None, None
stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=16, temperature=0, seed=1, stream=True, stream_options={"include_usage": True}
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
streamed = "".join(pieces)
check(streamed == text, f"streamed chat equals the non-streaming reply (greedy): {streamed!r}")
check(finish == r.choices[0].finish_reason, f"streamed finish_reason {finish}")
check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"streamed usage {usage}")

c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
check(isinstance(c.choices[0].text, str) and c.usage.completion_tokens >= 1, f"completions: {c.choices[0].text!r}")

try:
    OpenAI(base_url=URL + "/v1", api_key="wrong-key", max_retries=0).models.list()
    check(False, "a wrong API key is refused")
except openai.AuthenticationError as e:
    check(e.status_code == 401, "a wrong API key is refused with 401")

try:
    client.chat.completions.create(model=model, messages=messages, temperature=-1)
    check(False, "temperature -1 is refused")
except openai.BadRequestError as e:
    check(e.status_code == 400 and "temperature" in str(e), f"bad temperature gives 400: {e}")

print("openai client tests passed")
