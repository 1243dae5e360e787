"""The public cache key, validated the way the LMCache server would (and stricter).

A :class:`CacheKey` names a token sequence and a token range of it for one model and
world size. The server hashes ``token_ids`` itself (see :mod:`lmcache_mp.protocol.hashing`);
``request_id`` is the session key and is excluded from equality, as in LMCache.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from .errors import InvalidArgument
from .protocol.types import U32

__all__ = ["CacheKey", "SALT_MAX_LEN", "SALT_FORBIDDEN_CHARS", "unpack_token_bytes"]

SALT_MAX_LEN = 128
# LMCache's L2 adapters use '@' as a separator, '/' and '\\' reach file names, NUL ends C strings.
SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")
# kv_rank packs world size and rank into 8 bits each (ObjectKey.ComputeKVRank).
MAX_WORLD_SIZE = 255
_TOKENS = tuple[U32, ...]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SWAP = sys.byteorder == "little"
_NATIVE_U32 = array.array("I").itemsize == 4


class _Tokens:
    """A key's token ids, in one or both forms; shared by the keys cut from it
    (``with_range``, ``replace``), so a form derived for one range (the tuple older
    servers' keys carry, or 0.5.7's packed bytes) is derived once for all of them."""

    __slots__ = ("packed", "ids", "count")

    def __init__(self, packed: bytes | None, ids: tuple[int, ...] | None) -> None:
        self.packed = packed
        self.ids = ids
        self.count = len(ids) if packed is None else len(packed) // 4  # type: ignore[arg-type]


def _big_endian(words: array.array[int]) -> bytes:
    if _SWAP:
        words.byteswap()
    return words.tobytes()


def _pack_checked_ints(seq: Sequence[int]) -> bytes:
    """Big-endian uint32 words of Python ints already known to be in range."""
    if not _NATIVE_U32:  # pragma: no cover - no such platform in CI
        return struct.pack(f">{len(seq)}I", *seq)
    return _big_endian(array.array("I", seq))


def _read_tokens(token_ids: Any) -> tuple[bytes | None, tuple[int, ...] | None]:
    """``token_ids`` checked as strictly as the server would decode them (and stricter),
    in the form that costs least to get: ``(packed, None)`` for numpy arrays and
    ``array('I')`` (converted in bulk, without a Python int per token: the form
    LMCache 0.5.7's ``token_bytes`` sends), ``(None, ids)`` for lists and tuples (their
    Python ints exist already: the form 0.5.3-0.5.6 keys send). A key derives the other
    form only if a profile asks for it, once."""
    kind = getattr(getattr(token_ids, "dtype", None), "kind", None)
    if isinstance(kind, str) and hasattr(token_ids, "tolist"):  # numpy-like
        if getattr(token_ids, "ndim", 1) != 1:
            raise InvalidArgument("token_ids must be one-dimensional")
        if token_ids.dtype.kind not in "iu":
            raise InvalidArgument(f"token_ids must hold integers, got dtype {token_ids.dtype}")
        if len(token_ids) and (int(token_ids.min()) < 0 or int(token_ids.max()) > 2**32 - 1):
            raise InvalidArgument("token ids must fit in uint32 (0 <= id < 2**32)")
        return token_ids.astype(">u4").tobytes(), None
    if isinstance(token_ids, array.array):
        if token_ids.typecode not in "bBhHiIlLqQ":
            raise InvalidArgument(f"token_ids: array typecode {token_ids.typecode!r} does not "
                                  f"hold integers (token ids are uint32)")
        if token_ids.typecode == "I" and _NATIVE_U32:
            return _big_endian(array.array("I", token_ids)), None  # a copy: the caller's kept
        try:
            return _pack_checked_ints(array.array("I", token_ids)), None
        except OverflowError:
            raise InvalidArgument("token ids must fit in uint32 (0 <= id < 2**32)") from None
    if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):
        try:  # e.g. a torch tensor: checked as the list it converts to
            token_ids = token_ids.tolist()
        except Exception as exc:  # noqa: BLE001 - any failure means "not token ids"
            raise InvalidArgument(f"token_ids: cannot read {type(token_ids).__name__}: "
                                  f"{exc}") from None
    if not isinstance(token_ids, (list, tuple)):
        raise InvalidArgument(
            f"token_ids must be a list, tuple, array('I') or 1-D integer numpy array, "
            f"got {type(token_ids).__name__}"
        )
    try:
        return None, msgspec.convert(token_ids, _TOKENS, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(
            f"token ids must be ints that fit in uint32 (0 <= id < 2**32): {exc}"
        ) from None


def unpack_token_bytes(packed: bytes) -> tuple[int, ...]:
    """Token ids from their packed form (big-endian uint32, :attr:`CacheKey.token_bytes`)."""
    words = array.array("I")
    words.frombytes(packed)
    if _SWAP:
        words.byteswap()
    return tuple(words)


class CacheKey:
    """A token range of a prompt, for one model and KV world size.

    Args:
        model_name: the model; part of the cache identity; must not contain ``@``.
        world_size: KV world size (number of KV shards per chunk), 1..255.
        worker_id: this worker's KV rank for STORE / RETRIEVE, or None. LOOKUP and
            FREE_LOOKUP_LOCKS always send None (all ranks) whatever is set here.
        token_ids: the whole token sequence from token 0 (list, tuple or 1-D integer
            numpy array), each id in ``[0, 2**32)``.
        start, end: the token range ``[start, end)`` an operation covers;
            STORE / RETRIEVE need chunk-aligned values (checked when sent).
        request_id: session key on the server; not part of the cache identity.
        cache_salt: per-user isolation salt (<= 128 chars, none of ``@ / \\`` NUL).
    """

    # The constructor's fields (replace() takes these).
    FIELDS = ("model_name", "world_size", "worker_id", "token_ids", "start", "end",
              "request_id", "cache_salt")
    # Token ids are held in the form they came in (packed from numpy / array('I'), a
    # tuple from a list); the other form (0.5.7's token_bytes, or the tuple older
    # servers' keys carry) is derived on first use, once.
    __slots__ = ("model_name", "world_size", "worker_id", "_tokens", "start", "end",
                 "request_id", "cache_salt")

    model_name: str
    world_size: int
    worker_id: int | None
    _tokens: _Tokens
    start: int
    end: int
    request_id: str
    cache_salt: str

    def __init__(
        self,
        *,
        model_name: str,
        world_size: int,
        worker_id: int | None,
        token_ids: Sequence[int] | Any,
        start: int,
        end: int,
        request_id: str,
        cache_salt: str = "",
    ) -> None:
        if not isinstance(model_name, str) or not model_name:
            raise InvalidArgument("model_name must be a non-empty str")
        if "@" in model_name:
            raise InvalidArgument(f"model_name must not contain '@' (got {model_name!r})")
        if not _is_int(world_size) or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"world_size must be an int in 1..{MAX_WORLD_SIZE}")
        if worker_id is not None and (not _is_int(worker_id) or not 0 <= worker_id < world_size):
            raise InvalidArgument(
                f"worker_id must be None or an int in [0, world_size={world_size}), "
                f"got {worker_id!r}"
            )
        if isinstance(token_ids, _Tokens):  # a copy's: checked already
            tokens = token_ids
        else:
            tokens = _Tokens(*_read_tokens(token_ids))
        count = tokens.count
        if not _is_int(start) or not _is_int(end):
            raise InvalidArgument("start and end must be ints")
        if not 0 <= start <= end <= count:
            raise InvalidArgument(
                f"need 0 <= start <= end <= len(token_ids); got start={start}, end={end}, "
                f"len(token_ids)={count} (the server would hash a partial chunk "
                f"that no lookup can ever hit)"
            )
        if not isinstance(request_id, str):
            raise InvalidArgument("request_id must be a str")
        if not isinstance(cache_salt, str):
            raise InvalidArgument("cache_salt must be a str")
        bad = SALT_FORBIDDEN_CHARS.intersection(cache_salt)
        if bad:
            raise InvalidArgument(
                f"cache_salt must not contain {''.join(sorted(bad))!r} "
                f"(LMCache forbids '@', '/', '\\\\' and NUL)"
            )
        if len(cache_salt) > SALT_MAX_LEN:
            raise InvalidArgument(
                f"cache_salt is {len(cache_salt)} chars; LMCache allows at most {SALT_MAX_LEN}"
            )
        setter = object.__setattr__
        setter(self, "model_name", model_name)
        setter(self, "world_size", world_size)
        setter(self, "worker_id", worker_id)
        setter(self, "_tokens", tokens)
        setter(self, "start", start)
        setter(self, "end", end)
        setter(self, "request_id", request_id)
        setter(self, "cache_salt", cache_salt)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("CacheKey is immutable; use replace()")

    def replace(self, **changes: Any) -> CacheKey:
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - set(self.FIELDS)
        if unknown:
            raise InvalidArgument(f"CacheKey has no field {', '.join(sorted(unknown))}; "
                                  f"fields: {', '.join(self.FIELDS)}")
        fields = {name: getattr(self, name) for name in self.FIELDS if name != "token_ids"}
        # Checked already: not validated again (tokens of long prompts).
        fields["token_ids"] = self._tokens
        fields.update(changes)
        return CacheKey(**fields)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The token ids as a tuple of ints (unpacked on first use, then kept)."""
        tokens = self._tokens
        if tokens.ids is None:
            tokens.ids = unpack_token_bytes(tokens.packed)  # type: ignore[arg-type]
        return tokens.ids

    @property
    def token_bytes(self) -> bytes:
        """The token ids packed as big-endian uint32, LMCache 0.5.7's ``token_bytes``
        and the bytes its hasher reads (packed on first use, then kept)."""
        tokens = self._tokens
        if tokens.packed is None:
            tokens.packed = _pack_checked_ints(tokens.ids)  # type: ignore[arg-type]
        return tokens.packed

    @property
    def num_token_ids(self) -> int:
        """How many token ids the key holds (the whole sequence, not the range)."""
        return self._tokens.count

    def with_range(self, start: int, end: int) -> CacheKey:
        """A copy for tokens ``[start, end)``; only the range is checked again (the
        tokens were checked once, which matters for long prompts)."""
        if not _is_int(start) or not _is_int(end) or not 0 <= start <= end <= self.num_token_ids:
            raise InvalidArgument(
                f"need ints 0 <= start <= end <= {self.num_token_ids} (the number of tokens), "
                f"got start={start!r}, end={end!r}")
        key = object.__new__(CacheKey)
        for name in self.__slots__:
            object.__setattr__(key, name, getattr(self, name))
        object.__setattr__(key, "start", start)
        object.__setattr__(key, "end", end)
        return key

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def _identity(self) -> tuple[Any, ...]:
        # request_id is a session handle, not part of what is cached (as in LMCache).
        return (
            self.model_name,
            self.world_size,
            self.worker_id,
            self.token_bytes,
            self.start,
            self.end,
            self.cache_salt,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        n = self.num_token_ids
        head = ", ".join(map(str, unpack_token_bytes(self.token_bytes[:16]))) + (", ..." if n > 4 else "")
        return (
            f"CacheKey(model_name={self.model_name!r}, world_size={self.world_size}, "
            f"worker_id={self.worker_id}, token_ids=[{head}] ({n}), start={self.start}, "
            f"end={self.end}, request_id={self.request_id!r}, cache_salt={self.cache_salt!r})"
        )
