"""The transport's DEALER socket: its options, what close() releases, and its monitor.

:func:`open_dealer` makes the private context, the DEALER (``LINGER=0``,
``IMMEDIATE``, fast reconnects, ``MAXMSGSIZE``), its socket monitor and the pipe that
wakes the thread driving the socket; :class:`SocketResources` releases them exactly
once. :func:`on_monitor_event` applies a connection event to the transport: a new
connection bumps its epoch, a lost one holds every send behind a barrier and fails
the requests sent on it at once.

``MAXMSGSIZE``: a reply frame over :data:`MAX_REPLY_BYTES` is never buffered; ZMQ
drops the connection instead, the calls in flight fail at once saying so, and the
transport connects again (ZMQ itself would not after such a protocol error).
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING

import zmq

from .errors import InvalidArgument, LMCacheMPError
from .transport_gate import lift_locked
from .transport_pending import connection_lost

if TYPE_CHECKING:
    from .transport import Transport

__all__ = ["MAX_REPLY_BYTES", "SocketResources", "open_dealer", "on_monitor_event"]

#: The largest reply frame accepted (``zmq.MAXMSGSIZE``). The largest reply an LMCache
#: server sends this client is a PREPARE_* context, about 100 bytes per chunk slot, so
#: 64 MiB is some 600,000 chunks (150 M tokens at 256-token chunks), far past any
#: prompt; every other reply is a few bytes to a few kB. (Pickle-mode PREPARE_RETRIEVE
#: carries tensors, but this client never uses that mode: it never unpickles.) Bounded,
#: so a broken or foreign peer cannot make the client buffer gigabytes per frame.
MAX_REPLY_BYTES = 64 << 20

# A monitor event's first frame: 16-bit event id, 32-bit value, native order, packed.
_MONITOR_HEADER = struct.Struct("=hi")
_MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
)


class SocketResources:
    """What must be released exactly once, by close() or by the finaliser at exit."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes],
                 monitor: zmq.Socket[bytes], wake_r: int, wake_w: int) -> None:
        self.ctx, self.sock, self.monitor = ctx, sock, monitor
        self.wake_r, self.wake_w = wake_r, wake_w

    def release(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()
        os.close(self.wake_r)
        os.close(self.wake_w)


def open_dealer(url: str) -> SocketResources:
    """A DEALER connecting to ``url`` (in a private context), its monitor and a wake pipe.

    Raises InvalidArgument for a URL ZMQ cannot connect to, LMCacheMPError when the
    sockets cannot be made (out of file descriptors); nothing is left open then."""
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None
    sock: zmq.Socket[bytes] | None = None
    monitor: zmq.Socket[bytes] | None = None
    connecting = False
    try:
        ctx = zmq.Context(io_threads=1)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # Retry a lost connection every 50 ms, backing off to at most 200 ms: a
        # restarted server is reached within 0.2 s of listening (a refused connect
        # to a co-located server costs next to nothing).
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        if "://[" in url:  # an IPv6 literal (only then: names keep resolving to IPv4)
            sock.setsockopt(zmq.IPV6, 1)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        connecting = True
        sock.connect(url)
        connecting = False
        wake_r, wake_w = os.pipe()
    except (zmq.ZMQError, OSError) as exc:
        for s in (monitor, sock):
            if s is not None:
                s.close(linger=0)
        if ctx is not None:
            ctx.term()
        if connecting:
            raise InvalidArgument(
                f"cannot connect to {url!r}: {exc}; expected e.g. tcp://127.0.0.1:5555"
            ) from None
        raise LMCacheMPError(
            f"cannot set up the client's ZMQ socket for {url}: {exc} (out of file "
            f"descriptors? close unused clients)") from None
    return SocketResources(ctx, sock, monitor, wake_r, wake_w)


def on_monitor_event(t: Transport, msg: list[bytes]) -> None:
    """Apply one monitor event to ``t``; called under ``t``'s lock."""
    # zmq.utils.monitor.parse_monitor_message would import zmq.asyncio (and asyncio)
    # at import time: the first frame is a 16-bit event id and a 32-bit value.
    event = _MONITOR_HEADER.unpack_from(msg[0])[0]
    if event == zmq.EVENT_CONNECTED:
        t.connected = True
        t._ever_connected = True
        t.epoch += 1
        if t._outbox and t._outbox[0] is t._barrier:
            t._outbox.popleft()  # the lost connection's pipe is gone by now
        # Possibly a restarted server: whatever the last one did not answer says
        # nothing about this one.
        if t._gated:
            lift_locked(t)
    elif event == zmq.EVENT_CONNECT_RETRIED:
        t._refused += 1
    elif event == zmq.EVENT_DISCONNECTED:
        t.connected = False
        # ZMQ detaches the lost connection's pipe a moment after this event: until
        # then a send would vanish into it. Hold every send until a new connection.
        if not (t._outbox and t._outbox[0] is t._barrier):
            t._outbox.appendleft(t._barrier)
        if t._gated:  # the verdict was about that connection; calls now wait
            lift_locked(t)  # for a new one within their deadlines
        # Replies to requests sent on the lost connection can never arrive: the
        # server's ROUTER sees a new peer after a reconnect.
        lost = [p for p in t._pending.values() if p.sent]
        for p in lost:
            del t._pending[p.uid]
            p.fail(connection_lost(p, t.url, MAX_REPLY_BYTES))
        # After a protocol error (an oversized frame) ZMQ ends the connection for
        # good instead of reconnecting; starting it afresh covers that and is the
        # same as ZMQ's own reconnect otherwise.
        try:
            t._sock.disconnect(t.url)
        except zmq.ZMQError:
            pass
        t._sock.connect(t.url)
