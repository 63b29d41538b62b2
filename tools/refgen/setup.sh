#!/usr/bin/env bash
# Set up the fixture generator's environment, outside the repo:
#   - a venv of its own (never the project's shared one) with requirements.txt;
#   - llama.cpp's convert_hf_to_gguf.py + bundled gguf-py, taken from the
#     llama-cpp-python 0.3.36 source distribution on PyPI (the only registry
#     that carries them here). Its code is used as a tool, never committed.
# Idempotent: re-running skips what is already there.
set -euo pipefail

VENV="${REFGEN_VENV:-/root/.cache/pulsar/venv-ref}"
SDIST_DIR="${REFGEN_SDIST_DIR:-/root/.cache/pulsar/llamacpp-sdist}"
HERE="$(cd "$(dirname "$0")" && pwd)"
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -r "$HERE/requirements.txt"

TARBALL="$SDIST_DIR/llama_cpp_python-0.3.36.tar.gz"
if [ ! -f "$TARBALL" ]; then
  mkdir -p "$SDIST_DIR"
  # --no-build-isolation: pip must prepare the sdist's metadata, which needs
  # scikit-build-core and cmake; they are in the venv, so no network build env.
  "$VENV/bin/pip" download --no-deps --no-binary=:all: --no-build-isolation \
    llama-cpp-python==0.3.36 -d "$SDIST_DIR"
fi
echo "$SDIST_SHA256  $TARBALL" | sha256sum -c -
if [ ! -f "$SDIST_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  tar -xzf "$TARBALL" -C "$SDIST_DIR"
fi
echo "venv:      $VENV"
echo "converter: $SDIST_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py"
