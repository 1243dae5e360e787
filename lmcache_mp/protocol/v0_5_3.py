"""Protocol profile for LMCache 0.5.3 and 0.5.4 (wire-identical releases).

Source: lmcache 0.5.3 ``v1/multiprocess/protocols/{base,engine,controller,debug,
observability}.py``. Op ids are the 1-based ``enum.auto()`` positions of
``RequestType``; only the engine, controller, debug and observability groups are
listed (blend and P2P ops are not spoken by this client, so their ids can never be
sent). Any id above 40 would kill a 0.5.3 server's message thread.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .operations import Operation, Payload, Profile
from .types import (
    U32,
    BlockAllocationRecord,
    BlockId,
    EngineGroupInfo,
    EngineType,
    LayoutHints,
    PrepareRetrieveResponse,
    PrepareStoreResponse,
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
    WireInt,
    WrapperBlob,
)

__all__ = ["PROFILE", "CacheKeyV053"]


class CacheKeyV053(msgspec.Struct, frozen=True):
    """``IPCCacheServerKey`` of 0.5.3: exactly these eight fields, in this order."""

    model_name: str
    world_size: WireInt
    worker_id: WireInt | None
    token_ids: tuple[U32, ...]
    start: WireInt
    end: WireInt
    request_id: str
    cache_salt: str = ""


def build_key(key: Any, worker_id: int | None) -> CacheKeyV053:
    return CacheKeyV053(
        model_name=key.model_name,
        world_size=key.world_size,
        worker_id=worker_id,
        token_ids=key.token_ids,
        start=key.start,
        end=key.end,
        request_id=key.request_id,
        cache_salt=key.cache_salt,
    )


def wrap_cpu_shm(
    shm_name: str, nbytes: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...]
) -> WrapperBlob:
    """0.5.3-0.5.5 carry a pickled ``CpuShmTensorWrapper``, emitted from its template."""
    from ..pickle_emitter import emit_cpu_shm_wrapper

    return WrapperBlob(emit_cpu_shm_wrapper(
        shm_name=shm_name, nbytes=nbytes, dtype=dtype, shape=shape, stride=stride
    ))


def wrap_cuda(
    ipc_handle: bytes,
    nbytes: int,
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    device_uuid: str,
) -> WrapperBlob:
    """A pickled ``RawCudaIPCWrapper``: a bare 64-byte ``cudaIpcMemHandle_t`` of an
    allocation base, no offset (the server needs cupy to open it)."""
    from ..pickle_emitter import emit_raw_cuda_wrapper

    return WrapperBlob(emit_raw_cuda_wrapper(
        ipc_handle=ipc_handle, nbytes=nbytes, dtype=dtype, shape=shape, stride=stride,
        device_uuid=device_uuid,
    ))


KEY = Payload("key", CacheKeyV053)
INSTANCE_ID = Payload("instance_id", WireInt)
BLOCK_IDS = Payload("block_ids", list[list[BlockId]])
EVENT = Payload("event_ipc_handle", bytes)
REQUEST_ID = Payload("request_id", str)
TP_SIZE = Payload("tp_size", WireInt)

_REGISTER_PAYLOADS = (
    INSTANCE_ID,
    Payload("kv_caches", list[WrapperBlob]),
    Payload("model_name", str),
    Payload("world_size", WireInt),
    Payload("engine_type", EngineType),
    Payload("layout_hints", LayoutHints),
    Payload("engine_group_infos", list[EngineGroupInfo]),
)
_TRANSFER_REPLY = tuple[bytes, bool]

_OPS = (
    # --- engine group -------------------------------------------------------
    Operation("REGISTER_KV_CACHE", 1, _REGISTER_PAYLOADS, None, "sync", "engine"),
    Operation("UNREGISTER_KV_CACHE", 2, (INSTANCE_ID,), None, "sync", "engine"),
    # Q-cache ops are answered only by servers started with --enable transfer_query.
    Operation("REGISTER_Q_CACHE", 3, _REGISTER_PAYLOADS, None, "sync", "engine"),
    Operation("UNREGISTER_Q_CACHE", 4, (INSTANCE_ID,), None, "sync", "engine"),
    Operation(
        "STORE_Q", 5, (KEY, INSTANCE_ID, BLOCK_IDS, EVENT), _TRANSFER_REPLY, "blocking", "engine"
    ),
    Operation(
        "STORE", 6, (KEY, INSTANCE_ID, BLOCK_IDS, EVENT), _TRANSFER_REPLY, "blocking", "engine"
    ),
    Operation(
        "RETRIEVE",
        7,
        (KEY, INSTANCE_ID, BLOCK_IDS, EVENT, Payload("skip_first_n_tokens", WireInt)),
        _TRANSFER_REPLY,
        "blocking",
        "engine",
    ),
    Operation("LOOKUP", 8, (KEY, TP_SIZE), None, "blocking", "engine"),
    Operation(
        "QUERY_PREFETCH_STATUS", 9, (REQUEST_ID,), int, "blocking", "engine", reply_optional=True
    ),
    Operation(
        "WAIT_PREFETCH_STATUS",
        10,
        (REQUEST_ID, Payload("timeout", float)),
        int,
        "blocking",
        "engine",
        reply_optional=True,
    ),
    Operation(
        "QUERY_PREFETCH_LOOKUP_HITS",
        11,
        (REQUEST_ID,),
        int,
        "blocking",
        "engine",
        reply_optional=True,
    ),
    Operation("FREE_LOOKUP_LOCKS", 12, (KEY, TP_SIZE), None, "blocking", "engine"),
    Operation("END_SESSION", 13, (REQUEST_ID,), None, "blocking", "engine"),
    Operation(
        "REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT",
        14,
        (Payload("payload", RegisterEngineDrivenContextPayload),),
        RegisterEngineDrivenContextResponse,
        "sync",
        "engine",
    ),
    Operation(
        "UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT", 15, (INSTANCE_ID,), None, "sync", "engine"
    ),
    Operation(
        "PREPARE_STORE", 16, (KEY, INSTANCE_ID), PrepareStoreResponse, "blocking", "engine"
    ),
    Operation(
        "COMMIT_STORE",
        17,
        (KEY, INSTANCE_ID, Payload("cpu_data", bytes)),
        bool,
        "blocking",
        "engine",
    ),
    Operation(
        "PREPARE_RETRIEVE", 18, (KEY, INSTANCE_ID), PrepareRetrieveResponse, "blocking", "engine"
    ),
    Operation("COMMIT_RETRIEVE", 19, (KEY, INSTANCE_ID), bool, "blocking", "engine"),
    # --- controller group ---------------------------------------------------
    # CLEAR has no payload up to 0.5.5 (the server always forces).
    Operation("CLEAR", 20, (), None, "blocking", "controller"),
    Operation("GET_CHUNK_SIZE", 21, (), int, "sync", "controller"),
    Operation(
        "PING", 22, (Payload("instance_id", WireInt | None),), bool, "blocking", "controller"
    ),
    Operation("GET_EXPERIMENTAL", 40, (), list[str], "sync", "controller"),
    # --- observability group ------------------------------------------------
    Operation(
        "REPORT_BLOCK_ALLOCATION",
        23,
        (INSTANCE_ID, Payload("model_name", str), Payload("records", list[BlockAllocationRecord])),
        None,
        "blocking",
        "observability",
    ),
    # --- debug group --------------------------------------------------------
    Operation("NOOP", 24, (), str, "sync", "debug"),
)

PROFILE = Profile(
    name="0.5.3",
    releases=("0.5.3", "0.5.4"),
    operations={op.name: op for op in _OPS},
    key_type=CacheKeyV053,
    build_key=build_key,
    wrap_cpu_shm=wrap_cpu_shm,
    wrap_cuda=wrap_cuda,
    notes={
        "clear": "CLEAR takes no payload; the server always forces.",
        "cpu_layout": "CPU servers read 5-D vLLM tensors as HND whatever kv_layout says.",
        "wrapper_format": "REGISTER_KV_CACHE carries pickled wrappers (ext type 1).",
    },
)
