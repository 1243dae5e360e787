"""Exporting device memory and ordering transfers: what one layer's CUDA IPC export
is, the device/context and stream rules, the caller's per-transfer event, and which
reply events can be waited on.

Memory. A ``cudaIpcMemHandle_t`` always names a whole ``cudaMalloc`` allocation and
maps at its base; :func:`export_allocation` records where the pointer sits in it (the
``raw`` form of LMCache 0.5.3 carries no offset, so its encoder refuses a non-zero
one). Memory from CUDA VMM (``cuMemCreate``: PyTorch's ``expandable_segments:True``,
cumem allocators), from a stream-ordered pool (``cudaMallocAsync``), managed or host
memory cannot be exported with ``cudaIpcGetMemHandle`` and is refused, saying why; the
caches keep such device memory as a handle-less record for engine-driven transfers
(:func:`export_or_local`).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ...checks import non_negative_int, positive_int
from ...errors import InvalidArgument
from .driver import (
    CU_MEMORYTYPE_DEVICE,
    IPC_HANDLE_SIZE,
    TIMELINE_EVENT_HANDLE_SIZE,
    CudaDriver,
    CudaError,
    UnsupportedServerEvent,
    get_driver,
)
from .vmm import VmmShare, export_vmm

__all__ = [
    "ExportedAllocation",
    "TransferEvent",
    "export_allocation",
    "export_or_local",
    "local_allocation",
    "mapped_range",
    "on_device",
    "default_stream",
    "stream_handle",
    "check_server_event",
]


@contextmanager
def on_device(driver: CudaDriver, device: int) -> Iterator[None]:
    """Run with ``device``'s primary context current, then restore the caller's device.

    A thread that never touched CUDA has no current context even though cudaGetDevice
    says 0: driver-API calls would then fail, so make the device current in that case
    too (nothing to restore: the thread had no context)."""
    prev = driver.get_device()
    switched = prev != device
    if switched or driver.current_context() == 0:
        driver.set_device(device)
    try:
        yield
    finally:
        if switched:
            driver.set_device(prev)


def stream_handle(stream: object) -> int:
    """The ``cudaStream_t`` value of an explicit ``stream``: an int handle (0 is the
    legacy default stream), a torch.cuda.Stream (``.cuda_stream``), any object with the
    CUDA stream protocol (``__cuda_stream__``, e.g. cupy), or a cuda-bindings
    ``cudaStream_t`` / ``CUstream``. (``None`` is resolved by the cache, which knows
    the device: see :func:`~lmcache_mp.ipc.cuda.export.default_stream`.)"""
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise InvalidArgument("stream must be a CUDA stream or None, got a bool")
    if isinstance(stream, int):
        value = stream
    elif hasattr(stream, "cuda_stream"):  # torch.cuda.Stream / ExternalStream
        value = int(stream.cuda_stream)
    elif hasattr(stream, "__cuda_stream__"):
        value = int(stream.__cuda_stream__()[1])
    else:
        try:
            value = int(stream)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"stream must be None, an int handle, a torch.cuda.Stream or a "
                f"cuda-bindings stream, got {type(stream).__name__}"
            ) from None
    if value < 0:
        raise InvalidArgument(f"a CUDA stream handle is non-negative, got {value}")
    return value


def default_stream(device: int) -> int:
    """The stream ``stream=None`` means: torch's current stream on ``device`` when this
    process has torch with CUDA initialised, else the legacy default stream (0).

    Why: PyTorch's own streams are created ``cudaStreamNonBlocking``
    (``c10/cuda/CUDAStream.cpp``: ``kDefaultFlags``), and the legacy default stream
    does not wait for non-blocking streams, so a bare 0 would let the server read
    blocks that a ``with torch.cuda.stream(s):`` block is still writing. torch is never
    imported here: if nothing imported it, no torch work can be pending."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None:
        return 0
    try:
        if not cuda.is_initialized():
            return 0
        return int(cuda.current_stream(device).cuda_stream)
    except Exception:  # a torch without CUDA support, or a partial import
        return 0


