"""The instance-id data-plane calls of earlier releases, kept as the low-level API of
:class:`~lmcache_mp.Client`. Each goes through the :class:`~lmcache_mp.Registration`
of its instance, so it gets the same checks, heartbeat and recovery."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument
from ..ipc.base import ExportableKVCache
from ..ipc.cpu_cache import CpuKVCache
from ..keys import CacheKey
from ..protocol.types import EngineGroupInfo, RegisterEngineDrivenContextResponse
from ..transport import ReplyFuture, blocking
from .blocks import BlockIds
from .connection import Connection
from .registration import Mode, Registration
from .registry import Registry

__all__ = ["InstanceIdAPI"]


class InstanceIdAPI:
    """Mixed into :class:`~lmcache_mp.Client`; needs its connection and registry."""

    _conn: Connection
    _registry: Registry

    if TYPE_CHECKING:  # provided by Client
        def register(self, kv_cache: ExportableKVCache, *, model_name: str, mode: str = "auto",
                     world_size: int = 1, worker_id: int = 0, instance_id: int | None = None,
                     engine_group_infos: Sequence[EngineGroupInfo] | None = None,
                     timeout: float | None = None) -> Registration: ...

        def registration(self, instance_id: int) -> Registration: ...

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
        if not isinstance(instance_id, int) or isinstance(instance_id, bool):
            raise InvalidArgument(f"{op}: instance_id must be an int, got {instance_id!r}")
        reg = self._registry.get(instance_id)
        if reg is None:
            self._conn.call(op, {"instance_id": instance_id}, timeout)
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
        the LOOKUP's read locks). Needs a LOOKUP hit first; False on a miss. Done when
        the blocks are written (the COMMIT's reply is read later: session.commits)."""
        return self._for(instance_id, "engine", "PREPARE_RETRIEVE").retrieve_async(
            key, block_ids, skip_first_n_tokens=skip_first_n_tokens, timeout=timeout)

    retrieve_engine_driven = blocking(retrieve_engine_driven_async)

