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

from .core_ops import core_operations
from .operations import Profile
from .v0_5_5 import (
    CacheKeyV055,
    EngineGroupInfoV055,
    RegisterEngineDrivenContextPayloadV055,
    build_key,
)
from .wrappers import DESCRIPTOR_V056

__all__ = ["PROFILE"]

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
    wrappers=DESCRIPTOR_V056,
    notes={
        "clear": "CLEAR takes [force: bool].",
        "num_kv_readers": "LOOKUP keys must carry num_kv_readers >= 1.",
        "wrapper_format": "REGISTER_KV_CACHE carries msgpack descriptors (ext type 1).",
        "retired": "QUERY_PREFETCH_LOOKUP_HITS (id 11) is retired.",
    },
)
