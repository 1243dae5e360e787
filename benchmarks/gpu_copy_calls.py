"""How many GPU operations one engine-driven transfer takes: the copy plan (one DMA per
head and run of blocks, ``lmcache_mp.ipc.cuda.staging``) against the gather path
(``lmcache_mp.ipc.cuda.gather``: gathers on the GPU, one DMA per chunk object).

Counted, not timed: it needs no GPU. The gather path's numbers come from running its
real code (``GatherCopier.store`` / ``retrieve``) over a counting driver whose device
tensors are torch "meta" tensors (shapes, no memory): every torch operation that
touches memory is a kernel, every ``cudaMemcpy2DAsync`` a DMA, and the events and
host waits are counted too. The copy plan's are the length of the plan it builds. What
made the plan slow on an H200: thousands of small DMAs per transfer, 4-5 GB/s against
a 52-55 GB/s pinned copy (2026-12-04); speeds come from ``scripts/gpu_check.sh`` on a
lent device.

    .venv/bin/python benchmarks/gpu_copy_calls.py [--tokens 4096] [--chunk 256]
"""

from __future__ import annotations

import argparse
import ctypes
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from lmcache_mp.ipc.base import KVGeometry
from lmcache_mp.ipc.cuda import staging
from lmcache_mp.ipc.cuda.gather import STAGING_LIMIT_BYTES, GatherCopier


