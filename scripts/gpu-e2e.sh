#!/usr/bin/env bash
# End-to-end checks and benchmarks for the GPU machine (no Rust there: it runs
# prebuilt binaries). BIN_DIR holds pulsar-host, plugins/<name>/ and selftest
# (scripts/devbin.sh lays that out). Writes Markdown and logs under OUT_DIR.
#
#   scripts/gpu-e2e.sh BIN_DIR [OUT_DIR] [STAGES]
#
# STAGES (default "selftest parity budget bench"):
#   selftest  every CUDA kernel against its CPU twin (scripts/gpu-check.sh)
#   parity    gemma3/qwen3moe fixtures: CUDA vs CPU teacher-forced logits and
#             greedy tokens, decode consistency on CUDA
#   budget    a synthetic qwen3moe larger than --vram-budget: same tokens as unbudgeted
#   bench     the synthetic qwen3-235b-a22b --layers 48 q2_K model: resident and
#             --vram-budget 16 (cold and warm)
set -uo pipefail
B="$(cd "${1:?usage: scripts/gpu-e2e.sh BIN_DIR [OUT_DIR] [STAGES]}" && pwd)"
O="${2:-${OUT:-/tmp/pulsar-gpu}}"
STAGES="${3:-selftest parity budget bench}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$O"
H="$B/pulsar-host"
P=(--plugin-dir "$B/plugins")
WORK="${PULSAR_GPU_WORK:-/tmp/pulsar-work}"
mkdir -p "$WORK"
export XDG_CACHE_HOME="$WORK/cache"
S="$O/summary.md"
say() { echo "$*" | tee -a "$S"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

say "# GPU e2e $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$S"

if has selftest; then
  say "## selftest"
  "$ROOT/scripts/gpu-check.sh" "$B" "$O" > "$O/selftest.out" 2>&1
  say "selftest exit $?"
fi

compare() { # name cpu.jsonl cuda.jsonl
  python3 - "$@" <<'PY' | tee -a "$S"
import json, sys
name, a, b = sys.argv[1:4]
A = [json.loads(l) for l in open(a)]
B = [json.loads(l) for l in open(b)]
agree = sum(x["top"][0][0] == y["top"][0][0] for x, y in zip(A, B))
d = max(abs(p[1] - q[1]) for x, y in zip(A, B) for p, q in zip(x["top"], y["top"]) if p[0] == q[0])
m = max(abs(p[1]) for x in A for p in x["top"])
print(f"| {name} | {len(A)} | {agree}/{len(A)} | {d:.3e} | {d/m:.3e} |")
PY
}

if has parity; then
  say "## parity: CUDA vs CPU (teacher forcing, top-5 logits)"
  say "| fixture | positions | top-1 agree | max abs diff | rel to max |"
  say "|---|---|---|---|---|"
  for arch in qwen3moe gemma3; do
    for v in f32 q8_0; do
      m="$ROOT/fixtures/parity/$arch/model-$v.gguf"
      toks=$(python3 -c "import json;print(','.join(map(str,json.load(open('$ROOT/fixtures/parity/$arch/meta.json'))['tokens'])))")
      "$H" run -m "$m" --tokens "$toks" --teacher-force --device cpu "${P[@]}" > "$WORK/cpu.jsonl" 2>>"$O/parity.log"
      "$H" run -m "$m" --tokens "$toks" --teacher-force --device cuda "${P[@]}" > "$WORK/cuda.jsonl" 2>>"$O/parity.log"
      compare "$arch $v" "$WORK/cpu.jsonl" "$WORK/cuda.jsonl"
      a=$("$H" run -m "$m" --tokens "$toks" -n 24 --device cpu "${P[@]}" 2>>"$O/parity.log" | od -An -tx1 | md5sum)
      b=$("$H" run -m "$m" --tokens "$toks" -n 24 --device cuda "${P[@]}" 2>>"$O/parity.log" | od -An -tx1 | md5sum)
      [ "$a" = "$b" ] && say "greedy 24 tokens $arch $v: identical" || say "greedy 24 tokens $arch $v: DIFFERENT"
      "$H" run -m "$m" --tokens "$toks" --decode-consistency 32 --device cuda "${P[@]}" 2>>"$O/parity.log" | sed "s/^/$arch $v cuda /" | tee -a "$S"
    done
  done
fi

if has budget; then
  say "## streaming under --vram-budget"
  m="$WORK/q30-l8.gguf"
  [ -f "$m" ] || "$H" synth --preset qwen3-30b-a3b --layers 8 --expert-type q4_K -o "$m" 2>>"$O/budget.log"
  ls -la "$m" | tee -a "$S"
  for cfg in "--device cpu" "--device cuda" "--device cuda --vram-budget 1.2"; do
    # shellcheck disable=SC2086
    out=$("$H" run -m "$m" -p "The quick brown fox" -n 16 $cfg --stats "${P[@]}" 2>"$WORK/err.txt" | od -An -tx1 | md5sum)
    say "$cfg: text md5 $out; $(grep -E 'tok/s|vram expert pool|error' "$WORK/err.txt" | tr '\n' ' ')"
  done
fi

if has bench; then
  say "## bench"
  # skew:configs ("-" = resident)
  for plan in "0:- 16" "1:16"; do
    skew=${plan%%:*}; cfgs=${plan#*:}
    m="$WORK/q235-l48-q2k-s$skew.gguf"
    rm -f "$WORK"/q235-l48-q2k-s*.gguf  # one 39 GB model at a time on a 64 GB disk
    t0=$(date +%s)
    "$H" synth --preset qwen3-235b-a22b --layers 48 --expert-type q2_K --skew "$skew" -o "$m" 2>>"$O/bench.log"
    say "synth skew $skew: $(( $(date +%s) - t0 )) s for $(du -h "$m" | cut -f1)"
    for c in $cfgs; do
      if [ "$c" = "-" ]; then cfg=""; else cfg="--vram-budget $c"; fi
      # shellcheck disable=SC2086
      "$H" bench -m "$m" -p 512 -n 32 -r 2 --device cuda $cfg "${P[@]}" > "$WORK/bench.txt" 2>>"$O/bench.log"
      say "### cuda skew $skew ${cfg:-resident}"
      tee -a "$S" < "$WORK/bench.txt"
    done
  done
fi
say "done $(date -u +%FT%TZ)"
