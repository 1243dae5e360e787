#!/usr/bin/env python3
"""The GPU round trip against one real LMCache MP server in GPU mode (run by gpu_check.sh).

For each client side: allocate a paged bf16 KV cache on the GPU (several layers), fill it
with random bits, REGISTER_KV_CACHE (timed), then for each size: STORE from source
blocks, wait until LOOKUP sees every chunk, RETRIEVE into other (zeroed) blocks, and
compare on the GPU: destination == source bit for bit, every other block unchanged.
Then UNREGISTER. Sides:

* torch_ipc / raw / auto: lmcache_mp + CudaKVCache with that wrapper form
* engine:                 lmcache_mp + CudaKVCache registered with mode="engine": this
                          client copies between the GPU blocks and the server's SHM L1
                          pool with CUDA copies (no CUDA IPC; lmcache_mp.ipc.cuda.staging),
                          plus plain device<->pinned-host copies of the same bytes as the
                          bandwidth reference (server started with --shm-name and
                          --no-l1-use-lazy by gpu_check.sh)
* nhd_views:              lmcache_mp + CudaKVCache.from_torch over vLLM-style layers:
                          per-layer NHD [2, blocks, block_size, heads, head_dim] views
                          into ONE torch allocation (each at an offset inside it; the
                          layout read from the strides), registered LMCache-driven
                          (wrapper "auto"). A round trip cannot see a layout the
                          server misreads (the same permutation both ways), so each
                          stored key is also retrieved engine-driven (this client's
                          NHD copy plan reads the server's chunk objects) and compared.
                          The CPU dry run uses an NHD CpuKVCache (HND on 0.5.3 / 0.5.4,
                          whose CPU servers refuse NHD)
* vllm_views / vllm_blocks_first:
                          what the connector registers for vLLM 0.32's OWN KV caches:
                          per-layer 4-D fused K/V views [blocks, heads, block_size,
                          2 * head_size] of ONE allocation, with the shapes, strides and
                          offsets vLLM's allocate_kv_cache made (recorded from vLLM in
                          fixtures/vllm/kv_layouts.json by tools/gen_vllm_kv_layouts.py:
                          8 layers, 8 KV heads of 128, blocks of 16), rebuilt with
                          torch.as_strided and wrapped by the connector's wrap_layers.
                          vllm_views: LBNHC (vLLM's default on a GPU), registered
                          LMCache-driven, each key re-read engine-driven as nhd_views
                          does (the server's GPU copy of fused layers must write the
                          objects this client's plan reads); vllm_blocks_first: BLHNC
                          (every layer's block in one page), engine-driven (the only mode
                          lmcache_mp registers it in). Their own sizes (256 and 4096
                          tokens; the dry run: the tiny recorded geometry, 256)
* lmcache:                LMCache's own worker client (LMCacheDrivenTransferContext over
                          its MessageQueueClient (0.5.3) or RequestClient (0.5.6)),
                          the way vLLM's adapter drives it, producer event kept alive
                          until the reply as the adapter does

A run must never be lost on a lent device, so: every request has a deadline
(``--request-timeout``, ~20 s); each side runs in its own thread and is abandoned
(recorded as hung, with the step it hung in) after ``--side-timeout`` or at
``--deadline``; results are written to ``--out`` (JSON, with the table) after every
side and on SIGTERM; every side's cache stays allocated until the whole run ends (a
freed allocation that the server still maps must not alias the next side's memory);
zmq contexts are destroyed with linger 0, and the process leaves with ``os._exit``
so nothing hung can hold it.

Timings include the request, the server's copy and a host wait for its completion event
(LMCache's future waits on the host, so ours runs with wait_host=True); best of --reps.

Exit status: 0 every side that ran round-tripped, 1 a side failed or hung, 3 no GPU.
``--cpu-dry-run`` runs the same flow against a CPU-mode server with CpuKVCache and CPU
tensors, to rehearse this script on a machine without a GPU; it proves nothing about
CUDA. ``GPU_CHECK_FAULT=hang:SIDE,fail:SIDE`` provokes a hung or failing side (tests).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
# One readiness probe, lmcache-server.sh's too.
from wait_ready import wait_ready  # noqa: E402

SIDES = ("torch_ipc", "raw", "auto", "lmcache", "engine", "engine_plan", "engine_nhd",
         "engine_expandable", "nhd_views", "vllm_views", "vllm_views_engine",
         "vllm_blocks_first")
DEFAULT_SIDES = ("torch_ipc,raw,lmcache,engine,engine_plan,engine_nhd,engine_expandable,"
                 "nhd_views,vllm_views,vllm_views_engine,vllm_blocks_first")
#: Sides that only mean something on a GPU (skipped by the CPU dry run, saying so).
GPU_ONLY_SIDES = {"engine_plan": "the copy plan is CUDA copies; the dry run's cache is a "
                                 "CpuKVCache",
                  "engine_expandable": "expandable segments are CUDA VMM memory"}
#: Sides whose 256-token store / retrieve are profiled (item 2 of
#: issue 31: where a small LMCache-driven transfer's time goes, ours against LMCache's).
PROFILED_SIDES = ("torch_ipc", "lmcache")
SMALL = 1024  # sizes up to this many tokens get --small-reps round trips
VLLM_LAYOUTS = REPO / "fixtures" / "vllm" / "kv_layouts.json"
MIN_SIDE_SECONDS = 15.0  # a side is not started with less time than this left


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--release", default="?", help="the server's LMCache release (label)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sizes", default="256,4096", help="token counts to move, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="round trips per size (best is reported)")
    p.add_argument("--small-reps", type=int, default=20,
                   help=f"round trips for sizes up to {SMALL} tokens (a transfer of a few "
                        f"ms: best of 3 was noise)")
    p.add_argument("--profile", default=",".join(PROFILED_SIDES),
                   help="sides whose 256-token transfers are profiled (cProfile, top "
                        "entries in the JSON); empty: none")
    p.add_argument("--l1-gib", action="store_true",
                   help="print the L1 size (GiB) this run's sides, sizes and reps need, "
                        "and exit")
    p.add_argument("--restart-check", action="store_true",
                   help="the restart step: a registration of each mode round-trips, the "
                        "server is SIGKILLed and restarted (--server-pid-file, "
                        "--server-start-script), both round-trip again; added to --out")
    p.add_argument("--server-pid-file", help="(--restart-check) the server's pid; the "
                                             "restarted server's pid is written here")
    p.add_argument("--server-start-script",
                   help="(--restart-check) a bash script that execs the same server again")
    p.add_argument("--request-timeout", type=float, default=20.0, help="per request, seconds")
    p.add_argument("--register-timeout", type=float, default=45.0)
    p.add_argument("--side-timeout", type=float, default=60.0,
                   help="a side still running after this long is recorded as hung")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="wall-clock time (epoch seconds) by which this run must end")
    p.add_argument("--sides", default=DEFAULT_SIDES,
                   help=f"which clients to run, from {', '.join(SIDES)}")
    p.add_argument("--out", help="write the results as JSON here (after every side)")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="exercise this script against a CPU-mode server (no CUDA involved)")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.profile = [s for s in args.profile.split(",") if s]
    args.sides = [s for s in args.sides.split(",") if s]
    for side in args.sides:
        if side not in SIDES:
            p.error(f"unknown side {side!r}")
    return args


def no_gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    try:
        from cuda.bindings import runtime  # noqa: F401
    except ImportError as exc:
        return f"cuda-bindings does not import ({exc})"
    return None


def raw_wrapper_blocker(release: str) -> str | None:
    """Why the server (same Python environment as this script) cannot open a raw
    wrapper, if it cannot: 0.5.3's RawCudaIPCWrapper.to_tensor assigns
    cudaIpcMemHandle_t.reserved (gone in cuda-bindings 13.4); every release needs cupy."""
    try:
        import cuda.bindings as cb
        from cuda.bindings import runtime as rt
    except ImportError as exc:
        return f"cuda-bindings does not import: {exc}"
    if release in ("0.5.3", "0.5.4") and not hasattr(rt.cudaIpcMemHandle_t(), "reserved"):
        return (f"cuda-bindings {cb.__version__} has no cudaIpcMemHandle_t.reserved, which "
                f"LMCache {release}'s RawCudaIPCWrapper.to_tensor assigns (removed in 13.4)")
    try:
        import cupy  # noqa: F401
    except Exception as exc:
        return f"cupy does not import ({exc!r}); the raw wrapper's to_tensor needs it"
    return None


def faults() -> dict[str, str]:
    """GPU_CHECK_FAULT=hang:lmcache,fail:raw -> {"lmcache": "hang", "raw": "fail"}."""
    out: dict[str, str] = {}
    for item in os.environ.get("GPU_CHECK_FAULT", "").split(","):
        kind, _, side = item.partition(":")
        if kind in ("hang", "fail") and side:
            out[side] = kind
    return out


# ---------------------------------------------------------------- the flow
class Layout:
    """Block ids: per size a source and a destination range, plus guard blocks."""

    def __init__(self, sizes: list[int], block_size: int) -> None:
        self.ranges: dict[int, tuple[list[int], list[int]]] = {}
        nxt = 4  # leading guard blocks
        for size in sizes:
            n = size // block_size
            self.ranges[size] = (list(range(nxt, nxt + n)), list(range(nxt + n, nxt + 2 * n)))
            nxt += 2 * n
        self.num_blocks = nxt + 4  # trailing guard blocks


def blocks_of(t: Any, idx: Any, axis: int) -> Any:
    """The blocks ``idx`` of layer tensor ``t``, whose block axis is ``axis``."""
    return t[idx] if axis == 0 else t[:, idx]


def zero_blocks(t: Any, idx: Any, axis: int) -> None:
    if axis == 0:
        t[idx] = 0
    else:
        t[:, idx] = 0


class Side:
    name = "?"
    chunk = 256
    layers: list[Any]
    #: The block axis of ``layers``: 1 for [2, blocks, ...], 0 for vLLM's 4-D views.
    block_axis = 1
    #: A side with its own geometry sets these (else the run's).
    layout: Layout | None = None
    sizes: list[int] | None = None
    bytes_per_token: int | None = None

    def register(self) -> float: raise NotImplementedError
    def store(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool: ...
    def wait_visible(self, tokens: list[int], size: int, rid: str) -> int: ...
    def retrieve(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool: ...
    def unregister(self) -> None: ...
    def close(self) -> None: ...


class OursSide(Side):
    def __init__(self, args: argparse.Namespace, layout: Layout, wrapper: str, model: str) -> None:
        from lmcache_mp import Client

        self.name = f"ours ({wrapper})"
        self.args, self.model = args, model
        self.client = Client(args.url, timeout=args.request_timeout)
        self.chunk = self.client.chunk_size()
        geometry = dict(num_layers=args.layers, num_blocks=layout.num_blocks,
                        block_size=args.block_size, num_heads=args.heads,
                        head_dim=args.head_dim, dtype="bfloat16")
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
        self.cache.close()
        self.client.close()


def choose_copy_path(cache: Any, want: str | None) -> str:
    """Decide a CUDA cache's engine-driven copy path now (``want``: "plan" forces the
    copy plan, the path before issue 31) and say which it got."""
    if not hasattr(cache, "gather_copier"):
        return "cpu"
    before = os.environ.get("LMCACHE_MP_GPU_COPY")
    if want:
        os.environ["LMCACHE_MP_GPU_COPY"] = want
    try:
        cache.gather_copier()
    finally:
        if before is None:
            os.environ.pop("LMCACHE_MP_GPU_COPY", None)
        else:
            os.environ["LMCACHE_MP_GPU_COPY"] = before
    return str(cache.copy_path)


class EngineSide(OursSide):
    """Engine-driven: the same cache registered with mode="engine" (a Registration).
    ``copy_path="plan"``: by the copy plan (one DMA per head and run of blocks)
    instead of the gather path, for a before / after in one run."""

    mode = "engine"
    copy_path = "cpu"

    def __init__(self, args: argparse.Namespace, layout: Layout, model: str,
                 copy_path: str | None = None) -> None:
        super().__init__(args, layout, "auto", model)
        self.name = "ours (engine-driven" + (", copy plan)" if copy_path == "plan" else ")")
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

    def memcpy_gbps(self, nbytes: int, reps: int) -> tuple[float, float]:
        """Device->pinned-host and back, ``nbytes`` in one copy each (cudaMemcpy via
        torch): the bandwidth the engine-driven copies are measured against."""
        import torch

        if self.args.cpu_dry_run:
            dev = torch.empty(nbytes, dtype=torch.uint8)
            host = torch.empty(nbytes, dtype=torch.uint8)
        else:
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d2h, h2d = [], []
        for _ in range(reps):
            synchronize(self.args)
            start = time.perf_counter()
            host.copy_(dev)
            synchronize(self.args)
            d2h.append(time.perf_counter() - start)
            start = time.perf_counter()
            dev.copy_(host)
            synchronize(self.args)
            h2d.append(time.perf_counter() - start)
        return nbytes / min(d2h) / 1e9, nbytes / min(h2d) / 1e9


class NhdViewsSide(EngineSide):
    """What the vLLM connector registers: per-layer NHD views into one torch allocation
    (every layer at an offset inside it), CudaKVCache.from_torch, LMCache-driven (or,
    ``mode="engine"``, engine-driven: the gather path on NHD)."""

    mode = "lmcache"

    def __init__(self, args: argparse.Namespace, layout: Layout, model: str,
                 mode: str = "lmcache") -> None:
        from lmcache_mp import Client

        self.mode = mode
        self.name = "ours (NHD torch views" + (", engine)" if mode == "engine" else ")")
        self.args, self.model, self.reg = args, model, None
        self.client = Client(args.url, timeout=args.request_timeout)
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

        from lmcache_mp import Client
        from lmcache_mp.integrations.vllm.kv_caches import wrap_layers

        geometry = "tiny" if args.cpu_dry_run else "gpu_check"
        rec = next(x for x in json.loads(VLLM_LAYOUTS.read_text())
                   if x["geometry"] == geometry and x["layout"] == vllm_layout
                   and not x["mla"])
        self.name = f"ours (vLLM {vllm_layout} views)"
        self.args, self.model, self.reg = args, model, None
        self.client = Client(args.url, timeout=args.request_timeout)
        self.chunk = self.client.chunk_size()
        bs = int(rec["block_size"])
        self.sizes = [256] if geometry == "tiny" else [256, 4096]
        self.layout = Layout(self.sizes, bs)
        if self.layout.num_blocks != rec["num_blocks"]:
            raise RuntimeError(f"the recorded {geometry} views have {rec['num_blocks']} "
                               f"blocks, this side's sizes need {self.layout.num_blocks}")
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

        from lmcache_mp import Client
        from lmcache_mp.ipc.cuda import CudaKVCache

        self.name = "ours (expandable segments, engine)"
        self.args, self.model, self.reg = args, model, None
        self.client = Client(args.url, timeout=args.request_timeout)
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
            self.chunk = int(self._call(RequestType.GET_CHUNK_SIZE, []))
        else:
            self.mq = None
            self.rpc = RequestClientFactory.create(args.url, context=self.zctx)
            self.ctx = LMCacheDrivenTransferContext(self.instance_id, self.rpc)
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
        # 0.5.3 passes the instance id with every request; 0.5.6's context holds it.
        ids = (self.instance_id,) if self.rpc is None else ()
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


def synchronize(args: argparse.Namespace) -> None:
    if not args.cpu_dry_run:
        import torch

        torch.cuda.synchronize()


def side_label(name: str) -> str:
    return "LMCache" if name == "lmcache" else f"ours ({name})"


class SideRun:
    """One side's state, shared with the thread that runs it."""

    def __init__(self, name: str, publish: Callable[[], None] = lambda: None) -> None:
        self.name = name
        # Rewrites the results document: called when the side reaches a step where a real
        # run may hang (register), so a run killed there says where it was.
        self.publish = publish
        self.side: Side | None = None
        self.res: dict[str, Any] = {
            "side": side_label(name), "ok": False, "step": "starting", "register_ms": None,
            "store_gbps": {}, "retrieve_gbps": {}, "store_s": {}, "retrieve_s": {},
            "checks": [], "error": None}
        self.thread: threading.Thread | None = None


