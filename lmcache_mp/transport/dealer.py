"""The transport's DEALER socket: its options, what close() releases, and its monitor.

:func:`open_dealer` makes the private context, the DEALER (``LINGER=0``,
``IMMEDIATE``, fast reconnects, ``MAXMSGSIZE``), its socket monitor and the pipe that
wakes the thread driving the socket; :class:`SocketResources` releases them exactly
once. :func:`monitor_event` reads a monitor message's event id; what a connection
event does to the transport is the transport's own business
(``Transport._on_monitor_event_locked``).

``MAXMSGSIZE``: a reply frame over :data:`MAX_REPLY_BYTES` is never buffered; ZMQ
drops the connection instead, the calls in flight fail at once saying so, and the
transport connects again (ZMQ itself would not after such a protocol error).
"""

from __future__ import annotations

import os
import struct

import zmq

from ..errors import InvalidArgument, LMCacheMPError

__all__ = ["MAX_REPLY_BYTES", "SocketResources", "open_dealer", "monitor_event"]

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


def monitor_event(msg: list[bytes]) -> int:
    """The event id (``zmq.EVENT_*``) of one message from the socket's monitor."""
    # zmq.utils.monitor.parse_monitor_message would import zmq.asyncio (and asyncio)
    # at import time: the first frame is a 16-bit event id and a 32-bit value.
    return int(_MONITOR_HEADER.unpack_from(msg[0])[0])
