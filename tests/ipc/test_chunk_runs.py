"""Chunk objects lying one after another in the pool, for blocks that are one run of
consecutive ids, are copied as one run (lmcache_mp.ipc.paged_copy.gather_run_tasks /
scatter_run_tasks: one copy per layer, issue 38), with exactly the bytes of the copy of
each chunk on its own (gather_chunk / scatter_chunk, themselves proven against the
loop-per-token reference in test_copy_properties.py). Every layout: HND, NHD, MLA and
vLLM's fused K/V rows (HND and NHD).

Then the engine-driven copies of a transfer (session.engine_driven.copy_into_slots /
copy_from_slots) over slots in every arrangement a server can hand out: one after
another, reversed, with gaps, the store's chunks in the server's order, a retrieve
skipping whole and part chunks. The slots here are laid out by the test (a live server
hands out fresh slots one after another: tests/session/test_transfers.py copies through
them against every release).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_mp.ipc.base import STORAGE_DTYPES, KVGeometry
from lmcache_mp.ipc.cpu_cache import CpuKVCache
from lmcache_mp.ipc.paged_copy import (
    gather_chunk,
    gather_run_tasks,
    run_task,
    scatter_chunk,
    scatter_run_tasks,
)
from lmcache_mp.protocol.types import PoolSlot
from lmcache_mp.session import engine_driven
from lmcache_mp.session.engine_driven import Pool, copy_from_slots, copy_into_slots

from .test_copy_properties import random_layers

PROPERTY = settings(derandomize=True, max_examples=80, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
LAYOUTS = ("HND", "NHD", "MLA", "fused HND", "fused NHD")


def geometry(kind: str, num_layers: int = 2, num_blocks: int = 40, block_size: int = 2,
             num_heads: int = 2, head_dim: int = 3, dtype: str = "bfloat16") -> KVGeometry:
    mla = kind == "MLA"
    return KVGeometry(num_layers, num_blocks, block_size, 1 if mla else num_heads, head_dim,
                      dtype, mla, "NHD" if kind.endswith("NHD") else "HND",
                      fused=kind.startswith("fused"))


def object_shape(g: KVGeometry, tokens: int) -> tuple[int, ...]:
    if g.kv_planes == 1:
        return (g.num_layers, tokens, g.hidden_dim)
    return (2, g.num_layers, tokens, g.hidden_dim)


@st.composite
def runs(draw: st.DrawFn) -> tuple[KVGeometry, int, int, int, int]:
    g = geometry(draw(st.sampled_from(LAYOUTS)), num_layers=draw(st.integers(1, 3)),
                 block_size=draw(st.integers(1, 4)), num_heads=draw(st.integers(1, 3)),
                 head_dim=draw(st.integers(1, 5)),
                 dtype=draw(st.sampled_from(sorted(STORAGE_DTYPES))))
    per_chunk, m, step = draw(st.integers(1, 4)), draw(st.integers(2, 5)), draw(
        st.sampled_from([1, -1]))
    n = m * per_chunk
    first = draw(st.integers(0, g.num_blocks - n) if step == 1 else st.integers(n - 1,
                                                                               g.num_blocks - 1))
    return g, per_chunk, m, first, step


@PROPERTY
@given(run=runs(), seed=st.integers(0, 2**16))
def test_a_run_of_chunks_holds_the_bytes_of_each_chunk_copied_alone(
        run: tuple[KVGeometry, int, int, int, int], seed: int) -> None:
    g, per_chunk, m, first, step = run  # blocks first, first + step, ... (step: 1 or -1)
    ids = first + step * np.arange(m * per_chunk)
    layers = random_layers(g, seed)
    holder = np.dtype(STORAGE_DTYPES[g.dtype][0])
    shape = object_shape(g, per_chunk * g.block_size)
    objs = np.zeros((m, *shape), dtype=holder)
    tasks = gather_run_tasks(layers, first, objs, g, step)
    assert len(tasks) == g.num_layers  # one copy per layer for the whole run
    for t in tasks:
        run_task(t)
    for c in range(m):
        alone = np.zeros(shape, dtype=holder)
        gather_chunk(layers, ids[c * per_chunk: (c + 1) * per_chunk], alone, g)
        # Compared as bytes: random bits include NaNs, which never compare equal.
        assert objs[c].tobytes() == alone.tobytes()

    back = [np.zeros_like(layer) for layer in layers]
    for t in scatter_run_tasks(objs, back, first, g, step):
        run_task(t)
    expected = [np.zeros_like(layer) for layer in layers]
    for c in range(m):
        scatter_chunk(objs[c], expected, ids[c * per_chunk: (c + 1) * per_chunk], g)
    for got, want in zip(back, expected, strict=True):
        assert got.tobytes() == want.tobytes()


# ------------------------------------------------- the transfers' slot arrangements
CHUNK = 8  # tokens: 4 blocks of 2


@pytest.fixture(params=LAYOUTS)
def cache(request: pytest.FixtureRequest) -> CpuKVCache:
    g = geometry(request.param)
    return CpuKVCache.wrap(random_layers(g, 7), layout=g.layout, block_size=g.block_size,
                           dtype=g.dtype, fused=g.fused)


def pool_with(g: KVGeometry, offsets_in_slots: list[int]) -> tuple[Pool, list[PoolSlot]]:
    """A pool and one slot per entry, at that many slot lengths from the pool's start."""
    shape = list(object_shape(g, CHUNK))
    nbytes = int(np.prod(shape)) * g.itemsize
    buf = np.zeros(nbytes * (max(offsets_in_slots) + 2), np.uint8)
    return Pool("test", len(buf), 0, buf), [
        PoolSlot(offset=o * nbytes, length=nbytes, shape=shape, dtype=g.dtype)
        for o in offsets_in_slots]


