#!/usr/bin/env bash
# Start a real LMCache server (oracle venv), run the demo against it, stop the server.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
port=${DEMO_PORT:-$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
scripts/lmcache-server.sh start --port "$port" -- --supported-transfer-mode auto
trap 'scripts/lmcache-server.sh stop --port "$port"' EXIT
# The "running for days" part SIGKILLs the server and starts it again on the same port.
export DEMO_RESTART_CMD="kill -9 \$(cat .oracle/run/server-$port.pid) && scripts/lmcache-server.sh stop --port $port && scripts/lmcache-server.sh start --port $port -- --supported-transfer-mode auto"
.venv/bin/python examples/demo.py "tcp://127.0.0.1:$port"