def run_side(run: SideRun, args: argparse.Namespace, layout: Layout, seed: int,
             fault: str | None) -> None:
    """Run one side's flow, filling ``run.res`` as it goes. Unregisters at the end but
    never frees the cache: the caller keeps it until the whole run is over."""
    import torch

    res = run.res
    rng = random.Random(seed)
    side: Side | None = None
    try:
        # Unique per run: a server that already holds these chunks would skip the STORE.
        model = f"gpu-check-{run.name}-{os.getpid()}-{time.time_ns() % 10**9}"
        res["step"] = "connect and allocate"
        if run.name == "lmcache":
            side = LMCacheSide(args, layout, model)
        elif run.name in ("engine", "engine_plan"):
            side = EngineSide(args, layout, model,
                              "plan" if run.name == "engine_plan" else None)
        elif run.name == "engine_expandable":
            side = ExpandableSide(args, layout, model)
            res["export_kinds"] = side.export_kinds
        elif run.name in ("nhd_views", "engine_nhd"):
            side = NhdViewsSide(args, layout, model,
                                "engine" if run.name == "engine_nhd" else "lmcache")
        elif run.name in ("vllm_views", "vllm_views_engine", "vllm_blocks_first"):
            side = VllmViewsSide(args, model, "BLHNC" if run.name == "vllm_blocks_first"
                                 else "LBNHC",
                                 "engine" if run.name == "vllm_views_engine" else None)
        else:
            side = OursSide(args, layout, run.name, model)
        run.side = side
        res["side"] = side.name
        res["mode"] = getattr(side, "mode", "lmcache")
        if isinstance(side, EngineSide):
            res["copy_path"] = side.copy_path
        layout = side.layout or layout
        ax = side.block_axis
        bytes_per_token = side.bytes_per_token or (
            2 * args.layers * args.heads * args.head_dim * 2)  # K+V, bf16
        dev = side.layers[0].device
        for t in side.layers:
            bits = t.view(torch.int16)
            bits.copy_(torch.randint(-32768, 32768, bits.shape, dtype=torch.int16, device=dev))
        synchronize(args)
        res["step"] = "register"
        run.publish()
        if fault == "fail":
            raise RuntimeError("GPU_CHECK_FAULT: injected failure")
        if fault == "hang":
            threading.Event().wait()  # GPU_CHECK_FAULT: a side that never returns
        res["register_ms"] = side.register() * 1e3
        ok = True
        for size in side.sizes or args.sizes:
            src, dst = layout.ranges[size]
            src_i = torch.tensor(src, device=dev)
            dst_i = torch.tensor(dst, device=dev)
            written = set(dst)
            keep = torch.tensor([b for b in range(layout.num_blocks) if b not in written],
                                device=dev)
            stores, retrieves = [], []
            for rep in range(args.small_reps if size <= SMALL else args.reps):
                rid = f"{model}-{size}-{rep}"
                tokens = [rng.randrange(1, 100_000) for _ in range(size)]
                for t in side.layers:  # the retrieve must write these
                    zero_blocks(t, dst_i, ax)
                snapshot = [t.view(torch.int16).clone() for t in side.layers]
                synchronize(args)
                res["step"] = f"store {size} tokens (rep {rep})"
                start = time.perf_counter()
                if not side.store(tokens, size, src, rid):
                    raise RuntimeError(f"STORE of {size} tokens answered ok=false")
                stores.append(time.perf_counter() - start)
                res["step"] = f"lookup {size} tokens (rep {rep})"
                hits = side.wait_visible(tokens, size, rid)
                if hits * side.chunk < size:
                    raise RuntimeError(f"LOOKUP saw {hits} chunks of {size} tokens")
                res["step"] = f"retrieve {size} tokens (rep {rep})"
                start = time.perf_counter()
                if not side.retrieve(tokens, size, dst, rid):
                    raise RuntimeError(f"RETRIEVE of {size} tokens answered ok=false")
                retrieves.append(time.perf_counter() - start)
                synchronize(args)
                same = all(torch.equal(blocks_of(t.view(torch.int16), src_i, ax),
                                       blocks_of(t.view(torch.int16), dst_i, ax))
                           for t in side.layers)
                untouched = all(torch.equal(blocks_of(t.view(torch.int16), keep, ax),
                                            blocks_of(s, keep, ax))
                                for t, s in zip(side.layers, snapshot, strict=True))
                res["checks"].append({"size": size, "rep": rep, "dst_equals_src": same,
                                      "others_untouched": untouched})
                ok = ok and same and untouched
                cross = getattr(side, "cross_check", None)
                if cross is not None:
                    res["step"] = f"engine-driven re-read {size} tokens (rep {rep})"
                    seen = cross(tokens, size, src_i, dst_i, dst, rid)
                    res["checks"][-1]["engine_rereads_src"] = (
                        seen if seen is not None else f"skipped: {side.engine_error}")
                    ok = ok and seen is not False
                del snapshot
            moved = size * bytes_per_token
            res["store_s"][size] = stores
            res["retrieve_s"][size] = retrieves
            res["store_gbps"][size] = moved / min(stores) / 1e9
            res["retrieve_gbps"][size] = moved / min(retrieves) / 1e9
            res.setdefault("store_gbps_median", {})[size] = moved / statistics.median(stores) / 1e9
            res.setdefault("retrieve_gbps_median", {})[size] = (
                moved / statistics.median(retrieves) / 1e9)
            if isinstance(side, EngineSide) and side.mode == "engine":
                # The floor, measured now, on the same GPU, for the same bytes: what the
                # engine-driven copies are judged against (issue 31: >= 0.6x).
                d2h, h2d = side.memcpy_gbps(moved, max(args.reps, 3))
                res.setdefault("memcpy_d2h_gbps", {})[size] = d2h
                res.setdefault("memcpy_h2d_gbps", {})[size] = h2d
                res.setdefault("store_over_pinned", {})[size] = res["store_gbps"][size] / d2h
                res.setdefault("retrieve_over_pinned", {})[size] = (
                    res["retrieve_gbps"][size] / h2d)
            if run.name in args.profile and size == min(side.sizes or args.sizes):
                # A measurement, not a check: its failure is recorded, not the side's.
                res["step"] = f"profile {size} tokens"
                try:
                    res["profile"] = profile_transfers(side, size, layout, model, rng)
                except Exception as exc:
                    res["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
        if isinstance(side, EngineSide) and side.mode == "engine" and not args.cpu_dry_run:
            from lmcache_mp.ipc.cuda import staging

            res["pool_pinned"] = all(v is not None for v in staging.pinned_pools().values())
        res["step"] = "unregister"
        side.unregister()
        res["ok"] = ok
        res["step"] = "done"
        if not ok:
            res["error"] = "data mismatch (see checks)"
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc} (at step: {res['step']})"
        res["traceback"] = traceback.format_exc()
        if side is not None:
            try:
                side.unregister()
            except Exception:
                pass


