"""Sides over torch tensors laid out as engines lay them: NHD views into one allocation,
vLLM 0.32's own fused K/V views (recorded from vLLM, fixtures/vllm/kv_layouts.json),
PyTorch's expandable segments (CUDA VMM memory)."""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

from .plan import VLLM_LAYOUTS, Layout, blocks_of, synchronize, zero_blocks
from .side_base import choose_copy_path, shared_client
from .side_ours import EngineSide


class NhdViewsSide(EngineSide):
    """What the vLLM connector registers: per-layer NHD views into one torch allocation
    (every layer at an offset inside it), CudaKVCache.from_torch, LMCache-driven (or,
    ``mode="engine"``, engine-driven: the gather path on NHD)."""

    mode = "lmcache"

    def __init__(self, args: argparse.Namespace, layout: Layout, model: str,
                 mode: str = "lmcache") -> None:
        self.mode = mode
        self.name = "ours (NHD torch views" + (", engine)" if mode == "engine" else ")")
        self.args, self.model, self.reg = args, model, None
        self.client = shared_client(args)
        self.chunk = self.client.chunk_size()
        shape = (2, layout.num_blocks, args.block_size, args.heads, args.head_dim)
        if args.cpu_dry_run:
            from lmcache_mp import CpuKVCache

            nhd = "HND" if args.release in ("0.5.3", "0.5.4") else "NHD"
            self.cache: Any = CpuKVCache.allocate(
                num_layers=args.layers, num_blocks=layout.num_blocks,
                block_size=args.block_size, num_heads=args.heads, head_dim=args.head_dim,
                dtype="bfloat16", layout=nhd)
            self.layers = self.cache.torch_layers
        else:
            import torch

            from lmcache_mp.ipc.cuda import CudaKVCache

            n = 2 * layout.num_blocks * args.block_size * args.heads * args.head_dim
            pad = 4096  # elements before layer 0: no layer is at the allocation's base
            self.big: Any = torch.zeros(pad + args.layers * n, dtype=torch.bfloat16,
                                        device="cuda")
            self.layers = [self.big[pad + i * n: pad + (i + 1) * n].view(shape)
                           for i in range(args.layers)]
            self.cache = CudaKVCache.from_torch(self.layers, layout="NHD", wait_host=True)
            if self.cache.kv_layout != "NHD" or not all(e.offset for e in self.cache.exports):
                raise RuntimeError(f"from_torch read layout {self.cache.kv_layout}, offsets "
                                   f"{[e.offset for e in self.cache.exports]}")
        self.copy_path = choose_copy_path(self.cache, None)
        self.instance_id = random.getrandbits(62)
        self.registered = False

    engine_reg: Any = None
    engine_error: str | None = None

    def cross_check(self, tokens: list[int], size: int, src_i: Any, dst_i: Any,
                    dst: list[int], rid: str) -> bool | None:
        """Zero ``dst``, RETRIEVE the key again through an engine-driven registration of
        the same memory, and compare with ``src``: None if the server has no pool."""
        import torch

        if self.mode == "engine":  # the round trip was engine-driven already
            return True
        if self.engine_reg is None and self.engine_error is None:
            try:
                self.engine_reg = self.client.register(
                    self.cache, model_name=self.model, mode="engine",
                    timeout=self.args.register_timeout)
            except Exception as exc:
                self.engine_error = f"{type(exc).__name__}: {exc}"
        if self.engine_reg is None:
            return None
        ax = self.block_axis
        for t in self.layers:
            zero_blocks(t, dst_i, ax)
        synchronize(self.args)
        if self.wait_visible(tokens, size, rid) * self.chunk < size:
            return False
        if not self.engine_reg.retrieve(self._key(tokens, size, rid), dst):
            return False
        synchronize(self.args)
        return all(torch.equal(blocks_of(t.view(torch.int16), src_i, ax),
                               blocks_of(t.view(torch.int16), dst_i, ax))
                   for t in self.layers)

    def unregister(self) -> None:
        if self.engine_reg is not None:
            reg, self.engine_reg = self.engine_reg, None
            reg.unregister()
        super().unregister()

    def close(self) -> None:
        super().close()
        self.big = None