def counted_tasks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counts: list[int] = []
    real = engine_driven._run

    def run(tasks: list, workers: object) -> None:  # type: ignore[type-arg]
        counts.append(len(tasks))
        real(tasks, None)

    monkeypatch.setattr(engine_driven, "_run", run)
    return counts


ARRANGEMENTS = {
    # name: (slot offsets, in slot lengths; block ids of the key; runs copied as one)
    "one after another": ([3, 4, 5, 6], list(range(5, 21)), 1),
    "reversed": ([6, 5, 4, 3], list(range(5, 21)), 4),  # each chunk alone
    "a gap": ([0, 1, 3, 4], list(range(5, 21)), 2),
    "blocks not one run": ([0, 1, 2, 3], [*range(0, 8), *range(20, 28)], 2),
    # vLLM's usual order for a request reusing freed blocks: falling by one.
    "blocks falling": ([3, 4, 5, 6], list(range(20, 4, -1)), 1),
    "rising then falling": ([3, 4, 5, 6], [*range(0, 8), *range(27, 19, -1)], 2),
    "falling to block 0": ([3, 4, 5, 6], list(range(15, -1, -1)), 1),
}


@pytest.mark.parametrize("name", list(ARRANGEMENTS))
def test_a_retrieve_writes_each_chunk_where_its_slot_says(
        cache: CpuKVCache, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    offsets, ids, groups = ARRANGEMENTS[name]
    g = cache.geometry
    pool, slots = pool_with(g, offsets)
    holder = STORAGE_DTYPES[g.dtype][0]
    pool.view[:] = np.random.default_rng(3).integers(0, 256, pool.size, dtype=np.uint8)
    for skip in (0, 4, 6):  # no block, a whole chunk, a chunk and a half
        for layer, fresh in zip(cache.layers, random_layers(g, skip), strict=True):
            layer[...] = fresh  # skipped blocks must keep what they held, unlike the pool's
        expected = [layer.copy() for layer in cache.layers]
        per_chunk = CHUNK // g.block_size
        for c, slot in enumerate(slots):
            obj = pool.view[slot.offset: slot.offset + slot.length].view(holder).reshape(
                slot.shape)
            scatter_chunk(obj, expected, np.asarray(ids[c * per_chunk: (c + 1) * per_chunk]),
                          g, skip_blocks=max(0, skip - c * per_chunk))
        counts = counted_tasks(monkeypatch)
        copy_from_slots(cache, np.asarray(ids, dtype=np.int64), slots, pool, CHUNK,
                        skip * g.block_size)
        for got, want in zip(cache.layers, expected, strict=True):
            assert got.tobytes() == want.tobytes()
        if skip == 0:  # a copy per layer and run (a chunk alone: one run of blocks)
            assert counts == [g.num_layers * groups]
        monkeypatch.undo()


# The chunks a PREPARE_STORE names, in its order (its slots one after another): runs.
ORDERS = {(0, 1, 2, 3): 1, (1, 2, 3, 0): 2, (3, 2, 1, 0): 4, (2, 3): 1}


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_store_fills_each_slot_from_its_chunk_in_the_servers_order(
        cache: CpuKVCache, order: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    g = cache.geometry
    ids = list(range(5, 21))
    pool, slots = pool_with(g, [2 + k for k in range(len(order))])
    holder = STORAGE_DTYPES[g.dtype][0]
    per_chunk = CHUNK // g.block_size
    counts = counted_tasks(monkeypatch)
    copy_into_slots(cache, np.asarray(ids, dtype=np.int64), slots, list(order), pool, CHUNK)
    for slot, ci in zip(slots, order, strict=True):
        alone = np.zeros(slot.shape, dtype=holder)
        gather_chunk(cache.layers, np.asarray(ids[ci * per_chunk: (ci + 1) * per_chunk]),
                     alone, g)
        got = pool.view[slot.offset: slot.offset + slot.length].view(holder)
        assert got.tobytes() == alone.tobytes()
    assert counts == [g.num_layers * ORDERS[order]]  # a copy per layer and run
