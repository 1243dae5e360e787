#!/usr/bin/env python3
"""Data-plane throughput: STORE and RETRIEVE of one 4096-token key, in both transfer
modes, lmcache_mp vs LMCache 0.5.3's own worker client, against the same real CPU
server, in one run.

Runs in the oracle venv (it imports LMCache's client for comparison, see
benchmarks/_lmcache_side.py; lmcache_mp itself never does):

    scripts/lmcache-server.sh python -- benchmarks/data_plane.py [--url URL] [--rounds 5] [--json out.json]

Without --url it starts (and stops) its own server with ``--supported-transfer-mode
auto``; a server given by --url needs that flag too (engine-driven ops).

* lmcache_driven: REGISTER_KV_CACHE of SHM-backed layers; the server copies the blocks
  itself on STORE / RETRIEVE. Ours: ``Registration.store`` / ``.retrieve`` of a
  ``CpuKVCache`` registered with ``mode="lmcache"``. LMCache:
  ``LMCacheDrivenTransferContext.submit_*().result()``.
* engine_driven: the worker copies between its paged cache and the server's L1 pool
  (PREPARE_* / copy / COMMIT_*). Ours: the same calls with ``mode="engine"``.
  LMCache: ``EngineDrivenTransferContext.submit_*().result()``.

Each client has its own KV cache, model name and instance id (so each really copies),
the same geometry and HND layout, the same source blocks and the same target blocks.
Every STORE is of fresh random tokens (a new key: a STORE of cached chunks copies
nothing); its chunks are then looked up until all are visible (the last, fully-hit
LOOKUP + WAIT_PREFETCH_STATUS is reported as the lookup latency) and retrieved into
other blocks. Only the blocking STORE / RETRIEVE call is timed (keys are built before).
The cache is cleared before each mode of each round, so the 1 GiB L1 never evicts.
The warm-up round and the last round zero the target blocks first and check
afterwards that they hold the source blocks' bytes, for both clients.

GB/s = KV bytes of the key (tokens x layers x 2 x heads x head_dim x itemsize) / seconds
of the call. Rounds alternate which client goes first; medians over rounds are reported,
and ratios (ours / LMCache, higher is better) are the headline: the machines are noisy.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from lmcache_mp import CacheKey, Client, CpuKVCache, Registration  # noqa: E402
from lmcache_mp.ipc.cpu_cache import STORAGE_DTYPES  # noqa: E402
from lmcache_mp.ipc.shm import NAME_PREFIX, SHM_DIR  # noqa: E402

MODES = ("lmcache_driven", "engine_driven")
CLIENTS = ("ours", "lmcache")
OPS = ("store", "retrieve")
TIMEOUT = 30.0


def our_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{NAME_PREFIX}{os.getpid()}_")}


class OurSide:
    """A CpuKVCache registered with lmcache_mp in one transfer mode: its Registration
    carries the mode, instance and model, so store / retrieve are the same calls."""

    def __init__(self, client: Client, mode: str, *, num_layers: int, num_blocks: int,
                 num_heads: int, block_size: int, head_dim: int, dtype: str,
                 instance_id: int, model_name: str) -> None:
        self.client, self.mode = client, mode
        self.chunk_size = client.chunk_size()
        self.kv = CpuKVCache.allocate(num_layers=num_layers, num_blocks=num_blocks,
                                      block_size=block_size, num_heads=num_heads,
                                      head_dim=head_dim, dtype=dtype)
        try:
            self.reg: Registration | None = client.register(
                self.kv, model_name=model_name, instance_id=instance_id,
                mode="lmcache" if mode == "lmcache_driven" else "engine")
        except BaseException:
            self.kv.close()
            raise
        self.model_name = model_name

    def fill(self, block_ids: Sequence[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        ids = np.asarray(block_ids)
        for layer in self.kv.layers:
            raw = layer.view(np.uint8)
            raw[:, ids] = rng.integers(0, 256, raw[:, ids].shape, dtype=np.uint8)

    def zero(self, block_ids: Sequence[int]) -> None:
        ids = np.asarray(block_ids)
        for layer in self.kv.layers:
            layer[:, ids] = 0

    def same_bytes(self, a: Sequence[int], b: Sequence[int]) -> bool:
        ia, ib = np.asarray(a), np.asarray(b)
        return all(layer[:, ia].tobytes() == layer[:, ib].tobytes() for layer in self.kv.layers)

    def key(self, tokens: Sequence[int], rid: str, worker_id: int | None = 0) -> CacheKey:
        return CacheKey(model_name=self.model_name, world_size=1, worker_id=worker_id,
                        token_ids=tokens, start=0, end=len(tokens), request_id=rid)

    def store(self, key: CacheKey, block_ids: list[int]) -> float:
        assert self.reg is not None
        start = time.perf_counter()
        ok = self.reg.store(key, block_ids, timeout=TIMEOUT)
        elapsed = time.perf_counter() - start
        if not ok:
            raise RuntimeError(f"lmcache_mp {self.mode} store failed")
        return elapsed

    def retrieve(self, key: CacheKey, block_ids: list[int]) -> float:
        assert self.reg is not None
        start = time.perf_counter()
        ok = self.reg.retrieve(key, block_ids, timeout=TIMEOUT)
        elapsed = time.perf_counter() - start
        if not ok:
            raise RuntimeError(f"lmcache_mp {self.mode} retrieve failed")
        return elapsed

    def lookup(self, key: CacheKey) -> tuple[int, float]:
        start = time.perf_counter()
        hits = self.client.lookup(key, timeout=TIMEOUT)
        return hits, time.perf_counter() - start

    def free_locks(self, key: CacheKey, hits: int) -> None:
        self.client.free_lookup_locks(key.with_range(0, hits * self.chunk_size))

    def end_session(self, rid: str) -> None:
        self.client.end_session(rid)

    def close(self) -> None:
        try:
            if self.reg is not None:
                reg, self.reg = self.reg, None
                reg.unregister()
        finally:
            self.kv.close()


def wait_visible(side: Any, key: Any, want: int, deadline_s: float = 10.0) -> tuple[float, int]:
    """Look up until all ``want`` chunks hit (a STORE's chunks become visible shortly
    after its reply); release partial hits. Returns the last lookup's seconds and the
    number of lookups. The final lookup's read locks stay for the RETRIEVE."""
    deadline = time.monotonic() + deadline_s
    polls = 0
    while True:
        hits, secs = side.lookup(key)
        polls += 1
        if hits >= want:
            return secs, polls
        if hits:
            side.free_locks(key, hits)
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {hits}/{want} chunks visible after {deadline_s} s")
        time.sleep(0.002)


