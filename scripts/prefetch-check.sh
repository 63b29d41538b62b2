#!/usr/bin/env bash
# Prefill cross-layer prefetch correctness on the GPU machine: a prompt long
# enough (>= 64 tokens at top-8 over 128 experts) that a prefill layer copies
# the next layer's cold slabs ahead must give the same tokens with and without
# --no-prefetch, and decode must equal a fresh prefill (decode consistency).
#   scripts/prefetch-check.sh BIN_DIR MODEL BUDGET_GB
set -uo pipefail
B="$1"; m="$2"; g="$3"
P=(--plugin-dir "$B/plugins")
txt=$(for i in $(seq 1 30); do printf 'The quick brown fox jumps over the lazy dog number %d. ' "$i"; done)
for cfg in "" "--no-prefetch"; do
  # shellcheck disable=SC2086
  out=$("$B/pulsar-host" run -m "$m" -p "$txt" -n 16 --ignore-eos --device cuda --vram-budget "$g" $cfg --stats "${P[@]}" 2>/tmp/pf-err.txt | od -An -tx1 | md5sum)
  echo "prefetch-check budget $g ${cfg:-prefetch}: text md5 $out; $(grep -Eo '"prefetched":[0-9]+,"prefetch_hits":[0-9]+' /tmp/pf-err.txt | tail -1) $(grep -E 'prefill:' /tmp/pf-err.txt | tail -1)"
done
"$B/pulsar-host" run -m "$m" -p "$txt" --decode-consistency 8 --device cuda --vram-budget "$g" "${P[@]}" 2>/dev/null | sed "s/^/prefetch-check budget $g /"
