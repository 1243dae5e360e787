"""A registration's binding to the server, as one explicit state machine.

The server forgets a registration when it restarts, and reaps one that stays silent
too long; either way it then drops the registration's transfers without a reply. So a
:class:`~lmcache_mp.Registration` holds a *binding*: what its last (re-)registration
established (the connection it was made on, the engine-driven pool), when the server
last proved it knows the registration, and what is in doubt. Its states:

* ``NEW``: made, not yet registered (:meth:`Client.register` is registering it).
* ``BOUND``: the server confirmed it on connection :attr:`BindingState.epoch`. It is
  *fresh* (transfers go out on it) while the transport is still on that connection
  and the server was refreshed (a PING, a transfer, a register) less than
  ``stale_after`` seconds ago; else the next check renews or re-registers it.
* ``SUSPECT``: the server may have lost it (a heartbeat went unanswered, or the
  transport moved to a new connection, which may reach a restarted server). The next
  check registers it again.
* ``RENEWING``: registering again because it was silent too long (the server treats a
  repeated REGISTER of a live instance as a refresh): nothing was lost.
* ``RE_REGISTERING``: registering again while suspect: the server may have restarted,
  so what it cached may be gone (the client's ``on_recovered`` callback runs after).
* ``UNREGISTERED``: unregistered; nothing brings it back. Final.

Every legal move is one entry of :data:`TRANSITIONS` (as in h11's ``_state.py``): the
registration reports what happened (a :class:`BindingEvent`) and the table says where
that leads from the current state. A pair the table lacks is a bug in the client and
raises :class:`BindingError` rather than leaving the binding somewhere nobody reasoned
about. A failed renewal leaves the binding as it was (``BOUND``, still stale, so the
next check tries again); a failed re-registration leaves it ``SUSPECT``.

Freshness is tested once, by :meth:`BindingState.fresh`, on every transfer: it reads
three attributes and moves nothing. A reply moves :attr:`BindingState.last_refresh`
forward (:meth:`BindingState.touch`); that is data, not a move, and costs no table
lookup on the hot path. Moves happen under the state's own small lock, so that the
heartbeat thread (``HEARTBEAT_FAILED``) and a thread re-registering (under the
registration's recovery lock) never lose each other's move.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..protocol.types import RegisterEngineDrivenContextResponse

if TYPE_CHECKING:
    from .engine_driven import Pool

__all__ = ["Binding", "BindingState", "BindingStatus", "BindingEvent", "BindingError",
           "TRANSITIONS"]


@dataclass(frozen=True)
class Binding:
    """What one (re-)registration established: the connection it was made on and, for
    engine-driven registrations, the server's pool as mapped here."""

    epoch: int
    pool: Pool | None = None
    pool_info: RegisterEngineDrivenContextResponse | None = None


class BindingStatus(enum.Enum):
    NEW = "new"
    BOUND = "bound"
    SUSPECT = "suspect"
    RENEWING = "renewing"
    RE_REGISTERING = "re-registering"
    UNREGISTERED = "unregistered"


class BindingEvent(enum.Enum):
    #: The first REGISTER was answered.
    REGISTERED = "registered"
    #: A heartbeat PING got no answer: the server may have lost the registration.
    HEARTBEAT_FAILED = "heartbeat failed"
    #: A check found the transport on a newer connection than the binding's.
    CONNECTION_CHANGED = "connection changed"
    #: Registering again because the binding was silent too long.
    RENEW_STARTED = "renewal started"
    #: Registering again because the binding is suspect.
    RE_REGISTER_STARTED = "re-registration started"
    #: The server answered the renewal's or re-registration's REGISTER.
    RE_REGISTERED = "re-registered"
    #: The renewal or re-registration failed (nothing answered, deadline, mismatch).
    RE_REGISTER_FAILED = "re-registration failed"
    #: Registration.unregister().
    UNREGISTERED = "unregistered"


_S, _E = BindingStatus, BindingEvent

#: (state, event) -> next state; any pair missing is illegal.
TRANSITIONS: dict[tuple[BindingStatus, BindingEvent], BindingStatus] = {
    (_S.NEW, _E.REGISTERED): _S.BOUND,
    (_S.NEW, _E.UNREGISTERED): _S.UNREGISTERED,  # unregister() before any register: a no-op

    (_S.BOUND, _E.HEARTBEAT_FAILED): _S.SUSPECT,
    (_S.BOUND, _E.CONNECTION_CHANGED): _S.SUSPECT,
    (_S.BOUND, _E.RENEW_STARTED): _S.RENEWING,
    (_S.BOUND, _E.UNREGISTERED): _S.UNREGISTERED,

    # More doubt changes nothing; only registering again clears it (no PING is sent).
    (_S.SUSPECT, _E.HEARTBEAT_FAILED): _S.SUSPECT,
    (_S.SUSPECT, _E.CONNECTION_CHANGED): _S.SUSPECT,
    (_S.SUSPECT, _E.RE_REGISTER_STARTED): _S.RE_REGISTERING,
    (_S.SUSPECT, _E.UNREGISTERED): _S.UNREGISTERED,

    (_S.RENEWING, _E.RE_REGISTERED): _S.BOUND,
    (_S.RENEWING, _E.RE_REGISTER_FAILED): _S.BOUND,  # still stale: the next check retries
    # A PING sent before the renewal began went unanswered: should the renewal fail,
    # the binding stays suspect.
    (_S.RENEWING, _E.HEARTBEAT_FAILED): _S.RE_REGISTERING,

    (_S.RE_REGISTERING, _E.RE_REGISTERED): _S.BOUND,
    (_S.RE_REGISTERING, _E.RE_REGISTER_FAILED): _S.SUSPECT,
    (_S.RE_REGISTERING, _E.HEARTBEAT_FAILED): _S.RE_REGISTERING,

    # A PING in flight when the registration was unregistered; unregister() again.
    (_S.UNREGISTERED, _E.HEARTBEAT_FAILED): _S.UNREGISTERED,
    (_S.UNREGISTERED, _E.UNREGISTERED): _S.UNREGISTERED,
}

