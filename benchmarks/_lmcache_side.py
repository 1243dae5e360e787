"""LMCache 0.5.3's own worker-side client, driven the way vLLM's MP adapter drives it on
a CPU worker, for benchmarks/data_plane.py. Imports lmcache: oracle venv only.

Both transfer modes go through LMCache's own transfer contexts
(``lmcache.v1.multiprocess.transfer_context.worker_transfer``), exactly as
``LMCacheMPWorkerAdapter`` does: a ``kv_caches`` dict of per-layer torch tensors, HND
layout with ``{"kv_layout": "HND"}`` hints, ``submit_store`` / ``submit_retrieve``
futures resolved with ``.result()``.

* lmcache_driven: ``LMCacheDrivenTransferContext``. Registration wraps each layer with
  ``migrate_to_shm_and_wrap`` (storage moved into a ``/lmcache_kv_<pid>_<n>`` SHM
  segment), STORE / RETRIEVE carry block ids and the CPU stub event; the server copies.
* engine_driven: ``EngineDrivenTransferContext`` (the synchronous one: the async one
  needs device streams), backed by ``EngineDrivenContextShm``: PREPARE_*, then
  ``gather_paged_kv_to_cpu`` / ``scatter_cpu_to_paged_kv`` between the worker's tensors
  and slot views of the server's L1 pool, then COMMIT_*. The tensors are plain torch
  tensors, as vLLM allocates them.

Lookups use LOOKUP + WAIT_PREFETCH_STATUS on the same ``MessageQueueClient``.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import zmq
from lmcache import torch_dev
from lmcache.utils import EngineType
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.mq import MessageQueueClient
from lmcache.v1.multiprocess.posix_shm import shm_unlink
from lmcache.v1.multiprocess.protocol import get_response_class
from lmcache.v1.multiprocess.protocols.base import RequestType
from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
    EngineDrivenTransferContext,
    LMCacheDrivenTransferContext,
)
from lmcache.v1.platform.cpu.shm import CpuShmTensorWrapper, migrate_to_shm_and_wrap

TIMEOUT = 30.0
HINTS: Any = {"kv_layout": "HND"}


def send_request(mq: MessageQueueClient, rt: RequestType, payloads: list[object]) -> Any:
    """vLLM's ``send_lmcache_request``."""
    return mq.submit_request(rt, payloads, get_response_class(rt))


def lmcache_kv_segments() -> set[str]:
    """This process's LMCache CPU KV segments in /dev/shm."""
    prefix = f"{CpuShmTensorWrapper.SHM_NAME_PREFIX.lstrip('/')}{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


