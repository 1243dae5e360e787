"""The error hierarchy of lmcache_mp.

Every error the client raises derives from :class:`LMCacheMPError`, and each message
says what went wrong and what to do about it. The LMCache MP server never replies to a
request it could not handle, so a :class:`RequestTimeout` usually means the server
rejected the request (its log says why), not that it was slow. When the server answers
nothing at all (not even a NOOP sent after the request), the call raises
:class:`ServerUnresponsive` instead, and later calls fail at once until it answers.
"""

from __future__ import annotations

__all__ = [
    "LMCacheMPError",
    "RequestTimeout",
    "ServerUnavailable",
    "ServerUnresponsive",
    "ClientClosed",
    "ConnectionChanged",
    "ProtocolMismatch",
    "InvalidArgument",
]


class LMCacheMPError(Exception):
    """Base class of every error raised by lmcache_mp."""


class RequestTimeout(LMCacheMPError, TimeoutError):
    """A request was sent but no reply arrived before its deadline (the server still
    answers other requests, or could not be asked)."""


class ServerUnavailable(LMCacheMPError, ConnectionError):
    """The server could not be reached, or the connection was lost mid-request."""


class ServerUnresponsive(ServerUnavailable):
    """The server accepts the connection but answers nothing: a request went unanswered
    and so did a NOOP sent after it (NOOP is answered on the server's message thread).
    Its message thread has most likely died (a malformed message from any client kills
    it for good), or the process is stopped. Calls then fail at once with this error
    until the server answers again (probed at most about once a second, and again on
    every reconnect, so a restarted server is used as soon as it is up)."""


class ConnectionChanged(ServerUnavailable):
    """A request bound to one connection was not sent because the socket reconnected
    (the server may have restarted). Registrations catch it, re-register and send
    again within the call's deadline; a caller sees it only if that is impossible."""


class ClientClosed(ServerUnavailable):
    """The client was closed; requests still pending were failed with this error."""


class ProtocolMismatch(LMCacheMPError):
    """The server speaks a protocol this client (or the chosen profile) does not."""


class InvalidArgument(LMCacheMPError, ValueError):
    """An argument was rejected locally, before anything was sent.

    The server drops requests it cannot decode without replying (and a malformed
    request-type frame kills its message thread), so the client validates first.
    """
