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
  a rejected request from a server that answers nothing (:mod:`.probe` decides); a
  server judged silent shuts the gate (:mod:`.gate`, a state machine), and calls then
  fail at once instead of each waiting its deadline.
* ``MAXMSGSIZE``: a reply frame over :data:`MAX_REPLY_BYTES` is never buffered; ZMQ
  drops the connection instead, the calls in flight fail at once saying so, and the
  transport connects again (ZMQ itself would not after such a protocol error).

Everything that reads or writes the transport's state is a method here: the hot path
(submit, send, wait, complete), the connection events from the socket's monitor, and
the gate's probes. Beside it, owning no transport state: :mod:`.pending` (a request in
flight, the errors that end it), :mod:`.dealer` (the socket's setup and release),
:mod:`.probe` (the probes and their verdicts) and :mod:`.gate` (the gate's states).
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

from ..errors import (
    ClientClosed,
    LMCacheMPError,
    RequestTimeout,
    ServerUnavailable,
    ServerUnresponsive,
)
from .dealer import MAX_REPLY_BYTES, monitor_event, open_dealer
from .gate import Gate, GateEvent, GateState
from .pending import PendingRequest, connection_changed, connection_lost, unreachable_reason
from .probe import PROBE_LEAD_S, PROBE_TIMEOUT_S, ProbeState

__all__ = ["Transport"]

# A follower re-checks for a free leader slot at least this often, as a safety net
# under the explicit leadership hand-off.
_FOLLOWER_SLICE_S = 0.05
# Plain ints: pyzmq's IntFlag constants cost an enum operation on every use.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_OUTBOX_RETRY_MS = 2
_CONNECTED = int(zmq.EVENT_CONNECTED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_CONNECT_RETRIED = int(zmq.EVENT_CONNECT_RETRIED)
_CLOSED = GateState.CLOSED
_UNRESPONSIVE = GateState.UNRESPONSIVE


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
        # Whether calls go out (open, probing) or fail at once (unresponsive, closed):
        # submit() tests its one ``blocks`` attribute, so the gate costs nothing while
        # the server answers.
        self._gate = Gate()
        self._probes = ProbeState(url)
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
            if self._gate.blocks:
                self._check_gate_locked(label)  # raises unless the server answers again
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
            if not self.connected:
                # It went out (IMMEDIATE: on a connection), so that connection's event
                # is waiting unread: take it in first, so the request is tied to the
                # connection (epoch) it went out on.
                self._drain_monitor_locked()
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
            self._on_monitor_event_locked(monitor_event(monitor.recv_multipart(_NOBLOCK)))
            n += 1
        return n

    def _on_monitor_event_locked(self, event: int) -> None:
        """Apply one connection event: a new connection bumps :attr:`epoch`, a lost one
        holds every send behind the barrier and fails the requests sent on it at once."""
        if event == _CONNECTED:
            self.connected = True
            self._ever_connected = True
            self.epoch += 1
            outbox = self._outbox
            if outbox and outbox[0] is self._barrier:
                outbox.popleft()  # the lost connection's pipe is gone by now
            # Possibly a restarted server: whatever the last one did not answer says
            # nothing about this one.
            self._gate.fire(GateEvent.CONNECTION)
        elif event == _CONNECT_RETRIED:
            self._refused += 1
        elif event == _DISCONNECTED:
            self.connected = False
            # ZMQ detaches the lost connection's pipe a moment after this event: until
            # then a send would vanish into it. Hold every send until a new connection.
            outbox = self._outbox
            if not (outbox and outbox[0] is self._barrier):
                outbox.appendleft(self._barrier)
            # The verdict was about that connection; calls now wait for a new one
            # within their deadlines.
            self._gate.fire(GateEvent.CONNECTION)
            # Replies to requests sent on the lost connection can never arrive: the
            # server's ROUTER sees a new peer after a reconnect.
            pending = self._pending
            lost = [p for p in pending.values() if p.sent]
            for p in lost:
                del pending[p.uid]
                p.fail(connection_lost(p, self.url, MAX_REPLY_BYTES))
            # After a protocol error (an oversized frame) ZMQ ends the connection for
            # good instead of reconnecting; starting it afresh covers that and is the
            # same as ZMQ's own reconnect otherwise.
            try:
                self._sock.disconnect(self.url)
            except zmq.ZMQError:
                pass
            self._sock.connect(self.url)

    def refresh(self) -> int:
        """Take in connection events now (without blocking) and return :attr:`epoch`.

        Events are otherwise seen only while some thread waits on the socket."""
        with self._lock:
            if self._gate.state is not _CLOSED and self._drain_monitor_locked() \
                    and self._leader.locked():
                self._wake_leader()  # the waiting thread's requests may have been failed
            return self.epoch

    def _drain_inbound_locked(self, until: PendingRequest | None = None) -> int:
        """Dispatch every readable reply; with ``until``, stop once that one is done.

        Stopping early leaves the socket's edge-triggered fd unsignalled for what is
        still unread; that is safe because every thread that starts driving the socket
        (``_lead``) drains first, and the leader hands off to a waiting follower when it
        leaves. It saves the last ZMQ_EVENTS read (a socket option call, ~1.5 us) of
        every blocking call."""
        n = 0
        sock = self._sock
        get = sock.get
        pending = self._pending
        while int(get(_EVENTS)) & _POLLIN:
            msg = sock.recv_multipart(_NOBLOCK)
            req = pending.pop(msg[0], None)
            if req is not None:  # else: a late reply to a request that timed out
                req.complete(msg[1:])
                n += 1
                if req is until:
                    break
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
                self._probe_for(p)
                self._await(p, p.deadline)
                self._settled()
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
                    if self._gate.state is not _CLOSED:
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
        if not self._followers:
            # Unlocked read: a follower that registers after it retries the leader slot
            # itself before sleeping (see _await), so none is missed.
            return
        with self._followers_lock:
            for q in self._followers:
                if not q.done and q.event is not None:
                    q.event.set()
                    return

    def _lead(self, p: PendingRequest, deadline: float) -> None:
        poller = self._poller
        wake_r = self._res.wake_r
        monitor_fd = self._monitor_fd
        # The monitor is read only when its fd fires: every reader drains it whole, so
        # an event nobody has read keeps the fd readable and poll() returns at once.
        check_monitor = False
        gate = self._gate
        while True:
            with self._lock:
                if gate.state is _CLOSED:
                    return
                if check_monitor:
                    self._drain_monitor_locked()
                if self._outbox:
                    self._service_locked()
                else:
                    self._drain_inbound_locked(p)
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
                now = time.monotonic()
                err: LMCacheMPError = self._probes.verdict(p, now)
                if isinstance(err, ServerUnresponsive):
                    self._gate.fire(GateEvent.SILENT, now)
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

    # ---------------------------------------------------------------------- gate
    # None of this runs while the server answers: submit() tests ``_gate.blocks``, and
    # wait() probes only for a request still unanswered near its deadline.
    def set_probe_frames(self, frames: list[bytes]) -> None:
        """The probe request's frames (NOOP's type frame in the server's protocol); no
        probe is sent before they are known."""
        with self._lock:
            self._probes.frames = frames

    def declare_unresponsive(self, frames: list[bytes]) -> None:
        """Shut the gate: the protocol detection got no answer at all. Probes are
        ``frames`` (a request answered on the server's message thread in every release)
        until the protocol is known; the first answer opens the gate again."""
        with self._lock:
            if self._gate.state is _CLOSED:
                return
            probes = self._probes
            if probes.frames is None:
                probes.frames = frames
            self._send_probe_locked()
            self._gate.fire(GateEvent.DECLARED)

    def _check_gate_locked(self, label: str) -> None:
        """Closed: ClientClosed. Judged unresponsive: ServerUnresponsive at once, unless
        a probe was answered or the socket connected again meanwhile (the gate opens)."""
        gate = self._gate
        if gate.state is _CLOSED:
            raise ClientClosed(f"the client for {self.url} is closed; create a new Client")
        woke = self._drain_monitor_locked()  # a new connection opens the gate
        woke += self._drain_inbound_locked()  # so may a probe's reply
        if woke and self._leader.locked():
            self._wake_leader()
        probes = self._probes
        if gate.state is _UNRESPONSIVE and probes.answered():
            gate.fire(GateEvent.ANSWERED)
        if not gate.blocks:
            return
        now = time.monotonic()
        if probes.reprobe_due(now):
            self._send_probe_locked()
        raise probes.fast_fail(label, now, gate.since)

    def _probe_for(self, p: PendingRequest) -> None:
        """``p`` is still unanswered near its deadline: make sure a probe follows it."""
        with self._lock:
            if self._gate.state is not _CLOSED and self._probes.needs_probe(p):
                self._send_probe_locked()

    def _settled(self) -> None:
        """A probed request ended (answered, failed or judged): its doubt is over."""
        with self._lock:
            self._gate.fire(GateEvent.SETTLED)

    def _send_probe_locked(self) -> None:
        """Send a NOOP probe (never waited on: its reply is looked at by verdicts and by
        the gate). Like submit(), minus the gate and the epoch."""
        probes = self._probes
        frames = probes.frames
        assert frames is not None
        uid = msgspec.msgpack.encode(next(self._uids))
        p = PendingRequest(uid, "a NOOP liveness probe", PROBE_TIMEOUT_S, [uid, *frames])
        self._enqueue_locked(p)
        self._gate.fire(GateEvent.PROBE_SENT)
        dropped = probes.add(p)
        if dropped is not None and not dropped.done:
            self._pending.pop(dropped.uid, None)
            if dropped.out is not None:
                try:
                    self._outbox.remove(dropped)
                except ValueError:
                    pass
            dropped.fail(RequestTimeout("superseded by a newer probe"))
        if self._leader.locked() and self._drain_inbound_locked():
            self._wake_leader()

    # ------------------------------------------------------------------- closing
    def close(self) -> None:
        """Fail every pending request with ClientClosed and release the socket."""
        with self._lock:
            if self._gate.state is _CLOSED:
                return
            self._gate.fire(GateEvent.CLOSE)
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
        return self._gate.state is _CLOSED

    @property
    def gate_state(self) -> GateState:
        """Where the gate stands (see :mod:`lmcache_mp.transport.gate`)."""
        return self._gate.state

    @property
    def in_flight(self) -> int:
        return len(self._pending)
