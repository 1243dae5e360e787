"""CUDA VMM (cuMemCreate) exports through the fake driver: the fd / fabric export, its
lifetime, the refusals, and the descriptor each profile would send (or refuses to).

The descriptor bytes themselves are checked against LMCache 0.5.6's and 0.5.7rc2's own
encoder in test_codec_fixtures.py (wrappers.json, kind cuda_vmm); the GPU round trip
of a real export is scripts/gpu_check.py's VMM step.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from lmcache_mp import InvalidArgument, ProtocolMismatch
from lmcache_mp.ipc.base import STORAGE_DTYPES, KVGeometry, VmmLayerExport
from lmcache_mp.ipc.cuda import CudaKVCache, export_allocation, staging
from lmcache_mp.ipc.cuda.vmm import HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD
from lmcache_mp.ipc.paged_copy import gather_chunk
from lmcache_mp.protocol import get_profile
from lmcache_mp.protocol.wrappers import vmm_descriptor
from lmcache_mp.session.engine_driven import copy_from_slots, copy_into_slots

from ..support.fake_cuda import GRANULE, FakeDriver
from .test_cuda_engine_driven import CHUNK, object_shape, pool_and_slots

GEOM = {"num_blocks": 4, "block_size": 16, "num_heads": 2, "head_dim": 64,
        "dtype": "bfloat16"}
LAYER = 2 * 4 * 2 * 16 * 64 * 2  # bytes of one HND layer of GEOM


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def vmm_cache(drv: FakeDriver, types: int, offset: int = 4096) -> tuple[CudaKVCache, int]:
    base = drv.add_alloc(1 << 20, kind="vmm")
    drv.set_vmm_types(base, types)
    return CudaKVCache.from_pointers([base + offset, base + offset + LAYER], driver=drv,
                                     **GEOM), base  # type: ignore[arg-type]


def test_a_posix_fd_export_is_recorded_held_and_closed() -> None:
    drv = FakeDriver()
    cache, base = vmm_cache(drv, HANDLE_TYPE_POSIX_FD)
    recs = cache.export_layers()
    assert all(isinstance(r, VmmLayerExport) for r in recs)
    first, second = recs
    assert isinstance(first, VmmLayerExport) and isinstance(second, VmmLayerExport)
    assert (first.kind, first.fabric_blob, first.alloc_size) == ("posix_fd", None, 1 << 20)
    assert (first.alloc_offset, second.alloc_offset) == (4096, 4096 + LAYER)
    assert first.nbytes == LAYER and first.device_uuid == cache.device_uuid
    assert len(first.export_id) == 16 and first.export_id != second.export_id
    # One export (and one fd) per layer, as LMCache's wrapper does; the retained
    # allocation handle is always released again.
    assert len(drv.vmm_fds) == 2 and all(fd_open(fd) for fd in drv.vmm_fds)
    assert drv.vmm_retained == {base: 0}
    cache.close()
    assert not any(fd_open(fd) for fd in drv.vmm_fds)
    cache.close()  # idempotent


def test_a_fabric_export_travels_in_the_0_5_7_descriptor() -> None:
    drv = FakeDriver()
    cache, base = vmm_cache(drv, HANDLE_TYPE_FABRIC)
    recs = cache.export_layers()
    assert drv.vmm_fds == [] and all(isinstance(r, VmmLayerExport) and r.kind == "fabric"
                                     and r.fabric_blob == base.to_bytes(8, "little") * 8
                                     for r in recs)
    for family in ("0.5.6", "0.5.7"):
        payloads = get_profile(family).register_payloads(7, recs, "m", 1, "HND", [])
        assert [b.data for b in payloads["kv_caches"]] == [vmm_descriptor(r) for r in recs]  # type: ignore[arg-type]
    cache.close()


def test_fd_is_preferred_when_both_kinds_were_requested() -> None:
    """LMCache's order: a POSIX fd when the chunk allows one, else fabric."""
    drv = FakeDriver()
    cache, _ = vmm_cache(drv, HANDLE_TYPE_POSIX_FD | HANDLE_TYPE_FABRIC)
    assert {r.kind for r in cache.export_layers()} == {"posix_fd"}  # type: ignore[union-attr]
    cache.close()


