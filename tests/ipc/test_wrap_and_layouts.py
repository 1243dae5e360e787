"""NHD caches and CpuKVCache.wrap (caller-owned host arrays, zero-copy): geometry,
sharing of memory, the copies through wrapped strided views, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_mp import Client, CpuKVCache, InvalidArgument
from lmcache_mp.ipc.cpu_cache import KVGeometry
from lmcache_mp.ipc.paged_copy import gather_chunk, scatter_chunk

NB, BS, H, D = 12, 4, 3, 5


def test_allocate_nhd_shape_and_layout_hint() -> None:
    with CpuKVCache.allocate(num_layers=2, num_blocks=NB, block_size=BS, num_heads=H,
                             head_dim=D, dtype="float16", layout="NHD") as kv:
        assert kv.layers[0].shape == (2, NB, BS, H, D)
        assert kv.kv_layout == "NHD" and kv.geometry.layout == "NHD"
        assert kv.export_layers()[0].shape == (2, NB, BS, H, D)
        assert not kv.wrapped
    with CpuKVCache.allocate(num_layers=1, num_blocks=NB, block_size=BS, num_heads=H,
                             head_dim=D) as kv:
        assert kv.kv_layout == "HND" and kv.layers[0].shape == (2, NB, H, BS, D)
    with pytest.raises(InvalidArgument, match="layout"):
        CpuKVCache.allocate(num_layers=1, num_blocks=NB, block_size=BS, num_heads=H,
                            head_dim=D, layout="hnd")  # type: ignore[arg-type]


def _chunk_ref(layers: list[np.ndarray], ids: list[int], layout: str) -> np.ndarray:
    """The chunk object, built the slow obvious way: [2, L, tokens, H * D]."""
    per_layer = []
    for layer in layers:
        blocks = layer[:, ids]  # [2, n, H, BS, D] or [2, n, BS, H, D]
        if layout == "HND":
            blocks = blocks.transpose(0, 1, 3, 2, 4)
        per_layer.append(blocks.reshape(2, len(ids) * BS, H * D))
    return np.stack(per_layer, axis=1)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("ids", [[2, 3, 4, 5], [9, 1, 6, 0]])
def test_nhd_and_hnd_copies_match_the_reference(layout: str, ids: list[int]) -> None:
    g = KVGeometry(2, NB, BS, H, D, "float32", False, layout)  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    layers = [rng.standard_normal(g.layer_shape).astype(np.float32) for _ in range(2)]
    out = np.empty((2, 2, len(ids) * BS, H * D), np.float32)
    gather_chunk(layers, np.array(ids), out, g)
    assert np.array_equal(out, _chunk_ref(layers, ids, layout))
    back = [np.zeros_like(x) for x in layers]
    scatter_chunk(out, back, np.array(ids), g)
    for a, b in zip(layers, back, strict=True):
        assert np.array_equal(a[:, ids], b[:, ids])


def test_a_chunk_moves_between_layouts() -> None:
    """What an NHD cache stores, an HND cache reads back (and vice versa) unchanged."""
    rng = np.random.default_rng(4)
    nhd = KVGeometry(1, NB, BS, H, D, "float32", False, "NHD")
    hnd = KVGeometry(1, NB, BS, H, D, "float32", False, "HND")
    src = rng.standard_normal(nhd.layer_shape).astype(np.float32)
    chunk = np.empty((2, 1, 2 * BS, H * D), np.float32)
    gather_chunk([src], np.array([3, 7]), chunk, nhd)
    dst = np.zeros(hnd.layer_shape, np.float32)
    scatter_chunk(chunk, [dst], np.array([1, 2]), hnd)
    assert np.array_equal(dst[:, 1:3].transpose(0, 1, 3, 2, 4), src[:, [3, 7]])


def test_wrap_numpy_is_zero_copy_and_infers_geometry() -> None:
    arrays = [np.zeros((2, NB, BS, H, D), np.float16) for _ in range(3)]
    kv = CpuKVCache.wrap(arrays, layout="NHD", block_size=BS)
    g = kv.geometry
    assert (g.num_layers, g.num_blocks, g.block_size, g.num_heads, g.head_dim, g.dtype,
            g.mla, g.layout) == (3, NB, BS, H, D, "float16", False, "NHD")
    assert kv.wrapped and kv.segment_names == [] and not kv.unlinked
    assert all(np.shares_memory(a, b) for a, b in zip(kv.layers, arrays, strict=True))
    arrays[1][1, 5, 2, 0, 4] = 7
    assert kv.block_bytes(1, 5) == arrays[1][:, 5].tobytes()
    kv.close()
    assert kv.closed and arrays[1][1, 5, 2, 0, 4] == 7  # the memory stays the caller's


def test_wrap_views_into_one_allocation_and_permuted_strides() -> None:
    """vLLM-style: one allocation, per-layer views; and a [blocks, 2, ...] tensor passed
    as a transposed view. Copies through the wrapped views equal the contiguous ones."""
    rng = np.random.default_rng(5)
    big = rng.integers(0, 2**16, (NB, 2, 2, BS, H, D), dtype=np.uint16)  # [blocks, L, 2,..]
    views = [big[:, li].transpose(1, 0, 2, 3, 4) for li in range(2)]  # [2, blocks, BS, H, D]
    kv = CpuKVCache.wrap(views, layout="NHD", dtype="bfloat16")
    assert kv.geometry.dtype == "bfloat16" and not views[0].flags.c_contiguous
    ids = np.array([4, 5, 6, 1])
    out = np.empty((2, 2, 4 * BS, H * D), np.uint16)
    gather_chunk(kv.layers, ids, out, kv.geometry)
    contiguous = [np.ascontiguousarray(v) for v in views]
    ref = np.empty_like(out)
    gather_chunk(contiguous, ids, ref, kv.geometry)
    assert np.array_equal(out, ref)
    scatter_chunk(out[:, :, ::-1].copy(), kv.layers, np.array([0, 2, 3, 8]), kv.geometry)
    assert np.shares_memory(kv.layers[0], big)
    # Target 8 got the reversed chunk's position 3 (source block 4, tokens reversed),
    # written through the view into `big`.
    assert np.array_equal(big[8, 1][:, ::-1], contiguous[1][:, 4])


def test_wrap_torch_tensors_bfloat16_both_directions() -> None:
    torch = pytest.importorskip("torch", reason="torch not installed: torch wrap untested")
    base = torch.zeros((NB, 2, 2, H, BS, D), dtype=torch.bfloat16)
    tensors = [base[:, li].transpose(0, 1) for li in range(2)]  # HND views, strided
    kv = CpuKVCache.wrap(tensors, layout="HND", block_size=BS)
    assert kv.geometry.dtype == "bfloat16" and kv.geometry.layout == "HND"
    assert kv.torch_layers[0] is tensors[0]
    kv.layers[1][0, 3, 2, 1, 4] = torch.tensor(1.5, dtype=torch.bfloat16).view(
        torch.int16).item()
    assert float(base[3, 1, 0, 2, 1, 4]) == 1.5
    kv.close()


def test_wrap_numpy_torch_views_share_memory() -> None:
    torch = pytest.importorskip("torch", reason="torch not installed: torch views untested")
    arrays = [np.zeros((2, NB, H, BS, D), np.uint16)]
    kv = CpuKVCache.wrap(arrays, dtype="bfloat16")
    t = kv.torch_layers[0]
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == arrays[0].shape
    t[1, 2, 0, 3, 4] = 2.0
    assert arrays[0][1, 2, 0, 3, 4] == torch.tensor(2.0, dtype=torch.bfloat16).view(
        torch.int16).item()


def test_wrap_mla_layers() -> None:
    kv = CpuKVCache.wrap([np.zeros((NB, BS, 64), np.float16)] * 2)
    assert kv.geometry.mla and kv.geometry.num_heads == 1 and kv.kv_layout is None


@pytest.mark.parametrize(("layers", "kwargs", "match"), [
    ([], {}, "non-empty"),
    (np.zeros((1, 2, NB, H, BS, D), np.float16), {}, "non-empty list"),
    ([np.zeros((2, NB, H, BS, D), np.uint16)], {}, "bfloat16"),
    ([np.zeros((2, NB, H, BS, D), np.float16)], {"block_size": H}, "layout right"),
    ([np.zeros((2, NB, H, BS, D), np.float16)], {"dtype": "float32"}, "item"),
    ([np.zeros((NB, 2, H, BS), np.float16)], {}, "transpose"),
    ([np.zeros((2, NB, H, BS, D), np.float16), np.zeros((2, NB, H, BS, D), np.float32)],
     {}, "one shape and dtype"),
    ([np.zeros((2, NB, H, BS, D), np.float16)], {"layout": "XYZ"}, "layout"),
    ([[0.0]], {}, "numpy arrays or torch"),
])
def test_wrap_refusals(layers: object, kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidArgument, match=match):
        CpuKVCache.wrap(layers, **kwargs)  # type: ignore[arg-type]


def test_wrap_refuses_read_only_and_lmcache_mode() -> None:
    ro = np.zeros((2, NB, H, BS, D), np.float16)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        CpuKVCache.wrap([ro])
    kv = CpuKVCache.wrap([np.zeros((2, NB, H, BS, D), np.float16)])
    with pytest.raises(InvalidArgument, match="mode='engine'"):
        kv.export_layers()
    # Refused before anything is sent: no server needed.
    with Client("tcp://127.0.0.1:1", timeout=0.5) as client, \
            pytest.raises(InvalidArgument, match="mode='engine'"):
        client.register(kv, model_name="m", mode="lmcache")
