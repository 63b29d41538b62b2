#!/usr/bin/env python3
"""Send the same greedy requests, all at once, to two `pulsar-host serve`
instances (say one on the CPU and one on CUDA, same model) and check that
every reply's text is identical. Loopback, stdlib only; exits non-zero on
the first difference or failed request.

  scripts/serve-compare.py URL_A URL_B [--requests 8] [--tokens 24] [--api-key KEY]
"""

import argparse
import concurrent.futures
import http.client
import json
import sys
import urllib.parse


def complete(url, key, prompt, tokens, timeout):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    c.request("POST", "/v1/completions", body=body, headers=headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        raise RuntimeError(f"{url}: HTTP {r.status}: {data[:300]!r}")
    return json.loads(data)["choices"][0]["text"]


def run_all(url, key, prompts, tokens, timeout):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: complete(url, key, p, tokens, timeout), prompts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url_a")
    ap.add_argument("url_b")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--api-key")
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    prompts = [f"Prompt {i}: " + "the quick brown fox " * (1 + i % 4) for i in range(a.requests)]
    got_a = run_all(a.url_a, a.api_key, prompts, a.tokens, a.timeout)
    got_b = run_all(a.url_b, a.api_key, prompts, a.tokens, a.timeout)
    bad = [i for i, (x, y) in enumerate(zip(got_a, got_b)) if x != y]
    for i in bad:
        print(f"request {i} differs:\n  A: {got_a[i]!r}\n  B: {got_b[i]!r}", file=sys.stderr)
    print(f"{len(prompts) - len(bad)} of {len(prompts)} concurrent greedy replies identical")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
