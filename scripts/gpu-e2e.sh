#!/usr/bin/env bash
# End-to-end checks and benchmarks for the GPU machine (no Rust there: it runs
# prebuilt binaries). BIN_DIR holds pulsar-host, plugins/<name>/ and selftest
# (scripts/devbin.sh lays that out). Writes Markdown and logs under OUT_DIR.
#
#   scripts/gpu-e2e.sh BIN_DIR [OUT_DIR] [STAGES]
#
# STAGES (default "selftest opcheck family parity gemma budget bench"):
#   selftest  every CUDA kernel against its CPU twin (scripts/gpu-check.sh)
#   opcheck   the Ops harness: every CUDA primitive against the CPU on random shapes
#   family    the test-only family (rows state, scan, custom router) on CUDA vs the
#             CPU (BIN_DIR/custom_family, the test binary, when present)
#   parity    every family's fixtures: CUDA vs CPU teacher-forced logits and
#             greedy tokens, decode consistency on CUDA; KV_TYPES (default f32)
#             and VARIANTS (default "f32 q8_0") choose the KV formats and weights
#   stream    the deepseek2 / hy_v3 / minimax-m2 / m3 fixtures under a tiny --vram-budget,
#             every cold path: the same greedy text as resident
#   gemma     gemma-3-270m Q4_K_M ($GEMMA, default $WORK/gemma.gguf): CUDA vs CPU
#             teacher-forced logits, greedy tokens, decode consistency, bench
#   budget    a synthetic qwen3moe larger than --vram-budget: same tokens as unbudgeted
#   bench     the synthetic qwen3-235b-a22b --layers 48 q2_K model: resident and
#             --vram-budget 16 (cold and warm; upload and zero-copy cold paths),
#             skew 0 and 1 ($BENCH_SKEWS, default "0 1")
#   q4k       the same geometry with q4_K experts at 24 layers
#   depth     the qwen3-235b twin at long context: decode-consistency after 4100
#             tokens and tg64 at depths 0/8192/32768 ($DEPTHS), each KV format of
#             $KV_TYPES (default "f16 f32")
#   twins     each new family's synthetic twin at its real geometry, cut to $TWIN_LAYERS
#             (default 8) layers of q2_K experts: resident and --vram-budget 16 (cold,
#             warm) tg64 with the per-tier traffic; the file is deleted after each
#             ($TWIN_PRESETS picks presets)
set -uo pipefail
B="$(cd "${1:?usage: scripts/gpu-e2e.sh BIN_DIR [OUT_DIR] [STAGES]}" && pwd)"
O="${2:-${OUT:-/tmp/pulsar-gpu}}"
STAGES="${3:-selftest opcheck family parity gemma budget bench}"
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

if has opcheck; then
  say "## opcheck: CUDA primitives vs the CPU"
  "$H" opcheck --seeds 8 --out "$O/opcheck.md" > "$O/opcheck.out" 2>&1
  say "opcheck exit $? ($(tail -1 "$O/opcheck.out"))"
fi

