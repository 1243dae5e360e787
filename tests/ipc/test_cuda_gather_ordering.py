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

from lmcache_mp import CacheKey, Client
from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.ipc.base import KVGeometry
from lmcache_mp.ipc.cuda import CudaError, CudaKVCache, gather, staging
from lmcache_mp.session.engine_driven import copy_from_slots, copy_into_slots

from ..conftest import LiveServer
from ..support.fake_cuda import FakeDriver
from ..support.live_helpers import SETUP_S
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



# ------------------------------------------------- fresh memory from torch's cache
CURRENT = 0xC0  # torch's current stream (vLLM's forward stream), not the transfer's


def test_the_fake_allocator_is_no_kinder_than_torchs() -> None:
    """torch's caching allocator as the fake models it: a block an engine tensor freed
    on a stream (a kernel still queued on it) is the next allocation of that stream,
    not another's; work of another stream on it unordered is a race; a block freed
    with another stream's copy still on it is a race at the free (no record_stream)."""
    drv = FakeDriver()
    drv.torch_current_stream = CURRENT
    freed = drv.engine_temporary(1 << 16, STREAM_A)
    assert drv.alloc_buffer(1 << 16, 0) != freed  # torch's current stream: another pool
    with drv.torch_stream(STREAM_A, 0):
        again = drv.alloc_buffer(1 << 15, 0)  # smaller fits: the smallest free block
    assert again == freed
    host = drv.malloc_host(1 << 15)
    with pytest.raises(AssertionError, match="race: cudaMemcpy2DAsync on stream 0xb0"):
        drv.memcpy_2d_async(again, 1 << 15, host, 1 << 15, 1 << 15, 1, STREAM_B)
    drv.memcpy_2d_async(again, 1 << 15, host, 1 << 15, 1 << 15, 1, STREAM_A)  # ordered
    drv.stream_synchronize(STREAM_A)
    drv.memcpy_2d_async(host, 1 << 15, again, 1 << 15, 1 << 15, 1, STREAM_B)
    with pytest.raises(AssertionError, match="race: the reuse of a torch block"):
        drv.free_buffer(again)
    drv.run_queued()
    drv.races.clear()


@pytest.mark.parametrize("direction", ["store", "retrieve"])
@pytest.mark.parametrize("freed_on, transfer_on", [
    (CURRENT, CURRENT), (CURRENT, STREAM_A), (STREAM_A, STREAM_A)],
    ids=["freed-on-current-transfer-on-current", "freed-on-current-transfer-on-other",
         "freed-on-other-transfer-on-other"])
def test_fresh_staging_from_torchs_cache_is_ordered_after_its_last_user(
        direction: str, freed_on: int, transfer_on: int) -> None:
    """The engine dropped temporaries on ``freed_on`` (torch's cache holds their blocks,
    sized like the staging and block-id buffers, with the engine's kernels on them still
    queued) just before the first transfer of a cache, on ``transfer_on``. torch hands a
    block freed on a stream to the next allocation on that stream, safe only for work
    queued there later: the staging must be allocated for the transfer's stream, and the
    copy stream's first DMA into it (RETRIEVE) ordered after that stream's work. The bytes
    equal the plan's and no access is unordered. Before the fix (265a737; 1470964 had
    cudaMalloc staging, not torch's) the buffers came from torch's current stream: a
    RETRIEVE's first DMA wrote a block the engine's kernel still wrote (current /
    current), a transfer on another stream wrote blocks that kernel still wrote
    (current / other), and a transfer on another stream got fresh memory instead of
    its stream's block (other / other: no race there; with the buffers from the
    transfer's stream, that case guards the RETRIEVE's opening hand-over)."""
    g = bigger(GEOMETRIES["hnd"])
    drv, cache, raws = fake_cache(g, seed=61)
    drv.torch_current_stream = CURRENT
    ids = block_ids(g, 4, seed=62)
    obj = g.kv_planes * g.num_layers * CHUNK * g.hidden_dim * g.itemsize
    # What the first transfer asks torch for: staging of 4 objects, 4096 bytes of ids.
    drv.engine_temporary(4 * obj, freed_on)
    drv.engine_temporary(4096, freed_on)
    if direction == "store":
        want = expected_store(g, raws, ids, [0, 1, 2, 3])
        pool, slots, buf = pool_and_slots(g, 4)
        copy_into_slots(cache, ids, slots, [0, 1, 2, 3], pool, CHUNK, stream=transfer_on)  # type: ignore[arg-type]
        assert buf.tobytes() == want
    else:
        cache2, raws2 = plan_cache(g, [r.copy() for r in raws])
        pool2, slots2, _ = pool_and_slots(g, 4, seed=63)
        copy_from_slots(cache2, ids, slots2, pool2, CHUNK, 0, stream=1)  # type: ignore[arg-type]
        pool, slots, _ = pool_and_slots(g, 4, seed=63)
        copy_from_slots(cache, ids, slots, pool, CHUNK, 0, stream=transfer_on)  # type: ignore[arg-type]
        assert [r.tobytes() for r in raws] == [r.tobytes() for r in raws2]
    copier = cache.gather_copier()
    assert copier is not None and copier.staging_bytes == 4 * obj
    reused = [c[2] for c in drv.calls if c[0] == "alloc_buffer_cached"]
    assert reused == ([transfer_on, transfer_on] if freed_on == transfer_on else []), \
        "torch's cache served the buffers of the transfer's own stream only"
    assert not drv.races
    # Nothing of the transfer's is left running (the engine's kernels on another
    # stream may be: the transfer never waited for that stream).
    assert all(op.stream == freed_on != transfer_on for op in drv.streams.unfinished())


