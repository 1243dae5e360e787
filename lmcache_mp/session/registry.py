"""The registrations of one client, and the heartbeat that keeps them alive.

LMCache servers (0.5.0+) reap a registration that has been silent for
``--worker-reap-timeout-seconds`` (default 120 s, at least 30 s) once it has sent
``PING(instance_id)``, or ``--worker-registration-grace-seconds`` (default 3600 s) if
it never has; PING, STORE and RETRIEVE refresh the timer. A reaped or restarted
server then drops every transfer of that registration without a reply.

While a client holds at least one registration, one daemon thread sends
``PING(instance_id)`` for each every ``heartbeat_interval`` seconds over the same
transport (requests are matched by uid, so it never delays a caller's request). A
registration found on a new connection, after a failed PING, or silent for too long
is registered again on the spot (:meth:`Registration.keep_alive`), so the first
transfer after a restart does not pay for it. The thread ends with the last
registration or when the client closes.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable

from ..errors import ClientClosed, InvalidArgument, LMCacheMPError
from ..ipc.base import KVGeometry
from .connection import Connection
from .engine_driven import PoolMaps
from .registration import Registration

__all__ = ["Registry", "MIN_REAP_TIMEOUT"]

log = logging.getLogger("lmcache_mp")

#: The shortest reap budget a server accepts (``--worker-reap-timeout-seconds``).
MIN_REAP_TIMEOUT = 30.0
# Register again once silent for this share of the reap budget, leaving a margin for
# the reaper's own period and for the request's trip.
_STALE_SHARE = 0.8


class Registry:
    """Registrations by instance id, guarded by a lock, with the heartbeat thread."""

    def __init__(
        self,
        conn: Connection,
        *,
        heartbeat_interval: float | None,
        reap_timeout: float,
        on_health_change: Callable[[bool], None] | None = None,
        on_recovered: Callable[[Registration], None] | None = None,
    ) -> None:
        self.conn = conn
        self.pools = PoolMaps()
        self.interval = heartbeat_interval
        self.stale_after = reap_timeout * _STALE_SHARE
        self._on_health_change = on_health_change
        self._on_recovered = on_recovered
        self._lock = threading.Lock()
        self._regs: dict[int, Registration] = {}
        self._claims: dict[int, _LayoutKey] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self.healthy = True
        if heartbeat_interval is not None and 3 * heartbeat_interval > reap_timeout:
            warnings.warn(
                f"heartbeat_interval={heartbeat_interval:g} s leaves fewer than three "
                f"heartbeats per {reap_timeout:g} s reap budget: a server may reap a "
                f"registration after two lost PINGs; use at most {reap_timeout / 3:g} s",
                stacklevel=3)

    # ---------------------------------------------------------- the registry
    def reserve(self, instance_id: int, model_name: str, world_size: int,
                geometry: KVGeometry) -> None:
        """Claim ``instance_id`` before registering it (refused if already held), and
        the memory layout of (model, world size) on this server (see
        :func:`_claim_layout`)."""
        with self._lock:
            if self._closed:
                raise ClientClosed("the client is closed; create a new Client")
            if instance_id in self._regs:
                raise InvalidArgument(
                    f"instance {instance_id} is already registered by this client; the server "
                    f"would silently keep the old registration: unregister it first")
            claim = _claim_layout(self.conn.url, model_name, world_size, geometry)
            self._regs[instance_id] = _RESERVED
            self._claims[instance_id] = claim

    def add(self, reg: Registration) -> None:
        """Hold ``reg`` (its id reserved before) and make sure the heartbeat runs."""
        with self._lock:
            self._regs[reg.instance_id] = reg
            if self.interval is not None and self._thread is None and not self._closed:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="lmcache-mp-heartbeat",
                                                daemon=True)
                self._thread.start()

    def release(self, instance_id: int) -> None:
        """Give back a reserved id whose registration failed."""
        with self._lock:
            if self._regs.get(instance_id) is _RESERVED:
                del self._regs[instance_id]
                _release_layout(self._claims.pop(instance_id, None))

    def discard(self, reg: Registration) -> None:
        with self._lock:
            if self._regs.get(reg.instance_id) is reg:
                del self._regs[reg.instance_id]
                _release_layout(self._claims.pop(reg.instance_id, None))

    def get(self, instance_id: int) -> Registration | None:
        reg = self._regs.get(instance_id)
        return None if reg is None or reg is _RESERVED else reg

    def snapshot(self) -> list[Registration]:
        with self._lock:
            return [r for r in self._regs.values() if r is not _RESERVED]

    # ------------------------------------------------------------- callbacks
    def recovered(self, reg: Registration) -> None:
        callback = self._on_recovered
        if callback is not None:
            try:
                callback(reg)
            except Exception:  # a user callback must not break the transfer or thread
                log.exception("lmcache_mp: on_recovered callback failed")

    def _set_health(self, healthy: bool) -> None:
        changed = healthy != self.healthy
        self.healthy = healthy
        if changed:
            (log.info if healthy else log.warning)(
                "lmcache_mp: the server at %s is %s", self.conn.url,
                "answering again" if healthy else "not answering heartbeats")
            callback = self._on_health_change
            if callback is not None:
                try:
                    callback(healthy)
                except Exception:
                    log.exception("lmcache_mp: on_health_change callback failed")

    # ------------------------------------------------------------- heartbeat
    def _run(self) -> None:
        interval = self.interval
        assert interval is not None
        while not self._stop.wait(interval):
            with self._lock:
                regs = [r for r in self._regs.values() if r is not _RESERVED]
                if not regs:
                    self._thread = None  # a later add() starts a new thread
                    return
            self.beat(regs, min(interval, self.conn.timeout))

    def beat(self, regs: list[Registration], seconds: float) -> bool:
        """One heartbeat over ``regs``; returns (and records) whether all answered."""
        ok = True
        for reg in regs:
            if self._stop.is_set():
                return ok
            try:
                reg.keep_alive(seconds)
            except LMCacheMPError as err:
                if not reg.registered:
                    continue  # unregistered meanwhile: nothing to keep alive
                ok = False
                log.debug("lmcache_mp: heartbeat for instance %d failed: %s",
                          reg.instance_id, err)
        self._set_health(ok)
        return ok

    @property
    def heartbeat_running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self) -> None:
        """Stop the heartbeat and forget every registration here (the server keeps
        them until it reaps them). Close the transport next, so that a PING in flight
        fails at once, then :meth:`join`."""
        with self._lock:
            self._closed = True
            self._regs.clear()
            for claim in self._claims.values():
                _release_layout(claim)
            self._claims.clear()
        self._stop.set()

    def join(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self.pools.close()


_RESERVED: Registration = object()  # type: ignore[assignment]


# ------------------------------------------------------- one layout per model
# The server keeps one memory layout per (model, world size), the latest registered:
# a second registration of the pair with another geometry makes every retrieve of the
# first (and stored objects of the first shape) fail with a size mismatch, which the
# caller sees only as a miss (False). The server cannot be asked, so this process
# refuses it among the registrations it holds, per server URL and across clients.
_LayoutKey = tuple[str, str, int]
_Shape = tuple[int, int, int, str, bool, bool]
_layouts: dict[_LayoutKey, tuple[_Shape, int]] = {}
_layouts_lock = threading.Lock()


def _object_shape(g: KVGeometry) -> _Shape:
    # What the server's chunk objects depend on; not the number of blocks, nor the
    # block size (caches of one model with other block sizes share chunk objects).
    return (g.num_layers, g.num_heads, g.head_dim, g.dtype, g.mla, g.fused)


def _describe(shape: _Shape) -> str:
    layers, heads, dim, dtype, mla, fused = shape
    return (f"{layers} layers x {dim} {dtype} (MLA)" if mla
            else f"{layers} layers x {heads} heads x {dim} {dtype}"
            + (" (fused K/V rows)" if fused else ""))


def _claim_layout(url: str, model_name: str, world_size: int, g: KVGeometry) -> _LayoutKey:
    key = (url, model_name, world_size)
    shape = _object_shape(g)
    with _layouts_lock:
        held = _layouts.get(key)
        if held is not None and held[0] != shape:
            raise InvalidArgument(
                f"model {model_name!r} / world_size {world_size} is already registered with "
                f"{url} by this process for caches of {_describe(held[0])}; this cache has "
                f"{_describe(shape)}. The server keeps one memory layout per (model, world "
                f"size), so every retrieve of one of them would return False (the server "
                f"only logs a size mismatch). Give this cache its own model_name, or "
                f"unregister the other caches first.")
        _layouts[key] = (shape, 1 if held is None else held[1] + 1)
    return key


def _release_layout(key: _LayoutKey | None) -> None:
    if key is None:
        return
    with _layouts_lock:
        held = _layouts.get(key)
        if held is None:
            return
        if held[1] <= 1:
            del _layouts[key]
        else:
            _layouts[key] = (held[0], held[1] - 1)
