#!/usr/bin/env bash
# Build pulsar-host and its plugins (release), stage the plugins next to the
# binary, and run it. With no arguments: `run` on the built-in default model.
# Usage: scripts/pulsar.sh [pulsar-host arguments...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
(cd "$root" && cargo build --release --locked -p pulsar-host -p pulsar-arch-gemma3 -p pulsar-arch-qwen3moe -p pulsar-arch-hy-v3 -p pulsar-arch-minimax -p pulsar-arch-deepseek2 -p pulsar-arch-qwen35 >&2)
"$root/scripts/stage-plugins.sh" release >/dev/null
if [ "$#" -eq 0 ]; then set -- run -p "Once upon a time" -n 24; fi
exec "${CARGO_TARGET_DIR:-$root/target}/release/pulsar-host" "$@"