def profile_transfers(side: Side, size: int, layout: Layout, model: str,
                      rng: random.Random, pairs: int = 20) -> dict[str, Any]:
    """Where a small transfer's time goes: ``pairs`` STORE / LOOKUP / RETRIEVE rounds of
    ``size`` tokens under cProfile, the top entries by cumulative and by own time (the
    calling thread's: LMCache's client waits there while its I/O thread works)."""
    import cProfile
    import io
    import pstats

    src, dst = layout.ranges[size]
    out: dict[str, Any] = {"pairs": pairs, "size": size}
    prof = cProfile.Profile()
    store_s, retrieve_s = [], []
    for i in range(pairs):
        rid = f"{model}-profile-{i}"
        tokens = [rng.randrange(1, 100_000) for _ in range(size)]
        prof.enable()
        t0 = time.perf_counter()
        side.store(tokens, size, src, rid)
        t1 = time.perf_counter()
        side.wait_visible(tokens, size, rid)
        t2 = time.perf_counter()
        side.retrieve(tokens, size, dst, rid)
        t3 = time.perf_counter()
        prof.disable()
        store_s.append(t1 - t0)
        retrieve_s.append(t3 - t2)
    out["store_ms_median"] = statistics.median(store_s) * 1e3
    out["retrieve_ms_median"] = statistics.median(retrieve_s) * 1e3
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
        out[f"by_{key}"] = buf.getvalue()[-9000:]
    return out


