#!/usr/bin/env bash
# The benchmark matrix for the GPU machine in one command: synthesises the
# qwen3-235b-a22b --layers 48 q2_K models (skew 0 and 1, one at a time on its
# disk) and the 24-layer q4_K one, benches them resident, at --vram-budget 16
# on every cold path, with --no-prefetch, and with --host-cache 8 (the disk
# tier), plus gemma-3-270m when it is at $PULSAR_GPU_WORK/gemma.gguf; writes
# the Markdown tables to OUT_DIR/summary.md. Prebuilt binaries only (no Rust
# there): BIN_DIR as laid out by scripts/devbin.sh.
#
#   scripts/bench-h200.sh BIN_DIR [OUT_DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "$here/gpu-e2e.sh" "${1:?usage: scripts/bench-h200.sh BIN_DIR [OUT_DIR]}" "${2:-${OUT:-/tmp/pulsar-bench}}" "gemma bench q4k"
