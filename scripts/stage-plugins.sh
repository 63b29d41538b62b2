#!/usr/bin/env bash
# Lay out every built family plugin next to the binary, where `pulsar-host`
# looks by default: target/<profile>/plugins/<name>/{plugin.toml, lib*.so}.
# Each file is written under a temporary name beside its place and renamed
# over it, so a running pulsar-host that has the old library mapped keeps
# its (untouched) inode: copying over a loaded library in place crashes it.
# Usage: scripts/stage-plugins.sh [debug|release] [TARGET_DIR]
set -euo pipefail
profile="${1:-debug}"
root="$(cd "$(dirname "$0")/.." && pwd)"
target="${2:-${CARGO_TARGET_DIR:-$root/target}}"
out="$target/$profile/plugins"
mkdir -p "$out"
install_file() { # SRC DST MODE
  local tmp
  tmp=$(mktemp "$(dirname "$2")/.$(basename "$2").XXXXXX")
  cp "$1" "$tmp" && chmod "$3" "$tmp" && mv -f "$tmp" "$2" || { rm -f "$tmp"; return 1; }
}
for manifest in "$root"/arch-plugins/*/plugin.toml; do
  name=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$manifest")
  lib=$(sed -n 's/^library *= *"\(.*\)"/\1/p' "$manifest")
  if [ ! -f "$target/$profile/$lib" ]; then
    echo "stage-plugins: $target/$profile/$lib is missing (build first)" >&2
    exit 1
  fi
  mkdir -p "$out/$name"
  install_file "$manifest" "$out/$name/plugin.toml" 0644
  install_file "$target/$profile/$lib" "$out/$name/$lib" 0755
done
echo "$out"