# ------------------------------------------------------------------ export
@dataclass(frozen=True)
class ExportedAllocation:
    """A pointer's CUDA IPC export: the allocation's memory handle, where the pointer
    sits in it, and the device that holds it."""

    handle: bytes
    ptr: int
    base: int
    size: int
    device: int
    # VMM memory: its export instead of a legacy handle (``handle`` is then empty).
    vmm: VmmShare | None = None
    # Neither: memory only this process can reach (engine-driven mode only); why the
    # server cannot map it, for the error a server-copy registration gets.
    local_reason: str = ""

    @property
    def offset(self) -> int:
        return self.ptr - self.base


_VMM_HINT = (" (CudaKVCache.from_pointers / from_torch export VMM memory with "
             "cuMemExportToShareableHandle instead, for LMCache 0.5.6+)")


def _not_ipc_capable_reason(driver: CudaDriver, ptr: int) -> str:
    if driver.pointer_attribute(ptr, "MEMPOOL_HANDLE"):
        return ("it comes from a stream-ordered memory pool (cudaMallocAsync, e.g. "
                "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)")
    if driver.pointer_attribute(ptr, "IS_MANAGED"):
        return "it is managed (unified) memory"
    return ("it is CUDA virtual memory (cuMemCreate / cuMemMap), e.g. PyTorch's "
            "expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or a "
            "cumem allocator")


def export_allocation(
    ptr: int, nbytes: int, *, allow_offset: bool = False, driver: CudaDriver | None = None,
    vmm: bool = False,
) -> ExportedAllocation:
    """Export the ``nbytes`` at device pointer ``ptr`` with ``cudaIpcGetMemHandle``.

    The calling thread needs a current CUDA context (the device's primary context:
    ``cudaSetDevice`` / ``torch.cuda.set_device``). Refuses memory that legacy CUDA IPC
    cannot share (VMM, memory pools, managed or host memory) and, unless
    ``allow_offset``, pointers that are not the base of their allocation. With ``vmm``,
    VMM memory is exported with ``cuMemExportToShareableHandle`` instead (see
    :mod:`.vmm`; it always carries the offset).
    """
    drv = driver if driver is not None else get_driver()
    positive_int("ptr (a device address)", ptr)
    positive_int("nbytes", nbytes)
    if drv.current_context() == 0:
        raise CudaError(
            "no CUDA context is current on this thread: make the device's primary context "
            "current first (cudaSetDevice(device), or torch.cuda.set_device(device)), in "
            "the thread that exports the memory", call="cuCtxGetCurrent")
    mem_type = drv.pointer_attribute(ptr, "MEMORY_TYPE")
    if mem_type is None:
        raise InvalidArgument(
            f"0x{ptr:x} is not memory CUDA knows about in the current context (wrong "
            f"device current, freed, or not a CUDA allocation)")
    if mem_type != CU_MEMORYTYPE_DEVICE:
        raise InvalidArgument(
            f"0x{ptr:x} is not device memory (CUmemorytype {mem_type}): only GPU memory "
            f"can be registered as a GPU KV cache; use CpuKVCache for host memory")
    # 0 = not shareable by cudaIpcGetMemHandle; None = the driver cannot tell (old
    # drivers), then cudaIpcGetMemHandle itself decides. Pool memory is checked on its
    # own as well: cudaIpcGetMemHandle never exports cudaMallocAsync allocations.
    legacy = drv.pointer_attribute(ptr, "IS_LEGACY_CUDA_IPC_CAPABLE")
    pool = drv.pointer_attribute(ptr, "MEMPOOL_HANDLE")
    if vmm and legacy == 0 and not pool and not drv.pointer_attribute(ptr, "IS_MANAGED"):
        share, base, size = export_vmm(drv, ptr, nbytes)  # type: ignore[arg-type]
        device = drv.pointer_device(ptr)
        return ExportedAllocation(b"", ptr, base, size,
                                  drv.get_device() if device is None else device, share)
    if legacy == 0 or pool:
        raise InvalidArgument(
            f"the memory at 0x{ptr:x} cannot be exported with cudaIpcGetMemHandle: "
            f"{_not_ipc_capable_reason(drv, ptr)}. Allocate the KV cache with "
            f"CudaKVCache.allocate (plain cudaMalloc), or turn that allocator setting off"
            f"{'' if pool or vmm else _VMM_HINT}")
    base, size = drv.address_range(ptr)
    offset = ptr - base
    if offset and not allow_offset:
        raise InvalidArgument(
            f"0x{ptr:x} is {offset} bytes into its CUDA allocation (base 0x{base:x}, "
            f"{size} bytes). A CUDA IPC handle always maps an allocation at its base, so "
            f"the receiver needs the offset: pass allow_offset=True (the torch_ipc form, "
            f"and the raw form of LMCache 0.5.5+, carry it), or allocate with "
            f"CudaKVCache.allocate (one cudaMalloc per layer)")
    if offset + nbytes > size:
        raise InvalidArgument(
            f"{nbytes} bytes at 0x{ptr:x} run past the end of its allocation (base "
            f"0x{base:x}, {size} bytes)")
    handle = drv.ipc_get_mem_handle(base)
    # Not CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: it reads 0 on cuda-bindings 13.3-13.4.1.
    device = drv.pointer_device(ptr)
    if device is None:
        device = drv.get_device()
    return ExportedAllocation(handle, ptr, base, size, device)


