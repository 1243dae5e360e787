"""Engine-driven transfers of GPU caches (lmcache_mp.ipc.cuda.staging) through the fake
CUDA driver: the copy plan (which bytes go where, in which order, on which stream) is
run by the fake on CPU memory and checked against the CPU cache's copies
(paged_copy.gather_chunk / scatter_chunk) of the same blocks; then the same path
against a real server, whose SHM pool the fake's copies read and write.

This proves the plan and the protocol path, not CUDA: scripts/gpu_check.sh runs the
same round trip on a GPU."""

from __future__ import annotations

import logging
import mmap
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lmcache_mp import CacheKey, Client, InvalidArgument, LMCacheMPError
from lmcache_mp.ipc.base import STORAGE_DTYPES, KVGeometry
from lmcache_mp.ipc.cuda import CudaError, CudaKVCache, staging
from lmcache_mp.ipc.paged_copy import gather_chunk, scatter_chunk
from lmcache_mp.ipc.shm import ShmSegment
from lmcache_mp.protocol.types import PoolSlot
from lmcache_mp.session.engine_driven import Pool, PoolMaps, copy_from_slots, copy_into_slots

from ..conftest import LiveServer
from ..support.fake_cuda import FakeDriver
from ..support.live_helpers import SETUP_S

STREAM = 0x5EED
CHUNK = 32

GEOMETRIES = [
    KVGeometry(2, 12, 8, 4, 16, "bfloat16", False),   # HND, several heads: 2-D copies
    KVGeometry(3, 10, 16, 1, 32, "float32", False),   # one head: merged 1-D runs
    KVGeometry(2, 12, 8, 1, 64, "float16", True),     # MLA
    KVGeometry(2, 12, 8, 4, 16, "bfloat16", False, "NHD"),  # NHD: a block is one 1-D run
    KVGeometry(3, 10, 16, 3, 8, "float32", False, "NHD"),
]


def gid(g: KVGeometry) -> str:
    return (f"L{g.num_layers}H{g.num_heads}{'-mla' if g.mla else ''}"
            f"{'-nhd' if g.layout == 'NHD' and not g.mla else ''}")


def fake_cache(drv: FakeDriver, g: KVGeometry, kind: str = "vmm",
               seed: int = 0) -> tuple[CudaKVCache, list[np.ndarray]]:
    """A CudaKVCache over fake device memory of ``kind`` filled with random bytes, and
    its layers as numpy arrays over the fake's backing (the CPU implementation's view)."""
    ptrs = [drv.add_alloc(g.layer_nbytes, kind) for _ in range(g.num_layers)]
    cache = CudaKVCache.from_pointers(
        ptrs, num_blocks=g.num_blocks, block_size=g.block_size, num_heads=g.num_heads,
        head_dim=g.head_dim, dtype=g.dtype, mla=g.mla, layout=g.layout, driver=drv)
    rng = np.random.default_rng(seed)
    layers = []
    for p in ptrs:
        raw = drv._memory(p, g.layer_nbytes)
        raw[:] = rng.integers(0, 256, g.layer_nbytes, dtype=np.uint8)
        layers.append(raw.view(STORAGE_DTYPES[g.dtype][0]).reshape(g.layer_shape))
    return cache, layers


def object_shape(g: KVGeometry) -> list[int]:
    return ([g.num_layers, CHUNK, g.hidden_dim] if g.mla
            else [2, g.num_layers, CHUNK, g.hidden_dim])


def pool_and_slots(g: KVGeometry, n: int) -> tuple[Pool, list[PoolSlot], np.ndarray]:
    nbytes = int(np.prod(object_shape(g))) * g.itemsize
    buf = np.zeros(nbytes * (n + 2), np.uint8)
    # Slots out of order and not at 0: offsets must be honoured.
    slots = [PoolSlot(offset=(n - i) * nbytes, length=nbytes, shape=object_shape(g),
                      dtype=g.dtype) for i in range(n)]
    return Pool("test", len(buf), 0, buf), slots, buf


def copied_bytes(drv: FakeDriver) -> int:
    return (sum(c[5] * c[6] for c in drv.calls if c[0] == "memcpy2d")
            + sum(c[7] * c[8] * c[9] for c in drv.calls if c[0] == "memcpy3d"))


