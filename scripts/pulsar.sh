#!/usr/bin/env bash
# Build pulsar-host and its plugins (release), stage the plugins next to the
# binary, and run it. With no arguments: fetch the small real model the tests
# use (gemma-3-270m, cached and checksummed) and generate from it; offline, or
# with `synthetic`, the built-in random model instead (its text is noise).
# Usage: scripts/pulsar.sh [synthetic | pulsar-host arguments...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
(cd "$root" && cargo build --release --locked -p pulsar-host -p pulsar-arch-gemma3 -p pulsar-arch-qwen3moe -p pulsar-arch-hy-v3 -p pulsar-arch-minimax -p pulsar-arch-deepseek2 -p pulsar-arch-qwen35 -p pulsar-arch-qwen4exp >&2)
"$root/scripts/stage-plugins.sh" release >/dev/null
if [ "$#" -eq 0 ]; then
  if gemma="$("$root/scripts/fetch-gemma.sh")"; then
    set -- run -m "$gemma" -p "The three most useful things to pack for a long hike are" -n 48
  else
    echo "pulsar.sh: could not fetch gemma-3-270m (offline?): running the built-in synthetic model" >&2
    set -- synthetic
  fi
fi
if [ "$1" = synthetic ]; then set -- run -p "Once upon a time" -n 24; fi
exec "${CARGO_TARGET_DIR:-$root/target}/release/pulsar-host" "$@"