def _call_with_timeout(fn: Any, seconds: float) -> str | None:
    """Run ``fn`` in a daemon thread; an error message, "timed out", or None."""
    box: list[str | None] = ["timed out"]

    def target() -> None:
        try:
            fn()
            box[0] = None
        except Exception as exc:
            box[0] = repr(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return box[0]


def unlink_own_segments() -> None:
    """Remove the SHM names this process made (CPU dry run: our CpuKVCaches'
    ``lmcache_mp_<pid>_*``, LMCache's migrated tensors' ``lmcache_kv_<pid>_*``):
    os._exit skips finalizers, and a hung side is never closed."""
    prefixes = (f"lmcache_mp_{os.getpid()}_", f"lmcache_kv_{os.getpid()}_")
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefixes)]
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


def table(results: list[dict[str, Any]], sizes: list[int]) -> str:
    def cell(r: dict[str, Any], key: str, size: int | None = None) -> str:
        if r.get("skipped"):
            return "skipped"
        v = r.get(key) if size is None else r.get(key, {}).get(size)
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    def verdict(r: dict[str, Any]) -> str:
        if r.get("skipped"):
            return "skipped"
        if r["ok"]:
            return "yes"
        return "HUNG" if r.get("hung") else "CUT" if r.get("interrupted") else "NO"

    rows = [["", *(r["side"] for r in results)]]
    rows.append(["round trip ok", *(verdict(r) for r in results)])
    rows.append(["register ms", *(cell(r, "register_ms") for r in results)])
    rows.append(["mode / copy path", *(
        "-" if r.get("skipped") else
        f"{r.get('mode', '?')}" + (f" / {str(r['copy_path']).split(':')[0]}"
                                   if r.get("mode") == "engine" and r.get("copy_path") else "")
        for r in results)])
    for size in sizes:
        rows.append([f"store GB/s {size} tok", *(cell(r, "store_gbps", size) for r in results)])
        rows.append([f"retrieve GB/s {size} tok",
                     *(cell(r, "retrieve_gbps", size) for r in results)])
        if any(r.get("memcpy_d2h_gbps") for r in results):
            # The engine-driven side's reference: plain copies of the same bytes.
            rows.append([f"D2H copy GB/s {size} tok",
                         *(cell(r, "memcpy_d2h_gbps", size) for r in results)])
            rows.append([f"H2D copy GB/s {size} tok",
                         *(cell(r, "memcpy_h2d_gbps", size) for r in results)])
            rows.append([f"store / pinned copy {size} tok",
                         *(cell(r, "store_over_pinned", size) for r in results)])
            rows.append([f"retrieve / pinned copy {size} tok",
                         *(cell(r, "retrieve_over_pinned", size) for r in results)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


class Report:
    """The results document, rewritten (atomically) after every change."""

    def __init__(self, args: argparse.Namespace, env: dict[str, Any]) -> None:
        self.args, self.env = args, env
        self.results: list[dict[str, Any]] = []
        self.running: str | None = None
        self.state = "running"
        # Re-entrant: the SIGTERM handler writes from the main thread, maybe mid-write.
        self.lock = threading.RLock()

    def doc(self) -> dict[str, Any]:
        title = ("CPU DRY RUN (no CUDA involved)" if self.args.cpu_dry_run
                 else self.env.get("gpu", "GPU"))
        head = (f"LMCache {self.args.release}, {title}: {self.args.layers} layers x "
                f"{self.args.heads} heads x {self.args.head_dim} dim, bf16, block "
                f"{self.args.block_size}, best of {self.args.reps}")
        rows = [{k: v for k, v in r.items() if k != "traceback"} for r in self.results]
        return {"release": self.args.release, "state": self.state, "running": self.running,
                "env": self.env, "args": vars(self.args), "results": self.results,
                "title": head, "table": table(rows, self.args.sizes) if rows else ""}

    def write(self) -> None:
        if not self.args.out:
            return
        with self.lock:
            path = Path(self.args.out)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.doc(), indent=1, default=str))
            os.replace(tmp, path)


