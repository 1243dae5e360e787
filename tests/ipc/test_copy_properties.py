"""Property-based tests of the paged <-> chunk copies (lmcache_mp.ipc.paged_copy) against
the loop-per-token reference in tests/support/kv_reference.py, and the dtype table against numpy
and torch.

Block-id lists are drawn long and short, contiguous, scattered, with repeated runs, and
with more than 8 runs (the fancy-indexed branch); both layouts (MLA and not), every
dtype of STORAGE_DTYPES, every skip count. Derandomized and bounded: the same examples
every run, a few seconds in all.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_mp.ipc.base import STORAGE_DTYPES, KVGeometry
from lmcache_mp.ipc.paged_copy import block_runs, block_slice, gather_chunk, scatter_chunk, slice_runs

from ..support.kv_reference import chunk_shape, reference_gather, reference_scatter

PROPERTY = settings(derandomize=True, max_examples=120, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def geometries(draw: st.DrawFn) -> KVGeometry:
    mla = draw(st.booleans())
    return KVGeometry(
        num_layers=draw(st.integers(1, 3)),
        num_blocks=draw(st.integers(30, 48)),
        block_size=draw(st.integers(1, 4)),
        num_heads=1 if mla else draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, 5)),
        dtype=draw(st.sampled_from(sorted(STORAGE_DTYPES))),
        mla=mla,
    )


def many_runs(draw: st.DrawFn, num_blocks: int,
              orders: tuple[str, ...] = ("as is", "reversed", "shuffled")) -> list[int]:
    """Distinct ids in 9 or more runs (runs of 1-2 ids, one-block gaps: at least 10 runs
    fit in 30 blocks) unless shuffled, which may merge a few."""
    ids: list[int] = []
    pos = draw(st.integers(0, 1))
    while pos < num_blocks - 1 and len(ids) < 24:
        n = draw(st.integers(1, 2))
        ids.extend(range(pos, min(pos + n, num_blocks)))
        pos += n + 1
    order = draw(st.sampled_from(orders))
    if order == "reversed":
        ids.reverse()
    elif order == "shuffled":
        ids = draw(st.permutations(ids))
    return ids


@st.composite
def fancy_ids(draw: st.DrawFn, num_blocks: int) -> list[int]:
    return many_runs(draw, num_blocks, ("as is", "reversed"))


@st.composite
def block_ids(draw: st.DrawFn, num_blocks: int, distinct: bool) -> list[int]:
    kind = draw(st.sampled_from(["contiguous", "falling", "short", "scattered", "many runs",
                                 "one block"] + ([] if distinct else ["repeated runs"])))
    if kind == "contiguous":
        n = draw(st.integers(2, 16))
        first = draw(st.integers(0, num_blocks - n))
        return list(range(first, first + n))
    if kind == "falling":  # vLLM's order for blocks that earlier requests freed
        n = draw(st.integers(2, 16))
        first = draw(st.integers(n - 1, num_blocks - 1))
        return list(range(first, first - n, -1))
    if kind == "one block":
        return [draw(st.integers(0, num_blocks - 1))]
    if kind == "short":
        return draw(st.lists(st.integers(0, num_blocks - 1), min_size=2, max_size=4,
                             unique=True))
    if kind == "scattered":
        return draw(st.lists(st.integers(0, num_blocks - 1), min_size=5, max_size=20,
                             unique=True))
    if kind == "many runs":
        return many_runs(draw, num_blocks)
    # repeated runs: the same run of blocks read twice (gather only)
    n = draw(st.integers(2, 5))
    first = draw(st.integers(0, num_blocks - n))
    run = list(range(first, first + n))
    return run + draw(st.lists(st.sampled_from(run), max_size=3)) + run


def random_layers(g: KVGeometry, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    holder = STORAGE_DTYPES[g.dtype][0]
    return [rng.integers(0, 256, int(np.prod(g.layer_shape)) * g.itemsize, dtype=np.uint8)
            .view(holder).reshape(g.layer_shape) for _ in range(g.num_layers)]


@PROPERTY
@given(data=st.data(), g=geometries(), seed=st.integers(0, 2**16))
def test_gather_matches_the_reference(data: st.DataObject, g: KVGeometry, seed: int) -> None:
    ids = data.draw(block_ids(g.num_blocks, distinct=False))
    layers = random_layers(g, seed)
    holder = np.dtype(STORAGE_DTYPES[g.dtype][0])
    out = np.full(chunk_shape(g, len(ids) * g.block_size), 0, dtype=holder)
    gather_chunk(layers, np.asarray(ids, dtype=np.int64), out, g)
    # Compared as bytes: random bits include NaNs, which never compare equal.
    assert out.tobytes() == reference_gather(layers, ids, g, holder).tobytes()


@PROPERTY
@given(data=st.data(), g=geometries(), seed=st.integers(0, 2**16))
def test_scatter_matches_the_reference_for_every_skip(data: st.DataObject, g: KVGeometry,
                                                      seed: int) -> None:
    ids = data.draw(block_ids(g.num_blocks, distinct=True))
    skip = data.draw(st.integers(0, len(ids) + 1))
    holder = np.dtype(STORAGE_DTYPES[g.dtype][0])
    obj = np.random.default_rng(seed + 1).integers(
        0, 256, int(np.prod(chunk_shape(g, len(ids) * g.block_size))) * holder.itemsize,
        dtype=np.uint8).view(holder).reshape(chunk_shape(g, len(ids) * g.block_size))
    targets = random_layers(g, seed)
    expected = [t.copy() for t in targets]
    reference_scatter(obj, expected, ids, g, skip_blocks=skip)
    scatter_chunk(obj, targets, np.asarray(ids, dtype=np.int64), g, skip_blocks=skip)
    for got, want in zip(targets, expected, strict=True):
        assert got.tobytes() == want.tobytes()


@PROPERTY
@given(data=st.data(), g=geometries())
def test_lists_with_more_than_8_runs_take_the_fancy_branch_and_stay_exact(
        data: st.DataObject, g: KVGeometry) -> None:
    ids = data.draw(fancy_ids(g.num_blocks))
    assert len(block_runs(np.asarray(ids))) > 8
    layers = random_layers(g, len(ids))
    holder = np.dtype(STORAGE_DTYPES[g.dtype][0])
    obj = np.zeros(chunk_shape(g, len(ids) * g.block_size), dtype=holder)
    gather_chunk(layers, np.asarray(ids, dtype=np.int64), obj, g)
    assert obj.tobytes() == reference_gather(layers, ids, g, holder).tobytes()
    back = [np.zeros_like(layer) for layer in layers]
    scatter_chunk(obj, back, np.asarray(ids, dtype=np.int64), g)
    for got, src in zip(back, layers, strict=True):
        if g.mla:
            assert got[ids].tobytes() == src[ids].tobytes()
        else:
            assert got[:, ids].tobytes() == src[:, ids].tobytes()


@PROPERTY
@given(ids=st.lists(st.integers(0, 50), max_size=30))
def test_block_runs_cover_the_list_with_maximal_runs(ids: list[int]) -> None:
    runs = block_runs(np.asarray(ids, dtype=np.int64))
    rebuilt = [first + i for _, first, n in runs for i in range(n)]
    assert rebuilt == ids
    assert [pos for pos, _, _ in runs] == [sum(n for _, _, n in runs[:k])
                                           for k in range(len(runs))]
    for (_, a, n), (_, b, _) in zip(runs, runs[1:], strict=False):
        assert b != a + n  # maximal: the next run does not continue this one


@PROPERTY
@given(ids=st.lists(st.integers(0, 12), max_size=30))
def test_slice_runs_cover_the_list_with_greedy_maximal_runs_up_or_down(ids: list[int]) -> None:
    runs = slice_runs(np.asarray(ids, dtype=np.int64))
    rebuilt = [first + step * i for _, first, n, step in runs for i in range(n)]
    assert rebuilt == ids
    assert all(step in (1, -1) for *_, step in runs)
    assert [pos for pos, *_ in runs] == [sum(r[2] for r in runs[:k]) for k in range(len(runs))]
    for (_, a, n, step), (_, b, _, _) in zip(runs, runs[1:], strict=False):
        last = a + step * (n - 1)
        # Greedy and maximal: the next id does not continue this run (nor start one with
        # a lone id before it).
        assert b != last + step and (n > 1 or b not in (last - 1, last + 1))
    for _, first, n, step in runs:  # a slice over exactly the run's ids
        assert list(range(40))[block_slice(first, n, step)] == [first + step * i
                                                                for i in range(n)]


# ------------------------------------------------------------------ dtype table
# Every dtype name a torch build must know, and the itemsize the format defines
# (IEEE 754 half/single/double, bfloat16, OCP FP8, two's complement ints).
FORMAT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1, "int16": 2,
                "int32": 4}


def test_the_dtype_table_names_exactly_the_formats_known_here() -> None:
    assert set(STORAGE_DTYPES) == set(FORMAT_BYTES)


@pytest.mark.parametrize("name", sorted(FORMAT_BYTES))
def test_itemsizes_agree_with_numpy(name: str) -> None:
    holder, itemsize = STORAGE_DTYPES[name]
    assert itemsize == FORMAT_BYTES[name]
    assert np.dtype(holder).itemsize == FORMAT_BYTES[name]
    if name in np.sctypeDict:  # numpy's own type of that name must be the holder
        assert np.dtype(name) == np.dtype(holder)
    else:  # no numpy type: raw unsigned bits of the same width
        assert np.dtype(holder).kind == "u"


@pytest.mark.parametrize("name", sorted(FORMAT_BYTES))
def test_itemsizes_agree_with_torch(name: str) -> None:
    torch = pytest.importorskip("torch", reason="torch not installed: torch itemsizes unchecked")
    dtype = getattr(torch, name)
    assert torch.empty((), dtype=dtype).element_size() == STORAGE_DTYPES[name][1]
    g = KVGeometry(num_layers=1, num_blocks=3, block_size=4, num_heads=2, head_dim=5,
                   dtype=name, mla=False)
    t = torch.empty(g.layer_shape, dtype=dtype)
    assert g.layer_nbytes == t.numel() * t.element_size()
    assert g.layer_strides == tuple(t.stride())
