"""Operation tables: what an operation sends, what it gets back, and its wire id.

A :class:`Profile` is one wire family of LMCache servers (e.g. 0.5.3/0.5.4). It owns the
op ids, payload and reply schemas, and the cache-key schema, so that speaking a new
release means adding a profile module, not editing the client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from ..layer_exports import KVLayout, LayerExport
from .wrappers import WrapperFormats

__all__ = ["Payload", "Operation", "Profile", "KeyBuilder", "kv_readers", "NO_DEFAULT"]

#: Marks a payload the caller must always give.
NO_DEFAULT: Any = object()

Group = Literal["engine", "controller", "debug", "observability"]
HandlerKind = Literal["sync", "blocking"]


@dataclass(frozen=True)
class Payload:
    """One payload frame: its name (for error messages) and its msgspec type.

    ``validate`` returns the value the encoder will send (e.g. an int timeout becomes
    a float, a dict becomes the Struct) or raises ``msgspec.ValidationError`` /
    ``TypeError``; it is built once per payload type.
    """

    name: str
    type: Any
    # A trailing payload with a default may be left out by the caller; the encoder
    # sends the default, as LMCache's own client does (``bind_payloads`` applies the
    # defaults: its server requires every payload frame, defaulted ones included).
    default: Any = NO_DEFAULT
    validate: Callable[[Any], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "validate", _make_validator(self.type))


def _make_validator(tp: Any) -> Callable[[Any], Any]:
    from .types import WrapperBlob

    if tp == list[WrapperBlob]:

        def validate_blobs(value: Any) -> Any:
            if not isinstance(value, (list, tuple)) or not value:
                raise TypeError("expected a non-empty list of WrapperBlob")
            for blob in value:
                if not isinstance(blob, WrapperBlob):
                    raise TypeError(f"expected WrapperBlob, got {type(blob).__name__}")
            return value

        return validate_blobs

    # msgspec learns a Struct's fields (its annotations evaluated, a compile each) on
    # the type's first use and keeps them on the class: learnt here, at import (~2 ms
    # for every profile's payloads), not in the first call of each operation, which is
    # often on a request's path (0.2 ms of LOOKUP's key on vLLM's scheduler thread).
    msgspec.msgpack.Decoder(tp)

    def validate(value: Any) -> Any:
        # strict: a bool is not an int, a str is not bytes, as on the server side.
        # from_attributes: a family's richer struct (e.g. 0.5.5's EngineGroupInfo)
        # is built from the public one, its extra fields taking their defaults.
        return msgspec.convert(value, tp, strict=True, from_attributes=True)

    return validate


@dataclass(frozen=True)
class Operation:
    """One request type of a profile.

    ``reply`` is the msgspec type of the third reply frame, or None for a 2-frame
    acknowledgement. ``reply_optional`` marks ``T | None`` replies, where the server
    signals None by omitting the third frame rather than sending msgpack nil.
    """

    name: str
    id: int
    payloads: tuple[Payload, ...]
    reply: Any
    handler: HandlerKind
    group: Group
    reply_optional: bool = False
    # Precomputed, so the hot path never encodes the op id and can never emit an
    # id that is not in a hand-written table.
    type_frame: bytes = field(init=False, repr=False, compare=False)
    reply_decoder: msgspec.msgpack.Decoder[Any] | None = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not 1 <= self.id <= 127:
            raise ValueError(f"op id {self.id} of {self.name} is outside the fixint range")
        object.__setattr__(self, "type_frame", msgspec.msgpack.encode(self.id))
        decoder = None if self.reply is None else msgspec.msgpack.Decoder(self.reply)
        object.__setattr__(self, "reply_decoder", decoder)


# Builds the profile's wire key from a public CacheKey, a worker id (None for LOOKUP) and
# the number of readers that will retrieve each chunk (0.5.5+ keys carry it).
KeyBuilder = Callable[[Any, "int | None", int], msgspec.Struct]


#: LMCache's ``MAX_READ_LOCK_COUNT`` (l1_manager.py, 0.5.3-0.5.6): read locks per object.
MAX_READ_LOCKS = 128


def kv_readers(tp_size: int, world_size: int, mla: bool = False) -> int:
    """Read locks per looked-up chunk: how many workers will retrieve it.

    0.5.3's server derives it from LOOKUP's ``tp_size`` payload (extra readers when
    MLA replicates KV over more TP ranks than KV shards); 0.5.5+ keys carry it as
    ``num_kv_readers``. Same rule both ways, so ``tp_size`` means the same everywhere.
    With ``mla`` (a pure-MLA cache: KV replicated over the TP ranks on this server) the
    0.5.5+ key declares all ``tp_size`` ranks as readers whatever the world size, as
    LMCache's own adapter does (``ParallelStrategy.num_kv_readers``); a 0.5.3 server
    applies its own rule to the ``tp_size`` payload.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        from ..errors import InvalidArgument

        raise InvalidArgument(f"tp_size must be a positive int, got {tp_size!r}")
    tp = tp_size if tp_size > 1 else world_size
    readers = tp_size if mla else 1 + (tp - 1 if tp > world_size else 0)
    if readers > MAX_READ_LOCKS:
        from ..errors import InvalidArgument

        raise InvalidArgument(
            f"tp_size={tp_size} asks for {readers} read locks per chunk; LMCache servers hold "
            f"at most {MAX_READ_LOCKS} (they clamp silently, and the extra retrieves would "
            f"miss): use tp_size <= {MAX_READ_LOCKS}")
    return readers


