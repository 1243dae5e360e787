"""GPU KV caches the LMCache server maps through CUDA IPC, with cuda-python only.

Imported only when used (``pip install 'lmcache-mp[cuda]'``); it never imports torch
or lmcache at import time, and cuda-python only when a driver is first needed.

Memory. A ``cudaIpcMemHandle_t`` always names a whole ``cudaMalloc`` allocation and
maps at its base, and LMCache 0.5.3's ``RawCudaIPCWrapper`` carries no offset, so each
layer tensor must start at the base of its own allocation. :meth:`CudaKVCache.allocate`
guarantees that (one ``cudaMalloc`` per layer); caller-owned memory is checked with
``cuMemGetAddressRange`` and refused, with what to do instead, when it is not a base.
Memory from CUDA VMM (``cuMemCreate``: PyTorch's ``expandable_segments:True``, cumem
allocators) or from a stream-ordered pool (``cudaMallocAsync``) cannot be exported with
``cudaIpcGetMemHandle`` and is refused too.

Wrapper forms (:attr:`CudaKVCache.wrapper_format`):

* ``"raw"`` (default): LMCache's ``RawCudaIPCWrapper``, the bare 64-byte memory
  handle. The server needs cupy, and its cuda-bindings must still expose
  ``cudaIpcMemHandle_t.reserved`` (cuda-bindings <= 13.3: 0.5.3's ``to_tensor``
  assigns that attribute, which 13.4 removed).
* ``"torch_ipc"``: LMCache's ``CudaIPCWrapper``, torch's ``_share_cuda_()`` 8-tuple
  built without torch (bare memory handle, byte offset inside the allocation, no
  ref-counter file, no producer event). The server needs only torch, and layers
  need not start at their allocation's base.

Ordering. Every STORE / RETRIEVE sends the handle of an interprocess event recorded on
the caller's stream (the server's copy waits for it) and gets back the handle of the
server's completion event, on which the caller's stream is then made to wait
(``cudaStreamWaitEvent``): work queued on that stream afterwards sees the copied
blocks. ``wait_host=True`` (or :meth:`CudaKVCache.synchronize`) also waits on the host.

Every CUDA call goes through a small driver object (:class:`CudaDriver`), so the logic
here is tested on machines without a GPU with a fake one.
"""

from __future__ import annotations

import ctypes
import threading
import uuid as _uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..errors import InvalidArgument, LMCacheMPError
from .base import STORAGE_DTYPES, CudaLayerExport, KVGeometry, KVLayout, LayerExport

__all__ = [
    "IPC_HANDLE_SIZE",
    "CudaError",
    "CudaUnavailable",
    "CudaDriver",
    "CudaBindingsDriver",
    "DeviceInfo",
    "ExportedAllocation",
    "TransferEvent",
    "CudaKVCache",
    "WrapperFormat",
    "get_driver",
    "torch_uuid_string",
    "handle_bytes",
    "write_handle_bytes",
    "uuid_bytes",
    "stream_handle",
    "export_allocation",
]

IPC_HANDLE_SIZE = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t are both 64 bytes

# cudaEventInterprocess | cudaEventDisableTiming: IPC events must not record timing.
EVENT_INTERPROCESS = 0x04
EVENT_DISABLE_TIMING = 0x02
CU_MEMORYTYPE_DEVICE = 2

# Opened server events, kept per distinct handle. The server makes a new event for
# every request; the driver recycles IPC event slots, so the set stays small, but the
# cache is bounded in case it does not.
_MAX_OPEN_SERVER_EVENTS = 256

WrapperFormat = Literal["raw", "torch_ipc"]


