"""CUDA errors and the handle / UUID byte helpers, apart from the driver calls.

The helpers must cope with every cuda-bindings layout (``.reserved`` up to 13.3,
``getPtr()`` only from 13.4); they need no CUDA and no cuda-python to run.
"""

from __future__ import annotations

import ctypes
import uuid as _uuid
from collections.abc import Sequence

from ...errors import InvalidArgument, LMCacheMPError, ProtocolMismatch

__all__ = [
    "IPC_HANDLE_SIZE",
    "TIMELINE_EVENT_HANDLE_SIZE",
    "CudaError",
    "CudaUnavailable",
    "UnsupportedServerEvent",
    "torch_uuid_string",
    "handle_bytes",
    "write_handle_bytes",
    "uuid_bytes",
    "ABSENT_ERRORS",
    "char_array_bytes",
]

IPC_HANDLE_SIZE = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t are both 64 bytes
#: LMCache 0.5.5+ ``--isolated-ipc`` servers answer with timeline-semaphore events:
#: ``struct.pack("!B64sQQ", 1, mem_handle, slot_offset, seq)``
#: (``platform/cuda/timeline_semaphore_event_ipc.py`` ``_EXPORT_STRUCT``).
TIMELINE_EVENT_HANDLE_SIZE = 81


# ---------------------------------------------------------------------- errors
class CudaError(LMCacheMPError):
    """A CUDA call failed; ``call`` and ``code`` say which and how."""

    def __init__(self, message: str, *, call: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.call = call
        self.code = code


class CudaUnavailable(CudaError):
    """No usable CUDA here: cuda-python missing, no driver, or no device."""


class UnsupportedServerEvent(CudaError, ProtocolMismatch):
    """A STORE / RETRIEVE reply carried a completion event this client cannot wait on
    (a CPU-mode server's stub, or an ``--isolated-ipc`` timeline-semaphore event)."""


#: Error names meaning "no CUDA on this machine" rather than "this call was wrong"
#: (the driver raises :class:`CudaUnavailable` for them).
ABSENT_ERRORS = (
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


def char_array_bytes(value: object) -> bytes:
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
    13.4 dropped that attribute (runtime.pxd: ``cudaIpcMemHandle_st`` lists no field),
    so otherwise read ``size`` bytes at ``getPtr()``."""
    reserved = getattr(struct, "reserved", None)
    data = char_array_bytes(reserved) if reserved is not None else ctypes.string_at(
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
    data = char_array_bytes(raw) if raw is not None else ctypes.string_at(
        _struct_address(uuid_struct), 16)
    if len(data) != 16:
        raise CudaError(f"a CUDA device UUID is 16 bytes, got {len(data)}")
    return data