@dataclass(frozen=True)
class Profile:
    """One wire family of LMCache MP servers, and every payload whose shape differs
    between families (keys, CLEAR, REGISTER's wrappers): callers hand plain values."""

    name: str
    releases: tuple[str, ...]
    operations: Mapping[str, Operation]
    key_type: type[msgspec.Struct]
    build_key: KeyBuilder
    wrappers: WrapperFormats
    # Behaviours the client must respect (documented per profile).
    notes: Mapping[str, str] = field(default_factory=dict)

    def op(self, name: str) -> Operation:
        """The operation called ``name``; ProtocolMismatch if this family lacks it."""
        try:
            return self.operations[name]
        except KeyError:
            from ..errors import ProtocolMismatch

            raise ProtocolMismatch(
                f"LMCache {'/'.join(self.releases)} servers have no {name} operation; "
                f"the client refuses to send it. Use a server release that has it, "
                f"or choose the matching protocol= profile."
            ) from None

    def has(self, name: str) -> bool:
        return name in self.operations

    # ------------------------------------------------------------ payloads
    # Callers name every payload (a dict by payload name, see codec.encode_request): the
    # wire order is the operation's, a payload left out takes its default. What differs
    # between families is built here from plain values.
    def all_ranks_payloads(self, key: Any, tp_size: int, mla: bool = False) -> dict[str, Any]:
        """LOOKUP / FREE_LOOKUP_LOCKS: the key for every rank (worker_id nil), the reader
        count in the key (0.5.5+; see :func:`kv_readers` for ``mla``) and as the
        ``tp_size`` payload (0.5.3)."""
        return {"key": self.build_key(key, None, kv_readers(tp_size, key.world_size, mla)),
                "tp_size": tp_size}

    def transfer_key(self, key: Any, worker_id: int) -> msgspec.Struct:
        """The key of a STORE / RETRIEVE / PREPARE_* / COMMIT_* for one KV rank."""
        return self.build_key(key, worker_id, 1)

    def clear_payloads(self, force: bool) -> dict[str, Any]:
        """CLEAR: no payload up to 0.5.5 (the server always forces), ``[force]`` after."""
        return {"force": bool(force)} if self.op("CLEAR").payloads else {}

    def register_payloads(
        self,
        instance_id: int,
        exports: Sequence[LayerExport],
        model_name: str,
        world_size: int,
        kv_layout: KVLayout | None,
        groups: Sequence[Any],
    ) -> dict[str, Any]:
        """REGISTER_KV_CACHE's seven payloads; the engine type is always ``"vllm"``
        (the server reads vLLM-style paged layers; it is only a format hint)."""
        from .types import LayoutHints

        hints = LayoutHints() if kv_layout is None else LayoutHints(kv_layout=kv_layout)
        return {"instance_id": instance_id,
                "kv_caches": self.wrappers.encode(exports, "/".join(self.releases)),
                "model_name": model_name, "world_size": world_size, "engine_type": "vllm",
                "layout_hints": hints, "engine_group_infos": list(groups)}
