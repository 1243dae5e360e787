"""CudaKVCache.from_torch on layers as vLLM hands them to a connector (fake tensors over
fake device memory, no GPU): logical NHD ``[2, blocks, block_size, heads, head_dim]``,
physically NHD or HND (a permuted, non-contiguous view), views into one allocation.
The physical layout is read from the strides and registered; the engine-driven copies
of such a cache are checked byte for byte against CpuKVCache.wrap's copies of the same
memory seen as numpy arrays of the same logical shape and strides."""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_mp import CpuKVCache, InvalidArgument
from lmcache_mp.ipc.base import CudaLayerExport
from lmcache_mp.ipc.cuda import CudaKVCache, staging
from lmcache_mp.session.engine_driven import Pool, copy_from_slots, copy_into_slots

from ..support.fake_cuda import FakeDriver, FakeTensor
from .test_cuda_engine_driven import CHUNK, pool_and_slots

STREAM = 0xC0DE
L, NB, BS, NH, HD = 3, 10, 8, 4, 6


def shared_layers(drv: FakeDriver, physical: str, seed: int = 0, lead: int = 512
                  ) -> tuple[list[FakeTensor], list[np.ndarray], int]:
    """L per-layer float32 views into ONE fake allocation (layer i at ``lead + i *
    layer bytes``), logically NHD; memory in ``physical`` order. Returns the fake
    tensors, the same views as numpy arrays (logical shape, real strides), the base."""
    nbytes = 2 * NB * BS * NH * HD * 4
    base = drv.add_alloc(lead + L * nbytes + 256)
    raw = drv._memory(base, lead + L * nbytes + 256)
    raw[:] = np.random.default_rng(seed).integers(0, 256, len(raw), dtype=np.uint8)
    tensors, arrays = [], []
    for i in range(L):
        mem = raw[lead + i * nbytes: lead + (i + 1) * nbytes].view(np.float32)
        if physical == "NHD":
            logical = mem.reshape(2, NB, BS, NH, HD)
        else:  # HND memory, seen NHD: vLLM's permuted view for HND backends
            logical = mem.reshape(2, NB, NH, BS, HD).transpose(0, 1, 3, 2, 4)
        assert logical.shape == (2, NB, BS, NH, HD)
        arrays.append(logical)
        tensors.append(FakeTensor(base + lead + i * nbytes, logical.shape, "torch.float32",
                                  strides=tuple(s // 4 for s in logical.strides)))
    return tensors, arrays, base


@pytest.fixture(autouse=True)
def no_pins_left() -> None:
    yield
    for address in list(staging.pinned_pools()):
        staging._pinned.pop(address, None)


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_physical_layout_is_read_from_strides_and_registered(physical: str) -> None:
    drv = FakeDriver()
    tensors, arrays, base = shared_layers(drv, physical)
    assert arrays[0].flags.c_contiguous == (physical == "NHD")
    cache = CudaKVCache.from_torch(tensors, layout="NHD", driver=drv)
    g = cache.geometry
    assert (g.num_layers, g.num_blocks, g.block_size, g.num_heads, g.head_dim, g.dtype) == (
        L, NB, BS, NH, HD, "float32")
    assert g.layout == physical and cache.kv_layout == physical
    # Views into one allocation: each layer's offset in it is exported.
    nbytes = g.layer_nbytes
    assert [e.offset for e in cache.exports] == [512 + i * nbytes for i in range(L)]
    assert {e.base for e in cache.exports} == {base}
    exports = cache.export_layers()
    want = (2, NB, BS, NH, HD) if physical == "NHD" else (2, NB, NH, BS, HD)
    assert all(isinstance(e, CudaLayerExport) and e.shape == want for e in exports)
    assert cache.torch_layers == tensors  # the caller's own (logical) tensors
    # The same memory declared HND-shaped: the strides decide, not the declared order.
    if physical == "HND":
        hnd = [FakeTensor(t.ptr, (2, NB, NH, BS, HD), "torch.float32") for t in tensors]
        assert CudaKVCache.from_torch(hnd, driver=drv).geometry == g


def unmapped(pool: Pool) -> None:
    """What the client does before it unmaps a pool: its before_unmap hooks (the GPU
    copy's page-locking undone). Without it the next test buffer, at the freed one's
    address, was page-locked again in the same fake driver (then an assertion, "pinned
    twice", in the pin thread in 4 of issue 37's 5 loaded runs; now the fake refuses
    as CUDA does, cudaErrorHostMemoryAlreadyRegistered, and the copy goes pageable)."""
    for undo in list(pool.before_unmap):
        undo(pool.view)


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_engine_driven_copies_match_cpu_wrap_of_the_same_views(physical: str) -> None:
    drv = FakeDriver()
    tensors, arrays, _ = shared_layers(drv, physical, seed=3)
    cuda = CudaKVCache.from_torch(tensors, layout="NHD", driver=drv)
    cpu = CpuKVCache.wrap(arrays, layout="NHD", block_size=BS)
    g = cuda.geometry
    per = CHUNK // BS
    ids = np.array([4, 5, 9, 1, 2, 3, 8, 6][: 2 * per], np.int64)

    # STORE: the same bytes land in the slots.
    stored = []
    for cache in (cuda, cpu):
        pool, slots, buf = pool_and_slots(g, 2)
        copy_into_slots(cache, ids, slots, [1, 0], pool, CHUNK, stream=STREAM)  # type: ignore[arg-type]
        stored.append(buf.tobytes())
        unmapped(pool)
    assert stored[0] == stored[1] and any(stored[0])

    # RETRIEVE into the CUDA cache, skipping 8 tokens; the CPU cache over a copy of the
    # memory as it was gets the same scatter.
    expect = [a.copy() for a in arrays]
    cpu_expect = CpuKVCache.wrap(expect, layout="NHD", block_size=BS)
    pool, slots, buf = pool_and_slots(g, 2)
    buf[:] = np.random.default_rng(5).integers(0, 256, len(buf), dtype=np.uint8)
    copy_from_slots(cpu_expect, ids, slots, pool, CHUNK, 8)
    copy_from_slots(cuda, ids, slots, pool, CHUNK, 8, stream=STREAM)  # type: ignore[arg-type]
    for got, want in zip(arrays, expect, strict=True):
        assert got.tobytes() == want.tobytes()
    assert drv.calls[-1] == ("stream_sync", STREAM)
    unmapped(pool)


def test_layers_dense_in_neither_order_are_refused_with_their_strides() -> None:
    drv = FakeDriver()
    nbytes = 2 * NB * BS * NH * HD * 2
    ptr = drv.add_alloc(L * nbytes)
    # Blocks-first memory [NB, 2, BS, NH, HD] seen as [2, NB, BS, NH, HD].
    blocks_first = (BS * NH * HD, 2 * BS * NH * HD, NH * HD, HD, 1)
    with pytest.raises(InvalidArgument) as info:
        CudaKVCache.from_torch([FakeTensor(ptr, (2, NB, BS, NH, HD), strides=blocks_first)],
                               layout="NHD", driver=drv)
    msg = str(info.value)
    assert "dense in neither NHD nor HND" in msg and str(blocks_first) in msg
    # Layers that disagree on strides (one permuted, one not).
    ok = FakeTensor(ptr, (2, NB, BS, NH, HD))
    permuted = FakeTensor(ptr + nbytes, (2, NB, BS, NH, HD),
                          strides=(NB * NH * BS * HD, NH * BS * HD, HD, BS * HD, 1))
    with pytest.raises(InvalidArgument, match="differs from layer 0 in shape, strides"):
        CudaKVCache.from_torch([ok, permuted], layout="NHD", driver=drv)
    with pytest.raises(InvalidArgument, match="layers must be NHD"):
        CudaKVCache.from_torch([FakeTensor(ptr, (NB, 2, BS, NH, HD))], layout="NHD",
                               driver=drv)
    with pytest.raises(InvalidArgument, match="layout"):
        CudaKVCache.from_torch([ok], layout="BHND", driver=drv)  # type: ignore[arg-type]


def test_allocate_and_from_pointers_take_the_layout() -> None:
    drv = FakeDriver()
    nhd = CudaKVCache.allocate(num_layers=2, num_blocks=4, block_size=16, num_heads=2,
                               head_dim=8, layout="NHD", driver=drv)
    assert nhd.kv_layout == "NHD" and nhd.geometry.layer_shape == (2, 4, 16, 2, 8)
    assert nhd.export_layers()[0].shape == (2, 4, 16, 2, 8)  # type: ignore[union-attr]
    hnd = CudaKVCache.from_pointers(nhd.layer_ptrs, num_blocks=4, block_size=16,
                                    num_heads=2, head_dim=8, driver=drv)
    assert hnd.kv_layout == "HND"  # the default stays HND
    with pytest.raises(InvalidArgument, match="layout"):
        CudaKVCache.allocate(num_layers=1, num_blocks=4, block_size=16, num_heads=2,
                             head_dim=8, layout="nhd", driver=drv)  # type: ignore[arg-type]
    mla = CudaKVCache.allocate(num_layers=1, num_blocks=4, block_size=16, num_heads=1,
                               head_dim=8, mla=True, layout="NHD", driver=drv)
    assert mla.kv_layout is None
