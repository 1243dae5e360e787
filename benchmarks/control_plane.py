#!/usr/bin/env python3
"""Control-plane latency and pipelined throughput: lmcache_mp vs LMCache's own client
vs a bare pyzmq DEALER, against the same real server, in one run.

Runs in the oracle venv (it imports LMCache's client for comparison; lmcache_mp itself
never does):

    scripts/lmcache-server.sh python -- benchmarks/control_plane.py [--url URL] [--rounds 7]

Without --url it starts (and stops) its own server. Rounds alternate between the
clients so machine noise hits all of them alike; medians over rounds are reported,
and ratios are the headline (these machines are noisy).

The heartbeat's cost is measured in the same rounds: NOOP latency of a client holding
a registration with the default 10 s heartbeat, and with a 50 ms one (200x the
default rate, so that PINGs contend with the caller's requests in every round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import zmq  # noqa: E402

from lmcache_mp import CacheKey, Client, CpuKVCache  # noqa: E402

NOOP, LOOKUP, WAIT = 24, 8, 10


def lmcache_client(url: str):  # type: ignore[no-untyped-def]
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.mq import MessageQueueClient
    from lmcache.v1.multiprocess.protocol import get_response_class
    from lmcache.v1.multiprocess.protocols.base import RequestType

    ctx = zmq.Context()
    mq = MessageQueueClient(url, ctx)

    def call(rt, payloads):  # type: ignore[no-untyped-def]
        return mq.submit_request(rt, payloads, get_response_class(rt)).result(timeout=10)

    def noop():  # type: ignore[no-untyped-def]
        return call(RequestType.NOOP, [])

    def noop_async():  # type: ignore[no-untyped-def]
        return mq.submit_request(RequestType.NOOP, [], get_response_class(RequestType.NOOP))

    def lookup(tokens, request_id):  # type: ignore[no-untyped-def]
        key = IPCCacheServerKey("bench", 1, None, tuple(tokens), 0, len(tokens), request_id)
        call(RequestType.LOOKUP, [key, 1])
        return call(RequestType.WAIT_PREFETCH_STATUS, [request_id, 5.0])

    def close():  # type: ignore[no-untyped-def]
        mq.close()
        ctx.term()

    return noop, noop_async, lookup, close


def bare_dealer(url: str):  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    counter = iter(range(1 << 62))
    noop_frame = msgspec.msgpack.encode(NOOP)

    def noop():  # type: ignore[no-untyped-def]
        sock.send_multipart([msgspec.msgpack.encode(next(counter)), noop_frame])
        return sock.recv_multipart()

    def close():  # type: ignore[no-untyped-def]
        sock.close(0)
        ctx.term()

    return noop, close


def per_call_us(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def cpu_per_call_us(fn: Callable[[], object], n: int) -> float:
    """This process's CPU time (every thread: ours' I/O, zmq's) per call, in us: what
    a call costs the engine that makes it, whatever the server's latency."""
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


def import_ms(python: str, runs: int, root: Path = REPO) -> tuple[float, float]:
    """Median wall time of ``import lmcache_mp`` (from the checkout ``root``) in a fresh
    interpreter, minus that of the bare interpreter (same python, same flags), and the
    bare time, in ms.

    Measured as an installed wheel runs: with bytecode. A shell that sets
    PYTHONDONTWRITEBYTECODE (these machines' does) would otherwise have every import
    compile our modules (and msgspec's, zmq's) from source, about twice the time."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

    def median_ms(code: str) -> float:
        subprocess.run([python, "-c", code], check=True, cwd=root, env=env)  # bytecode
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run([python, "-c", code], check=True, cwd=root, env=env)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    bare = median_ms("pass")
    return median_ms("import lmcache_mp") - bare, bare


# Client CPU per NOOP over a bare DEALER's, in a process of its own, so that another
# checkout's lmcache_mp (--baseline-root) is measured the same way in the same run.
CPU_RATIO_SNIPPET = """
import json, statistics, sys, time
import msgspec, zmq
from lmcache_mp import Client
url, n = sys.argv[1], int(sys.argv[2])
c = Client(url, timeout=10)
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(url)
nf = msgspec.msgpack.encode(24); uids = iter(range(1 << 62))
def bare():
    s.send_multipart([msgspec.msgpack.encode(next(uids)), nf]); s.recv_multipart()
