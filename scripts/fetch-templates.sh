#!/usr/bin/env bash
# Fetch the chat templates the model authors publish, as llama.cpp carries them
# (vendor/llama.cpp/models/templates/ of the llama-cpp-python 0.3.36 sdist on PyPI),
# checksum-verified and cached. Idempotent: prints the directory.
# Usage: scripts/fetch-templates.sh [DEST_DIR]   (default: $PULSAR_TEMPLATES or ~/.cache/pulsar/templates)
set -euo pipefail
dest="${1:-${PULSAR_TEMPLATES:-$HOME/.cache/pulsar/templates}}"
names=(deepseek-ai-DeepSeek-V3.1 deepseek-ai-DeepSeek-V3.2 moonshotai-Kimi-K2 Kimi-K2-Instruct Kimi-K2-Thinking tencent-Hy3 MiniMax-M2 MiniMax-M3 Qwen3.5-4B Qwen3-Coder)
have=1
for n in "${names[@]}"; do [ -f "$dest/$n.jinja" ] || have=0; done
if [ "$have" = 1 ]; then echo "$dest"; exit 0; fi
sdist_dir="${REFGEN_SDIST_DIR:-$HOME/.cache/pulsar/llamacpp-sdist}"
tarball="$sdist_dir/llama_cpp_python-0.3.36.tar.gz"
sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
if ! { [ -f "$tarball" ] && echo "$sha  $tarball" | sha256sum -c --quiet - 2>/dev/null; }; then
  mkdir -p "$sdist_dir"
  python3 - "$tarball" >&2 <<'PY'
import re, sys, urllib.request
page = urllib.request.urlopen(urllib.request.Request("https://pypi.org/simple/llama-cpp-python/", headers={"Accept": "text/html"}), timeout=120).read().decode()
url = next(l for l in re.findall(r'href="([^"]+)"', page) if l.split("#")[0].endswith("llama_cpp_python-0.3.36.tar.gz"))
urllib.request.urlretrieve(url.split("#")[0], sys.argv[1] + ".tmp")
PY
  echo "$sha  $tarball.tmp" | sha256sum -c --quiet - || { echo "checksum mismatch for $tarball" >&2; rm -f "$tarball.tmp"; exit 1; }
  mv "$tarball.tmp" "$tarball"
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
tar -xzf "$tarball" -C "$work" --wildcards '*/vendor/llama.cpp/models/templates/*.jinja'
mkdir -p "$dest"
for n in "${names[@]}"; do cp "$work/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/$n.jinja" "$dest/"; done
echo "$dest"
