"""ReplyFuture: the non-blocking form of every client call, for pipelining.

A ReplyFuture is not an asyncio or concurrent.futures future: there is no I/O
thread, so ``result()`` drives the socket in the calling thread until the reply (or
the request's deadline) arrives. Submit many, then collect them in any order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from .errors import LMCacheMPError
from .transport import PendingRequest, Transport

__all__ = ["ReplyFuture"]

T = TypeVar("T")

_UNSET: object = object()


class ReplyFuture(Generic[T]):
    """The eventual value of one request (or a value the client already knows)."""

    __slots__ = ("_transport", "_request", "_decode", "_value", "_error")

    def __init__(
        self,
        transport: Transport | None,
        request: PendingRequest | None,
        decode: Callable[[list[bytes]], T] | None,
        value: object = _UNSET,
    ) -> None:
        self._transport = transport
        self._request = request
        self._decode = decode
        self._value: object = value
        self._error: LMCacheMPError | None = None

    @classmethod
    def completed(cls, value: T) -> ReplyFuture[T]:
        """A future that already holds ``value`` (nothing is sent)."""
        return cls(None, None, None, value)

    def done(self) -> bool:
        """Whether the reply (or an error) is in, without blocking."""
        if self._value is not _UNSET or self._error is not None:
            return True
        assert self._transport is not None and self._request is not None
        return self._transport.poll(self._request)

    def result(self) -> T:
        """The decoded reply; raises the request's error (timeout, unavailable, ...)."""
        if self._value is _UNSET and self._error is None:
            assert self._transport is not None and self._request is not None
            assert self._decode is not None
            try:
                self._value = self._decode(self._transport.wait(self._request))
            except LMCacheMPError as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def exception(self) -> LMCacheMPError | None:
        """The error the request ended with, or None; blocks like ``result()``."""
        try:
            self.result()
        except LMCacheMPError as exc:
            return exc
        return None

    def __repr__(self) -> str:
        label = self._request.label if self._request is not None else "value"
        state = "done" if (self._value is not _UNSET or self._error is not None) else "pending"
        return f"<ReplyFuture {label} {state}>"
