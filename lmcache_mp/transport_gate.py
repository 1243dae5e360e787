"""The transport's "unresponsive" gate and the NOOP probes behind it.

A request unanswered near its deadline gets a NOOP probe sent after it
(:func:`probe_for`); when neither is answered, the transport is *gated*
(:mod:`lmcache_mp.probing` decides: see its docstring): while gated, submit() calls
:func:`check_gate_locked`, which fails the call at once unless a probe was answered or
the socket connected again meanwhile (the gate lifts), and sends a fresh probe at most
every ``REPROBE_S``. :func:`declare_unresponsive` gates a transport whose protocol
detection got no answer at all.

None of this runs while the server answers: submit() tests one flag, ``_gated``.
These functions do the gate's I/O on a :class:`~lmcache_mp.transport.Transport`,
under its lock (``*_locked``) or taking it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

from .errors import ClientClosed, RequestTimeout
from .probing import PROBE_TIMEOUT_S
from .transport_pending import PendingRequest

if TYPE_CHECKING:
    from .transport import Transport

__all__ = ["check_gate_locked", "lift_locked", "send_probe_locked", "declare_unresponsive",
           "probe_for"]


def check_gate_locked(t: Transport, label: str) -> None:
    """Closed: ClientClosed. Judged unresponsive: ServerUnresponsive at once, unless
    a probe was answered or the socket connected again meanwhile (the gate lifts)."""
    if t._closed:
        raise ClientClosed(f"the client for {t.url} is closed; create a new Client")
    woke = t._drain_monitor_locked()  # a new connection lifts the gate
    woke += t._drain_inbound_locked()  # so may a probe's reply
    if woke and t._leader.locked():
        t._wake_leader()
    live = t.liveness
    if t._gated and live.answered():
        lift_locked(t)
    if not t._gated:
        return
    now = time.monotonic()
    if live.reprobe_due(now):
        send_probe_locked(t)
    raise live.fast_fail(label, now)


def lift_locked(t: Transport) -> None:
    """The server answers again (or the connection changed): calls go out again."""
    t.liveness.lift()
    t._gated = t._closed


def send_probe_locked(t: Transport) -> None:
    """Send a NOOP probe (never waited on: its reply is looked at by verdicts and by
    the gate). Like submit(), minus the gate and the epoch."""
    frames = t.liveness.frames
    assert frames is not None
    uid = msgspec.msgpack.encode(next(t._uids))
    out = [uid, *frames]
    p = PendingRequest(uid, "a NOOP liveness probe", PROBE_TIMEOUT_S, out)
    t._enqueue_locked(p)
    dropped = t.liveness.add(p)
    if dropped is not None and not dropped.done:
        t._pending.pop(dropped.uid, None)
        if dropped.out is not None:
            try:
                t._outbox.remove(dropped)
            except ValueError:
                pass
        dropped.fail(RequestTimeout("superseded by a newer probe"))
    if t._leader.locked() and t._drain_inbound_locked():
        t._wake_leader()


def declare_unresponsive(t: Transport, frames: list[bytes]) -> None:
    """Gate ``t``: the protocol detection got no answer at all. Probes are ``frames``
    (a request answered on the server's message thread in every release) until the
    protocol is known; the first answer lifts the gate."""
    with t._lock:
        if t._closed:
            return
        live = t.liveness
        if live.frames is None:
            live.frames = frames
        send_probe_locked(t)
        live.since = time.monotonic()
        t._gated = True


def probe_for(t: Transport, p: PendingRequest) -> None:
    """``p`` is still unanswered near its deadline: make sure a probe follows it."""
    with t._lock:
        if not t._closed and t.liveness.needs_probe(p):
            send_probe_locked(t)
