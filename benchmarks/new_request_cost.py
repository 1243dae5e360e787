#!/usr/bin/env python3
"""What the connector's scheduler side costs per new request (issue 38, item 3): the CPU
of ``SchedulerSide.on_new_request`` for vLLM's real ``Request`` objects, with eager
prefetch on (the lookup is sent, not waited for), against a real LMCache server, and a
cProfile of where it goes.

Runs in vLLM's venv (``make vllm-venv``), which has no lmcache_mp installed: the
checkout is put on the path. It starts and stops its own server:

    .venv-vllm/bin/python benchmarks/new_request_cost.py [--release 0.5.6] [--tokens 8192]

CPU is this thread's (``time.thread_time``), so a busy machine inflates it less than
the wall time, which is printed beside it. Stop 44's two runs, beside a loaded ``make
test`` (load average 3): 406 and 409 us of CPU per 8192-token request; CacheKey alone
costs 74 us of CPU (the strict conversion of 8192 token ids, 63 us); by cProfile (wall
clock, noisy under that load) the rest is the LOOKUP's submission, mostly pyzmq's
per-frame sends in one run and the conversions in the other.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SERVER = REPO / "scripts" / "lmcache-server.sh"

from lmcache_mp import Client  # noqa: E402
from lmcache_mp.integrations.vllm.config import ConnectorConfig  # noqa: E402
from lmcache_mp.integrations.vllm.scheduler import SchedulerSide  # noqa: E402


def requests(prefix: str, n: int, tokens: int, seed: int) -> list[object]:
    """``n`` vLLM requests of ``tokens`` random prompt tokens each, made by vLLM itself."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    rng = random.Random(seed)
    return [Request(f"{prefix}{i}", [rng.randrange(0, 2048) for _ in range(tokens)],
                    SamplingParams(max_tokens=8), None) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", default="0.5.6", help="the LMCache server's release (0.5.6)")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens per request (8192)")
    ap.add_argument("--requests", type=int, default=50, help="requests measured (50)")
    ap.add_argument("--top", type=int, default=25, help="cProfile lines shown (25)")
    args = ap.parse_args(argv)
    with socket.socket() as probe:  # a port the kernel says is free, for the server
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    subprocess.run([str(SERVER), "start", "--version", args.release, "--port", str(port), "--",
                    "--supported-transfer-mode", "auto", "--shm-name",
                    f"lmcache_l1_pool_nrc{os.getpid()}"], check=True, capture_output=True)
    url = f"tcp://127.0.0.1:{port}"
    try:
        with Client(url, timeout=10.0) as client:
            side = SchedulerSide(ConnectorConfig(server_urls=(url,), lookup_wait=0.0),
                                 {url: client}, model_name="new-request-cost", kv_world_size=1,
                                 block_size=32, start_health=False)
            for r in requests("warm", 10, args.tokens, 0):
                side.on_new_request(r)  # connection, protocol, first encodes
            plain = requests("plain", args.requests, args.tokens, 1)
            c0, w0 = time.thread_time(), time.perf_counter()
            for r in plain:
                side.on_new_request(r)
            cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
            profiled = requests("prof", args.requests, args.tokens, 2)
            prof = cProfile.Profile()
            prof.enable()
            for r in profiled:
                side.on_new_request(r)
            prof.disable()
    finally:
        subprocess.run([str(SERVER), "stop", "--port", str(port)], capture_output=True)
    n = args.requests
    print(f"on_new_request, {args.tokens} tokens, LMCache {args.release}, load average "
          f"{os.getloadavg()[0]:.2f}: {cpu / n * 1e6:.0f} us CPU, {wall / n * 1e6:.0f} us wall "
          f"per request ({n} requests)")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
