"""Protocol profile for LMCache 0.5.6.

Differences from 0.5.5 (source: lmcache 0.5.6 ``v1/multiprocess/transport``,
``v1/platform/base/ipc_wire.py``):

* the request-type enum is gone: operations are method names, and the frozen
  ``LEGACY_OPERATION_IDS`` table keeps ids 1-33 (id 11, QUERY_PREFETCH_LOOKUP_HITS,
  is retired). This client sends only those integers, never string names;
* CLEAR takes ``[force: bool]`` (an empty CLEAR is dropped);
* REGISTER_KV_CACHE carries msgpack **descriptors** inside ext type 1 instead of
  pickles (pickle is rejected): tagged, versioned maps with ``forbid_unknown_fields``;
* unknown ops are logged and dropped instead of killing the message thread.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .core_ops import core_operations
from .operations import Profile
from .types import WrapperBlob
from .v0_5_5 import (
    CacheKeyV055,
    EngineGroupInfoV055,
    RegisterEngineDrivenContextPayloadV055,
    build_key,
)

__all__ = ["PROFILE", "cpu_shm_descriptor", "cuda_raw_descriptor"]

NonNegative = msgspec.Meta(ge=0)


# Mirrors of lmcache 0.5.6 ipc_wire.py, same options, so msgspec writes the same
# bytes (the tag, then kw_only base fields after the subclass's own fields).
class _TensorMetadata(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device_uuid: str


class _IPCData(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    version: Literal[1]
    metadata: _TensorMetadata


class _CpuShmIPCData(_IPCData, tag="cpu_shm"):
    shm_name: str
    nbytes: int


class _RawCudaIPCData(_IPCData, tag="cuda_raw"):
    ipc_handle: bytes
    alloc_offset: int
    nbytes: int


def _metadata(dtype: str, shape: tuple[int, ...], stride: tuple[int, ...],
              device_uuid: str) -> _TensorMetadata:
    from ..pickle_emitter import TORCH_DTYPES

    if dtype not in TORCH_DTYPES:
        from ..errors import InvalidArgument

        raise InvalidArgument(f"unsupported dtype {dtype!r}")
    return _TensorMetadata(dtype=dtype, shape=tuple(shape), stride=tuple(stride),
                           storage_offset=0, device_uuid=device_uuid)


def cpu_shm_descriptor(
    shm_name: str, nbytes: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...]
) -> bytes:
    return msgspec.msgpack.encode(_CpuShmIPCData(
        version=1, metadata=_metadata(dtype, shape, stride, "cpu"), shm_name=shm_name,
        nbytes=nbytes,
    ))


def cuda_raw_descriptor(
    ipc_handle: bytes, nbytes: int, dtype: str, shape: tuple[int, ...],
    stride: tuple[int, ...], device_uuid: str,
) -> bytes:
    if len(ipc_handle) != 64:
        from ..errors import InvalidArgument

        raise InvalidArgument("a cudaIpcMemHandle_t is exactly 64 bytes")
    return msgspec.msgpack.encode(_RawCudaIPCData(
        version=1, metadata=_metadata(dtype, shape, stride, device_uuid),
        ipc_handle=ipc_handle, alloc_offset=0, nbytes=nbytes,
    ))


def wrap_cpu_shm(
    shm_name: str, nbytes: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...]
) -> WrapperBlob:
    return WrapperBlob(cpu_shm_descriptor(shm_name, nbytes, dtype, shape, stride))


def wrap_cuda(
    ipc_handle: bytes, nbytes: int, dtype: str, shape: tuple[int, ...],
    stride: tuple[int, ...], device_uuid: str,
) -> WrapperBlob:
    return WrapperBlob(cuda_raw_descriptor(ipc_handle, nbytes, dtype, shape, stride,
                                           device_uuid))


PROFILE = Profile(
    name="0.5.6",
    releases=("0.5.6",),
    operations={op.name: op for op in core_operations(
        key_type=CacheKeyV055,
        group_info_type=EngineGroupInfoV055,
        engine_driven_payload_type=RegisterEngineDrivenContextPayloadV055,
        get_experimental_id=32,
        clear_takes_force=True,
        has_lookup_hits=False,
    )},
    key_type=CacheKeyV055,
    build_key=build_key,
    wrap_cpu_shm=wrap_cpu_shm,
    wrap_cuda=wrap_cuda,
    notes={
        "clear": "CLEAR takes [force: bool].",
        "num_kv_readers": "LOOKUP keys must carry num_kv_readers >= 1.",
        "wrapper_format": "REGISTER_KV_CACHE carries msgpack descriptors (ext type 1).",
        "retired": "QUERY_PREFETCH_LOOKUP_HITS (id 11) is retired.",
    },
)
