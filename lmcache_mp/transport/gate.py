"""The transport's gate: whether calls go out, as one explicit state machine.

A server that accepts the connection but answers nothing (its message thread died, the
process is stopped) would make every call wait its whole deadline, for ever; the gate
turns that into an immediate :class:`~lmcache_mp.errors.ServerUnresponsive` (see
:mod:`lmcache_mp.transport.probe` for how the transport tells a silent server from a
rejected request). Its states:

* ``OPEN``: calls go out; nothing is in doubt.
* ``PROBING``: calls go out; a NOOP probe follows a request still unanswered near its
  deadline, and that request's verdict is pending.
* ``UNRESPONSIVE``: calls fail at once, unless a probe was answered or the connection
  changed meanwhile; a fresh probe goes out at most every ``REPROBE_S``.
* ``CLOSED``: the transport is closed; calls fail with ``ClientClosed``. Final.

Every legal move is one entry of :data:`TRANSITIONS` (as in h11's ``_state.py``): the
transport reports what happened (a :class:`GateEvent`) and the table says where that
leads from the current state. A pair the table lacks is a bug in the transport and
raises :class:`GateError` rather than leaving the gate somewhere nobody reasoned about.

The transport tests one attribute on every call, :attr:`Gate.blocks`, so the gate costs
nothing while the server answers. The gate does no I/O and takes no lock: the transport
fires events under its own lock.
"""

from __future__ import annotations

import enum
import time

__all__ = ["GateState", "GateEvent", "GateError", "Gate", "TRANSITIONS", "BLOCKING"]


class GateState(enum.Enum):
    OPEN = "open"
    PROBING = "probing"
    UNRESPONSIVE = "unresponsive"
    CLOSED = "closed"


class GateEvent(enum.Enum):
    #: A NOOP probe went out (after an unanswered request, or again while unresponsive).
    PROBE_SENT = "probe sent"
    #: A probed request ended (reply, error or verdict): the doubt it raised is over.
    SETTLED = "settled"
    #: A verdict: a probe sent after an unanswered request was not answered either.
    SILENT = "silent"
    #: The protocol detection got no answer at all (nothing to probe after).
    DECLARED = "declared unresponsive"
    #: A probe was answered while the server was judged unresponsive.
    ANSWERED = "probe answered"
    #: The socket connected or disconnected: what the last connection did not answer
    #: says nothing about the next one (it may reach a restarted server).
    CONNECTION = "connection changed"
    #: Transport.close().
    CLOSE = "close"


_OPEN, _PROBING, _UNRESPONSIVE, _CLOSED = (GateState.OPEN, GateState.PROBING,
                                           GateState.UNRESPONSIVE, GateState.CLOSED)
_E = GateEvent

#: state -> {event: next state}; anything missing is illegal.
TRANSITIONS: dict[GateState, dict[GateEvent, GateState]] = {
    _OPEN: {
        _E.PROBE_SENT: _PROBING,
        # Another probed call settled first and opened the gate while this call's
        # probe was still out; its verdict may still find the server silent.
        _E.SILENT: _UNRESPONSIVE,
        _E.SETTLED: _OPEN,
        _E.DECLARED: _UNRESPONSIVE,
        _E.CONNECTION: _OPEN,
        _E.CLOSE: _CLOSED,
    },
    _PROBING: {
        # Several calls near their deadlines: each may send its probe.
        _E.PROBE_SENT: _PROBING,
        _E.SETTLED: _OPEN,
        _E.SILENT: _UNRESPONSIVE,
        _E.DECLARED: _UNRESPONSIVE,
        _E.CONNECTION: _OPEN,
        _E.CLOSE: _CLOSED,
    },
    _UNRESPONSIVE: {
        # Re-probes, and a call sent before the gate shut reaching its probe point.
        _E.PROBE_SENT: _UNRESPONSIVE,
        # Calls sent before the gate shut end one by one; each says nothing new.
        _E.SETTLED: _UNRESPONSIVE,
        _E.SILENT: _UNRESPONSIVE,
        _E.DECLARED: _UNRESPONSIVE,
        _E.ANSWERED: _OPEN,
        _E.CONNECTION: _OPEN,
        _E.CLOSE: _CLOSED,
    },
    _CLOSED: {
        # close() fails the calls in flight after letting go of the lock, so a call
        # reaching its deadline meanwhile may still end (and be judged) first.
        _E.SETTLED: _CLOSED,
        _E.SILENT: _CLOSED,
    },
}

#: The states in which submit() refuses calls.
BLOCKING = frozenset({_UNRESPONSIVE, _CLOSED})


class GateError(RuntimeError):
    """An event the gate's table does not allow in its current state (a bug)."""


class Gate:
    """The current state, whether it blocks calls, and since when the server is judged
    unresponsive."""

    __slots__ = ("state", "blocks", "since")

    def __init__(self) -> None:
        self.state = _OPEN
        #: ``state in BLOCKING``, kept by :meth:`fire`: the one attribute submit() tests.
        self.blocks = False
        #: When the server was judged unresponsive (None unless UNRESPONSIVE).
        self.since: float | None = None

    def fire(self, event: GateEvent, now: float | None = None) -> GateState:
        """Apply ``event``; returns the new state. ``now`` (monotonic) stamps a move
        into UNRESPONSIVE (default: the current time)."""
        old = self.state
        new = TRANSITIONS[old].get(event)
        if new is None:
            raise GateError(f"the transport's gate cannot take {event.value!r} while "
                            f"{old.value}")
        if new is _UNRESPONSIVE:
            # The clock starts when the server is first judged silent; the detection's
            # verdict is fresh evidence of its own and restarts it.
            if old is not _UNRESPONSIVE or event is _E.DECLARED:
                self.since = time.monotonic() if now is None else now
        else:
            self.since = None
        self.state = new
        self.blocks = new in BLOCKING
        return new
