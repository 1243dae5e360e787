"""CUDA VMM (cuMemCreate) exports through the fake driver: the fd / fabric export, its
lifetime, the refusals, and the descriptor each profile would send (or refuses to).

The descriptor bytes themselves are checked against LMCache 0.5.6's and 0.5.7rc2's own
encoder in test_codec_fixtures.py (wrappers.json, kind cuda_vmm); the GPU round trip
of a real export is scripts/gpu_check.py's VMM step.
"""

from __future__ import annotations

import os

import pytest

from lmcache_mp import InvalidArgument, ProtocolMismatch
from lmcache_mp.ipc.base import VmmLayerExport
from lmcache_mp.ipc.cuda import CudaKVCache, export_allocation
from lmcache_mp.ipc.cuda.vmm import HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD
from lmcache_mp.protocol import get_profile
from lmcache_mp.protocol.wrappers import vmm_descriptor

from ..support.fake_cuda import FakeDriver

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
