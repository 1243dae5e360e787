"""Rehearse scripts/gpu_check.sh on CPU (GPU_CHECK_DRY_RUN=1) against real LMCache servers
from the oracle venvs, on every failure path we can provoke, and prove each time that
the summary (table, JSON) is written and nothing is left running or in /dev/shm.

A lent GPU machine gives one 10-minute call: a run that ends without its table is lost.
These tests take every branch of the script except the CUDA calls: a server that fails
to start, a hung round-trip side, a run killed by SIGTERM and by SIGKILL, a budget too
small for the plan. Not marked ``live``: they start their own servers once, whatever
release the live suite is pointed at.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
RELEASES = ("0.5.3", "0.5.6")
ORACLES = (*RELEASES, "0.5.7rc2")  # the quiet-server rehearsal runs the newest
MAX_OUT_FILES = 8  # what the device tool brings back from $OUT


def _oracle_python(version: str) -> str:
    proc = subprocess.run([str(REPO / "scripts" / "lmcache-server.sh"), "install", "--version",
                           version], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        pytest.skip(f"the LMCache {version} oracle venv is not available: {proc.stderr[-300:]}")
    return str(Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python")


@pytest.fixture(scope="module")
def oracle() -> dict[str, str]:
    if os.environ.get("LMCACHE_MP_SKIP_LIVE") == "1":
        pytest.skip("LMCACHE_MP_SKIP_LIVE=1: the rehearsal needs real LMCache servers")
    return {v: _oracle_python(v) for v in ORACLES}


def _free_base_port() -> int:
    """A port p with p and p + 1 free (one server per release)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base > 65000:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports")


class Run:
    def __init__(self, out: Path, proc: subprocess.Popen[str]) -> None:
        self.out, self.proc = out, proc
        self.stdout = ""

    def wait(self, timeout: float = 400) -> int:
        # A guard against a hang, not a speed check: the whole plan starts a server per
        # release and runs pytest, beside other test jobs on a 2-core machine.
        self.stdout, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode

    @property
    def summary(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.out / "summary.json").read_text())
        return data

    @property
    def text(self) -> str:
        return (self.out / "summary.txt").read_text()

    def step(self, name: str) -> dict[str, Any]:
        matches = [s for s in self.summary["steps"] if s["name"] == name]
        assert matches, f"no step {name!r} in {[s['name'] for s in self.summary['steps']]}"
        step: dict[str, Any] = matches[-1]
        return step

    def results(self, release: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.out / f"results-{release}.json").read_text())
        return data

    def server_pids(self) -> list[int]:
        log = (self.out / "run.log").read_text()
        return [int(p) for p in re.findall(r"ready after \d+ s \(pid (\d+)", log)]


