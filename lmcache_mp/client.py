"""The public client: the protocol profile and the transport composed into typed calls."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from .errors import InvalidArgument, RequestTimeout
from .futures import ReplyFuture
from .keys import CacheKey
from .protocol import Profile, decode_reply, encode_request, get_profile
from .protocol.operations import Operation
from .protocol.types import BlockAllocationRecord
from .transport import PendingRequest, Transport

__all__ = ["Client", "DEFAULT_TIMEOUT"]

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0


def _check_timeout(timeout: float, what: str = "timeout") -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgument(f"{what} must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class Client:
    """A client of one LMCache MP server.

    Every call has a deadline (``timeout`` seconds, overridable per call) and raises
    :class:`~lmcache_mp.errors.RequestTimeout` or
    :class:`~lmcache_mp.errors.ServerUnavailable` instead of hanging. Thread-safe: any
    number of threads may call concurrently; replies are matched by uid. Each blocking
    call ``x()`` has a non-blocking ``x_async()`` returning a :class:`ReplyFuture`.

    Args:
        url: the server's ZMQ endpoint, e.g. ``"tcp://127.0.0.1:5555"``.
        timeout: default deadline of each call, in seconds.
        protocol: the server's wire family (``"0.5.3"`` covers 0.5.3 and 0.5.4).
    """

    def __init__(
        self, url: str, *, timeout: float = DEFAULT_TIMEOUT, protocol: str = "0.5.3"
    ) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise InvalidArgument(f"url must look like tcp://host:port, got {url!r}")
        self.url = url
        self.timeout = _check_timeout(timeout)
        self._profile: Profile = get_profile(protocol)
        self._transport = Transport(url)
        self._chunk_size: int | None = None

    # ---------------------------------------------------------------- plumbing
    @property
    def server_protocol(self) -> str:
        """The protocol family this client speaks to the server."""
        return self._profile.name

    @property
    def profile(self) -> Profile:
        return self._profile

    def _submit(
        self, op_name: str, payloads: Sequence[Any], timeout: float | None
    ) -> tuple[Operation, PendingRequest]:
        op = self._profile.op(op_name)
        frames = encode_request(op, payloads)
        t = self.timeout if timeout is None else _check_timeout(timeout)
        return op, self._transport.submit(frames, t, op_name)

    def _request(
        self, op_name: str, payloads: Sequence[Any], timeout: float | None
    ) -> ReplyFuture[Any]:
        """The non-blocking form: a future that decodes the reply when asked."""
        op, pending = self._submit(op_name, payloads, timeout)
        return ReplyFuture(self._transport, pending, partial(decode_reply, op))

    def _call(self, op_name: str, payloads: Sequence[Any], timeout: float | None) -> Any:
        """The blocking form, without a future on the hot path."""
        op, pending = self._submit(op_name, payloads, timeout)
        return decode_reply(op, self._transport.wait(pending))

    def _op(self, name: str) -> Operation:
        return self._profile.op(name)

    def close(self) -> None:
        """Fail pending calls with ClientClosed and release the socket. Idempotent."""
        self._transport.close()

    @property
    def closed(self) -> bool:
        return self._transport.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<lmcache_mp.Client {self.url} protocol={self._profile.name} {state}>"

    # ------------------------------------------------------------ control plane
    def ping_async(
        self, instance_id: int | None = None, *, timeout: float | None = None
    ) -> ReplyFuture[bool]:
        return self._request("PING", (instance_id,), timeout)

    def ping(self, instance_id: int | None = None, *, timeout: float | None = None) -> bool:
        """PING; with ``instance_id`` it also marks that worker alive (ping-proven)."""
        return bool(self._call("PING", (instance_id,), timeout))

    def noop_async(self, *, timeout: float | None = None) -> ReplyFuture[str]:
        return self._request("NOOP", (), timeout)

    def noop(self, *, timeout: float | None = None) -> str:
        """NOOP, answered on the server's message thread ("OK")."""
        return str(self._call("NOOP", (), timeout))

    def chunk_size(self, *, timeout: float | None = None) -> int:
        """The server's chunk size in tokens (asked once per client, then remembered)."""
        if self._chunk_size is None:
            value = self._call("GET_CHUNK_SIZE", (), timeout)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"server reported an invalid chunk size {value!r}")
            self._chunk_size = value
        return self._chunk_size

    def clear(self, *, timeout: float | None = None) -> None:
        """CLEAR: drop every cached object on the server (forced)."""
        self._call("CLEAR", (), timeout)

    def get_experimental(self, *, timeout: float | None = None) -> list[str]:
        """The experimental transfer features the server was started with."""
        return list(self._call("GET_EXPERIMENTAL", (), timeout))

    # ------------------------------------------------------------------ lookup
    def submit_lookup_async(
        self, key: CacheKey, tp_size: int = 1, *, timeout: float | None = None
    ) -> ReplyFuture[None]:
        wire = self._profile.build_key(_key(key), None)
        return self._request("LOOKUP", (wire, tp_size), timeout)

    def submit_lookup(self, key: CacheKey, tp_size: int = 1, *, timeout: float | None = None) -> None:
        """Send LOOKUP for the whole of ``key.token_ids`` and wait for its acknowledgement.

        The server read-locks every prefix chunk it finds, for all ranks, and records a
        job under ``key.request_id``; collect the count with
        :meth:`query_prefetch_status` or :meth:`wait_prefetch_status`. Locks stay until
        a RETRIEVE or :meth:`free_lookup_locks` releases them (or a 300 s TTL).
        ``tp_size`` adds readers for MLA; send the same value to free_lookup_locks.
        """
        wire = self._profile.build_key(_key(key), None)
        self._call("LOOKUP", (wire, tp_size), timeout)

    def query_prefetch_status_async(
        self, request_id: str, *, timeout: float | None = None
    ) -> ReplyFuture[int | None]:
        return self._request("QUERY_PREFETCH_STATUS", (request_id,), timeout)

    def query_prefetch_status(self, request_id: str, *, timeout: float | None = None) -> int | None:
        """Hit chunks of the lookup job, None while it runs; consumes the job (then 0)."""
        return self._call("QUERY_PREFETCH_STATUS", (request_id,), timeout)  # type: ignore[no-any-return]

    def wait_prefetch_status(
        self, request_id: str, timeout: float, *, rpc_timeout: float | None = None
    ) -> int | None:
        """Wait up to ``timeout`` s on the server for the lookup job; None if unfinished.

        The call's own deadline is ``timeout`` plus ``rpc_timeout`` (default: the
        client's timeout), so a dead server still surfaces as an error.
        """
        wait_s = _check_timeout(timeout)
        deadline = wait_s + (self.timeout if rpc_timeout is None else _check_timeout(rpc_timeout))
        return self._call("WAIT_PREFETCH_STATUS", (request_id, wait_s), deadline)  # type: ignore[no-any-return]

    def query_prefetch_lookup_hits(
        self, request_id: str, *, timeout: float | None = None
    ) -> int | None:
        """Hit chunks found so far, without consuming the job (0.5.3-0.5.5 only)."""
        return self._call("QUERY_PREFETCH_LOOKUP_HITS", (request_id,), timeout)  # type: ignore[no-any-return]

    def lookup(self, key: CacheKey, tp_size: int = 1, *, timeout: float | None = None) -> int:
        """LOOKUP then wait for the result: the number of leading chunks cached for
        every rank (tokens = chunks x :meth:`chunk_size`). The hit chunks stay
        read-locked for a RETRIEVE; release the ones you will not retrieve with
        :meth:`free_lookup_locks`."""
        budget = self.timeout if timeout is None else _check_timeout(timeout)
        start = time.monotonic()
        self.submit_lookup(key, tp_size, timeout=budget)
        remaining = max(budget - (time.monotonic() - start), 0.001)
        # Let the server wait for most of the remaining budget and keep a margin for
        # the reply itself; the call as a whole stays within ``budget``.
        hits = self.wait_prefetch_status(
            key.request_id, remaining * 0.8, rpc_timeout=max(remaining * 0.2, 0.001)
        )
        if hits is None:
            raise RequestTimeout(
                f"the lookup for request {key.request_id!r} did not finish within {budget:g} s "
                f"(a slow L2 backend?); its hit chunks stay locked: collect the result later "
                f"with query_prefetch_status() or release them with free_lookup_locks()"
            )
        return int(hits)

    def free_lookup_locks_async(
        self, key: CacheKey, tp_size: int = 1, *, timeout: float | None = None
    ) -> ReplyFuture[None]:
        wire = self._profile.build_key(_key(key), None)
        return self._request("FREE_LOOKUP_LOCKS", (wire, tp_size), timeout)

    def free_lookup_locks(
        self, key: CacheKey, tp_size: int = 1, *, timeout: float | None = None
    ) -> None:
        """Release the read locks a LOOKUP took on chunks in ``[key.start, key.end)``
        that will not be retrieved (all ranks). Use the LOOKUP's ``tp_size``."""
        wire = self._profile.build_key(_key(key), None)
        self._call("FREE_LOOKUP_LOCKS", (wire, tp_size), timeout)

    def end_session_async(
        self, request_id: str, *, timeout: float | None = None
    ) -> ReplyFuture[None]:
        return self._request("END_SESSION", (request_id,), timeout)

    def end_session(self, request_id: str, *, timeout: float | None = None) -> None:
        """Drop the server's session (cached chunk hashes) for ``request_id``.

        End every request id before reusing it for other tokens, and before the last
        unregister of its model (the server does not answer it after that).
        """
        self._call("END_SESSION", (request_id,), timeout)

    # ----------------------------------------------------------- observability
    def report_block_allocation(
        self,
        instance_id: int,
        model_name: str,
        records: Iterable[BlockAllocationRecord | Mapping[str, Any]],
        *,
        timeout: float | None = None,
    ) -> None:
        """Report per-request block allocation deltas (vLLM's observability feed)."""
        recs = [
            r if isinstance(r, BlockAllocationRecord) else BlockAllocationRecord(**r)
            for r in records
        ]
        self._call("REPORT_BLOCK_ALLOCATION", (instance_id, model_name, recs), timeout)


def _key(key: CacheKey) -> CacheKey:
    if not isinstance(key, CacheKey):
        raise InvalidArgument(f"expected a lmcache_mp.CacheKey, got {type(key).__name__}")
    return key