class CountingDriver:
    """The gather path's driver calls, counted; device memory as meta tensors."""

    def __init__(self, allocation: int) -> None:
        self.counts: Counter[str] = Counter()
        self.allocation = allocation  # bytes of the allocation holding the layers
        self._host: dict[int, Any] = {}
        self._next = 0x7F00_0000_0000

    # what on_device asks
    def get_device(self) -> int:
        return 0

    def set_device(self, device: int) -> None: ...

    def current_context(self) -> int:
        return 1

    def address_range(self, ptr: int) -> tuple[int, int]:
        return 0x1000_0000, self.allocation

    def torch_bytes(self, ptr: int, nbytes: int, device: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    @contextmanager
    def torch_stream(self, stream: int, device: int) -> Iterator[None]:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts

        class Kernels(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                # Views and the meta tensors standing for device memory (torch_bytes:
                # on CUDA a view of a pointer) launch nothing.
                if not func.is_view and func is not torch.ops.aten.empty.memory_format:
                    counts["kernels"] += 1
                return func(*args, **(kwargs or {}))

        with Kernels():
            yield

    def alloc_buffer(self, nbytes: int, device: int) -> int:
        self._next += nbytes + (1 << 20)
        return self._next

    def free_buffer(self, ptr: int) -> None: ...

    def malloc_host(self, nbytes: int) -> int:
        buf = (ctypes.c_uint8 * nbytes)()
        self._host[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free_host(self, ptr: int) -> None:
        del self._host[ptr]

    def memcpy_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                        height: int, stream: int) -> None:
        self.counts["DMAs" if src not in self._host else "index copies"] += 1

    def stream_create(self) -> int:
        return 0x5000

    def stream_destroy(self, stream: int) -> None: ...

    def event_create(self) -> object:
        return object()

    def event_destroy(self, event: object) -> None: ...

    def event_record(self, event: object, stream: int) -> None:
        self.counts["event records"] += 1

    def stream_wait_event(self, stream: int, event: object) -> None:
        self.counts["event waits"] += 1

    def stream_synchronize(self, stream: int) -> None:
        self.counts["host waits"] += 1


def gather_counts(g: KVGeometry, ids: np.ndarray, chunk: int, one_allocation: bool,
                  retrieve: bool = False) -> Counter[str]:
    """The gather path's operations for one STORE (or RETRIEVE) of ``ids`` through a
    cache whose staging an earlier transfer allocated (the first transfer of a cache
    allocates it: a RETRIEVE then adds one event record and wait, its first DMA
    ordered after the allocating stream): layers one allocation at a constant stride
    (vLLM's layouts) or separate allocations."""
    chunks = len(ids) * g.block_size // chunk
    stride = g.layer_nbytes if not g.block_stride else g.head_dim * g.itemsize * (
        g.num_heads * g.block_size)
    span = stride * (g.num_layers - 1) + g.layer_nbytes
    drv = CountingDriver(span if one_allocation else g.layer_nbytes)
    layers = [0x1000_0000 + i * stride for i in range(g.num_layers)]
    copier = GatherCopier(drv, 0, g, layers)  # type: ignore[arg-type]
    slots = [0x9_0000_0000 + i * (1 << 28) for i in range(chunks)]
    for _ in range(2):  # the second transfer counted: staging allocated by the first
        drv.counts.clear()
        if retrieve:
            copier.retrieve(ids, slots, chunk, 0, 7)
        else:
            copier.store(ids, slots, list(range(chunks)), chunk, 7)
    copier.close()
    return drv.counts


def plan_calls(g: KVGeometry, ids: np.ndarray, chunk: int) -> int:
    chunks = len(ids) * g.block_size // chunk
    layers = [0x1000_0000 * (i + 1) for i in range(g.num_layers)]
    slots = [0x9_0000_0000 + i * (1 << 28) for i in range(chunks)]
    return len(staging.store_plan(g, layers, ids, slots, list(range(chunks)), chunk))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    args = p.parse_args()
    nb, bs = 20000, 16
    n = args.tokens // bs
    rng = np.random.default_rng(0)
    orders = {"consecutive": np.arange(1, n + 1, dtype=np.int64),
              "scattered": rng.permutation(np.arange(1, nb))[:n].astype(np.int64)}
    layers = 32  # Llama-3-8B: 32 layers x 8 KV heads x 128, bf16
    geometries = {
        "HND [2, blocks, heads, 16, 128] per layer": (
            KVGeometry(layers, nb, bs, 8, 128, "bfloat16", False), False),
        "NHD per layer": (KVGeometry(layers, nb, bs, 8, 128, "bfloat16", False, "NHD"), False),
        "vLLM LBHNC (fused K/V, one allocation)": (
            KVGeometry(layers, nb, bs, 8, 256, "bfloat16", False, "HND", True), True),
        "vLLM LBNHC (fused K/V, one allocation)": (
            KVGeometry(layers, nb, bs, 8, 256, "bfloat16", False, "NHD", True), True),
        "vLLM BLHNC (blocks-first, one allocation)": (
            KVGeometry(layers, nb, bs, 8, 256, "bfloat16", False, "HND", True,
                       layers * bs * 8 * 256), True),
        "vLLM BLNHC (blocks-first, one allocation)": (
            KVGeometry(layers, nb, bs, 8, 256, "bfloat16", False, "NHD", True,
                       layers * bs * 8 * 256), True),
    }
    print(f"Llama-3-8B geometry ({layers} layers), {args.tokens} tokens, chunks of "
          f"{args.chunk}, staging limit {STAGING_LIMIT_BYTES >> 20} MiB")
    print()
    print("| layout | block ids | copy plan: DMAs | gather STORE: kernels + DMAs "
          "(index copies, event records / waits, host waits) | gather RETRIEVE: kernels "
          "+ DMAs (event records / waits) |")
    print("|---|---|---:|---:|---:|")
    for name, (g, one) in geometries.items():
        for order, ids in orders.items():
            store = gather_counts(g, ids, args.chunk, one)
            back = gather_counts(g, ids, args.chunk, one, retrieve=True)
            print(f"| {name} | {order} | {plan_calls(g, ids, args.chunk):,} | "
                  f"{store['kernels']} + {store['DMAs']} ({store['index copies']}, "
                  f"{store['event records']} / {store['event waits']}, "
                  f"{store['host waits']}) | {back['kernels']} + {back['DMAs']} "
                  f"({back['event records']} / {back['event waits']}) |")


if __name__ == "__main__":
    main()
