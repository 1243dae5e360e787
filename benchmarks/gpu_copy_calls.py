"""How many GPU operations one engine-driven transfer takes: the copy plan (one DMA per
head and run of blocks, ``lmcache_mp.ipc.cuda.staging``) against the gather path (one
kernel per plane and layer, one DMA per chunk object, ``lmcache_mp.ipc.cuda.gather``).

Counted, not timed: it needs no GPU, and it is what made the plan slow on an H200
(thousands of small DMAs per transfer: 4-5 GB/s against a 52-55 GB/s pinned copy,
2026-12-04). The speeds come from ``scripts/gpu_check.sh`` on a lent device.

    .venv/bin/python benchmarks/gpu_copy_calls.py [--tokens 4096] [--chunk 256]
"""

from __future__ import annotations

import argparse

import numpy as np

from lmcache_mp.ipc.base import KVGeometry
from lmcache_mp.ipc.cuda import staging


def count(g: KVGeometry, ids: np.ndarray, chunk: int) -> tuple[int, int, int]:
    """(plan calls, gather kernels, gather DMAs) for a STORE of ``ids``."""
    chunks = len(ids) * g.block_size // chunk
    layers = [0x1000_0000 * (i + 1) for i in range(g.num_layers)]
    slots = [0x9_0000_0000 + i * (1 << 28) for i in range(chunks)]
    plan = staging.store_plan(g, layers, ids, slots, list(range(chunks)), chunk)
    return len(plan), g.kv_planes * g.num_layers, chunks


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    args = p.parse_args()
    nb, bs = 20000, 16
    n = args.tokens // bs
    rng = np.random.default_rng(0)
    orders = {"consecutive ids": np.arange(1, n + 1, dtype=np.int64),
              "scattered ids (vLLM after a while)":
                  rng.permutation(np.arange(1, nb))[:n].astype(np.int64)}
    geometries = {
        "HND, 8 layers x 8 heads x 128": KVGeometry(8, nb, bs, 8, 128, "bfloat16", False),
        "NHD, 8 layers": KVGeometry(8, nb, bs, 8, 128, "bfloat16", False, "NHD"),
        "vLLM BLHNC (blocks-first), 8 layers": KVGeometry(
            8, nb, bs, 8, 256, "bfloat16", False, "HND", True, 8 * bs * 8 * 256),
        "HND, 32 layers (Llama-3-8B)": KVGeometry(32, nb, bs, 8, 128, "bfloat16", False),
    }
    print(f"| {args.tokens} tokens, chunks of {args.chunk} | block ids | copy plan: DMAs | "
          f"gather: kernels + DMAs |")
    print("|---|---|---:|---:|")
    for name, g in geometries.items():
        for order, ids in orders.items():
            calls, kernels, dmas = count(g, ids, args.chunk)
            print(f"| {name} | {order} | {calls:,} | {kernels} + {dmas} |")


if __name__ == "__main__":
    main()
