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

from .core_ops import core_operations
from .operations import Profile
from .types import U32, EngineGroupInfo, RegisterEngineDrivenContextPayload, WireInt
from .wrappers import PICKLE_V053

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


def key_fields(key: Any, worker_id: int | None) -> dict[str, Any]:
    """The eight 0.5.3 key fields of a public CacheKey, for this and later families."""
    return {
        "model_name": key.model_name,
        "world_size": key.world_size,
        "worker_id": worker_id,
        "token_ids": key.token_ids,
        "start": key.start,
        "end": key.end,
        "request_id": key.request_id,
        "cache_salt": key.cache_salt,
    }


def build_key(key: Any, worker_id: int | None, num_kv_readers: int = 1) -> CacheKeyV053:
    # 0.5.3 has no num_kv_readers: extra readers travel as LOOKUP's tp_size payload.
    return CacheKeyV053(**key_fields(key, worker_id))


_OPS = core_operations(
    key_type=CacheKeyV053,
    group_info_type=EngineGroupInfo,
    engine_driven_payload_type=RegisterEngineDrivenContextPayload,
    get_experimental_id=40,
    clear_takes_force=False,
    has_lookup_hits=True,
)

PROFILE = Profile(
    name="0.5.3",
    releases=("0.5.3", "0.5.4"),
    operations={op.name: op for op in _OPS},
    key_type=CacheKeyV053,
    build_key=build_key,
    wrappers=PICKLE_V053,
    notes={
        "clear": "CLEAR takes no payload; the server always forces.",
        "cpu_layout": "CPU servers read 5-D vLLM tensors as HND whatever kv_layout says.",
        "wrapper_format": "REGISTER_KV_CACHE carries pickled wrappers (ext type 1); CUDA "
                          "layers as RawCudaIPCWrapper or torch's CudaIPCWrapper.",
    },
)
