"""The ZMQ transport: one DEALER socket, replies matched by uid, a deadline on everything.

It knows nothing of operations: it sends ``[uid, *frames]`` and hands back the reply
frames after the uid. Design, for latency and for never hanging:

* No I/O thread. The thread that waits for a reply drives the socket itself (the
  "leader"); other waiting threads sleep on their own event and are woken when their
  reply is dispatched or when leadership is handed to them. A lone blocking call is
  therefore a send, a ``select`` on the socket's fd and a receive in the caller's own
  thread, as with a bare DEALER.
* Every socket touch happens under one lock. ZMQ's fd is edge-triggered, so whoever
  touches the socket drains what is readable before letting go.
* ``ZMQ_IMMEDIATE``: nothing is queued toward a server that is not connected, so a
  request to an absent server fails as *unavailable* at its deadline instead of being
  delivered, stale, when a server appears. A socket monitor tells connection loss, so
  requests in flight fail at once when the server dies.
* ``LINGER=0`` and a private context: ``close()`` returns at once and leaves no thread.
* A request still unanswered near its deadline gets a NOOP probe sent after it, to tell
  a rejected request from a server that answers nothing (:mod:`lmcache_mp.probing`).
* ``MAXMSGSIZE``: a reply frame over :data:`MAX_REPLY_BYTES` is never buffered; ZMQ
  drops the connection instead, the calls in flight fail at once saying so, and the
  transport connects again (ZMQ itself would not after such a protocol error).

The hot path (submit, send, wait, complete) is all here; the cold parts are beside it:
:mod:`.transport_pending` (a request in flight, the errors that end it),
:mod:`.transport_socket` (the socket, its release, its monitor's connection events),
:mod:`.transport_gate` (the unresponsive gate and its probes).
"""

from __future__ import annotations

import itertools
import os
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from .errors import ClientClosed, LMCacheMPError, RequestTimeout, ServerUnavailable
from .probing import PROBE_LEAD_S, ProbeState
from .transport_gate import check_gate_locked, declare_unresponsive, probe_for
from .transport_pending import PendingRequest, connection_changed, unreachable_reason
from .transport_socket import MAX_REPLY_BYTES, on_monitor_event, open_dealer

__all__ = ["Transport", "PendingRequest", "MAX_REPLY_BYTES"]

# A follower re-checks for a free leader slot at least this often, as a safety net
# under the explicit leadership hand-off.
_FOLLOWER_SLICE_S = 0.05
# Plain ints: pyzmq's IntFlag constants cost an enum operation on every use.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_OUTBOX_RETRY_MS = 2


