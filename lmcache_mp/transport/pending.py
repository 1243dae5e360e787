"""One request in flight on the transport, and the errors that end one unanswered.

:class:`PendingRequest` is what :meth:`lmcache_mp.transport.core.Transport.submit` returns:
completed once, with the reply frames (after the uid) or an error, by whichever
thread drives the socket; a follower thread sleeping on it is woken through its
event. The functions below build the transport's own errors (those that do not come
from :mod:`lmcache_mp.transport.probe`'s verdicts): each says what happened and what to do.
"""

from __future__ import annotations

import threading
import time

from ..errors import ConnectionChanged, LMCacheMPError, ServerUnavailable

__all__ = ["PendingRequest", "connection_changed", "connection_lost", "unreachable_reason"]


class PendingRequest:
    """One request in flight. Completed with the reply frames (after the uid) or an error."""

    __slots__ = ("uid", "label", "deadline", "timeout", "frames", "error", "done", "sent", "event",
                 "out", "epoch", "sent_epoch")

    def __init__(self, uid: bytes, label: str, timeout: float, out: list[bytes],
                 epoch: int | None = None) -> None:
        self.uid = uid
        self.label = label
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.frames: list[bytes] | None = None
        self.error: LMCacheMPError | None = None
        self.done = False
        self.sent = False
        # Created only when a follower thread sleeps on this request: a lone blocking
        # call never needs one. Order matters: completion sets ``done`` before reading
        # ``event``, a follower sets ``event`` before re-checking ``done``.
        self.event: threading.Event | None = None
        self.out: list[bytes] | None = out
        # Only send on this connection (see Transport.submit); the one it went out on.
        self.epoch = epoch
        self.sent_epoch = 0

    def complete(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.done = True
        event = self.event
        if event is not None:
            event.set()

    def fail(self, error: LMCacheMPError) -> None:
        if not self.done:
            self.error = error
            self.done = True
            event = self.event
            if event is not None:
                event.set()


def connection_changed(p: PendingRequest, url: str, epoch: int) -> ConnectionChanged:
    """``p`` was bound to connection ``p.epoch`` but the socket is now on ``epoch``."""
    return ConnectionChanged(
        f"{p.label} was not sent: the connection to {url} was re-established "
        f"(connection {epoch}, the request was for connection {p.epoch}), so the "
        f"server may have restarted and forgotten registrations"
    )


def connection_lost(p: PendingRequest, url: str, max_reply_bytes: int) -> ServerUnavailable:
    """``p`` was sent on a connection that has been lost: its reply can never arrive."""
    return ServerUnavailable(
        f"lost the connection to the LMCache server at {url} while waiting "
        f"for the reply to {p.label}: the server exited or restarted, or a reply "
        f"frame exceeded this client's {max_reply_bytes >> 20} MiB limit "
        f"(zmq.MAXMSGSIZE; no LMCache server sends one: a bug, or not an LMCache "
        f"server). The request may or may not have been executed. Check the "
        f"server, then retry (the client connects again by itself)."
    )


def unreachable_reason(url: str, label: str, timeout: float, ever_connected: bool,
                       refused: int) -> str:
    """Why ``label`` could not be sent to ``url`` within ``timeout`` s, and what to do."""
    if ever_connected:
        what = "the connection was lost and has not come back"
    elif refused:
        what = "nothing accepted the connection (refused)"
    else:
        what = "no connection could be made"
    return (
        f"could not send {label} to an LMCache server at {url} within "
        f"{timeout:g} s: {what}. Start the server (python -m "
        f"lmcache.v1.multiprocess.server --host ... --port ...) or check the URL."
    )