if has family; then
  say "## the test-only family on CUDA"
  if [ -x "$B/custom_family" ]; then
    "$B/custom_family" --nocapture > "$O/family.out" 2>&1
    say "custom_family exit $? ($(grep -E '^test result' "$O/family.out"))"
  else
    say "custom_family: not in $B"
  fi
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
  # KV_TYPES (default f32) and VARIANTS (default f32 q8_0) choose the KV
  # cache formats and the fixture weights compared.
  for kv in ${KV_TYPES:-f32}; do
  for arch in qwen3moe gemma3 hy_v3 minimax-m2 minimax-m3 deepseek2 deepseek2-kimi_k25 qwen35moe qwen35; do
    for v in ${VARIANTS:-f32 q8_0}; do
      m="$ROOT/fixtures/parity/$arch/model-$v.gguf"
      K=(--kv-type "$kv")
      toks=$(python3 -c "import json;print(','.join(map(str,json.load(open('$ROOT/fixtures/parity/$arch/meta.json'))['tokens'])))")
      "$H" run -m "$m" --tokens "$toks" --teacher-force --device cpu "${K[@]}" "${P[@]}" > "$WORK/cpu.jsonl" 2>>"$O/parity.log"
      "$H" run -m "$m" --tokens "$toks" --teacher-force --device cuda "${K[@]}" "${P[@]}" > "$WORK/cuda.jsonl" 2>>"$O/parity.log"
      compare "$arch $v kv $kv" "$WORK/cpu.jsonl" "$WORK/cuda.jsonl"
      ga=$("$H" run -m "$m" --tokens "$toks" -n 24 --device cpu "${K[@]}" "${P[@]}" 2>>"$O/parity.log" | od -An -tx1)
      gb=$("$H" run -m "$m" --tokens "$toks" -n 24 --device cuda "${K[@]}" "${P[@]}" 2>>"$O/parity.log" | od -An -tx1)
      if [ -z "$ga" ]; then say "greedy 24 tokens $arch $v kv $kv: FAILED (no output; parity.log says why)"
      elif [ "$ga" = "$gb" ]; then say "greedy 24 tokens $arch $v kv $kv: identical"; else say "greedy 24 tokens $arch $v kv $kv: DIFFERENT"; fi
      "$H" run -m "$m" --tokens "$toks" --decode-consistency 32 --device cuda "${K[@]}" "${P[@]}" 2>>"$O/parity.log" | sed "s/^/$arch $v kv $kv cuda /" | tee -a "$S"
    done
  done
  done
fi

