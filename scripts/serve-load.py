#!/usr/bin/env python3
"""A bounded load generator for `pulsar-host serve` (loopback, stdlib only).

For each concurrency level N it runs N streams at once; each stream sends
ROUNDS streaming greedy /v1/completions requests one after another (its own
prompt, `max_tokens` tokens, ignore_eos so every request generates the same
count). It reports the aggregate generated tokens per second, the mean time to
first token, and, from /metrics before and after, the mean rows per step and
the routed-expert bytes the GPU pool moved per generated token (uploads,
zero-copy reads and CPU-lane reads; the host store's hit rates where there
is no GPU).

  scripts/serve-load.py --url http://127.0.0.1:11435 --streams 1,4,16,64 \
      --tokens 64 --rounds 2 [--api-key KEY] [--json out.json] [--texts out.json]

`--texts` writes every request's generated text by prompt (greedy: two
servers given the same requests must write the same file). The KV pool's
peak blocks in use and the sequences paused for KV blocks come from /metrics.

Every request is bounded (a timeout, a fixed token count); the run stops at
the first failed request and says which.
"""

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def prompt_for(i):
    # Distinct prompts (no shared prefix beyond a few tokens) so prefix reuse
    # does not flatter the numbers.
    w = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12)]
    return f"Request {i}: " + " ".join(w) + ". Continue the list:"


class Target:
    def __init__(self, url, key, timeout):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.timeout = timeout

    def conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def metrics(self):
        c = self.conn()
        c.request("GET", "/metrics?format=json", headers={**self.headers, "Accept": "application/json"})
        r = c.getresponse()
        body = r.read()
        c.close()
        if r.status != 200:
            raise RuntimeError(f"/metrics: HTTP {r.status}")
        return json.loads(body)

    def stream(self, prompt, tokens):
        """One streaming completion: (seconds to the first token, tokens, seconds)."""
        body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
        t0 = time.monotonic()
        c = self.conn()
        c.request("POST", "/v1/completions", body=body, headers=self.headers)
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"/v1/completions: HTTP {r.status}: {r.read()[:300]!r}")
        first, n_chunks, usage, text = None, 0, None, []
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("error"):
                raise RuntimeError(f"/v1/completions: {ev['error']}")
            if ev.get("usage"):
                usage = ev["usage"]
            if any(ch.get("text") for ch in ev.get("choices", [])):
                text.extend(ch.get("text") or "" for ch in ev["choices"])
                n_chunks += 1
                if first is None:
                    first = time.monotonic() - t0
        c.close()
        n = usage["completion_tokens"] if usage else n_chunks
        return (first if first is not None else time.monotonic() - t0), n, time.monotonic() - t0, "".join(text)


def expert_bytes(m):
    s = m.get("expert_tier_hit_rates") or {}
    pool = s.get("gpu_pool") if isinstance(s, dict) else None
    if not pool:
        return None
    return pool.get("uploaded_bytes", 0) + pool.get("zero_copy_bytes", 0) + pool.get("cpu_lane_bytes", 0)


def level(t, n, tokens, rounds, texts):
    before = t.metrics()
    ttfts, counts, errors = [], [0] * n, []
    lock = threading.Lock()
    peak = [0]
    done = threading.Event()

    def watch():
        # The pool's blocks in use, sampled while the level runs.
        while not done.wait(0.05):
            try:
                peak[0] = max(peak[0], t.metrics().get("kv_blocks_used", 0))
            except Exception:  # noqa: BLE001 - a sample lost is no error
                pass

    def worker(i):
        for r in range(rounds):
            p = prompt_for(i * rounds + r)
            try:
                ttft, got, _, text = t.stream(p, tokens)
            except Exception as e:  # noqa: BLE001 - reported, then the run stops
                with lock:
                    errors.append(f"stream {i} round {r}: {e}")
                return
            with lock:
                ttfts.append(ttft)
                counts[i] += got
                texts[f"{n}/{p}"] = text

    t0 = time.monotonic()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    done.set()
    watcher.join()
    after = t.metrics()
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    gen = sum(counts)
    steps = after["steps_total"] - before["steps_total"]
    # /metrics gives the mean over the server's life: this level's rows are
    # the difference of the running totals.
    rows = (after["mean_rows_per_step"] * after["steps_total"] - before["mean_rows_per_step"] * before["steps_total"]) / max(steps, 1)
    eb = (expert_bytes(after) or 0) - (expert_bytes(before) or 0) if expert_bytes(after) is not None else None
    return {
        "streams": n,
        "generated": gen,
        "seconds": wall,
        "aggregate_tok_s": gen / wall if wall > 0 else 0.0,
        "mean_ttft_ms": 1e3 * sum(ttfts) / max(len(ttfts), 1),
        "steps": steps,
        "mean_rows_per_step": rows,
        "expert_bytes_per_token": (eb / gen) if (eb is not None and gen) else None,
        "kv_blocks_peak": peak[0],
        "kv_blocks_total": after.get("kv_blocks_total", 0),
        "paused": after.get("sequences_preempted", 0) - before.get("sequences_preempted", 0),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:11435")
    ap.add_argument("--streams", default="1,4,16,64", help="comma-separated concurrency levels")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream, one after another")
    ap.add_argument("--api-key")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds any one request may take")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--texts", help="write each request's generated text here (JSON, by level and prompt)")
    a = ap.parse_args()
    t = Target(a.url, a.api_key, a.timeout)
    rows, texts = [], {}
    print("| streams | generated | aggregate tok/s | mean TTFT ms | mean rows/step | expert MiB/token | KV blocks peak / pool | paused |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in a.streams.split(",") if x]:
        try:
            r = level(t, n, a.tokens, a.rounds, texts)
        except Exception as e:  # noqa: BLE001
            print(f"streams {n}: {e}", file=sys.stderr)
            sys.exit(1)
        rows.append(r)
        eb = "n/a" if r["expert_bytes_per_token"] is None else f"{r['expert_bytes_per_token'] / 2**20:.1f}"
        print(f"| {n} | {r['generated']} | {r['aggregate_tok_s']:.1f} | {r['mean_ttft_ms']:.0f} | {r['mean_rows_per_step']:.1f} | {eb} | {r['kv_blocks_peak']} / {r['kv_blocks_total']} | {r['paused']} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.texts:
        with open(a.texts, "w") as f:
            json.dump(texts, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
