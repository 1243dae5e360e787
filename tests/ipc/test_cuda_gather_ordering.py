"""The gather path's ordering and lifetime under CUDA's rules, through the fake driver's
stream model (tests/support/fake_streams.py: copies run as late as CUDA lets them, an
unordered access across streams or from the host is a race).

* Two threads, two streams, one cache: each transfer's bytes are its own (the staging
  buffer is never reused while another transfer's work on it is in flight).
* A DMA that raises midway: when the error reaches the COMMIT, nothing queued is still
  running (the host waited for it in a ``finally``).
* Sleep / wake: caches replaced 20 times leave the fake's device allocations, pinned
  buffers, streams and events where they were (a finalizer frees a dropped cache's
  staging; close() is idempotent).
* The fake is no kinder than CUDA: a hand-over event left out is reported as a race.
"""

from __future__ import annotations

import ctypes
import gc
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.ipc.base import KVGeometry
from lmcache_mp.ipc.cuda import CudaError, CudaKVCache, gather, staging
from lmcache_mp.session.engine_driven import copy_from_slots, copy_into_slots

from ..support.fake_cuda import FakeDriver
from .test_cuda_gather import (
    CHUNK,
    GEOMETRIES,
    block_ids,
    fake_cache,
    forget_pins,
    pool_and_slots,
)

torch = pytest.importorskip("torch")

STREAM_A, STREAM_B = 0xA0, 0xB0


@pytest.fixture(autouse=True)
def gather_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("LMCACHE_MP_GPU_COPY", "gather")
    forget_pins()
    yield
    forget_pins()


def bigger(g: KVGeometry, times: int = 3) -> KVGeometry:
    return KVGeometry(g.num_layers, times * g.num_blocks, g.block_size, g.num_heads,
                      g.head_dim, g.dtype, g.mla, g.layout, g.fused, g.block_stride)


def plan_cache(g: KVGeometry, raws: list[np.ndarray]) -> tuple[CudaKVCache, list[np.ndarray]]:
    """A fresh fake cache holding the bytes ``raws``, moving by the copy plan."""
    _, cache, fresh = fake_cache(g, seed=0)
    for f, r in zip(fresh, raws, strict=True):
        f[:] = r
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMCACHE_MP_GPU_COPY", "plan")
        assert cache.gather_copier() is None  # decided now, for good
    return cache, fresh


def expected_store(g: KVGeometry, raws: list[np.ndarray], ids: np.ndarray,
                   order: list[int]) -> bytes:
    """What the copy plan puts in the slots, from the same bytes."""
    cache, _ = plan_cache(g, raws)
    pool, slots, buf = pool_and_slots(g, len(order))
    copy_into_slots(cache, ids, slots, order, pool, CHUNK, stream=1)  # type: ignore[arg-type]
    return buf.tobytes()


