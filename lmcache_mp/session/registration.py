"""Registration: one KV cache registered with the server, and kept registered.

A :class:`Registration` carries everything a registration knows (instance id, model,
world size, rank, chunk size, transfer mode, the server's pool), so that transfers need
only a key and block ids, and one ``store`` / ``retrieve`` works in either mode.

Keeping it registered. The server forgets a registration when it restarts, and
reaps one that stays silent too long. Either way it then drops every STORE /
RETRIEVE without a reply. So before each transfer the registration checks that it
is *bound*: made on the current connection (a reconnect may reach a restarted
server), not after a failed heartbeat, and refreshed (a PING, a transfer or a
register) within the server's shortest reap budget. If not, it registers again first
(the server treats a repeated REGISTER of a live instance as a refresh), holding the
transfer within its deadline. Transfers are sent bound to the connection they were
checked on, so one that would reach a new server unregistered is held back and sent
again after re-registering (see :meth:`Transport.submit`). Where the binding stands is
one state machine, :mod:`lmcache_mp.session.binding`.

The two ways a registration moves blocks:

* LMCache-driven (``mode="lmcache"``): one STORE / RETRIEVE; the server copies between
  the mapped cache and its L1. If the socket reconnected before it went out, it is sent
  again after the registration is renewed, within the call's deadline.
* Engine-driven (``mode="engine"``): PREPARE_* (the server reserves or finds pool
  slots), this client's copy, COMMIT_*. A PREPARE that finds a new connection is
  prepared again after re-registering; the COMMIT must go to the server that prepared.
  A retrieve is done when its blocks are written: it does not wait for its
  COMMIT_RETRIEVE's reply (:mod:`lmcache_mp.session.commits`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from ..checks import is_int
from ..errors import ConnectionChanged, InvalidArgument, LMCacheMPError, ProtocolMismatch
from ..ipc.base import ExportableKVCache
from ..ipc.cpu_cache import CpuKVCache
from ..keys import CacheKey
from ..protocol import decode_reply
from ..protocol.operations import Operation
from ..protocol.types import (
    EngineGroupInfo,
    PrepareRetrieveResponse,
    PrepareStoreResponse,
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
)
from ..transport import PendingRequest, ReplyFuture, Transport, blocking
from .binding import Binding, BindingEvent, BindingState
from .blocks import BlockIds, TransferLayout, normalize_block_ids
from .commits import UnconfirmedCommits
from .connection import NO_PAYLOADS, Connection, Payloads
from .deadlines import remaining, unsent, within
from .engine_driven import NO_POOL_HELP, PoolMaps, bound_to, copy_from_slots, copy_into_slots
from .request import Request

__all__ = ["Registration", "Mode", "Binding"]

log = logging.getLogger("lmcache_mp")

#: How long an unregister waits for the replies of COMMITs sent after their retrieve
#: returned (lmcache_mp.session.commits): a live server answers in milliseconds.
COMMITS_SETTLE_S = 1.0

#: ``"lmcache"``: the server maps the cache and copies blocks itself; ``"engine"``: this
#: client copies blocks through the server's shared-memory pool (CPU caches).
Mode = Literal["lmcache", "engine"]

#: Releases whose CPU servers ignore the ``kv_layout`` hint and read 5-D layers as HND
#: (lmcache/v1/gpu_connector/kv_format/detectors/vllm.py forces it when the torch
#: device is the CPU; 0.5.5 honours the hint).
HND_ONLY_RELEASES = frozenset({"0.5.3", "0.5.4"})


class RegistrationOwner(Protocol):
    """What a registration needs from its client (see :mod:`lmcache_mp.session.registry`)."""

    conn: Connection
    pools: PoolMaps
    stale_after: float

    def discard(self, reg: Registration) -> None: ...
    def recovered(self, reg: Registration) -> None: ...


class Registration:
    """One registered KV cache; made by :meth:`Client.register`. A context manager that
    unregisters on exit. Thread-safe."""

    def __init__(
        self,
        owner: RegistrationOwner,
        cache: ExportableKVCache,
        mode: Mode,
        layout: TransferLayout,
        worker_id: int,
    ) -> None:
        self._owner = owner
        self._conn = owner.conn
        self.cache = cache
        self.mode: Mode = mode
        self.layout = layout
        self.worker_id = worker_id
        # Its binding to the server (see lmcache_mp.session.binding): every move of
        # it goes through the state's transitions table.
        self._state = BindingState(owner.stale_after)
        self._recover_lock = threading.Lock()
        self._requests: weakref.WeakSet[Request] = weakref.WeakSet()
        # COMMIT_RETRIEVEs of engine-driven retrieves that returned before the reply
        # (lmcache_mp.session.commits says why that is safe).
        self._commits = UnconfirmedCommits()
        #: How many times this registration was re-sent on its own (restart, reap).
        self.recoveries = 0

    # ------------------------------------------------------------ what it is
    @property
    def instance_id(self) -> int:
        return self.layout.instance_id

    @property
    def model_name(self) -> str:
        return self.layout.model_name

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def chunk_size(self) -> int:
        return self.layout.chunk_size

    @property
    def _mla(self) -> bool:
        # A pure-MLA cache: its KV is replicated over TP ranks, so lookups declare every
        # TP rank a reader (0.5.5+ keys), as LMCache's adapter does.
        return bool(self.cache.geometry.mla)

    @property
    def groups(self) -> tuple[EngineGroupInfo, ...]:
        return self.layout.groups

    @property
    def registered(self) -> bool:
        return self._state.binding is not None

    @property
    def pool_info(self) -> RegisterEngineDrivenContextResponse | None:
        """Where the server's L1 pool is (engine-driven mode), as it last answered."""
        b = self._state.binding
        return None if b is None else b.pool_info

    def __repr__(self) -> str:
        state = "registered" if self.registered else "unregistered"
        return (f"<lmcache_mp.Registration instance={self.instance_id} {self.mode} "
                f"model={self.model_name!r} world_size={self.world_size} {state}>")

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self.registered:
            return
        try:
            self.unregister()
        except LMCacheMPError as err:
            if exc_type is None:
                raise
            log.warning("lmcache_mp: unregistering instance %d on error exit failed: %s",
                        self.instance_id, err)

    # -------------------------------------------------------- (re)registering
    def _register_on_server(self, deadline: float) -> Binding:
        """Send this registration's REGISTER and return what it established."""
        conn, cache = self._conn, self.cache
        if cache.closed or cache.unlinked:
            raise InvalidArgument(
                "this KV cache was closed or unlinked (its shared-memory names are gone), so "
                "the server cannot map it again; allocate a new cache and register that")
        if self.mode == "lmcache":
            profile = conn.profile_for(unsent(deadline, "REGISTER"))
            if (isinstance(cache, CpuKVCache) and cache.kv_layout == "NHD"
                    and HND_ONLY_RELEASES & set(profile.releases)):
                raise InvalidArgument(
                    f"LMCache {'/'.join(profile.releases)} CPU servers read 5-D layers as HND "
                    f"whatever layout is declared, so they would copy this NHD cache's blocks "
                    f"scrambled: register it with mode='engine' (this client copies either "
                    f"layout), allocate it with layout='HND', or use LMCache 0.5.5+")
            payloads = profile.register_payloads(
                instance_id=self.instance_id, exports=cache.export_layers(),
                model_name=self.model_name, world_size=self.world_size,
                kv_layout=cache.kv_layout, groups=self.groups)
            op, p = conn.submit("REGISTER_KV_CACHE", payloads, unsent(deadline, "REGISTER"))
            decode_reply(op, conn.transport.wait(p))
            return Binding(p.sent_epoch)
        op, p = conn.submit("REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT",
                            {"payload": self._engine_payload()}, unsent(deadline, "REGISTER"))
        info: RegisterEngineDrivenContextResponse = decode_reply(op, conn.transport.wait(p))
        return self._bind_pool(info, p.sent_epoch, deadline)

    def establish(self, deadline: float, *, fall_back: bool = False,
                  engine_only: bool = False) -> None:
        """The first REGISTER (:meth:`Client.register` sends it; a Registration is
        handed out established). With ``fall_back`` (mode "auto": an engine-driven
        try), a server without the engine-driven handler or without a pool gets a
        server-copy registration instead, and :attr:`mode` says so; ``engine_only``:
        see :meth:`_establish_engine_only`."""
        if engine_only:
            self._establish_engine_only(deadline)
            return
        sent_at = time.monotonic()
        binding = self._try_engine_driven(deadline) if fall_back else None
        if binding is None:
            if fall_back:
                self.mode = "lmcache"
            sent_at = time.monotonic()
            binding = self._register_on_server(deadline)
        self._state.registered(binding, sent_at)

    def _establish_engine_only(self, deadline: float) -> None:
        """The first REGISTER of a cache that only engine-driven transfers can move (a GPU
        cache CUDA IPC cannot export): a server without the handler or a pool is told
        at once, not waited out."""
        sent_at = time.monotonic()
        binding = self._try_engine_driven(deadline)
        if binding is None:
            raise ProtocolMismatch(
                "CUDA IPC cannot share this GPU cache's memory, so only engine-driven "
                "transfers can move it, and the server offers no engine-driven handler or "
                "no shared-memory L1 pool: start it with --supported-transfer-mode auto "
                "--shm-name NAME (the name is needed from 0.5.4) --no-l1-use-lazy")
        self._state.registered(binding, sent_at)

    def _try_engine_driven(self, deadline: float) -> Binding | None:
        conn = self._conn
        transport = conn.transport
        op, p = conn.submit("REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT",
                            {"payload": self._engine_payload()}, remaining(deadline, "REGISTER"))
        # Both run on the server's message thread in arrival order, so once the NOOP
        # is answered a missing REGISTER reply means "no handler" (a server started
        # with --supported-transfer-mode lmcache_driven), not "slow".
        _, fence = conn.submit("NOOP", NO_PAYLOADS, remaining(deadline, "REGISTER"))
        try:
            transport.wait(fence)
        except LMCacheMPError:
            transport.cancel(p)
            raise
        if not transport.poll(p):
            transport.cancel(p)
            return None
        info: RegisterEngineDrivenContextResponse = decode_reply(op, transport.wait(p))
        if not info.shm_name or info.pool_size <= 0:
            conn.call("UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT",
                      {"instance_id": self.instance_id}, remaining(deadline, "UNREGISTER"))
            return None
        pool = self._owner.pools.acquire(info.shm_name, info.pool_size, p.sent_epoch)
        return Binding(p.sent_epoch, bound_to(self.cache, pool), info)

    def _engine_payload(self) -> RegisterEngineDrivenContextPayload:
        g = self.cache.geometry
        return RegisterEngineDrivenContextPayload(
            instance_id=self.instance_id, model_name=self.model_name,
            world_size=self.world_size, block_size=g.block_size, num_layers=g.num_layers,
            hidden_dim_size=g.hidden_dim, dtype_str=g.dtype,
            # "MLA" on the wire means one object plane: fused K/V rows too (as LMCache's
            # connector registers them: use_mla = kv_size == 1).
            use_mla=g.kv_planes == 1)

    def _bind_pool(self, info: RegisterEngineDrivenContextResponse, epoch: int,
                   deadline: float) -> Binding:
        if not info.shm_name or info.pool_size <= 0:
            self._conn.call("UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT",
                            {"instance_id": self.instance_id}, remaining(deadline, "UNREGISTER"))
            raise ProtocolMismatch(NO_POOL_HELP)
        pool = self._owner.pools.acquire(info.shm_name, info.pool_size, epoch)
        return Binding(epoch, bound_to(self.cache, pool), info)

    def _bound(self, deadline: float) -> Binding:
        """The current binding, registering again first unless it is fresh."""
        state = self._state
        b = state.binding
        if state.fresh(self._conn.transport.refresh()):
            assert b is not None
            return b
        if b is None:
            raise InvalidArgument(
                f"instance {self.instance_id} is unregistered; register the cache again")
        return self._recover(deadline, b)

    def _recover(self, deadline: float, seen: Binding) -> Binding:
        """Register again (unless another thread did meanwhile): a renewal if the binding
        was only silent too long, a re-registration if the server may have lost it."""
        state = self._state
        with within(self._recover_lock, deadline, f"re-registering instance {self.instance_id}"):
            b = state.binding
            if b is None:
                raise InvalidArgument(
                    f"instance {self.instance_id} was unregistered while a transfer waited")
            if b is not seen:
                return b  # another thread re-registered meanwhile
            restarted = state.begin_again(self._conn.transport.epoch)
            try:
                chunk = self._conn.chunk_size(unsent(deadline, "GET_CHUNK_SIZE"))
                if chunk != self.chunk_size:
                    raise ProtocolMismatch(
                        f"the server now uses chunk size {chunk}, but instance "
                        f"{self.instance_id} was registered with {self.chunk_size}: register "
                        f"the cache again")
                sent_at = time.monotonic()
                new = self._register_on_server(deadline)
            except BaseException:
                state.fire(BindingEvent.RE_REGISTER_FAILED)
                raise
            old = state.registered_again(new, sent_at)
            if old is not None:
                self._owner.pools.release(old.pool)
            self.recoveries += 1
        log.info("lmcache_mp: re-registered instance %d (%s)", self.instance_id,
                 "new connection or failed heartbeat" if restarted else "silent too long")
        if restarted:
            self._owner.recovered(self)
        return new

    def keep_alive(self, seconds: float) -> None:
        """One heartbeat (the client's heartbeat thread sends them; a caller need not):
        register again unless the binding is fresh, else PING(instance_id)."""
        deadline = time.monotonic() + seconds
        state = self._state
        b = state.binding
        if b is None:
            return
        if not state.fresh(self._conn.transport.refresh()):
            self._recover(deadline, b)
            return
        sent_at = time.monotonic()
        try:
            self._conn.call("PING", {"instance_id": self.instance_id}, seconds)
        except LMCacheMPError:
            state.fire(BindingEvent.HEARTBEAT_FAILED)
            raise
        state.touch(sent_at)

    # -------------------------------------------------------------- requests
    def request(
        self,
        token_ids: Sequence[int] | Any,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
        tp_size: int = 1,
    ) -> Request:
        """A :class:`~lmcache_mp.Request` for one prompt: lookup, store, retrieve by
        token range; on exit it frees the read locks it still holds and ends its
        server session. ``request_id`` is generated when not given; pass one only
        if it is unique: every LMCache release keeps a session's chunk hashes by request
        id until END_SESSION (else 600 s), so STORE / RETRIEVE under an id reused for
        another prompt in that time use the *first* prompt's hashes."""
        req = Request(self, self._conn, self._state, token_ids, request_id=request_id,
                      cache_salt=cache_salt, tp_size=tp_size, mla=self._mla)
        self._requests.add(req)
        return req

    def lookup_async(self, key: CacheKey, *, tp_size: int = 1,
                     timeout: float | None = None) -> ReplyFuture[int]:
        """LOOKUP then wait: how many leading tokens of ``key.token_ids`` are cached for
        every rank (whole chunks). They stay read-locked for a RETRIEVE."""
        if not isinstance(key, CacheKey) or (key.model_name, key.world_size) != (
                self.model_name, self.world_size):
            raise InvalidArgument(f"LOOKUP: expected a CacheKey for model {self.model_name!r} / "
                                  f"world_size {self.world_size}, got {key!r}")
        chunk = self.chunk_size
        return self._conn.lookup_async(key, tp_size, timeout, lambda hits: hits * chunk,
                                       mla=self._mla)

    lookup = blocking(lookup_async)

    def store_async(self, key: CacheKey, block_ids: BlockIds, *, timeout: float | None = None,
                    stream: Any = None) -> ReplyFuture[bool]:
        """STORE tokens ``[key.start, key.end)`` held in ``block_ids`` (one id per block
        of the range, in order; one list per group for multi-group caches). True when
        stored (chunks cached already count as stored). The chunks become visible to
        LOOKUP shortly after the reply. ``stream`` (CUDA caches): the copy starts after
        work queued on it (the server's, or in engine-driven mode this client's CUDA
        copies, synchronised before COMMIT_STORE)."""
        deadline = time.monotonic() + self._conn.seconds(timeout)
        groups = self._checked(key, block_ids, "STORE")
        if self.mode == "engine":
            return self._engine_store(key, groups, deadline, stream)
        return self._server_copy("STORE", key, groups, {}, deadline, stream)

    store = blocking(store_async)

    def retrieve_async(self, key: CacheKey, block_ids: BlockIds, *,
                       skip_first_n_tokens: int = 0, timeout: float | None = None,
                       stream: Any = None) -> ReplyFuture[bool]:
        """RETRIEVE tokens ``[key.start, key.end)`` into ``block_ids``. Needs a LOOKUP
        hit covering the range first (the retrieve releases its read locks); False when
        a chunk is missing. ``skip_first_n_tokens`` (from ``start``, rounded down to
        whole blocks) leaves leading blocks untouched. ``stream`` (CUDA caches): made to
        wait for the server's copy before reading (engine-driven: this client's copies
        run on it and have finished when the call returns)."""
        deadline = time.monotonic() + self._conn.seconds(timeout)
        groups = self._checked(key, block_ids, "RETRIEVE")
        if (not is_int(skip_first_n_tokens)
                or not 0 <= skip_first_n_tokens <= key.end - key.start):
            raise InvalidArgument(f"skip_first_n_tokens must be an int in "
                                  f"[0, {key.end - key.start}], got {skip_first_n_tokens!r}")
        if self.mode == "engine":
            return self._engine_retrieve(key, groups, skip_first_n_tokens, deadline, stream)
        return self._server_copy("RETRIEVE", key, groups,
                                 {"skip_first_n_tokens": skip_first_n_tokens}, deadline, stream)

    retrieve = blocking(retrieve_async)

    def _checked(self, key: CacheKey, block_ids: BlockIds, op: str) -> list[list[int]]:
        if self._state.binding is None:
            raise InvalidArgument(
                f"{op}: instance {self.instance_id} is unregistered; register the cache again")
        self.layout.check_key(key, op)
        return normalize_block_ids(block_ids, key, self.layout, op)

    def _worker(self, key: CacheKey) -> int:
        """The KV rank of a transfer: the key's, else the registration's."""
        return self.worker_id if key.worker_id is None else key.worker_id

    # ----------------------------------------------- LMCache-driven transfers
    def _server_copy(self, op_name: str, key: CacheKey, groups: list[list[int]],
                     extra: Payloads, deadline: float, stream: Any) -> ReplyFuture[bool]:
        """STORE / RETRIEVE: the server copies between the registered cache and its L1."""
        conn, cache, state = self._conn, self.cache, self._state
        worker, instance_id = self._worker(key), self.instance_id
        # The event orders the server's copy after the caller's stream (CUDA); the
        # token (the event) must live until the reply. A CPU server ignores it.
        event, token = cache.begin_transfer(stream)
        sent: list[tuple[Operation, float]] = []

        def submit() -> PendingRequest:
            b = self._bound(deadline)
            wire = conn.profile_for(unsent(deadline, op_name)).transfer_key(key, worker)
            sent_at = time.monotonic()
            op, p = conn.submit(op_name, {"key": wire, "instance_id": instance_id,
                                          "block_ids": groups, "event_ipc_handle": event,
                                          **extra},
                                unsent(deadline, op_name), epoch=b.epoch)
            sent.append((op, sent_at))
            return p

        def finish(frames: list[bytes]) -> bool:
            op, sent_at = sent[-1]
            server_event, ok = decode_reply(op, frames)
            state.touch(sent_at)
            cache.end_transfer(server_event, stream, token)
            return bool(ok)

        return _SentBound(conn.transport, submit, finish)

    # ------------------------------------------------ engine-driven transfers
    def _prepare(self, op_name: str, key: CacheKey,
                 deadline: float) -> tuple[Binding, Any, Operation, list[bytes]]:
        """PREPARE_* bound to the current connection, re-registering when it changed; the
        reply frames, not yet decoded (a reply that cannot be read must still be followed
        by the COMMIT that releases what the server took)."""
        self._commits.collect()
        conn = self._conn
        worker, instance_id = self._worker(key), self.instance_id
        while True:
            b = self._bound(deadline)
            wire = conn.profile_for(unsent(deadline, op_name)).transfer_key(key, worker)
            sent_at = time.monotonic()
            op, p = conn.submit(op_name, {"key": wire, "instance_id": instance_id},
                                unsent(deadline, op_name), epoch=b.epoch)
            try:
                frames = conn.transport.wait(p)
            except ConnectionChanged:
                continue
            self._state.touch(sent_at)
            return b, wire, op, frames

    def _engine_store(self, key: CacheKey, groups: list[list[int]], deadline: float,
                      stream: Any = None) -> ReplyFuture[bool]:
        """PREPARE_STORE, copy the blocks into the reserved slots, COMMIT_STORE (chunks
        already cached get no slot: nothing to do for them)."""
        # A CpuKVCache, or a GPU cache (CUDA copies on ``stream``; enforced at registration).
        b, wire, op, frames = self._prepare("PREPARE_STORE", key, deadline)
        commit = {"key": wire, "instance_id": self.instance_id}
        try:
            prepared = decode_reply(op, frames)
            assert isinstance(prepared, PrepareStoreResponse) and b.pool is not None
            ctx = prepared.context
            if not ctx.slots and not ctx.chunk_indices:
                return ReplyFuture.completed(True)  # every chunk is cached already
            import numpy as np  # loaded on the first engine-driven copy, not at import

            copy_into_slots(self.cache, np.asarray(groups[0], dtype=np.int64), ctx.slots,
                            ctx.chunk_indices, b.pool, self.chunk_size,
                            self._owner.pools.workers, stream)
        except BaseException as exc:
            # The server holds a write reservation until COMMIT_STORE (else until its write
            # TTL, 600 s, or the unregister; either way it then publishes the slots as they
            # are, exactly as this COMMIT does): release it now, then say what happened.
            self._release("COMMIT_STORE", commit, b, deadline)
            if isinstance(exc, ProtocolMismatch):
                raise ProtocolMismatch(
                    f"{exc}. Nothing was copied; the COMMIT_STORE that releases the server's "
                    f"reservation was sent, and LMCache publishes reserved slots as written "
                    f"whatever they hold, so chunks of this key on the server may hold "
                    f"unwritten data: clear() its cache if that matters") from None
            raise
        return self._commit("COMMIT_STORE", commit, b, deadline, bool)

    def _engine_retrieve(self, key: CacheKey, groups: list[list[int]], skip: int,
                         deadline: float, stream: Any = None) -> ReplyFuture[bool]:
        """PREPARE_RETRIEVE, copy the slots into the blocks, COMMIT_RETRIEVE (which
        releases the LOOKUP's read locks, also when the reply was unreadable or the copy
        failed). Resolved once the COMMIT is sent: its reply is read later
        (lmcache_mp.session.commits)."""
        b, wire, op, frames = self._prepare("PREPARE_RETRIEVE", key, deadline)
        commit = {"key": wire, "instance_id": self.instance_id}
        try:
            prepared = decode_reply(op, frames)
            assert isinstance(prepared, PrepareRetrieveResponse) and b.pool is not None
            if not prepared.success:
                return ReplyFuture.completed(False)  # the server released what it found
            import numpy as np

            copy_from_slots(self.cache, np.asarray(groups[0], dtype=np.int64),
                            prepared.context.slots, b.pool, self.chunk_size, skip,
                            self._owner.pools.workers, stream)
        except BaseException as exc:
            self._release("COMMIT_RETRIEVE", commit, b, deadline)
            if isinstance(exc, ProtocolMismatch):
                raise ProtocolMismatch(
                    f"{exc}. No block was written; the COMMIT_RETRIEVE that releases the "
                    f"server's read locks was sent") from None
            raise
        # The blocks are written: the COMMIT's reply (``True`` on every release) is
        # read later (lmcache_mp.session.commits), not waited for here.
        self._commits.add("COMMIT_RETRIEVE",
                          self._commit("COMMIT_RETRIEVE", commit, b, deadline, _true))
        return ReplyFuture.completed(True)

    def _commit(self, op_name: str, payloads: Payloads, b: Binding, deadline: float,
                convert: Callable[[Any], bool]) -> ReplyFuture[bool]:
        conn, state = self._conn, self._state
        sent_at = time.monotonic()
        op, p = conn.submit(op_name, payloads, remaining(deadline, op_name), epoch=b.epoch)

        def finish(frames: list[bytes]) -> bool:
            value = convert(decode_reply(op, frames))
            state.touch(sent_at)
            return value

        return ReplyFuture(conn.transport, p, finish)

    def _release(self, op_name: str, payloads: Payloads, b: Binding, deadline: float) -> None:
        """Send the COMMIT that frees what a PREPARE took on the server, even when the
        call's deadline has passed (the server needs it either way); wait for its reply
        only within the deadline. Failures are logged: the caller raises its own error."""
        conn = self._conn
        try:
            _, p = conn.submit(op_name, payloads, max(deadline - time.monotonic(), 1.0),
                               epoch=b.epoch)
            conn.transport.wait_for(p, max(deadline - time.monotonic(), 0.0))
            if not p.done:
                conn.transport.cancel(p)  # sent; its reply is not needed
            elif p.error is not None:
                raise p.error
        except LMCacheMPError as err:
            log.warning("lmcache_mp: %s after a failed transfer was not confirmed: %s",
                        op_name, err)

    # ----------------------------------------------------------- unregister
    def unregister(self, *, timeout: float | None = None, unlink: bool = True) -> None:
        """End the requests still open, UNREGISTER, then (``unlink``) remove the CPU
        cache's shared-memory names. Local state goes even if the server does not
        answer (it then reaps the silent registration itself)."""
        for req in list(self._requests):
            req.close()
        self._commits.settle(COMMITS_SETTLE_S)
        # Under the recovery lock: a re-registration in progress finishes first, and
        # none can bring this registration back afterwards (no ghost on the server).
        with self._recover_lock:
            b = self._state.unregistered()
        if b is None:
            return
        self._owner.discard(self)
        self._owner.pools.release(b.pool)
        try:
            op = ("UNREGISTER_KV_CACHE" if self.mode == "lmcache"
                  else "UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT")
            self._conn.call(op, {"instance_id": self.instance_id}, timeout)
        finally:
            if unlink:
                self.cache.unlink()


class _SentBound(ReplyFuture[bool]):
    """The future of an LMCache-driven transfer, sent bound to the connection its
    registration was checked on. If the socket reconnected before it went out, it
    failed unsent (ConnectionChanged): ``send`` checks the registration again (which
    re-registers with what may be a restarted server) and sends it again, within the
    transfer's deadline (it raises once that has passed)."""

    __slots__ = ("_send",)

    def __init__(self, transport: Transport, send: Callable[[], PendingRequest],
                 finish: Callable[[list[bytes]], bool]) -> None:
        super().__init__(transport, send(), finish)
        self._send = send

    def _reply(self) -> list[bytes]:
        while True:
            try:
                return super()._reply()
            except ConnectionChanged:
                self._awaiting(self._send())


def _true(_: Any) -> bool:
    return True