# ----------------------------------------------------------------- overlap
def four_rounds(direction: str, monkeypatch: pytest.MonkeyPatch, seed: int
                ) -> tuple[FakeDriver, CudaKVCache, bool]:
    """4 chunk objects through staging of 2 (two regions of one object: 4 rounds), the
    layers in one allocation (one gather or scatter per round); whether the bytes equal
    the plan's."""
    g = bigger(GEOMETRIES["nhd"])
    obj = g.kv_planes * g.num_layers * CHUNK * g.hidden_dim * g.itemsize
    monkeypatch.setattr(gather, "STAGING_LIMIT_BYTES", 2 * obj)
    drv, cache, raws = fake_cache(g, seed=seed, one_allocation=True)
    ids = block_ids(g, 4, seed=seed + 1)
    if direction == "store":
        want = expected_store(g, raws, ids, [0, 1, 2, 3])
        pool, slots, buf = pool_and_slots(g, 4)
        copy_into_slots(cache, ids, slots, [0, 1, 2, 3], pool, CHUNK, stream=STREAM_A)  # type: ignore[arg-type]
        return drv, cache, buf.tobytes() == want
    cache2, raws2 = plan_cache(g, [r.copy() for r in raws])
    pool2, slots2, _ = pool_and_slots(g, 4, seed=seed + 2)
    copy_from_slots(cache2, ids, slots2, pool2, CHUNK, 0, stream=1)  # type: ignore[arg-type]
    pool, slots, _ = pool_and_slots(g, 4, seed=seed + 2)
    copy_from_slots(cache, ids, slots, pool, CHUNK, 0, stream=STREAM_A)  # type: ignore[arg-type]
    return drv, cache, [r.tobytes() for r in raws] == [r.tobytes() for r in raws2]


