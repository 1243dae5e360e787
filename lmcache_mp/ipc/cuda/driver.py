"""Every CUDA call the CUDA cache makes, behind a small driver object.

:class:`CudaDriver` is the protocol; :class:`CudaBindingsDriver` implements it over
cuda-python (imported on first use only), and the tests pass a fake. The errors and
the handle / UUID byte helpers are in :mod:`.handles` (re-exported here).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import InvalidArgument, LMCacheMPError
from .handles import (
    ABSENT_ERRORS,
    IPC_HANDLE_SIZE,
    TIMELINE_EVENT_HANDLE_SIZE,
    CudaError,
    CudaUnavailable,
    UnsupportedServerEvent,
    char_array_bytes,
    handle_bytes,
    torch_uuid_string,
    uuid_bytes,
    write_handle_bytes,
)

__all__ = [
    "IPC_HANDLE_SIZE",
    "TIMELINE_EVENT_HANDLE_SIZE",
    "CudaError",
    "CudaUnavailable",
    "UnsupportedServerEvent",
    "DeviceInfo",
    "CudaDriver",
    "CudaBindingsDriver",
    "get_driver",
    "torch_uuid_string",
    "handle_bytes",
    "write_handle_bytes",
    "uuid_bytes",
]

# cudaEventInterprocess | cudaEventDisableTiming: IPC events must not record timing.
EVENT_INTERPROCESS = 0x04
EVENT_DISABLE_TIMING = 0x02
CU_MEMORYTYPE_DEVICE = 2
HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
STREAM_NON_BLOCKING = 0x01  # cudaStreamNonBlocking


# ------------------------------------------------------------------- driver
@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    uuid: str  # torch form
    total_memory: int
    compute_capability: tuple[int, int]


class CudaDriver(Protocol):
    """The CUDA calls the cache makes. Streams are raw handles (ints); events are
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
    def pointer_device(self, ptr: int) -> int | None: ...
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
        self._buffers: dict[int, Any] = {}  # alloc_buffer: address -> its torch tensor

    # -- call plumbing
    def _check(self, call: str, result: Any) -> tuple[Any, ...]:
        if not isinstance(result, tuple):
            result = (result,)
        err, rest = result[0], result[1:]
        if int(err) != 0:
            name = _error_name(err)
            cls = CudaUnavailable if name in ABSENT_ERRORS else CudaError
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
        name = char_array_bytes(prop.name).split(b"\0", 1)[0].decode(errors="replace")
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
        the bindings or the driver do not know it, or the pointer is not CUDA's.

        Not for ``DEVICE_ORDINAL``: cuda-bindings 13.3.x-13.4.1 store it in one field
        and return another (``_lib/utils.pxi``: ``self._cptr = &self._int`` but
        ``pyObj()`` returns ``self._uint``), so it reads 0 whatever the device; fixed
        in 13.4.4. Use :meth:`pointer_device`."""
        if name == "DEVICE_ORDINAL":
            raise InvalidArgument("read a pointer's device with pointer_device()")
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

    def pointer_device(self, ptr: int) -> int | None:
        """The ordinal of the device holding ``ptr`` (``cudaPointerGetAttributes``'s
        ``device``, a plain int field in every bindings release), or None if CUDA does
        not know the pointer."""
        try:
            err, attrs = self._rt.cudaPointerGetAttributes(ptr)
        except Exception:
            return None
        if int(err) != 0 or attrs is None:
            return None
        return int(attrs.device)

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

    # -- CUDA VMM (cuMemCreate) allocations; see .vmm
    def vmm_retain(self, ptr: int) -> Any:
        """The allocation handle of the VMM chunk holding ``ptr`` (one more reference:
        :meth:`vmm_release` it)."""
        return self._cu_call("cuMemRetainAllocationHandle", ptr)[0]

    def vmm_handle_types(self, handle: Any) -> int:
        """``requestedHandleTypes``: the shareable forms fixed at cuMemCreate time."""
        (prop,) = self._cu_call("cuMemGetAllocationPropertiesFromHandle", handle)
        return int(prop.requestedHandleTypes)

    def vmm_export(self, handle: Any, handle_type: int) -> int | bytes:
        """cuMemExportToShareableHandle: a POSIX fd (ours to close) or a fabric blob."""
        kind = self._cu.CUmemAllocationHandleType(handle_type)
        (value,) = self._cu_call("cuMemExportToShareableHandle", handle, kind, 0)
        return bytes(value.data) if hasattr(value, "data") else int(value)

    def vmm_release(self, handle: Any) -> None:
        self._cu_call("cuMemRelease", handle)
    # -- engine-driven copies and the doctor (lmcache_mp.ipc.cuda.staging, doctor):
    # they satisfy staging.CopyDriver, a CudaDriver with these calls as well.
    def host_register(self, ptr: int, nbytes: int) -> None:
        # Portable: the pinning holds for every context, whichever device copies.
        self._rt_call("cudaHostRegister", ptr, nbytes, HOST_REGISTER_PORTABLE)

    def host_unregister(self, ptr: int) -> None:
        self._rt_call("cudaHostUnregister", ptr)

    def memcpy_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                        height: int, stream: int) -> None:
        # cudaMemcpyDefault: unified addressing tells host from device by the pointer.
        self._rt_call("cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height,
                      self._rt.cudaMemcpyKind.cudaMemcpyDefault, stream)

    def memcpy_3d_async(self, dst: int, dpitch: int, dheight: int, src: int, spitch: int,
                        sheight: int, width: int, height: int, depth: int,
                        stream: int) -> None:
        """``depth`` slices of ``height`` rows of ``width`` bytes; a slice is ``pitch *
        pitch_height`` bytes on each side (linear memory, cudaMemcpyDefault)."""
        rt = self._rt
        try:
            params = rt.cudaMemcpy3DParms()
            params.srcPtr = rt.make_cudaPitchedPtr(src, spitch, width, sheight)
            params.dstPtr = rt.make_cudaPitchedPtr(dst, dpitch, width, dheight)
            params.extent = rt.make_cudaExtent(width, height, depth)
            params.kind = rt.cudaMemcpyKind.cudaMemcpyDefault
        except Exception as exc:  # bindings without these helpers
            raise CudaError(f"cudaMemcpy3DParms: {exc!r}", call="cudaMemcpy3DAsync") from exc
        self._rt_call("cudaMemcpy3DAsync", params, stream)

    def torch_bytes(self, ptr: int, nbytes: int, device: int) -> Any:
        """The device memory at ``ptr`` (any kind: cudaMalloc, VMM, pool) as a CUDA
        uint8 torch tensor, neither copied nor owned (the gather path's views)."""
        import torch

        from .torch_layers import CudaArrayView

        t = torch.as_tensor(CudaArrayView(None, ptr, nbytes),
                            device=torch.device("cuda", device))
        # as_tensor copies silently when the pointer is on another device: a scatter
        # into such a copy would write nothing the cache holds.
        if t.data_ptr() != ptr:
            raise CudaError(f"torch viewed 0x{ptr:x} as a copy at 0x{t.data_ptr():x} (not "
                            f"memory of cuda:{device})", call="torch.as_tensor")
        return t

    @contextmanager
    def torch_stream(self, stream: int, device: int) -> Iterator[None]:
        """Torch operations inside the block go to ``stream`` on ``device``: torch's
        own stream object when the handle is its current one (what ``stream=None``
        resolves to) or the legacy default stream (0), else an ExternalStream."""
        import torch as torch_module

        torch: Any = torch_module  # ExternalStream is untyped
        dev = torch.device("cuda", device)
        current = torch.cuda.current_stream(dev)
        on = (current if current.cuda_stream == stream else
              torch.cuda.default_stream(dev) if stream == 0 else
              torch.cuda.ExternalStream(stream, device=dev))
        with torch.cuda.device(device), torch.cuda.stream(on):
            yield

    def alloc_buffer(self, nbytes: int, device: int) -> int:
        """``nbytes`` of device memory from torch's caching allocator, for torch's
        current stream (call it inside :meth:`torch_stream`): blocks freed on that
        stream serve it first, even with work queued there still using them (safe for
        work queued there later only); on a miss torch frees its cache and retries
        before giving up. Kept until :meth:`free_buffer`. CudaError when the device
        has no room."""
        import torch

        try:
            t = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
        except torch.OutOfMemoryError as exc:
            raise CudaError(f"torch.empty({nbytes}) on cuda:{device}: "
                            f"{str(exc).splitlines()[0]}", call="torch.empty", code=2) from None
        ptr = int(t.data_ptr())
        with self._init_lock:
            self._buffers[ptr] = t
        return ptr

    def free_buffer(self, ptr: int) -> None:
        """Back to torch's cache (the caller has waited for every use of it: torch may
        hand it out again at once on the stream it was allocated on)."""
        with self._init_lock:
            self._buffers.pop(ptr, None)

    def malloc_host(self, nbytes: int) -> int:
        return int(self._rt_call("cudaMallocHost", nbytes)[0])

    def free_host(self, ptr: int) -> None:
        self._rt_call("cudaFreeHost", ptr)

    def stream_create(self) -> int:
        """A stream that does not synchronise with the legacy default stream
        (cudaStreamNonBlocking), as torch creates its streams."""
        (stream,) = self._rt_call("cudaStreamCreateWithFlags", STREAM_NON_BLOCKING)
        return int(stream)

    def stream_destroy(self, stream: int) -> None:
        self._rt_call("cudaStreamDestroy", stream)

    def event_create(self) -> Any:
        """An event for ordering streams of this process (no timing, no IPC)."""
        return self._rt_call("cudaEventCreateWithFlags", EVENT_DISABLE_TIMING)[0]

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        self._rt_call("cudaMemcpy", dst, src, nbytes, self._rt.cudaMemcpyKind.cudaMemcpyDefault)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._rt_call("cudaMemGetInfo")
        return int(free), int(total)

    def device_attribute(self, device: int, name: str) -> int | None:
        """``cudaDevAttr<name>`` of ``device`` (e.g. "Integrated",
        "PageableMemoryAccess"), or None when these bindings do not know it."""
        attr = getattr(self._rt.cudaDeviceAttr, f"cudaDevAttr{name}", None)
        if attr is None:
            return None
        return int(self._rt_call("cudaDeviceGetAttribute", attr, device)[0])


_driver_lock = threading.Lock()
_default_driver: CudaDriver | None = None


def get_driver() -> CudaDriver:
    """The process-wide cuda-python driver (CudaUnavailable without cuda-python)."""
    global _default_driver
    with _driver_lock:
        if _default_driver is None:
            _default_driver = CudaBindingsDriver()
        return _default_driver
