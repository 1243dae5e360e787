"""The control-plane calls of :class:`~lmcache_mp.Client`: liveness, server facts,
lookups and sessions. Each ``x()`` is the blocking twin of ``x_async()``."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ..checks import non_negative_int, non_negative_seconds, positive_seconds
from ..errors import InvalidArgument
from ..keys import CacheKey
from ..protocol.types import BlockAllocationRecord
from ..transport import ReplyFuture, blocking
from .connection import NO_PAYLOADS, Connection, Payloads

__all__ = ["ControlPlane"]


class ControlPlane:
    """Mixed into :class:`~lmcache_mp.Client`; needs its connection."""

    _conn: Connection

    def noop(self, *, timeout: float | None = None) -> str:
        """NOOP, answered on the server's message thread ("OK")."""
        # Written out (not via noop_async) to keep the latency floor: no future.
        return str(self._conn.call("NOOP", NO_PAYLOADS, timeout))

    def noop_async(self, *, timeout: float | None = None) -> ReplyFuture[str]:
        return self._conn.request("NOOP", NO_PAYLOADS, timeout, str)

    def ping_async(self, instance_id: int | None = None, *,
                   timeout: float | None = None) -> ReplyFuture[bool]:
        """PING; with ``instance_id`` it also marks that worker alive (ping-proven)."""
        return self._conn.request("PING", {"instance_id": instance_id}, timeout, bool)

    ping = blocking(ping_async)

    def chunk_size(self, *, timeout: float | None = None) -> int:
        """The server's chunk size in tokens (asked once per connection)."""
        return self._conn.chunk_size(timeout)

    def clear_async(self, *, force: bool = True, timeout: float | None = None) -> ReplyFuture[None]:
        """CLEAR: drop cached objects on the server. Servers up to 0.5.5 always force
        (``force`` is not sent); 0.5.6 takes it as its payload."""
        payloads = self._conn.profile_for(self._conn.seconds(timeout)).clear_payloads(force)
        return self._conn.request("CLEAR", payloads, timeout)

    clear = blocking(clear_async)

    def get_experimental_async(self, *, timeout: float | None = None) -> ReplyFuture[list[str]]:
        """The experimental transfer features the server was started with."""
        return self._conn.request("GET_EXPERIMENTAL", NO_PAYLOADS, timeout, list)

    get_experimental = blocking(get_experimental_async)

    # ------------------------------------------------------------------ lookup
    def submit_lookup_async(self, key: CacheKey, tp_size: int = 1, *,
                            timeout: float | None = None,
                            mla: bool = False) -> ReplyFuture[None]:
        """Send LOOKUP for the whole of ``key.token_ids`` (all ranks) and wait for its
        acknowledgement. The server read-locks every prefix chunk it finds and records a
        job under ``key.request_id``; collect the count with :meth:`query_prefetch_status`
        or :meth:`wait_prefetch_status`. Locks stay until a RETRIEVE or
        :meth:`free_lookup_locks` releases them (or a 300 s TTL). ``tp_size`` adds
        readers for MLA; send the same value to free_lookup_locks (``mla``: a pure-MLA
        cache, every one of the ``tp_size`` ranks reads each chunk, see ``kv_readers``)."""
        return self._conn.request("LOOKUP", self._all_ranks(key, tp_size, timeout, mla),
                                  timeout)

    submit_lookup = blocking(submit_lookup_async)

    def query_prefetch_status_async(self, request_id: str, *,
                                    timeout: float | None = None) -> ReplyFuture[int | None]:
        """Hit chunks of the lookup job, None while it runs; consumes the job (then 0)."""
        return self._conn.request("QUERY_PREFETCH_STATUS", {"request_id": request_id}, timeout)

    query_prefetch_status = blocking(query_prefetch_status_async)

    def wait_prefetch_status_async(self, request_id: str, timeout: float, *,
                                   rpc_timeout: float | None = None) -> ReplyFuture[int | None]:
        """Wait up to ``timeout`` s on the server for the lookup job; None if unfinished.
        The call's own deadline is ``timeout`` plus ``rpc_timeout`` (default: the client's
        timeout), so a dead server still surfaces as an error."""
        wait_s = positive_seconds("timeout", timeout)
        deadline = wait_s + self._conn.seconds(rpc_timeout)
        return self._conn.request("WAIT_PREFETCH_STATUS",
                                  {"request_id": request_id, "timeout": wait_s}, deadline)

    wait_prefetch_status = blocking(wait_prefetch_status_async)

    def query_prefetch_lookup_hits_async(self, request_id: str, *,
                                         timeout: float | None = None) -> ReplyFuture[int | None]:
        """Hit chunks found so far, without consuming the job (0.5.3-0.5.5 only)."""
        return self._conn.request("QUERY_PREFETCH_LOOKUP_HITS", {"request_id": request_id},
                                  timeout)

    query_prefetch_lookup_hits = blocking(query_prefetch_lookup_hits_async)

    def lookup_async(self, key: CacheKey, tp_size: int = 1, *,
                     timeout: float | None = None) -> ReplyFuture[int]:
        """LOOKUP then wait for the result: the number of leading chunks cached for
        every rank (tokens = chunks x :meth:`chunk_size`). The hit chunks stay
        read-locked for a RETRIEVE; release the ones you will not retrieve with
        :meth:`free_lookup_locks`."""
        return self._conn.lookup_async(key, tp_size, timeout)

    lookup = blocking(lookup_async)

    def free_lookup_locks_async(self, key: CacheKey, tp_size: int = 1, *,
                                timeout: float | None = None,
                                mla: bool = False) -> ReplyFuture[None]:
        """Release the read locks a LOOKUP took on chunks in ``[key.start, key.end)``
        that will not be retrieved (all ranks). Use the LOOKUP's ``tp_size`` and ``mla``."""
        return self._conn.request("FREE_LOOKUP_LOCKS",
                                  self._all_ranks(key, tp_size, timeout, mla), timeout)

    free_lookup_locks = blocking(free_lookup_locks_async)

    def end_session_async(self, request_id: str, *,
                          timeout: float | None = None) -> ReplyFuture[None]:
        """Drop the server's session (cached chunk hashes) for ``request_id``. End every
        request id before reusing it for other tokens, and before the last unregister of
        its model (the server does not answer it after that)."""
        return self._conn.request("END_SESSION", {"request_id": request_id}, timeout)

    end_session = blocking(end_session_async)

    def report_block_allocation_async(
        self, instance_id: int, model_name: str,
        records: Iterable[BlockAllocationRecord | Mapping[str, Any]], *,
        timeout: float | None = None,
    ) -> ReplyFuture[None]:
        """Report per-request block allocation deltas (vLLM's observability feed).
        ``records``: :class:`BlockAllocationRecord` or mappings with its fields."""
        if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
            raise InvalidArgument(
                f"records must be a list of BlockAllocationRecord (or mappings with req_id, "
                f"new_block_ids, new_token_ids), got {type(records).__name__}")
        recs = [_record(r) for r in records]
        return self._conn.request(
            "REPORT_BLOCK_ALLOCATION",
            {"instance_id": instance_id, "model_name": model_name, "records": recs}, timeout)

    report_block_allocation = blocking(report_block_allocation_async)

    def wait_for_lookup(self, key: CacheKey, min_chunks: int | None = None, *,
                        timeout: float | None = None, poll_interval: float = 0.02,
                        tp_size: int = 1) -> int:
        """LOOKUP until at least ``min_chunks`` (default: all complete chunks of the
        key's tokens) are cached, or ``timeout`` passes; returns the last hit count.

        A STORE's reply comes before its chunks are visible (the server commits them
        asynchronously), so "store, then look up at once" can miss. Partial hits of
        the retries are released; the final lookup's locks are held for a RETRIEVE.
        """
        if not isinstance(key, CacheKey):
            raise InvalidArgument(f"expected a lmcache_mp.CacheKey, got {type(key).__name__}")
        if min_chunks is not None:
            non_negative_int("min_chunks", min_chunks)
        poll_s = non_negative_seconds("poll_interval", poll_interval)
        budget = self._conn.seconds(timeout)
        self._all_ranks(key, tp_size, timeout)  # checks tp_size before anything is sent
        chunk = self.chunk_size()
        want = key.num_token_ids // chunk if min_chunks is None else min_chunks
        deadline = time.monotonic() + budget
        while True:
            remaining = deadline - time.monotonic()
            hits = self.lookup(key, tp_size, timeout=max(remaining, 0.05))
            if hits >= want or time.monotonic() + poll_s >= deadline:
                return hits
            if hits:
                self.free_lookup_locks(key.with_range(0, hits * chunk), tp_size)
            time.sleep(poll_s)

    def _all_ranks(self, key: CacheKey, tp_size: int, timeout: float | None,
                   mla: bool = False) -> Payloads:
        if not isinstance(key, CacheKey):
            raise InvalidArgument(f"expected a lmcache_mp.CacheKey, got {type(key).__name__}")
        return self._conn.profile_for(self._conn.seconds(timeout)).all_ranks_payloads(
            key, tp_size, bool(mla))


def _record(r: Any) -> BlockAllocationRecord:
    if isinstance(r, BlockAllocationRecord):
        # A Struct's constructor checks no types, and the codec passes a Struct of the
        # payload's own type through: check its fields here.
        r = {f: getattr(r, f) for f in r.__struct_fields__}
    elif not isinstance(r, Mapping):
        raise InvalidArgument(f"a block allocation record must be a BlockAllocationRecord or a "
                              f"mapping, got {r!r}")
    try:
        return msgspec.convert(dict(r), BlockAllocationRecord, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(
            f"invalid block allocation record {r!r}: {exc} (fields: req_id str, "
            f"new_block_ids and new_token_ids lists of ints)") from None
