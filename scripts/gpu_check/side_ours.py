"""lmcache_mp's own sides: a CudaKVCache per wrapper form registered LMCache-driven,
the same cache engine-driven (the gather path, or the copy plan for a before / after),
and an MLA cache both ways; the engine-driven side measures the pinned-copy floor."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

from .plan import MLA_DIM, Layout, synchronize
from .side_base import Side, choose_copy_path, shared_client


class OursSide(Side):
    """lmcache_mp's CudaKVCache (the dry run: CpuKVCache) with a wrapper form, registered
    LMCache-driven; ``mla``: one latent plane of MLA_DIM per token and layer."""

    def __init__(self, args: argparse.Namespace, layout: Layout, wrapper: str, model: str,
                 mla: bool = False) -> None:
        self.name = f"ours ({wrapper})" if not mla else "ours (MLA)"
        self.args, self.model = args, model
        self.client = shared_client(args)
        self.chunk = self.client.chunk_size()
        geometry: dict[str, Any] = dict(
            num_layers=args.layers, num_blocks=layout.num_blocks, block_size=args.block_size,
            num_heads=1 if mla else args.heads, head_dim=MLA_DIM if mla else args.head_dim,
            dtype="bfloat16", mla=mla)
        if mla:  # [blocks, block_size, MLA_DIM] per layer, one plane
            self.block_axis = 0
            self.bytes_per_token = args.layers * MLA_DIM * 2
        if args.cpu_dry_run:
            from lmcache_mp import CpuKVCache

            self.cache: Any = CpuKVCache.allocate(**geometry)
        else:
            from lmcache_mp.ipc.cuda import CudaKVCache

            # wait_host: return from store/retrieve once the server's copy is done, as
            # LMCache's own future does, so the timings compare like with like.
            self.cache = CudaKVCache.allocate(**geometry, wrapper=wrapper, wait_host=True)
        self.layers = self.cache.torch_layers
        self.instance_id = random.getrandbits(62)
        self.registered = False

    def _key(self, tokens: list[int], size: int, rid: str) -> Any:
        from lmcache_mp import CacheKey

        return CacheKey(model_name=self.model, world_size=1, worker_id=0, token_ids=tokens,
                        start=0, end=size, request_id=rid)

    def register(self) -> float:
        start = time.perf_counter()
        self.client.register_kv_cache(self.cache, instance_id=self.instance_id,
                                      model_name=self.model, timeout=self.args.register_timeout)
        self.registered = True
        return time.perf_counter() - start

    def store(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool:
        return self.client.store(self._key(tokens, size, rid), blocks,
                                 instance_id=self.instance_id)

    def wait_visible(self, tokens: list[int], size: int, rid: str) -> int:
        return self.client.wait_for_lookup(self._key(tokens, size, rid),
                                           timeout=self.args.request_timeout)

    def retrieve(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool:
        return self.client.retrieve(self._key(tokens, size, rid), blocks,
                                    instance_id=self.instance_id)

    def unregister(self) -> None:
        if self.registered:
            self.registered = False
            self.client.unregister_kv_cache(self.instance_id)

    def close(self) -> None:
        self.layers = []
        self.cache.close()  # the shared client is closed at the end of the run


class EngineSide(OursSide):
    """Engine-driven: the same cache registered with mode="engine" (a Registration).
    ``copy_path="plan"``: by the copy plan (one DMA per head and run of blocks)
    instead of the gather path, for a before / after in one run."""

    mode = "engine"
    copy_path = "cpu"

    def __init__(self, args: argparse.Namespace, layout: Layout, model: str,
                 copy_path: str | None = None, mla: bool = False) -> None:
        super().__init__(args, layout, "auto", model, mla)
        self.name = ("ours (MLA, engine)" if mla else
                     "ours (engine-driven" + (", copy plan)" if copy_path == "plan" else ")"))
        self.reg: Any = None
        self.copy_path = choose_copy_path(self.cache, copy_path)

    def register(self) -> float:
        start = time.perf_counter()
        self.reg = self.client.register(self.cache, model_name=self.model, mode=self.mode,
                                        instance_id=self.instance_id,
                                        timeout=self.args.register_timeout)
        self.registered = True
        return time.perf_counter() - start

    def store(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool:
        return bool(self.reg.store(self._key(tokens, size, rid), blocks))

    def retrieve(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool:
        return bool(self.reg.retrieve(self._key(tokens, size, rid), blocks))

    def unregister(self) -> None:
        if self.registered:
            self.registered = False
            self.reg.unregister()

    def memcpy_gbps(self, nbytes: int, reps: int) -> dict[str, float]:
        """The floor the engine-driven copies are judged against, for ``nbytes`` in one
        copy each way, best of ``reps``: device <-> torch's pinned buffer
        (``d2h`` / ``h2d``), and device <-> a registered shared mapping like the server's
        pool (``shm_d2h`` / ``shm_h2d``: an anonymous MAP_SHARED mapping, page-locked
        with cudaHostRegister as the copies page-lock the pool)."""
        import mmap

        import torch

        if self.args.cpu_dry_run:
            dev = torch.empty(nbytes, dtype=torch.uint8)
            host = torch.empty(nbytes, dtype=torch.uint8)
        else:
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out = dict(zip(("d2h", "h2d"), self._best(reps, lambda: host.copy_(dev),
                                                   lambda: dev.copy_(host), nbytes),
                       strict=True))
        mapping = mmap.mmap(-1, nbytes)  # shared, page-aligned: as the pool is mapped
        try:
            out["shm_d2h"], out["shm_h2d"] = self._shm_floor(mapping, dev, nbytes, reps)
        finally:
            mapping.close()
        return out

    def _shm_floor(self, mapping: Any, dev: Any, nbytes: int,
                   reps: int) -> tuple[float, float]:
        import torch

        shm = torch.frombuffer(mapping, dtype=torch.uint8)
        if self.args.cpu_dry_run:  # the same flow, CPU copies
            return self._best(reps, lambda: shm.copy_(dev), lambda: dev.copy_(shm), nbytes)
        from lmcache_mp.ipc.cuda import get_driver

        drv: Any = get_driver()
        addr, ptr = shm.data_ptr(), dev.data_ptr()
        drv.host_register(addr, nbytes)
        try:
            return self._best(reps, lambda: drv.memcpy(addr, ptr, nbytes),
                              lambda: drv.memcpy(ptr, addr, nbytes), nbytes)
        finally:
            drv.host_unregister(addr)

    def _best(self, reps: int, down: Callable[[], Any], up: Callable[[], Any],
              nbytes: int) -> tuple[float, float]:
        d2h, h2d = [], []
        for _ in range(reps):
            synchronize(self.args)
            start = time.perf_counter()
            down()
            synchronize(self.args)
            d2h.append(time.perf_counter() - start)
            start = time.perf_counter()
            up()
            synchronize(self.args)
            h2d.append(time.perf_counter() - start)
        return nbytes / min(d2h) / 1e9, nbytes / min(h2d) / 1e9