@pytest.fixture
def launch(oracle: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    runs: list[Run] = []
    shm_before = set(os.listdir("/dev/shm"))

    def start(releases: tuple[str, ...] = RELEASES, **env: str) -> Run:
        out = tmp_path / f"out{len(runs)}"
        full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        full.update({
            "OUT": str(out), "TMPDIR": str(tmp_path), "GPU_CHECK_DRY_RUN": "1",
            "GPU_CHECK_SKIP_INSTALL": "1", "GPU_CHECK_RELEASES": " ".join(releases),
            "GPU_CHECK_PYTHON": oracle["0.5.3"], "GPU_CHECK_TEST_PYTHON": sys.executable,
            "GPU_CHECK_PORT": str(_free_base_port()), "GPU_CHECK_REQUEST_TIMEOUT": "10",
            "GPU_CHECK_SKIP_PYTEST": "1",
            # The sides these rehearsals assert on; every side runs in
            # test_quiet_server_logs_restart_and_l1_sizing.
            "GPU_CHECK_SIDES": "torch_ipc,raw,lmcache",
        })
        for v, python in oracle.items():
            full[f"GPU_CHECK_PYTHON_{v.replace('.', '_')}"] = python
        full.update(env)
        proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=REPO, env=full, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        run = Run(out, proc)
        runs.append(run)
        return run

    yield start
    for run in runs:  # whatever a test did, nothing of ours may survive it
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()
        for pid in run.server_pids() if (run.out / "run.log").exists() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    new = set(os.listdir("/dev/shm")) - shm_before
    ours = {n for n in new for run in runs if _made_by(n, run)}
    for name in ours:
        os.unlink(f"/dev/shm/{name}")
    assert not ours, f"the run left shared memory behind: {sorted(ours)}"


def _made_by(name: str, run: Run) -> bool:
    """Whether a /dev/shm name belongs to a process of this run (servers by pid, the
    round-trip processes by the pid they record)."""
    pids = set(run.server_pids())
    for rel in ORACLES:
        f = run.out / f"results-{rel}.json"
        if f.exists():
            doc = json.loads(f.read_text())
            pids.add(int(doc["env"]["pid"]))
            if "restart" in doc:  # the restart step's own process
                pids.add(int(doc["restart"]["pid"]))
    m = re.match(r"(?:lmcache_mp_|lmcache_kv_|lmcache_l1_pool_)(\d+)", name)
    return bool(m) and int(m.group(1)) in pids


def _assert_written_and_clean(run: Run) -> None:
    """What every run must leave, however it ended."""
    files = sorted(p.name for p in run.out.iterdir())
    assert "summary.txt" in files and "summary.json" in files, files
    assert len(files) <= MAX_OUT_FILES, files
    assert not [f for f in files if f.endswith(".tmp")], files
    assert run.text.startswith("=== gpu_check "), run.text[:200]
    for pid in run.server_pids():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert not Path(f"/dev/shm/lmcache_l1_pool_{pid}").exists()


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (OSError, ValueError, KeyError, AssertionError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


# ------------------------------------------------------------------- tests
@pytest.mark.timeout(600)  # every release's server and pytest, on a busy machine
def test_failed_server_and_hung_side_do_not_stop_the_plan(launch: Any) -> None:
    """0.5.3's server fails to start and a side hangs on 0.5.6: every later step still
    runs (0.5.3's doctor, 0.5.6's server, round trip, doctor, pytest), the hung side is
    abandoned with the step it hung in while the other sides finish, and the table and
    JSON say so."""
    # 20 s per side: on a loaded machine (make test runs jobs side by side) 4 s let the
    # hung side be abandoned before it even reached the step it hangs in.
    run = launch(GPU_CHECK_FAULT="server-start:0.5.3,hang:lmcache",
                 GPU_CHECK_SIDE_TIMEOUT="20", GPU_CHECK_SKIP_PYTEST="0")
    assert run.wait() == 1, run.stdout
    _assert_written_and_clean(run)
    summary = run.summary
    assert summary["state"] == "FINISHED" and summary["result"] == "FAILED"
    bad = run.step("server 0.5.3")
    assert bad["status"] == "FAIL" and "exited during start" in bad["detail"]
    assert "gpu-check-provoked-bad-flag" in bad["detail"]  # the server's own complaint
    assert run.step("doctor 0.5.3")["status"] == "FAIL"  # ran anyway, nobody answered
    assert run.step("server 0.5.6")["status"] == "ok"
    trip = run.step("round trip 0.5.6")
    assert trip["status"] == "FAIL" and "LMCache: FAILED: no result after" in trip["detail"]
    assert run.step("doctor 0.5.6")["status"] == "ok"
    assert run.step("stop 0.5.6")["status"] == "ok"
    assert run.step("vmm export") == {"name": "vmm export", "status": "skip", "seconds": None,
                                      "detail": "dry run: needs a GPU (cuMemCreate)"}
    assert run.step("pytest")["status"] == "ok"
    res = run.results("0.5.6")
    assert res["state"] == "done"
    sides = {r["side"]: r for r in res["results"]}
    assert sides["ours (torch_ipc)"]["ok"] and sides["ours (raw)"]["ok"]
    assert sides["LMCache"]["hung"] and "hung at step 'register'" in sides["LMCache"]["error"]
    assert re.search(r"\| round trip ok +\| yes +\| yes +\| HUNG +\|", run.text), run.text
    assert "result: FAILED" in run.text
    assert run.text in run.stdout  # printed at the end too, for the device's output tail


def _hung_in_register(run: Run, side: str) -> bool:
    """The side runs and has published that it reached 'register' (where the fault hangs):
    waiting for "running" alone raced the side's first step (CI stop 16)."""
    res = run.results("0.5.3")
    return bool(res["running"] == side and res["results"]
                and res["results"][-1].get("step") == "register")


def test_sigterm_mid_step_writes_the_summary_and_stops_everything(launch: Any) -> None:
    run = launch(releases=("0.5.3",), GPU_CHECK_FAULT="hang:raw", GPU_CHECK_SIDE_TIMEOUT="120")
    _wait_for(lambda: _hung_in_register(run, "raw"), 60, "the hung side")
    servers = run.server_pids()
    assert servers
    os.kill(run.proc.pid, signal.SIGTERM)  # the script only, as a polite killer would
    assert run.wait(timeout=60) == 143, run.stdout
    _assert_written_and_clean(run)
    summary = run.summary
    assert summary["state"] == "INTERRUPTED by SIGTERM"
    step = run.step("round trip 0.5.3")
    assert step["status"] == "FAIL" and "interrupted (SIGTERM)" in step["detail"]
    res = run.results("0.5.3")
    # gpu_check.py, stopped by timeout's SIGTERM, wrote its own last words too.
    assert res["state"].startswith("interrupted by signal 15 while running raw")
    assert res["results"][0]["ok"] and res["results"][0]["side"] == "ours (torch_ipc)"
    cut = res["results"][1]
    assert cut["interrupted"] and "cut short by signal 15 at step 'register'" in cut["error"]
    assert "INTERRUPTED by SIGTERM" in run.text
    assert re.search(r"\| round trip ok +\| yes +\| CUT +\|", run.text), run.text


def test_sigkill_leaves_the_last_written_summary(launch: Any) -> None:
    """SIGKILL (the device tool at its limit) runs no trap: what was written after the
    last finished step must already be a complete summary."""
    run = launch(releases=("0.5.3",), GPU_CHECK_FAULT="hang:lmcache", GPU_CHECK_SIDE_TIMEOUT="120")
    _wait_for(lambda: _hung_in_register(run, "lmcache"), 60, "the hung side")
    os.killpg(run.proc.pid, signal.SIGKILL)  # the whole group: script, server, round trip
    run.wait(timeout=30)
    summary = run.summary
    assert summary["state"].startswith("RUNNING (written after: mode 0.5.3)")
    assert summary["running"] == "round trip 0.5.3"
    assert [s["name"] for s in summary["steps"]][-2:] == ["server 0.5.3", "mode 0.5.3"]
    assert "round trip 0.5.3" in run.text and "running when this was written" in run.text
    res = run.results("0.5.3")
    assert [r["ok"] for r in res["results"]] == [True, True, False]  # written per side
    # The killed server left its L1 segment, the killed round trip the hung side's KV
    # segments (allocated before 'register'): removed here (the device is given back
    # anyway); the script cannot, having been SIGKILLed.
    for pid in run.server_pids():
        Path(f"/dev/shm/lmcache_l1_pool_{pid}").unlink(missing_ok=True)
    round_trip = int(res["env"]["pid"])
    # `timeout` puts the round trip in a process group of its own, out of the killpg's
    # reach: it would end by itself at its side timeout (120 s), not left to run on.
    try:
        os.kill(round_trip, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for name in os.listdir("/dev/shm"):
        if name.startswith((f"lmcache_kv_{round_trip}_", f"lmcache_mp_{round_trip}_")):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.timeout(400)
def test_quiet_server_logs_restart_and_l1_sizing(launch: Any) -> None:
    """An operator's LMCACHE_LOG_LEVEL=WARNING (no 'running on' line in the server's
    log: readiness was read from it and 3 of 5 rehearsals failed after 264 s): the
    server is known ready by asking it. The restart step SIGKILLs and restarts it,
    and a registration of each mode round-trips before and after, bits compared; the
    restarted server is stopped at the end too. The L1 is sized from the plan."""
    run = launch(releases=("0.5.7rc2",), LMCACHE_LOG_LEVEL="WARNING", GPU_CHECK_SIDES="")
    assert run.wait() == 0, run.stdout
    _assert_written_and_clean(run)
    assert run.step("server 0.5.7rc2")["status"] == "ok"
    assert re.search(r"l1 \d+ GiB", run.step("server 0.5.7rc2")["detail"])
    restart = run.step("restart 0.5.7rc2")
    assert restart["status"] == "ok", restart
    assert re.search(r"before lmcache yes \(\d+ tries\) engine yes \(\d+ tries\); "
                     r"after lmcache yes \(\d+ tries\) engine yes", restart["detail"]), restart
    res = run.results("0.5.7rc2")
    # Every side of the device run (LMCache's own client speaking 0.5.7rc2's
    # token_bytes keys), the GPU-only ones skipped saying why.
    sides = {r["side"]: r for r in res["results"]}
    assert len(sides) == 13 and sides["LMCache"]["ok"]
    assert {k for k, r in sides.items() if r.get("skipped")} == {
        "ours (engine_plan)", "ours (engine_expandable)"}
    assert all(r["ok"] for r in sides.values() if not r.get("skipped"))
    # MLA both ways; the engine-driven sides' copy phase and both floors (torch's
    # pinned buffer, a registered shared mapping) beside the end-to-end figures.
    assert sides["ours (MLA)"]["mode"] == "lmcache" and sides["ours (MLA, engine)"]["ok"]
    engine = sides["ours (engine-driven)"]
    assert set(engine["store_over_pinned"]) == set(engine["store_gbps"])
    for key in ("store_copy_gbps", "retrieve_copy_gbps", "memcpy_shm_d2h_gbps",
                "memcpy_shm_h2d_gbps"):
        assert set(engine[key]) == set(engine["store_gbps"]), key
    assert all(r.get("clear_error") is None for r in sides.values() if not r.get("skipped"))
    assert res["env"]["pool"]["pool_pin_s"] >= 0 and res["env"]["pool_error"] is None
    assert "store copy-only GB/s" in run.text and "H2D registered SHM GB/s" in run.text
    assert "by_cumulative" in sides["ours (torch_ipc)"]["profile"]
    again = res["restart"]
    assert again["ok"] and again["same_instance_ids"] and again["new_pid"] in run.server_pids()
    assert len(set(run.server_pids())) == 2  # the first server and the restarted one, both gone
    servers_log = (run.out / "servers.log").read_text()
    assert servers_log.count("===== server 0.5.7rc2 started") == 2


def test_a_budget_too_small_still_writes_a_table(launch: Any) -> None:
    run = launch(GPU_CHECK_BUDGET="24", GPU_CHECK_RESERVE="20", GPU_CHECK_SKIP_PYTEST="0")
    assert run.wait(timeout=60) == 1, run.stdout
    _assert_written_and_clean(run)
    summary = run.summary
    assert summary["state"] == "FINISHED" and summary["result"] == "INCOMPLETE"
    for rel in RELEASES:
        assert run.step(f"server {rel}") == {"name": f"server {rel}", "status": "skip",
                                             "seconds": None, "detail": "no time left"}
    assert run.step("pytest")["detail"] == "no time left"
    assert "result: INCOMPLETE" in run.text


def test_scripts_parse_and_gpu_check_py_refuses_without_a_gpu() -> None:
    for script in ("gpu_check.sh", "fetch_gpu_wheels.sh"):
        proc = subprocess.run(["bash", "-n", str(REPO / "scripts" / script)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present: gpu_check.py would really run")
    except ImportError:
        pass
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"),
                           "--url", "tcp://127.0.0.1:1"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "no GPU here" in proc.stderr and "nothing was run" in proc.stderr
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_vmm_check.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert json.loads(proc.stdout)["skipped"].startswith("no GPU")