def cpu(fn):
    t = time.process_time()
    for _ in range(n):
        fn()
    return time.process_time() - t
for _ in range(200):
    bare(); c.noop()
print(json.dumps(statistics.median(cpu(c.noop) / cpu(bare) for _ in range(5))))
c.close(); s.close(0); ctx.term()
"""


def cpu_ratio_in(python: str, root: Path, url: str, n: int) -> float:
    out = subprocess.run([python, "-c", CPU_RATIO_SNIPPET, url, str(n)], check=True,
                         cwd=root, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1]))


def p50_us(fn: Callable[[], object], n: int) -> float:
    """The median of ``n`` single-call latencies (each call timed on its own)."""
    clock = time.perf_counter_ns
    times = []
    for _ in range(n):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) / 1e3


def pipelined_rps(submit: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    futures = [submit() for _ in range(n)]
    for f in futures:
        f.result()  # type: ignore[attr-defined]
    return n / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--pipeline", type=int, default=2000)
    ap.add_argument("--json", help="write results here too")
    ap.add_argument("--python", default=str(REPO / ".venv/bin/python"),
                    help="the interpreter import time is measured with (ours: .venv)")
    ap.add_argument("--baseline-root", type=Path,
                    help="another checkout (e.g. a git worktree of an older commit): its "
                         "import time and CPU per NOOP are measured in the same rounds")
    ap.add_argument("--cpu-guard", type=float, default=1.15,
                    help="exit 1 when our CPU per NOOP exceeds this times a bare DEALER's")
    ap.add_argument("--import-guard-ms", type=float, default=100.0,
                    help="exit 1 when import lmcache_mp takes longer (median, ms)")
    args = ap.parse_args()
    python = args.python if Path(args.python).exists() else sys.executable

    port = None
    url = args.url
    if url is None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        subprocess.run([str(REPO / "scripts/lmcache-server.sh"), "start", "--port", str(port)],
                       check=True, stdout=subprocess.DEVNULL)
        url = f"tcp://127.0.0.1:{port}"
    try:
        ours = Client(url, timeout=10)
        # Clients that hold a registration, so their heartbeat thread runs.
        kv = CpuKVCache.allocate(num_layers=1, num_blocks=16, block_size=16, num_heads=1,
                                 head_dim=16, dtype="float16")
        ours_hb = Client(url, timeout=10)
        ours_fast_hb = Client(url, timeout=10, heartbeat_interval=0.05)
        regs = [c.register(kv, model_name=f"bench-hb-{i}", mode="lmcache")
                for i, c in enumerate((ours_hb, ours_fast_hb))]
        lm_noop, lm_noop_async, lm_lookup, lm_close = lmcache_client(url)
        bare_noop, bare_close = bare_dealer(url)
        tokens = list(range(4096))

        def our_lookup() -> None:
            rid = uuid.uuid4().hex
            ours.lookup(CacheKey(model_name="bench", world_size=1, worker_id=None,
                                 token_ids=tokens, start=0, end=len(tokens), request_id=rid))

        def their_lookup() -> None:
            lm_lookup(tokens, uuid.uuid4().hex)

        # warm up (connections, JIT-free but caches)
        for fn in (ours.noop, ours_hb.noop, ours_fast_hb.noop, lm_noop, bare_noop, our_lookup,
                   their_lookup):
            for _ in range(50):
                fn()

        results: dict[str, list[float]] = {k: [] for k in (
            "noop_us.bare", "noop_us.ours", "noop_cpu_us.bare", "noop_cpu_us.ours",
            "import_ms.ours", "noop_us.ours_registered_hb10s",
            "noop_us.ours_registered_hb50ms", "noop_us.lmcache",
            "noop_p50_us.ours", "noop_p50_us.ours_registered_hb10s",
            "noop_p50_us.ours_registered_hb50ms",
            "lookup4096_us.ours", "lookup4096_us.lmcache",
            "pipelined_rps.ours", "pipelined_rps.lmcache")}
        for _ in range(args.rounds):
            results["noop_us.bare"].append(per_call_us(bare_noop, args.calls))
            results["noop_us.ours"].append(per_call_us(ours.noop, args.calls))
            results["noop_cpu_us.bare"].append(cpu_per_call_us(bare_noop, args.calls))
            results["noop_cpu_us.ours"].append(cpu_per_call_us(ours.noop, args.calls))
            results["import_ms.ours"].append(import_ms(python, 3)[0])
            if args.baseline_root:
                for name, root in (("baseline", args.baseline_root), ("current", REPO)):
                    results.setdefault(f"import_ms.{name}", []).append(
                        import_ms(python, 3, root)[0])
                    results.setdefault(f"noop_cpu_ratio.{name}", []).append(
                        cpu_ratio_in(python, root, url, args.calls))
            results["noop_us.ours_registered_hb10s"].append(per_call_us(ours_hb.noop, args.calls))
            results["noop_us.ours_registered_hb50ms"].append(
                per_call_us(ours_fast_hb.noop, args.calls))
            for name, c in (("ours", ours), ("ours_registered_hb10s", ours_hb),
                            ("ours_registered_hb50ms", ours_fast_hb)):
                results[f"noop_p50_us.{name}"].append(p50_us(c.noop, args.calls))
            results["noop_us.lmcache"].append(per_call_us(lm_noop, args.calls))
            results["lookup4096_us.ours"].append(per_call_us(our_lookup, args.calls // 4))
            results["lookup4096_us.lmcache"].append(per_call_us(their_lookup, args.calls // 4))
            results["pipelined_rps.ours"].append(pipelined_rps(ours.noop_async, args.pipeline))
            results["pipelined_rps.lmcache"].append(pipelined_rps(lm_noop_async, args.pipeline))
        med = {k: statistics.median(v) for k, v in results.items()}
        ratios = {
            "noop ours/bare (latency, lower is better)": med["noop_us.ours"] / med["noop_us.bare"],
            "noop ours/bare (client CPU per call)":
                med["noop_cpu_us.ours"] / med["noop_cpu_us.bare"],
            "noop ours/lmcache (latency)": med["noop_us.ours"] / med["noop_us.lmcache"],
            "noop p50 with a registration, 10 s heartbeat / none":
                med["noop_p50_us.ours_registered_hb10s"] / med["noop_p50_us.ours"],
            "noop p50 with a registration, 50 ms heartbeat / none":
                med["noop_p50_us.ours_registered_hb50ms"] / med["noop_p50_us.ours"],
            "lookup4096 ours/lmcache (latency)": med["lookup4096_us.ours"] / med["lookup4096_us.lmcache"],
            "pipelined ours/lmcache (throughput, higher is better)":
                med["pipelined_rps.ours"] / med["pipelined_rps.lmcache"],
        }
        if args.baseline_root:
            for name in ("baseline", "current"):
                ratios[f"noop client CPU / bare, {name} (own process)"] = \
                    med[f"noop_cpu_ratio.{name}"]
            ratios["import time current / baseline"] = \
                med["import_ms.current"] / med["import_ms.baseline"]
        print(f"server {url}, {args.rounds} alternating rounds, medians "
              f"(cpu count {os.cpu_count()}):")
        for k, v in med.items():
            print(f"  {k:<24} {v:>12,.1f}")
        print("ratios:")
        for k, v in ratios.items():
            print(f"  {k:<55} {v:.2f}x")
        if args.json:
            Path(args.json).write_text(json.dumps({"medians": med, "ratios": ratios,
                                                   "rounds": results}, indent=1))
        cpu_ratio = ratios["noop ours/bare (client CPU per call)"]
        guards = [(cpu_ratio <= args.cpu_guard,
                   f"client CPU per NOOP {cpu_ratio:.2f}x a bare DEALER's (guard "
                   f"{args.cpu_guard:.2f}x)"),
                  (med["import_ms.ours"] <= args.import_guard_ms,
                   f"import lmcache_mp {med['import_ms.ours']:.0f} ms (guard "
                   f"{args.import_guard_ms:.0f} ms, {python})")]
        for ok, what in guards:
            print(f"guard {'ok  ' if ok else 'FAIL'} {what}")
        for reg in regs:
            reg.unregister(unlink=False)
        kv.close()
        ours_hb.close()
        ours_fast_hb.close()
        ours.close()
        lm_close()
        bare_close()
    finally:
        if port is not None:
            subprocess.run([str(REPO / "scripts/lmcache-server.sh"), "stop", "--port", str(port)],
                           check=False, stdout=subprocess.DEVNULL)
    return 0 if all(ok for ok, _ in guards) else 1


if __name__ == "__main__":
    sys.exit(main())
