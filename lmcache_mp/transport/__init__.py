"""The transport layer: one DEALER socket, replies matched by uid, a deadline on
everything. It knows nothing of operations, profiles or memory: it sends frames and
hands back frames.

* :mod:`.core`: :class:`Transport`, the one owner of the transport's state (the hot
  path, connection events, the gate's probes);
* :mod:`.pending`: :class:`PendingRequest`, a request in flight, and the errors that
  end one unanswered;
* :mod:`.dealer`: the socket's options, its monitor, what ``close()`` releases;
* :mod:`.probe`: NOOP probes and their verdicts (a rejected request, or a server that
  answers nothing);
* :mod:`.gate`: the gate's state machine (open / probing / unresponsive / closed);
* :mod:`.futures`: :class:`ReplyFuture`, the non-blocking form of every call.
"""

from __future__ import annotations

from .core import Transport
from .dealer import MAX_REPLY_BYTES
from .futures import ReplyFuture, blocking
from .pending import PendingRequest

__all__ = ["Transport", "PendingRequest", "MAX_REPLY_BYTES", "ReplyFuture", "blocking"]
