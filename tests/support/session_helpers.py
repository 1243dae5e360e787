"""What the session tests (tests/session/) share: the chunk geometry of the scripted
server, token lists, CacheKeys, a filled CPU cache, slot contexts, a restart that waits for
the client to reconnect, and timing helpers with the slack a loaded machine needs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lmcache_mp import CacheKey, Client, CpuKVCache, Registration

from .fake_server import FakeServer
from .kv_reference import chunk_shape
from .polling import wait_until

CHUNK = 256  # the scripted server's chunk size (LMCache's default)
BS = 16  # tokens per block of kv_cache()
PER_CHUNK = CHUNK // BS
FAMILIES = ["0.5.3", "0.5.5", "0.5.6", "0.5.7"]
# A call resolves within its deadline plus SLACK; "at once" is under FAST. Both leave room
# for a loaded machine (make test runs pytest jobs side by side on 2 cores) and still
# tell "at once" from "at the deadline" (every deadline here is >= 0.3 s).
SLACK = 0.3
FAST = 0.2


def tokens(n_chunks: int = 2, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**31, n_chunks * CHUNK).tolist()


def key(reg: Registration, toks: list[int], start: int = 0, end: int | None = None,
        worker_id: int | None = None, salt: str = "") -> CacheKey:
    return CacheKey(model_name=reg.model_name, world_size=reg.world_size, worker_id=worker_id,
                    token_ids=toks, start=start, end=len(toks) if end is None else end,
                    request_id="rq", cache_salt=salt)


def kv_cache(*, mla: bool = False, dtype: str = "float16", num_blocks: int = 80,
             num_layers: int = 2) -> CpuKVCache:
    """A CPU cache of random bytes (a copy to the wrong place shows), blocks of BS tokens."""
    cache = CpuKVCache.allocate(num_layers=num_layers, num_blocks=num_blocks, block_size=BS,
                                num_heads=1 if mla else 2, head_dim=8, dtype=dtype, mla=mla)
    rng = np.random.default_rng(11)
    for layer in cache.layers:
        raw = layer.view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    return cache


def slot(cache: CpuKVCache, offset: int, **change: Any) -> dict[str, Any]:
    """One engine-driven slot context for a chunk of `cache`, as the server sends it."""
    g = cache.geometry
    shape = list(chunk_shape(g, CHUNK))
    length = int(np.prod(shape)) * cache.layers[0].dtype.itemsize
    return {"offset": offset, "length": length, "shape": shape, "dtype": g.dtype, **change}


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lmcache-mp-heartbeat"]


def restart(fake: FakeServer, client: Client) -> None:
    """Restart the fake and wait until the client has reconnected. A real restart takes
    seconds, so the client sees the connection drop long before the next request; a
    request sent in the moment between fails (in flight across a restart)."""
    epoch = client._conn.transport.epoch
    fake.restart()
    assert wait_until(lambda: client._conn.transport.refresh() > epoch)


def timed(call: Callable[[], object]) -> tuple[float, BaseException | None]:
    """How long `call` took, and what it raised (None if nothing)."""
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return time.monotonic() - start, exc
    return time.monotonic() - start, None


def elapsed(call: Callable[[], object]) -> float:
    """How long `call` took; what it raised is raised."""
    took, exc = timed(call)
    if exc is not None:
        raise exc
    return took
