#!/usr/bin/env bash
# One prepared run on a lent GPU machine (see ../shared/reference/gpu-device-notes.md):
# install the carried wheels, then for each LMCache release (0.5.7rc2, 0.5.6, 0.5.3:
# the newest first, should time run short) start its real MP server in GPU mode, run the
# GPU round trip (scripts/gpu_check.py, the package scripts/gpu_check/: Llama-3-8B's
# geometry by default, 32 layers x 8 KV heads x 128, bf16, vLLM-style scattered block
# ids, every side on a stream of its own; our wrapper forms, engine-driven copies on
# every layout with the copy phase alone and the pinned-copy floor (torch's pinned
# buffer and a registered shared mapping) measured beside them, an MLA cache both ways,
# vs LMCache's own client), the restart step (SIGKILL, restart, both transfer modes
# recover) and the doctor, stop it; then the VMM export check
# (scripts/gpu_vmm_check.py), the event per transfer vs per step timing
# (scripts/gpu_step_events.py, issue 38 item 4) and the CUDA tests (tests/ipc/test_gpu_live.py: the
# two-thread two-stream race and the 20-replacement leak check on real CUDA among
# them). One short table at the end.
#
# Here, first:  scripts/fetch_gpu_wheels.sh         (fills the git-ignored .whl/)
# On the GPU:   device run, carry [".whl"], timeout_s 600, command "bash scripts/gpu_check.sh"
#
# A lent device's run must never be lost, so this script:
# * never stops at a failed step: each is recorded (ok / FAIL / skip) and the run goes on;
# * rewrites $OUT/summary.txt and $OUT/summary.json after every step, and once more from
#   an EXIT trap (SIGTERM / SIGINT included), so a table exists even if it is cut short;
# * gives every step a time limit inside one budget (GPU_CHECK_BUDGET, default 540 s,
#   under the device's 600 s per call), skipping what no longer fits;
# * stops every server it started, whatever happened;
# * knows a server is ready by asking it (scripts/wait_ready.py), not by its log;
# * sizes each server's L1 for what the run stores (gpu_check.py --l1-gib);
# * keeps $OUT to at most 8 files (what the device tool brings back): summary.txt,
#   summary.json, run.log (every step's output), servers.log (every server's output,
#   one after another), results-<release>.json (written by gpu_check.py after every
#   side, and by its restart step) and step_events.json.
#
# Environment (all optional):
#   OUT                   where results go (default /tmp/gpu_check_out)
#   GPU_CHECK_PYTHON      interpreter (default: /opt/torch/.venv/bin/python3, else python3)
#   GPU_CHECK_PYTHON_0_5_3, ...  interpreter for one release's server
#                         and round trip (dry runs: the oracle venvs)
#   GPU_CHECK_TEST_PYTHON interpreter for the pytest step (default: GPU_CHECK_PYTHON)
#   GPU_CHECK_RELEASES    default "0.5.7rc2 0.5.6 0.5.3"
#   GPU_CHECK_BUDGET      seconds for the whole run (default 540); GPU_CHECK_RESERVE (20)
#                         of them are kept for stopping servers and the summary
#   GPU_CHECK_PORT        first server port (default 5555; one port per release)
#   GPU_CHECK_REQUEST_TIMEOUT  per request, seconds (default 20)
#   GPU_CHECK_SIDE_TIMEOUT     a round-trip side running longer is abandoned (default 60)
#   GPU_CHECK_SIDES       the round trip's sides (gpu_check.py --sides; default: all)
#   GPU_CHECK_SKIP_INSTALL=1   use the interpreters' own packages (no .whl/ install)
#   GPU_CHECK_SKIP_PYTEST=1    no pytest step
#   GPU_CHECK_DRY_RUN=1   a machine without a GPU: accept CPU-mode servers and run
#                         gpu_check.py --cpu-dry-run (rehearses this script, proves no CUDA)
#   GPU_CHECK_FAULT       provoked failures, for the rehearsal tests: server-start:REL,
#                         hang:SIDE / fail:SIDE (passed on to gpu_check.py)
#
# Exit status: 0 every step passed, 1 something failed or was skipped for lack of time,
# 128+N killed by signal N (the summary is written all the same).
set -uo pipefail # never -e: a failed step is recorded and the run goes on

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 2
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
budget=${GPU_CHECK_BUDGET:-540}
reserve=${GPU_CHECK_RESERVE:-20}
base_port=${GPU_CHECK_PORT:-5555}
dry=${GPU_CHECK_DRY_RUN:-0}
read -r -a releases <<<"${GPU_CHECK_RELEASES:-0.5.7rc2 0.5.6 0.5.3}"
req_timeout=${GPU_CHECK_REQUEST_TIMEOUT:-20}
side_timeout=${GPU_CHECK_SIDE_TIMEOUT:-60}
fault=${GPU_CHECK_FAULT:-}
site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
py=${GPU_CHECK_PYTHON:-}
if [ -z "$py" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then py=/opt/torch/.venv/bin/python3; else py=python3; fi
fi
test_py=${GPU_CHECK_TEST_PYTHON:-$py}

steps=()          # "name|status|seconds|detail", in order
failed=0
incomplete=0      # a step was skipped for lack of time
interrupted=""
finished=0
current=""        # the step running now
step_pid=""
declare -A server_pid=() rel_path=() server_shm=()
: >"$OUT/run.log"

log() { echo "[gpu_check $(printf '%4d' "$SECONDS")s] $*" | tee -a "$OUT/run.log"; }

left() {  # seconds a step may take: min(wanted, budget - elapsed - reserve)
  local want=$1 rest=$((budget - SECONDS - reserve))
  ((rest < want)) && want=$rest
  echo "$want"
}

json_str() {  # a JSON string literal
  local s=$1
  s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/ }; s=${s//$'\r'/ }; s=${s//$'\n'/\\n}
  printf '"%s"' "$(printf '%s' "$s" | tr -d '\000-\010\013\014\016-\037')"
}

json_field() {  # the value of a top-level string field of gpu_check.py's JSON, unescaped
  local v
  v=$(grep -m1 "^ \"$1\": \"" "$2" 2>/dev/null | sed "s/^ \"$1\": \"//; s/\",\{0,1\}\$//") || return 0
  printf '%b' "${v//\\\"/\"}"
}

write_summary() {  # summary.txt and summary.json from what is known now (atomic)
  local state result elapsed=$SECONDS row name st secs detail first=1 rel f
  if [ -n "$interrupted" ]; then state="INTERRUPTED by $interrupted"
  elif ((finished)); then state="FINISHED"
  elif ((${#steps[@]})); then state="RUNNING (written after: ${steps[${#steps[@]}-1]%%|*})"
  else state="RUNNING (starting)"; fi
  if ((failed)); then result=FAILED
  elif ((finished)) && [ -z "$interrupted" ] && ((!incomplete)); then result=OK
  else result=INCOMPLETE; fi
  {
    echo "=== gpu_check $state: $elapsed s of a $budget s budget$([ "$dry" = 1 ] && echo ', CPU DRY RUN (no CUDA involved)') ==="
    for rel in "${releases[@]}"; do
      f="$OUT/results-$rel.json"
      [ -s "$f" ] || continue
      echo
      echo "$(json_field title "$f") [$(json_field state "$f")]"
      json_field table "$f"
      echo
    done
    echo
    printf '  %-28s %-6s %5s  %s\n' step status secs detail
    for row in "${steps[@]+"${steps[@]}"}"; do
      IFS='|' read -r name st secs detail <<<"$row"
      printf '  %-28s %-6s %5s  %s\n' "$name" "$st" "$secs" "$detail"
    done
    [ -n "$current" ] && printf '  %-28s %-6s %5s  %s\n' "$current" "..." "" "running when this was written"
    echo "  result: $result"
    echo "  files in $OUT: $(cd "$OUT" && ls | grep -v '\.tmp$' | tr '\n' ' ')"
  } >"$OUT/summary.txt.tmp"
  mv -f "$OUT/summary.txt.tmp" "$OUT/summary.txt"
  {
    printf '{"state": %s, "result": %s, "elapsed_s": %d, "budget_s": %d, "dry_run": %s,\n' \
      "$(json_str "$state")" "$(json_str "$result")" "$elapsed" "$budget" \
      "$([ "$dry" = 1 ] && echo true || echo false)"
    printf ' "work_dir": %s, "running": %s,\n "steps": [' "$(json_str "$work")" "$(json_str "$current")"
    for row in "${steps[@]+"${steps[@]}"}"; do
      IFS='|' read -r name st secs detail <<<"$row"
      ((first)) || printf ','
      first=0
      printf '\n  {"name": %s, "status": %s, "seconds": %s, "detail": %s}' "$(json_str "$name")" \
        "$(json_str "$st")" "${secs:-null}" "$(json_str "$detail")"
    done
    printf '\n ]}\n'
  } >"$OUT/summary.json.tmp"
  mv -f "$OUT/summary.json.tmp" "$OUT/summary.json"
}

record() {  # name status detail [seconds]
  local detail=${3//|//}
  detail=${detail//$'\n'/ }
  steps+=("$1|$2|${4:-}|${detail:0:300}")
  [ "$2" = FAIL ] && failed=1
  [ "$2" = skip ] && [[ "$detail" == "no time left"* ]] && incomplete=1
  log "$1: $2${detail:+: $detail}"
  write_summary
}

run_step() {  # name seconds command...: run with a time limit, output into run.log
  local name=$1 t=$2 rc
  shift 2
  # timeout 0 would mean no limit at all.
  if ((t < 1)); then echo "===== $name: no time left" >>"$OUT/run.log"; : >"$work/step.log"; return 124; fi
  current=$name
  write_summary
  echo "===== $name (limit ${t}s)" >>"$OUT/run.log"
  # In the background so that a signal reaches our trap at once (wait is interruptible).
  timeout -k 5 "$t" "$@" >"$work/step.log" 2>&1 </dev/null &
  step_pid=$!
  wait "$step_pid"
  rc=$?
  step_pid=""
  current=""
  cat "$work/step.log" >>"$OUT/run.log"
  return "$rc"
}

rc_detail() {  # why a step's command failed
  case $1 in
    124) echo "timed out after ${2}s" ;;
    137) echo "killed after ${2}s" ;;
    *) echo "exit $1" ;;
  esac
}

stop_server() {  # rel
  local rel=$1 pid=${server_pid[$1]:-} i
  [ -n "$pid" ] || return 0
  # The restart step starts the server again and writes its new pid there.
  [ -s "$work/server-$rel.pid" ] && pid=$(cat "$work/server-$rel.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null
      log "server $rel did not stop on SIGTERM; killed"
    fi
  fi
  wait "$pid" 2>/dev/null
  # SIGKILL leaves the server's L1 segment behind: remove it by its pid.
  rm -f "/dev/shm/lmcache_l1_pool_$pid"
  [ -z "${server_shm[$rel]:-}" ] || rm -f "/dev/shm/${server_shm[$rel]}"
  unset "server_pid[$rel]"
}

on_signal() {  # name exit-code
  interrupted=$1
  [ -n "$step_pid" ] && kill -TERM "$step_pid" 2>/dev/null
  exit "$2"
}

finish() {
  local rc=$? rel
  trap '' TERM INT
  if [ -n "$step_pid" ]; then
    kill -TERM "$step_pid" 2>/dev/null
    wait "$step_pid" 2>/dev/null
    cat "$work/step.log" >>"$OUT/run.log" 2>/dev/null
  fi
  if [ -n "$current" ]; then
    local name=$current
    current=""
    record "$name" FAIL "interrupted (${interrupted:-exit $rc})"
  fi
  for rel in "${!server_pid[@]}"; do stop_server "$rel"; done
  finished=1
  write_summary
  cat "$OUT/summary.txt"
  rm -rf "$work"
  if [ -n "$interrupted" ]; then exit "$rc"; fi
  exit $((failed || incomplete))
}
trap finish EXIT
trap 'on_signal SIGTERM 143' TERM
trap 'on_signal SIGINT 130' INT
log "OUT=$OUT work=$work budget=${budget}s releases=${releases[*]} python=$py dry_run=$dry"
write_summary

# ------------------------------------------------------------ environment
env_probe() {  # python: what the device has (never fails the run)
  local p=$1
  date -u; uname -a
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
  df -h /dev/shm
  "$p" -c 'import sys, torch, numpy; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("numpy", numpy.__version__)'
  "$p" -c 'import cupy; print("cupy", cupy.__version__)'
  "$p" -c 'import cuda.bindings as cb; from cuda.bindings import runtime as rt; print("cuda-bindings", cb.__version__, "reserved", hasattr(rt.cudaIpcMemHandle_t(), "reserved"))'
  "$p" -c 'import pytest; print("pytest", pytest.__version__)'
  return 0
}
export -f env_probe
t0=$SECONDS
run_step env "$(left 30)" bash -c 'env_probe "$1"' _ "$py"
record env ok "see run.log" $((SECONDS - t0))

# ------------------------------------------------------------------ wheels
install_wheels() {  # target wheels...: no network, no dependencies; unzip without pip
  local target=$1
  shift
  if "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$target" "$@"
  else
    "$py" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$target" "$@"
  fi
}

cb_fallback=""
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  for rel in "${releases[@]}"; do rel_path[$rel]=${PYTHONPATH:-}; done
  record wheels skip "GPU_CHECK_SKIP_INSTALL=1: the interpreters' own packages"
else
  t0=$SECONDS
  n=$(find .whl/common -maxdepth 1 -name '*.whl' 2>/dev/null | wc -l)
  if ((n < 8)); then
    record wheels FAIL ".whl/common holds $n wheels: run scripts/fetch_gpu_wheels.sh here and carry .whl"
  elif install_wheels "$site/common" .whl/common/*.whl >>"$OUT/run.log" 2>&1; then
    record wheels ok "$n common wheels into $site/common" $((SECONDS - t0))
  else
    record wheels FAIL "installing .whl/common failed (see run.log)" $((SECONDS - t0))
  fi
  for rel in "${releases[@]}"; do
    rel_path[$rel]=$site/$rel:$site/common
    t0=$SECONDS
    bundle=.whl/$rel/lmcache-$rel-slim.tar.xz
    extras=(.whl/"$rel"/*.whl)
    [ -e "${extras[0]}" ] || extras=()
    if [ ! -s "$bundle" ]; then
      record "wheels $rel" FAIL "no $bundle: run scripts/fetch_gpu_wheels.sh"
    elif "$py" -c 'import sys, tarfile
with tarfile.open(sys.argv[2]) as t:
    t.extractall(sys.argv[1], filter="data")' "$site/$rel" "$bundle" >>"$OUT/run.log" 2>&1 \
        && { ((${#extras[@]} == 0)) || install_wheels "$site/$rel" "${extras[@]}" >>"$OUT/run.log" 2>&1; }; then
      record "wheels $rel" ok "lmcache $rel (slim bundle) and ${#extras[@]} wheels of its own into $site/$rel" $((SECONDS - t0))
    else
      record "wheels $rel" FAIL "installing lmcache $rel failed (see run.log)" $((SECONDS - t0))
    fi
  done
  # LMCache 0.5.3's RawCudaIPCWrapper.to_tensor assigns cudaIpcMemHandle_t.reserved, gone
  # from cuda-bindings 13.4: with newer device bindings, its server (and round trip) get
  # the carried 13.3.1, so the raw form is tested at all. pytest keeps the device's own.
  bindings=$("$py" -c 'import cuda.bindings as cb; from cuda.bindings import runtime as rt; print(cb.__version__, hasattr(rt.cudaIpcMemHandle_t(), "reserved"))' 2>/dev/null)
  wheel=$(find .whl/extra -maxdepth 1 -name 'cuda_bindings-13.3.*.whl' 2>/dev/null | head -1)
  if [[ "$bindings" == *" False" ]] && [ -n "$wheel" ] && install_wheels "$site/cb133" "$wheel" >>"$OUT/run.log" 2>&1; then
    cb_fallback=$site/cb133
    record "cuda-bindings" ok "device: ${bindings% *} (no .reserved): the 0.5.3 server and its round trip get the carried 13.3.1"
  else
    record "cuda-bindings" ok "device: ${bindings:-none} (version, has .reserved); no fallback installed"
  fi
fi

# ----------------------------------------------------------- per release
# The round trip's geometry (also what --l1-gib sizes the L1 for). The dry run: small.
rt_flags=()
[ "$dry" = 1 ] && rt_flags=(--cpu-dry-run --layers 2 --heads 2 --head-dim 64 --reps 2 --small-reps 2)
[ -n "${GPU_CHECK_SIDES:-}" ] && rt_flags+=(--sides "$GPU_CHECK_SIDES")
port=$base_port
for rel in "${releases[@]}"; do
  var=GPU_CHECK_PYTHON_${rel//./_}
  rpy=${!var:-$py}
  path=${rel_path[$rel]}
  if [ -n "$cb_fallback" ] && [[ "$rel" == 0.5.[34] ]]; then path=$cb_fallback:$path; fi

  # -- server
  t=$(left 120)
  if ((t < 10)); then
    record "server $rel" skip "no time left"
    continue
  fi
  slog=$OUT/servers.log
  # Both transfer modes, and an L1 pool in shared memory for the engine-driven side (a
  # GPU host allocates L1 lazily unless told not to, and then offers no pool).
  # 0.5.3 names its pool lmcache_l1_pool_<pid> by default; 0.5.4+ need a name.
  shm_args=()
  if [ "$rel" != 0.5.3 ]; then
    server_shm[$rel]=lmcache_l1_pool_gpucheck$port
    shm_args=(--shm-name "${server_shm[$rel]}")
  fi
  # The L1 holds the keys of the largest side's round trips (gpu_check.py --l1-gib says
  # how much; the round trip clears the server after every side), at most what
  # /dev/shm has free less 2 GiB. 1 GiB made 5 of 7 sides fail on 2026-12-04.
  l1=$(PYTHONPATH=$path "$rpy" scripts/gpu_check.py --url x --l1-gib "${rt_flags[@]}" 2>>"$OUT/run.log" || echo 8)
  shm_free=$(( $(df -Pk /dev/shm | awk 'NR == 2 {print $4}') / 1048576 - 2 ))
  ((shm_free < l1)) && l1=$((shm_free > 1 ? shm_free : 1))
  args=(--host 127.0.0.1 --port "$port" --l1-size-gb "$l1" --eviction-policy LRU --disable-observability
        --supported-transfer-mode auto "${shm_args[@]}" --no-l1-use-lazy)
  [[ ",$fault," == *",server-start:$rel,"* ]] && args+=(--gpu-check-provoked-bad-flag)
  # One script starts it, the first time and after the restart step's SIGKILL. INFO
  # logging for this server whatever the operator's LMCACHE_LOG_LEVEL: its GPU mode is
  # read from its log (readiness is asked, see wait_ready).
  start_script=$work/start-$rel.sh
  {
    printf 'echo "===== server %s started $(date -u +%%T) (pid $$)" >>%q\n' "$rel" "$slog"
    printf 'exec env PYTHONPATH=%q LMCACHE_DISABLE_BANNER=1 LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_LOG_LEVEL=INFO OMP_NUM_THREADS=4 %q -m lmcache.v1.multiprocess.server' "$path" "$rpy"
    printf ' %q' "${args[@]}"
    printf ' >>%q 2>&1 </dev/null\n' "$slog"
  } >"$start_script"
  touch "$slog"
  log_from=$(($(stat -c %s "$slog") + 1))
  t0=$SECONDS
  bash "$start_script" &
  server_pid[$rel]=$!
  echo "${server_pid[$rel]}" >"$work/server-$rel.pid"
  current="server $rel"
  write_summary
  PYTHONPATH=$path "$rpy" scripts/wait_ready.py "tcp://127.0.0.1:$port" "${server_pid[$rel]}" \
    "$t" >>"$OUT/run.log" 2>&1
  wrc=$?
  current=""
  if ((wrc != 0)); then
    why="not ready after $((SECONDS - t0)) s"
    ((wrc == 3)) && why="exited during start"
    record "server $rel" FAIL "$why (l1 $l1 GiB): $(tail -c +"$log_from" "$slog" | grep -v '^\s*$' | tail -1 | cut -c1-160)" $((SECONDS - t0))
    stop_server "$rel"
  else
    record "server $rel" ok "ready after $((SECONDS - t0)) s (pid ${server_pid[$rel]}, port $port, l1 $l1 GiB)" $((SECONDS - t0))
    gpu=0
    if tail -c +"$log_from" "$slog" | grep -q "torch_device_type=cuda"; then
      gpu=1
      record "mode $rel" ok "GPU (torch_device_type=cuda)"
    elif [ "$dry" = 1 ]; then
      record "mode $rel" ok "CPU (dry run)"
    else
      # A failed import of lmcache's cuda platform is swallowed: the server runs on CPU.
      record "mode $rel" FAIL "CPU mode (no torch_device_type=cuda in servers.log)"
    fi

    # -- round trip
    # 200 s: three sides of at most 60 s, and the next release still gets its turn.
    t=$(left 200)
    if ((gpu == 0)) && [ "$dry" != 1 ]; then
      record "round trip $rel" skip "the server is not in GPU mode"
    elif ((t < 20)); then
      record "round trip $rel" skip "no time left"
    else
      t0=$SECONDS
      run_step "round trip $rel" "$t" env PYTHONPATH="$path" GPU_CHECK_FAULT="$fault" \
        "$rpy" scripts/gpu_check.py --url "tcp://127.0.0.1:$port" --release "$rel" \
        --out "$OUT/results-$rel.json" --request-timeout "$req_timeout" \
        --side-timeout "$side_timeout" --deadline $(($(date +%s) + t - 10)) "${rt_flags[@]}"
      rc=$?
      sides=$(grep '^gpu_check: ' "$work/step.log" | sed 's/^gpu_check: //' | cut -c1-70 | paste -sd ';' -)
      case $rc in
        0) record "round trip $rel" ok "byte-exact on every side that ran: $sides" $((SECONDS - t0)) ;;
        3) record "round trip $rel" FAIL "gpu_check.py found no GPU" $((SECONDS - t0)) ;;
        *) record "round trip $rel" FAIL "$(rc_detail "$rc" "$t"): $sides" $((SECONDS - t0)) ;;
      esac
      kill -0 "${server_pid[$rel]}" 2>/dev/null || record "server $rel" FAIL "died during the round trip"
    fi

    # -- restart: a registration of each mode round-trips, the server is SIGKILLed and
    # started again by the same script, both round-trip again (bits compared) through
    # the same Registration objects, which re-register themselves.
    t=$(left 60)
    if ((gpu == 0)) && [ "$dry" != 1 ]; then
      record "restart $rel" skip "the server is not in GPU mode"
    elif ((t < 30)); then
      record "restart $rel" skip "no time left"
    elif ! kill -0 "${server_pid[$rel]}" 2>/dev/null; then
      record "restart $rel" skip "the server is not running"
    else
      t0=$SECONDS
      run_step "restart $rel" "$t" env PYTHONPATH="$path" "$rpy" scripts/gpu_check.py \
        --url "tcp://127.0.0.1:$port" --release "$rel" --out "$OUT/results-$rel.json" \
        --request-timeout "$req_timeout" --restart-check --server-pid-file "$work/server-$rel.pid" \
        --server-start-script "$start_script" "${rt_flags[@]}"
      rc=$?
      server_pid[$rel]=$(cat "$work/server-$rel.pid")
      line=$(grep '^gpu_check restart: ' "$work/step.log" | tail -1 | sed 's/^gpu_check restart: //' | cut -c1-200)
      ready=$(grep -o 'restarted server ready after [0-9]* s (pid [0-9]*)' "$work/step.log" | head -1)
      if ((rc == 0)); then record "restart $rel" ok "$line; $ready" $((SECONDS - t0))
      else record "restart $rel" FAIL "$(rc_detail "$rc" "$t"): $line; $ready" $((SECONDS - t0)); fi
    fi
  fi

  # -- doctor (also when the server failed: it reports what this machine can do)
  t=$(left 30)
  if ((t < 5)); then
    record "doctor $rel" skip "no time left"
  else
    t0=$SECONDS
    run_step "doctor $rel" "$t" env PYTHONPATH="$path:$repo" "$rpy" -c \
      "import sys; from lmcache_mp.cli.doctor import main_doctor; sys.exit(main_doctor('tcp://127.0.0.1:$port', 10.0))"
    rc=$?
    forms=$(grep -o 'CUDA wrapper forms.*' "$work/step.log" | tr -s ' ' | cut -c1-160)
    server=$(grep -o '\] server .*' "$work/step.log" | cut -c3-160)
    if ((rc == 0)); then record "doctor $rel" ok "${forms:-see run.log}" $((SECONDS - t0))
    else record "doctor $rel" FAIL "$(rc_detail "$rc" "$t"): ${server:-see run.log}" $((SECONDS - t0)); fi
  fi

  # -- stop
  if [ -n "${server_pid[$rel]:-}" ]; then
    stop_server "$rel"
    errors=$(tail -c +"$log_from" "$slog" | grep -c "LMCache ERROR")
    # lmcache_mp's family detection sends one op id the release lacks (by design).
    # 0.5.6+: id 11 (retired) and the FREE_LOOKUP_LOCKS key form of the other release.
    probes=$(tail -c +"$log_from" "$slog" | grep -c "No handler registered for request type\|Available handlers:\|Invalid ZMQ operation identifier\|Error handling operation free_lookup_locks")
    record "stop $rel" ok "$errors ERROR lines in servers.log for $rel ($probes from lmcache_mp's protocol-detection probe)"
  fi
  port=$((port + 1))
done

# ------------------------------------------------- device-only script steps
device_step() {  # name wanted-seconds dry-run-reason summary-prefix command...
  # A script that needs the device: skipped in a dry run or when no time is left; its
  # exit status 0 / 3 / other is recorded as ok / skip (the device lacks the feature) /
  # FAIL, with the script's summary line as the detail: its last line starting with
  # "PREFIX: " (without the prefix), or its last line when the prefix is empty.
  local name=$1 want=$2 dry_reason=$3 prefix=$4 t t0 rc line
  shift 4
  if [ "$dry" = 1 ]; then
    record "$name" skip "dry run: $dry_reason"
    return
  fi
  t=$(left "$want")
  if ((t < 10)); then
    record "$name" skip "no time left"
    return
  fi
  t0=$SECONDS
  run_step "$name" "$t" "$@"
  rc=$?
  if [ -n "$prefix" ]; then
    line=$(grep "^$prefix: " "$work/step.log" | tail -1 | sed "s/^$prefix: //" | cut -c1-200)
  else
    line=$(tail -1 "$work/step.log")
  fi
  case $rc in
    0) record "$name" ok "$line" $((SECONDS - t0)) ;;
    3) record "$name" skip "$line" $((SECONDS - t0)) ;;
    *) record "$name" FAIL "$(rc_detail "$rc" "$t"): $line" $((SECONDS - t0)) ;;
  esac
}

# cuMemCreate memory exported as a POSIX fd (scripts/gpu_vmm_check.py): the fd names
# the memory (imported and read back here, as LMCache's receiver would map it).
device_step "vmm export" 60 "needs a GPU (cuMemCreate)" "" \
  env PYTHONPATH="$site/common:$repo" "$py" scripts/gpu_vmm_check.py

# Issue 38 item 4: the caller's cost of an interprocess event per transfer against one
# per step (CudaKVCache.one_event), on the real driver (scripts/gpu_step_events.py).
device_step "step events" 30 "needs a GPU (interprocess events)" gpu_step_events \
  env PYTHONPATH="$site/common:$repo" "$py" scripts/gpu_step_events.py --json "$OUT/step_events.json"

# ------------------------------------------------------------------ tests
if [ "${GPU_CHECK_SKIP_PYTEST:-0}" = 1 ]; then
  record pytest skip "GPU_CHECK_SKIP_PYTEST=1"
elif ! "$test_py" -c 'import pytest' 2>/dev/null; then
  record pytest skip "pytest is not installed for $test_py"
else
  t=$(left 150)
  if ((t < 20)); then
    record pytest skip "no time left"
  else
    t0=$SECONDS
    # The device's own cuda-bindings; live tests need the oracle venvs, absent there.
    run_step pytest "$t" env PYTHONPATH="$site/common:$repo" LMCACHE_MP_SKIP_LIVE=1 \
      "$test_py" -m pytest -q -rs -p no:cacheprovider tests/ipc/test_gpu_live.py \
      tests/ipc/test_cuda_events.py tests/ipc/test_cuda_exporter.py tests/ipc/test_cuda_vmm.py \
      tests/ipc/test_cuda_engine_driven.py tests/ipc/test_cuda_gather.py \
      tests/cli/test_doctor_box.py
    rc=$?
    line=$(grep -E "passed|failed|error" "$work/step.log" | tail -1)
    if ((rc == 0)); then record pytest ok "$line" $((SECONDS - t0))
    else record pytest FAIL "$(rc_detail "$rc" "$t"): $line" $((SECONDS - t0)); fi
  fi
fi