@pytest.mark.parametrize("direction", ["store", "retrieve"])
def test_a_rounds_dma_overlaps_the_next_rounds_gpu_work(
        direction: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read off the fake's vector clocks (what each operation is ordered after): round
    r + 1's gather (STORE) is not ordered after round r's DMA, nor round r + 1's DMA
    (RETRIEVE) after round r's scatter, so they may run together; a region is reused
    only after round r - 2 is done with it, and each round's DMA and kernel are ordered
    by their hand-over. Before the fix (265a737) a wait right after each round held the
    next one too: every round after every DMA of the last (no overlap at all)."""
    drv, cache, same = four_rounds(direction, monkeypatch, seed=71)
    assert same and not drv.races
    copier = cache.gather_copier()
    assert copier is not None
    history = drv.streams.history
    kernels = [op for op in history if op.stream == STREAM_A and op.name.startswith("torch")]
    dmas = [op for op in history if op.stream == copier._copy_stream]
    assert len(kernels) == len(dmas) == 4
    after = drv.streams.ordered_after
    # (first of a round, second of it): STORE gathers then DMAs, RETRIEVE the reverse
    first, second = (kernels, dmas) if direction == "store" else (dmas, kernels)
    for r in range(4):
        assert after(second[r], first[r]), f"round {r}: its hand-over"
    for r in range(3):
        assert not after(first[r + 1], second[r]), f"round {r + 1} waits for round {r}"
    for r in range(2):
        assert after(first[r + 2], second[r]), f"round {r + 2} reuses round {r}'s region"


@pytest.mark.parametrize("direction", ["store", "retrieve"])
def test_without_the_reuse_waits_a_region_is_overwritten_in_flight(
        direction: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits that let round r + 2 reuse round r's region are needed: without them
    round 2's gather (STORE) overwrites region 0 while round 0's DMA still reads it, or
    round 2's DMA (RETRIEVE) while round 0's scatter still reads it: a race."""
    monkeypatch.setattr(gather.GatherCopier, "_await_reuse", lambda *a: None, raising=False)
    with pytest.raises(AssertionError, match="race"):
        four_rounds(direction, monkeypatch, seed=81)


# ----------------------------------------------------------- failed transfers
def fail_second_kernel(monkeypatch: pytest.MonkeyPatch, direction: str) -> None:
    """Round 2's gather (STORE) or scatter (RETRIEVE) raises as torch raises a CUDA
    error (torch.AcceleratorError is a RuntimeError), after round 1 was queued."""
    name = "_gather" if direction == "store" else "_scatter"
    real = getattr(gather.GatherCopier, name)
    calls = [0]

    def kernel(self: Any, index: Any, staged: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        real(self, index, staged)

    monkeypatch.setattr(gather.GatherCopier, name, kernel)


@pytest.mark.parametrize("direction", ["store", "retrieve"])
def test_a_failed_transfer_is_this_librarys_error_and_says_what_it_left(
        direction: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch error midway (round 2's kernel) reaches the caller as a TransferFailed
    (an LMCacheMPError: what the vLLM connector counts as a failed store or load,
    where a bare RuntimeError went through it), after the host waited for round 1's
    work, naming what the COMMIT then publishes (STORE: partly written slots).
    Before the fix (265a737): a bare RuntimeError."""
    g = bigger(GEOMETRIES["hnd"])
    drv, cache, _ = fake_cache(g, seed=91)
    ids = block_ids(g, 4, seed=92)
    pool, slots, _ = pool_and_slots(g, 4, seed=93)
    fail_second_kernel(monkeypatch, direction)
    with pytest.raises(LMCacheMPError) as err:
        if direction == "store":
            copy_into_slots(cache, ids, slots, [0, 1, 2, 3], pool, CHUNK, stream=STREAM_A)  # type: ignore[arg-type]
        else:
            copy_from_slots(cache, ids, slots, pool, CHUNK, 0, stream=STREAM_A)  # type: ignore[arg-type]
    assert isinstance(err.value, staging.TransferFailed), repr(err.value)
    assert "illegal memory access" in str(err.value)
    assert ("COMMIT_STORE" in str(err.value) and "partly written" in str(err.value)
            if direction == "store" else "not loaded" in str(err.value))
    assert isinstance(err.value.__cause__, RuntimeError)
    assert not drv.streams.unfinished() and not drv.races


@pytest.mark.live
def test_a_failed_store_fails_and_the_server_publishes_what_it_reserved(
        live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real server, a fake GPU cache storing two chunks whose second round's gather
    raises: Registration.store raises TransferFailed (the store failed, for the
    caller), after the COMMIT_STORE that releases the reservation; and the server
    then answers a LOOKUP of the key with both chunks: LMCache publishes reserved
    slots at COMMIT_STORE whatever they hold (no abort in its protocol), what
    docs/colocated.md says. Before the fix (265a737) a bare RuntimeError."""
    fail_second_kernel(monkeypatch, "store")
    drv = FakeDriver()
    # A set-up's deadline (bytes and errors checked here, not time): a process's first
    # gather copy pays torch's one-time start-up (test_cuda_engine_driven.py says how much).
    with Client(live_server.url, timeout=SETUP_S) as client:
        chunk = client.chunk_size()
        g = GEOMETRIES["hnd"]
        g = KVGeometry(g.num_layers, 2 * chunk // g.block_size + 2, g.block_size,
                       g.num_heads, g.head_dim, g.dtype, False)
        ptrs = [drv.add_alloc(g.layer_nbytes, "vmm") for _ in range(g.num_layers)]
        cache = CudaKVCache.from_pointers(
            ptrs, num_blocks=g.num_blocks, block_size=g.block_size, num_heads=g.num_heads,
            head_dim=g.head_dim, dtype=g.dtype, driver=drv)
        reg = client.register(cache, model_name=f"gpu-fail-{id(drv):x}", mode="engine")
        try:
            tokens = np.random.default_rng(94).integers(0, 2**31, 2 * chunk).tolist()
            key = CacheKey(model_name=reg.model_name, world_size=1, worker_id=0,
                           token_ids=tokens, start=0, end=2 * chunk, request_id="fail")
            with pytest.raises(staging.TransferFailed, match="publishes them as they are"):
                reg.store(key, list(range(1, 2 * chunk // g.block_size + 1)), stream=STREAM_A)
            assert not drv.streams.unfinished()
            assert reg.lookup(key) == 2 * chunk  # published, half of it never written
        finally:
            reg.unregister()