# ---------------------------------------------------------------------- errors
class CudaError(LMCacheMPError):
    """A CUDA call failed; ``call`` and ``code`` say which and how."""

    def __init__(self, message: str, *, call: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.call = call
        self.code = code


class CudaUnavailable(CudaError):
    """No usable CUDA here: cuda-python missing, no driver, or no device."""


# Error names meaning "no CUDA on this machine" rather than "this call was wrong".
_ABSENT_ERRORS = (
    "cudaErrorNoDevice", "cudaErrorInsufficientDriver", "cudaErrorStubLibrary",
    "cudaErrorSystemDriverMismatch", "CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_STUB_LIBRARY",
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
)


# ------------------------------------------------------------ pure helpers
def torch_uuid_string(uuid16: bytes) -> str:
    """The device UUID as torch prints it (``str(get_device_properties(i).uuid)``):
    lower-case 8-4-4-4-12 hex, no ``GPU-`` prefix. LMCache servers map a client's
    ``device_uuid`` to their own ordinal by comparing with exactly this string."""
    if not isinstance(uuid16, (bytes, bytearray)) or len(uuid16) != 16:
        raise InvalidArgument(f"a CUDA device UUID is 16 bytes, got {uuid16!r}")
    return str(_uuid.UUID(bytes=bytes(uuid16)))


def _as_bytes(value: object) -> bytes:
    """bytes from what the bindings return for a char array: bytes, a latin-1 str, or
    a sequence of (possibly signed) C chars."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("latin-1")
    if isinstance(value, Sequence):
        return bytes(int(v) & 0xFF for v in value)
    raise TypeError(f"cannot read bytes from {type(value).__name__}")


def _struct_address(struct: object) -> int:
    get_ptr = getattr(struct, "getPtr", None)
    if get_ptr is None:
        raise TypeError(f"{type(struct).__name__} has neither .reserved nor .getPtr()")
    address = int(get_ptr())
    if not address:
        raise TypeError(f"{type(struct).__name__}.getPtr() returned NULL")
    return address


def handle_bytes(struct: object, size: int = IPC_HANDLE_SIZE) -> bytes:
    """The raw bytes of a cuda-bindings handle struct (``cudaIpcMemHandle_t``,
    ``cudaIpcEventHandle_t``). cuda-bindings up to 13.3 expose them as ``.reserved``;
    13.4 dropped that attribute, so otherwise read ``size`` bytes at ``getPtr()``."""
    reserved = getattr(struct, "reserved", None)
    data = _as_bytes(reserved) if reserved is not None else ctypes.string_at(
        _struct_address(struct), size)
    if len(data) != size:
        raise CudaError(f"expected a {size}-byte handle, got {len(data)} bytes")
    return data


def write_handle_bytes(struct: object, data: bytes, size: int = IPC_HANDLE_SIZE) -> None:
    """Fill a handle struct with ``data`` (``.reserved`` when the bindings have it,
    else through ``getPtr()``)."""
    if not isinstance(data, (bytes, bytearray)) or len(data) != size:
        raise InvalidArgument(f"a CUDA IPC handle is {size} bytes, got {data!r:.80}")
    if getattr(struct, "reserved", None) is not None:
        struct.reserved = bytes(data)  # type: ignore[attr-defined]
        return
    ctypes.memmove(_struct_address(struct), bytes(data), size)


def uuid_bytes(uuid_struct: object) -> bytes:
    """The 16 bytes of a ``cudaUUID_t`` / ``CUuuid`` (``.bytes``, else its pointer)."""
    raw = getattr(uuid_struct, "bytes", None)
    data = _as_bytes(raw) if raw is not None else ctypes.string_at(
        _struct_address(uuid_struct), 16)
    if len(data) != 16:
        raise CudaError(f"a CUDA device UUID is 16 bytes, got {len(data)}")
    return data


def stream_handle(stream: object) -> int:
    """The ``cudaStream_t`` value of ``stream``: None (the legacy default stream, 0),
    an int handle, a torch.cuda.Stream (``.cuda_stream``), any object with the CUDA
    stream protocol (``__cuda_stream__``, e.g. cupy), or a cuda-bindings
    ``cudaStream_t`` / ``CUstream``."""
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


# ------------------------------------------------------------------- driver
@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    uuid: str  # torch form
    total_memory: int
    compute_capability: tuple[int, int]


class CudaDriver(Protocol):
    """The CUDA calls this module makes. Streams are raw handles (ints); events are
    whatever the implementation returns."""

    def bindings_version(self) -> str: ...
    def driver_version(self) -> int: ...
    def runtime_version(self) -> int: ...
    def device_count(self) -> int: ...
    def device_info(self, device: int) -> DeviceInfo: ...
    def get_device(self) -> int: ...
    def set_device(self, device: int) -> None: ...
    def current_context(self) -> int: ...
    def malloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def memset(self, ptr: int, value: int, nbytes: int) -> None: ...
    def synchronize_device(self) -> None: ...
    def address_range(self, ptr: int) -> tuple[int, int]: ...
    def pointer_attribute(self, ptr: int, name: str) -> int | None: ...
    def ipc_get_mem_handle(self, ptr: int) -> bytes: ...
    def event_create_ipc(self) -> Any: ...
    def event_record(self, event: Any, stream: int) -> None: ...
    def ipc_get_event_handle(self, event: Any) -> bytes: ...
    def ipc_open_event_handle(self, handle: bytes) -> Any: ...
    def stream_wait_event(self, stream: int, event: Any) -> None: ...
    def event_synchronize(self, event: Any) -> None: ...
    def event_destroy(self, event: Any) -> None: ...
    def stream_synchronize(self, stream: int) -> None: ...


def _error_name(err: object) -> str:
    return str(getattr(err, "name", err))


class CudaBindingsDriver:
    """:class:`CudaDriver` over cuda-python (``cuda.bindings``; ``cuda.cudart`` /
    ``cuda.cuda`` for cuda-python < 12.6)."""

    def __init__(self) -> None:
        try:
            import cuda.bindings as bindings
            from cuda.bindings import driver as cu
            from cuda.bindings import runtime as rt

            version = str(getattr(bindings, "__version__", "?"))
        except ImportError as exc:
            if exc.name not in ("cuda", "cuda.bindings"):
                # Installed but broken (e.g. a missing cuda-pathfinder): say what broke.
                raise CudaUnavailable(f"cuda-python does not import: {exc}") from exc
            try:
                from cuda import cuda as cu
                from cuda import cudart as rt
            except ImportError:
                raise CudaUnavailable(
                    "cuda-python is not installed (pip install 'lmcache-mp[cuda]')"
                ) from None
            version = "cuda-python < 12.6"
        self._cu: Any = cu
        self._rt: Any = rt
        self._version = version
        self._init_lock = threading.Lock()
        self._driver_ready = False

    # -- call plumbing
    def _check(self, call: str, result: Any) -> tuple[Any, ...]:
        if not isinstance(result, tuple):
            result = (result,)
        err, rest = result[0], result[1:]
        if int(err) != 0:
            name = _error_name(err)
            cls = CudaUnavailable if name in _ABSENT_ERRORS else CudaError
            raise cls(f"{call} failed: {name} ({int(err)})", call=call, code=int(err))
        return tuple(rest)

    def _rt_call(self, call: str, *args: Any) -> tuple[Any, ...]:
        try:
            result = getattr(self._rt, call)(*args)
        except LMCacheMPError:
            raise
        except Exception as exc:  # the bindings raise (not return) when libcuda is missing
            raise CudaUnavailable(f"{call}: {exc}", call=call) from exc
        return self._check(call, result)

    def _cu_call(self, call: str, *args: Any) -> tuple[Any, ...]:
        self._ensure_driver()
        try:
            result = getattr(self._cu, call)(*args)
        except Exception as exc:
            raise CudaUnavailable(f"{call}: {exc}", call=call) from exc
        return self._check(call, result)

    def _ensure_driver(self) -> None:
        # Driver-API calls need cuInit first; the runtime calls do it themselves.
        if self._driver_ready:
            return
        with self._init_lock:
            if not self._driver_ready:
                try:
                    result = self._cu.cuInit(0)
                except Exception as exc:
                    raise CudaUnavailable(f"cuInit: {exc}", call="cuInit") from exc
                self._check("cuInit", result)
                self._driver_ready = True

    # -- versions and devices
    def bindings_version(self) -> str:
        return self._version

    def driver_version(self) -> int:
        return int(self._rt_call("cudaDriverGetVersion")[0])

    def runtime_version(self) -> int:
        return int(self._rt_call("cudaRuntimeGetVersion")[0])

    def device_count(self) -> int:
        return int(self._rt_call("cudaGetDeviceCount")[0])

    def device_info(self, device: int) -> DeviceInfo:
        (prop,) = self._rt_call("cudaGetDeviceProperties", device)
        name = _as_bytes(prop.name).split(b"\0", 1)[0].decode(errors="replace")
        return DeviceInfo(device, name, torch_uuid_string(uuid_bytes(prop.uuid)),
                          int(prop.totalGlobalMem), (int(prop.major), int(prop.minor)))

    def get_device(self) -> int:
        return int(self._rt_call("cudaGetDevice")[0])

    def set_device(self, device: int) -> None:
        self._rt_call("cudaSetDevice", device)

    def current_context(self) -> int:
        (ctx,) = self._cu_call("cuCtxGetCurrent")
        return 0 if ctx is None else int(ctx)

    # -- memory
    def malloc(self, nbytes: int) -> int:
        return int(self._rt_call("cudaMalloc", nbytes)[0])

    def free(self, ptr: int) -> None:
        self._rt_call("cudaFree", ptr)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._rt_call("cudaMemset", ptr, value, nbytes)

    def synchronize_device(self) -> None:
        self._rt_call("cudaDeviceSynchronize")

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = self._cu_call("cuMemGetAddressRange", ptr)
        return int(base), int(size)

    def pointer_attribute(self, ptr: int, name: str) -> int | None:
        """An integer pointer attribute (``CU_POINTER_ATTRIBUTE_<name>``), or None when
        the bindings or the driver do not know it, or the pointer is not CUDA's."""
        attr = getattr(self._cu.CUpointer_attribute, f"CU_POINTER_ATTRIBUTE_{name}", None)
        if attr is None:
            return None
        self._ensure_driver()
        try:
            result = self._cu.cuPointerGetAttribute(attr, ptr)
        except Exception:
            return None
        if int(result[0]) != 0:
            return None
        value = result[1]
        return 0 if value is None else int(value)

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        (handle,) = self._rt_call("cudaIpcGetMemHandle", ptr)
        return handle_bytes(handle)

    # -- events and streams
    def event_create_ipc(self) -> Any:
        return self._rt_call("cudaEventCreateWithFlags",
                             EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)[0]

    def event_record(self, event: Any, stream: int) -> None:
        self._rt_call("cudaEventRecord", event, stream)

    def ipc_get_event_handle(self, event: Any) -> bytes:
        (handle,) = self._rt_call("cudaIpcGetEventHandle", event)
        return handle_bytes(handle)

    def ipc_open_event_handle(self, handle: bytes) -> Any:
        struct = self._rt.cudaIpcEventHandle_t()
        write_handle_bytes(struct, handle)
        return self._rt_call("cudaIpcOpenEventHandle", struct)[0]

    def stream_wait_event(self, stream: int, event: Any) -> None:
        self._rt_call("cudaStreamWaitEvent", stream, event, 0)

    def event_synchronize(self, event: Any) -> None:
        self._rt_call("cudaEventSynchronize", event)

    def event_destroy(self, event: Any) -> None:
        self._rt_call("cudaEventDestroy", event)

    def stream_synchronize(self, stream: int) -> None:
        self._rt_call("cudaStreamSynchronize", stream)


_driver_lock = threading.Lock()
_default_driver: CudaDriver | None = None


def get_driver() -> CudaDriver:
    """The process-wide cuda-python driver (CudaUnavailable without cuda-python)."""
    global _default_driver
    with _driver_lock:
        if _default_driver is None:
            _default_driver = CudaBindingsDriver()
        return _default_driver


@contextmanager
def _on_device(driver: CudaDriver, device: int) -> Iterator[None]:
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

    @property
    def offset(self) -> int:
        return self.ptr - self.base


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
    ptr: int, nbytes: int, *, allow_offset: bool = False, driver: CudaDriver | None = None
) -> ExportedAllocation:
    """Export the ``nbytes`` at device pointer ``ptr`` with ``cudaIpcGetMemHandle``.

    The calling thread needs a current CUDA context (the device's primary context:
    ``cudaSetDevice`` / ``torch.cuda.set_device``). Refuses memory that legacy CUDA IPC
    cannot share (VMM, memory pools, managed or host memory) and, unless
    ``allow_offset`` (the ``torch_ipc`` wrapper form carries an offset), pointers that
    are not the base of their allocation: the server would map the allocation's base.
    """
    drv = driver if driver is not None else get_driver()
    if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr <= 0:
        raise InvalidArgument(f"ptr must be a device address (a positive int), got {ptr!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise InvalidArgument(f"nbytes must be a positive int, got {nbytes!r}")
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
    if drv.pointer_attribute(ptr, "IS_LEGACY_CUDA_IPC_CAPABLE") == 0 or drv.pointer_attribute(
            ptr, "MEMPOOL_HANDLE"):
        raise InvalidArgument(
            f"the memory at 0x{ptr:x} cannot be exported with cudaIpcGetMemHandle: "
            f"{_not_ipc_capable_reason(drv, ptr)}. Allocate the KV cache with "
            f"CudaKVCache.allocate (plain cudaMalloc), or turn that allocator setting off")
    base, size = drv.address_range(ptr)
    offset = ptr - base
    if offset and not allow_offset:
        raise InvalidArgument(
            f"0x{ptr:x} is {offset} bytes into its CUDA allocation (base 0x{base:x}, "
            f"{size} bytes). A CUDA IPC handle always maps an allocation at its base and "
            f"LMCache's RawCudaIPCWrapper carries no offset, so the server would read the "
            f"wrong memory. Allocate with CudaKVCache.allocate (one cudaMalloc per layer), "
            f"pass the whole allocation, or use wrapper='torch_ipc' (carries the offset)")
    if offset + nbytes > size:
        raise InvalidArgument(
            f"{nbytes} bytes at 0x{ptr:x} run past the end of its allocation (base "
            f"0x{base:x}, {size} bytes)")
    handle = drv.ipc_get_mem_handle(base)
    ordinal = drv.pointer_attribute(ptr, "DEVICE_ORDINAL")
    device = drv.get_device() if ordinal is None else ordinal
    return ExportedAllocation(handle, ptr, base, size, device)


# -------------------------------------------------------------- lifetimes
def _free_allocation(driver: CudaDriver, device: int, ptr: int) -> None:
    try:
        with _on_device(driver, device):
            driver.free(ptr)
    except Exception:  # at interpreter exit the driver may already be gone
        pass


class _DeviceAllocation:
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


class _CudaArrayView:
    """``__cuda_array_interface__`` over one allocation, for torch.as_tensor; the
    tensor keeps this object (and so the allocation) alive."""

    def __init__(self, owner: object, ptr: int, nbytes: int) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


def _destroy_event(driver: CudaDriver, device: int, event: Any) -> None:
    try:
        with _on_device(driver, device):
            driver.event_destroy(event)
    except Exception:  # at exit, or a driver that is gone: nothing left to release
        pass


class TransferEvent:
    """The caller's event of one STORE / RETRIEVE, alive until the reply arrives.
    Destroyed by :meth:`CudaKVCache.end_transfer`, or when dropped (a request that
    timed out never gets its reply)."""

    __slots__ = ("event", "handle", "_finalizer", "__weakref__")

    def __init__(self, driver: CudaDriver, device: int, event: Any) -> None:
        self.event = event
        self.handle = b""
        self._finalizer = weakref.finalize(self, _destroy_event, driver, device, event)

    def destroy(self) -> None:
        self._finalizer()

    @property
    def destroyed(self) -> bool:
        return not self._finalizer.alive


def _release_cache(driver: CudaDriver, device: int, opened: OrderedDict[bytes, Any]) -> None:
    events = list(opened.values())
    opened.clear()
    for event in events:
        _destroy_event(driver, device, event)


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
    return value


def _check_wrapper(wrapper: str) -> WrapperFormat:
    if wrapper == "raw":
        return "raw"
    if wrapper == "torch_ipc":
        return "torch_ipc"
    raise InvalidArgument(f"wrapper must be 'raw' or 'torch_ipc', got {wrapper!r}")


def _geometry(num_layers: int, num_blocks: int, block_size: int, num_heads: int,
              head_dim: int, dtype: str, mla: bool) -> KVGeometry:
    if dtype not in STORAGE_DTYPES:
        raise InvalidArgument(
            f"dtype {dtype!r} is not supported; use one of {', '.join(STORAGE_DTYPES)}")
    if mla and num_heads != 1:
        raise InvalidArgument("an MLA cache has one latent head: pass num_heads=1")
    return KVGeometry(
        _positive("num_layers", num_layers), _positive("num_blocks", num_blocks),
        _positive("block_size", block_size), _positive("num_heads", num_heads),
        _positive("head_dim", head_dim), dtype, bool(mla))


# ------------------------------------------------------------------- cache
class CudaKVCache:
    """Per-layer GPU KV tensors the LMCache server maps through CUDA IPC.

    Build one with :meth:`allocate` (memory of its own, always exportable),
    :meth:`from_torch` (caller-owned tensors) or :meth:`from_pointers`. Layers are HND
    ``[2, num_blocks, num_heads, block_size, head_dim]`` (MLA: ``[num_blocks,
    block_size, head_dim]``), contiguous. Unregister before closing: the server keeps
    mapping the memory until then.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        device: int,
        exports: Sequence[ExportedAllocation],
        *,
        driver: CudaDriver,
        owners: Sequence[object] = (),
        torch_layers: Sequence[Any] | None = None,
        wrapper: WrapperFormat = "raw",
        wait_host: bool = False,
    ) -> None:
        """Use :meth:`allocate`, :meth:`from_torch` or :meth:`from_pointers`."""
        self.geometry = geometry
        self.device = device
        self.wrapper_format: WrapperFormat = _check_wrapper(wrapper)
        #: Also block the host in end_transfer until the server's copy is done.
        self.wait_host = bool(wait_host)
        self._driver = driver
        self._exports = list(exports)
        # What keeps the memory alive: our _DeviceAllocations, or the caller's tensors.
        # One owner per layer (allocate), or a single keepalive object (from_*).
        self._owners: list[object] = list(owners)
        # from_torch: the caller's own tensors are the torch views.
        self._torch_layers: list[Any] | None = None if torch_layers is None else list(
            torch_layers)
        with _on_device(driver, device):
            self.device_uuid = driver.device_info(device).uuid
        self._lock = threading.Lock()
        self._opened: OrderedDict[bytes, Any] = OrderedDict()
        self._finalizer = weakref.finalize(self, _release_cache, driver, device, self._opened)

    # ------------------------------------------------------------ builders
    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        dtype: str = "bfloat16",
        mla: bool = False,
        device: int = 0,
        wrapper: WrapperFormat = "raw",
        wait_host: bool = False,
        driver: CudaDriver | None = None,
    ) -> CudaKVCache:
        """Allocate ``num_layers`` zero-filled layers on ``device``, one ``cudaMalloc``
        each, so every layer is the base of its own allocation and exportable."""
        geometry = _geometry(num_layers, num_blocks, block_size, num_heads, head_dim,
                             dtype, mla)
        device = _device_index(device)
        drv = driver if driver is not None else get_driver()
        allocations: list[_DeviceAllocation] = []
        with _on_device(drv, device):
            try:
                for _ in range(num_layers):
                    ptr = drv.malloc(geometry.layer_nbytes)
                    allocations.append(_DeviceAllocation(drv, device, ptr,
                                                         geometry.layer_nbytes))
                    drv.memset(ptr, 0, geometry.layer_nbytes)
                # cudaMemset is asynchronous to the host; finish before handing out.
                drv.synchronize_device()
                exports = [export_allocation(a.ptr, a.nbytes, driver=drv) for a in allocations]
            except BaseException:
                for a in allocations:
                    a.free()
                raise
        return cls(geometry, device, exports, driver=drv, owners=allocations,
                   wrapper=wrapper, wait_host=wait_host)

    @classmethod
    def from_pointers(
        cls,
        ptrs: Sequence[int],
        *,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        dtype: str = "bfloat16",
        mla: bool = False,
        device: int = 0,
        keepalive: object = None,
        wrapper: WrapperFormat = "raw",
        wait_host: bool = False,
        driver: CudaDriver | None = None,
        torch_layers: Sequence[Any] | None = None,
    ) -> CudaKVCache:
        """Register memory the caller owns, one device pointer per layer (contiguous,
        HND or MLA as in the class docstring). ``keepalive`` is held until close;
        ``torch_layers``, if given, are returned by :attr:`torch_layers`."""
        ptrs = list(ptrs)
        if not ptrs:
            raise InvalidArgument("ptrs must hold one device pointer per layer (got none)")
        geometry = _geometry(len(ptrs), num_blocks, block_size, num_heads, head_dim, dtype,
                             mla)
        device = _device_index(device)
        drv = driver if driver is not None else get_driver()
        wrapper = _check_wrapper(wrapper)
        with _on_device(drv, device):
            exports = []
            for i, ptr in enumerate(ptrs):
                try:
                    exp = export_allocation(ptr, geometry.layer_nbytes, driver=drv,
                                            allow_offset=wrapper == "torch_ipc")
                except InvalidArgument as exc:
                    raise InvalidArgument(f"layer {i}: {exc}") from None
                if exp.device != device:
                    raise InvalidArgument(
                        f"layer {i} is on device {exp.device}, not device {device}")
                exports.append(exp)
        return cls(geometry, device, exports, driver=drv,
                   owners=[] if keepalive is None else [keepalive],
                   torch_layers=torch_layers, wrapper=wrapper, wait_host=wait_host)

    @classmethod
    def from_torch(
        cls,
        layers: Sequence[Any],
        *,
        mla: bool = False,
        wrapper: WrapperFormat = "raw",
        wait_host: bool = False,
        driver: CudaDriver | None = None,
    ) -> CudaKVCache:
        """Register caller-owned CUDA torch tensors, one per layer: contiguous HND
        ``[2, num_blocks, num_heads, block_size, head_dim]`` (``mla=True``:
        ``[num_blocks, block_size, head_dim]``), same shape, dtype and device.

        With the default ``wrapper="raw"`` each tensor must start at the base of its
        own CUDA allocation: PyTorch's caching allocator does not promise that (it
        carves tensors out of larger segments), so prefer :meth:`allocate` and its
        :attr:`torch_layers`, or ``wrapper="torch_ipc"``.
        """
        layers = list(layers)
        if not layers:
            raise InvalidArgument("layers must hold one CUDA tensor per layer (got none)")
        first = layers[0]
        shape = tuple(int(d) for d in getattr(first, "shape", ()))
        for i, t in enumerate(layers):
            device = getattr(t, "device", None)
            if getattr(device, "type", None) != "cuda":
                raise InvalidArgument(f"layer {i} is not a CUDA tensor (device {device})")
            if tuple(int(d) for d in t.shape) != shape or t.dtype != first.dtype \
                    or t.device != first.device:
                raise InvalidArgument(
                    f"layer {i} differs from layer 0 in shape, dtype or device: "
                    f"{tuple(t.shape)} {t.dtype} {t.device} vs {shape} {first.dtype} "
                    f"{first.device}")
            if not t.is_contiguous():
                raise InvalidArgument(
                    f"layer {i} is not contiguous: the server maps it as a dense block "
                    f"(pass .contiguous() copies, or allocate with CudaKVCache.allocate)")
        dtype = str(first.dtype).removeprefix("torch.")
        if mla:
            if len(shape) != 3:
                raise InvalidArgument(
                    f"MLA layers are [num_blocks, block_size, head_dim], got {shape}")
            num_blocks, block_size, head_dim = shape
            num_heads = 1
        else:
            if len(shape) != 5 or shape[0] != 2:
                hint = " (an MLA cache? pass mla=True)" if len(shape) == 3 else ""
                raise InvalidArgument(
                    f"layers must be HND [2, num_blocks, num_heads, block_size, head_dim], "
                    f"got {shape}{hint}")
            _, num_blocks, num_heads, block_size, head_dim = shape
        index = first.device.index
        return cls.from_pointers(
            [int(t.data_ptr()) for t in layers], num_blocks=num_blocks,
            block_size=block_size, num_heads=num_heads, head_dim=head_dim, dtype=dtype,
            mla=mla, device=0 if index is None else int(index), keepalive=layers,
            wrapper=wrapper, wait_host=wait_host, driver=driver, torch_layers=layers)

    # --------------------------------------------------------------- views
    @property
    def layer_ptrs(self) -> list[int]:
        """Each layer's device address."""
        return [e.ptr for e in self._exports]

    @property
    def exports(self) -> list[ExportedAllocation]:
        return list(self._exports)

    @property
    def torch_layers(self) -> list[Any]:
        """The layers as CUDA torch tensors over the same memory (needs torch with
        CUDA). Tensors handed out keep the memory alive after :meth:`close`."""
        self._check_open()
        if self._torch_layers is None:
            owners = self._owners
            try:
                import torch
            except ImportError:
                raise InvalidArgument(
                    "torch is not installed: use .layer_ptrs, or install torch") from None
            g = self.geometry
            tdtype = getattr(torch, g.dtype)
            dev = torch.device("cuda", self.device)
            layers = []
            for i, e in enumerate(self._exports):
                owner = owners[i] if len(owners) == len(self._exports) else self
                view = _CudaArrayView(owner, e.ptr, g.layer_nbytes)
                layers.append(torch.as_tensor(view, device=dev).view(tdtype).view(g.layer_shape))
            self._torch_layers = layers
        return self._torch_layers

    @property
    def unlinked(self) -> bool:
        # CUDA handles stay valid until the memory is freed: a cache can be registered
        # again after an unregister.
        return False

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgument("this CudaKVCache is closed; allocate a new one")

    # ------------------------------------------------ ExportableKVCache
    def export_layers(self) -> list[LayerExport]:
        self._check_open()
        g = self.geometry
        return [
            CudaLayerExport(ipc_handle=e.handle, nbytes=g.layer_nbytes, alloc_offset=e.offset,
                            dtype=g.dtype, shape=g.layer_shape, stride=g.layer_strides,
                            device_index=self.device, device_uuid=self.device_uuid,
                            form=self.wrapper_format)
            for e in self._exports
        ]

    @property
    def kv_layout(self) -> KVLayout | None:
        # GPU servers default to NHD for 5-D layers: say HND. MLA has no head axis.
        return None if self.geometry.mla else "HND"

    def begin_transfer(self, stream: Any) -> tuple[bytes, Any]:
        """Record a fresh interprocess event on ``stream``: the server's copy waits
        for it. Returns its 64-byte handle and the event (kept until the reply)."""
        self._check_open()
        handle_of_stream = stream_handle(stream)
        drv = self._driver
        with _on_device(drv, self.device):
            token = TransferEvent(drv, self.device, drv.event_create_ipc())
            try:
                drv.event_record(token.event, handle_of_stream)
                token.handle = drv.ipc_get_event_handle(token.event)
            except BaseException:
                token.destroy()
                raise
        return token.handle, token

    def end_transfer(self, server_event: bytes, stream: Any, token: Any) -> None:
        """Make ``stream`` wait for the server's copy (its event handle, opened once
        per distinct handle), then destroy our event; with ``wait_host`` also block
        until the copy is done."""
        try:
            if not isinstance(server_event, bytes) or len(server_event) != IPC_HANDLE_SIZE:
                raise CudaError(
                    f"the server answered with event handle {server_event!r:.40} "
                    f"instead of a 64-byte cudaIpcEventHandle_t: it is not running in GPU "
                    f"mode (its log says torch_device_type=cpu?), so it cannot have "
                    f"copied GPU blocks", call="end_transfer")
            handle_of_stream = stream_handle(stream)
            drv = self._driver
            with _on_device(drv, self.device):
                with self._lock:
                    # Under the lock: an eviction must not destroy the event between
                    # lookup and wait.
                    drv.stream_wait_event(handle_of_stream, self._server_event(server_event))
                if self.wait_host:
                    drv.stream_synchronize(handle_of_stream)
        finally:
            if isinstance(token, TransferEvent):
                token.destroy()

    def _server_event(self, handle: bytes) -> Any:
        """The opened server event for ``handle`` (call with the lock held)."""
        event = self._opened.get(handle)
        if event is not None:
            self._opened.move_to_end(handle)
            return event
        event = self._driver.ipc_open_event_handle(handle)
        self._opened[handle] = event
        while len(self._opened) > _MAX_OPEN_SERVER_EVENTS:
            _, old = self._opened.popitem(last=False)
            # Waits already enqueued on it stay valid: CUDA releases a destroyed
            # event once the work depending on it is done.
            self._driver.event_destroy(old)
        return event

    def synchronize_server_event(self, handle: bytes) -> None:
        """Block the host until the server's event ``handle`` (a STORE / RETRIEVE
        reply's) has completed."""
        if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_SIZE:
            raise InvalidArgument("a server event handle is 64 bytes")
        with _on_device(self._driver, self.device), self._lock:
            self._driver.event_synchronize(self._server_event(handle))

    def synchronize(self, stream: Any = None) -> None:
        """Block the host until ``stream`` (None: the legacy default stream) has done
        everything queued on it, including the waits on the server's copies."""
        with _on_device(self._driver, self.device):
            self._driver.stream_synchronize(stream_handle(stream))

    @property
    def open_server_events(self) -> int:
        """How many distinct server event handles are open (for tests and tuning)."""
        return len(self._opened)

    # ------------------------------------------------------------ lifetime
    def unlink(self) -> None:
        """A no-op: CUDA memory stays exportable until it is freed by :meth:`close`."""
        return None

    def close(self) -> None:
        """Release the opened server events and our references to the memory: memory
        from :meth:`allocate` is freed now, or when the last torch view of it goes."""
        self._torch_layers = None
        self._owners = []
        self._finalizer()

    def __enter__(self) -> CudaKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        g = self.geometry
        state = "closed" if self.closed else "open"
        return (f"<CudaKVCache cuda:{self.device} {g.num_layers} x {g.layer_shape} {g.dtype}"
                f"{' MLA' if g.mla else ''} {self.wrapper_format} {state}>")


def _device_index(device: object) -> int:
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidArgument(f"device must be a CUDA device index (int >= 0), got {device!r}")
    return device