class Transport:
    """A DEALER connected to ``url``; thread-safe; see the module docstring."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._res = res = open_dealer(url)
        self._finalizer = weakref.finalize(self, res.release)
        self._sock = sock = res.sock
        self._monitor = monitor = res.monitor
        self._poller = select.poll()
        self._monitor_fd = int(monitor.getsockopt(zmq.FD))
        for fd in (int(sock.getsockopt(zmq.FD)), self._monitor_fd, res.wake_r):
            self._poller.register(fd, select.POLLIN)

        self._lock = threading.Lock()  # guards the sockets and the tables below
        self._leader = threading.Lock()  # held by the thread driving the socket
        self._pending: dict[bytes, PendingRequest] = {}
        self._outbox: deque[PendingRequest] = deque()
        # Put at the head of the outbox when the connection is lost (never sent).
        self._barrier = PendingRequest(b"", "connection barrier", 0.0, [])
        self._followers: set[PendingRequest] = set()
        self._followers_lock = threading.Lock()
        self._uids = itertools.count()
        self._closed = False
        # True once closed or while the server is judged unresponsive: the one flag
        # submit() tests, so the gate costs nothing while the server answers.
        self._gated = False
        self.liveness = ProbeState(url)
        self.connected = False
        # Counts the connections made: a new one may lead to a new server process
        # (a restart), which knows nothing of what the old one was told.
        self.epoch = 0
        self._ever_connected = False
        self._refused = 0

    # ------------------------------------------------------------------ sending
    def submit(self, frames: Sequence[bytes], timeout: float, label: str,
               epoch: int | None = None) -> PendingRequest:
        """Send ``[uid, *frames]``; the reply (or error) completes the returned request.

        With ``epoch``, the request may only go out on that connection (see
        :attr:`epoch`): if the socket has reconnected since, it is failed unsent with
        :class:`ConnectionChanged`, so a caller can first redo what a restarted server
        forgot (a registration) and then submit again.
        """
        uid = msgspec.msgpack.encode(next(self._uids))
        out = [uid, *frames]
        p = PendingRequest(uid, label, timeout, out, epoch)
        with self._lock:
            if self._gated:
                check_gate_locked(self, label)  # raises unless the server answers again
            if epoch is not None:
                if self._drain_monitor_locked() and self._leader.locked():
                    self._wake_leader()  # its requests may have been failed
                if epoch != self.epoch:
                    p.fail(connection_changed(p, self.url, self.epoch))
                    return p
            self._enqueue_locked(p)
            if self._leader.locked():
                # Another thread is blocked on the socket's edge-triggered fd; our send
                # may have consumed its wake-up, so drain what is readable and wake it.
                if self._drain_inbound_locked():
                    self._wake_leader()
        return p

    def declare_unresponsive(self, frames: list[bytes]) -> None:
        """Gate the transport: the protocol detection got no answer at all (see
        :func:`lmcache_mp.transport_gate.declare_unresponsive`)."""
        declare_unresponsive(self, frames)

    def _enqueue_locked(self, p: PendingRequest) -> None:
        """Register ``p`` and send it now, or queue it behind requests still waiting for
        a connection (order is kept): a request that cannot be sent now (not connected,
        IMMEDIATE) waits in the outbox until the server is reachable or its deadline
        passes."""
        self._pending[p.uid] = p
        assert p.out is not None
        if self._outbox or not self._send_locked(p.out):
            self._outbox.append(p)
        else:
            self._mark_sent_locked(p)

    def _mark_sent_locked(self, p: PendingRequest) -> None:
        p.out = None
        p.sent = True
        p.sent_epoch = self.epoch

    def _send_locked(self, frames: list[bytes]) -> bool:
        send = self._sock.send
        try:
            send(frames[0], _SNDMORE_NOBLOCK)
        except zmq.Again:
            return False
        # Once the first part is accepted, ZMQ takes the whole message atomically.
        last = len(frames) - 1
        for i in range(1, last):
            send(frames[i], _SNDMORE_NOBLOCK)
        send(frames[last], _NOBLOCK)
        return True

    # ----------------------------------------------------------------- receiving
    def _service_locked(self) -> int:
        """Process connection events, flush the outbox, dispatch every readable reply."""
        self._drain_monitor_locked()
        outbox = self._outbox
        while outbox:
            p = outbox[0]
            if p is self._barrier:  # nothing goes out until the new connection is up
                if not self.connected:
                    break
                outbox.popleft()
                continue
            if p.done:  # expired while waiting for a connection
                outbox.popleft()
                continue
            assert p.out is not None
            if p.epoch is not None and p.epoch != self.epoch:
                outbox.popleft()
                self._pending.pop(p.uid, None)
                p.fail(connection_changed(p, self.url, self.epoch))
                continue
            if not self._send_locked(p.out):
                break
            outbox.popleft()
            self._mark_sent_locked(p)
        return self._drain_inbound_locked()

    def _drain_monitor_locked(self) -> int:
        monitor = self._monitor
        n = 0
        while int(monitor.get(_EVENTS)) & _POLLIN:
            on_monitor_event(self, monitor.recv_multipart(_NOBLOCK))
            n += 1
        return n

    def refresh(self) -> int:
        """Take in connection events now (without blocking) and return :attr:`epoch`.

        Events are otherwise seen only while some thread waits on the socket."""
        with self._lock:
            if not self._closed and self._drain_monitor_locked() and self._leader.locked():
                self._wake_leader()  # the waiting thread's requests may have been failed
            return self.epoch

    def _drain_inbound_locked(self) -> int:
        n = 0
        sock = self._sock
        pending = self._pending
        while int(sock.get(_EVENTS)) & _POLLIN:
            msg = sock.recv_multipart(_NOBLOCK)
            req = pending.pop(msg[0], None)
            if req is not None:  # else: a late reply to a request that timed out
                req.complete(msg[1:])
                n += 1
        return n

    def _wake_leader(self) -> None:
        try:
            os.write(self._res.wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass

    # ------------------------------------------------------------------- waiting
    def wait(self, p: PendingRequest) -> list[bytes]:
        """Block until ``p`` completes or its deadline passes; return the reply frames."""
        if not p.done:
            self._await(p, p.deadline - min(p.timeout * 0.5, PROBE_LEAD_S))  # probe_point
            if not p.done:  # no reply yet, near the deadline: is anything answering?
                probe_for(self, p)
                self._await(p, p.deadline)
        if p.error is not None:
            raise p.error
        assert p.frames is not None
        return p.frames

    def wait_for(self, p: PendingRequest, seconds: float) -> bool:
        """Wait at most ``seconds`` (never past ``p``'s own deadline) for ``p`` to
        complete, without failing it; returns whether it is done."""
        if not p.done:
            self._await(p, min(p.deadline, time.monotonic() + seconds))
        return p.done

    def poll(self, p: PendingRequest) -> bool:
        """Whether ``p`` is complete, servicing the socket once without blocking."""
        if not p.done and self._leader.acquire(blocking=False):
            try:
                with self._lock:
                    if not self._closed:
                        self._service_locked()
            finally:
                self._leader.release()
                self._hand_off()
        if not p.done and time.monotonic() >= p.deadline:
            self._expire(p)
        return p.done

    def _await(self, p: PendingRequest, deadline: float) -> None:
        """Wait for ``p`` until ``deadline``; expire it if that is its own deadline."""
        leader = self._leader
        following = False
        try:
            while not p.done:
                if leader.acquire(blocking=False):
                    try:
                        self._lead(p, deadline)
                    finally:
                        leader.release()
                        self._hand_off()
                    if not p.done and time.monotonic() >= p.deadline:
                        self._expire(p)
                    return
                if not following:
                    # Register before sleeping, then retry the leader slot once, so a
                    # leader that leaves in between cannot miss us in its hand-off.
                    if p.event is None:
                        p.event = threading.Event()
                    with self._followers_lock:
                        self._followers.add(p)
                    following = True
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if time.monotonic() >= p.deadline:
                        self._expire(p)
                    return
                event = p.event
                assert event is not None
                event.wait(min(remaining, _FOLLOWER_SLICE_S))
                if not p.done:
                    event.clear()
        finally:
            if following:
                with self._followers_lock:
                    self._followers.discard(p)
                if not leader.locked():
                    self._hand_off()

    def _hand_off(self) -> None:
        with self._followers_lock:
            for q in self._followers:
                if not q.done and q.event is not None:
                    q.event.set()
                    return

    def _lead(self, p: PendingRequest, deadline: float) -> None:
        poller = self._poller
        wake_r = self._res.wake_r
        monitor_fd = self._monitor_fd
        check_monitor = True  # once on entry, then only when its fd fires
        while True:
            with self._lock:
                if self._closed:
                    return
                if check_monitor:
                    self._drain_monitor_locked()
                if self._outbox:
                    self._service_locked()
                else:
                    self._drain_inbound_locked()
            if p.done:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            wait_ms = max(1, int(remaining * 1000 + 0.999))
            if self._outbox and (self.connected or self._outbox[0] is not self._barrier):
                # ZMQ's fd does not reliably signal when a new connection's pipe becomes
                # writable, so retry queued sends on a short period until it does
                # (behind the barrier, the monitor's fd signals the connection).
                wait_ms = min(wait_ms, _OUTBOX_RETRY_MS)
            check_monitor = False
            for fd, _ in poller.poll(wait_ms):
                if fd == monitor_fd:
                    check_monitor = True
                elif fd == wake_r:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        pass

    def _expire(self, p: PendingRequest) -> None:
        with self._lock:
            if p.sent and not p.done and self._drain_inbound_locked():
                # Replies were waiting unread (this one's, or a probe's).
                if self._leader.locked():
                    self._wake_leader()
            if p.done:
                return
            self._pending.pop(p.uid, None)
            if p.sent:
                err: LMCacheMPError = self.liveness.verdict(p, time.monotonic())
                if self.liveness.since is not None:
                    self._gated = True
            else:
                try:
                    self._outbox.remove(p)
                except ValueError:
                    pass
                err = ServerUnavailable(self.unreachable_reason(p.label, p.timeout))
            p.fail(err)

    def unreachable_reason(self, label: str, timeout: float) -> str:
        """Why ``label`` could not be sent within ``timeout`` s, and what to do."""
        return unreachable_reason(self.url, label, timeout, self._ever_connected,
                                  self._refused)

    def cancel(self, p: PendingRequest) -> None:
        """Forget a request whose reply is no longer wanted (a late reply is dropped)."""
        with self._lock:
            if p.done:
                return
            self._pending.pop(p.uid, None)
            try:
                self._outbox.remove(p)
            except ValueError:
                pass
            p.fail(RequestTimeout(f"{p.label} was cancelled"))

    # ------------------------------------------------------------------- closing
    def close(self) -> None:
        """Fail every pending request with ClientClosed and release the socket."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._gated = True
            victims = list(self._pending.values())
            self._pending.clear()
            self._outbox.clear()
        err = ClientClosed(f"the client for {self.url} was closed before the reply arrived")
        for p in victims:
            p.fail(err)
        self._wake_leader()
        # Wait for a leader to leave poll() before its fds are closed.
        with self._leader:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        return len(self._pending)
