#!/usr/bin/env bash
# End-to-end tests of `pulsar-host serve` with real clients: the official
# `openai` Python package and the web chat page in headless Chromium.
#
# Installs what they need when missing (a venv under ~/.cache/pulsar, the
# playwright-core npm package under ~/.cache/pulsar, Debian's chromium via
# apt), starts fresh servers on free loopback ports with an API key (a tiny
# synthetic model for the Python client, gemma-3-270m for the page), runs
# both, stops the servers with SIGTERM (each must exit 0), and exits non-zero
# if anything failed. Screenshots and server logs land in $TARGET/server-e2e/.
#
# Usage: host/tests/server/run-e2e.sh   (PULSAR_E2E_NO_BUILD=1 skips the cargo build)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
art="$target/server-e2e"
cache="${PULSAR_CACHE:-$HOME/.cache/pulsar}"
venv="$cache/venv-server"
nodedir="$cache/node-server"
mkdir -p "$art" "$cache"

log() { echo "run-e2e: $*" >&2; }

# 1. The binary and its plugins.
if [ "${PULSAR_E2E_NO_BUILD:-0}" != 1 ]; then
  cargo build --workspace --locked
  scripts/stage-plugins.sh debug "$target" >/dev/null
fi
bin="$target/debug/pulsar-host"
[ -x "$bin" ] || { log "$bin is missing (build first)"; exit 1; }

# 2. The clients.
if ! "$venv/bin/python" -c "import openai" 2>/dev/null || ! cmp -s "$here/requirements.txt" "$venv/.requirements.txt"; then
  log "installing the openai client into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt"
  cp "$here/requirements.txt" "$venv/.requirements.txt"
fi
if [ ! -d "$nodedir/node_modules/playwright-core" ]; then
  command -v npm >/dev/null || { log "npm is required for the browser test"; exit 1; }
  log "installing playwright-core into $nodedir"
  mkdir -p "$nodedir"
  npm install --silent --no-audit --no-fund --prefix "$nodedir" playwright-core@1.65.1 >/dev/null
fi
chromium="${CHROMIUM:-/usr/bin/chromium}"
if [ ! -x "$chromium" ]; then
  log "installing chromium (apt)"
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq chromium >/dev/null
fi

# 3. Fresh servers on free ports: the tiny synthetic model for the API
# client; gemma-3-270m for the page (real text, ~30 tok/s in a debug build,
# so Stop lands mid-stream; the synthetic model's noise stops too soon).
tiny="$art/tiny-qwen3moe.gguf"
"$bin" synth --preset tiny --layers 2 -o "$tiny" >/dev/null
gemma="${PULSAR_GEMMA_GGUF:-$HOME/.cache/pulsar/models/gemma-3-270m-Q4_K_M.gguf}"
[ -f "$gemma" ] || gemma="$(scripts/fetch-gemma.sh)"
key="e2e-$RANDOM$RANDOM"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
# start NAME MODEL: start a server, set $url to its address.
start() {
  local name="$1" model="$2" log="$art/server-$1.log"
  "$bin" serve -m "$model" --host 127.0.0.1 --port 0 --api-key "$key" --parallel 4 --alias "$name" --shutdown-grace 2 -v >"$log" 2>&1 &
  pids+=($!)
  url=""
  for _ in $(seq 1 600); do
    url=$(sed -n 's/.*listening on \(http:\/\/[^ ]*\).*/\1/p' "$log" | head -1)
    [ -n "$url" ] && break
    kill -0 "${pids[-1]}" 2>/dev/null || { log "the $name server exited:"; cat "$log" >&2; exit 1; }
    sleep 0.1
  done
  [ -n "$url" ] || { log "the $name server did not start:"; cat "$log" >&2; exit 1; }
  log "$name server at $url"
}
export PULSAR_API_KEY="$key" PULSAR_E2E_ARTIFACTS="$art" CHROMIUM="$chromium"

status=0
start tiny "$tiny"
log "openai python client"
PULSAR_SERVER_URL="$url" timeout 300 "$venv/bin/python" "$here/test_openai.py" || { log "FAILED: openai client tests"; status=1; }
start gemma "$gemma"
log "web chat page in headless chromium"
PULSAR_SERVER_URL="$url" NODE_PATH="$nodedir/node_modules" timeout 300 node "$here/ui_test.cjs" || { log "FAILED: browser tests"; status=1; }

# 4. SIGTERM: each server exits cleanly (status 0, "server stopped").
for i in "${!pids[@]}"; do
  p="${pids[$i]}"
  kill -TERM "$p"
  if ! timeout 30 tail --pid="$p" -f /dev/null; then
    log "FAILED: server $p did not exit within 30 s of SIGTERM"
    status=1
  fi
  wait "$p" && rc=0 || rc=$?
  if [ "$rc" != 0 ]; then
    log "FAILED: server $p exited with $rc after SIGTERM"
    status=1
  fi
done
trap - EXIT
for name in tiny gemma; do
  grep -q "server stopped" "$art/server-$name.log" || { log "FAILED: no clean shutdown in server-$name.log"; tail -20 "$art/server-$name.log" >&2; status=1; }
done
[ "$status" = 0 ] && log "all end-to-end tests passed (artefacts in $art)" || log "FAILED (server logs in $art)"
exit "$status"
