"""The public client: a connection, the control-plane calls, and :meth:`Client.register`.

Data-plane calls belong to the :class:`~lmcache_mp.Registration` that ``register()``
returns; the instance-id-based ``store`` / ``retrieve`` / ``register_kv_cache*`` calls
below remain as the low-level API and go through the same registrations, so every
registration gets the heartbeat and the recovery whichever API made it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .blocks import BlockIds, TransferLayout
from .checks import one_of, optional_positive_seconds, positive_seconds
from .connection import DEFAULT_TIMEOUT, Connection
from .errors import InvalidArgument
from .futures import ReplyFuture, blocking
from .ipc.base import ExportableKVCache
from .ipc.cpu_cache import CpuKVCache
from .keys import CacheKey
from .liveness import Registry
from .protocol import Profile
from .protocol.detect import Detection
from .protocol.types import BlockAllocationRecord, EngineGroupInfo, RegisterEngineDrivenContextResponse
from .registration import Mode, Registration

__all__ = ["Client", "DEFAULT_TIMEOUT"]


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
        protocol: the server's wire family: ``"auto"`` (default) probes the server on
            first use, and again after a reconnect, without disturbing it; or name it
            (``"0.5.3"`` covers 0.5.4, ``"0.5.5"``, ``"0.5.6"``) to skip the probe.
        heartbeat_interval: seconds between ``PING(instance_id)`` heartbeats while the
            client holds a registration (None: no heartbeat thread; registrations are
            then checked only when used).
        reap_timeout: the server's ``--worker-reap-timeout-seconds`` (30 s, the least
            any server accepts, is safe for all): a registration silent for most of it
            is registered again before its next transfer.
        on_health_change: called with ``healthy`` when heartbeats start failing or
            answer again (from the heartbeat thread).
        on_recovered: called with a :class:`Registration` the client registered again
            on its own after a reconnect or failed heartbeats: the server may have
            restarted, so what it cached may be gone.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        protocol: str = "auto",
        heartbeat_interval: float | None = 10.0,
        reap_timeout: float = 30.0,
        on_health_change: Callable[[bool], None] | None = None,
        on_recovered: Callable[[Registration], None] | None = None,
    ) -> None:
        interval = optional_positive_seconds("heartbeat_interval", heartbeat_interval)
        reap = positive_seconds("reap_timeout", reap_timeout)
        self._conn = Connection(url, timeout, protocol)
        self._registry = Registry(self._conn, heartbeat_interval=interval, reap_timeout=reap,
                                  on_health_change=on_health_change, on_recovered=on_recovered)

    # ---------------------------------------------------------------- plumbing
    @property
    def url(self) -> str:
        return self._conn.url

    @property
    def timeout(self) -> float:
        """The default deadline of a call, in seconds."""
        return self._conn.timeout

    @property
    def profile(self) -> Profile:
        """The wire profile this client speaks to the server (probes it if "auto")."""
        return self._conn.profile

    @property
    def server_protocol(self) -> str:
        """The protocol family this client speaks to the server (probes it if "auto")."""
        return self._conn.profile.name

    @property
    def detection(self) -> Detection | None:
        """What the last protocol probe found (None if none ran)."""
        return self._conn.detection

    @property
    def healthy(self) -> bool:
        """False while heartbeats go unanswered (updated once per heartbeat)."""
        return self._registry.healthy

    @property
    def registrations(self) -> list[Registration]:
        return self._registry.snapshot()

    def close(self) -> None:
        """Stop the heartbeat, fail pending calls with ClientClosed, release the socket.
        Idempotent. Registrations stay on the server until it reaps them (unregister
        first if you are done); KV caches are the caller's to close."""
        self._registry.stop()
        self._conn.close()
        self._registry.join()

    @property
    def closed(self) -> bool:
        return self._conn.transport.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        conn = self._conn
        proto = conn.profile.name if conn.fixed_protocol or conn.detection else "auto"
        return f"<lmcache_mp.Client {self.url} protocol={proto} {state}>"

    # ------------------------------------------------------------ control plane
    def noop(self, *, timeout: float | None = None) -> str:
        """NOOP, answered on the server's message thread ("OK")."""
        # Written out (not via noop_async) to keep the latency floor: no future.
        return str(self._conn.call("NOOP", (), timeout))

    def noop_async(self, *, timeout: float | None = None) -> ReplyFuture[str]:
        return self._conn.request("NOOP", (), timeout, str)

    def ping_async(self, instance_id: int | None = None, *,
                   timeout: float | None = None) -> ReplyFuture[bool]:
        """PING; with ``instance_id`` it also marks that worker alive (ping-proven)."""
        return self._conn.request("PING", (instance_id,), timeout, bool)

    ping = blocking(ping_async)

    def chunk_size(self, *, timeout: float | None = None) -> int:
        """The server's chunk size in tokens (asked once per connection)."""
        return self._conn.chunk_size(timeout)

    def clear_async(self, *, force: bool = True, timeout: float | None = None) -> ReplyFuture[None]:
        """CLEAR: drop cached objects on the server. Servers up to 0.5.5 always force
        (``force`` is not sent); 0.5.6 takes it as its payload."""
        return self._conn.request("CLEAR", self._conn.profile.clear_payloads(force), timeout)

    clear = blocking(clear_async)

    def get_experimental_async(self, *, timeout: float | None = None) -> ReplyFuture[list[str]]:
        """The experimental transfer features the server was started with."""
        return self._conn.request("GET_EXPERIMENTAL", (), timeout, list)

    get_experimental = blocking(get_experimental_async)

    # ------------------------------------------------------------------ lookup
    def submit_lookup_async(self, key: CacheKey, tp_size: int = 1, *,
                            timeout: float | None = None) -> ReplyFuture[None]:
        """Send LOOKUP for the whole of ``key.token_ids`` (all ranks) and wait for its
        acknowledgement. The server read-locks every prefix chunk it finds and records a
        job under ``key.request_id``; collect the count with :meth:`query_prefetch_status`
        or :meth:`wait_prefetch_status`. Locks stay until a RETRIEVE or
        :meth:`free_lookup_locks` releases them (or a 300 s TTL). ``tp_size`` adds
        readers for MLA; send the same value to free_lookup_locks."""
        return self._conn.request("LOOKUP", self._all_ranks(key, tp_size), timeout)

    submit_lookup = blocking(submit_lookup_async)

    def query_prefetch_status_async(self, request_id: str, *,
                                    timeout: float | None = None) -> ReplyFuture[int | None]:
        """Hit chunks of the lookup job, None while it runs; consumes the job (then 0)."""
        return self._conn.request("QUERY_PREFETCH_STATUS", (request_id,), timeout)

    query_prefetch_status = blocking(query_prefetch_status_async)

    def wait_prefetch_status_async(self, request_id: str, timeout: float, *,
                                   rpc_timeout: float | None = None) -> ReplyFuture[int | None]:
        """Wait up to ``timeout`` s on the server for the lookup job; None if unfinished.
        The call's own deadline is ``timeout`` plus ``rpc_timeout`` (default: the client's
        timeout), so a dead server still surfaces as an error."""
        wait_s = positive_seconds("timeout", timeout)
        deadline = wait_s + self._conn.seconds(rpc_timeout)
        return self._conn.request("WAIT_PREFETCH_STATUS", (request_id, wait_s), deadline)

    wait_prefetch_status = blocking(wait_prefetch_status_async)

    def query_prefetch_lookup_hits_async(self, request_id: str, *,
                                         timeout: float | None = None) -> ReplyFuture[int | None]:
        """Hit chunks found so far, without consuming the job (0.5.3-0.5.5 only)."""
        return self._conn.request("QUERY_PREFETCH_LOOKUP_HITS", (request_id,), timeout)

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
                                timeout: float | None = None) -> ReplyFuture[None]:
        """Release the read locks a LOOKUP took on chunks in ``[key.start, key.end)``
        that will not be retrieved (all ranks). Use the LOOKUP's ``tp_size``."""
        return self._conn.request("FREE_LOOKUP_LOCKS", self._all_ranks(key, tp_size), timeout)

    free_lookup_locks = blocking(free_lookup_locks_async)

    def end_session_async(self, request_id: str, *,
                          timeout: float | None = None) -> ReplyFuture[None]:
        """Drop the server's session (cached chunk hashes) for ``request_id``. End every
        request id before reusing it for other tokens, and before the last unregister of
        its model (the server does not answer it after that)."""
        return self._conn.request("END_SESSION", (request_id,), timeout)

    end_session = blocking(end_session_async)

    def report_block_allocation_async(
        self, instance_id: int, model_name: str,
        records: Iterable[BlockAllocationRecord | Mapping[str, Any]], *,
        timeout: float | None = None,
    ) -> ReplyFuture[None]:
        """Report per-request block allocation deltas (vLLM's observability feed)."""
        recs = [r if isinstance(r, BlockAllocationRecord) else BlockAllocationRecord(**r)
                for r in records]
        return self._conn.request("REPORT_BLOCK_ALLOCATION", (instance_id, model_name, recs),
                                  timeout)

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
        chunk = self.chunk_size()
        want = len(key.token_ids) // chunk if min_chunks is None else min_chunks
        deadline = time.monotonic() + self._conn.seconds(timeout)
        while True:
            remaining = deadline - time.monotonic()
            hits = self.lookup(key, tp_size, timeout=max(remaining, 0.05))
            if hits >= want or time.monotonic() + poll_interval >= deadline:
                return hits
            if hits:
                self.free_lookup_locks(key.with_range(0, hits * chunk), tp_size)
            time.sleep(poll_interval)

    def _all_ranks(self, key: CacheKey, tp_size: int) -> tuple[Any, int]:
        if not isinstance(key, CacheKey):
            raise InvalidArgument(f"expected a lmcache_mp.CacheKey, got {type(key).__name__}")
        return self._conn.profile.all_ranks_payloads(key, tp_size)

    # ------------------------------------------------------------- registering
    def register(
        self,
        kv_cache: ExportableKVCache,
        *,
        model_name: str,
        mode: str = "auto",
        world_size: int = 1,
        worker_id: int = 0,
        instance_id: int | None = None,
        engine_group_infos: Sequence[EngineGroupInfo] | None = None,
        timeout: float | None = None,
    ) -> Registration:
        """Register ``kv_cache`` with the server and return its :class:`Registration`.

        ``mode``: ``"lmcache"`` (the server maps the cache and copies blocks),
        ``"engine"`` (this client copies blocks through the server's shared-memory pool;
        CPU caches), or ``"auto"``: engine-driven for a CPU cache when the server offers
        a pool, else server-copy (``reg.mode`` says which). ``instance_id`` defaults to a
        random 63-bit int; ``worker_id`` is this worker's KV rank. Layers are described
        by the cache's layout, with by default one group holding every layer.
        """
        chosen = one_of("mode", mode, ("auto", "lmcache", "engine"))
        if not isinstance(kv_cache, ExportableKVCache):
            raise InvalidArgument(
                f"kv_cache must be a lmcache_mp.CpuKVCache (or a CUDA cache from "
                f"lmcache_mp.ipc.cuda), got {type(kv_cache).__name__}")
        if chosen == "engine" and not isinstance(kv_cache, CpuKVCache):
            raise InvalidArgument("engine-driven transfers copy through host memory: "
                                  "register a CpuKVCache, or use mode='lmcache'")
        if kv_cache.closed or kv_cache.unlinked:
            raise InvalidArgument(
                "this KV cache was closed or unregistered (its shared-memory names are gone); "
                "allocate a new cache to register")
        iid = secrets.randbits(63) if instance_id is None else instance_id
        # The shared key fields are checked exactly as a CacheKey checks them.
        CacheKey(model_name=model_name, world_size=world_size, worker_id=worker_id,
                 token_ids=(), start=0, end=0, request_id="")
        if isinstance(iid, bool) or not isinstance(iid, int) or not 0 <= iid < 2**63:
            raise InvalidArgument(f"instance_id must be an int in [0, 2**63), got {iid!r}")
        g = kv_cache.geometry
        groups = tuple(engine_group_infos) if engine_group_infos else (
            EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(g.num_layers)),
                            tokens_per_block=g.block_size),)
        deadline = time.monotonic() + self._conn.seconds(timeout)
        self._registry.reserve(iid)
        try:
            chunk = self._conn.chunk_size(timeout)
            for group in groups:
                per_block = group.tokens_per_block or g.block_size
                if chunk % per_block:
                    raise InvalidArgument(
                        f"the server's chunk size {chunk} is not a multiple of {per_block} "
                        f"tokens per block; the server would refuse this cache")
            layout = TransferLayout(iid, model_name, world_size, chunk, groups, g.block_size,
                                    g.num_blocks)
            first: Mode = "lmcache" if chosen == "lmcache" else "engine"
            reg = Registration(self._registry, kv_cache, first, layout, worker_id)
            reg._establish(deadline, fall_back=chosen == "auto")
            self._registry.add(reg)
        except BaseException:
            self._registry.release(iid)
            raise
        return reg

    def registration(self, instance_id: int) -> Registration:
        """This client's registration of ``instance_id``."""
        reg = self._registry.get(instance_id)
        if reg is None:
            raise InvalidArgument(
                f"instance {instance_id} is not registered by this client; register its KV "
                f"cache first (the server silently drops transfers for unknown instances)")
        return reg

    # --------------------------------------------- low-level API (instance ids)
    def register_kv_cache(self, kv_cache: ExportableKVCache, *, instance_id: int,
                          model_name: str, world_size: int = 1, worker_id: int = 0,
                          engine_group_infos: Sequence[EngineGroupInfo] | None = None,
                          timeout: float | None = None) -> None:
        """REGISTER_KV_CACHE (LMCache-driven mode): ``register(mode="lmcache")``."""
        self.register(kv_cache, model_name=model_name, mode="lmcache", world_size=world_size,
                      worker_id=worker_id, instance_id=instance_id,
                      engine_group_infos=engine_group_infos, timeout=timeout)

    def register_kv_cache_engine_driven(
        self, kv_cache: CpuKVCache, *, instance_id: int, model_name: str, world_size: int = 1,
        worker_id: int = 0, timeout: float | None = None,
    ) -> RegisterEngineDrivenContextResponse:
        """REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT: ``register(mode="engine")``; returns
        where the server's pool is (a server without one is refused)."""
        reg = self.register(kv_cache, model_name=model_name, mode="engine",
                            world_size=world_size, worker_id=worker_id, instance_id=instance_id,
                            timeout=timeout)
        assert reg.pool_info is not None
        return reg.pool_info

    def unregister_kv_cache(self, instance_id: int, *, timeout: float | None = None,
                            unlink: bool = True) -> None:
        """UNREGISTER_KV_CACHE, then unlink the cache's SHM names. End the sessions of
        this model first: the server does not answer END_SESSION after the last
        unregister. An instance this client did not register is unregistered as asked."""
        self._unregister(instance_id, "lmcache", "UNREGISTER_KV_CACHE", timeout, unlink)

    def unregister_kv_cache_engine_driven(self, instance_id: int, *,
                                          timeout: float | None = None,
                                          unlink: bool = True) -> None:
        """UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT (also drops the instance's pending
        reservations on the server), then unlink the cache's SHM names."""
        self._unregister(instance_id, "engine", "UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT",
                         timeout, unlink)

    def _unregister(self, instance_id: int, mode: Mode, op: str, timeout: float | None,
                    unlink: bool) -> None:
        reg = self._registry.get(instance_id)
        if reg is None:
            self._conn.call(op, (instance_id,), timeout)
            return
        self._in_mode(reg, mode, op).unregister(timeout=timeout, unlink=unlink)

    def _in_mode(self, reg: Registration, mode: Mode, op: str) -> Registration:
        if reg.mode != mode:
            raise InvalidArgument(
                f"{op}: instance {reg.instance_id} is registered for "
                f"{'engine-driven' if reg.mode == 'engine' else 'LMCache-driven'} transfers")
        return reg

    def _for(self, instance_id: int, mode: Mode, op: str) -> Registration:
        return self._in_mode(self.registration(instance_id), mode, op)

    def store_async(self, key: CacheKey, block_ids: BlockIds, *, instance_id: int,
                    timeout: float | None = None, stream: Any = None) -> ReplyFuture[bool]:
        """STORE through the registration of ``instance_id`` (LMCache-driven); see
        :meth:`Registration.store_async`."""
        return self._for(instance_id, "lmcache", "STORE").store_async(
            key, block_ids, timeout=timeout, stream=stream)

    store = blocking(store_async)

    def retrieve_async(self, key: CacheKey, block_ids: BlockIds, *, instance_id: int,
                       skip_first_n_tokens: int = 0, timeout: float | None = None,
                       stream: Any = None) -> ReplyFuture[bool]:
        """RETRIEVE through the registration of ``instance_id`` (LMCache-driven); see
        :meth:`Registration.retrieve_async`."""
        return self._for(instance_id, "lmcache", "RETRIEVE").retrieve_async(
            key, block_ids, skip_first_n_tokens=skip_first_n_tokens, timeout=timeout,
            stream=stream)

    retrieve = blocking(retrieve_async)

    def store_engine_driven_async(self, key: CacheKey, block_ids: BlockIds, *,
                                  instance_id: int,
                                  timeout: float | None = None) -> ReplyFuture[bool]:
        """PREPARE_STORE, copy into the reserved pool slots, COMMIT_STORE (chunks cached
        already are skipped); the future is the commit's."""
        return self._for(instance_id, "engine", "PREPARE_STORE").store_async(
            key, block_ids, timeout=timeout)

    store_engine_driven = blocking(store_engine_driven_async)

    def retrieve_engine_driven_async(self, key: CacheKey, block_ids: BlockIds, *,
                                     instance_id: int, skip_first_n_tokens: int = 0,
                                     timeout: float | None = None) -> ReplyFuture[bool]:
        """PREPARE_RETRIEVE, copy from the pool slots, COMMIT_RETRIEVE (which releases
        the LOOKUP's read locks). Needs a LOOKUP hit first; False on a miss."""
        return self._for(instance_id, "engine", "PREPARE_RETRIEVE").retrieve_async(
            key, block_ids, skip_first_n_tokens=skip_first_n_tokens, timeout=timeout)

    retrieve_engine_driven = blocking(retrieve_engine_driven_async)
