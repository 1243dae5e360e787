"""Waiting for a condition another thread or process brings about, with a bound."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 3.0,
               interval: float = 0.01) -> bool:
    """True once `predicate()` is true, False if it is still false after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