@pytest.mark.parametrize("family", ["0.5.3", "0.5.5", "0.5.6", "0.5.7"])
def test_register_payloads_refuse_what_the_server_cannot_open(family: str) -> None:
    drv = FakeDriver()
    cache, _ = vmm_cache(drv, HANDLE_TYPE_POSIX_FD)
    profile = get_profile(family)
    match = "set_vmm_fd_resolver" if profile.wrappers.vmm is not None else \
        "cannot open CUDA VMM memory"
    with pytest.raises(ProtocolMismatch, match=match):
        profile.register_payloads(7, cache.export_layers(), "m", 1, "HND", [])
    cache.close()


def test_memory_created_without_a_shareable_type_is_engine_only_and_leaks_nothing() -> None:
    """No shareable handle type: the server cannot map it, this process still can (the
    engine-driven copies of issue 14); a server-copy export says why, nothing leaks."""
    drv = FakeDriver()
    cache, _ = vmm_cache(drv, 0)
    assert not cache.ipc_exportable and not cache.server_mappable
    with pytest.raises(InvalidArgument, match="requestedHandleTypes has neither"):
        cache.export_layers()
    assert drv.vmm_fds == [] and set(drv.vmm_retained.values()) == {0}


def test_a_view_spanning_two_chunks_is_refused_and_its_fd_closed() -> None:
    drv = FakeDriver()
    with pytest.raises(InvalidArgument, match="layer 1: .*more than one cuMemCreate chunk"):
        vmm_cache(drv, HANDLE_TYPE_POSIX_FD, offset=(1 << 20) - 2 * LAYER + 512)
    # Layer 0's fd (exported) and layer 1's (exported, then refused) are both closed.
    assert len(drv.vmm_fds) == 2 and not any(fd_open(fd) for fd in drv.vmm_fds)
    assert set(drv.vmm_retained.values()) == {0}


@pytest.mark.parametrize("wrapper", ["raw", "torch_ipc"])
def test_legacy_forms_cannot_carry_vmm_memory(wrapper: str) -> None:
    drv = FakeDriver()
    base = drv.add_alloc(1 << 20, kind="vmm")
    with pytest.raises(InvalidArgument, match="use wrapper='auto'"):
        CudaKVCache.from_pointers([base], driver=drv, wrapper=wrapper,  # type: ignore[arg-type]
                                  **GEOM)  # type: ignore[arg-type]
    assert not any(fd_open(fd) for fd in drv.vmm_fds)


def test_export_allocation_alone_still_refuses_vmm_memory_with_the_way_out() -> None:
    drv = FakeDriver()
    base = drv.add_alloc(1 << 20, kind="vmm")
    with pytest.raises(InvalidArgument, match="from_pointers / from_torch export VMM memory"):
        export_allocation(base, 4096, driver=drv)
    assert drv.vmm_fds == []


def test_pool_memory_is_never_taken_for_vmm() -> None:
    drv = FakeDriver()
    base = drv.add_alloc(1 << 20, kind="pool")
    cache = CudaKVCache.from_pointers([base], driver=drv, **GEOM)  # type: ignore[arg-type]
    assert not cache.ipc_exportable  # engine-driven only
    with pytest.raises(InvalidArgument, match="stream-ordered memory pool"):
        cache.export_layers()
    assert not any(c[0] == "vmm_retain" for c in drv.calls)


# ------------------------------------- views over several chunks (vLLM 0.34, PyTorch)
#: Two layers of [2, blocks, heads, block_size, head_dim] bf16, 6 MiB each: each
#: layer three 2 MiB chunks, as vLLM 0.34's extensible cache commits one segment (its
#: minimum, warm-up and final commits each map a chunk: utils/extensible_tensor.py).
MULTI = KVGeometry(2, 768, 16, 2, 64, "bfloat16", False)
#: Blocks in every chunk of both planes, on both sides of each boundary (4 KiB a block
#: per plane: 2 MiB is block 512 of the K plane; the V plane starts at 3 MiB, inside
#: the second chunk, and 4 MiB is its block 256).
SCATTERED = np.array([1, 511, 512, 700, 767, 255, 256, 400], np.int64)


