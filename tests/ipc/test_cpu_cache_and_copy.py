"""The SHM-backed CPU KV cache and the paged <-> chunk copies (no server needed)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lmcache_mp import CacheKey, CpuKVCache, InvalidArgument
from lmcache_mp.ipc.cpu_cache import KVGeometry
from lmcache_mp.ipc.paged_copy import block_runs, gather_chunk, scatter_chunk
from lmcache_mp.ipc.shm import NAME_PREFIX, SHM_DIR, PageMapper
from lmcache_mp.protocol.types import EngineGroupInfo
from lmcache_mp.session.blocks import TransferLayout, normalize_block_ids


def ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{NAME_PREFIX}{os.getpid()}_")}


def test_allocate_layout_permissions_and_close() -> None:
    before = ours()
    kv = CpuKVCache.allocate(num_layers=3, num_blocks=10, block_size=16, num_heads=4,
                             head_dim=8, dtype="bfloat16")
    try:
        assert len(kv.layers) == 3
        assert kv.layers[0].shape == (2, 10, 4, 16, 8)  # HND
        assert kv.layers[0].dtype == np.uint16  # bfloat16 bits
        names = kv.segment_names
        assert len(set(names)) == 3 and all(n.startswith("/" + NAME_PREFIX) for n in names)
        for n in names:
            st = os.stat(os.path.join(SHM_DIR, n[1:]))
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_size == 2 * 10 * 4 * 16 * 8 * 2  # numel * itemsize, offset 0
        assert not any(layer.any() for layer in kv.layers)
        assert ours() - before == {n[1:] for n in names}
    finally:
        kv.close()
    assert ours() == before
    assert kv.closed
    kv.close()  # idempotent


def test_mla_layout_is_one_plane() -> None:
    with CpuKVCache.allocate(num_layers=2, num_blocks=5, block_size=32, num_heads=1,
                             head_dim=576, dtype="float16", mla=True) as kv:
        assert kv.layers[0].shape == (5, 32, 576)
        assert kv.geometry.hidden_dim == 576 and kv.geometry.kv_planes == 1
    with pytest.raises(InvalidArgument, match="num_heads=1"):
        CpuKVCache.allocate(num_layers=1, num_blocks=1, block_size=16, num_heads=2,
                            head_dim=8, mla=True)


@pytest.mark.parametrize("bad", [dict(dtype="float128"), dict(num_blocks=0),
                                 dict(block_size=True), dict(head_dim=-1)])
def test_allocate_rejects_bad_geometry(bad: dict) -> None:  # type: ignore[type-arg]
    args = dict(num_layers=1, num_blocks=4, block_size=16, num_heads=2, head_dim=8)
    args.update(bad)
    with pytest.raises(InvalidArgument):
        CpuKVCache.allocate(**args)  # type: ignore[arg-type]


def test_torch_views_share_memory_with_numpy() -> None:
    torch = pytest.importorskip("torch", reason="torch not installed: torch views untested")
    with CpuKVCache.allocate(num_layers=1, num_blocks=4, block_size=16, num_heads=2,
                             head_dim=8, dtype="bfloat16") as kv:
        t = kv.torch_layers[0]
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == kv.layers[0].shape
        t[1, 2, 1, 3, 4] = 1.5
        assert kv.layers[0][1, 2, 1, 3, 4] == torch.tensor(1.5, dtype=torch.bfloat16).view(
            torch.int16).item()
        del t


def test_segments_are_unlinked_at_exit_and_after_exceptions() -> None:
    code = textwrap.dedent("""
        import os, sys
        from lmcache_mp import CpuKVCache
        kv = CpuKVCache.allocate(num_layers=2, num_blocks=4, block_size=16, num_heads=1,
                                 head_dim=8)
        held = kv.layers[0]  # a live view must not block cleanup
        print(" ".join(kv.segment_names), flush=True)
        if sys.argv[1] == "raise":
            raise RuntimeError("boom")
        """)
    for mode in ("exit", "raise"):
        proc = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True)
        names = proc.stdout.split()
        assert len(names) == 2, proc.stderr
        assert (proc.returncode != 0) == (mode == "raise")
        for n in names:
            assert not os.path.exists(os.path.join(SHM_DIR, n[1:])), f"{n} left after {mode}"


def test_unlink_keeps_memory_usable() -> None:
    with CpuKVCache.allocate(num_layers=1, num_blocks=2, block_size=16, num_heads=1,
                             head_dim=8, dtype="float32") as kv:
        kv.unlink()
        assert kv.unlinked and not ours() & {n[1:] for n in kv.segment_names}
        kv.layers[0][...] = 3.0
        assert kv.layers[0].sum() == 3.0 * kv.layers[0].size


def test_block_runs() -> None:
    assert block_runs(np.array([], dtype=np.int64)) == []
    assert block_runs(np.array([4, 5, 6, 9, 10, 2])) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("ids", [list(range(3, 11)), [7, 1, 5, 0, 2, 9, 4, 11],
                                 [0, 1, 2, 3, 10, 11, 12, 13]])
def test_gather_then_scatter_is_exact_and_token_major(mla: bool, ids: list[int]) -> None:
    g = KVGeometry(num_layers=3, num_blocks=16, block_size=4, num_heads=1 if mla else 3,
                   head_dim=5, dtype="float32", mla=mla)
    rng = np.random.default_rng(7)
    layers = [rng.standard_normal(g.layer_shape).astype(np.float32) for _ in range(3)]
    ids_arr = np.array(ids)
    chunk_tokens = len(ids) * g.block_size
    obj_shape = ((3, chunk_tokens, g.hidden_dim) if mla
                 else (2, 3, chunk_tokens, g.hidden_dim))
    obj = np.zeros(obj_shape, dtype=np.float32)
    gather_chunk(layers, ids_arr, obj, g)
    # Token t of the chunk lives in block ids[t // bs], slot t % bs; heads then dims.
    for li in range(3):
        for t in range(chunk_tokens):
            b, s = ids[t // g.block_size], t % g.block_size
            if mla:
                np.testing.assert_array_equal(obj[li, t], layers[li][b, s])
            else:
                for kv in range(2):
                    np.testing.assert_array_equal(obj[kv, li, t], layers[li][kv, b, :, s, :].reshape(-1))
    targets = [np.zeros_like(x) for x in layers]
    scatter_chunk(obj, targets, ids_arr, g, skip_blocks=2)
    for li in range(3):
        for j, b in enumerate(ids):
            got = targets[li][b] if mla else targets[li][:, b]
            want = layers[li][b] if mla else layers[li][:, b]
            if j < 2:
                assert not got.any()  # skipped blocks untouched
            else:
                np.testing.assert_array_equal(got, want)


def _reg(num_blocks: int = 64, groups: int = 1) -> TransferLayout:
    infos = tuple(EngineGroupInfo(engine_group_id=i, layer_indices=(i,), tokens_per_block=16)
                  for i in range(groups))
    return TransferLayout(1, "m", 1, 256, infos, 16, num_blocks)


def _k(start: int = 0, end: int = 512) -> CacheKey:
    return CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=list(range(512)),
                    start=start, end=end, request_id="r")


def test_block_id_normalisation_and_checks() -> None:
    reg = _reg()
    assert normalize_block_ids(list(range(32)), _k(), reg, "STORE") == [list(range(32))]
    assert normalize_block_ids([list(range(16))], _k(256), reg, "STORE") == [list(range(16))]
    assert normalize_block_ids(np.arange(32), _k(), reg, "STORE") == [list(range(32))]
    for bad, msg in [(list(range(31)), "exactly 32"), (list(range(33)), "exactly 32"),
                     ([64] + list(range(31)), "outside"), ([-1] + list(range(31)), "outside"),
                     ([True] + list(range(31)), "outside"),
                     ([list(range(16)), list(range(16))], "group")]:
        with pytest.raises(InvalidArgument, match=msg):
            normalize_block_ids(bad, _k(), reg, "STORE")
    reg.check_key(_k(), "STORE")
    with pytest.raises(InvalidArgument, match="multiples"):
        reg.check_key(_k(0, 300), "STORE")
    with pytest.raises(InvalidArgument, match="empty"):
        reg.check_key(_k(256, 256), "STORE")
    with pytest.raises(InvalidArgument, match="registered"):
        reg.check_key(_k().replace(model_name="other"), "STORE")



class _RecordingMapping:
    """An mmap stand-in that records madvise calls (and can refuse them)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.error = error

    def madvise(self, option: int, start: int, length: int) -> None:
        self.calls.append((option, start, length))
        if self.error is not None:
            raise self.error


