"""Telling "the server rejected this request" from "nothing answers at all".

An LMCache server sends no reply to a request it rejects (it logs why), so an
unanswered request alone proves nothing. But a malformed message from *any* client
kills the server's message thread for good while the process lives on and keeps the
port open; a stopped (SIGSTOP) or wedged server looks the same. Every call would then
wait its whole deadline, for ever.

So when a request is still unanswered shortly before its deadline (:func:`probe_point`),
the transport sends one NOOP, which the server answers on that message thread. At the
deadline (see :meth:`ProbeState.verdict`):

* a NOOP sent after the request was answered: the server is alive and dropped or is
  still running the request: :class:`RequestTimeout`, as before;
* no NOOP sent after it was answered, though one has been out for a while:
  :class:`ServerUnresponsive`, and the transport's gate shuts
  (:mod:`lmcache_mp.transport.gate`): later calls fail at once with that error instead
  of each waiting its deadline. The gate opens as soon as any probe is answered (a
  SIGCONT, a busy thread freed), or when the socket connects again (a restarted
  server). While it is shut, a fresh probe goes out at most every :data:`REPROBE_S`.

Nothing here runs while replies arrive in time: the probe point is computed once per
blocking wait, and the rest only for a request that is about to time out.
This module holds the probes and the decisions; the transport
(:class:`~lmcache_mp.transport.core.Transport`) sends the probes under its lock and
moves its gate on the verdicts.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ..errors import LMCacheMPError, RequestTimeout, ServerUnresponsive

if TYPE_CHECKING:
    from .pending import PendingRequest

__all__ = ["ProbeState", "PROBE_LEAD_S", "MIN_SILENCE_S", "REPROBE_S", "PROBE_TIMEOUT_S",
           "probe_point"]

#: A NOOP probe goes out this long before an unanswered request's deadline (at most
#: half its timeout), so the verdict is in by the deadline: a call never overstays it.
#: One second is ample for a live message thread (it answers NOOP in well under a
#: millisecond) even on a loaded host, and small against the 5 s default deadline.
PROBE_LEAD_S = 1.0
#: A probe unanswered for less than this proves nothing (tiny per-call timeouts).
MIN_SILENCE_S = 0.05
#: While the server answers nothing, a fresh probe goes out at most this often.
REPROBE_S = 1.0
#: Probes are never waited on by a caller; their own deadline only bounds how long an
#: unanswered one is kept (a later answer still lifts the gate).
PROBE_TIMEOUT_S = 3600.0
#: The probes kept outstanding (older ones are forgotten, their late replies dropped).
_KEPT = 2


def probe_point(p: PendingRequest) -> float:
    """When an unanswered ``p`` gets a probe sent after it."""
    return p.deadline - min(p.timeout * 0.5, PROBE_LEAD_S)


def _created(p: PendingRequest) -> float:
    return p.deadline - p.timeout


class ProbeState:
    """The probes in flight, and the verdicts drawn from them."""

    def __init__(self, url: str) -> None:
        self.url = url
        #: The probe request's frames (NOOP's type frame); None until the server's
        #: protocol is known: nothing is ever sent to an unidentified server.
        self.frames: list[bytes] | None = None
        self.probes: deque[PendingRequest] = deque()

    # ------------------------------------------------------------- probes
    def needs_probe(self, p: PendingRequest) -> bool:
        """Whether ``p`` (sent, unanswered near its deadline) needs a new probe: none
        was sent after it yet."""
        if self.frames is None or not p.sent:
            return False
        created = _created(p)
        return not any(_created(q) >= created for q in self.probes)

    def add(self, probe: PendingRequest) -> PendingRequest | None:
        """Track a probe just sent; returns one no longer kept (to be cancelled)."""
        self.probes.append(probe)
        return self.probes.popleft() if len(self.probes) > _KEPT else None

    def answered(self) -> bool:
        return any(q.done and q.error is None for q in self.probes)

    def reprobe_due(self, now: float) -> bool:
        if self.frames is None:
            return False
        live = [q for q in self.probes if not q.done]
        return not live or now - _created(live[-1]) >= REPROBE_S

    # ------------------------------------------------------------ verdicts
    def verdict(self, p: PendingRequest, now: float) -> LMCacheMPError:
        """The error of ``p``, sent and unanswered at its deadline (see the module
        docstring): :class:`ServerUnresponsive` when the server is judged silent."""
        created = _created(p)
        after = [q for q in self.probes if _created(q) >= created]
        if any(q.done and q.error is None for q in after):
            return RequestTimeout(
                f"no reply to {p.label} from the LMCache server at {self.url} within "
                f"{p.timeout:g} s, although the server is answering (a NOOP sent after it "
                f"was answered): it rejected or dropped this request (its log says why), "
                f"or is still working on it; raise the timeout only if it is merely slow.")
        waiting = [q for q in after if not q.done]
        if waiting and now - _created(waiting[0]) >= MIN_SILENCE_S:
            silent = now - _created(waiting[0])
            return ServerUnresponsive(
                f"no reply to {p.label} from the LMCache server at {self.url} within "
                f"{p.timeout:g} s, nor to a NOOP sent {silent:.2f} s before that deadline: "
                f"the server accepts the connection but answers nothing. Its message "
                f"thread has died (a malformed message from any client kills it for good) "
                f"or the process is stopped or overloaded: restart it. Until it answers "
                f"again, calls fail at once with this error.")
        return RequestTimeout(
            f"no reply to {p.label} from the LMCache server at {self.url} within "
            f"{p.timeout:g} s. The server sends no reply when it rejects a request (its "
            f"log says why); if it no longer answers anything (try `lmcache-mp ping "
            f"{self.url}`), its message thread has died: restart it. Raise the timeout "
            f"only if the server is merely slow.")

    def fast_fail(self, label: str, now: float, since: float | None) -> ServerUnresponsive:
        """The error of a call made while the server is judged unresponsive (since
        ``since``, monotonic)."""
        since = now if since is None else since
        return ServerUnresponsive(
            f"{label} was not sent: the LMCache server at {self.url} stopped answering "
            f"(judged {now - since:.1f} s ago: its message thread has died, or the process "
            f"is stopped): restart it. Calls fail at once until it "
            f"answers a NOOP probe again (one goes out at most every {REPROBE_S:g} s) or "
            f"the connection is re-established.")