class ContendedLock:
    """The copier's lock, saying when a thread had to wait for it."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self.contended = threading.Event()

    def __enter__(self) -> bool:
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@pytest.mark.parametrize("direction", ["store", "retrieve"])
@pytest.mark.parametrize("name", ["hnd", "blocks-first-nhd", "mla"])
def test_two_threads_on_two_streams_share_one_cache(name: str, direction: str) -> None:
    """Thread A's transfer on stream A has queued its work; before the host has waited
    for it, thread B starts a transfer of other blocks on stream B through the same
    cache. Each gets its own bytes: B waits for A's buffers (the lock is held until
    A's work is complete), never overwrites A's staging under A's DMAs. On 1470964 the
    lock was released before the wait: B's gather replaced A's staged bytes, and A's
    DMAs (run later, as on a GPU) copied B's blocks into A's slots."""
    g = bigger(GEOMETRIES[name])
    drv, cache, raws = fake_cache(g, seed=21)
    per = CHUNK // g.block_size
    ids = block_ids(g, 4, seed=22)
    ids_a, ids_b = ids[: 2 * per], ids[2 * per:]
    copier = cache.gather_copier()
    assert copier is not None
    lock = ContendedLock(copier._lock)
    copier._lock = lock  # type: ignore[assignment]
    done_b = threading.Event()
    errors: list[BaseException] = []
    retrieving = direction == "retrieve"  # pools holding objects to read back
    pool_a, slots_a, buf_a = pool_and_slots(g, 2, seed=23 if retrieving else None)
    pool_b, slots_b, buf_b = pool_and_slots(g, 2, seed=24 if retrieving else None)

    def transfer(ids: np.ndarray, pool: Any, slots: Any, stream: int) -> None:
        if direction == "store":
            copy_into_slots(cache, ids, slots, [1, 0], pool, CHUNK, stream=stream)
        else:
            copy_from_slots(cache, ids, slots, pool, CHUNK, 0, stream=stream)

    def thread_b() -> None:
        try:
            transfer(ids_b, pool_b, slots_b, STREAM_B)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            done_b.set()

    b = threading.Thread(target=thread_b)
    real_sync = drv.stream_synchronize

    def sync(stream: int) -> None:
        # A's first host wait: A's work is queued, not run. B goes now, and A waits
        # until B either finished or is held off by A's buffers.
        if stream == STREAM_A and not b.is_alive() and not done_b.is_set():
            b.start()
            deadline = threading.Event()
            while not (done_b.is_set() or lock.contended.is_set()):
                deadline.wait(0.01)
        real_sync(stream)

    drv.stream_synchronize = sync  # type: ignore[method-assign]
    if direction == "retrieve":
        before = [r.copy() for r in raws]
    transfer(ids_a, pool_a, slots_a, STREAM_A)
    b.join(timeout=60)
    assert not b.is_alive() and not errors, errors
    assert not drv.races, drv.races
    if direction == "store":
        assert buf_a.tobytes() == expected_store(g, raws, ids_a, [1, 0])
        assert buf_b.tobytes() == expected_store(g, raws, ids_b, [1, 0])
    else:
        # Both retrieves wrote their own blocks, from their own slots: as the plan
        # does both in turn from the same bytes.
        cache2, raws2 = plan_cache(g, before)
        for ids_x, seed in ((ids_a, 23), (ids_b, 24)):  # the same objects, in new pools
            pool_x, slots_x, _ = pool_and_slots(g, 2, seed=seed)
            copy_from_slots(cache2, ids_x, slots_x, pool_x, CHUNK, 0, stream=1)  # type: ignore[arg-type]
        assert [r.tobytes() for r in raws] == [r.tobytes() for r in raws2]
    assert lock.contended.is_set(), "B ran while A's work was in flight"
    assert not drv.streams.unfinished()


class DmaFails:
    """memcpy_2d_async that raises on the ``nth`` chunk-object copy (after earlier
    ones were queued), as cudaMemcpy2DAsync does on a bad argument or a sticky error."""

    def __init__(self, drv: FakeDriver, nth: int) -> None:
        self.real, self.nth, self.seen = drv.memcpy_2d_async, nth, 0
        self.drv = drv
        self.unfinished_at_raise = -1

    def __call__(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                 height: int, stream: int) -> None:
        if height > 1 or src not in self.drv.host_allocs:  # not the block-id copy
            self.seen += 1
            if self.seen == self.nth:
                self.unfinished_at_raise = len(self.drv.streams.unfinished())
                raise CudaError("cudaMemcpy2DAsync failed: cudaErrorInvalidValue (1)",
                                call="cudaMemcpy2DAsync", code=1)
        self.real(dst, dpitch, src, spitch, width, height, stream)


@pytest.mark.parametrize("path", ["gather", "plan"])
@pytest.mark.parametrize("direction", ["store", "retrieve"])
def test_a_dma_that_raises_midway_leaves_nothing_running(
        path: str, direction: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The third copy raises after two were queued: the error reaches the caller (who
    then sends the COMMIT that releases the server's slots) only once the queued work
    has completed, and the next transfer runs clean. On 1470964 the stream was
    synchronised on the success path only: the queued copies were still pending when
    the error (and the COMMIT) went out."""
    monkeypatch.setenv("LMCACHE_MP_GPU_COPY", path)
    g = bigger(GEOMETRIES["hnd"])
    drv, cache, _ = fake_cache(g, seed=31)
    ids = block_ids(g, 4, seed=32)
    pool, slots, _ = pool_and_slots(g, 4, seed=33)
    failing = DmaFails(drv, nth=3)
    drv.memcpy_2d_async = failing  # type: ignore[method-assign]
    with pytest.raises(CudaError, match="cudaMemcpy2DAsync"):
        if direction == "store":
            copy_into_slots(cache, ids, slots, [0, 1, 2, 3], pool, CHUNK, stream=STREAM_A)  # type: ignore[arg-type]
        else:
            copy_from_slots(cache, ids, slots, pool, CHUNK, 0, stream=STREAM_A)  # type: ignore[arg-type]
    assert failing.unfinished_at_raise > 0, "work was queued before the failing copy"
    assert not drv.streams.unfinished() and not drv.queued  # complete before the COMMIT
    for slot in slots:  # what the COMMIT hands to the server: no copy still on it
        drv.host_access("COMMIT", pool.view[slot.offset:slot.offset + slot.length],
                        write=True)
    drv.memcpy_2d_async = failing.real  # type: ignore[method-assign]
    copy_into_slots(cache, ids, slots, [0, 1, 2, 3], pool, CHUNK, stream=STREAM_A)  # type: ignore[arg-type]
    assert not drv.races


