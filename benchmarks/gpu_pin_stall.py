"""The first engine-driven GPU copy against the next ones while the server's pool is
being page-locked (cudaHostRegister: roughly 0.1-0.3 s per GiB on a real machine), on
the fake CUDA driver (tests/support/fake_cuda.py) with a slow registration: what the
caller's (vLLM's forward) thread waits.

    .venv/bin/python benchmarks/gpu_pin_stall.py [--register-s 0.5] [--pool-mib 256]

2026-12-06, 2-core CI machine: first 7.7 ms, second 1.5 ms (0.5 s registration, 256
MiB pool); the code of 1470964 (the first copy pinned the pool itself): first 508 ms.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmcache_mp.ipc.shm import ShmSegment  # noqa: E402
from lmcache_mp.protocol.types import PoolSlot  # noqa: E402
from lmcache_mp.session.engine_driven import PoolMaps, copy_into_slots  # noqa: E402
from tests.ipc.test_cuda_gather import (  # noqa: E402
    CHUNK,
    GEOMETRIES,
    block_ids,
    fake_cache,
    object_shape,
)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--register-s", type=float, default=0.5)
    p.add_argument("--pool-mib", type=int, default=256)
    args = p.parse_args()
    import torch

    g = GEOMETRIES["hnd"]
    drv, cache, _ = fake_cache(g, seed=1)
    with drv.torch_stream(1, 0):  # the fake's dispatch mode: its first use imports
        torch.zeros(1).add_(1)    # torch._dynamo (~3 s), not what is measured
    drv.slow_host_register = args.register_s
    drv.allow_pageable = True
    size = args.pool_mib << 20
    seg = ShmSegment.create(size, tag="pinstall")
    maps = PoolMaps()
    try:
        pool = maps.acquire(seg.name, size, 0)
        n = int(np.prod(object_shape(g))) * g.itemsize
        slot = PoolSlot(offset=0, length=n, shape=object_shape(g), dtype=g.dtype)
        ids = block_ids(g, 1, seed=2)
        took = []
        for _ in range(3):
            t0 = time.perf_counter()
            copy_into_slots(cache, ids, [slot], [0], pool, CHUNK, stream=5)  # type: ignore[arg-type]
            took.append(time.perf_counter() - t0)
            time.sleep(args.register_s + 0.1)
        print(f"cudaHostRegister {args.register_s} s, pool {args.pool_mib} MiB: copy 1 "
              f"{took[0] * 1e3:.1f} ms, copy 2 {took[1] * 1e3:.1f} ms, copy 3 "
              f"{took[2] * 1e3:.1f} ms")
        maps.release(pool)
    finally:
        maps.close()
        seg.close()


if __name__ == "__main__":
    main()