class VllmViewsSide(NhdViewsSide):
    """vLLM 0.32's own KV caches (the module docstring): the views its allocator made,
    rebuilt from the recorded shapes, strides and offsets, wrapped as the connector
    wraps them."""

    block_axis = 0

    def __init__(self, args: argparse.Namespace, model: str, vllm_layout: str,
                 mode: str | None = None) -> None:
        import torch

        from lmcache_mp.integrations.vllm.kv_caches import wrap_layers

        geometry = "tiny" if args.cpu_dry_run else "gpu_check"
        rec = next(x for x in json.loads(VLLM_LAYOUTS.read_text())
                   if x["geometry"] == geometry and x["layout"] == vllm_layout
                   and not x["mla"])
        self.name = f"ours (vLLM {vllm_layout} views)"
        self.args, self.model, self.reg = args, model, None
        self.client = shared_client(args)
        self.chunk = self.client.chunk_size()
        bs = int(rec["block_size"])
        self.sizes = [256] if geometry == "tiny" else [256, 4096]
        # The block ids drawn among the recorded cache's blocks (scattered: all of them,
        # shuffled; its 8 layers are vLLM's own recording, not the run's --layers).
        self.layout = Layout(self.sizes, bs, args.scattered, num_blocks=rec["num_blocks"])
        self.bytes_per_token = (len(rec["layers"]) * rec["heads"] * 2 * rec["head_size"]
                                * 2)
        device = "cpu" if args.cpu_dry_run else "cuda"
        self.big: Any = torch.zeros(rec["alloc_bytes"] // 2, dtype=torch.bfloat16,
                                    device=device)
        self.layers = [torch.as_strided(self.big, x["shape"], x["stride"],
                                        x["storage_offset"]) for x in rec["layers"]]
        self.cache = wrap_layers(self.layers, bs, "auto")
        # Layer-compact on a GPU: the server maps the memory; blocks-first (and CPU
        # memory, the dry run): engine-driven copies only.
        self.mode = mode or ("lmcache" if not args.cpu_dry_run
                             and not vllm_layout.startswith("BL") else "engine")
        if mode == "engine":
            self.name = f"ours (vLLM {vllm_layout} views, engine)"
        self.copy_path = choose_copy_path(self.cache, None)
        self.instance_id = random.getrandbits(62)
        self.registered = False


class ExpandableSide(EngineSide):
    """An HND cache in PyTorch's expandable segments (CUDA VMM memory, as vLLM 0.34's
    extensible cache is): CUDA IPC cannot name it and no released server opens its
    POSIX-fd export, so it moves engine-driven only (the gather path)."""

    def __init__(self, args: argparse.Namespace, layout: Layout, model: str) -> None:
        import torch

        from lmcache_mp.ipc.cuda import CudaKVCache

        self.name = "ours (expandable segments, engine)"
        self.args, self.model, self.reg = args, model, None
        self.client = shared_client(args)
        self.chunk = self.client.chunk_size()
        shape = (args.layers, 2, layout.num_blocks, args.heads, args.block_size,
                 args.head_dim)
        # The allocator setting applies to segments made from now on (vLLM's sleep mode
        # toggles it the same way); restored at once for the other sides.
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        try:
            self.big: Any = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        finally:
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        self.layers = list(self.big.unbind(0))
        self.cache = CudaKVCache.from_torch(self.layers, layout="HND", wait_host=True)
        self.export_kinds = sorted({e.vmm.kind if e.vmm is not None else "legacy"
                                    for e in self.cache.exports})
        self.copy_path = choose_copy_path(self.cache, None)
        self.instance_id = random.getrandbits(62)
        self.registered = False

    def close(self) -> None:
        super().close()
        self.big = None