def l1_gib(args: argparse.Namespace) -> int:
    """The L1 this run stores into, in GiB: every side's round trips (each rep a key of
    its own), the profiled transfers, the warm-up and the restart step, plus a quarter
    and 1 GiB. A 1 GiB L1 filled after two sides and failed every later one, LMCache's
    own client included (2026-12-04): the server does not evict fast enough to make
    room for a 128 MiB STORE in a full pool."""
    per_token = 2 * args.layers * args.heads * args.head_dim * 2  # K + V, bf16
    stored = 0
    for side in args.sides:
        if args.cpu_dry_run and side in GPU_ONLY_SIDES:
            continue
        sizes = [256, 4096] if side.startswith("vllm_") else args.sizes
        for size in sizes:
            reps = args.small_reps if size <= SMALL else args.reps
            stored += reps * size * per_token * (2 if side == "nhd_views" else 1)
        if side in args.profile:
            stored += 20 * min(sizes) * per_token
    stored += 4 * 2 * 512 * per_token  # the restart step: two registrations, two rounds
    return int(-(-stored * 5 // 4 // (1 << 30))) + 1


def warm_up(args: argparse.Namespace) -> None:
    """One registration of a small cache with this client, before any timed side: a
    fresh server's first registration pays its own first-use start-up (the CUDA
    context of its handler, cupy), which must not be counted against whichever side
    happens to run first (2026-12-04: 166-394 ms for the first side, 10-56 ms after)."""
    from lmcache_mp import Client

    geometry = dict(num_layers=1, num_blocks=8, block_size=args.block_size,
                    num_heads=args.heads, head_dim=args.head_dim, dtype="bfloat16")
    if args.cpu_dry_run:
        from lmcache_mp import CpuKVCache

        cache: Any = CpuKVCache.allocate(**geometry)
    else:
        from lmcache_mp.ipc.cuda import CudaKVCache

        cache = CudaKVCache.allocate(**geometry)
    try:
        with Client(args.url, timeout=args.request_timeout) as client:
            iid = random.getrandbits(62)
            client.register_kv_cache(cache, instance_id=iid, model_name="gpu-check-warm-up",
                                     timeout=args.register_timeout)
            client.unregister_kv_cache(iid)
    finally:
        cache.close()


def restart_check(args: argparse.Namespace) -> int:
    """A registration of each mode (``lmcache``: the server maps the cache; ``engine``:
    this client copies through the pool) round-trips 512 tokens; the server is
    SIGKILLed and started again (``--server-start-script``, its new pid written to
    ``--server-pid-file``); both round-trip again through the same Registration
    objects, which re-register themselves (same instance ids; handles or the new pool).
    Bits compared each time. The result is added to ``--out`` as "restart"."""
    import torch

    from lmcache_mp import CacheKey, Client

    out = Path(args.out) if args.out else None
    doc: dict[str, Any] = {}
    if out is not None and out.exists():
        doc = json.loads(out.read_text())
    res: dict[str, Any] = {"ok": False, "step": "allocate", "pid": os.getpid(), "rounds": []}
    doc["restart"] = res

    def write() -> None:
        if out is not None:
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1, default=str))
            os.replace(tmp, out)

    size, per = 512, 512 // args.block_size
    blocks = 4 + 4 * per
    geometry = dict(num_layers=args.layers, num_blocks=blocks, block_size=args.block_size,
                    num_heads=args.heads, head_dim=args.head_dim, dtype="bfloat16")
    caches: dict[str, Any] = {}
    client = Client(args.url, timeout=args.request_timeout)
    regs: dict[str, Any] = {}
    rng = random.Random(7)
    try:
        for mode in ("lmcache", "engine"):
            if args.cpu_dry_run:
                from lmcache_mp import CpuKVCache

                caches[mode] = CpuKVCache.allocate(**geometry)
            else:
                from lmcache_mp.ipc.cuda import CudaKVCache

                caches[mode] = CudaKVCache.allocate(**geometry, wait_host=True)
            layers = caches[mode].torch_layers
            dev = layers[0].device
            for t in layers:
                bits = t.view(torch.int16)
                bits.copy_(torch.randint(-32768, 32768, bits.shape, dtype=torch.int16,
                                         device=dev))
            res["step"] = f"register {mode}"
            write()
            regs[mode] = client.register(caches[mode], model_name=f"gpu-check-restart-{mode}-"
                                         f"{os.getpid()}", mode=mode,
                                         timeout=args.register_timeout)
        res["instance_ids"] = {m: r.instance_id for m, r in regs.items()}

        def round_trip(phase: str, round_no: int) -> dict[str, Any]:
            out_r: dict[str, Any] = {"phase": phase}
            for mode, reg in regs.items():
                res["step"] = f"{phase}: {mode} round trip"
                write()
                layers = caches[mode].torch_layers
                dev = layers[0].device
                src = list(range(4 + round_no * per, 4 + (round_no + 1) * per))
                dst = list(range(4 + (2 + round_no % 2) * per, 4 + (3 + round_no % 2) * per))
                for t in layers:
                    t[:, dst] = 0
                synchronize(args)
                tokens = [rng.randrange(1, 100_000) for _ in range(size)]
                key = CacheKey(model_name=reg.model_name, world_size=1, worker_id=0,
                               token_ids=tokens, start=0, end=size, request_id=f"{phase}-{mode}")
                t0 = time.perf_counter()
                attempts = 0
                while True:  # the first transfer after a restart re-registers first
                    attempts += 1
                    try:
                        stored = bool(reg.store(key, src))
                    except Exception as exc:
                        stored = False
                        out_r[f"{mode}_store_error"] = f"{type(exc).__name__}: {exc}"
                    if stored or time.perf_counter() - t0 > 30:
                        break
                    time.sleep(0.5)
                hits = client.wait_for_lookup(key, timeout=args.request_timeout) if stored else 0
                got = bool(reg.retrieve(key, dst)) if hits * reg.chunk_size >= size else False
                synchronize(args)
                src_i = torch.tensor(src, device=dev)
                dst_i = torch.tensor(dst, device=dev)
                same = got and all(torch.equal(t.view(torch.int16)[:, src_i],
                                               t.view(torch.int16)[:, dst_i]) for t in layers)
                out_r[mode] = {"stored": stored, "retrieved": got, "bits_equal": same,
                               "attempts": attempts, "instance_id": reg.instance_id,
                               "seconds": time.perf_counter() - t0}
            return out_r

        res["rounds"].append(round_trip("before", 0))
        res["step"] = "SIGKILL and restart the server"
        write()
        old = int(Path(args.server_pid_file).read_text().strip())
        t0 = time.perf_counter()
        os.kill(old, signal.SIGKILL)
        while Path(f"/proc/{old}").exists():
            try:
                if Path(f"/proc/{old}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.05)
        Path(f"/dev/shm/lmcache_l1_pool_{old}").unlink(missing_ok=True)
        proc = subprocess.Popen(["bash", args.server_start_script], stdin=subprocess.DEVNULL)
        Path(args.server_pid_file).write_text(f"{proc.pid}\n")
        ready = wait_ready(args.url, proc.pid, 120)
        res["restart_s"] = time.perf_counter() - t0
        res["new_pid"] = proc.pid
        print(f"gpu_check restart: killed {old}; restarted server ready after "
              f"{res['restart_s']:.0f} s (pid {proc.pid})" if ready == 0 else
              f"gpu_check restart: the restarted server (pid {proc.pid}) is not ready "
              f"({ready})", flush=True)
        if ready != 0:
            raise RuntimeError(f"the restarted server did not answer (wait_ready {ready})")
        res["rounds"].append(round_trip("after", 1))
        res["ok"] = all(r[m]["bits_equal"] for r in res["rounds"] for m in regs)
        res["same_instance_ids"] = all(r[m]["instance_id"] == res["instance_ids"][m]
                                       for r in res["rounds"] for m in regs)
        res["step"] = "done"
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc} (at step: {res['step']})"
        res["traceback"] = traceback.format_exc()
    finally:
        write()
        for reg in regs.values():
            _call_with_timeout(reg.unregister, 10.0)
        _call_with_timeout(client.close, 10.0)
        for cache in caches.values():
            _call_with_timeout(cache.close, 10.0)
        write()
    print(f"gpu_check restart: {'ok' if res['ok'] else 'FAILED'}: " + "; ".join(
        f"{r['phase']} " + " ".join(f"{m} {'yes' if r[m]['bits_equal'] else 'NO'}"
                                     f" ({r[m]['attempts']} tries)" for m in regs)
        for r in res["rounds"]) + (f"; {res.get('error')}" if res.get("error") else ""),
        flush=True)
    unlink_own_segments()
    return 0 if res["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.l1_gib:
        print(l1_gib(args))
        return 0
    if not args.cpu_dry_run:
        reason = no_gpu_reason()
        if reason is not None:
            print(f"gpu_check: no GPU here ({reason}); nothing was run. "
                  f"Use --cpu-dry-run to exercise the script against a CPU server.",
                  file=sys.stderr)
            return 3
    sys.path.insert(0, str(REPO))
    import torch

    if args.restart_check:
        return restart_check(args)
    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cpu_dry_run": args.cpu_dry_run, "pid": os.getpid()}
    if not args.cpu_dry_run:
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        import cuda.bindings as cb

        env["cuda_bindings"] = cb.__version__
    except ImportError:
        pass
    report = Report(args, env)

    def on_term(signum: int, frame: Any) -> None:
        report.state = f"interrupted by signal {signum} while running {report.running}"
        for r in report.results:
            if not r.get("ok") and not r.get("skipped") and r.get("error") is None:
                r.update(interrupted=True, error=f"cut short by signal {signum} at step "
                                                 f"{r.get('step')!r}")
        report.write()
        unlink_own_segments()
        print(f"gpu_check: {report.state}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    report.write()
    started = time.perf_counter()
    env["warm_up_error"] = _call_with_timeout(lambda: warm_up(args), 60.0)
    env["warm_up_s"] = time.perf_counter() - started
    layout = Layout(args.sizes, args.block_size)
    injected = faults()
    runs: list[SideRun] = []
    for i, name in enumerate(args.sides):
        left = args.deadline - time.time() if args.deadline else float("inf")
        if left < MIN_SIDE_SECONDS:
            report.results.append({"side": side_label(name), "ok": False,
                                   "skipped": f"no time left ({left:.0f} s)"})
            report.write()
            continue
        blocker = GPU_ONLY_SIDES.get(name) if args.cpu_dry_run else None
        if blocker:
            blocker = f"dry run: {blocker}"
        if name == "raw" and not args.cpu_dry_run:
            blocker = raw_wrapper_blocker(args.release)
        if blocker:
            report.results.append({"side": side_label(name), "ok": False, "skipped": blocker})
            print(f"gpu_check: {name}: skipped: {blocker}", flush=True)
            report.write()
            continue
        run = SideRun(name, publish=report.write)
        runs.append(run)
        report.running = name
        report.results.append(run.res)
        report.write()
        started = time.perf_counter()
        run.thread = threading.Thread(target=run_side, daemon=True,
                                      args=(run, args, layout, 1000 + i, injected.get(name)))
        run.thread.start()
        run.thread.join(max(1.0, min(args.side_timeout, left - 5)))
        run.res["wall_s"] = time.perf_counter() - started
        if run.thread.is_alive():
            run.res.update(ok=False, hung=True, error=(
                f"no result after {run.res['wall_s']:.0f} s: hung at step "
                f"{run.res['step']!r}; abandoned, its cache kept until the run ends"))
        status = "ok" if run.res["ok"] else f"FAILED: {run.res['error']}"
        print(f"gpu_check: {run.res['side']}: {status} ({run.res['wall_s']:.1f} s)", flush=True)
        if not run.res["ok"] and run.res.get("traceback"):
            print(run.res["traceback"], file=sys.stderr, flush=True)
        report.running = None
        report.write()
    # Only now, every side done: free the caches and close the clients, never waiting
    # long on any of them (a hung side's objects are left alone).
    for run in runs:
        if run.side is not None and run.thread is not None and not run.thread.is_alive():
            err = _call_with_timeout(run.side.close, 10.0)
            if err:
                run.res["close_error"] = err
    report.state = "done"
    report.write()
    unlink_own_segments()
    doc = report.doc()
    print(f"\n{doc['title']}\n")
    print(doc["table"], flush=True)
    ran = [r for r in report.results if not r.get("skipped")]
    return 0 if ran and all(r["ok"] for r in ran) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never wait on a hung side's thread or a zmq context at exit
