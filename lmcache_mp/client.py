"""The public client: the protocol profile and the transport composed into typed calls."""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Literal, TypeVar

import numpy as np

from .errors import InvalidArgument, ProtocolMismatch, RequestTimeout, ServerUnavailable
from .futures import ReplyFuture
from .ipc.base import ExportableKVCache
from .ipc.cpu_cache import STORAGE_DTYPES, CpuKVCache
from .ipc.paged_copy import gather_chunk, scatter_chunk
from .ipc.shm import map_existing
from .keys import CacheKey
from .protocol import Profile, decode_reply, encode_request, get_profile
from .protocol.detect import Detection, detect
from .protocol.operations import Operation
from .protocol.types import (
    BlockAllocationRecord,
    EngineGroupInfo,
    PrepareRetrieveResponse,
    PrepareStoreResponse,
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
)
from .registrations import Registration, normalize_block_ids
from .transport import PendingRequest, Transport

__all__ = ["Client", "DEFAULT_TIMEOUT"]

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0


def kv_readers(tp_size: int, world_size: int) -> int:
    """Read locks per looked-up chunk: how many workers will retrieve it.

    0.5.3's server derives it from LOOKUP's ``tp_size`` payload (extra readers when
    MLA replicates KV over more TP ranks than KV shards); 0.5.5+ keys carry it as
    ``num_kv_readers``. Same rule both ways, so ``tp_size`` means the same everywhere.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise InvalidArgument(f"tp_size must be a positive int, got {tp_size!r}")
    tp = tp_size if tp_size > 1 else world_size
    return 1 + (tp - 1 if tp > world_size else 0)


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
        protocol: the server's wire family: ``"auto"`` (default) probes the server once,
            on the first call, without disturbing it (one round trip for 0.5.3/0.5.4
            and for 0.5.6 with observability on, about 0.3 s otherwise); or name it:
            ``"0.5.3"`` (covers 0.5.4), ``"0.5.5"``, ``"0.5.6"``, to skip the probe.
    """

    def __init__(
        self, url: str, *, timeout: float = DEFAULT_TIMEOUT, protocol: str = "auto"
    ) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise InvalidArgument(f"url must look like tcp://host:port, got {url!r}")
        self.url = url
        self.timeout = _check_timeout(timeout)
        self._profile: Profile | None = None if protocol == "auto" else get_profile(protocol)
        self.detection: Detection | None = None
        self._detect_lock = threading.Lock()
        self._transport = Transport(url)
        self._chunk_size: int | None = None
        self._registrations: dict[int, Registration] = {}
        # The server's L1 pool (engine-driven mode), mapped once per client.
        self._pools: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    # ---------------------------------------------------------------- plumbing
    @property
    def server_protocol(self) -> str:
        """The protocol family this client speaks to the server (probes it if "auto")."""
        return self.profile.name

    @property
    def profile(self) -> Profile:
        return self._profile if self._profile is not None else self._detect()

    def _detect(self) -> Profile:
        with self._detect_lock:
            if self._profile is None:
                pending: dict[str, PendingRequest] = {}
                try:
                    self.detection = detect(partial(self._probe_exchange, pending), self.url,
                                            timeout=min(self.timeout, 2.0))
                finally:
                    for p in pending.values():  # unanswered probes: drop late replies
                        self._transport.cancel(p)
                self._profile = get_profile(self.detection.profile)
            return self._profile

    def _probe_exchange(
        self,
        pending: dict[str, PendingRequest],
        batch: Sequence[tuple[str, list[bytes]]],
        until: str,
        timeout: float,
    ) -> dict[str, list[bytes] | None]:
        """Send probe frames in order; wait for ``until``; collect whatever else is in."""
        for name, frames in batch:
            pending[name] = self._transport.submit(frames, timeout,
                                                   f"the protocol probe ({name})")
        target = pending.get(until)
        if target is not None:
            self._transport.wait_for(target, timeout)
            if isinstance(target.error, ServerUnavailable):
                raise target.error  # never reached the server: say so, not "no answer"
            if not target.done and not target.sent:
                self._transport.cancel(target)
                raise ServerUnavailable(self._transport.unreachable_reason(
                    f"the protocol probe ({until})", timeout))
        out: dict[str, list[bytes] | None] = {}
        for name, p in list(pending.items()):
            self._transport.poll(p)
            out[name] = p.frames if p.done and p.error is None else None
        return out

    def _submit(
        self, op_name: str, payloads: Sequence[Any], timeout: float | None
    ) -> tuple[Operation, PendingRequest]:
        op = (self._profile or self._detect()).op(op_name)
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

    def close(self) -> None:
        """Fail pending calls with ClientClosed and release the socket. Idempotent.

        Registrations stay on the server (unregister first if you are done); KV caches
        are the caller's to close.
        """
        self._transport.close()
        self._registrations.clear()
        for pool, _view in self._pools.values():
            try:
                pool.close()
            except BufferError:
                pass
        self._pools.clear()

    @property
    def closed(self) -> bool:
        return self._transport.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        proto = self._profile.name if self._profile is not None else "auto (not yet probed)"
        return f"<lmcache_mp.Client {self.url} protocol={proto} {state}>"

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

    def clear(self, *, force: bool = True, timeout: float | None = None) -> None:
        """CLEAR: drop cached objects on the server. Servers up to 0.5.5 always force
        (``force`` is not sent); 0.5.6 takes it as its payload."""
        self._call("CLEAR", self.profile.clear_payloads(force), timeout)

    def get_experimental(self, *, timeout: float | None = None) -> list[str]:
        """The experimental transfer features the server was started with."""
        return list(self._call("GET_EXPERIMENTAL", (), timeout))

    # ------------------------------------------------------------------ lookup
    def _all_ranks_payloads(self, key: CacheKey, tp_size: int) -> tuple[Any, int]:
        """LOOKUP / FREE_LOOKUP_LOCKS payloads: the key for every rank (worker_id nil),
        with the reader count in the key (0.5.5+) and as ``tp_size`` (0.5.3)."""
        wire = self.profile.build_key(_key(key), None, kv_readers(tp_size, key.world_size))
        return wire, tp_size

    def submit_lookup_async(
        self, key: CacheKey, tp_size: int = 1, *, timeout: float | None = None
    ) -> ReplyFuture[None]:
        return self._request("LOOKUP", self._all_ranks_payloads(key, tp_size), timeout)

    def submit_lookup(self, key: CacheKey, tp_size: int = 1, *, timeout: float | None = None) -> None:
        """Send LOOKUP for the whole of ``key.token_ids`` and wait for its acknowledgement.

        The server read-locks every prefix chunk it finds, for all ranks, and records a
        job under ``key.request_id``; collect the count with
        :meth:`query_prefetch_status` or :meth:`wait_prefetch_status`. Locks stay until
        a RETRIEVE or :meth:`free_lookup_locks` releases them (or a 300 s TTL).
        ``tp_size`` adds readers for MLA; send the same value to free_lookup_locks.
        """
        self._call("LOOKUP", self._all_ranks_payloads(key, tp_size), timeout)

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
        return self._request("FREE_LOOKUP_LOCKS", self._all_ranks_payloads(key, tp_size), timeout)

    def free_lookup_locks(
        self, key: CacheKey, tp_size: int = 1, *, timeout: float | None = None
    ) -> None:
        """Release the read locks a LOOKUP took on chunks in ``[key.start, key.end)``
        that will not be retrieved (all ranks). Use the LOOKUP's ``tp_size``."""
        self._call("FREE_LOOKUP_LOCKS", self._all_ranks_payloads(key, tp_size), timeout)

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


    def wait_for_lookup(
        self,
        key: CacheKey,
        min_chunks: int | None = None,
        *,
        timeout: float | None = None,
        poll_interval: float = 0.02,
        tp_size: int = 1,
    ) -> int:
        """LOOKUP until at least ``min_chunks`` (default: all complete chunks of the
        key's tokens) are cached, or ``timeout`` passes; returns the last hit count.

        A STORE's reply comes before its chunks are visible (the server commits them
        asynchronously), so "store, then look up at once" can miss. Partial hits of
        the retries are released; the final lookup's locks are held for a RETRIEVE.
        """
        chunk = self.chunk_size()
        want = len(key.token_ids) // chunk if min_chunks is None else min_chunks
        budget = self.timeout if timeout is None else _check_timeout(timeout)
        deadline = time.monotonic() + budget
        while True:
            remaining = deadline - time.monotonic()
            hits = self.lookup(key, tp_size, timeout=max(remaining, 0.05))
            if hits >= want or time.monotonic() + poll_interval >= deadline:
                return hits
            if hits:
                self.free_lookup_locks(key.replace(start=0, end=hits * chunk), tp_size)
            time.sleep(poll_interval)

    # ----------------------------------------------- data plane: registration
    def register_kv_cache(
        self,
        kv_cache: ExportableKVCache,
        *,
        instance_id: int,
        model_name: str,
        world_size: int = 1,
        worker_id: int = 0,
        engine_group_infos: Sequence[EngineGroupInfo] | None = None,
        timeout: float | None = None,
    ) -> None:
        """REGISTER_KV_CACHE: let the server map ``kv_cache`` (LMCache-driven mode:
        the server copies blocks itself on :meth:`store` / :meth:`retrieve`).

        ``instance_id`` names this worker's registration (any int64, e.g. a random
        63-bit value); ``worker_id`` is this worker's KV rank, used when a key's own
        ``worker_id`` is None. Layers are described as HND with an explicit
        ``{"kv_layout": "HND"}`` hint and, by default, one group holding every layer
        with ``tokens_per_block = block_size``.
        """
        reg = self._new_registration("lmcache_driven", kv_cache, instance_id, model_name,
                                     world_size, worker_id, engine_group_infos, timeout)
        payloads = self.profile.register_payloads(
            instance_id, kv_cache.export_layers(), model_name, world_size, kv_cache.kv_layout,
            reg.groups)
        self._call("REGISTER_KV_CACHE", payloads, timeout)
        self._registrations[instance_id] = reg

    def unregister_kv_cache(
        self, instance_id: int, *, timeout: float | None = None, unlink: bool = True
    ) -> None:
        """UNREGISTER_KV_CACHE; then unlink the cache's SHM names (the memory stays
        mapped here until the cache is closed). End the sessions of this model first:
        the server does not answer END_SESSION after the last unregister."""
        self._call("UNREGISTER_KV_CACHE", (instance_id,), timeout)
        reg = self._registrations.pop(instance_id, None)
        if reg is not None and unlink:
            reg.cache.unlink()

    def _new_registration(
        self,
        mode: Literal["lmcache_driven", "engine_driven"],
        kv_cache: ExportableKVCache,
        instance_id: int,
        model_name: str,
        world_size: int,
        worker_id: int,
        engine_group_infos: Sequence[EngineGroupInfo] | None,
        timeout: float | None,
    ) -> Registration:
        if not isinstance(kv_cache, ExportableKVCache):
            raise InvalidArgument(
                f"kv_cache must be a lmcache_mp.CpuKVCache (or a CUDA cache from "
                f"lmcache_mp.ipc.cuda), got {type(kv_cache).__name__}"
            )
        if mode == "engine_driven" and not isinstance(kv_cache, CpuKVCache):
            raise InvalidArgument("engine-driven transfers copy through host memory: "
                                  "register a CpuKVCache")
        if kv_cache.closed or kv_cache.unlinked:
            raise InvalidArgument(
                "this KV cache was closed or unregistered (its shared-memory names are gone); "
                "allocate a new CpuKVCache to register"
            )
        if instance_id in self._registrations:
            raise InvalidArgument(
                f"instance {instance_id} is already registered by this client; the server "
                f"would silently keep the old registration: unregister it first"
            )
        # Validate the shared key fields exactly as a CacheKey would.
        CacheKey(model_name=model_name, world_size=world_size, worker_id=worker_id,
                 token_ids=(), start=0, end=0, request_id="")
        g = kv_cache.geometry
        groups = tuple(engine_group_infos) if engine_group_infos else (
            EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(g.num_layers)),
                            tokens_per_block=g.block_size),
        )
        chunk = self.chunk_size(timeout=timeout)
        for group in groups:
            per_block = group.tokens_per_block or g.block_size
            if chunk % per_block:
                raise InvalidArgument(
                    f"the server's chunk size {chunk} is not a multiple of "
                    f"{per_block} tokens per block; the server would refuse this cache"
                )
        return Registration(mode, instance_id, kv_cache, model_name, world_size, worker_id,
                            groups, chunk)

    def _registration(self, instance_id: int, mode: str, op: str) -> Registration:
        reg = self._registrations.get(instance_id)
        if reg is None:
            raise InvalidArgument(
                f"{op}: instance {instance_id} is not registered by this client; register "
                f"its KV cache first (the server silently drops transfers for unknown instances)"
            )
        if reg.mode != mode:
            raise InvalidArgument(
                f"{op}: instance {instance_id} is registered for {reg.mode} transfers"
            )
        return reg

    # ----------------------------------------- data plane: LMCache-driven mode
    def _transfer(
        self,
        op_name: str,
        key: CacheKey,
        block_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
        instance_id: int,
        extra: tuple[Any, ...],
        timeout: float | None,
        stream: Any,
    ) -> ReplyFuture[bool]:
        reg = self._registration(instance_id, "lmcache_driven", op_name)
        reg.check_key(key, op_name)
        groups = normalize_block_ids(block_ids, key, reg, op_name)
        wire = self.profile.build_key(key, reg.worker_for(key), 1)
        cache = reg.cache
        # The event handle orders the server's copy after the caller's stream (CUDA);
        # the token (the event) must live until the reply. A CPU server ignores it.
        event, token = cache.begin_transfer(stream)
        op, pending = self._submit(op_name, (wire, instance_id, groups, event, *extra), timeout)

        def finish(frames: list[bytes]) -> bool:
            server_event, ok = decode_reply(op, frames)
            cache.end_transfer(server_event, stream, token)
            return bool(ok)

        return ReplyFuture(self._transport, pending, finish)

    def store_async(
        self,
        key: CacheKey,
        block_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
        *,
        instance_id: int,
        timeout: float | None = None,
        stream: Any = None,
    ) -> ReplyFuture[bool]:
        return self._transfer("STORE", key, block_ids, instance_id, (), timeout, stream)

    def store(
        self,
        key: CacheKey,
        block_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
        *,
        instance_id: int,
        timeout: float | None = None,
        stream: Any = None,
    ) -> bool:
        """STORE tokens ``[key.start, key.end)`` held in ``block_ids`` (one id per block of
        the range, in order). True when stored (chunks already cached count as stored);
        the chunks become visible to LOOKUP shortly after (see :meth:`wait_for_lookup`).
        ``stream`` (CUDA caches): the server's copy starts after work queued on it, and
        it is made to wait for the copy before the blocks may be overwritten."""
        return self.store_async(key, block_ids, instance_id=instance_id, timeout=timeout,
                                stream=stream).result()

    def retrieve_async(
        self,
        key: CacheKey,
        block_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
        *,
        instance_id: int,
        skip_first_n_tokens: int = 0,
        timeout: float | None = None,
        stream: Any = None,
    ) -> ReplyFuture[bool]:
        _check_skip(skip_first_n_tokens, key)
        return self._transfer("RETRIEVE", key, block_ids, instance_id, (skip_first_n_tokens,),
                              timeout, stream)

    def retrieve(
        self,
        key: CacheKey,
        block_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
        *,
        instance_id: int,
        skip_first_n_tokens: int = 0,
        timeout: float | None = None,
        stream: Any = None,
    ) -> bool:
        """RETRIEVE tokens ``[key.start, key.end)`` into ``block_ids``. Needs a LOOKUP hit
        covering the range first (its read locks are released by the retrieve); False
        when any chunk is missing or unlocked. ``skip_first_n_tokens`` (relative to
        ``start``, rounded down to whole blocks) leaves leading blocks untouched.
        ``stream`` (CUDA caches): made to wait for the server's copy before reading."""
        return self.retrieve_async(key, block_ids, instance_id=instance_id,
                                   skip_first_n_tokens=skip_first_n_tokens,
                                   timeout=timeout, stream=stream).result()

    # ------------------------------------------- data plane: engine-driven mode
    def register_kv_cache_engine_driven(
        self,
        kv_cache: CpuKVCache,
        *,
        instance_id: int,
        model_name: str,
        world_size: int = 1,
        worker_id: int = 0,
        timeout: float | None = None,
    ) -> RegisterEngineDrivenContextResponse:
        """REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT: this client copies KV between
        ``kv_cache`` and the server's shared-memory L1 pool itself (the server needs
        ``--supported-transfer-mode auto`` or ``engine_driven``). Returns where the pool
        is; a server without a pool (GPU hosts with a lazy L1) is refused."""
        reg = self._new_registration("engine_driven", kv_cache, instance_id, model_name,
                                     world_size, worker_id, None, timeout)
        g = kv_cache.geometry
        payload = RegisterEngineDrivenContextPayload(
            instance_id=instance_id, model_name=model_name, world_size=world_size,
            block_size=g.block_size, num_layers=g.num_layers, hidden_dim_size=g.hidden_dim,
            dtype_str=g.dtype, use_mla=g.mla,
        )
        info: RegisterEngineDrivenContextResponse = self._call(
            "REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT", (payload,), timeout
        )
        if not info.shm_name or info.pool_size <= 0:
            self._call("UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT", (instance_id,), timeout)
            raise ProtocolMismatch(
                "the server has no shared-memory L1 pool, so engine-driven transfers would "
                "need pickled torch tensors, which lmcache_mp does not send. Start the server "
                "with --shm-name NAME (needed from 0.5.4; on GPU hosts also --no-l1-use-lazy), "
                "or use register_kv_cache()"
            )
        if info.shm_name not in self._pools:
            pool = map_existing(info.shm_name, info.pool_size)
            self._pools[info.shm_name] = (pool, np.frombuffer(pool, dtype=np.uint8))
        reg.pool_name, reg.pool_size = info.shm_name, info.pool_size
        reg.pool_view = self._pools[info.shm_name][1]
        self._registrations[instance_id] = reg
        return info

    def unregister_kv_cache_engine_driven(
        self, instance_id: int, *, timeout: float | None = None, unlink: bool = True
    ) -> None:
        """UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT (also drops the instance's pending
        reservations on the server); then unlink the cache's SHM names."""
        self._call("UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT", (instance_id,), timeout)
        reg = self._registrations.pop(instance_id, None)
        if reg is not None and unlink:
            reg.cache.unlink()

    def _slot(self, reg: Registration, slot: Any) -> np.ndarray:
        """A chunk object in the server's pool, checked against what we registered."""
        g = reg.cache.geometry
        expect = ([g.num_layers, reg.chunk_size, g.hidden_dim] if g.mla
                  else [2, g.num_layers, reg.chunk_size, g.hidden_dim])
        offset, length, shape, dtype = slot.offset, slot.length, slot.shape, slot.dtype
        nbytes = int(np.prod(expect)) * g.itemsize
        # MLA objects stored through REGISTER_KV_CACHE carry a leading kv_size of 1:
        # same bytes, one more dimension.
        shape_ok = shape == expect or (g.mla and shape == [1, *expect])
        if not shape_ok or dtype != g.dtype or length != nbytes or offset < 0 or (
            offset + length > reg.pool_size
        ):
            raise ProtocolMismatch(
                f"the server offered slot {slot!r}, expected shape {expect} {g.dtype} "
                f"({nbytes} bytes) inside a {reg.pool_size}-byte pool"
            )
        assert reg.pool_view is not None
        np_dtype = STORAGE_DTYPES[g.dtype][0]
        view: np.ndarray = reg.pool_view[offset : offset + length].view(np_dtype).reshape(expect)
        return view

    def _engine_driven_ids(
        self,
        op: str,
        key: CacheKey,
        block_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
        instance_id: int,
    ) -> tuple[Registration, np.ndarray, int]:
        reg = self._registration(instance_id, "engine_driven", op)
        reg.check_key(key, op)
        ids = np.asarray(normalize_block_ids(block_ids, key, reg, op)[0], dtype=np.int64)
        return reg, ids, reg.chunk_size // reg.cache.geometry.block_size

    def store_engine_driven(
        self,
        key: CacheKey,
        block_ids: Sequence[int] | np.ndarray,
        *,
        instance_id: int,
        timeout: float | None = None,
    ) -> bool:
        """PREPARE_STORE, copy the blocks into the reserved pool slots, COMMIT_STORE.
        Chunks already cached are skipped (True without a commit)."""
        reg, ids, per_chunk = self._engine_driven_ids("PREPARE_STORE", key, block_ids, instance_id)
        wire = self.profile.build_key(key, reg.worker_for(key), 1)
        prepared: PrepareStoreResponse = self._call("PREPARE_STORE", (wire, instance_id), timeout)
        slots = prepared.context.slots
        chunk_indices = prepared.context.chunk_indices
        if not slots:
            return True
        if len(slots) != len(chunk_indices):
            raise ProtocolMismatch(f"PREPARE_STORE returned {len(slots)} slots for "
                                   f"{len(chunk_indices)} chunk indices")
        cache = reg.cache
        assert isinstance(cache, CpuKVCache)  # enforced at engine-driven registration
        layers, g = cache.layers, cache.geometry
        for slot, ci in zip(slots, chunk_indices, strict=True):
            target = self._slot(reg, slot)
            gather_chunk(layers, ids[int(ci) * per_chunk : (int(ci) + 1) * per_chunk], target, g)
        return bool(self._call("COMMIT_STORE", (wire, instance_id, b""), timeout))

    def retrieve_engine_driven(
        self,
        key: CacheKey,
        block_ids: Sequence[int] | np.ndarray,
        *,
        instance_id: int,
        skip_first_n_tokens: int = 0,
        timeout: float | None = None,
    ) -> bool:
        """PREPARE_RETRIEVE, copy the pool slots into the blocks, COMMIT_RETRIEVE (which
        releases the LOOKUP's read locks). Needs a LOOKUP hit first; False on a miss."""
        _check_skip(skip_first_n_tokens, key)
        reg, ids, per_chunk = self._engine_driven_ids("PREPARE_RETRIEVE", key, block_ids,
                                                      instance_id)
        wire = self.profile.build_key(key, reg.worker_for(key), 1)
        prepared: PrepareRetrieveResponse = self._call("PREPARE_RETRIEVE", (wire, instance_id),
                                                       timeout)
        if not prepared.success:
            return False
        try:
            slots = prepared.context.slots
            if len(slots) != len(ids) // per_chunk:
                raise ProtocolMismatch(f"PREPARE_RETRIEVE returned {len(slots)} slots for "
                                       f"{len(ids) // per_chunk} chunks")
            skip_blocks = skip_first_n_tokens // reg.cache.geometry.block_size
            cache = reg.cache
            assert isinstance(cache, CpuKVCache)  # enforced at engine-driven registration
            layers, g = cache.layers, cache.geometry
            for ci, slot in enumerate(slots):
                scatter_chunk(self._slot(reg, slot), layers,
                              ids[ci * per_chunk : (ci + 1) * per_chunk], g,
                              skip_blocks=max(0, skip_blocks - ci * per_chunk))
        finally:
            # Always release the read locks, even if a copy failed.
            self._call("COMMIT_RETRIEVE", (wire, instance_id), timeout)
        return True


def _check_skip(skip: int, key: CacheKey) -> None:
    if not isinstance(skip, int) or isinstance(skip, bool) or not 0 <= skip <= key.end - key.start:
        raise InvalidArgument(
            f"skip_first_n_tokens must be an int in [0, {key.end - key.start}], got {skip!r}"
        )


def _key(key: CacheKey) -> CacheKey:
    if not isinstance(key, CacheKey):
        raise InvalidArgument(f"expected a lmcache_mp.CacheKey, got {type(key).__name__}")
    return key