_BOUND = _S.BOUND


class BindingError(RuntimeError):
    """An event the binding's table does not allow in its current state (a bug)."""


class BindingState:
    """A registration's binding: its state, the :class:`Binding` (epoch, pool) of the
    last (re-)registration, and when the server was last refreshed. Thread-safe.

    ``stale_after``: seconds of silence after which a binding is renewed (a share of
    the server's shortest reap budget)."""

    __slots__ = ("state", "binding", "last_refresh", "stale_after", "_lock")

    def __init__(self, stale_after: float) -> None:
        self.state = _S.NEW
        #: What the last (re-)registration established; None unless registered.
        self.binding: Binding | None = None
        #: When (monotonic) a request was sent that the server answered for this
        #: registration: its reap timer was refreshed then.
        self.last_refresh = 0.0
        self.stale_after = stale_after
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<BindingState {self.state.value} epoch={self.epoch}>"

    @property
    def epoch(self) -> int | None:
        """The connection the binding was made on; None unless registered."""
        b = self.binding
        return None if b is None else b.epoch

    # --------------------------------------------------------------- the test
    def fresh(self, epoch: int) -> bool:
        """Whether a transfer may go out on this binding now: it is ``BOUND``, on the
        transport's current connection ``epoch``, and refreshed within ``stale_after``."""
        b = self.binding
        return (self.state is _BOUND and b is not None and b.epoch == epoch
                and time.monotonic() - self.last_refresh < self.stale_after)

    def touch(self, sent_at: float) -> None:
        """The server answered a request of this registration sent at ``sent_at``
        (monotonic): its reap timer was refreshed then. Not a move."""
        if sent_at > self.last_refresh:
            self.last_refresh = sent_at

    # ---------------------------------------------------------------- moves
    def fire(self, event: BindingEvent) -> BindingStatus:
        """Apply ``event``; returns the new state."""
        with self._lock:
            return self._move(event)

    def _move(self, event: BindingEvent) -> BindingStatus:
        old = self.state
        new = TRANSITIONS.get((old, event))
        if new is None:
            raise BindingError(f"a registration's binding cannot take {event.value!r} while "
                               f"{old.value}")
        self.state = new
        return new

    def registered(self, binding: Binding, sent_at: float) -> None:
        """The first REGISTER (sent at ``sent_at``) established ``binding``."""
        with self._lock:
            self._check(_E.REGISTERED)
            self.binding, self.last_refresh = binding, sent_at
            self._move(_E.REGISTERED)

    def begin_again(self, epoch: int) -> bool:
        """Start registering again (the caller holds the registration's recovery lock),
        given the transport's connection ``epoch``: a re-registration if the binding is
        suspect or was made on an older connection (returns True: the server may have
        restarted), else a renewal (returns False)."""
        with self._lock:
            b = self.binding
            if self.state is _S.BOUND and b is not None and b.epoch != epoch:
                self._move(_E.CONNECTION_CHANGED)
            if self.state is _S.SUSPECT:
                self._move(_E.RE_REGISTER_STARTED)
                return True
            self._move(_E.RENEW_STARTED)
            return False

    def registered_again(self, binding: Binding, sent_at: float) -> Binding | None:
        """The renewal's or re-registration's REGISTER (sent at ``sent_at``) established
        ``binding``; returns the binding it replaces (whose pool to release)."""
        with self._lock:
            self._check(_E.RE_REGISTERED)
            old, self.binding, self.last_refresh = self.binding, binding, sent_at
            self._move(_E.RE_REGISTERED)
            return old

    def unregistered(self) -> Binding | None:
        """Registration.unregister(): returns the binding it held (None if it held none)."""
        with self._lock:
            self._move(_E.UNREGISTERED)
            old, self.binding = self.binding, None
            return old

    def _check(self, event: BindingEvent) -> None:
        # The data of a move that binds is written before the state changes (a reader
        # never sees BOUND with the old binding), so the move is checked first.
        if (self.state, event) not in TRANSITIONS:
            self._move(event)  # raises
