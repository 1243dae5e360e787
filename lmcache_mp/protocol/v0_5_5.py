"""Protocol profile for LMCache 0.5.5.

Differences from 0.5.3/0.5.4 (source: lmcache 0.5.5 ``v1/multiprocess``):

* the key gains ``request_configs`` (nil) and ``num_kv_readers``; LOOKUP and
  FREE_LOOKUP_LOCKS are dropped without a reply unless ``num_kv_readers >= 1``, and
  LOOKUP's ``tp_size`` payload is ignored (readers travel in the key);
* the old blend ops were deleted, so GET_EXPERIMENTAL moved from id 40 to 32 (and 40
  would kill the server's message thread);
* ``EngineGroupInfo`` gains ``extra_object_group_tag`` and ``recurrent_state``;
  the engine-driven payload gains ``num_physical_slots``; engine type "atom" exists;
* CPU servers honour the ``kv_layout`` hint (HND is still sent explicitly);
* wrappers are still pickles; ``RawCudaIPCWrapper`` gains ``_alloc_offset`` and
  ``_opens`` (template ``v0_5_5_raw_cuda``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .core_ops import core_operations
from .operations import Profile
from .types import U32, WireInt, WrapperBlob
from .v0_5_3 import wrap_cpu_shm

__all__ = ["PROFILE", "CacheKeyV055", "EngineGroupInfoV055",
           "RegisterEngineDrivenContextPayloadV055"]


class CacheKeyV055(msgspec.Struct, frozen=True):
    """``IPCCacheServerKey`` of 0.5.5 and 0.5.6: ten fields, in this order."""

    model_name: str
    world_size: WireInt
    worker_id: WireInt | None
    token_ids: tuple[U32, ...]
    start: WireInt
    end: WireInt
    request_id: str
    cache_salt: str = ""
    request_configs: dict[str, Any] | None = None
    num_kv_readers: WireInt = 0


class EngineGroupInfoV055(msgspec.Struct, frozen=True):
    engine_group_id: WireInt
    layer_indices: tuple[WireInt, ...] = ()
    tokens_per_block: WireInt = 0
    sw_size_tokens: WireInt = -1
    extra_object_group_tag: WireInt = 0
    recurrent_state: bool = False


class RegisterEngineDrivenContextPayloadV055(msgspec.Struct, frozen=True):
    instance_id: WireInt
    model_name: str
    world_size: WireInt
    block_size: WireInt
    num_layers: WireInt
    hidden_dim_size: WireInt
    dtype_str: str
    use_mla: bool
    num_physical_slots: WireInt | None = None


def build_key(key: Any, worker_id: int | None, num_kv_readers: int = 1) -> CacheKeyV055:
    # Every key carries its reader count, as LMCache's own vLLM adapter sends it.
    return CacheKeyV055(
        model_name=key.model_name,
        world_size=key.world_size,
        worker_id=worker_id,
        token_ids=key.token_ids,
        start=key.start,
        end=key.end,
        request_id=key.request_id,
        cache_salt=key.cache_salt,
        num_kv_readers=num_kv_readers,
    )


def wrap_cuda(
    ipc_handle: bytes,
    nbytes: int,
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    device_uuid: str,
) -> WrapperBlob:
    """A pickled 0.5.5 ``RawCudaIPCWrapper`` of an allocation base (offset 0)."""
    from ..pickle_emitter import emit

    return WrapperBlob(emit("v0_5_5_raw_cuda", {
        "_ipc_handle_reserved": ipc_handle, "_alloc_offset": 0, "_nbytes": nbytes,
        "dtype": dtype, "shape": shape, "stride": stride, "storage_offset": 0, "_opens": 0,
        "device_uuid": device_uuid,
    }))


PROFILE = Profile(
    name="0.5.5",
    releases=("0.5.5",),
    operations={op.name: op for op in core_operations(
        key_type=CacheKeyV055,
        group_info_type=EngineGroupInfoV055,
        engine_driven_payload_type=RegisterEngineDrivenContextPayloadV055,
        get_experimental_id=32,
        clear_takes_force=False,
        has_lookup_hits=True,
    )},
    key_type=CacheKeyV055,
    build_key=build_key,
    wrap_cpu_shm=wrap_cpu_shm,
    wrap_cuda=wrap_cuda,
    notes={
        "clear": "CLEAR takes no payload; the server always forces.",
        "num_kv_readers": "LOOKUP keys must carry num_kv_readers >= 1; tp_size is ignored.",
        "wrapper_format": "REGISTER_KV_CACHE carries pickled wrappers (ext type 1).",
    },
)
