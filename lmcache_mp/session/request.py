"""Request: one prompt's lookups, stores and retrieves, with the bookkeeping done.

The server ties state to a request id: a LOOKUP read-locks every cached prefix chunk
(held until a RETRIEVE of that chunk, a FREE_LOOKUP_LOCKS, or a 300 s TTL), and a
session remembers the request's hashes until END_SESSION. A :class:`Request` counts
the locks it took and gave back, and on exit (even after an exception) frees what is
still held and ends the session, so callers never leak either.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from ..checks import positive_int
from ..errors import InvalidArgument, LMCacheMPError
from ..keys import CacheKey
from ..transport import ReplyFuture, blocking
from .binding import BindingState
from .blocks import BlockIds
from .connection import Connection

__all__ = ["Request", "RequestOwner"]

log = logging.getLogger("lmcache_mp")


class RequestOwner(Protocol):
    """What a request needs from its registration (see
    :mod:`lmcache_mp.session.registration`): what it is, and its transfers."""

    @property
    def model_name(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def chunk_size(self) -> int: ...

    worker_id: int

    def store_async(self, key: CacheKey, block_ids: BlockIds, *, timeout: float | None = None,
                    stream: Any = None) -> ReplyFuture[bool]: ...

    def retrieve_async(self, key: CacheKey, block_ids: BlockIds, *,
                       skip_first_n_tokens: int = 0, timeout: float | None = None,
                       stream: Any = None) -> ReplyFuture[bool]: ...


class Request:
    """A prompt bound to a registration (see :meth:`Registration.request`). A context
    manager; thread-safe. Token positions are absolute (0 is the first token), and
    ranges must be chunk-aligned: a chunk is :attr:`Registration.chunk_size` tokens."""

    def __init__(
        self,
        reg: RequestOwner,
        conn: Connection,
        binding: BindingState,
        token_ids: Sequence[int] | Any,
        *,
        request_id: str | None,
        cache_salt: str,
        tp_size: int,
        mla: bool,
    ) -> None:
        # The registration's transfers, its connection, its binding (read locks and the
        # session belong to the connection it is bound to), and whether its cache is a
        # pure-MLA one (every TP rank reads each chunk).
        self._reg = reg
        self._conn = conn
        self._binding = binding
        self._mla = mla
        rid = f"lmcache-mp-{uuid.uuid4().hex}" if request_id is None else request_id
        self._key = CacheKey(model_name=reg.model_name, world_size=reg.world_size,
                             worker_id=reg.worker_id, token_ids=token_ids, start=0, end=0,
                             request_id=rid, cache_salt=cache_salt)
        self._tp_size = positive_int("tp_size", tp_size)
        self._chunk = reg.chunk_size
        self._lock = threading.Lock()
        # Read locks this request holds on the server, per chunk, and the connection
        # they were taken on (a restarted server holds none).
        self._locks = [0] * (self._key.num_token_ids // self._chunk)
        self._lock_epoch = -1
        self._used = False
        self._closed = False
        #: Leading tokens the last lookup found cached (and read-locked).
        self.cached_tokens = 0

    @property
    def request_id(self) -> str:
        return self._key.request_id

    @property
    def num_tokens(self) -> int:
        return self._key.num_token_ids

    @property
    def held_locks(self) -> int:
        """Read locks (chunk x lookup) this request still holds on the server."""
        with self._lock:
            return sum(self._locks)

    def __repr__(self) -> str:
        return (f"<lmcache_mp.Request {self.request_id!r} {self.num_tokens} tokens "
                f"cached={self.cached_tokens} {'closed' if self._closed else 'open'}>")

    def __enter__(self) -> Request:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _range(self, start: int, end: int | None, default_end: int, op: str) -> CacheKey:
        if self._closed:
            raise InvalidArgument(f"{op}: request {self.request_id!r} is closed")
        self._used = True
        return self._key.with_range(start, default_end if end is None else end)

    # ------------------------------------------------------------ operations
    def lookup_async(self, *, timeout: float | None = None) -> ReplyFuture[int]:
        """How many leading tokens are cached for every rank (whole chunks); they stay
        read-locked for :meth:`retrieve` (this request frees those it does not retrieve
        when it closes)."""
        key = self._range(0, None, self.num_tokens, "LOOKUP")
        return self._conn.lookup_async(key, self._tp_size, timeout, self._took_locks,
                                       mla=self._mla)

    lookup = blocking(lookup_async)

    def _took_locks(self, hits: int) -> int:
        bound = self._binding.epoch
        epoch = -1 if bound is None else bound
        with self._lock:
            if epoch != self._lock_epoch:  # locks of an earlier server are gone
                self._locks = [0] * len(self._locks)
                self._lock_epoch = epoch
            for i in range(min(hits, len(self._locks))):
                self._locks[i] += 1
        self.cached_tokens = hits * self._chunk
        return self.cached_tokens

    def store_async(self, block_ids: BlockIds, *, start: int = 0, end: int | None = None,
                    timeout: float | None = None, stream: Any = None) -> ReplyFuture[bool]:
        """STORE tokens ``[start, end)`` (default: every whole chunk of the prompt) from
        ``block_ids``, one id per block of that range."""
        whole = self.num_tokens - self.num_tokens % self._chunk
        key = self._range(start, end, whole, "STORE")
        return self._reg.store_async(key, block_ids, timeout=timeout, stream=stream)

    store = blocking(store_async)

    def retrieve_async(self, block_ids: BlockIds, *, start: int = 0, end: int | None = None,
                       skip_first_n_tokens: int = 0, timeout: float | None = None,
                       stream: Any = None) -> ReplyFuture[bool]:
        """RETRIEVE tokens ``[start, end)`` (default: what the last :meth:`lookup`
        found) into ``block_ids``, one id per block of that range; releases the read
        locks of those chunks, whether it succeeds or not."""
        key = self._range(start, end, self.cached_tokens, "RETRIEVE")
        if key.end <= key.start:
            raise InvalidArgument(
                f"RETRIEVE: nothing to retrieve in [{key.start}, {key.end}): call lookup() "
                f"first (it found {self.cached_tokens} cached tokens)")
        future = self._reg.retrieve_async(key, block_ids, skip_first_n_tokens=skip_first_n_tokens,
                                          timeout=timeout, stream=stream)
        # The server releases the range's locks whatever the outcome (a missing chunk
        # releases the ones found), so count them as given back once it is sent.
        with self._lock:
            for i in range(key.start // self._chunk, key.end // self._chunk):
                if self._locks[i]:
                    self._locks[i] -= 1
        return future

    retrieve = blocking(retrieve_async)

    # --------------------------------------------------------------- closing
    def close(self, *, timeout: float | None = None) -> None:
        """Free the read locks still held, end the server session. Idempotent; errors
        are logged, not raised (the server's TTL frees what could not be freed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            locks, self._locks = self._locks, [0] * len(self._locks)
            lock_epoch = self._lock_epoch
        bound = self._binding.epoch
        if bound is None or not self._used:
            return  # unregistered: the server would not answer for this model any more
        conn = self._conn
        try:
            if bound == lock_epoch:
                for start, end in _held_runs(locks):
                    key = self._key.with_range(start * self._chunk, end * self._chunk)
                    conn.call("FREE_LOOKUP_LOCKS",
                              conn.profile.all_ranks_payloads(key, self._tp_size, self._mla),
                              timeout)
            conn.call("END_SESSION", {"request_id": self.request_id}, timeout)
        except LMCacheMPError as err:
            log.warning("lmcache_mp: closing request %r: %s", self.request_id, err)


def _held_runs(locks: list[int]) -> list[tuple[int, int]]:
    """Chunk ranges ``[start, end)`` to free, one FREE_LOOKUP_LOCKS per range per lock:
    e.g. counts [2, 2, 1, 0, 1] -> (0, 3), (4, 5), (0, 2)."""
    counts = list(locks)
    runs: list[tuple[int, int]] = []
    while any(counts):
        i = 0
        while i < len(counts):
            if counts[i] == 0:
                i += 1
                continue
            j = i
            while j < len(counts) and counts[j]:
                counts[j] -= 1
                j += 1
            runs.append((i, j))
            i = j
    return runs
