"""LMCache's own worker-side client, side by side with ours: the way vLLM's MP adapter
drives it (0.5.3's MessageQueueClient + RequestType, 0.5.6's RequestClient, 0.5.7rc2's
token_bytes keys)."""

from __future__ import annotations

import argparse
import inspect
import random
import time
from typing import Any

from .plan import Layout
from .side_base import Side


class LMCacheSide(Side):
    """LMCache's own worker-side client, the way vLLM's MP adapter drives it: 0.5.3's
    MessageQueueClient + RequestType, or 0.5.6's method-oriented RequestClient."""

    def __init__(self, args: argparse.Namespace, layout: Layout, model: str) -> None:
        import torch
        import zmq
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
            LMCacheDrivenTransferContext,
        )

        self.name = "LMCache"
        self.args, self.model, self.Key = args, model, IPCCacheServerKey
        fields = getattr(IPCCacheServerKey, "__dataclass_fields__", {})
        self.has_readers = "num_kv_readers" in fields
        # 0.5.7rc2: the key carries token_bytes (packed big-endian uint32s) in place of
        # the token_ids tuple, packed by LMCache's own token_codec.
        self.pack: Any = None
        if "token_bytes" in fields:
            from lmcache.v1.multiprocess.token_codec import pack_token_ids

            self.pack = pack_token_ids
        self.zctx = zmq.Context()
        self.instance_id = random.getrandbits(62)
        try:
            from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
        except ImportError:  # 0.5.3-0.5.5: the op-enum message queue
            from lmcache.v1.multiprocess.mq import MessageQueueClient
            from lmcache.v1.multiprocess.protocol import get_response_class
            from lmcache.v1.multiprocess.protocols.base import RequestType

            self.rpc = None
            self.RT, self.get_response_class = RequestType, get_response_class
            self.mq = MessageQueueClient(args.url, self.zctx)
            self.ctx = LMCacheDrivenTransferContext()
            self.ctx_holds_id = False
            self.chunk = int(self._call(RequestType.GET_CHUNK_SIZE, []))
        else:
            self.mq = None
            self.rpc = RequestClientFactory.create(args.url, context=self.zctx)
            # 0.5.6+: the context holds the instance id and the client. 0.5.5 has the
            # client factory already but a bare context, given the client at register()
            # and the instance id with every transfer, as 0.5.3's.
            self.ctx_holds_id = "req_client" in inspect.signature(
                LMCacheDrivenTransferContext).parameters
            self.ctx = (LMCacheDrivenTransferContext(self.instance_id, self.rpc)
                        if self.ctx_holds_id else LMCacheDrivenTransferContext())
            self.chunk = int(self.rpc.get_chunk_size().result(timeout=args.request_timeout))
        self.blocks_in_chunk = self.chunk // args.block_size
        device = "cpu" if args.cpu_dry_run else "cuda"
        shape = (2, layout.num_blocks, args.heads, args.block_size, args.head_dim)  # HND
        self.layers = [torch.zeros(shape, dtype=torch.bfloat16, device=device)
                       for _ in range(args.layers)]
        self.kv_caches = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(self.layers)}
        self.shm_names: list[str] = []
        if args.cpu_dry_run:
            # What register() does to CPU tensors anyway; done first to learn the SHM
            # names and unlink them at the end.
            try:
                from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap
            except ImportError:
                from lmcache.v1.platform.cpu.shm import migrate_to_shm_and_wrap
            self.shm_names = [migrate_to_shm_and_wrap(t).shm_name for t in self.layers]
        self.registered = False
        self.pending_event: Any = None

    def _send(self, rt: Any, payloads: list[Any]) -> Any:
        assert self.mq is not None
        return self.mq.submit_request(rt, payloads, self.get_response_class(rt))

    def _call(self, rt: Any, payloads: list[Any]) -> Any:
        return self._send(rt, payloads).result(timeout=self.args.request_timeout)

    def _key(self, tokens: list[int], size: int, rid: str, worker: int | None = 0) -> Any:
        # 0.5.5+ keys carry num_kv_readers (LOOKUP drops keys without readers).
        extra: dict[str, Any] = {"num_kv_readers": 1} if self.has_readers else {}
        if self.pack is not None:
            extra["token_bytes"] = self.pack(tokens)
        else:
            extra["token_ids"] = tuple(tokens)
        return self.Key(model_name=self.model, world_size=1, worker_id=worker, start=0,
                        end=size, request_id=rid, **extra)

    def register(self) -> float:
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo

        groups = [EngineGroupInfo(0, tuple(range(self.args.layers)), self.args.block_size)]
        start = time.perf_counter()
        if self.rpc is None:
            self.ctx.register(
                self.instance_id, self.kv_caches, self.model, 1, self.blocks_in_chunk,
                self.mq, self.args.register_timeout,
                send_request=lambda mq, rt, p: self._send(rt, p),
                layout_hints={"kv_layout": "HND"}, engine_group_infos=groups,
                engine_type=EngineType.VLLM)
        elif not self.ctx_holds_id:  # 0.5.5
            self.ctx.register(
                self.instance_id, self.kv_caches, self.model, 1, self.blocks_in_chunk,
                self.rpc, self.args.register_timeout, layout_hints={"kv_layout": "HND"},
                engine_group_infos=groups, engine_type=EngineType.VLLM)
        else:
            self.ctx.register(
                self.kv_caches, self.model, 1, self.blocks_in_chunk,
                self.args.register_timeout, layout_hints={"kv_layout": "HND"},
                engine_group_infos=groups, engine_type=EngineType.VLLM)
        self.registered = True
        return time.perf_counter() - start

    def _event(self) -> Any:
        # vLLM records the event on its stream after the work the transfer must follow,
        # and keeps it until the reply (adapter: store_events / retrieve_events): the
        # server opens the handle only when it handles the request.
        make = getattr(self.ctx, "create_recorded_event", None)
        if make is not None:
            return make()
        from lmcache import torch_dev

        event = torch_dev.Event(interprocess=True)
        event.record()
        return event

    def _transfer(self, submit: Any, rid: str, key: Any, blocks: list[int],
                  *extra: Any) -> bool:
        # 0.5.3-0.5.5 pass the instance id with every request; 0.5.6's context holds it.
        ids = () if self.ctx_holds_id else (self.instance_id,)
        self.pending_event = self._event()
        try:
            fut = submit(rid, key, *ids, self.kv_caches, [blocks], self.pending_event,
                         self.blocks_in_chunk, *extra)
            return bool(fut.result(timeout=self.args.request_timeout))
        finally:
            self.pending_event = None  # released only once the reply is in

    def store(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool:
        return self._transfer(self.ctx.submit_store, rid, self._key(tokens, size, rid), blocks)

    def retrieve(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool:
        return self._transfer(self.ctx.submit_retrieve, rid, self._key(tokens, size, rid),
                              blocks, 0)

    def _lookup_round(self, key: Any, rid: str) -> int:
        timeout = self.args.request_timeout
        if self.rpc is None:
            self._call(self.RT.LOOKUP, [key, 1])
            return int(self._call(self.RT.WAIT_PREFETCH_STATUS, [rid, 5.0]) or 0)
        self.rpc.lookup(key, 1).result(timeout=timeout)
        return int(self.rpc.wait_prefetch_status(rid, 5.0).result(timeout=timeout) or 0)

    def _free_locks(self, key: Any) -> None:
        if self.rpc is None:
            self._call(self.RT.FREE_LOOKUP_LOCKS, [key, 1])
        else:
            self.rpc.free_lookup_locks(key, 1).result(timeout=self.args.request_timeout)

    def wait_visible(self, tokens: list[int], size: int, rid: str) -> int:
        want = size // self.chunk
        deadline = time.monotonic() + self.args.request_timeout
        while True:
            hits = self._lookup_round(self._key(tokens, size, rid, worker=None), rid)
            if hits >= want or time.monotonic() > deadline:
                return hits
            if hits:
                self._free_locks(self._key(tokens, hits * self.chunk, rid, worker=None))
            time.sleep(0.02)

    def unregister(self) -> None:
        if not self.registered:
            return
        self.registered = False
        if self.rpc is None:
            self._call(self.RT.UNREGISTER_KV_CACHE, [self.instance_id])
        elif not self.ctx_holds_id:  # 0.5.5's context has no unregister()
            self.rpc.unregister_kv_cache(self.instance_id).result(
                timeout=self.args.request_timeout)
        else:
            fut = self.ctx.unregister()
            if fut is not None:
                fut.result(timeout=self.args.request_timeout)

    def close(self) -> None:
        import gc

        self.ctx.close()
        self.kv_caches.clear()
        self.layers = []
        gc.collect()
        if self.shm_names:
            from lmcache.v1.multiprocess.posix_shm import shm_unlink

            for name in self.shm_names:
                try:
                    shm_unlink(name)
                except FileNotFoundError:
                    pass
        for client in (self.rpc, self.mq):
            if client is not None:
                client.close()
        # term() would wait for unsent messages of sockets closed with the default
        # linger: never block the run on that.
        self.zctx.destroy(linger=0)