def test_the_fake_reports_a_missing_hand_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream model is not kinder than CUDA: without the events between the
    caller's stream and the copy stream, the first DMA would read a region its gather
    has not been ordered before, and the second gather into a region would overwrite
    what a DMA still reads: reported as a race."""
    g = bigger(GEOMETRIES["nhd"])
    drv, cache, _ = fake_cache(g, seed=41)
    ids = block_ids(g, 4, seed=42)
    pool, slots, _ = pool_and_slots(g, 4)
    monkeypatch.setattr(gather.GatherCopier, "_hand_over", lambda *a: None)
    with pytest.raises(AssertionError, match="race"):
        copy_into_slots(cache, ids, slots, [0, 1, 2, 3], pool, CHUNK, stream=STREAM_A)  # type: ignore[arg-type]
    assert drv.races and "cudaMemcpy2DAsync" in drv.races[0]


def test_the_fake_runs_a_copy_as_late_as_cuda_may() -> None:
    """A host write to memory a queued copy has still to read is seen by the copy (as
    on a GPU), and a host access of memory with unfinished work on it is a race."""
    drv = FakeDriver()
    dev = drv.malloc(64)
    host = drv.malloc_host(64)
    src = np.ctypeslib.as_array((ctypes.c_uint8 * 64).from_address(host))
    src[:] = 1
    drv.memcpy_2d_async(dev, 64, host, 64, 64, 1, STREAM_A)
    src[:] = 2  # too early: the copy has not run
    with pytest.raises(AssertionError, match="race"):
        drv.host_access("read back", drv._memory(dev, 64))
    drv.stream_synchronize(STREAM_A)
    assert set(drv._memory(dev, 64).tolist()) == {2}
    drv.free_host(host)


# ----------------------------------------------------------------- leaks
def sleep_wake_cycles(drv: FakeDriver, g: KVGeometry, ptrs: list[int], cycles: int,
                      close: bool) -> list[dict[str, int]]:
    """``cycles`` times: wrap the same memory in a new cache (vLLM woke up and the
    connector registers it again), move a transfer through it, replace it (closed, or
    dropped as the connector did before). The fake's live resources after each."""
    per = CHUNK // g.block_size
    ids = np.arange(2 * per, dtype=np.int64)
    seen = []
    for _ in range(cycles):
        cache = CudaKVCache.from_pointers(
            ptrs, num_blocks=g.num_blocks, block_size=g.block_size, num_heads=g.num_heads,
            head_dim=g.head_dim, dtype=g.dtype, mla=g.mla, layout=g.layout, driver=drv)
        pool, slots, _ = pool_and_slots(g, 2)
        copy_into_slots(cache, ids, slots, [0, 1], pool, CHUNK, stream=STREAM_A)  # type: ignore[arg-type]
        assert cache.copy_path.startswith("gather")
        staging.unpin(pool.view)  # as the pool's unmapping does
        if close:
            cache.close()
        del cache, pool
        gc.collect()
        seen.append(drv.live_resources())
    return seen


@pytest.mark.parametrize("close", [False, True], ids=["dropped", "closed"])
def test_twenty_sleep_wake_cycles_leak_nothing(close: bool) -> None:
    """20 replacements of the cache over the same memory: the fake's device
    allocations, pinned buffers, streams and events stay at zero after each (a
    dropped cache's finalizer frees its staging). On 1470964 every dropped cache kept
    its staging buffer (cudaMalloc, freed only by close())."""
    g = GEOMETRIES["hnd"]
    drv = FakeDriver()
    ptrs = [drv.add_alloc(g.layer_nbytes, "vmm") for _ in range(g.num_layers)]
    seen = sleep_wake_cycles(drv, g, ptrs, 20, close)
    assert seen == [{"device": 0, "host": 0, "streams": 0, "events": 0}] * 20
    assert not drv.races


def test_close_is_idempotent_and_a_closed_cache_refuses_transfers() -> None:
    g = GEOMETRIES["nhd"]
    drv, cache, _ = fake_cache(g, seed=51)
    pool, slots, _ = pool_and_slots(g, 2)
    ids = block_ids(g, 2, seed=52)
    copy_into_slots(cache, ids, slots, [0, 1], pool, CHUNK, stream=STREAM_A)  # type: ignore[arg-type]
    copier = cache.gather_copier()
    assert copier is not None
    cache.close()
    cache.close()
    copier.close()
    assert drv.live_resources() == {"device": 0, "host": 0, "streams": 0, "events": 0}
    with pytest.raises(LMCacheMPError, match="closed"):
        copy_into_slots(cache, ids, slots, [0, 1], pool, CHUNK, stream=STREAM_A)  # type: ignore[arg-type]

