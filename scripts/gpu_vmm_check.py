#!/usr/bin/env python3
"""The GPU check of CUDA VMM exports (run by gpu_check.sh's "vmm export" step).

Creates VMM memory the way vLLM's cumem allocator does (``cuMemCreate`` with a POSIX-fd
shareable type, ``cuMemAddressReserve`` / ``cuMemMap`` / ``cuMemSetAccess``), fills two
layers with known bytes, builds a ``CudaKVCache.from_pointers`` over them (the layers
start inside the chunk, as a caching allocator's would), and checks:

1. each layer is exported as LMCache's ``cuda_vmm`` record: kind ``posix_fd``, a live
   fd, the chunk's size, the layer's offset in it;
2. the fd names that very memory: it is imported and mapped in this process exactly as
   LMCache's ``VmmCudaIPCWrapper._import_and_map`` does on the server side, and the
   bytes read through the new mapping equal those written (no LMCache release up to
   0.5.7rc2 can receive the fd itself: it has no fd transport, see
   lmcache_mp/ipc/cuda/vmm.py);
3. the 0.5.6 / 0.5.7 profiles refuse to REGISTER it (ProtocolMismatch), and a
   fabric-exportable chunk, where the device supports fabric handles, travels inline;
4. closing the cache closes the fds.

Prints one JSON object. Exit status: 0 all checks passed, 1 a check failed, 3 no GPU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POSIX_FD, FABRIC = 0x1, 0x8


def check(cu: Any, result: Any, what: str) -> Any:
    result = result if isinstance(result, tuple) else (result,)
    if int(result[0]) != 0:
        raise RuntimeError(f"{what} failed: {result[0]}")
    return result[1] if len(result) == 2 else result[1:]


def create_vmm(cu: Any, device: int, handle_type: int, want: int) -> tuple[Any, int, int]:
    """cuMemCreate + reserve + map + access, as a cumem allocator does: (handle, ptr, size)."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType(handle_type)
    gran = int(check(cu, cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity"))
    size = (want + gran - 1) // gran * gran
    handle = check(cu, cu.cuMemCreate(size, prop, 0), "cuMemCreate")
    ptr = check(cu, cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    check(cu, cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
    set_access(cu, ptr, size, device)
    return handle, int(ptr), size


def set_access(cu: Any, ptr: Any, size: int, device: int) -> None:
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check(cu, cu.cuMemSetAccess(ptr, size, [access], 1), "cuMemSetAccess")


def destroy(cu: Any, handle: Any, ptr: int, size: int) -> None:
    cu.cuMemUnmap(ptr, size)
    cu.cuMemAddressFree(ptr, size)
    cu.cuMemRelease(handle)


def read_through_import(cu: Any, fd: int, size: int, offset: int, nbytes: int,
                        device: int) -> bytes:
    """The server's side (LMCache's _import_and_map), in this process: import the fd,
    map the chunk at a fresh address, read the layer's bytes through that mapping."""
    dup = os.dup(fd)  # the import takes the fd over; the cache keeps its own
    try:
        handle = check(cu, cu.cuMemImportFromShareableHandle(
            dup, cu.CUmemAllocationHandleType(POSIX_FD)), "cuMemImportFromShareableHandle")
    finally:
        os.close(dup)
    base = check(cu, cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve (import)")
    try:
        check(cu, cu.cuMemMap(base, size, 0, handle, 0), "cuMemMap (import)")
        set_access(cu, base, size, device)
        out = bytearray(nbytes)
        check(cu, cu.cuMemcpyDtoH(out, int(base) + offset, nbytes), "cuMemcpyDtoH")
        return bytes(out)
    finally:
        destroy(cu, handle, int(base), size)


def main() -> int:
    from lmcache_mp import ProtocolMismatch
    from lmcache_mp.ipc.base import VmmLayerExport
    from lmcache_mp.ipc.cuda import CudaError, CudaKVCache, get_driver
    from lmcache_mp.protocol import get_profile

    report: dict[str, Any] = {"checks": {}}
    try:
        drv = get_driver()
        if drv.device_count() < 1:
            raise CudaError("no CUDA device")
        drv.set_device(0)
        from cuda.bindings import driver as cu
    except Exception as exc:  # noqa: BLE001 - any failure here means "no usable GPU"
        print(json.dumps({"skipped": f"no GPU: {exc}"}))
        return 3
    geom = {"num_blocks": 8, "block_size": 16, "num_heads": 2, "head_dim": 64,
            "dtype": "bfloat16"}
    layer = 2 * 8 * 2 * 16 * 64 * 2
    offset = 4096  # layers start inside the chunk, as a caching allocator's do
    handle, ptr, size = create_vmm(cu, 0, POSIX_FD, offset + 2 * layer)
    ok = True
    try:
        ptrs = [ptr + offset, ptr + offset + layer]
        for i, p in enumerate(ptrs):
            check(cu, cu.cuMemsetD8(p, 0xA5 ^ i, layer), "cuMemsetD8")
        check(cu, cu.cuCtxSynchronize(), "cuCtxSynchronize")
        cache = CudaKVCache.from_pointers(ptrs, **geom)  # type: ignore[arg-type]
        recs = cache.export_layers()
        fds = [e.vmm.fd for e in cache.exports if e.vmm is not None]
        good = all(isinstance(r, VmmLayerExport) and r.kind == "posix_fd"
                   and r.alloc_size == size and r.alloc_offset == offset + i * layer
                   for i, r in enumerate(recs)) and len(fds) == 2
        report["checks"]["export"] = {"ok": good, "records": [repr(r)[:200] for r in recs]}
        same = [read_through_import(cu, fd, size, offset + i * layer, layer, 0)  # type: ignore[arg-type]
                == bytes([0xA5 ^ i]) * layer for i, fd in enumerate(fds)]
        report["checks"]["fd names the memory"] = {"ok": all(same), "layers": same}
        refused = []
        for family in ("0.5.6", "0.5.7"):
            try:
                get_profile(family).register_payloads(1, recs, "m", 1, "HND", [])
                refused.append(False)
            except ProtocolMismatch:
                refused.append(True)
        report["checks"]["posix_fd refused"] = {"ok": all(refused)}
        cache.close()
        closed = all(not _fd_open(fd) for fd in fds)  # type: ignore[arg-type]
        report["checks"]["fds closed"] = {"ok": closed}
        report["checks"]["fabric"] = fabric_check(cu, geom, layer)
        ok = all(c.get("ok", True) for c in report["checks"].values())
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the run goes on
        report["error"] = f"{type(exc).__name__}: {exc}"
        ok = False
    finally:
        destroy(cu, handle, ptr, size)
    report["ok"] = ok
    print(json.dumps(report))
    return 0 if ok else 1


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def fabric_check(cu: Any, geom: dict[str, Any], layer: int) -> dict[str, Any]:
    """A fabric-exportable chunk, where the device has fabric handles (IMEX): exported
    inline as a 64-byte blob; the 0.5.7 profile encodes it."""
    from lmcache_mp.ipc.base import VmmLayerExport
    from lmcache_mp.ipc.cuda import CudaKVCache
    from lmcache_mp.protocol import get_profile

    attr = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED", None)
    if attr is None or not check(cu, cu.cuDeviceGetAttribute(attr, 0), "cuDeviceGetAttribute"):
        return {"skipped": "the device has no fabric handle support"}
    try:
        handle, ptr, size = create_vmm(cu, 0, FABRIC, layer)
    except RuntimeError as exc:  # no IMEX channel: cuMemCreate refuses FABRIC
        return {"skipped": str(exc)}
    try:
        cache = CudaKVCache.from_pointers([ptr], **geom)  # type: ignore[arg-type]
        (rec,) = cache.export_layers()
        blobs = get_profile("0.5.7").register_payloads(1, [rec], "m", 1, "HND", [])[1]
        cache.close()
        good = isinstance(rec, VmmLayerExport) and rec.kind == "fabric" \
            and rec.fabric_blob is not None and len(rec.fabric_blob) == 64 and len(blobs) == 1
        return {"ok": good}
    finally:
        destroy(cu, handle, ptr, size)


if __name__ == "__main__":
    sys.exit(main())