# ------------------------------------------- memory CUDA IPC cannot export
def export_or_local(drv: CudaDriver, ptr: int, nbytes: int, allow_offset: bool,
                    vmm: bool = False) -> ExportedAllocation:
    """A layer's CUDA IPC export (with ``vmm``, VMM memory's shareable-handle export);
    for device memory neither can share (pools, Tegra, VMM without a shareable handle
    type) a handle-less record instead, usable in engine-driven mode only."""
    try:
        return export_allocation(ptr, nbytes, driver=drv, allow_offset=allow_offset,
                                 vmm=vmm)
    except (InvalidArgument, CudaError) as exc:
        return local_allocation(drv, ptr, nbytes, exc)


def local_allocation(drv: CudaDriver, ptr: int, nbytes: int,
                     failure: Exception) -> ExportedAllocation:
    """A layer that ``export_allocation`` refused (``failure``), kept for engine-driven
    transfers when it is device memory that only CUDA IPC cannot share: VMM or pool
    memory, or a device where ``cudaIpcGetMemHandle`` is not supported (Tegra). Its
    handle is empty; ``base`` / ``size`` are the mapped range holding it (for VMM
    memory possibly several chunks: :func:`mapped_range`). Anything else re-raises
    ``failure``."""
    if drv.pointer_attribute(ptr, "MEMORY_TYPE") != CU_MEMORYTYPE_DEVICE:
        raise failure
    ipc_refused = isinstance(failure, CudaError) and failure.call == "cudaIpcGetMemHandle"
    not_capable = drv.pointer_attribute(ptr, "IS_LEGACY_CUDA_IPC_CAPABLE") == 0 or bool(
        drv.pointer_attribute(ptr, "MEMPOOL_HANDLE"))
    if not (ipc_refused or not_capable):
        raise failure
    base, size, device = mapped_range(drv, ptr, nbytes, failure)
    return ExportedAllocation(b"", ptr, base, size, drv.get_device() if device is None
                              else device, local_reason=str(failure))


