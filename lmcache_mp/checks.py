"""Argument checks shared by every layer, each raising :class:`InvalidArgument` with a
message that names the argument and what was wrong.

The server drops a request it cannot decode without replying, so everything a caller
passes is checked here first; one module keeps the wording and the rules the same
everywhere (a bool is never an int, a timeout is a positive number of seconds).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import InvalidArgument

__all__ = [
    "is_int",
    "positive_int",
    "non_negative_int",
    "int_in_range",
    "positive_seconds",
    "optional_positive_seconds",
    "non_empty_str",
    "one_of",
]


def is_int(value: Any) -> bool:
    """An int that is not a bool (``True`` must never pass for ``1``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    if not is_int(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    if not is_int(value) or value < 0:
        raise InvalidArgument(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def int_in_range(name: str, value: Any, lo: int, hi: int) -> int:
    """An int in the closed range ``[lo, hi]``."""
    if not is_int(value) or not lo <= value <= hi:
        raise InvalidArgument(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def positive_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgument(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def optional_positive_seconds(name: str, value: Any) -> float | None:
    return None if value is None else positive_seconds(name, value)


def non_empty_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty str, got {value!r}")
    return value


def one_of(name: str, value: Any, choices: Iterable[str]) -> str:
    options = tuple(choices)
    if value not in options:
        raise InvalidArgument(
            f"{name} must be one of {', '.join(repr(c) for c in options)}, got {value!r}")
    return str(value)
