"""Helpers for live tests that move KV bytes through a real server."""

from __future__ import annotations

import os
import time

import numpy as np

from lmcache_mp import CpuKVCache, Registration, Request
from lmcache_mp.ipc.shm import NAME_PREFIX, SHM_DIR

# The deadline of a fixture's own calls (connect, probe, register): not what a test measures.
# A first call's connection and protocol probe took over 1 s on a 2-core box running
# make test beside a CPU-bound process.
SETUP_S = 30.0


#: Server arguments that offer both transfer modes (from 0.5.4 the default is
#: LMCache-driven only) and an L1 pool in shared memory (off unless named from 0.5.4).
def both_modes_args(tag: str) -> tuple[str, ...]:
    return ("--supported-transfer-mode", "auto", "--shm-name", f"lmcache_l1_pool_{tag}")


def our_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{NAME_PREFIX}{os.getpid()}_")}


def fill_random(kv: CpuKVCache, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for layer in kv.layers:
        raw = layer.view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)


def same_blocks(kv: CpuKVCache, src: list[int], dst: list[int]) -> bool:
    return all(kv.block_bytes(li, s) == kv.block_bytes(li, d)
               for li in range(kv.geometry.num_layers) for s, d in zip(src, dst, strict=True))


def round_trip(reg: Registration, tokens: list[int], src: list[int], dst: list[int],
               *, timeout: float = 10.0) -> None:
    """Store ``tokens`` from blocks ``src``, look them up (waiting out the server's
    asynchronous commit), retrieve into ``dst``; assert byte equality."""
    kv = reg.cache
    assert isinstance(kv, CpuKVCache)
    for layer in kv.layers:
        if kv.geometry.mla:
            layer[dst] = 0
        else:
            layer[:, dst] = 0
    with reg.request(tokens) as writer:
        assert writer.store(src, timeout=timeout) is True
    with lookup_all(reg, tokens, timeout=timeout) as reader:
        assert reader.retrieve(dst, timeout=timeout) is True
    assert same_blocks(kv, src, dst), "retrieved blocks differ from the stored ones"


def lookup_all(reg: Registration, tokens: list[int], *, timeout: float = 10.0,
               expect: int | None = None) -> Request:
    """An open Request whose lookup found ``expect`` tokens (default: every whole chunk),
    looking again until the server's asynchronous commit shows them."""
    want = len(tokens) - len(tokens) % reg.chunk_size if expect is None else expect
    deadline = time.monotonic() + timeout
    while True:
        reader = reg.request(tokens)
        found = reader.lookup(timeout=timeout)
        if found >= want or time.monotonic() > deadline:
            break
        reader.close()
        time.sleep(0.02)
    if found < want:
        reader.close()
        raise AssertionError(f"lookup found {found} of {want} tokens")
    return reader
