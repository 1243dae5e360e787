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
4. closing the cache closes the fds;
5. vLLM 0.34's extensible cache as its ``ExtensibleTensor`` commits it (issue 34): one
   reservation, a chunk with no shareable handle type mapped per commit, side by side,
   each layer over three: ``cuMemGetAddressRange`` answers the chunk holding a pointer
   (what the fake driver models and the registration's chunk walk relies on), every
   chunk is device memory of device 0, the cache registers for engine-driven copies
   only, and they move every block both ways across the chunks' boundaries, bytes
   compared with what ``cuMemcpyDtoH`` reads.

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
        report["checks"]["multi-chunk"] = multi_chunk_check(cu)
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


def multi_chunk_check(cu: Any) -> dict[str, Any]:
    """Check 5 of the module docstring."""
    import numpy as np

    from lmcache_mp.ipc.base import STORAGE_DTYPES, KVGeometry
    from lmcache_mp.ipc.cuda import CudaKVCache, get_driver
    from lmcache_mp.ipc.paged_copy import gather_chunk, scatter_chunk
    from lmcache_mp.protocol.types import PoolSlot
    from lmcache_mp.session.engine_driven import Pool, copy_from_slots, copy_into_slots

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = int(check(cu, cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity"))
    gran = max(gran, 2 << 20)  # vLLM floors its granule at 2 MiB
    # Two HND layers of three granules each: 4 KiB a block per plane.
    g = KVGeometry(2, 3 * gran // (2 * 2 * 16 * 64 * 2), 16, 2, 64, "bfloat16", False)
    total = g.num_layers * g.layer_nbytes
    res = int(check(cu, cu.cuMemAddressReserve(total, 0, 0, 0), "cuMemAddressReserve"))
    handles: list[Any] = []
    out: dict[str, Any] = {}
    try:
        for i in range(total // gran):  # one cuMemCreate per commit, as vLLM's
            handles.append(check(cu, cu.cuMemCreate(gran, prop, 0), "cuMemCreate"))
            check(cu, cu.cuMemMap(res + i * gran, gran, 0, handles[-1], 0), "cuMemMap")
        set_access(cu, res, total, 0)
        base, size = check(cu, cu.cuMemGetAddressRange(res + gran + 100),
                           "cuMemGetAddressRange")
        out["address range is the chunk"] = (int(base), int(size)) == (res + gran, gran)
        drv = get_driver()
        out["every chunk device memory of device 0"] = all(
            drv.pointer_attribute(res + i * gran, "MEMORY_TYPE") == 2
            and drv.pointer_attribute(res + i * gran, "IS_LEGACY_CUDA_IPC_CAPABLE") == 0
            and drv.pointer_device(res + i * gran) == 0 for i in range(len(handles)))
        rng = np.random.default_rng(5)
        host = rng.integers(0, 256, total, dtype=np.uint8)
        check(cu, cu.cuMemcpyHtoD(res, host, total), "cuMemcpyHtoD")
        ptrs = [res + i * g.layer_nbytes for i in range(g.num_layers)]
        cache = CudaKVCache.from_pointers(ptrs, num_blocks=g.num_blocks, block_size=16,
                                          num_heads=2, head_dim=64, dtype="bfloat16")
        out["registered engine-driven only"] = not cache.ipc_exportable and [
            (e.base, e.size) for e in cache.exports] == [(p, g.layer_nbytes) for p in ptrs]
        dtype = STORAGE_DTYPES[g.dtype][0]
        layers = [host[i * g.layer_nbytes:(i + 1) * g.layer_nbytes].view(dtype)
                  .reshape(g.layer_shape) for i in range(g.num_layers)]
        # A plane is 1.5 granules: the K plane crosses a chunk at block 2n/3, the V
        # plane (from 1.5 granules) at block n/3: blocks on both sides of both.
        per = g.num_blocks // 3
        ids = np.array([1, 2 * per - 1, 2 * per, 2 * per + 5, g.num_blocks - 1, per - 1,
                        per, per + 9], np.int64)
        chunk = 4 * g.block_size
        shape = [2, g.num_layers, chunk, g.hidden_dim]
        nbytes = int(np.prod(shape)) * g.itemsize
        buf = np.zeros(2 * nbytes, np.uint8)
        slots = [PoolSlot(offset=i * nbytes, length=nbytes, shape=shape, dtype=g.dtype)
                 for i in range(2)]
        pool = Pool("gpu-vmm-check", len(buf), 0, buf)
        copy_into_slots(cache, ids, slots, [0, 1], pool, chunk, stream=0)
        stored = True
        for i, slot in enumerate(slots):
            want = np.zeros(shape, dtype)
            gather_chunk(layers, ids[4 * i:4 * i + 4], want, g)
            stored &= buf[slot.offset:slot.offset + nbytes].tobytes() == want.tobytes()
        out["store across chunks"] = stored
        buf[:] = rng.integers(0, 256, len(buf), dtype=np.uint8)
        for i, slot in enumerate(slots):
            obj = buf[slot.offset:slot.offset + nbytes].view(dtype).reshape(shape)
            scatter_chunk(obj, layers, ids[4 * i:4 * i + 4], g)
        copy_from_slots(cache, ids, slots, pool, chunk, 0, stream=0)
        back = np.empty(total, np.uint8)
        check(cu, cu.cuMemcpyDtoH(back, res, total), "cuMemcpyDtoH")
        out["retrieve across chunks"] = back.tobytes() == host.tobytes()
        cache.close()
    finally:
        check(cu, cu.cuCtxSynchronize(), "cuCtxSynchronize")
        cu.cuMemUnmap(res, total)
        for h in handles:
            cu.cuMemRelease(h)
        cu.cuMemAddressFree(res, total)
    out["ok"] = all(v for v in out.values())
    return out


if __name__ == "__main__":
    sys.exit(main())
