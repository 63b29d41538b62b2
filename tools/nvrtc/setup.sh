#!/usr/bin/env bash
# Installs NVRTC and the CUDA runtime headers from PyPI wheels into a venv under
# ~/.cache/pulsar/nvrtc-venv, so the kernel-compile test (host/cuda/tests/nvrtc_compile.rs)
# can run with no CUDA toolkit and no GPU. Idempotent: a second run only prints.
#
# Prints two lines, for scripts to eval:
#   PULSAR_NVRTC_LIB_DIR=<dir holding libnvrtc.so.13>
#   PULSAR_CUDA_INCLUDE_DIR=<dir holding cuda_runtime.h and friends>
set -euo pipefail

VERSION="${PULSAR_NVRTC_VERSION:-13.0.*}"
ROOT="${PULSAR_CACHE_DIR:-$HOME/.cache/pulsar}"
VENV="$ROOT/nvrtc-venv"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$ROOT"
    "$PY" -m venv "$VENV" >&2
fi
if ! "$VENV/bin/python" -c 'import nvidia.cuda_nvrtc, nvidia.cuda_runtime' 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
        "nvidia-cuda-nvrtc==$VERSION" "nvidia-cuda-runtime==$VERSION" >&2
fi

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The 13.x wheels put everything under nvidia/cu13; older ones under nvidia/cuda_nvrtc.
LIB="$(dirname "$(find "$SITE/nvidia" -name 'libnvrtc.so*' | grep -v builtins | head -n1)")"
INC="$(dirname "$(find "$SITE/nvidia" -name 'cuda_runtime.h' | head -n1)")"
if [ -z "$LIB" ] || [ ! -d "$LIB" ]; then
    echo "tools/nvrtc/setup.sh: libnvrtc not found under $SITE/nvidia" >&2
    exit 1
fi
# cudarc's dynamic loader asks for libnvrtc.so (and versioned names): make sure the
# plain name exists next to the versioned one.
if [ ! -e "$LIB/libnvrtc.so" ]; then
    ln -sf "$(basename "$(ls "$LIB"/libnvrtc.so.* | grep -v builtins | head -n1)")" "$LIB/libnvrtc.so"
fi
echo "PULSAR_NVRTC_LIB_DIR=$LIB"
echo "PULSAR_CUDA_INCLUDE_DIR=$INC"
