"""COMMIT_RETRIEVEs sent after their copy, whose replies no caller waits for.

An engine-driven RETRIEVE has written its blocks when this client's copy returns: the
server pinned the slots at PREPARE_RETRIEVE and keeps them pinned until the
COMMIT_RETRIEVE, which only releases the LOOKUP's read locks, and whose reply says
nothing about the bytes (``True`` on every release). So the retrieve resolves when the
COMMIT is sent, not when its reply is in: a vLLM engine learns of a warm request's load
one server round trip sooner (benchmarks/ttft_phases.py's ``to_reported``, ~1.3 ms of
a 8k-token warm TTFT on a CPU engine, issue 38). A server restarted under the copy
changes nothing either: its new pool is a new segment (engine_driven.PoolMaps), and the
copy read the mapping of the one that pinned the slots.

The replies are still read, here: each new commit and each engine-driven transfer
collects those that came in, and :meth:`UnconfirmedCommits.settle` (at unregister)
waits for the rest within a bound. Not ordered by this: an END_SESSION sent right after
the retrieve returns (``Request.close()``) may be handled before the COMMIT on LMCache
0.5.6's thread pool, whose ``commit_retrieve`` then recreates the session until its TTL
(600 s). Waiting for the COMMITs in ``close()`` was tried and reverted: with it,
tests/live/test_chaos.py's dead-message-thread scenario failed once (three 1 s stores took
2.9 s while the server restarted), and the cause was not pinned down.

A reply that failed (none within the retrieve's deadline, a server error) is logged: the
server then frees the locks at its read-lock TTL, as after any lost COMMIT.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..errors import LMCacheMPError
from ..transport import ReplyFuture

log = logging.getLogger("lmcache_mp")


class UnconfirmedCommits:
    """The replies of COMMITs sent on behalf of calls that have returned. Thread-safe
    (a registration's loads and stores run on different threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[str, ReplyFuture[Any]]] = []

    def add(self, op_name: str, future: ReplyFuture[Any]) -> None:
        self.collect()
        with self._lock:
            self._pending.append((op_name, future))

    def collect(self) -> None:
        """Read the replies that are in (without waiting), logging the failures."""
        if self._pending:  # unlocked peek: most calls find none
            self._check(None)

    def settle(self, seconds: float) -> None:
        """Wait at most ``seconds`` in all for the replies still out, then read them."""
        self._check(time.monotonic() + seconds)

    def _check(self, wait_until: float | None) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        left = []
        for op_name, future in pending:
            if wait_until is not None:
                future.wait(wait_until - time.monotonic())
            if not future.done():
                left.append((op_name, future))
                continue
            try:
                future.result()
            except LMCacheMPError as err:
                log.warning("lmcache_mp: the %s sent after a completed retrieve was not "
                            "confirmed: %s. The blocks were written under the server's "
                            "read locks; the server frees those at its lock TTL", op_name,
                            err)
        if left:
            with self._lock:
                self._pending[:0] = left
