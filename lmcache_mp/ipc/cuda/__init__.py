"""GPU KV caches the LMCache server maps through CUDA IPC, with cuda-python only.

Imported only when used (``pip install 'lmcache-mp[cuda]'``); it never imports torch
or lmcache, and cuda-python only when a driver is first needed.

* :mod:`.driver`: every CUDA call behind :class:`CudaDriver` (cuda-python's
  :class:`CudaBindingsDriver`, or a fake in tests), handle and UUID helpers;
* :mod:`.export`: exporting one allocation (or keeping it local when CUDA IPC cannot
  share it), device/context and stream rules, the per-transfer event;
* :mod:`.cache`: :class:`CudaKVCache`, the :class:`~lmcache_mp.ipc.base.ExportableKVCache`
  the client registers;
* :mod:`.staging`: engine-driven copies between a :class:`CudaKVCache` and the
  server's shared-memory pool (imported by the session only for such a copy).
"""

from __future__ import annotations

from .cache import WRAPPER_FORMATS, CudaKVCache, WrapperFormat
from .driver import (
    IPC_HANDLE_SIZE,
    TIMELINE_EVENT_HANDLE_SIZE,
    CudaBindingsDriver,
    CudaDriver,
    CudaError,
    CudaUnavailable,
    DeviceInfo,
    UnsupportedServerEvent,
    get_driver,
    handle_bytes,
    torch_uuid_string,
    uuid_bytes,
    write_handle_bytes,
)
from .export import (
    ExportedAllocation,
    TransferEvent,
    check_server_event,
    default_stream,
    export_allocation,
    on_device,
    stream_handle,
)

__all__ = [
    "IPC_HANDLE_SIZE",
    "TIMELINE_EVENT_HANDLE_SIZE",
    "CudaError",
    "CudaUnavailable",
    "UnsupportedServerEvent",
    "CudaDriver",
    "CudaBindingsDriver",
    "DeviceInfo",
    "ExportedAllocation",
    "TransferEvent",
    "CudaKVCache",
    "WrapperFormat",
    "WRAPPER_FORMATS",
    "check_server_event",
    "default_stream",
    "get_driver",
    "on_device",
    "torch_uuid_string",
    "handle_bytes",
    "write_handle_bytes",
    "uuid_bytes",
    "stream_handle",
    "export_allocation",
]