def test_pool_pages_are_mapped_once_per_granule_before_copies() -> None:
    g = PageMapper.GRANULE
    m = _RecordingMapping()
    pages = PageMapper(m, 5 * g + 100)  # type: ignore[arg-type]
    pages.prepare(g - 10, 20)           # straddles granules 0 and 1
    pages.prepare(g + 5, g)             # 1 again (nothing) and 2
    pages.prepare(5 * g, 100)           # the short last granule, clipped to the pool
    assert [(s, n) for _, s, n in m.calls] == [(0, g), (g, g), (2 * g, g), (5 * g, 100)]
    assert all(option == 23 for option, _, _ in m.calls)  # MADV_POPULATE_WRITE
    pages.prepare(0, 3 * g)
    assert len(m.calls) == 4  # mapped already: no call


def test_a_kernel_without_populate_advice_costs_one_refused_call() -> None:
    m = _RecordingMapping(OSError(22, "Invalid argument"))
    pages = PageMapper(m, 4 * PageMapper.GRANULE)  # type: ignore[arg-type]
    pages.prepare(0, 10)
    pages.prepare(3 * PageMapper.GRANULE, 10)
    assert len(m.calls) == 1  # the copy takes its own page faults, as before


def test_page_mapping_really_maps_a_shared_segment() -> None:
    import mmap
    import resource

    size = 4 * PageMapper.GRANULE
    path = os.path.join(SHM_DIR, f"{NAME_PREFIX}pagemap_{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        pages = PageMapper(m, size)
        pages.prepare(0, 2 * PageMapper.GRANULE)
        view = np.frombuffer(m, dtype=np.uint8)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        view[: 2 * PageMapper.GRANULE] = 7  # 1024 pages, mapped already
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        del view
        m.close()
        if not pages.supported:  # a kernel before 5.14: the copies fault as before
            pytest.skip("this kernel refuses MADV_POPULATE_WRITE (Linux 5.14+)")
        assert faults < 64, faults
    finally:
        os.close(fd)
        os.unlink(path)
