"""Operation tables: what an operation sends, what it gets back, and its wire id.

A :class:`Profile` is one wire family of LMCache servers (e.g. 0.5.3/0.5.4). It owns the
op ids, payload and reply schemas, and the cache-key schema, so that speaking a new
release means adding a profile module, not editing the client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

__all__ = ["Payload", "Operation", "Profile", "KeyBuilder", "CpuShmWrapperBuilder",
           "CudaWrapperBuilder"]

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
# Serialises one CPU SHM layer for REGISTER_KV_CACHE in the family's wrapper format:
# (shm_name, nbytes, dtype name, shape, stride) -> WrapperBlob.
CpuShmWrapperBuilder = Callable[[str, int, str, "tuple[int, ...]", "tuple[int, ...]"], Any]
# Serialises one CUDA layer allocation: (64-byte cudaIpcMemHandle, nbytes, dtype name,
# shape, stride, device uuid) -> WrapperBlob.
CudaWrapperBuilder = Callable[[bytes, int, str, "tuple[int, ...]", "tuple[int, ...]", str], Any]


@dataclass(frozen=True)
class Profile:
    """One wire family of LMCache MP servers."""

    name: str
    releases: tuple[str, ...]
    operations: Mapping[str, Operation]
    key_type: type[msgspec.Struct]
    build_key: KeyBuilder
    wrap_cpu_shm: CpuShmWrapperBuilder
    wrap_cuda: CudaWrapperBuilder
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
