"""Page-locking the server's pool for engine-driven GPU copies, off the caller's
thread: a large pool (a server's L1: GiBs, roughly 0.1-0.3 s per GiB to register) is
page-locked on a thread of its own, the copies meanwhile pageable (slower, never
wrong), so vLLM's forward thread never waits for ``cudaHostRegister``; after a server
restart the new pool starts being page-locked when the client maps it, before a copy
needs it. The fake driver's cudaHostRegister waits for a gate the test opens."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from lmcache_mp.ipc.cuda import staging
from lmcache_mp.ipc.shm import ShmSegment
from lmcache_mp.protocol.types import PoolSlot
from lmcache_mp.session.engine_driven import PoolMaps, copy_into_slots

from ..support.fake_cuda import FakeDriver
from .test_cuda_gather import CHUNK, GEOMETRIES, block_ids, fake_cache, object_shape

pytest.importorskip("torch")

STREAM = 0x5EED


@pytest.fixture(autouse=True)
def large_pools(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every pool counts as large (the tests' pools are MiBs, a server's GiBs)."""
    monkeypatch.setattr(staging, "PIN_WAIT_BYTES", 0, raising=False)  # (absent on 1470964)
    yield


def registered(drv: FakeDriver) -> dict[int, int]:
    """Host memory registered with cudaHostRegister (not the index buffers'
    cudaMallocHost)."""
    return {a: n for a, n in drv.pinned.items() if a not in drv.host_allocs}


def in_thread(fn: object, timeout: float = 30.0) -> float:
    """Run ``fn`` on a thread of its own, as a forward thread would; its wall time (it
    must return within ``timeout``: the old path waited for the pinning)."""
    took: list[float] = []
    errors: list[BaseException] = []

    def run() -> None:
        t0 = time.perf_counter()
        try:
            fn()  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)
        took.append(time.perf_counter() - t0)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the copy waited for cudaHostRegister"
    assert not errors, errors
    return took[0]


def test_the_first_copy_does_not_wait_for_the_pinning() -> None:
    """cudaHostRegister blocked (the gate closed): the first copy returns meanwhile,
    pageable; once the pinning finished, the next copy uses the page-locked pool (the
    fake refuses pageable memory again). On 1470964 the first copy page-locked the
    pool itself and waited for it."""
    g = GEOMETRIES["hnd"]
    drv, cache, _ = fake_cache(g, seed=61)
    seg = ShmSegment.create(8 << 20, tag="pintest")
    maps = PoolMaps()
    gate = drv.host_register_gate = threading.Event()
    try:
        pool = maps.acquire(seg.name, 8 << 20, 0)
        nbytes = int(np.prod(object_shape(g))) * g.itemsize
        slot = PoolSlot(offset=4096, length=nbytes, shape=object_shape(g), dtype=g.dtype)
        ids = block_ids(g, 1, seed=62)
        drv.allow_pageable = True  # while the pinning runs
        in_thread(lambda: copy_into_slots(cache, ids, [slot], [0], pool, CHUNK,  # type: ignore[arg-type]
                                          stream=STREAM))
        assert not registered(drv) and staging.pinned_pools() == {}  # still registering
        assert pool.view[4096:4096 + nbytes].any()  # the copy went through, pageable
        gate.set()
        pool.pinning["cuda"].done.wait(30)
        assert registered(drv) == {pool.view.ctypes.data: 8 << 20}
        drv.allow_pageable = False
        pool.view[:] = 0
        in_thread(lambda: copy_into_slots(cache, ids, [slot], [0], pool, CHUNK,  # type: ignore[arg-type]
                                          stream=STREAM))
        assert pool.view[4096:4096 + nbytes].any()
        maps.release(pool)
        assert not registered(drv)  # unregistered before the unmap
    finally:
        gate.set()
        maps.close()
        seg.close()


@contextmanager
def mapped_segments(n: int, nbytes: int) -> Iterator[tuple[PoolMaps, list[ShmSegment]]]:
    """A client's pool maps and ``n`` server segments (a server's, a restarted one's)."""
    segs = [ShmSegment.create(nbytes, tag="pinrestart") for _ in range(n)]
    maps = PoolMaps()
    try:
        yield maps, segs
    finally:
        maps.close()
        for seg in segs:
            seg.close()


