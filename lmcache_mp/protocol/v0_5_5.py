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

from .core_ops import core_operations
from .operations import Profile
from .types import EngineGroupInfo, RegisterEngineDrivenContextPayload, WireInt
from .v0_5_3 import CacheKeyV053, key_fields
from .wrappers import PICKLE_V055

__all__ = ["PROFILE", "CacheKeyV055", "EngineGroupInfoV055",
           "RegisterEngineDrivenContextPayloadV055"]


class CacheKeyV055(CacheKeyV053, frozen=True):
    """``IPCCacheServerKey`` of 0.5.5 and 0.5.6: 0.5.3's eight fields, then two more
    (msgspec puts a subclass's fields after its base's, as the wire order needs)."""

    request_configs: dict[str, Any] | None = None
    num_kv_readers: WireInt = 0


class EngineGroupInfoV055(EngineGroupInfo, frozen=True):
    extra_object_group_tag: WireInt = 0
    recurrent_state: bool = False


class RegisterEngineDrivenContextPayloadV055(RegisterEngineDrivenContextPayload, frozen=True):
    num_physical_slots: WireInt | None = None


def build_key(key: Any, worker_id: int | None, num_kv_readers: int = 1) -> CacheKeyV055:
    # Every key carries its reader count, as LMCache's own vLLM adapter sends it.
    return CacheKeyV055(**key_fields(key, worker_id), num_kv_readers=num_kv_readers)


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
    wrappers=PICKLE_V055,
    notes={
        "clear": "CLEAR takes no payload; the server always forces.",
        "num_kv_readers": "LOOKUP keys must carry num_kv_readers >= 1; tp_size is ignored.",
        "wrapper_format": "REGISTER_KV_CACHE carries pickled wrappers (ext type 1).",
    },
)
