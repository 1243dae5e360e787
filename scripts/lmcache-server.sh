#!/usr/bin/env bash
# The oracle: a real LMCache MP server in its own virtualenv, started and stopped
# exactly (by pid file), for tests, demos, fixture generation and benchmarks.
#
#   scripts/lmcache-server.sh install [--version V]
#   scripts/lmcache-server.sh start   [--version V] [--port P] [-- extra server args]
#   scripts/lmcache-server.sh stop    [--port P]
#   scripts/lmcache-server.sh python  [--version V] -- args...   (run the oracle python)
#   scripts/lmcache-server.sh zygote  [--version V] -- SOCKET     (a fork server, below)
#
# Environment: LMCACHE_MP_ORACLE_DIR (default: <repo>/.oracle) holds venv-<version>/
# and run/ (pid and log files). lmcache_mp itself never imports lmcache; only this venv does.
# LMCACHE_MP_SERVER_ZYGOTE=VERSION:SOCKET: `start` of that version forks the server from
# a running `zygote` (scripts/server_zygote.py: the server imported once, ~8 CPU-s
# saved a start; the test suite starts ~100) instead of starting a new interpreter.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/uv.sh"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
oracle_dir=${LMCACHE_MP_ORACLE_DIR:-$repo/.oracle}
python_bin=${PYTHON:-python3}

cmd=${1:-}; shift || true
version=0.5.3; port=5555; extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --version) version=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "lmcache-server.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

venv=$oracle_dir/venv-$version
run_dir=$oracle_dir/run
pid_file=$run_dir/server-$port.pid
log_file=$run_dir/server-$port.log
export LMCACHE_DISABLE_BANNER=1 LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 OMP_NUM_THREADS=1

install() {
  mkdir -p "$oracle_dir"
  # One installer at a time per venv (parallel test workers may all ask). The lock
  # lives in a subshell so no server started later inherits it.
  (
    flock 9
    install_locked
  ) 9>"$oracle_dir/.install-$version.lock"
}

# Packages LMCache does not require but the multi-node tests use (tests/multinode): its
# `valkey` L2 adapter imports valkey-glide's sync client (0.5.6, 0.5.7rc2 are tested).
oracle_extras() {
  case $version in 0.5.6|0.5.7rc2) echo "valkey-glide-sync==2.5.3" ;; esac
}

install_locked() {
  local extras; extras=$(oracle_extras)
  # One python: 0 installed, 2 the extras missing, else (no venv, another lmcache) anew.
  local rc=0
  [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import importlib.metadata as m, importlib.util as u, sys; sys.exit(1 if m.version('lmcache') != '$version' else 2 if '$extras' and not u.find_spec('glide_sync') else 0)" 2>/dev/null || rc=$?
  [ -x "$venv/bin/python" ] || rc=1
  case $rc in
    0) return 0 ;;
    2) uv_install "$venv" $extras; return 0 ;;  # a venv made before the extras were added
  esac
  echo "lmcache-server.sh: installing the oracle venv $venv (lmcache==$version, uv)" >&2
  # torch: the local CPU build, linked from uv's cache (scripts/uv.sh).
  uv_venv "$venv"
  # An exact pin (lmcache==0.5.7rc2) selects a pre-release of lmcache alone; allowing
  # pre-releases generally would also take them for its dependencies, and httpx 1.0.dev
  # breaks lmcache's import (no httpx.AsyncClient), so httpx is held below 1 as well.
  uv_install "$venv" "lmcache==$version" "httpx<1" $extras
  "$venv/bin/python" -c "import torch, lmcache; print('oracle', lmcache.__file__, 'torch', torch.__version__)" >&2
}

# Asks the server (scripts/wait_ready.py: GET_CHUNK_SIZE every 0.5 s, from one process
# of the oracle venv; a python a try cost ~2.5 CPU-s a start); exit 0 when answered, 3 if
# PID ended, 1 after 120 s.
wait_ready() {  # PID
  "$venv/bin/python" "$repo/scripts/wait_ready.py" "tcp://127.0.0.1:$port" "$1" 120
}

runs_server() {  # pid still runs, and is an LMCache server on this port (not a recycled pid)
  [ -r "/proc/$1/cmdline" ] || return 1
  if tr '\0' ' ' <"/proc/$1/cmdline" | grep -q "lmcache.v1.multiprocess.server.*--port $port"; then
    return 0
  fi
  # A server forked by scripts/server_zygote.py keeps the fork server's command line;
  # it names itself after its port instead.
  tr '\0' ' ' <"/proc/$1/cmdline" | grep -q "server_zygote.py serve" \
    && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "lmcache-s:$port" ]
}

