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
    "MAX_SECONDS",
    "positive_seconds",
    "non_negative_seconds",
    "optional_positive_seconds",
    "non_empty_str",
    "one_of",
    "server_url",
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


#: The longest duration any call takes (11.6 days). Deadlines become poll(2) waits in
#: milliseconds (a C int: at most 24.8 days) and Event.wait() timeouts, so an infinite
#: or astronomically long one would fail with OverflowError *after* the request was
#: sent; it is refused here instead. Nothing this client does should wait that long.
MAX_SECONDS = 1e6


def positive_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgument(f"{name} must be a positive number of seconds, got {value!r}")
    if not value <= MAX_SECONDS:  # inf and huge values (nan failed above)
        raise InvalidArgument(
            f"{name} must be at most {MAX_SECONDS:g} s (11.6 days), got {value!r}: every "
            f"call has a finite deadline; pass a finite number of seconds")
    return float(value)


def non_negative_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value <= MAX_SECONDS):
        raise InvalidArgument(
            f"{name} must be a number of seconds in [0, {MAX_SECONDS:g}], got {value!r}")
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


def server_url(url: Any, allow_remote: bool) -> str:
    """A ZMQ endpoint this client can reach a server at, checked before any socket.

    ``tcp://HOST:PORT`` (HOST: an IPv4 address, ``[IPv6]``, or a name) and ``ipc://PATH``.
    ``inproc://`` is refused: it only reaches sockets of this process's own ZMQ context,
    never a server. A ``tcp://`` host that is not loopback is refused unless
    ``allow_remote``: REGISTER sends pickles that LMCache servers 0.4.7-0.5.5 load, over
    plaintext ZMQ with no authentication.
    """
    if not isinstance(url, str) or not url or url != url.strip():
        raise InvalidArgument(f"url must be a str like tcp://127.0.0.1:5555, got {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise InvalidArgument(f"url must look like tcp://127.0.0.1:5555 or ipc:///path, got {url!r}")
    if scheme == "ipc":
        if not rest:
            raise InvalidArgument(f"an ipc:// url needs a path (ipc:///tmp/lmcache.sock), got {url!r}")
        return url
    if scheme == "inproc":
        raise InvalidArgument(
            f"{url!r}: inproc:// only reaches sockets inside this process's own ZMQ context, "
            f"never an LMCache server; use tcp://127.0.0.1:PORT or ipc:///path")
    if scheme in ("grpc", "grpc+unix"):
        # LMCache 0.5.6+ can serve gRPC instead of ZMQ (--transport grpc); its own
        # client picks the transport by this scheme. This client speaks ZMQ only.
        raise InvalidArgument(
            f"{url!r}: that is LMCache's gRPC transport, which lmcache-mp does not speak "
            f"(it speaks the ZMQ transport, LMCache's default). Start the server with "
            f"--transport zmq (the default) and connect to tcp://HOST:PORT")
    if scheme != "tcp":
        raise InvalidArgument(
            f"{url!r}: unsupported transport {scheme!r}; an LMCache server listens on "
            f"tcp://HOST:PORT (or ipc:///path)")
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit() or not port.isascii() or not 1 <= int(port) <= 65535:
        raise InvalidArgument(f"{url!r}: expected tcp://HOST:PORT with a port in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise InvalidArgument(f"{url!r}: write an IPv6 address in brackets: tcp://[::1]:{port}")
    if not host or any(c in host for c in " ;*/[]@") or not host.isascii():
        raise InvalidArgument(f"{url!r}: not a host name or address: {host!r}")
    if not allow_remote and not _is_local(host):
        raise InvalidArgument(
            f"{url!r} is not a loopback address. REGISTER sends pickled objects that LMCache "
            f"servers 0.4.7-0.5.5 unpickle, over plaintext ZMQ with no authentication: "
            f"whoever can reach that port can run code in the server, and anyone on the path "
            f"can read or alter the KV data. Connect over loopback (tcp://127.0.0.1:PORT) or "
            f"ipc://, or pass allow_remote=True if the network between you is trusted.")
    return url


def _is_local(host: str) -> bool:
    """Loopback (or the unspecified address, which connects to this host), by address;
    ``localhost`` by name. Other names are not resolved here (a DNS lookup could block),
    so they count as remote."""
    import ipaddress

    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False
    return addr.is_loopback or addr.is_unspecified
