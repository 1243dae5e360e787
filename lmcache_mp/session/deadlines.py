"""Deadline arithmetic of the session's calls: the time a call has left, and a lock
waited for only within it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import RequestTimeout, ServerUnavailable

__all__ = ["remaining", "unsent", "within"]


@contextmanager
def within(lock: threading.Lock, deadline: float, what: str) -> Iterator[None]:
    """Hold ``lock``, waiting for it only until ``deadline`` (another thread holding it
    must not make this call overstay its own deadline)."""
    if not lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
        # Nothing was sent: the server is being reached again, as for a call made
        # while it is down.
        raise ServerUnavailable(
            f"{what}: not sent; the call's deadline passed while another thread was "
            f"re-registering with a server that restarted or had dropped this registration")
    try:
        yield
    finally:
        lock.release()


def unsent(deadline: float, what: str) -> float:
    """Like :func:`remaining`, for the steps of a (re-)registration done on a call's
    behalf: once its deadline has passed, the call fails as unsent (ServerUnavailable),
    like a call made while the server is down, which is what the caller sees happen."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ServerUnavailable(
            f"{what}: not sent; the call's deadline passed while the client was registering "
            f"with a server that restarted or had dropped this registration")
    return left


def remaining(deadline: float, what: str) -> float:
    """Seconds left before ``deadline``; RequestTimeout once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise RequestTimeout(f"{what}: the call's deadline passed before it could be sent")
    return left