def start_server() -> tuple[int, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([str(REPO / "scripts/lmcache-server.sh"), "start", "--port", str(port), "--",
                    "--supported-transfer-mode", "auto"], check=True, stdout=subprocess.DEVNULL)
    return port, f"tcp://127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an already running server (with --supported-transfer-mode auto)")
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds (after one warm-up round)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shuffle-blocks", action="store_true",
                    help="scattered block ids (default: two contiguous runs)")
    ap.add_argument("--json", help="write results here too")
    args = ap.parse_args()

    # Imported here so --help works anywhere; needs the oracle venv. LMCache logs every
    # registration step (and every engine-driven copy's format detection) at INFO.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import _lmcache_side as theirs

    port = None
    url = args.url
    if url is None:
        port, url = start_server()
    ours_client: Client | None = None
    conn = None
    sides: dict[tuple[str, str], Any] = {}
    open_rids: dict[tuple[str, str], set[str]] = {}
    status = 0
    try:
        ours_client = Client(url, timeout=TIMEOUT)
        conn = theirs.LMCacheConnection(url)
        chunk = ours_client.chunk_size()
        if conn.chunk_size() != chunk:
            raise RuntimeError("the two clients disagree on the chunk size")
        if args.tokens % chunk or chunk % args.block_size:
            raise SystemExit(f"--tokens must be a multiple of the chunk size {chunk}, "
                             f"which must be a multiple of --block-size")
        want_chunks = args.tokens // chunk
        per_key = args.tokens // args.block_size
        num_blocks = 2 * per_key
        ids = np.arange(num_blocks)
        if args.shuffle_blocks:
            ids = np.random.default_rng(7).permutation(num_blocks)
        src, dst = [int(b) for b in ids[:per_key]], [int(b) for b in ids[per_key:]]
        itemsize = STORAGE_DTYPES[args.dtype][1]
        key_bytes = args.tokens * args.layers * 2 * args.heads * args.head_dim * itemsize
        geometry = dict(tokens=args.tokens, layers=args.layers, heads=args.heads,
                        head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype,
                        layout="HND", chunk_size=chunk, chunks=want_chunks,
                        blocks_per_key=per_key, block_order="shuffled" if args.shuffle_blocks
                        else "contiguous", bytes_per_key=key_bytes)

        rng = np.random.default_rng()
        tag = uuid.uuid4().hex[:8]
        dims = dict(num_layers=args.layers, num_blocks=num_blocks, num_heads=args.heads,
                    block_size=args.block_size, head_dim=args.head_dim, dtype=args.dtype)
        for mode in MODES:
            for who in CLIENTS:
                iid = int(rng.integers(1, 2**62))
                model = f"dp-{who}-{mode}-{tag}"
                if who == "ours":
                    side: Any = OurSide(ours_client, mode, instance_id=iid, model_name=model, **dims)
                else:
                    side = theirs.LMCacheSide(conn, mode, chunk_size=chunk, instance_id=iid,
                                              model_name=model, **dims)
                sides[(mode, who)] = side
                open_rids[(mode, who)] = set()
                side.fill(src, seed=hash((mode, who)) & 0xFFFF)

        samples: dict[str, list[float]] = {}
        polls: dict[str, list[int]] = {}
        total = args.rounds + 1
        t_begin = time.perf_counter()
        for r in range(total):
            warmup, verify = r == 0, r in (0, total - 1)
            order = CLIENTS if r % 2 == 0 else CLIENTS[::-1]
            for mode in MODES:
                ours_client.clear(timeout=TIMEOUT)
                for who in order:
                    side = sides[(mode, who)]
                    tokens = rng.integers(0, 2**31, args.tokens).tolist()
                    rid = f"dp-{uuid.uuid4().hex}"
                    open_rids[(mode, who)].add(rid)
                    store_key = side.key(tokens, rid)
                    lookup_key = side.key(tokens, rid, worker_id=None)
                    retrieve_key = side.key(tokens, rid)
                    t_store = side.store(store_key, src)
                    t_lookup, n_polls = wait_visible(side, lookup_key, want_chunks)
                    if verify:
                        side.zero(dst)
                    t_retrieve = side.retrieve(retrieve_key, dst)
                    if verify and not side.same_bytes(src, dst):
                        raise RuntimeError(f"{who} {mode}: retrieved bytes differ from the stored ones")
                    side.end_session(rid)
                    open_rids[(mode, who)].discard(rid)
                    if warmup:
                        continue
                    for op, secs in (("store", t_store), ("retrieve", t_retrieve)):
                        samples.setdefault(f"{mode}.{op}.{who}", []).append(key_bytes / secs / 1e9)
                    samples.setdefault(f"{mode}.lookup_ms.{who}", []).append(t_lookup * 1e3)
                    polls.setdefault(f"{mode}.{who}", []).append(n_polls)
        elapsed = time.perf_counter() - t_begin

        med = {k: statistics.median(v) for k, v in samples.items()}
        ratios = {f"{mode}.{op}": med[f"{mode}.{op}.ours"] / med[f"{mode}.{op}.lmcache"]
                  for mode in MODES for op in OPS}
        # The median of per-round ratios (same round, same machine state): a check on
        # the ratio of medians above.
        paired = {f"{mode}.{op}": statistics.median(
            a / b for a, b in zip(samples[f"{mode}.{op}.ours"], samples[f"{mode}.{op}.lmcache"],
                                  strict=True)) for mode in MODES for op in OPS}
        print(f"server {url}, {args.rounds} alternating rounds (+1 warm-up), medians "
              f"(cpu count {os.cpu_count()}, {elapsed:.1f} s)")
        print(f"geometry: {args.layers} layers x {args.heads} heads x {args.head_dim} head_dim, "
              f"{args.dtype}, block_size {args.block_size}, HND, {geometry['block_order']} blocks; "
              f"{args.tokens} tokens = {want_chunks} chunks of {chunk}; "
              f"{key_bytes / 2**20:.1f} MiB per key")
        print(f"  {'mode':<15} {'op':<9} {'ours GB/s':>10} {'LMCache GB/s':>13} {'ours/LMCache':>13}")
        for mode in MODES:
            for op in OPS:
                print(f"  {mode:<15} {op:<9} {med[f'{mode}.{op}.ours']:>10.2f} "
                      f"{med[f'{mode}.{op}.lmcache']:>13.2f} {ratios[f'{mode}.{op}']:>12.2f}x")
        print("  lookup of the stored key (LOOKUP + WAIT_PREFETCH_STATUS, all chunks hit), ms:")
        for mode in MODES:
            print(f"  {mode:<15} {'lookup':<9} {med[f'{mode}.lookup_ms.ours']:>10.2f} "
                  f"{med[f'{mode}.lookup_ms.lmcache']:>13.2f}   (lower is better)")
        print("  bytes checked equal after RETRIEVE (warm-up and last round), both clients, both modes")
        if args.json:
            Path(args.json).write_text(json.dumps({
                "url": url, "rounds": args.rounds, "geometry": geometry, "medians": med,
                "ratios": ratios, "paired_ratios": paired, "samples": samples, "lookup_polls": polls,
                "elapsed_s": elapsed}, indent=1))
    finally:
        for (mode, who), side in sides.items():
            for rid in open_rids.get((mode, who), ()):
                try:
                    side.end_session(rid)
                except Exception as exc:  # keep cleaning up
                    print(f"end_session({rid}) failed: {exc}", file=sys.stderr)
            try:
                side.close()
            except Exception as exc:
                print(f"closing {who} {mode} failed: {exc}", file=sys.stderr)
                status = 1
        if ours_client is not None:
            ours_client.close()
        if conn is not None:
            conn.close()
        if port is not None:
            subprocess.run([str(REPO / "scripts/lmcache-server.sh"), "stop", "--port", str(port)],
                           check=False, stdout=subprocess.DEVNULL)
        left = sorted(our_segments() | theirs.lmcache_kv_segments())
        if left:
            print(f"SHM segments left behind: {left}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
