#!/usr/bin/env python3
"""``lmcache-mp bench`` with LMCache's own client as one more contender, in the same
interleaved rounds. Runs in the oracle venv (it imports LMCache; lmcache_mp itself
never does):

    scripts/lmcache-server.sh python -- benchmarks/compare.py [--url URL] [--rounds 5]
        [--quick] [--json out.json] [--png out.png]

Without --url it starts (and stops) a 0.5.3 server with ``--supported-transfer-mode
auto`` (both transfer modes, and its default L1 pool for engine-driven copies).
LMCache's side is driven as vLLM's MP adapter drives it (benchmarks/_lmcache_side.py
for transfers, control_plane.py's MessageQueueClient calls for NOOP and LOOKUP).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from lmcache_mp.cli import bench  # noqa: E402


class LMCache(bench.Contender):
    """LMCache 0.5.3's worker client: one MessageQueueClient, transfer contexts as vLLM
    builds them (HND, the layout LMCache's CPU path uses)."""

    name = "lmcache"

    def __init__(self, url: str, cfg: bench.Config) -> None:
        import _lmcache_side as side
        from control_plane import lmcache_client

        self.side, self.cfg = side, cfg
        self.conn = side.LMCacheConnection(url)
        self.chunk = self.conn.chunk_size()
        self.noop, self.noop_async, self.lookup, self.close_cp = lmcache_client(url)
        self.sides: dict[tuple[str, bool], Any] = {}

    def _side(self, mode: str, tiny: bool) -> Any:
        if (mode, tiny) not in self.sides:
            c = self.cfg
            per = c.tokens // c.block_size
            s = self.side.LMCacheSide(
                self.conn, mode, num_layers=1 if tiny else c.layers, num_blocks=2 * per,
                num_heads=1 if tiny else c.heads, block_size=c.block_size,
                head_dim=8 if tiny else c.head_dim, dtype=c.dtype, chunk_size=self.chunk,
                instance_id=int.from_bytes(os.urandom(7), "big"),
                model_name=f"bench-lm-{uuid.uuid4().hex[:8]}")
            s.fill(range(per), seed=1)
            self.sides[(mode, tiny)] = s
        return self.sides[(mode, tiny)]

    def noop_us(self, n: int) -> bench.Sample:
        start = time.perf_counter()
        for _ in range(n):
            self.noop()
        return (time.perf_counter() - start) / n * 1e6

    def pipelined_krps(self, n: int) -> bench.Sample:
        start = time.perf_counter()
        futures = [self.noop_async() for _ in range(n)]
        for f in futures:
            f.result(timeout=30)
        return n / (time.perf_counter() - start) / 1e3

    def lookup_us(self, n: int) -> bench.Sample:
        toks = bench.tokens(self.cfg.tokens)
        rids = [uuid.uuid4().hex for _ in range(n)]
        start = time.perf_counter()
        for rid in rids:
            self.lookup(toks, rid)
        return (time.perf_counter() - start) / n * 1e6

    def _visible(self, s: Any, toks: list[int], rid: str) -> None:
        key = s.key(toks, rid, worker_id=None)
        bench.wait_visible(lambda: s.lookup(key)[0], len(toks) // self.chunk,
                           lambda h: s.free_locks(key, h))

    def request_cpu_us(self, op: str, k: int) -> bench.Sample:
        s = self._side("lmcache_driven", tiny=True)
        per = self.cfg.tokens // self.cfg.block_size
        src, dst = list(range(1, per + 1)), list(range(per, 2 * per))
        work = [(bench.tokens(self.cfg.tokens), uuid.uuid4().hex) for _ in range(k)]
        cpu = 0.0
        for toks, rid in work:
            key = s.key(toks, rid)
            t = time.process_time()
            s.store(key, src)
            if op == "store":
                cpu += time.process_time() - t
        for toks, rid in work:
            self._visible(s, toks, rid)
            key = s.key(toks, rid)
            t = time.process_time()
            s.retrieve(key, dst)
            if op == "retrieve":
                cpu += time.process_time() - t
            s.end_session(rid)
        return cpu / k * 1e6

    def transfer(self, mode: str, layout: str, verify: bool
                 ) -> tuple[bench.Sample, bench.Sample]:
        if layout != "HND":  # LMCache's CPU path: HND (0.5.3 / 0.5.4 servers force it)
            return None, None
        s = self._side("engine_driven" if mode == "engine" else "lmcache_driven", tiny=False)
        per = self.cfg.tokens // self.cfg.block_size
        src, dst = list(range(per)), list(range(per, 2 * per))
        toks, rid = bench.tokens(self.cfg.tokens), uuid.uuid4().hex
        if verify:
            s.zero(dst)
        t_store = s.store(s.key(toks, rid), src)
        self._visible(s, toks, rid)
        t_retrieve = s.retrieve(s.key(toks, rid), dst)
        s.end_session(rid)
        if verify and not s.same_bytes(src, dst):
            raise RuntimeError(f"LMCache {mode}: retrieved bytes differ from the stored ones")
        return self.cfg.key_bytes / t_store / 1e9, self.cfg.key_bytes / t_retrieve / 1e9

    def close(self) -> None:
        for s in self.sides.values():
            s.close()
        self.close_cp()
        self.conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--png")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    port = None
    url = args.url
    if url is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        subprocess.run([str(REPO / "scripts/lmcache-server.sh"), "start", "--port", str(port),
                        "--", "--supported-transfer-mode", "auto"], check=True,
                       stdout=subprocess.DEVNULL)
        url = f"tcp://127.0.0.1:{port}"
    try:
        return bench.main(url, rounds=args.rounds, quick=args.quick, json_path=args.json,
                          png_path=args.png, show_progress=not args.no_progress,
                          extra=lambda u, cfg: [LMCache(u, cfg)])
    finally:
        if port is not None:
            subprocess.run([str(REPO / "scripts/lmcache-server.sh"), "stop", "--port",
                            str(port)], check=False, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main())
