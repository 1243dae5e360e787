"""ReplyFuture: the non-blocking form of every client call, for pipelining.

A ReplyFuture is not an asyncio or concurrent.futures future: there is no I/O
thread, so ``result()`` drives the socket in the calling thread until the reply (or
the request's deadline) arrives. Submit many, then collect them in any order.

A future is the reply to one request. A layer above that may send its request again
(the session's transfers, sent again after a reconnect) subclasses it and overrides
:meth:`ReplyFuture._reply`; the transport itself never redoes a request.

:func:`blocking` makes the blocking twin ``x()`` of a method ``x_async()``, so that
each call is written once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, Generic, ParamSpec, TypeVar

from ..errors import LMCacheMPError
from .core import Transport
from .pending import PendingRequest

__all__ = ["ReplyFuture", "blocking"]

T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S")

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

    @classmethod
    def failed(cls, error: LMCacheMPError) -> ReplyFuture[T]:
        """A future that raises ``error`` from ``result()``."""
        future: ReplyFuture[T] = cls(None, None, None)
        future._error = error
        return future

    def done(self) -> bool:
        """Whether the reply (or an error) is in, without blocking."""
        if self._value is not _UNSET or self._error is not None:
            return True
        assert self._transport is not None and self._request is not None
        return self._transport.poll(self._request)

    def wait(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for the reply (never past the request's deadline)
        without raising; returns :meth:`done`."""
        if self._value is _UNSET and self._error is None and seconds > 0:
            assert self._transport is not None and self._request is not None
            self._transport.wait_for(self._request, seconds)
        return self.done()

    def result(self) -> T:
        """The decoded reply; raises the request's error (timeout, unavailable, ...)."""
        if self._value is _UNSET and self._error is None:
            decode = self._decode
            assert decode is not None
            try:
                self._value = decode(self._reply())
            except LMCacheMPError as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def _reply(self) -> list[bytes]:
        """The reply's frames, waiting for them in this thread. A subclass that sends
        its request again when it could not go out overrides this, and calls
        :meth:`_awaiting` with the new request before waiting again."""
        transport, request = self._transport, self._request
        assert transport is not None and request is not None
        return transport.wait(request)

    def _awaiting(self, request: PendingRequest) -> None:
        """From now on this future is the reply to ``request`` (its request sent again)."""
        self._request = request

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


def blocking(
    method: Callable[Concatenate[S, P], ReplyFuture[T]],
) -> Callable[Concatenate[S, P], T]:
    """The blocking twin of an ``x_async`` method: same arguments, returns the result.

    The twin's docstring is the async method's, which documents the call once."""

    @functools.wraps(method)
    def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return method(self, *args, **kwargs).result()

    call.__name__ = method.__name__.removesuffix("_async")
    call.__qualname__ = method.__qualname__.removesuffix("_async")
    return call
