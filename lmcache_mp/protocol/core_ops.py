"""The engine, controller, debug and observability operations shared by the 0.5.x
families, parametrised by what differs between them (key and struct schemas,
GET_EXPERIMENTAL's id, CLEAR's payload, whether QUERY_PREFETCH_LOOKUP_HITS exists).

Ids 1-24 are frozen since 0.5.3 (the enum order of ``RequestType``, kept as 0.5.6's
``LEGACY_OPERATION_IDS``). Only hand-written ids from this table can ever be sent.
"""

from __future__ import annotations

from typing import Any

from .operations import Operation, Payload
from .types import (
    BlockAllocationRecord,
    BlockId,
    EngineType,
    LayoutHints,
    PrepareRetrieveResponse,
    PrepareStoreResponse,
    RegisterEngineDrivenContextResponse,
    WireInt,
    WrapperBlob,
)

__all__ = ["core_operations"]


def core_operations(
    *,
    key_type: Any,
    group_info_type: Any,
    engine_driven_payload_type: Any,
    get_experimental_id: int,
    clear_takes_force: bool,
    has_lookup_hits: bool,
    defaulted_tails: bool = False,
) -> tuple[Operation, ...]:
    """``defaulted_tails`` (0.5.7+): FREE_LOOKUP_LOCKS gains ``extra_ranges`` and
    PREPARE_STORE ``skipped_chunks``, both defaulting to ``()``; the server requires
    the frame even when empty, so a 0.5.6-shaped request is dropped."""
    KEY = Payload("key", key_type)
    INSTANCE_ID = Payload("instance_id", WireInt)
    BLOCK_IDS = Payload("block_ids", list[list[BlockId]])
    EVENT = Payload("event_ipc_handle", bytes)
    REQUEST_ID = Payload("request_id", str)
    TP_SIZE = Payload("tp_size", WireInt)
    register_payloads = (
        INSTANCE_ID,
        Payload("kv_caches", list[WrapperBlob]),
        Payload("model_name", str),
        Payload("world_size", WireInt),
        Payload("engine_type", EngineType),
        Payload("layout_hints", LayoutHints),
        Payload("engine_group_infos", list[group_info_type]),
    )
    transfer_reply = tuple[bytes, bool]
    # (start, end) token ranges of earlier abandoned lookups whose locks to free too.
    free_tail = (Payload("extra_ranges", tuple[tuple[WireInt, WireInt], ...], default=()),
                 ) if defaulted_tails else ()
    # Per KV group, chunk positions the worker will not store (no slot reserved).
    prepare_tail = (Payload("skipped_chunks", tuple[tuple[WireInt, ...], ...], default=()),
                    ) if defaulted_tails else ()

    ops = [
        # --- engine group ---------------------------------------------------
        Operation("REGISTER_KV_CACHE", 1, register_payloads, None, "sync", "engine"),
        Operation("UNREGISTER_KV_CACHE", 2, (INSTANCE_ID,), None, "sync", "engine"),
        # Q-cache ops are answered only by servers started with --enable transfer_query.
        Operation("REGISTER_Q_CACHE", 3, register_payloads, None, "sync", "engine"),
        Operation("UNREGISTER_Q_CACHE", 4, (INSTANCE_ID,), None, "sync", "engine"),
        Operation("STORE_Q", 5, (KEY, INSTANCE_ID, BLOCK_IDS, EVENT), transfer_reply,
                  "blocking", "engine"),
        Operation("STORE", 6, (KEY, INSTANCE_ID, BLOCK_IDS, EVENT), transfer_reply,
                  "blocking", "engine"),
        Operation("RETRIEVE", 7,
                  (KEY, INSTANCE_ID, BLOCK_IDS, EVENT, Payload("skip_first_n_tokens", WireInt)),
                  transfer_reply, "blocking", "engine"),
        Operation("LOOKUP", 8, (KEY, TP_SIZE), None, "blocking", "engine"),
        Operation("QUERY_PREFETCH_STATUS", 9, (REQUEST_ID,), int, "blocking", "engine",
                  reply_optional=True),
        Operation("WAIT_PREFETCH_STATUS", 10, (REQUEST_ID, Payload("timeout", float)), int,
                  "blocking", "engine", reply_optional=True),
        Operation("FREE_LOOKUP_LOCKS", 12, (KEY, TP_SIZE, *free_tail), None, "blocking",
                  "engine"),
        Operation("END_SESSION", 13, (REQUEST_ID,), None, "blocking", "engine"),
        Operation("REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT", 14,
                  (Payload("payload", engine_driven_payload_type),),
                  RegisterEngineDrivenContextResponse, "sync", "engine"),
        Operation("UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT", 15, (INSTANCE_ID,), None,
                  "sync", "engine"),
        Operation("PREPARE_STORE", 16, (KEY, INSTANCE_ID, *prepare_tail), PrepareStoreResponse,
                  "blocking", "engine"),
        # cpu_data: empty, the data travels in the shared-memory pool (this client's only
        # engine-driven transport), as LMCache's own SHM adapter sends it.
        Operation("COMMIT_STORE", 17, (KEY, INSTANCE_ID, Payload("cpu_data", bytes, default=b"")),
                  bool, "blocking", "engine"),
        Operation("PREPARE_RETRIEVE", 18, (KEY, INSTANCE_ID), PrepareRetrieveResponse,
                  "blocking", "engine"),
        Operation("COMMIT_RETRIEVE", 19, (KEY, INSTANCE_ID), bool, "blocking", "engine"),
        # --- controller group -----------------------------------------------
        # CLEAR takes no payload up to 0.5.5 (the server always forces); 0.5.6 drops
        # a CLEAR without its [force] payload.
        Operation("CLEAR", 20, (Payload("force", bool),) if clear_takes_force else (), None,
                  "blocking", "controller"),
        Operation("GET_CHUNK_SIZE", 21, (), int, "sync", "controller"),
        Operation("PING", 22, (Payload("instance_id", WireInt | None),), bool, "blocking",
                  "controller"),
        Operation("GET_EXPERIMENTAL", get_experimental_id, (), list[str], "sync", "controller"),
        # --- observability group --------------------------------------------
        Operation("REPORT_BLOCK_ALLOCATION", 23,
                  (INSTANCE_ID, Payload("model_name", str),
                   Payload("records", list[BlockAllocationRecord])),
                  None, "blocking", "observability"),
        # --- debug group ------------------------------------------------------
        Operation("NOOP", 24, (), str, "sync", "debug"),
    ]
    if has_lookup_hits:
        ops.append(Operation("QUERY_PREFETCH_LOOKUP_HITS", 11, (REQUEST_ID,), int, "blocking",
                             "engine", reply_optional=True))
    return tuple(sorted(ops, key=lambda op: op.id))
