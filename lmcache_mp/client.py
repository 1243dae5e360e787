"""The public client: a connection, the control-plane calls, and :meth:`Client.register`.

Data-plane calls belong to the :class:`~lmcache_mp.Registration` that ``register()``
returns; the instance-id-based ``store`` / ``retrieve`` / ``register_kv_cache*`` calls
below remain as the low-level API and go through the same registrations, so every
registration gets the heartbeat and the recovery whichever API made it.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Sequence

from .checks import is_int, one_of, optional_positive_seconds, positive_seconds
from .errors import InvalidArgument
from .ipc.base import ExportableKVCache
from .ipc.cpu_cache import CpuKVCache
from .keys import CacheKey
from .protocol import Profile
from .protocol.detect import Detection
from .protocol.types import EngineGroupInfo
from .session.blocks import TransferLayout
from .session.connection import DEFAULT_TIMEOUT, Connection
from .session.control import ControlPlane
from .session.instance_ids import InstanceIdAPI
from .session.registration import Mode, Registration
from .session.registry import Registry

__all__ = ["Client", "DEFAULT_TIMEOUT"]


class Client(ControlPlane, InstanceIdAPI):
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
            (``"0.5.3"`` covers 0.5.4, ``"0.5.5"``, ``"0.5.6"``, ``"0.5.7"`` covers
            0.5.7rc2) to skip the probe. A server answering like none of them (a newer
            LMCache) is refused with ProtocolMismatch before anything else is sent.
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
        allow_remote: allow a ``tcp://`` host that is not loopback. Off by default:
            REGISTER sends pickles that LMCache servers 0.4.7-0.5.5 unpickle, over
            plaintext ZMQ with no authentication, so only connect across a network
            you trust (see the README's Safety section).
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
        allow_remote: bool = False,
    ) -> None:
        interval = optional_positive_seconds("heartbeat_interval", heartbeat_interval)
        reap = positive_seconds("reap_timeout", reap_timeout)
        for name, callback in (("on_health_change", on_health_change),
                               ("on_recovered", on_recovered)):
            if callback is not None and not callable(callback):
                raise InvalidArgument(f"{name} must be callable or None, got {callback!r}")
        self._conn = Connection(url, timeout, protocol, allow_remote)
        self._registry = Registry(self._conn, heartbeat_interval=interval, reap_timeout=reap,
                                  on_health_change=on_health_change, on_recovered=on_recovered)
        # A client dropped without close() must not leave its heartbeat thread (which
        # holds the connection, not the client) running for ever.
        self._finalizer = weakref.finalize(self, _shut_down, self._registry, self._conn)

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
    def protocol_identified(self) -> bool:
        """Whether the server's protocol is known on the current connection: until it
        is (a new client, or a reconnect), the next call first runs a protocol probe
        (up to 2 s). Threads that must not wait can check this and skip the call."""
        return self._conn.identified

    @property
    def detection(self) -> Detection | None:
        """What the last protocol probe found (None if none ran)."""
        return self._conn.detection

    def adopt_protocol(self, family: str, *, source: str = "another process") -> bool:
        """Use the wire family another process found on this server (e.g. vLLM's
        workers, for its scheduler) instead of probing it again: each probe leaves
        ERROR lines in the log of some releases. Valid for the current connection (or
        the first, if none was made yet); a reconnect probes again. Returns whether it
        was taken: not when the protocol was named or is already identified."""
        return self._conn.adopt(family, source)

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
        self._finalizer()

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
        CPU caches, and GPU caches with CUDA copies), or ``"auto"``: engine-driven for a
        CPU cache when the server offers a pool, else server-copy; for a GPU cache
        server-copy, unless CUDA IPC cannot export its memory (VMM, Tegra), then
        engine-driven (``reg.mode`` says which). ``instance_id`` defaults to a
        random 63-bit int; ``worker_id`` is this worker's KV rank. Layers are described
        by the cache's layout, with by default one group holding every layer.
        """
        chosen = one_of("mode", mode, ("auto", "lmcache", "engine"))
        if not isinstance(kv_cache, ExportableKVCache):
            raise InvalidArgument(
                f"kv_cache must be a lmcache_mp.CpuKVCache (or a CUDA cache from "
                f"lmcache_mp.ipc.cuda), got {type(kv_cache).__name__}")
        engine_ok = isinstance(kv_cache, CpuKVCache) or bool(
            getattr(kv_cache, "supports_engine_driven", False))
        # A GPU cache the server cannot map (pool memory, Tegra, VMM without a fabric
        # export) can only be engine-driven: "auto" registers it so, with no fall-back.
        exportable = getattr(kv_cache, "ipc_exportable", True)
        engine_only = not getattr(kv_cache, "server_mappable", exportable)
        wrapped = isinstance(kv_cache, CpuKVCache) and kv_cache.wrapped
        if chosen == "engine" and not engine_ok:
            raise InvalidArgument("this cache cannot do engine-driven transfers: register a "
                                  "CpuKVCache or a CudaKVCache, or use mode='lmcache'")
        if chosen == "lmcache" and wrapped:
            raise InvalidArgument(
                "a cache from CpuKVCache.wrap() is caller memory the server cannot map: "
                "register it with mode='engine' (or 'auto'), or allocate a shared-memory "
                "cache with CpuKVCache.allocate() for mode='lmcache'")
        if chosen == "lmcache" and not exportable:
            raise InvalidArgument(
                "the server cannot map this GPU cache: CUDA IPC cannot export its memory "
                "(VMM / memory-pool memory, or no CUDA IPC on this device). Register with "
                "mode='engine' or 'auto' (the client copies through the server's pool)")
        if kv_cache.closed or kv_cache.unlinked:
            raise InvalidArgument(
                "this KV cache was closed or unregistered (its shared-memory names are gone); "
                "allocate a new cache to register")
        # 63 random bits (os.urandom: the secrets module costs import time for nothing more)
        iid = int.from_bytes(os.urandom(8), "big") >> 1 if instance_id is None else instance_id
        # The shared key fields are checked exactly as a CacheKey checks them.
        CacheKey(model_name=model_name, world_size=world_size, worker_id=worker_id,
                 token_ids=(), start=0, end=0, request_id="")
        if isinstance(iid, bool) or not isinstance(iid, int) or not 0 <= iid < 2**63:
            raise InvalidArgument(f"instance_id must be an int in [0, 2**63), got {iid!r}")
        g = kv_cache.geometry
        groups = _checked_groups(engine_group_infos, g.num_layers) if engine_group_infos else (
            EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(g.num_layers)),
                            tokens_per_block=g.block_size),)
        deadline = time.monotonic() + self._conn.seconds(timeout)
        self._registry.reserve(iid, model_name, world_size, g)
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
            # "auto" tries engine-driven for a CPU cache, and for a GPU cache only when
            # CUDA IPC cannot export it (then with no fall-back): an exportable GPU cache
            # is copied by the server, device to device.
            try_engine = chosen == "engine" or (chosen == "auto" and (
                isinstance(kv_cache, CpuKVCache) or engine_only))
            first: Mode = "engine" if try_engine else "lmcache"
            reg = Registration(self._registry, kv_cache, first, layout, worker_id)
            # A wrapped cache has no server-copy mode to fall back to: a server without
            # a pool is then reported as such (ProtocolMismatch) by the engine-driven try.
            reg.establish(deadline, engine_only=engine_only and chosen != "lmcache",
                          fall_back=chosen == "auto" and try_engine and not wrapped)
            self._registry.add(reg)
        except BaseException:
            self._registry.release(iid)
            raise
        return reg

    def registration(self, instance_id: int) -> Registration:
        """This client's registration of ``instance_id``."""
        if not is_int(instance_id):
            raise InvalidArgument(f"instance_id must be an int, got {instance_id!r}")
        reg = self._registry.get(instance_id)
        if reg is None:
            raise InvalidArgument(
                f"instance {instance_id} is not registered by this client; register its KV "
                f"cache first (the server silently drops transfers for unknown instances)")
        return reg


def _checked_groups(infos: object, num_layers: int) -> tuple[EngineGroupInfo, ...]:
    """``engine_group_infos`` as given, checked against the cache (a wrong one would be
    dropped by the server without a reply, or fail its transfers)."""
    if not isinstance(infos, (list, tuple)) or not all(
            isinstance(gi, EngineGroupInfo) for gi in infos):
        raise InvalidArgument(f"engine_group_infos must be a list of lmcache_mp.EngineGroupInfo, "
                              f"got {infos!r}")
    for gi in infos:
        if (not is_int(gi.engine_group_id) or gi.engine_group_id < 0
                or not is_int(gi.tokens_per_block) or gi.tokens_per_block < 0
                or not is_int(gi.sw_size_tokens)
                or not isinstance(gi.layer_indices, (list, tuple))
                or not all(is_int(i) and 0 <= i < num_layers for i in gi.layer_indices)):
            raise InvalidArgument(
                f"invalid {gi!r}: engine_group_id and tokens_per_block (0: the cache's block "
                f"size) must be ints >= 0, layer_indices ints in [0, {num_layers})")
    return tuple(infos)


def _shut_down(registry: Registry, conn: Connection) -> None:
    registry.stop()
    conn.close()  # a PING in flight fails at once
    registry.join()
