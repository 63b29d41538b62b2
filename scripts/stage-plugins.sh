#!/usr/bin/env bash
# Lay out every built family plugin next to the binary, where `pulsar-host`
# looks by default: target/<profile>/plugins/<name>/{plugin.toml, lib*.so}.
# Usage: scripts/stage-plugins.sh [debug|release] [TARGET_DIR]
set -euo pipefail
profile="${1:-debug}"
root="$(cd "$(dirname "$0")/.." && pwd)"
target="${2:-${CARGO_TARGET_DIR:-$root/target}}"
out="$target/$profile/plugins"
mkdir -p "$out"
for manifest in "$root"/arch-plugins/*/plugin.toml; do
  name=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$manifest")
  lib=$(sed -n 's/^library *= *"\(.*\)"/\1/p' "$manifest")
  if [ ! -f "$target/$profile/$lib" ]; then
    echo "stage-plugins: $target/$profile/$lib is missing (build first)" >&2
    exit 1
  fi
  mkdir -p "$out/$name"
  cp "$manifest" "$out/$name/plugin.toml"
  cp "$target/$profile/$lib" "$out/$name/$lib"
done
echo "$out"