@pytest.fixture(autouse=True)
def no_pins_left(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # These tests are about the copy plan (caches without torch keep it); the gather
    # path (tests/ipc/test_cuda_gather.py) is compared with it byte for byte there.
    monkeypatch.setenv("LMCACHE_MP_GPU_COPY", "plan")
    yield
    for address in list(staging.pinned_pools()):
        staging._pinned.pop(address, None)
    staging._no_3d.clear()


@pytest.mark.parametrize("g", GEOMETRIES, ids=gid)
def test_store_plan_matches_the_cpu_copy(g: KVGeometry) -> None:
    drv = FakeDriver()
    cache, layers = fake_cache(drv, g)
    per_chunk = CHUNK // g.block_size
    ids = np.array([7, 8, 1, 2, 9, 3, 4, 11][: 2 * per_chunk], np.int64)
    pool, slots, buf = pool_and_slots(g, 2)
    copy_into_slots(cache, ids, slots, [1, 0], pool, CHUNK, stream=STREAM)  # type: ignore[arg-type]

    np_dtype = STORAGE_DTYPES[g.dtype][0]
    for slot, ci in zip(slots, [1, 0], strict=True):
        expect = np.zeros(object_shape(g), np_dtype)
        gather_chunk(layers, ids[ci * per_chunk:(ci + 1) * per_chunk], expect, g)
        got = buf[slot.offset:slot.offset + slot.length].view(np_dtype).reshape(expect.shape)
        assert got.tobytes() == expect.tobytes()  # bytes: random floats hold NaNs
    # Every copy on the caller's stream, the pool pinned before the first, and the
    # stream synchronised after the last (before COMMIT_STORE can be sent).
    copies = ("memcpy2d", "memcpy3d")
    kinds = [c[0] for c in drv.calls if c[0] in ("host_register", "stream_sync", *copies)]
    assert kinds[0] == "host_register" and kinds[-1] == "stream_sync"
    # Several heads: runs of consecutive ids as 3-D copies, lone blocks as 2-D ones.
    assert set(kinds[1:-1]) == ({"memcpy2d", "memcpy3d"}
                                if g.num_heads > 1 and not g.mla and g.layout == "HND"
                                else {"memcpy2d"})
    assert {c[-1] for c in drv.calls if c[0] in copies} == {STREAM}
    assert drv.calls[-1] == ("stream_sync", STREAM) and not drv.queued
    assert copied_bytes(drv) == 2 * slots[0].length  # every byte of both objects, once


@pytest.mark.parametrize("g", GEOMETRIES, ids=gid)
@pytest.mark.parametrize("skip_tokens", [0, 8, CHUNK + 8])
def test_retrieve_plan_matches_the_cpu_copy(g: KVGeometry, skip_tokens: int) -> None:
    drv = FakeDriver()
    cache, layers = fake_cache(drv, g, seed=1)
    per_chunk = CHUNK // g.block_size
    ids = np.array([5, 6, 9, 0, 2, 3, 1, 4][: 2 * per_chunk], np.int64)
    pool, slots, buf = pool_and_slots(g, 2)
    buf[:] = np.random.default_rng(2).integers(0, 256, len(buf), dtype=np.uint8)
    expect = [layer.copy() for layer in layers]
    np_dtype = STORAGE_DTYPES[g.dtype][0]
    skip_blocks = skip_tokens // g.block_size
    for ci, slot in enumerate(slots):
        obj = buf[slot.offset:slot.offset + slot.length].view(np_dtype).reshape(object_shape(g))
        scatter_chunk(obj, expect, ids[ci * per_chunk:(ci + 1) * per_chunk], g,
                      skip_blocks=max(0, skip_blocks - ci * per_chunk))
    copy_from_slots(cache, ids, slots, pool, CHUNK, skip_tokens, stream=STREAM)  # type: ignore[arg-type]
    for got, want in zip(layers, expect, strict=True):
        assert got.tobytes() == want.tobytes()
    assert drv.calls[-1] == ("stream_sync", STREAM)


@pytest.mark.parametrize("skip_tokens", [0, 8])
def test_refused_3d_copies_fall_back_to_2d(skip_tokens: int,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """A driver that refuses cudaMemcpy3DAsync (raised before anything is queued) gets
    the same bytes through one 2-D copy per block."""
    g = GEOMETRIES[0]
    per_chunk = CHUNK // g.block_size
    ids = np.array([5, 6, 7, 8, 1, 2, 9, 3][: 2 * per_chunk], np.int64)
    results = []
    for refuse in (False, True):
        drv = FakeDriver()
        drv.refuse_3d = refuse
        cache, layers = fake_cache(drv, g, seed=7)
        pool, slots, buf = pool_and_slots(g, 2)
        buf[:] = np.random.default_rng(8).integers(0, 256, len(buf), dtype=np.uint8)
        with caplog.at_level(logging.WARNING, logger="lmcache_mp"):
            copy_from_slots(cache, ids, slots, pool, CHUNK, skip_tokens, stream=STREAM)  # type: ignore[arg-type]
            copy_into_slots(cache, ids[::-1].copy(), slots, [0, 1], pool, CHUNK, stream=STREAM)  # type: ignore[arg-type]
        results.append((b"".join(layer.tobytes() for layer in layers), buf.tobytes()))
        tried_3d = sum(c[0] == "memcpy3d" for c in drv.calls)
        assert tried_3d == 1 if refuse else tried_3d > 1  # refused once, then 2-D only
        staging._no_3d.clear()
        for address in list(staging.pinned_pools()):
            staging._pinned.pop(address, None)
    assert results[0] == results[1]
    assert "cudaMemcpy3DAsync refused" in caplog.text


def test_one_head_and_mla_plans_merge_contiguous_runs() -> None:
    g = GEOMETRIES[1]  # one head: a block is contiguous on both sides
    per_chunk = CHUNK // g.block_size
    plan = staging.store_plan(g, [0x1000_0000, 0x2000_0000, 0x3000_0000],
                              np.arange(per_chunk), [0x9000_0000], [0], CHUNK)
    # Contiguous ids: one copy per (K/V, layer) instead of one per block.
    assert len(plan) == 2 * g.num_layers and plan.height == 1
    assert plan.nbytes == 2 * g.num_layers * CHUNK * g.hidden_dim * g.itemsize
    g2 = GEOMETRIES[0]
    plan2 = staging.store_plan(g2, [0x1000_0000, 0x2000_0000], np.arange(CHUNK // g2.block_size),
                               [0x9000_0000], [0], CHUNK)
    # Several heads, contiguous ids: one 3-D copy per (K/V, layer, head), the run's
    # blocks as its slices; scattered ids: one per block.
    assert len(plan2) == 2 * g2.num_layers * g2.num_heads
    assert (plan2.depth == CHUNK // g2.block_size).all()
    assert (plan2.height, plan2.spitch, plan2.dpitch, plan2.slice_pitch) == (
        g2.block_size, g2.head_dim * g2.itemsize, g2.hidden_dim * g2.itemsize,
        g2.num_heads * g2.block_size * g2.head_dim * g2.itemsize)
    scattered = staging.store_plan(g2, [0x1000_0000, 0x2000_0000], np.array([3, 1, 5, 7]),
                                   [0x9000_0000], [0], CHUNK)
    assert len(scattered) == 2 * g2.num_layers * 4 * g2.num_heads and (scattered.depth == 1).all()


def test_nhd_plan_is_one_1d_copy_per_kv_layer_run() -> None:
    """NHD: a block [block_size, heads * head_dim] is one contiguous run of the chunk, so
    a run of consecutive block ids is one 1-D copy per (K/V, layer), whatever the heads."""
    g = GEOMETRIES[3]
    assert g.layout == "NHD" and g.num_heads > 1
    per = CHUNK // g.block_size
    ptrs = [0x1000_0000, 0x2000_0000]
    block = g.block_size * g.hidden_dim * g.itemsize
    plan = staging.store_plan(g, ptrs, np.arange(2, 2 + per), [0x9000_0000], [0], CHUNK)
    assert len(plan) == 2 * g.num_layers and plan.height == 1 and (plan.depth == 1).all()
    assert (plan.width == per * block).all()
    # (K, layer 0) first: from block 2 of layer 0 to the start of the slot.
    assert (int(plan.src[0]), int(plan.dst[0])) == (ptrs[0] + 2 * block, 0x9000_0000)
    # V of layer 1: the V plane starts num_blocks blocks in; the chunk's V half after K.
    assert int(plan.src[-1]) == ptrs[1] + (g.num_blocks + 2) * block
    assert int(plan.dst[-1]) == 0x9000_0000 + (2 * g.num_layers - 1) * CHUNK * g.hidden_dim \
        * g.itemsize
    # Scattered ids: one copy per block; a run inside them is merged.
    scattered = staging.retrieve_plan(g, ptrs, np.array([7, 1, 2, 5][:per]), [0x9000_0000],
                                      CHUNK, skip_blocks=0)
    runs = 3 if per == 4 else per
    assert len(scattered) == 2 * g.num_layers * runs and scattered.nbytes == 2 * g.num_layers \
        * per * block


def test_nothing_lands_before_the_stream_is_synchronised() -> None:
    g = GEOMETRIES[0]
    drv = FakeDriver()
    cache, _ = fake_cache(drv, g)
    _, slots, buf = pool_and_slots(g, 1)
    plan = staging.store_plan(g, cache.layer_ptrs, np.arange(CHUNK // g.block_size),
                              [buf.ctypes.data + slots[0].offset], [0], CHUNK)
    drv.allow_pageable = True
    staging.run_plan(drv, plan, STREAM)
    assert not buf.any(), "the fake runs copies only when their stream is synchronised"
    drv.stream_synchronize(STREAM + 1)
    assert not buf.any()
    drv.stream_synchronize(STREAM)
    assert buf.any()


def test_pool_is_pinned_once_and_unpinned_before_unmap() -> None:
    g = GEOMETRIES[0]
    drv = FakeDriver()
    cache, _ = fake_cache(drv, g)
    seg = ShmSegment.create(1 << 20, tag="pintest")
    maps = PoolMaps()
    try:
        pool = maps.acquire(seg.name, 1 << 20, 0)
        nbytes = int(np.prod(object_shape(g))) * g.itemsize
        slot = PoolSlot(offset=4096, length=nbytes, shape=object_shape(g), dtype=g.dtype)
        ids = np.arange(CHUNK // g.block_size)
        for _ in range(3):
            copy_into_slots(cache, ids, [slot], [0], pool, CHUNK, stream=STREAM)  # type: ignore[arg-type]
        assert [c for c in drv.calls if c[0] == "host_register"] == [
            ("host_register", pool.view.ctypes.data, 1 << 20)]
        maps.release(pool)
        assert drv.unpinned == [pool.view.ctypes.data] and not drv.pinned
    finally:
        maps.close()
        seg.close()


def test_unpinnable_pool_is_copied_pageable(caplog: pytest.LogCaptureFixture) -> None:
    g = GEOMETRIES[2]
    drv = FakeDriver()
    drv.fail_host_register = drv.allow_pageable = True
    cache, layers = fake_cache(drv, g)
    pool, slots, buf = pool_and_slots(g, 1)
    with caplog.at_level(logging.WARNING, logger="lmcache_mp"):
        copy_into_slots(cache, np.arange(CHUNK // g.block_size), slots, [0], pool,  # type: ignore[arg-type]
                        CHUNK, stream=STREAM)
    assert "ulimit -l" in caplog.text and buf.any()
    assert "pageable and slower" in caplog.text
    assert staging.pinned_pools() == {buf.ctypes.data: None}


def test_a_pool_page_locked_by_other_code_is_left_to_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """Memory at the pool's address already page-locked by other code of the process:
    CUDA refuses the second cudaHostRegister (cudaErrorHostMemoryAlreadyRegistered; the
    fake raises as CUDA does). The copy still runs, the warning names that cause
    (raising ulimit -l would not help), and the client never unregisters what it did
    not register. Before, the fake asserted ("pinned twice") and the message said to
    raise ulimit -l."""
    g = GEOMETRIES[2]
    drv = FakeDriver()
    cache, layers = fake_cache(drv, g)
    pool, slots, buf = pool_and_slots(g, 1)
    drv.host_register(buf.ctypes.data, buf.nbytes)  # the other code's registration
    with caplog.at_level(logging.WARNING, logger="lmcache_mp"):
        copy_into_slots(cache, np.arange(CHUNK // g.block_size), slots, [0], pool,  # type: ignore[arg-type]
                        CHUNK, stream=STREAM)
    assert buf.any()
    assert "page-locked memory at this address" in caplog.text
    assert "ulimit" not in caplog.text
    assert "pageable" not in caplog.text  # CUDA has the range page-locked already
    assert staging.pinned_pools() == {buf.ctypes.data: None}  # not the client's
    for undo in list(pool.before_unmap):  # the client unmaps the pool
        undo(pool.view)
    assert drv.pinned.get(buf.ctypes.data) == buf.nbytes and not drv.unpinned


def test_the_fake_refuses_as_cuda_does() -> None:
    """The fake driver's page-locking errors are CUDA's: an overlapping range, an
    address never registered (or registered by cudaMallocHost), an unregister twice."""
    drv = FakeDriver()
    buf = np.zeros(1 << 16, np.uint8)
    base = buf.ctypes.data
    drv.host_register(base + 4096, 8192)
    for ptr, n in ((base + 4096, 8192), (base, 8192), (base + 8192, 1 << 12)):
        with pytest.raises(CudaError) as err:
            drv.host_register(ptr, n)
        assert err.value.code == 712 and err.value.call == "cudaHostRegister"
    drv.host_register(base, 4096)  # adjacent, not overlapping: fine
    for ptr in (base + 8192, base + 12288 + 4096):
        with pytest.raises(CudaError) as err:
            drv.host_unregister(ptr)
        assert err.value.code == 713
    drv.host_unregister(base + 4096)
    with pytest.raises(CudaError):
        drv.host_unregister(base + 4096)  # twice
    drv.host_unregister(base)
    assert not drv.pinned


# ------------------------------------------ caches CUDA IPC cannot export
def test_vmm_and_pool_memory_make_engine_only_caches() -> None:
    for kind in ("vmm", "pool"):
        drv = FakeDriver()
        cache, _ = fake_cache(drv, GEOMETRIES[0], kind)
        # VMM memory exports as a POSIX fd (issue 10), which no released server can open:
        # not server-mappable, so "auto" registers it engine-driven. Pool memory does
        # not export at all.
        assert not cache.server_mappable and cache.supports_engine_driven
        assert cache.ipc_exportable == (kind == "vmm")
        if kind == "pool":
            with pytest.raises(InvalidArgument, match="mode='engine'"):
                cache.export_layers()
    drv = FakeDriver()
    cache, _ = fake_cache(drv, GEOMETRIES[0], "malloc")
    assert cache.ipc_exportable and cache.server_mappable


def test_tegra_allocate_keeps_the_cache_for_engine_driven_mode() -> None:
    drv = FakeDriver()
    drv.ipc_supported = False  # cudaIpcGetMemHandle: cudaErrorNotSupported
    cache = CudaKVCache.allocate(num_layers=2, num_blocks=4, block_size=8, num_heads=2,
                                 head_dim=16, driver=drv)
    assert not cache.ipc_exportable
    assert all(e.handle == b"" and e.ptr == e.base for e in cache.exports)


def test_host_memory_is_still_refused() -> None:
    drv = FakeDriver()
    ptr = drv.add_alloc(GEOMETRIES[0].layer_nbytes, "host")
    g = GEOMETRIES[0]
    with pytest.raises(InvalidArgument, match="not device memory"):
        CudaKVCache.from_pointers([ptr, ptr], num_blocks=g.num_blocks, block_size=g.block_size,
                                  num_heads=g.num_heads, head_dim=g.head_dim, driver=drv)


def test_register_modes_for_an_engine_only_cache() -> None:
    drv = FakeDriver()
    cache, _ = fake_cache(drv, GEOMETRIES[0], "pool")
    with Client("tcp://127.0.0.1:1", timeout=0.2) as client:
        with pytest.raises(InvalidArgument, match="mode='engine' or 'auto'"):
            client.register(cache, model_name="m", mode="lmcache")


# ----------------------------------------------------------------- live
@pytest.mark.live
@pytest.mark.parametrize("copy_path", ["plan", "gather"])
@pytest.mark.parametrize("mode", ["engine", "auto"])
@pytest.mark.parametrize("g", [GEOMETRIES[0], GEOMETRIES[2]], ids=["hnd", "mla"])
def test_live_round_trip_through_the_server_pool(live_server: LiveServer, g: KVGeometry,
                                                 mode: str, copy_path: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A VMM-backed (engine-only) fake GPU cache against a real server: STORE through
    its pool, LOOKUP, RETRIEVE into other blocks, byte for byte; by the copy plan and
    by the gather path (torch on the fake's memory)."""
    monkeypatch.setenv("LMCACHE_MP_GPU_COPY", copy_path)
    drv = FakeDriver()
    # A set-up's deadline for every call (this test checks bytes, not time): the process's
    # first gather copy pays torch's one-time start-up (on the fake's CPU tensors, the first
    # torch call under its stream dispatch mode imports torch._dynamo: 2-5 s alone here,
    # 11.8 s in make test beside a CPU-bound process, past the 10 s this had).
    with Client(live_server.url, timeout=SETUP_S) as client:
        chunk = client.chunk_size()
        g = KVGeometry(g.num_layers, 2 * chunk // g.block_size + 2, g.block_size, g.num_heads,
                       g.head_dim, g.dtype, g.mla)
        cache, layers = fake_cache(drv, g, seed=3)
        reg = client.register(cache, model_name=f"gpu-ed-{uuid.uuid4().hex[:8]}", mode=mode)
        try:
            assert reg.mode == "engine"
            # Page-locking the pool started when the registration mapped it, before any
            # copy (not on the first copy's, the caller's, thread).
            assert "cuda" in reg._state.binding.pool.pinning  # type: ignore[union-attr]
            n = chunk // g.block_size
            tokens = np.random.default_rng(4).integers(0, 2**31, chunk).tolist()
            key = CacheKey(model_name=reg.model_name, world_size=1, worker_id=0,
                           token_ids=tokens, start=0, end=chunk, request_id="gpu-ed")
            src = list(range(1, n + 1))
            dst = list(range(n + 1, 2 * n + 1))
            assert reg.store(key, src, stream=STREAM)
            for _ in range(50):
                if reg.lookup(key) == chunk:
                    break
            else:
                pytest.fail("the stored chunk never became visible")
            assert reg.retrieve(key, dst, stream=STREAM)
            for layer in layers:
                got = layer[dst] if g.mla else layer[:, dst]
                want = layer[src] if g.mla else layer[:, src]
                assert got.tobytes() == want.tobytes()
            assert {c[-1] for c in drv.calls if c[0].startswith("memcpy")} == {STREAM}
            assert (cache.gather_copier() is None) == (copy_path == "plan")
            pool_pins = [p for p in reg._state.binding.pool.pinning.values()]  # type: ignore[union-attr]
            assert pool_pins and pool_pins[0].done.wait(30)
            assert set(drv.pinned) - set(drv.host_allocs), \
                "the server's pool is page-locked while registered"
        finally:
            reg.unregister()
        assert not set(drv.pinned) - set(drv.host_allocs), \
            "unregistering unmapped the pool and undid the pinning"


# ------------------------------------------------------------------ GPU
def _real_driver() -> Any:
    """cuda-python's driver, or skip saying why (no GPU on the CI machine)."""
    try:
        from lmcache_mp.ipc.cuda import CudaBindingsDriver

        drv = CudaBindingsDriver()
        if drv.driver_version() <= 0 or drv.device_count() < 1:
            pytest.skip("no CUDA device visible: the engine-driven CUDA copies are checked "
                        "on a GPU by scripts/gpu_check.sh")
    except LMCacheMPError as exc:
        pytest.skip(f"no usable CUDA here ({exc}); scripts/gpu_check.sh checks this on a GPU")
    return drv


@pytest.mark.parametrize("copy_path", ["plan", "gather"])
def test_real_gpu_copies_match_the_cpu_copy(copy_path: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy plan and the gather path through cuda-python on a real GPU: blocks ->
    a page-locked mmap'd pool -> other blocks, byte for byte against the CPU
    implementation."""
    monkeypatch.setenv("LMCACHE_MP_GPU_COPY", copy_path)
    drv = _real_driver()
    g = GEOMETRIES[0]
    cache = CudaKVCache.allocate(num_layers=g.num_layers, num_blocks=g.num_blocks,
                                 block_size=g.block_size, num_heads=g.num_heads,
                                 head_dim=g.head_dim, dtype=g.dtype, driver=drv)
    rng = np.random.default_rng(5)
    np_dtype = STORAGE_DTYPES[g.dtype][0]
    host = [rng.integers(0, 256, g.layer_nbytes, dtype=np.uint8) for _ in range(g.num_layers)]
    for ptr, h in zip(cache.layer_ptrs, host, strict=True):
        drv.memcpy(ptr, h.ctypes.data, g.layer_nbytes)
    nbytes = int(np.prod(object_shape(g))) * g.itemsize
    mapping = mmap.mmap(-1, nbytes * 4)  # page-aligned, like the server's pool
    buf = np.frombuffer(mapping, dtype=np.uint8)
    pool = Pool("gpu-test", len(buf), 0, buf)
    slots = [PoolSlot(offset=(2 - i) * nbytes, length=nbytes, shape=object_shape(g),
                      dtype=g.dtype) for i in range(2)]
    per_chunk = CHUNK // g.block_size
    ids = np.array([7, 8, 1, 2, 9, 3, 4, 11][: 2 * per_chunk], np.int64)
    layers = [h.view(np_dtype).reshape(g.layer_shape) for h in host]
    try:
        copy_into_slots(cache, ids, slots, [1, 0], pool, CHUNK)
        for slot, ci in zip(slots, [1, 0], strict=True):
            expect = np.zeros(object_shape(g), np_dtype)
            gather_chunk(layers, ids[ci * per_chunk:(ci + 1) * per_chunk], expect, g)
            assert buf[slot.offset:slot.offset + nbytes].tobytes() == expect.tobytes()
        buf[:] = rng.integers(0, 256, len(buf), dtype=np.uint8)
        dst = np.array([0, 5, 6, 10, 11, 2, 3, 4][: 2 * per_chunk], np.int64)
        copy_from_slots(cache, dst, slots, pool, CHUNK, g.block_size)  # skip one block
        for ci, slot in enumerate(slots):
            obj = buf[slot.offset:slot.offset + nbytes].view(np_dtype).reshape(object_shape(g))
            scatter_chunk(obj, layers, dst[ci * per_chunk:(ci + 1) * per_chunk], g,
                          skip_blocks=max(0, 1 - ci * per_chunk))
        for ptr, want in zip(cache.layer_ptrs, host, strict=True):
            got = np.zeros(g.layer_nbytes, np.uint8)
            drv.memcpy(got.ctypes.data, ptr, g.layer_nbytes)
            assert got.tobytes() == want.tobytes()
        assert staging.pinned_pools().get(buf.ctypes.data) == len(buf)
        assert (cache.gather_copier() is not None) == (copy_path == "gather")
    finally:
        staging.unpin(buf)
        del buf, layers
        cache.close()


@pytest.mark.live
def test_live_engine_only_cache_on_a_server_without_the_handler() -> None:
    """An engine-only GPU cache and a server that only does LMCache-driven transfers:
    told at once what to start the server with, not waited out."""
    import time

    from lmcache_mp import ProtocolMismatch

    from ..conftest import start_server

    server = start_server("--supported-transfer-mode", "lmcache_driven")
    try:
        drv = FakeDriver()
        cache, _ = fake_cache(drv, GEOMETRIES[0])
        with Client(server.url, timeout=10.0) as client:
            for mode in ("engine", "auto"):
                started = time.monotonic()
                with pytest.raises(ProtocolMismatch, match="--supported-transfer-mode auto"):
                    client.register(cache, model_name="no-handler", mode=mode)
                assert time.monotonic() - started < 5.0
    finally:
        server.stop()
