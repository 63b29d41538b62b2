#!/usr/bin/env bash
# The test suite, as CI runs it: fetch the real test model (cached), build the
# whole workspace (the plugin libraries the registry tests load included),
# stage the plugins next to the binary, run every test.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PULSAR_GEMMA_GGUF="${PULSAR_GEMMA_GGUF:-$(scripts/fetch-gemma.sh)}"
PULSAR_TEMPLATES="${PULSAR_TEMPLATES:-$(scripts/fetch-templates.sh)}"
export PULSAR_TEMPLATES
export PULSAR_GEMMA_GGUF
# NVRTC and the CUDA headers from PyPI wheels: the kernel-compile test runs with no GPU.
eval "$(tools/nvrtc/setup.sh)"
export PULSAR_NVRTC_LIB_DIR PULSAR_CUDA_INCLUDE_DIR
cargo build --workspace --locked
scripts/stage-plugins.sh debug >/dev/null
cargo test --workspace --locked "$@"
# The reference-parity table of every family (cargo captures it in the run above).
cargo test --locked -q -p pulsar-host --test parity parity_table -- --nocapture 2>&1 | sed -n '/^family/,/^$/p'
# The server with real clients: the official openai package and the web page in
# headless Chromium (installs its venv, npm package and Chromium when missing).
PULSAR_E2E_NO_BUILD=1 host/tests/server/run-e2e.sh
