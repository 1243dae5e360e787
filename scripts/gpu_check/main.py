"""The run: every side in turn, each on a thread of its own that is abandoned (recorded
as hung, with the step it hung in) after --side-timeout or at --deadline; the results
written after every side and on SIGTERM; nothing freed until the run is over."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from .flow import SideRun, _call_with_timeout, run_side, side_label, unlink_own_segments, warm_up
from .plan import (
    GPU_ONLY_SIDES,
    MIN_SIDE_SECONDS,
    REPO,
    Layout,
    faults,
    l1_gib,
    no_gpu_reason,
    parse_args,
    raw_wrapper_blocker,
)
from .report import Report
from .restart import restart_check
from .side_base import COPY_TIMES, close_shared, keep_pool, shared_client


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.l1_gib:
        print(l1_gib(args))
        return 0
    if not args.cpu_dry_run:
        reason = no_gpu_reason()
        if reason is not None:
            print(f"gpu_check: no GPU here ({reason}); nothing was run. "
                  f"Use --cpu-dry-run to exercise the script against a CPU server.",
                  file=sys.stderr)
            return 3
    sys.path.insert(0, str(REPO))
    import torch

    if args.restart_check:
        return restart_check(args)
    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cpu_dry_run": args.cpu_dry_run, "pid": os.getpid()}
    if not args.cpu_dry_run:
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        import cuda.bindings as cb

        env["cuda_bindings"] = cb.__version__
    except ImportError:
        pass
    report = Report(args, env)
    COPY_TIMES.install()

    def on_term(signum: int, frame: Any) -> None:
        report.state = f"interrupted by signal {signum} while running {report.running}"
        for r in report.results:
            if not r.get("ok") and not r.get("skipped") and r.get("error") is None:
                r.update(interrupted=True, error=f"cut short by signal {signum} at step "
                                                 f"{r.get('step')!r}")
        report.write()
        unlink_own_segments()
        print(f"gpu_check: {report.state}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    report.write()
    started = time.perf_counter()
    env["warm_up_error"] = _call_with_timeout(lambda: warm_up(args), 60.0)
    env["warm_up_s"] = time.perf_counter() - started
    # One mapping of the server's pool for every side of ours, page-locked now (timed)
    # rather than in the first engine-driven side's first transfers.
    pool: dict[str, Any] = {}
    env["pool_error"] = _call_with_timeout(lambda: pool.update(keep_pool(args)), 150.0)
    env["pool"] = pool
    report.write()
    layout = Layout(args.sizes, args.block_size, args.scattered)
    injected = faults()
    runs: list[SideRun] = []
    for i, name in enumerate(args.sides):
        left = args.deadline - time.time() if args.deadline else float("inf")
        if left < MIN_SIDE_SECONDS:
            report.results.append({"side": side_label(name), "ok": False,
                                   "skipped": f"no time left ({left:.0f} s)"})
            report.write()
            continue
        blocker = GPU_ONLY_SIDES.get(name) if args.cpu_dry_run else None
        if blocker:
            blocker = f"dry run: {blocker}"
        if name == "raw" and not args.cpu_dry_run:
            blocker = raw_wrapper_blocker(args.release)
        if blocker:
            report.results.append({"side": side_label(name), "ok": False, "skipped": blocker})
            print(f"gpu_check: {name}: skipped: {blocker}", flush=True)
            report.write()
            continue
        run = SideRun(name, publish=report.write)
        runs.append(run)
        report.running = name
        report.results.append(run.res)
        report.write()
        started = time.perf_counter()
        run.thread = threading.Thread(target=run_side, daemon=True,
                                      args=(run, args, layout, 1000 + i, injected.get(name)))
        run.thread.start()
        run.thread.join(max(1.0, min(args.side_timeout, left - 5)))
        run.res["wall_s"] = time.perf_counter() - started
        if run.thread.is_alive():
            run.res.update(ok=False, hung=True, error=(
                f"no result after {run.res['wall_s']:.0f} s: hung at step "
                f"{run.res['step']!r}; abandoned, its cache kept until the run ends"))
        status = "ok" if run.res["ok"] else f"FAILED: {run.res['error']}"
        print(f"gpu_check: {run.res['side']}: {status} ({run.res['wall_s']:.1f} s)", flush=True)
        if not run.res["ok"] and run.res.get("traceback"):
            print(run.res["traceback"], file=sys.stderr, flush=True)
        report.running = None
        if not run.thread.is_alive():  # the L1 holds one side's keys at a time (l1_gib)
            run.res["clear_error"] = _call_with_timeout(lambda: shared_client(args).clear(),
                                                        30.0)
        report.write()
    # Only now, every side done: free the caches and close the clients, never waiting
    # long on any of them (a hung side's objects are left alone).
    for run in runs:
        if run.side is not None and run.thread is not None and not run.thread.is_alive():
            err = _call_with_timeout(run.side.close, 10.0)
            if err:
                run.res["close_error"] = err
    env["close_shared_error"] = _call_with_timeout(close_shared, 20.0)
    report.state = "done"
    report.write()
    unlink_own_segments()
    doc = report.doc()
    print(f"\n{doc['title']}\n")
    print(doc["table"], flush=True)
    ran = [r for r in report.results if not r.get("skipped")]
    return 0 if ran and all(r["ok"] for r in ran) else 1
