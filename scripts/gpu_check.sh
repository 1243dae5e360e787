#!/usr/bin/env bash
# One prepared run on a lent GPU machine (see ../shared/reference/gpu-device-notes.md):
# install the carried wheels, start the real LMCache 0.5.3 MP server in GPU mode, run
# the GPU round trip (scripts/gpu_check.py: ours vs LMCache's own client), the doctor and
# the live CUDA tests, stop the server, print one short table. Logs go to $OUT.
#
# Here, first:  scripts/fetch_gpu_wheels.sh         (fills the git-ignored .whl/)
# On the GPU:   device run, carry [".whl"], command "bash scripts/gpu_check.sh"
#
# Environment (all optional):
#   OUT                   where logs go (default /tmp/gpu_check_out)
#   GPU_CHECK_PYTHON      interpreter (default: /opt/torch/.venv/bin/python3, else python3)
#   GPU_CHECK_BUDGET      seconds for the whole run (default 450); steps are cut to fit
#   GPU_CHECK_PORT        server port (default 5555)
#   GPU_CHECK_SKIP_INSTALL=1  use the interpreter's own lmcache (no .whl/ install)
#   GPU_CHECK_DRY_RUN=1   a machine without a GPU: accept a CPU-mode server and run
#                         gpu_check.py --cpu-dry-run (checks this script, proves no CUDA)
#
# Exit status: 0 every round trip byte-exact, 1 something failed, 2 not set up.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
budget=${GPU_CHECK_BUDGET:-450}
port=${GPU_CHECK_PORT:-5555}
dry=${GPU_CHECK_DRY_RUN:-0}
py=${GPU_CHECK_PYTHON:-}
if [ -z "$py" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then py=/opt/torch/.venv/bin/python3; else py=python3; fi
fi
status=0
summary=()
server_pid=

log() { echo "[gpu_check $(printf '%4d' "$SECONDS")s] $*"; }
note() { summary+=("$1|$2"); log "$1: $2"; }
failed() { status=1; note "$1" "FAIL: $2"; }
left() {  # seconds left for a step: min(wanted, budget - elapsed - reserve)
  local want=$1 rest=$((budget - SECONDS - 20))
  [ "$rest" -lt "$want" ] && want=$rest
  [ "$want" -lt 5 ] && want=5
  echo "$want"
}

stop_server() {
  [ -n "$server_pid" ] || return 0
  if kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null
    for _ in $(seq 1 40); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
    # SIGKILL leaves the server's 1 GiB+ L1 segment behind: remove it by its pid.
    if kill -0 "$server_pid" 2>/dev/null; then
      kill -KILL "$server_pid" 2>/dev/null
      log "server did not stop on SIGTERM; killed"
    fi
  fi
  rm -f "/dev/shm/lmcache_l1_pool_$server_pid"
  server_pid=
}
trap stop_server EXIT

# Install wheels into a --target folder, without network or dependencies. Without pip in
# the interpreter, unzip them: none of the carried wheels has a .data folder or scripts,
# so that is the same thing for imports.
install_wheels() {  # target, wheels...
  local target=$1; shift
  if "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$target" "$@"
  else
    "$py" - "$target" "$@" <<'PYEOF'
import sys, zipfile
target, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
print(f"unzipped {len(wheels)} wheels into {target} (no pip here)")
PYEOF
  fi
}

# ------------------------------------------------------------ environment
{
  date -u; uname -a
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
  df -h /dev/shm
  "$py" -c 'import sys, torch, numpy; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("numpy", numpy.__version__)'
  "$py" -c 'import cupy; print("cupy", cupy.__version__)'
  "$py" -c 'import cuda.bindings as cb; from cuda.bindings import runtime as rt; print("cuda-bindings", cb.__version__, "reserved", hasattr(rt.cudaIpcMemHandle_t(), "reserved"))'
  "$py" -c 'import numba; print("numba", numba.__version__)'
  "$py" -c 'import pytest; print("pytest", pytest.__version__)'
} >"$OUT/env.txt" 2>&1
log "python: $py; environment in $OUT/env.txt"

# ------------------------------------------------------------------ wheels
site=/tmp/site
server_path=${PYTHONPATH:-}
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
  n=$(find .whl -maxdepth 1 -type f -name '*.whl' 2>/dev/null | wc -l)
  if [ "$n" -lt 9 ]; then
    log "FAIL: .whl/ holds $n wheels: run scripts/fetch_gpu_wheels.sh on a networked machine and carry .whl"
    exit 2
  fi
  if ! install_wheels "$site" .whl/*.whl >"$OUT/pip.txt" 2>&1; then
    cat "$OUT/pip.txt"; log "FAIL: installing the carried wheels"; exit 2
  fi
  server_path=$site${server_path:+:$server_path}
  note "wheels" "$n installed into $site"
fi
test_path=$server_path

# LMCache 0.5.3's RawCudaIPCWrapper.to_tensor assigns cudaIpcMemHandle_t.reserved, gone
# from cuda-bindings 13.4 on: give the server (and gpu_check.py, same environment) the
# carried 13.3.1 then. The pytest run keeps the device's own bindings, so our exporter
# is tested against them too.
cb_info=$(PYTHONPATH=$server_path "$py" -c 'import cuda.bindings as cb; from cuda.bindings import runtime as rt; print(cb.__version__, hasattr(rt.cudaIpcMemHandle_t(), "reserved"))' 2>&1 | tail -1)
note "cuda-bindings" "$cb_info"
if [[ "$cb_info" == *" False" ]]; then
  fallback=$(find .whl/extra -maxdepth 1 -name 'cuda_bindings-13.3.*.whl' 2>/dev/null | head -1)
  if [ -n "$fallback" ] && install_wheels /tmp/site_cb "$fallback" >>"$OUT/pip.txt" 2>&1; then
    server_path=/tmp/site_cb:$server_path
    cb_info=$(PYTHONPATH=$server_path "$py" -c 'import cuda.bindings as cb; from cuda.bindings import runtime as rt; print(cb.__version__, hasattr(rt.cudaIpcMemHandle_t(), "reserved"))' 2>&1 | tail -1)
    note "server cuda-bindings" "$cb_info (carried fallback for RawCudaIPCWrapper)"
  else
    note "server cuda-bindings" "no fallback carried: the raw wrapper side will be skipped"
  fi
fi
if ! PYTHONPATH=$test_path "$py" -c 'import pytest' 2>/dev/null; then
  if ls .whl/extra/pytest-*.whl >/dev/null 2>&1 && install_wheels /tmp/site_test \
      .whl/extra/pytest-*.whl .whl/extra/pluggy-*.whl .whl/extra/iniconfig-*.whl \
      .whl/extra/packaging-*.whl .whl/extra/pygments-*.whl >>"$OUT/pip.txt" 2>&1; then
    test_path=$test_path:/tmp/site_test
  fi
fi

# ------------------------------------------------------------------ server
shm_free_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
l1=2
[ "${shm_free_gb:-0}" -lt 4 ] && l1=1
log "starting the LMCache server on port $port (L1 ${l1} GiB; /dev/shm free ${shm_free_gb:-?} GiB)"
PYTHONPATH=$server_path LMCACHE_DISABLE_BANNER=1 LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 \
  OMP_NUM_THREADS=4 "$py" -m lmcache.v1.multiprocess.server --host 127.0.0.1 --port "$port" \
  --l1-size-gb "$l1" --eviction-policy LRU --disable-observability >"$OUT/server.log" 2>&1 &
server_pid=$!
ready=0
deadline=$((SECONDS + $(left 150)))
while [ "$SECONDS" -lt "$deadline" ]; do
  if grep -q "LMCache ZMQ cache server is running on" "$OUT/server.log"; then ready=1; break; fi
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.5
done
if [ "$ready" != 1 ]; then
  tail -30 "$OUT/server.log"
  log "FAIL: the server did not become ready (see $OUT/server.log)"
  exit 1
fi
note "server ready" "after $SECONDS s (pid $server_pid)"
if grep -q "torch_device_type=cuda" "$OUT/server.log"; then
  note "server mode" "GPU (torch_device_type=cuda)"
elif [ "$dry" = 1 ]; then
  note "server mode" "CPU (dry run)"
else
  grep -m3 "torch_device_type\|c_ops\|cuda" "$OUT/server.log"
  log "FAIL: the server started in CPU mode (no torch_device_type=cuda in its log): a failed import of lmcache.v1.platform.cuda is swallowed; see $OUT/server.log"
  exit 1
fi

# ---------------------------------------------------------------- round trip
log "round trip: ours vs LMCache's client"
dry_flag=()
[ "$dry" = 1 ] && dry_flag=(--cpu-dry-run --layers 2 --heads 2 --head-dim 64 --reps 2)
PYTHONPATH=$server_path timeout "$(left 240)" "$py" scripts/gpu_check.py \
  --url "tcp://127.0.0.1:$port" --register-timeout 60 --out "$OUT/gpu_check.json" \
  "${dry_flag[@]}" >"$OUT/gpu_check.log" 2>&1
rc=$?
cat "$OUT/gpu_check.log"
case $rc in
  0) note "round trip" "byte-exact on every side that ran" ;;
  3) failed "round trip" "gpu_check.py found no GPU" ;;
  124) failed "round trip" "timed out (see gpu_check.log, server.log)" ;;
  *) failed "round trip" "exit $rc (see gpu_check.log, server.log)" ;;
esac
kill -0 "$server_pid" 2>/dev/null || failed "server" "died during the round trip"

# ------------------------------------------------------------ doctor, tests
PYTHONPATH=$test_path:$repo timeout "$(left 60)" "$py" -c "import sys; from lmcache_mp.doctor import main_doctor; sys.exit(main_doctor('tcp://127.0.0.1:$port', 10.0))" >"$OUT/doctor.txt" 2>&1
rc=$?
cat "$OUT/doctor.txt"
[ "$rc" = 0 ] && note "doctor" "ok" || failed "doctor" "exit $rc"

if PYTHONPATH=$test_path "$py" -c 'import pytest' 2>/dev/null; then
  log "live CUDA tests (device's own cuda-bindings)"
  PYTHONPATH=$test_path:$repo timeout "$(left 180)" "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/test_gpu_live.py tests/test_cuda_exporter.py >"$OUT/pytest.log" 2>&1
  rc=$?
  tail -15 "$OUT/pytest.log"
  line=$(grep -E "passed|failed|error" "$OUT/pytest.log" | tail -1)
  [ "$rc" = 0 ] && note "pytest" "$line" || failed "pytest" "exit $rc: $line"
else
  note "pytest" "not run: pytest is not installed here and .whl/extra has none"
fi

# -------------------------------------------------------------------- end
c_ops=$(grep -o "multi_layer_block_kv_transfer mode: [a-z]*" "$OUT/server.log" | head -1)
note "server transfer" "${c_ops:-no transfer-mode line in the log}"
grep -q "c_ops compiled extension not found" "$OUT/server.log" && note "server c_ops" "NOT loaded (torch fallbacks)"
stop_server
errors=$(grep -c "Traceback\|LMCache ERROR" "$OUT/server.log")
note "server log" "$errors error lines (server.log)"

{
  echo
  echo "=== gpu_check summary ($SECONDS s) ==="
  [ -f "$OUT/gpu_check.log" ] && sed -n '/^|/p' "$OUT/gpu_check.log"
  echo
  for row in "${summary[@]}"; do printf '  %-22s %s\n' "${row%%|*}" "${row#*|}"; done
  echo "  result                 $([ "$status" = 0 ] && echo OK || echo FAILED)"
  echo "  logs                   $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
} | tee "$OUT/summary.txt"
exit "$status"
