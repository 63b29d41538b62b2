#!/usr/bin/env bash
# GPU check, for the GPU machine (which has no Rust toolchain): runs the
# prebuilt pulsar-cuda self-test from a folder of binaries and writes its
# Markdown table.
#
#   scripts/gpu-check.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR holds `selftest` (built here with
#   CARGO_TARGET_DIR=/work/targets/cuda cargo build --release -p pulsar-cuda --example selftest
# and copied from $CARGO_TARGET_DIR/release/examples/selftest). OUT_DIR
# (default: $OUT if set, else BIN_DIR) receives gpu-selftest.md and
# gpu-selftest.log. Exit status: the self-test's (0 all pass, 1 a row failed,
# 2 no device).
set -uo pipefail

BIN_DIR="${1:?usage: scripts/gpu-check.sh BIN_DIR [OUT_DIR]}"
OUT_DIR="${2:-${OUT:-$BIN_DIR}}"
BIN="$BIN_DIR/selftest"
if [ ! -x "$BIN" ]; then
    echo "gpu-check: $BIN missing or not executable" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
# A private kernel cache, so the run measures a cold NVRTC compile first.
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$(mktemp -d)}"
"$BIN" --bench --out "$OUT_DIR/gpu-selftest.md" 2>&1 | tee "$OUT_DIR/gpu-selftest.log"
rc=${PIPESTATUS[0]}
echo "gpu-check: selftest exit status $rc; table in $OUT_DIR/gpu-selftest.md"
exit "$rc"
