#!/usr/bin/env bash
# Lay out stripped release binaries for the GPU machine in devbin/ (git-ignored):
# pulsar-host, plugins/<name>/{plugin.toml, lib}, and the pulsar-cuda selftest.
# Usage: scripts/devbin.sh [TARGET_DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
t="${1:-${CARGO_TARGET_DIR:-$root/target}}/release"
out="$root/devbin"
rm -rf "$out"; mkdir -p "$out/plugins"
strip -o "$out/pulsar-host" "$t/pulsar-host"
strip -o "$out/selftest" "$t/examples/selftest"
for manifest in "$root"/arch-plugins/*/plugin.toml; do
  name=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$manifest")
  lib=$(sed -n 's/^library *= *"\(.*\)"/\1/p' "$manifest")
  mkdir -p "$out/plugins/$name"
  cp "$manifest" "$out/plugins/$name/"
  strip -o "$out/plugins/$name/$lib" "$t/$lib"
done
du -sh "$out"
