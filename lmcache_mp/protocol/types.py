"""msgspec Structs for LMCache MP wire types that every protocol profile shares.

msgspec encodes Structs (and LMCache's dataclasses) as msgpack maps keyed by field
name, in declaration order, defaults included; declaration order below is therefore
wire order, and must match LMCache's classes for frames to be byte-identical.
Decoding is by key name, so unknown keys from a newer server are ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = [
    "WireInt",
    "U32",
    "BlockId",
    "EngineType",
    "KVLayout",
    "LayoutHints",
    "EngineGroupInfo",
    "BlockAllocationRecord",
    "RegisterEngineDrivenContextPayload",
    "RegisterEngineDrivenContextResponse",
    "PoolSlot",
    "EngineDrivenContext",
    "PrepareStoreResponse",
    "PrepareRetrieveResponse",
    "WrapperBlob",
]

# Integers the client puts on the wire: msgspec validates int64 bounds natively.
WireInt = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# Token ids: the server packs them as unsigned 32-bit big-endian when hashing.
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]

EngineType = Literal["vllm", "sglang", "trtllm", "mock"]
KVLayout = Literal["NHD", "HND"]


class LayoutHints(msgspec.Struct, frozen=True, omit_defaults=True):
    """LMCache's ``LayoutHints`` TypedDict (total=False): unset keys are omitted.

    Keys are emitted in the TypedDict's declaration order. The server rejects nil
    here, so an empty hint is ``LayoutHints()`` (an empty map), never None.
    """

    kv_layout: KVLayout | msgspec.UnsetType = msgspec.UNSET
    num_kv_heads: WireInt | msgspec.UnsetType = msgspec.UNSET
    tokens_per_block: WireInt | msgspec.UnsetType = msgspec.UNSET
    head_dim: WireInt | msgspec.UnsetType = msgspec.UNSET


class EngineGroupInfo(msgspec.Struct, frozen=True):
    """One LMCache KV group (``lmcache.v1.multiprocess.group_view.EngineGroupInfo``)."""

    engine_group_id: WireInt
    layer_indices: tuple[WireInt, ...] = ()
    tokens_per_block: WireInt = 0
    sw_size_tokens: WireInt = -1


class BlockAllocationRecord(msgspec.Struct, frozen=True):
    """One per-request block allocation delta, for REPORT_BLOCK_ALLOCATION."""

    req_id: str
    new_block_ids: list[WireInt]
    new_token_ids: list[WireInt]


class RegisterEngineDrivenContextPayload(msgspec.Struct, frozen=True):
    """Payload of REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT (0.5.3 field set)."""

    instance_id: WireInt
    model_name: str
    world_size: WireInt
    block_size: WireInt
    num_layers: WireInt
    hidden_dim_size: WireInt
    dtype_str: str
    use_mla: bool


class RegisterEngineDrivenContextResponse(msgspec.Struct, frozen=True):
    """Where the server's L1 pool lives in POSIX SHM ("" / 0: no pool, pickle mode)."""

    shm_name: str = ""
    pool_size: int = 0
    # 0.5.7+: the engine block id the server treats as absent KV (older servers: 0).
    null_block_id: int = 0


class PoolSlot(msgspec.Struct, frozen=True):
    """One chunk object in the server's SHM L1 pool (LMCache's ``ShmSlotDescriptor``):
    ``length`` bytes at ``offset``, holding a tensor of ``shape`` and ``dtype``."""

    offset: int
    length: int
    shape: list[int]
    dtype: str


class EngineDrivenContext(msgspec.Struct, frozen=True):
    """The ``context`` map of PREPARE_STORE / PREPARE_RETRIEVE in SHM mode: the slots
    to copy, and (store only) which chunk of the key each slot is for. Pickle mode sends
    an empty map: both lists are then empty."""

    slots: list[PoolSlot] = []
    chunk_indices: list[int] = []


class PrepareStoreResponse(msgspec.Struct, frozen=True):
    """Slots reserved for an engine-driven store (none: every chunk is cached already)."""

    context: EngineDrivenContext = EngineDrivenContext()


class PrepareRetrieveResponse(msgspec.Struct, frozen=True):
    """Slots to read for an engine-driven retrieve (``success`` False on a miss)."""

    success: bool
    data: bytes = b""
    context: EngineDrivenContext = EngineDrivenContext()


class WrapperBlob:
    """An already-serialised KV-cache IPC wrapper, sent as msgpack ext type 1.

    ``data`` is produced by the pickle emitter (0.5.3-0.5.5) or the descriptor
    encoder (0.5.6); the codec never builds or inspects it. A plain class, not a
    Struct, so that the codec's encoder hook turns it into ``Ext(1, data)``.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        if not isinstance(data, bytes) or not data:
            raise TypeError("WrapperBlob needs non-empty bytes")
        self.data = data

    def __repr__(self) -> str:
        return f"WrapperBlob({len(self.data)} bytes)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WrapperBlob) and other.data == self.data

    def __hash__(self) -> int:
        return hash(self.data)