def vllm_like(drv: FakeDriver, **kw: Any) -> list[int]:
    """The layers' pointers in a reservation of 2 MiB chunks mapped side by side (none
    exportable: vLLM's IN_PROCESS cache requests no handle type)."""
    n = MULTI.layer_nbytes // GRANULE
    base = drv.vmm_reservation([GRANULE] * (MULTI.num_layers * n), **kw)
    return [base + i * MULTI.layer_nbytes for i in range(MULTI.num_layers)]


def from_ptrs(drv: FakeDriver, ptrs: list[int]) -> CudaKVCache:
    g = MULTI
    return CudaKVCache.from_pointers(ptrs, num_blocks=g.num_blocks, block_size=g.block_size,
                                     num_heads=g.num_heads, head_dim=g.head_dim,
                                     dtype=g.dtype, driver=drv)


@pytest.mark.parametrize("copy", ["gather", "plan"])
def test_a_layer_over_several_chunks_moves_bytes_both_ways(
        copy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer spans three chunks (cuMemGetAddressRange answers one each): the
    registration walks them (every byte mapped device memory of device 0) and keeps
    the layers for engine-driven copies, which store and retrieve across the chunks'
    boundaries byte for byte (against the CPU cache's copies of the same blocks).
    Before: ``local_allocation`` wanted the layer inside one chunk and re-raised the
    export's refusal (vLLM 0.34's default cache on a GPU failed at start)."""
    if copy == "plan":
        monkeypatch.setenv("LMCACHE_MP_GPU_COPY", "plan")
    drv = FakeDriver()
    ptrs = vllm_like(drv)
    cache = from_ptrs(drv, ptrs)
    assert not cache.server_mappable and not cache.ipc_exportable
    assert [(e.base, e.size) for e in cache.exports] == [(p, MULTI.layer_nbytes) for p in ptrs]
    assert all(drv.address_range(p)[1] == GRANULE for p in ptrs)  # one chunk each
    with pytest.raises(InvalidArgument, match="requestedHandleTypes has neither"):
        cache.export_layers()
    rng = np.random.default_rng(3)
    dtype = STORAGE_DTYPES[MULTI.dtype][0]
    layers = []
    for p in ptrs:
        raw = drv._memory(p, MULTI.layer_nbytes)
        raw[:] = rng.integers(0, 256, MULTI.layer_nbytes, dtype=np.uint8)
        layers.append(raw.view(dtype).reshape(MULTI.layer_shape))
    per_chunk = CHUNK // MULTI.block_size
    n = len(SCATTERED) // per_chunk
    pool, slots, buf = pool_and_slots(MULTI, n)
    try:
        copy_into_slots(cache, SCATTERED, slots, list(range(n)), pool, CHUNK, stream=7)
        for i, slot in enumerate(slots):
            want = np.zeros(object_shape(MULTI), dtype)
            gather_chunk(layers, SCATTERED[i * per_chunk:(i + 1) * per_chunk], want, MULTI)
            assert buf[slot.offset:slot.offset + slot.length].tobytes() == want.tobytes()
        before = [layer.copy() for layer in layers]
        for layer in layers:
            layer[:, SCATTERED] = 0
        copy_from_slots(cache, SCATTERED, slots, pool, CHUNK, 0, stream=7)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(layers, before, strict=True))
    finally:
        for address in list(staging.pinned_pools()):
            staging._pinned.pop(address, None)
        cache.close()


def test_a_hole_or_another_devices_chunk_in_a_layer_is_refused_saying_where() -> None:
    """Engine-driven copies need every byte of a layer mapped on one device: a chunk of
    the reservation left unmapped (reserved, or released by sleep) or mapped from
    another device is refused at registration with the byte where it starts."""
    drv = FakeDriver(devices=2)
    with pytest.raises(InvalidArgument, match=r"layer 0: .*byte 2097152 .* not mapped .*"
                                              r"hole in the VMM reservation"):
        from_ptrs(drv, vllm_like(drv, holes={1}))
    with pytest.raises(InvalidArgument, match=r"layer 1: .*start on device 0 and byte "
                                              r"4194304 .* is on device 1"):
        from_ptrs(drv, vllm_like(drv, devices=[0, 0, 0, 0, 0, 1]))


def test_expandable_segments_pages_export_alone_and_a_longer_layer_is_engine_driven() -> None:
    """PyTorch's expandable segments map one POSIX-fd handle per 20 MiB page: a layer
    inside one page is exported for the server as before; a layer spanning two pages
    cannot be (one handle maps one chunk), so the cache is engine-driven only; every
    fd exported on the way is closed and every retained handle released."""
    drv = FakeDriver()
    g = KVGeometry(2, 1024, 16, 8, 64, "bfloat16", False)  # 32 MiB per layer
    base = drv.expandable_segment(g.num_layers * g.layer_nbytes)
    inside = CudaKVCache.from_pointers([base, base + (1 << 20)], num_blocks=16,
                                       block_size=16, num_heads=8, head_dim=64, driver=drv)
    assert inside.ipc_exportable and {e.vmm.kind for e in inside.exports  # type: ignore[union-attr]
                                      } == {"posix_fd"}
    inside.close()
    spanning = CudaKVCache.from_pointers(
        [base + i * g.layer_nbytes for i in range(g.num_layers)], num_blocks=g.num_blocks,
        block_size=16, num_heads=8, head_dim=64, driver=drv)
    assert not spanning.ipc_exportable and not spanning.server_mappable
    # Each layer's pages: [0, 40) MiB for layer 0, [20, 80) MiB for layer 1.
    assert [(e.base - base, e.size) for e in spanning.exports] == [(0, 40 << 20),
                                                                  (20 << 20, 60 << 20)]
    with pytest.raises(InvalidArgument, match="more than one cuMemCreate chunk"):
        spanning.export_layers()
    assert not any(fd_open(fd) for fd in drv.vmm_fds) and set(drv.vmm_retained.values()) == {0}
    spanning.close()


# ------------------------------------------- the server's own receiving code (CPU)
_RECEIVER = r"""
import json, sys
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmcache.v1.platform.devices.cuda import ipc_wrapper as iw
out = []
for hexdata in json.loads(sys.argv[1]):
    w = DeviceIPCWrapper.Deserialize(bytes.fromhex(hexdata))
    row = {"cls": type(w).__name__, "kind": w._kind, "export_id": w._export_id.hex(),
           "alloc_size": w._alloc_size, "alloc_offset": w._alloc_offset,
           "nbytes": w._nbytes, "fd": w._fd, "shape": list(w.shape)}
    try:  # what to_tensor() asks first for a posix_fd descriptor
        iw._resolve_vmm_fd(w._export_id)
        row["resolver"] = "installed"
    except RuntimeError as exc:
        row["resolver"] = str(exc)
    out.append(row)
print(json.dumps(out))
"""


@pytest.mark.live
def test_the_release_reads_our_descriptors_and_has_no_fd_receiver() -> None:
    """Our cuda_vmm bytes, decoded by the release's own DeviceIPCWrapper.Deserialize in
    its oracle venv (no GPU needed up to the import), and the reason posix_fd is
    refused: a fresh LMCache process has no fd resolver installed."""
    import json
    import subprocess

    from ..conftest import EXPECTED_FAMILY, SERVER_VERSION, oracle_python

    if get_profile(EXPECTED_FAMILY[SERVER_VERSION]).wrappers.vmm is None:
        pytest.skip(f"LMCache {SERVER_VERSION} has no cuda_vmm descriptor")
    drv = FakeDriver()
    fd_cache, _ = vmm_cache(drv, HANDLE_TYPE_POSIX_FD)
    fabric_cache, _ = vmm_cache(drv, HANDLE_TYPE_FABRIC)
    recs = [*fd_cache.export_layers(), *fabric_cache.export_layers()]
    proc = subprocess.run(
        [str(oracle_python()), "-c", _RECEIVER,
         json.dumps([vmm_descriptor(r).hex() for r in recs])],  # type: ignore[arg-type]
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for rec, row in zip(recs, rows, strict=True):
        assert isinstance(rec, VmmLayerExport)
        assert row["cls"] == "VmmCudaIPCWrapper" and row["fd"] is None
        assert (row["kind"], row["export_id"], row["alloc_size"], row["alloc_offset"],
                row["nbytes"], tuple(row["shape"])) == (
            rec.kind, rec.export_id.hex(), rec.alloc_size, rec.alloc_offset, rec.nbytes,
            rec.shape)
        assert "No VMM fd resolver installed" in row["resolver"]
    fd_cache.close()
    fabric_cache.close()
