#!/usr/bin/env bash
# Lay out stripped release binaries for the GPU machine in devbin/ (git-ignored):
# pulsar-host, plugins/<name>/{plugin.toml, lib}, the pulsar-cuda selftest, and
# the custom_family and server_batch test binaries when they were built
# (cargo test --release -p pulsar-host --test custom_family --test server_batch
# --no-run; server_batch goes to deps/ so it finds plugins/ one folder up).
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
fam=$(ls -t "$t"/deps/custom_family-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
[ -n "$fam" ] && strip -o "$out/custom_family" "$fam"
sb=$(ls -t "$t"/deps/server_batch-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
[ -n "$sb" ] && mkdir -p "$out/deps" && strip -o "$out/deps/server_batch" "$sb"
du -sh "$out"
