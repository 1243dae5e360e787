"""Pure frame encoding and decoding: operation + payloads <-> multipart frames.

No sockets here. A request on the wire is ``[uid, type, *payloads]``; the transport
owns the uid, this module produces ``[type, *payloads]`` and reads a reply's
``[type, (value)]``. Every payload is validated against the operation's schema before
encoding, because the server silently drops what it cannot decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ..errors import InvalidArgument, ProtocolMismatch
from .operations import NO_DEFAULT, Operation
from .types import WrapperBlob

__all__ = ["encode_request", "decode_reply", "encode_value"]

# The ext code LMCache's decoder maps to its wrapper deserialiser (custom_types.py).
WRAPPER_EXT_CODE = 1


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, WrapperBlob):
        return msgspec.msgpack.Ext(WRAPPER_EXT_CODE, obj.data)
    raise TypeError(f"cannot encode {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
encode_value = _ENCODER.encode


def encode_request(op: Operation, payloads: Sequence[Any] | dict[str, Any]) -> list[bytes]:
    """Frames ``[type, *payloads]`` for ``op``; raises InvalidArgument before sending.

    ``payloads``: a dict of the values by payload name (``op.payloads`` gives the wire
    order, and the value a payload left out defaults to, if it has one), or the values
    in wire order (a trailing payload with a default may be left out)."""
    if isinstance(payloads, dict):
        return _encode_named(op, payloads)
    specs = op.payloads
    given = len(payloads)
    if given < len(specs) and all(s.default is not NO_DEFAULT for s in specs[given:]):
        payloads = (*payloads, *(s.default for s in specs[given:]))
    if len(payloads) != len(specs):
        names = ", ".join(p.name for p in specs) or "no payload"
        raise InvalidArgument(
            f"{op.name} takes {len(specs)} payload(s) ({names}), got {len(payloads)}"
        )
    frames = [op.type_frame]
    for spec, value in zip(specs, payloads, strict=True):
        try:
            checked = spec.validate(value)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{op.name}: invalid {spec.name}: {exc}") from None
        frames.append(_ENCODER.encode(checked))
    return frames


def _encode_named(op: Operation, named: dict[str, Any]) -> list[bytes]:
    # One pass over the op's payload specs: the names give the order, no tuple is built.
    frames = [op.type_frame]
    found = 0
    for spec in op.payloads:
        value = named.get(spec.name, _ABSENT)
        if value is _ABSENT:
            value = spec.default
            if value is NO_DEFAULT:
                raise InvalidArgument(f"{op.name}: no {spec.name} given ({_takes(op)})")
        else:
            found += 1
        try:
            checked = spec.validate(value)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{op.name}: invalid {spec.name}: {exc}") from None
        frames.append(_ENCODER.encode(checked))
    if found != len(named):
        unknown = sorted(set(named) - {spec.name for spec in op.payloads})
        raise InvalidArgument(f"{op.name} has no payload {', '.join(unknown)} ({_takes(op)})")
    return frames


def _takes(op: Operation) -> str:
    return f"it takes {', '.join(p.name for p in op.payloads) or 'no payload'}"


_ABSENT: Any = object()


def decode_reply(op: Operation, frames: Sequence[bytes]) -> Any:
    """The typed value of a reply ``[type, (value)]`` to ``op``; 2-frame replies are None."""
    if not frames or frames[0] != op.type_frame:
        seen = frames[0].hex() if frames else "nothing"
        raise ProtocolMismatch(
            f"reply to {op.name} echoed request type {seen}, expected "
            f"{op.type_frame.hex()}: the server speaks another protocol; check its version"
        )
    if len(frames) == 1:
        if op.reply is None or op.reply_optional:
            return None
        raise ProtocolMismatch(
            f"{op.name} was acknowledged without a value, but a {op.reply!r} was expected: "
            f"the server speaks another protocol than profile for this client; check its version"
        )
    if len(frames) > 2 or op.reply_decoder is None:
        raise ProtocolMismatch(
            f"{op.name}: unexpected reply with {len(frames) + 1} frames; "
            f"the server speaks another protocol; check its version"
        )
    try:
        return op.reply_decoder.decode(frames[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolMismatch(
            f"{op.name}: cannot read the server's reply {frames[1][:64].hex()} as "
            f"{op.reply!r} ({exc}); the server speaks another protocol; check its version"
        ) from None