# The run directory lives in the oracle directory, which several checkouts may share
# (a symlinked .oracle): a pid file can name another checkout's server on the same
# port. Servers are started with this checkout's path in their environment, and only
# those are ever stopped.
owner="LMCACHE_MP_SERVER_OWNER=$repo"
is_our_server() {
  # 2>/dev/null: the process may exit between the checks (a stop racing its own exit)
  runs_server "$1" && [ -r "/proc/$1/environ" ] && tr '\0' '\n' 2>/dev/null <"/proc/$1/environ" | grep -qxF "$owner"
}

start() {
  install
  mkdir -p "$run_dir"
  if [ -f "$pid_file" ] && runs_server "$(cat "$pid_file")"; then
    echo "lmcache-server.sh: a server is already running on port $port (pid $(cat "$pid_file"))" >&2; exit 1
  fi
  local args=(--host 127.0.0.1 --port "$port" --l1-size-gb 1 --eviction-policy LRU
              --disable-observability "${extra[@]}")
  local zygote=${LMCACHE_MP_SERVER_ZYGOTE:-}
  if [ "${zygote%%:*}" = "$version" ] && [ -S "${zygote#*:}" ]; then
    if ! env "$owner" "$venv/bin/python" -I -S "$repo/scripts/server_zygote.py" spawn \
        "${zygote#*:}" "$log_file" -- "${args[@]}" >"$pid_file"; then
      echo "lmcache-server.sh: the fork server ${zygote#*:} did not start a server" >&2
      rm -f "$pid_file"; exit 1
    fi
  else
    env "$owner" setsid "$venv/bin/python" -m lmcache.v1.multiprocess.server "${args[@]}" \
      >"$log_file" 2>&1 </dev/null &
    echo $! >"$pid_file"
  fi
  local pid; pid=$(cat "$pid_file")
  local i
  for ((i = 0; i < ${#extra[@]}; i++)); do
    if [ "${extra[$i]}" = "--shm-name" ] && [ -n "${extra[$((i + 1))]:-}" ]; then
      echo "${extra[$((i + 1))]}" >"$run_dir/server-$port.shm"
    fi
  done
  local rc=0
  wait_ready "$pid" >/dev/null 2>&1 || rc=$?
  case $rc in
    0) echo "lmcache-server.sh: LMCache $version server pid $pid on tcp://127.0.0.1:$port (log $log_file)"; return 0 ;;
    3) echo "lmcache-server.sh: server exited during start; last log lines:" >&2; tail -20 "$log_file" >&2; rm -f "$pid_file"; exit 1 ;;
  esac
  echo "lmcache-server.sh: server did not answer GET_CHUNK_SIZE within 120 s" >&2; stop; exit 1
}

stop() {
  [ -f "$pid_file" ] || { echo "lmcache-server.sh: no server recorded on port $port"; return 0; }
  local pid; pid=$(cat "$pid_file")
  if runs_server "$pid" && ! is_our_server "$pid"; then
    echo "lmcache-server.sh: the server on port $port (pid $pid) was started from another checkout; not stopping it" >&2
    return 0
  fi
  if is_our_server "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do is_our_server "$pid" || break; sleep 0.1; done
    if is_our_server "$pid"; then
      kill -KILL "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do is_our_server "$pid" || break; sleep 0.1; done
    fi
  fi
  # A SIGKILLed server leaves its 1 GiB L1 pool segment behind (named after its pid,
  # or as given with --shm-name, which LMCache prefixes with lmcache_l1_pool_).
  rm -f "/dev/shm/lmcache_l1_pool_$pid"
  if [ -f "$run_dir/server-$port.shm" ]; then
    local name; name=$(cat "$run_dir/server-$port.shm")
    rm -f "/dev/shm/$name" "/dev/shm/lmcache_l1_pool_$name"
    rm -f "$run_dir/server-$port.shm"
  fi
  rm -f "$pid_file"
  echo "lmcache-server.sh: stopped server pid $pid on port $port"
}

case "$cmd" in
  install) install; echo "$venv" ;;
  start) start ;;
  stop) stop ;;
  python) install; exec "$venv/bin/python" "${extra[@]}" ;;
  zygote) install; exec env "$owner" "$venv/bin/python" "$repo/scripts/server_zygote.py" serve "${extra[0]}" ;;
  venv) echo "$venv" ;;
  *) sed -n 2,12p "$0" >&2; exit 2 ;;
esac
