"""The two ways a registration moves blocks, each bound to the connection its
registration was checked on (see :mod:`lmcache_mp.session.registration`).

* LMCache-driven (``mode="lmcache"``): one STORE / RETRIEVE; the server copies between
  the mapped cache and its L1. Sent bound to a connection: if the socket reconnected
  before it went out, it is re-sent after the registration is renewed (the future's
  ``resubmit``), within the call's deadline.
* Engine-driven (``mode="engine"``): PREPARE_* (the server reserves or finds pool
  slots), this client's copy, COMMIT_*. A PREPARE that finds a new connection is
  prepared again after re-registering; the COMMIT must go to the server that prepared.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..errors import (
    ConnectionChanged,
    LMCacheMPError,
    ProtocolMismatch,
    RequestTimeout,
    ServerUnavailable,
)
from ..keys import CacheKey
from ..protocol import decode_reply
from ..protocol.operations import Operation
from ..protocol.types import PrepareRetrieveResponse, PrepareStoreResponse
from ..transport import PendingRequest, ReplyFuture
from .connection import Payloads
from .engine_driven import copy_from_slots, copy_into_slots

if TYPE_CHECKING:
    from .registration import Binding, Registration

__all__ = ["server_copy", "engine_store", "engine_retrieve", "remaining", "unsent", "within"]

log = logging.getLogger("lmcache_mp")


# ------------------------------------------------- LMCache-driven transfers
def server_copy(reg: Registration, op_name: str, key: CacheKey, groups: list[list[int]],
                extra: Payloads, deadline: float, stream: Any) -> ReplyFuture[bool]:
    """STORE / RETRIEVE: the server copies between the registered cache and its L1."""
    conn, cache = reg._conn, reg.cache
    worker = reg._worker(key)
    # The event orders the server's copy after the caller's stream (CUDA); the
    # token (the event) must live until the reply. A CPU server ignores it.
    event, token = cache.begin_transfer(stream)
    sent: list[tuple[Operation, float]] = []

    def submit() -> PendingRequest:
        b = reg._bound(deadline)
        wire = conn.profile_for(unsent(deadline, op_name)).transfer_key(key, worker)
        sent_at = time.monotonic()
        op, p = conn.submit(op_name, {"key": wire, "instance_id": reg.instance_id,
                                      "block_ids": groups, "event_ipc_handle": event, **extra},
                            unsent(deadline, op_name), epoch=b.epoch)
        sent.append((op, sent_at))
        return p

    def finish(frames: list[bytes]) -> bool:
        op, sent_at = sent[-1]
        server_event, ok = decode_reply(op, frames)
        reg._touch(sent_at)
        cache.end_transfer(server_event, stream, token)
        return bool(ok)

    return ReplyFuture(conn.transport, submit(), finish, resubmit=submit)


# ---------------------------------------------- engine-driven transfers
def _prepare(reg: Registration, op_name: str, key: CacheKey,
             deadline: float) -> tuple[Binding, Any, Operation, list[bytes]]:
    """PREPARE_* bound to the current connection, re-registering when it changed; the
    reply frames, not yet decoded (a reply that cannot be read must still be followed
    by the COMMIT that releases what the server took)."""
    conn = reg._conn
    while True:
        b = reg._bound(deadline)
        wire = conn.profile_for(unsent(deadline, op_name)).transfer_key(key, reg._worker(key))
        sent_at = time.monotonic()
        op, p = conn.submit(op_name, {"key": wire, "instance_id": reg.instance_id},
                            unsent(deadline, op_name), epoch=b.epoch)
        try:
            frames = conn.transport.wait(p)
        except ConnectionChanged:
            continue
        reg._touch(sent_at)
        return b, wire, op, frames


def engine_store(reg: Registration, key: CacheKey, groups: list[list[int]],
                 deadline: float, stream: Any = None) -> ReplyFuture[bool]:
    """PREPARE_STORE, copy the blocks into the reserved slots, COMMIT_STORE (chunks
    already cached get no slot: nothing to do for them)."""
    cache = reg.cache
    # A CpuKVCache, or a GPU cache (CUDA copies on ``stream``; enforced at registration).
    b, wire, op, frames = _prepare(reg, "PREPARE_STORE", key, deadline)
    commit = {"key": wire, "instance_id": reg.instance_id}
    try:
        prepared = decode_reply(op, frames)
        assert isinstance(prepared, PrepareStoreResponse) and b.pool is not None
        ctx = prepared.context
        if not ctx.slots and not ctx.chunk_indices:
            return ReplyFuture.completed(True)  # every chunk is cached already
        import numpy as np  # loaded on the first engine-driven copy, not at import

        copy_into_slots(cache, np.asarray(groups[0], dtype=np.int64), ctx.slots,
                        ctx.chunk_indices, b.pool, reg.chunk_size, reg._owner.pools.workers,
                        stream)
    except BaseException as exc:
        # The server holds a write reservation until COMMIT_STORE (else until its write
        # TTL, 600 s, or the unregister; either way it then publishes the slots as they
        # are, exactly as this COMMIT does): release it now, then say what happened.
        _release(reg, "COMMIT_STORE", commit, b, deadline)
        if isinstance(exc, ProtocolMismatch):
            raise ProtocolMismatch(
                f"{exc}. Nothing was copied; the COMMIT_STORE that releases the server's "
                f"reservation was sent, and LMCache publishes reserved slots as written "
                f"whatever they hold, so chunks of this key on the server may hold "
                f"unwritten data: clear() its cache if that matters") from None
        raise
    return _commit(reg, "COMMIT_STORE", commit, b, deadline, bool)


def engine_retrieve(reg: Registration, key: CacheKey, groups: list[list[int]], skip: int,
                    deadline: float, stream: Any = None) -> ReplyFuture[bool]:
    """PREPARE_RETRIEVE, copy the slots into the blocks, COMMIT_RETRIEVE (which releases
    the LOOKUP's read locks, also when the reply was unreadable or the copy failed)."""
    cache = reg.cache
    b, wire, op, frames = _prepare(reg, "PREPARE_RETRIEVE", key, deadline)
    commit = {"key": wire, "instance_id": reg.instance_id}
    try:
        prepared = decode_reply(op, frames)
        assert isinstance(prepared, PrepareRetrieveResponse) and b.pool is not None
        if not prepared.success:
            return ReplyFuture.completed(False)  # the server released what it found
        import numpy as np

        copy_from_slots(cache, np.asarray(groups[0], dtype=np.int64),
                        prepared.context.slots, b.pool, reg.chunk_size, skip,
                        reg._owner.pools.workers, stream)
    except BaseException as exc:
        _release(reg, "COMMIT_RETRIEVE", commit, b, deadline)
        if isinstance(exc, ProtocolMismatch):
            raise ProtocolMismatch(
                f"{exc}. No block was written; the COMMIT_RETRIEVE that releases the "
                f"server's read locks was sent") from None
        raise
    return _commit(reg, "COMMIT_RETRIEVE", commit, b, deadline, _true)


def _commit(reg: Registration, op_name: str, payloads: Payloads, b: Binding,
            deadline: float, convert: Callable[[Any], bool]) -> ReplyFuture[bool]:
    conn = reg._conn
    sent_at = time.monotonic()
    op, p = conn.submit(op_name, payloads, remaining(deadline, op_name), epoch=b.epoch)

    def finish(frames: list[bytes]) -> bool:
        value = convert(decode_reply(op, frames))
        reg._touch(sent_at)
        return value

    return ReplyFuture(conn.transport, p, finish)


def _release(reg: Registration, op_name: str, payloads: Payloads, b: Binding,
             deadline: float) -> None:
    """Send the COMMIT that frees what a PREPARE took on the server, even when the
    call's deadline has passed (the server needs it either way); wait for its reply
    only within the deadline. Failures are logged: the caller raises its own error."""
    conn = reg._conn
    try:
        _, p = conn.submit(op_name, payloads, max(deadline - time.monotonic(), 1.0),
                           epoch=b.epoch)
        conn.transport.wait_for(p, max(deadline - time.monotonic(), 0.0))
        if not p.done:
            conn.transport.cancel(p)  # sent; its reply is not needed
        elif p.error is not None:
            raise p.error
    except LMCacheMPError as err:
        log.warning("lmcache_mp: %s after a failed transfer was not confirmed: %s", op_name, err)


def _true(_: Any) -> bool:
    return True


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
