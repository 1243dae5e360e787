"""What every side of the round trip is, and what the sides of this client share: one
lmcache_mp Client (one mapping of the server's pool, page-locked once for the run, not
once per side) and the timing of the engine-driven copy phase."""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .plan import Layout


class Side:
    """One client's way of moving KV: made, registered, STORE / LOOKUP / RETRIEVE."""

    name = "?"
    chunk = 256
    layers: list[Any]
    #: The block axis of ``layers``: 1 for [2, blocks, ...], 0 for vLLM's 4-D views.
    block_axis = 1
    #: A side with its own geometry sets these (else the run's).
    layout: Layout | None = None
    sizes: list[int] | None = None
    bytes_per_token: int | None = None

    def register(self) -> float: raise NotImplementedError
    def store(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool: ...
    def wait_visible(self, tokens: list[int], size: int, rid: str) -> int: ...
    def retrieve(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool: ...
    def unregister(self) -> None: ...
    def close(self) -> None: ...



def choose_copy_path(cache: Any, want: str | None) -> str:
    """Decide a CUDA cache's engine-driven copy path now (``want``: "plan" forces the
    copy plan, the path before issue 31) and say which it got."""
    if not hasattr(cache, "gather_copier"):
        return "cpu"
    before = os.environ.get("LMCACHE_MP_GPU_COPY")
    if want:
        os.environ["LMCACHE_MP_GPU_COPY"] = want
    try:
        cache.gather_copier()
    finally:
        if before is None:
            os.environ.pop("LMCACHE_MP_GPU_COPY", None)
        else:
            os.environ["LMCACHE_MP_GPU_COPY"] = before
    return str(cache.copy_path)


_shared: dict[str, Any] = {}
_shared_lock = threading.Lock()


def shared_client(args: argparse.Namespace) -> Any:
    """The lmcache_mp Client every side of ours uses (thread-safe): its registrations
    share one mapping of the server's pool, page-locked once (a 30 GiB L1 takes seconds)
    and kept mapped for the run by the keeper registration (:func:`keep_pool`)."""
    with _shared_lock:
        if "client" not in _shared:
            from lmcache_mp import Client

            _shared["client"] = Client(args.url, timeout=args.request_timeout)
        return _shared["client"]


def close_shared() -> None:
    with _shared_lock:
        keeper, client = _shared.pop("keeper", None), _shared.pop("client", None)
    if keeper is not None:
        reg, cache = keeper
        reg.unregister()
        cache.close()
    if client is not None:
        client.close()


def keep_pool(args: argparse.Namespace) -> dict[str, Any]:
    """An engine-driven registration of a small cache, kept until the run ends: the
    pool stays mapped (and page-locked) between the sides. One STORE through it starts
    the page-locking; the time until it finished is the run's ``pool_pin_s``."""
    from lmcache_mp import CacheKey

    client = shared_client(args)
    geometry = dict(num_layers=1, num_blocks=client.chunk_size() // args.block_size + 2,
                    block_size=args.block_size, num_heads=args.heads,
                    head_dim=args.head_dim, dtype="bfloat16")
    if args.cpu_dry_run:
        from lmcache_mp import CpuKVCache

        cache: Any = CpuKVCache.allocate(**geometry)
    else:
        from lmcache_mp.ipc.cuda import CudaKVCache

        cache = CudaKVCache.allocate(**geometry)
    reg = client.register(cache, model_name=f"gpu-check-keeper-{os.getpid()}", mode="engine",
                          timeout=args.register_timeout)
    _shared["keeper"] = (reg, cache)
    chunk = client.chunk_size()
    key = CacheKey(model_name=reg.model_name, world_size=1, worker_id=0,
                   token_ids=list(range(1, chunk + 1)), start=0, end=chunk,
                   request_id="gpu-check-keeper")
    t0 = time.perf_counter()
    reg.store(key, list(range(1, chunk // args.block_size + 1)))
    out: dict[str, Any] = {"pool_bytes": reg.pool_info.pool_size if reg.pool_info else None}
    if not args.cpu_dry_run:
        from lmcache_mp.ipc.cuda import staging

        while time.perf_counter() - t0 < 120 and len(staging.pinned_pools()) < 1:
            time.sleep(0.05)
        out["pool_pinned"] = staging.pinned_pools()
    out["pool_pin_s"] = time.perf_counter() - t0
    return out


class CopyTimes:
    """How long each engine-driven transfer's copy phase took (between PREPARE and
    COMMIT: lmcache_mp.session.registration's copy_into_slots / copy_from_slots), per
    thread: the copy alone, beside the end-to-end time with the two requests."""

    def __init__(self) -> None:
        self._local = threading.local()

    def install(self) -> None:
        from lmcache_mp.session import registration

        for name in ("copy_into_slots", "copy_from_slots"):
            setattr(registration, name, self._timed(getattr(registration, name)))

    def _timed(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self._local.last = time.perf_counter() - t0
        return timed

    def take(self) -> float | None:
        """The last copy phase of this thread, once."""
        last = getattr(self._local, "last", None)
        self._local.last = None
        return last


COPY_TIMES = CopyTimes()
