#!/usr/bin/env python3
"""Recovery after a server restart: SIGKILL a real LMCache server under a live
Registration, start it again on the same port, and time the first STORE on the same
Registration after the new server answers (no application action in between).

    .venv/bin/python benchmarks/recovery.py [--restarts 5] [--version 0.5.3] [--json out.json]

Runs in the project's own venv (it never imports lmcache); the server comes from the
oracle (scripts/lmcache-server.sh). For each transfer mode, ``--restarts`` times: kill,
start (the script returns once the new server answers GET_CHUNK_SIZE: that instant is
t0), then ``req.store()`` at once; reported: the store's completion minus t0 (the
client re-detects the protocol, re-asks the chunk size and re-registers inside it),
and the byte-exact check of a round trip after each restart.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from lmcache_mp import Client, CpuKVCache  # noqa: E402

SCRIPT = str(REPO / "scripts/lmcache-server.sh")


def start(port: int, version: str, args: list[str]) -> float:
    subprocess.run([SCRIPT, "start", "--version", version, "--port", str(port), "--", *args],
                   check=True, stdout=subprocess.DEVNULL)
    return time.monotonic()


def kill(port: int) -> None:
    pid = int((REPO / f".oracle/run/server-{port}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    subprocess.run([SCRIPT, "stop", "--port", str(port)], check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--version", default="0.5.3")
    ap.add_argument("--json")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server_args = ["--supported-transfer-mode", "auto", "--shm-name",
                   f"lmcache_l1_pool_bench{os.getpid()}"]
    results: dict[str, list[float]] = {}
    start(port, args.version, server_args)
    try:
        for mode in ("lmcache", "engine"):
            with Client(f"tcp://127.0.0.1:{port}", timeout=10.0) as client, \
                    CpuKVCache.allocate(num_layers=8, num_blocks=600, block_size=16,
                                        num_heads=8, head_dim=128, dtype="bfloat16") as kv, \
                    client.register(kv, model_name=f"recovery-{mode}", mode=mode) as reg:
                rng = np.random.default_rng(0)
                for layer in kv.layers:
                    layer[...] = rng.integers(0, 2**16, layer.shape, dtype=np.uint16)
                chunk = reg.chunk_size
                blocks = 4 * chunk // 16
                samples = []
                for i in range(args.restarts):
                    kill(port)
                    t0 = start(port, args.version, server_args)
                    tokens = rng.integers(0, 2**31, 4 * chunk).tolist()
                    with reg.request(tokens) as req:
                        ok = req.store(list(range(1, 1 + blocks)))
                    took = time.monotonic() - t0
                    if not ok:
                        raise SystemExit(f"{mode}: the store after restart {i} failed")
                    samples.append(took * 1e3)
                    # A byte-exact round trip on the same registration, after each restart.
                    for _ in range(200):
                        req = reg.request(tokens)
                        if req.lookup() == len(tokens):
                            break
                        req.close()
                        time.sleep(0.01)
                    with req:
                        dst = list(range(300, 300 + blocks))
                        assert req.retrieve(dst) is True
                    assert all(kv.block_bytes(li, a) == kv.block_bytes(li, b)
                               for li in range(8) for a, b in zip(range(1, 1 + blocks), dst,
                                                                   strict=True))
                results[mode] = samples
                print(f"{mode:<8} first STORE after the new server answered, ms: "
                      f"median {statistics.median(samples):.1f}, min {min(samples):.1f}, "
                      f"max {max(samples):.1f} over {len(samples)} restarts "
                      f"(reg.recoveries = {reg.recoveries}); round trips byte-exact")
    finally:
        subprocess.run([SCRIPT, "stop", "--port", str(port)], check=False,
                       stdout=subprocess.DEVNULL)
    if args.json:
        Path(args.json).write_text(json.dumps({"version": args.version, "ms": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
