"""Protocol profile for LMCache 0.5.7 (0.5.7rc2 on the package index).

Differences from 0.5.6 (source: lmcache 0.5.7rc2 ``v1/multiprocess/custom_types.py``,
``token_codec.py``, ``transport/base.py``; every one checked against its encoder by
fixtures/v0.5.7rc2):

* the key's ``token_ids`` tuple was replaced in place by ``token_bytes``: the ids
  packed as big-endian uint32, one word per token (the bytes blake3 always hashed,
  so chunk hashes are unchanged). A 0.5.6 key is dropped ("missing required field
  'token_bytes'"), and a 0.5.7 key by 0.5.6;
* FREE_LOOKUP_LOCKS gains a third payload ``extra_ranges`` and PREPARE_STORE a third
  ``skipped_chunks`` (both default ``()``; the server still needs the frame);
* the engine-driven registration payload gains ``group_layouts`` (default ``[]``) and
  its reply ``null_block_id``;
* GET_EXPERIMENTAL no longer advertises ``kv_event_stream``;
* unchanged: the frozen legacy op ids (``transport/zmq_impl/wire.py`` is byte-identical
  to 0.5.6's), CLEAR ``[force]``, the msgpack wrapper descriptors (``ipc_wire.py``
  unchanged), which gain nothing but a server-side ``cuda_vmm`` receiver.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .core_ops import core_operations
from .operations import Profile
from .types import WireInt
from .v0_5_5 import EngineGroupInfoV055, RegisterEngineDrivenContextPayloadV055
from .wrappers import DESCRIPTOR_V056

__all__ = ["PROFILE", "CacheKeyV057", "GroupLayout", "RegisterEngineDrivenContextPayloadV057"]


class CacheKeyV057(msgspec.Struct, frozen=True):
    """``IPCCacheServerKey`` of 0.5.7: 0.5.6's ten fields with ``token_bytes`` in the
    place of ``token_ids`` (wire order is declaration order)."""

    model_name: str
    world_size: WireInt
    worker_id: WireInt | None
    token_bytes: bytes
    start: WireInt
    end: WireInt
    request_id: str
    cache_salt: str = ""
    request_configs: dict[str, Any] | None = None
    num_kv_readers: WireInt = 0


class GroupLayout(msgspec.Struct, frozen=True):
    """LMCache 0.5.7's per-group layout for multi-group engine-driven registration
    (the client registers one group, so it sends none)."""

    num_layers: WireInt
    hidden_dim_size: WireInt
    dtype_str: str
    tokens_per_block: WireInt
    window_tokens: WireInt = 0
    kv_size: WireInt = 0
    window_chunks: WireInt = 0
    recurrent: bool = False


class RegisterEngineDrivenContextPayloadV057(RegisterEngineDrivenContextPayloadV055, frozen=True):
    group_layouts: list[GroupLayout] = []


def build_key(key: Any, worker_id: int | None, num_kv_readers: int = 1) -> CacheKeyV057:
    # The public key holds its ids packed already: no Python int per token here.
    return CacheKeyV057(
        model_name=key.model_name, world_size=key.world_size, worker_id=worker_id,
        token_bytes=key.token_bytes, start=key.start, end=key.end,
        request_id=key.request_id, cache_salt=key.cache_salt, num_kv_readers=num_kv_readers)


PROFILE = Profile(
    name="0.5.7",
    # 0.5.7 final: add it here (and to the Makefile's RELEASES) once it is published and
    # `make fixtures` / tools/record_probe.py show it speaks this wire.
    releases=("0.5.7rc2",),
    operations={op.name: op for op in core_operations(
        key_type=CacheKeyV057,
        group_info_type=EngineGroupInfoV055,
        engine_driven_payload_type=RegisterEngineDrivenContextPayloadV057,
        get_experimental_id=32,
        clear_takes_force=True,
        has_lookup_hits=False,
        defaulted_tails=True,
    )},
    key_type=CacheKeyV057,
    build_key=build_key,
    wrappers=DESCRIPTOR_V056,
    notes={
        "clear": "CLEAR takes [force: bool].",
        "num_kv_readers": "LOOKUP keys must carry num_kv_readers >= 1.",
        "token_bytes": "Keys carry token ids packed as big-endian uint32 (token_bytes).",
        "wrapper_format": "REGISTER_KV_CACHE carries msgpack descriptors (ext type 1).",
        "retired": "QUERY_PREFETCH_LOOKUP_HITS (id 11) is retired.",
    },
)