def test_a_restarted_servers_pool_is_pinned_when_mapped() -> None:
    """The client maps a restarted server's new pool (another segment): its
    page-locking starts then, on its own thread, before any copy. On 1470964 it waited
    for the first copy into it (on the caller's thread)."""
    g = GEOMETRIES["nhd"]
    drv, cache, _ = fake_cache(g, seed=63)
    with mapped_segments(2, 4 << 20) as (maps, segs):
        first = maps.acquire(segs[0].name, 4 << 20, 0)
        nbytes = int(np.prod(object_shape(g))) * g.itemsize
        slot = PoolSlot(offset=0, length=nbytes, shape=object_shape(g), dtype=g.dtype)
        drv.allow_pageable = True
        copy_into_slots(cache, block_ids(g, 1, seed=64), [slot], [0], first, CHUNK,  # type: ignore[arg-type]
                        stream=STREAM)
        first.pinning["cuda"].done.wait(30)
        maps.release(first)  # the old server's pool goes
        second = maps.acquire(segs[1].name, 4 << 20, 1)  # the restarted one's is mapped
        assert "cuda" in second.pinning, "not being page-locked at map time"
        assert second.pinning["cuda"].done.wait(30)
        assert registered(drv) == {second.view.ctypes.data: 4 << 20}
        maps.release(second)
        assert not registered(drv)


def test_a_pool_reusing_an_address_starts_afresh() -> None:
    """A new mapping at the address of an old one (the kernel reuses addresses) is
    page-locked itself: the record belongs to the mapping, not to the address."""
    g = GEOMETRIES["mla"]
    drv, cache, _ = fake_cache(g, seed=65)
    with mapped_segments(1, 2 << 20) as (maps, segs):
        nbytes = int(np.prod(object_shape(g))) * g.itemsize
        slot = PoolSlot(offset=0, length=nbytes, shape=object_shape(g), dtype=g.dtype)
        for epoch in range(3):
            pool = maps.acquire(segs[0].name, 2 << 20, epoch)
            if "cuda" not in pool.pinning:  # not pinned at map time: the copy pins it
                copy_into_slots(cache, block_ids(g, 1, seed=66), [slot], [0], pool,  # type: ignore[arg-type]
                                CHUNK, stream=STREAM)
            assert pool.pinning["cuda"].done.wait(30)
            assert registered(drv) == {pool.view.ctypes.data: 2 << 20}
            maps.release(pool)
            assert not registered(drv)


def test_the_first_servers_pool_is_pinned_when_the_registration_binds_it() -> None:
    """The registration that maps the first pool (engine_driven.bound_to, called where
    the session binds a registration to its pool) starts its page-locking, before any
    copy: the first copy on vLLM's forward thread no longer starts it. On the previous
    commit only a restarted server's pool was pinned at map time."""
    from lmcache_mp.session.engine_driven import bound_to

    g = GEOMETRIES["hnd"]
    drv, cache, _ = fake_cache(g, seed=67)
    with mapped_segments(1, 4 << 20) as (maps, segs):
        pool = bound_to(cache, maps.acquire(segs[0].name, 4 << 20, 0))  # type: ignore[arg-type]
        assert "cuda" in pool.pinning, "not being page-locked at registration"
        assert pool.pinning["cuda"].done.wait(30)
        assert registered(drv) == {pool.view.ctypes.data: 4 << 20}
        assert not [c for c in drv.calls if c[0] in ("memcpy2d", "memcpy3d")]  # no copy yet
        maps.release(pool)
        assert not registered(drv)


EXIT_SCRIPT = """
import sys, threading, time
import numpy as np
sys.path.insert(0, {repo!r})
from lmcache_mp.ipc.cuda import staging
from tests.support.fake_cuda import FakeDriver

inside = threading.Event()

class SlowRegister(FakeDriver):
    def host_register(self, ptr, nbytes):
        print("register started", flush=True)
        inside.set()
        time.sleep(1.0)  # a large pool: cudaHostRegister takes its time
        super().host_register(ptr, nbytes)
        print("register finished", flush=True)

drv = SlowRegister()
pool = np.zeros(1 << 20, np.uint8)
pin = staging.PoolPin(drv, 0, pool)
assert inside.wait(60)  # the thread is inside cudaHostRegister
print("exiting", flush=True)
"""


def test_the_interpreter_exit_waits_for_a_pinning_in_flight(tmp_path: object) -> None:
    """A process that exits while a pool is being page-locked (its thread inside
    cudaHostRegister) waits for it at exit (atexit, bounded by PIN_EXIT_WAIT_S) instead
    of tearing CUDA down under it. Before the fix (265a737) the daemon thread was cut
    off mid-call: "register finished" never printed."""
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT.format(repo=repo)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == "register started exiting register finished".split(), \
        out.stdout + out.stderr