def mapped_range(drv: CudaDriver, ptr: int, nbytes: int,
                 failure: Exception) -> tuple[int, int, int | None]:
    """(base, size, device) of the mapped device memory holding the ``nbytes`` at
    ``ptr``, walked allocation by allocation with the driver.

    ``cuMemGetAddressRange`` answers the allocation holding a pointer: for CUDA VMM
    memory the one ``cuMemCreate`` chunk mapped there, not the reservation. vLLM
    0.34's extensible KV cache maps a new chunk at every commit (its minimum, warm-up
    and final size: ``utils/extensible_tensor.py``), PyTorch's expandable segments one
    per 20 MiB page, so one layer's view spans several chunks side by side. This
    process's copies need only every byte mapped on one device (a copy never cares
    where one chunk ends), so the chunks are followed from ``ptr``; a hole (an address
    reserved but not mapped), host memory or another device's memory within the view
    is refused, saying where. A view inside one allocation is one step. ``failure``:
    why the server cannot map it (the message's tail)."""
    end, at = ptr + nbytes, ptr
    base: int | None = None
    device: int | None = None
    chunks = 0
    while at < end:
        try:
            chunk, size = drv.address_range(at)
        except CudaError:
            chunk, size = at, 0
        if size <= 0 or chunk + size <= at or (
                chunks and drv.pointer_attribute(at, "MEMORY_TYPE") != CU_MEMORYTYPE_DEVICE):
            what = ("nothing is mapped there (a hole in the VMM reservation: reserved, or "
                    "released, but not mapped)" if size <= 0 else "it is not device memory")
            raise InvalidArgument(
                f"the {nbytes} bytes at 0x{ptr:x} cannot be registered: byte {at - ptr} "
                f"(0x{at:x}) is not mapped device memory: {what}. Engine-driven copies need "
                f"every byte of a layer mapped (the server cannot map it either: {failure})")
        holder = drv.pointer_device(at)
        if chunks and holder != device:
            raise InvalidArgument(
                f"the {nbytes} bytes at 0x{ptr:x} cannot be registered: they start on "
                f"device {device} and byte {at - ptr} (0x{at:x}) is on device {holder}; a "
                f"layer must be on one device")
        if base is None:
            base, device = chunk, holder
        at = chunk + size
        chunks += 1
    assert base is not None  # nbytes > 0: at least one step
    return base, at - base, device


# -------------------------------------------------------------- lifetimes
def _free_allocation(driver: CudaDriver, device: int, ptr: int) -> None:
    try:
        with on_device(driver, device):
            driver.free(ptr)
    except Exception:  # at interpreter exit the driver may already be gone
        pass


class DeviceAllocation:
    """One cudaMalloc'd block, freed when the last holder (the cache, or a torch view
    handed out from it) lets go, or at interpreter exit."""

    __slots__ = ("ptr", "nbytes", "_finalizer", "__weakref__")

    def __init__(self, driver: CudaDriver, device: int, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, _free_allocation, driver, device, ptr)

    def free(self) -> None:
        self._finalizer()

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive


def destroy_event(driver: CudaDriver, device: int, event: Any) -> None:
    """cudaEventDestroy on ``device``, never raising (exit paths, gone drivers)."""
    try:
        with on_device(driver, device):
            driver.event_destroy(event)
    except Exception:
        pass


class TransferEvent:
    """The caller's event of one STORE / RETRIEVE, alive until the reply arrives, and
    the stream it was recorded on (the reply's wait goes on the same stream).
    Destroyed by :meth:`CudaKVCache.end_transfer`, or when dropped (a request that
    timed out never gets its reply)."""

    __slots__ = ("event", "handle", "stream", "_finalizer", "__weakref__")

    def __init__(self, driver: CudaDriver, device: int, event: Any, stream: int) -> None:
        self.event = event
        self.handle = b""
        self.stream = stream
        self._finalizer = weakref.finalize(self, destroy_event, driver, device, event)

    def destroy(self) -> None:
        self._finalizer()

    @property
    def destroyed(self) -> bool:
        return not self._finalizer.alive


def check_device_index(device: object) -> int:
    return non_negative_int("device (a CUDA device index)", device)


def check_server_event(handle: object) -> bytes:
    """``handle`` if it is a 64-byte ``cudaIpcEventHandle_t``; else say what the server
    sent instead (it can then not have copied GPU blocks in a way we can wait for)."""
    if isinstance(handle, bytes) and len(handle) == IPC_HANDLE_SIZE:
        return handle
    if isinstance(handle, bytes) and len(handle) == TIMELINE_EVENT_HANDLE_SIZE \
            and handle[0] == 1:
        raise UnsupportedServerEvent(
            "the server answered with an 81-byte timeline-semaphore event: it runs with "
            "--isolated-ipc (LMCache 0.5.5+), whose events this client cannot wait on yet. "
            "Restart the server without --isolated-ipc (containers must then share the "
            "host IPC namespace / /dev/shm for CUDA IPC events)", call="end_transfer")
    raise UnsupportedServerEvent(
        f"the server answered with event handle {handle!r:.40} instead of a 64-byte "
        f"cudaIpcEventHandle_t: it is not running in GPU mode (its log says "
        f"torch_device_type=cpu?), so it cannot have copied GPU blocks. Start it where "
        f"torch sees the GPU, or register a CpuKVCache", call="end_transfer")