class LMCacheConnection:
    """One MessageQueueClient (and zmq context) shared by LMCache's sides."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.Context()
        self.mq = MessageQueueClient(url, self.ctx)

    def call(self, rt: RequestType, payloads: list[object], timeout: float = TIMEOUT) -> Any:
        return send_request(self.mq, rt, payloads).result(timeout=timeout)

    def chunk_size(self) -> int:
        return int(self.call(RequestType.GET_CHUNK_SIZE, []))

    def close(self) -> None:
        self.mq.close()
        self.ctx.term()


class LMCacheSide:
    """A registered KV cache driven by LMCache's own worker transfer context."""

    def __init__(self, conn: LMCacheConnection, mode: str, *, num_layers: int, num_blocks: int,
                 num_heads: int, block_size: int, head_dim: int, dtype: str, chunk_size: int,
                 instance_id: int, model_name: str) -> None:
        self.conn, self.mode = conn, mode
        self.instance_id, self.model_name = instance_id, model_name
        self.chunk_size = chunk_size
        self.blocks_in_chunk = chunk_size // block_size
        shape = (2, num_blocks, num_heads, block_size, head_dim)  # HND, like lmcache_mp's
        self.layers = [torch.zeros(shape, dtype=getattr(torch, dtype)) for _ in range(num_layers)]
        self.kv_caches = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(self.layers)}
        self.shm_names: list[str] = []
        if mode == "lmcache_driven":
            # What wrap_kv_caches() does inside register(); done first only to learn the
            # segment names for cleanup (the call is idempotent per tensor).
            self.shm_names = [migrate_to_shm_and_wrap(t).shm_name for t in self.layers]
            self.ctx: Any = LMCacheDrivenTransferContext()
        else:
            self.ctx = EngineDrivenTransferContext()
        self.registered = False
        try:
            self.ctx.register(
                instance_id, self.kv_caches, model_name, 1, self.blocks_in_chunk, conn.mq,
                TIMEOUT, send_request=send_request, layout_hints=HINTS,
                engine_group_infos=[EngineGroupInfo(0, tuple(range(num_layers)), block_size)],
                engine_type=EngineType.VLLM,
            )
        except BaseException:
            self._release()
            raise
        self.registered = True

    # ------------------------------------------------------------------ data
    def fill(self, block_ids: Sequence[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        idx = torch.as_tensor(list(block_ids))
        for t in self.layers:
            raw = t.view(torch.uint8)
            raw[:, idx] = torch.randint(0, 256, raw[:, idx].shape, dtype=torch.uint8, generator=gen)

    def zero(self, block_ids: Sequence[int]) -> None:
        idx = torch.as_tensor(list(block_ids))
        for t in self.layers:
            t[:, idx] = 0

    def same_bytes(self, a: Sequence[int], b: Sequence[int]) -> bool:
        ia, ib = torch.as_tensor(list(a)), torch.as_tensor(list(b))
        return all(torch.equal(t.view(torch.uint8)[:, ia], t.view(torch.uint8)[:, ib])
                   for t in self.layers)

    # ----------------------------------------------------------------- keys
    def key(self, tokens: Sequence[int], rid: str, worker_id: int | None = 0,
            end: int | None = None) -> IPCCacheServerKey:
        return IPCCacheServerKey(self.model_name, 1, worker_id, tuple(tokens), 0,
                                 len(tokens) if end is None else end, rid)

    # ----------------------------------------------------------------- ops
    def store(self, key: IPCCacheServerKey, block_ids: list[int]) -> float:
        event = torch_dev.Event(interprocess=True)
        start = time.perf_counter()
        ok = self.ctx.submit_store(key.request_id, key, self.instance_id, self.kv_caches,
                                   [block_ids], event, self.blocks_in_chunk).result(timeout=TIMEOUT)
        elapsed = time.perf_counter() - start
        if not ok:
            raise RuntimeError(f"LMCache {self.mode} store failed")
        return elapsed

    def retrieve(self, key: IPCCacheServerKey, block_ids: list[int]) -> float:
        event = torch_dev.Event(interprocess=True)
        start = time.perf_counter()
        ok = self.ctx.submit_retrieve(key.request_id, key, self.instance_id, self.kv_caches,
                                      [block_ids], event, self.blocks_in_chunk, 0).result(timeout=TIMEOUT)
        elapsed = time.perf_counter() - start
        if not ok:
            raise RuntimeError(f"LMCache {self.mode} retrieve failed")
        return elapsed

    def lookup(self, key: IPCCacheServerKey) -> tuple[int, float]:
        """LOOKUP + WAIT_PREFETCH_STATUS (as the bench / scheduler do): hit chunks."""
        start = time.perf_counter()
        self.conn.call(RequestType.LOOKUP, [key, 1])
        hits = self.conn.call(RequestType.WAIT_PREFETCH_STATUS, [key.request_id, 5.0])
        return int(hits or 0), time.perf_counter() - start

    def free_locks(self, key: IPCCacheServerKey, hits: int) -> None:
        self.conn.call(RequestType.FREE_LOOKUP_LOCKS, [
            IPCCacheServerKey(key.model_name, key.world_size, None, key.token_ids, 0,
                              hits * self.chunk_size, key.request_id), 1])

    def end_session(self, rid: str) -> None:
        self.conn.call(RequestType.END_SESSION, [rid])

    def close(self) -> None:
        try:
            if self.registered:
                rt = (RequestType.UNREGISTER_KV_CACHE if self.mode == "lmcache_driven"
                      else RequestType.UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT)
                self.registered = False
                self.conn.call(rt, [self.instance_id])
        finally:
            self._release()

    def _release(self) -> None:
        self.ctx.close()
        # The migrated tensors unlink their segments when collected; make sure.
        self.kv_caches.clear()
        self.layers.clear()
        gc.collect()
        for name in self.shm_names:
            shm_unlink(name)