if has stream; then
  say "## the new families' fixtures streamed under a tight --vram-budget (same text as resident?)"
  for arch in deepseek2 hy_v3 minimax-m2 minimax-m3; do
    m="$ROOT/fixtures/parity/$arch/model-q8_0.gguf"
    toks=$(python3 -c "import json;print(','.join(map(str,json.load(open('$ROOT/fixtures/parity/$arch/meta.json'))['tokens'])))")
    C=(--ctx 64 "${P[@]}")
    ref=$("$H" run -m "$m" --tokens "$toks" -n 24 --device cuda "${C[@]}" 2>>"$O/stream.log" | od -An -tx1 | md5sum)
    # What the resident weights and KV need (from the refusal of a 1 KiB budget), then a little more.
    need=$("$H" run -m "$m" --tokens "$toks" -n 1 --device cuda --vram-budget 0.000001 "${C[@]}" 2>&1 >/dev/null | python3 -c "
import re,sys
m=re.search(r'need ([0-9.]+) (KiB|MiB|GiB)', sys.stdin.read())
print(float(m.group(1))*{'KiB':1/2**20,'MiB':1/2**10,'GiB':1}[m.group(2)] if m else 0)")
    for extra in ${STREAM_EXTRA_KIB:-48 96 192 768}; do
      b=$(python3 -c "print(f'{$need + $extra/2**20:.7f}')")
      for cp in auto upload zerocopy cpu; do
        rm -f "$m.warm"
        out=$("$H" run -m "$m" --tokens "$toks" -n 24 --device cuda --vram-budget "$b" --cold-path "$cp" --stats "${C[@]}" 2>"$WORK/err.txt" | od -An -tx1 | md5sum)
        if grep -q "error" "$WORK/err.txt"; then v="FAILED"; elif [ "$out" = "$ref" ]; then v=same; else v=DIFFERENT; fi
        say "$arch budget $b GiB (+$extra KiB) $cp: $v; $(grep -E 'vram expert pool|error' "$WORK/err.txt" | head -2 | tr '\n' ' ')"
      done
    done
  done
fi

if has twins; then
  say "## synthetic twins at real geometry (${TWIN_LAYERS:-8} layers, q2_K experts)"
  for preset in ${TWIN_PRESETS:-deepseek-v3-671b kimi-k2-1t hy3-295b minimax-m2-230b qwen3.6-35b-a3b}; do
    m="$WORK/$preset.gguf"
    "$H" synth --preset "$preset" --layers "${TWIN_LAYERS:-8}" --expert-type q2_K -o "$m" > "$O/twin-$preset.log" 2>&1 || { say "$preset: synth failed"; continue; }
    say "$preset: $(ls -la "$m" | awk '{printf "%.2f GiB", $5/2^30}')"
    "$H" bench -m "$m" -p 128 -n 32 -r 2 --device cuda "${P[@]}" 2>>"$O/twin-$preset.log" | grep -E '^\| ' | tee -a "$S"
    "$H" bench -m "$m" -p 0 -n 32 -r 2 --device cuda --vram-budget 16 "${P[@]}" 2>>"$O/twin-$preset.log" | grep -E '^\||floor|tier' | tee -a "$S"
    rm -f "$m" "$m.warm"
  done
fi

if has gemma; then
  say "## gemma-3-270m Q4_K_M"
  g="${GEMMA:-$WORK/gemma.gguf}"
  if [ -f "$g" ]; then
    txt="The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
    "$H" run -m "$g" -p "$txt" --teacher-force --device cpu "${P[@]}" > "$WORK/g-cpu.jsonl" 2>>"$O/gemma.log"
    "$H" run -m "$g" -p "$txt" --teacher-force --device cuda "${P[@]}" > "$WORK/g-cuda.jsonl" 2>>"$O/gemma.log"
    say "| model | positions | top-1 agree | max abs diff | rel to max |"
    say "|---|---|---|---|---|"
    compare "gemma-3-270m" "$WORK/g-cpu.jsonl" "$WORK/g-cuda.jsonl"
    a=$("$H" run -m "$g" -p "$txt" -n 32 --device cpu "${P[@]}" 2>>"$O/gemma.log")
    b=$("$H" run -m "$g" -p "$txt" -n 32 --device cuda "${P[@]}" 2>>"$O/gemma.log")
    [ "$a" = "$b" ] && say "greedy 32 tokens: identical: $(echo "$b" | tr '\n' ' ' | cut -c1-200)" || { say "greedy 32 tokens: DIFFERENT"; say "cpu: $a"; say "cuda: $b"; }
    "$H" run -m "$g" -p "$txt" --decode-consistency 32 --device cuda "${P[@]}" 2>>"$O/gemma.log" | sed "s/^/gemma cuda /" | tee -a "$S"
    "$H" bench -m "$g" -p 512 -n 128 -r 3 --device cuda "${P[@]}" > "$WORK/g-bench.txt" 2>>"$O/gemma.log"
    tee -a "$S" < "$WORK/g-bench.txt"
  else
    say "no gemma model at $g"
  fi
fi

if has budget; then
  say "## streaming under --vram-budget"
  m="$WORK/q30-l8.gguf"
  [ -f "$m" ] || "$H" synth --preset qwen3-30b-a3b --layers 8 --expert-type q4_K -o "$m" 2>>"$O/budget.log"
  ls -la "$m" | tee -a "$S"
  for cfg in "--device cpu" "--device cuda" "--device cuda --vram-budget 1.2 --cold-path upload" \
             "--device cuda --vram-budget 1.2 --cold-path zerocopy" "--device cuda --vram-budget 1.2 --cold-path cpu" \
             "--device cuda --vram-budget 1.2" "--device cuda --vram-budget 1.2 --no-prefetch" \
             "--device cuda --vram-budget 1.2 --host-cache 1"; do
    rm -f "$m.warm"
    # shellcheck disable=SC2086
    out=$("$H" run -m "$m" -p "The quick brown fox" -n 24 --ignore-eos $cfg --stats "${P[@]}" 2>"$WORK/err.txt" | od -An -tx1 | md5sum)
    say "$cfg: text md5 $out; $(grep -E 'tok/s|vram expert pool|error' "$WORK/err.txt" | tr '\n' ' ')"
  done
  "$H" run -m "$m" -p "The quick brown fox" --decode-consistency 16 --device cuda --vram-budget 1.2 "${P[@]}" 2>>"$O/budget.log" | sed "s/^/budget cuda /" | tee -a "$S"
  "$ROOT/scripts/prefetch-check.sh" "$B" "$m" 1.2 2>>"$O/budget.log" | tee -a "$S"
fi

bench_model() { # skew type layers -> path (one big model at a time on a 64 GB disk)
  local m="$WORK/q235-l$3-$2-s$1.gguf"
  if [ ! -f "$m" ]; then
    rm -f "$WORK"/q235-*.gguf
    local t0; t0=$(date +%s)
    "$H" synth --preset qwen3-235b-a22b --layers "$3" --expert-type "$2" --skew "$1" -o "$m" 2>>"$O/bench.log"
    say "synth skew $1 $2 x$3: $(( $(date +%s) - t0 )) s for $(du -h "$m" | cut -f1)" >&2
  fi
  echo "$m"
}
bench_row() { # model label args...
  local m="$1" label="$2"; shift 2
  rm -f "$m.warm"
  # shellcheck disable=SC2086
  "$H" bench -m "$m" ${PNR:--p 512 -n 32 -r 2} --device cuda "$@" "${P[@]}" > "$WORK/bench.txt" 2>>"$O/bench.log"
  say "### $label"
  tee -a "$S" < "$WORK/bench.txt"
}
if has bench; then
  say "## bench"
  for skew in ${BENCH_SKEWS:-0 1}; do
    m=$(bench_model "$skew" q2_K 48)
    [ "$skew" = 0 ] || [ -n "${BENCH_RESIDENT:-}" ] && bench_row "$m" "q2_K skew $skew resident"
    for path in ${BENCH_PATHS:-upload zerocopy cpu auto}; do
      bench_row "$m" "q2_K skew $skew --vram-budget 16 --cold-path $path" --vram-budget 16 --cold-path "$path"
    done
    bench_row "$m" "q2_K skew $skew --vram-budget 16 --cold-path upload --no-prefetch" --vram-budget 16 --cold-path upload --no-prefetch
    # The disk tier carries real traffic: fewer tokens (it reads at ~1 GB/s).
    [ -n "${BENCH_NO_DISK:-}" ] || PNR="-p 64 -n 16 -r 1" bench_row "$m" "q2_K skew $skew --vram-budget 16 --host-cache 8" --vram-budget 16 --host-cache 8
  done
fi
if has q4k; then
  m=$(bench_model 1 q4_K 24)
  bench_row "$m" "q4_K x24 skew 1 resident"
  bench_row "$m" "q4_K x24 skew 1 --vram-budget 8" --vram-budget 8
fi
if has depth; then
  # Long context on the qwen3-235b twin: decode-consistency after 4100 tokens
  # and tg64 at depths 0 / 8192 / 32768, for each of $KV_TYPES (default "f16 f32").
  say "## depth"
  m=$(bench_model 0 q2_K 48)
  toks=$(seq 1 4100 | awk '{printf "%s%d", (NR>1?",":""), ($1*37)%250+3}')  # the twin's byte vocabulary
  for kv in ${KV_TYPES:-f16 f32}; do
    "$H" run -m "$m" --tokens "$toks" --decode-consistency 32 -c 8192 --device cuda --kv-type "$kv" "${P[@]}" 2>>"$O/depth.log" | sed "s/^/depth 4100 kv $kv cuda /" | tee -a "$S"
    PNR="-p 0 -n 64 -r 1 -d ${DEPTHS:-0,8192,32768}" bench_row "$m" "q2_K x48 resident, kv $kv" --kv-type "$kv"
  done
fi
say "done $(date -u +%FT%TZ)"
