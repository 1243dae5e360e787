#!/usr/bin/env python3
"""Issue 38 item 4 on a device: the caller's cost of one interprocess event per transfer
against one per step (``CudaKVCache.one_event``), on the real CUDA driver.

LMCache-driven mode sends every STORE / RETRIEVE with a CUDA event the server's copy
waits on. Without ``one_event`` each transfer creates an interprocess event, records it
on the stream and exports its handle (``cudaEventCreateWithFlags`` with
``cudaEventInterprocess | cudaEventDisableTiming``, ``cudaEventRecord``,
``cudaIpcGetEventHandle``), and destroys it after the reply; inside ``one_event`` (what
the vLLM connector does for a step's RETRIEVEs, and for its STOREs) the first transfer
of the step does that once and the others share it. This times exactly those calls,
through ``CudaKVCache.begin_transfer`` and the tokens' release, for a step of N
transfers, both ways, interleaved; and counts the events each way made.

What it leaves out: the server's side (it opens the handle of each transfer's event and
makes its stream wait), the wire and the copies themselves; a server in GPU mode is
needed for those (scripts/gpu_check.sh's round trip).

    python scripts/gpu_step_events.py [--transfers 2,4,8,16] [--rounds 200] [--json F]

Prints one line per N (median microseconds a step, each way, and the ratio) and a
summary line ``gpu_step_events: ...``. Exit status: 0 measured, 3 no GPU (nothing is
measured, nothing is made up), 1 an error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # lmcache_mp from the checkout


class Counting:
    """Wraps a driver: counts the interprocess events made through it."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self.created = 0

    def event_create_ipc(self) -> Any:
        self.created += 1
        return self._driver.event_create_ipc()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)


def one_step(cache: Any, stream: int, n: int, shared: bool) -> float:
    """Seconds to begin ``n`` transfers on ``stream`` and let their events go, as a
    step does between its first transfer and its last reply (the waits left out)."""
    tokens = []
    start = time.perf_counter()
    if shared:
        with cache.one_event():
            for _ in range(n):
                tokens.append(cache.begin_transfer(stream)[1])
        for token in tokens:
            token.release()
    else:
        for _ in range(n):
            tokens.append(cache.begin_transfer(stream)[1])
        for token in tokens:
            token.destroy()
    tokens.clear()  # the shared event's last reference: destroyed here
    return time.perf_counter() - start


def measure(cache: Any, counting: Counting, stream: int, sync: Any,
            transfers: list[int], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for n in transfers:
        for shared in (False, True):  # warm-up: the driver's first calls
            one_step(cache, stream, n, shared)
        sync()
        times: dict[bool, list[float]] = {False: [], True: []}
        events: dict[bool, int] = {False: 0, True: 0}
        for r in range(rounds):
            for shared in ((False, True) if r % 2 else (True, False)):  # interleaved
                before = counting.created
                times[shared].append(one_step(cache, stream, n, shared))
                events[shared] += counting.created - before
            sync()
        per = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        rows.append({"transfers": n, "per_transfer_us": round(per[False], 1),
                     "per_step_us": round(per[True], 1),
                     "ratio": round(per[True] / per[False], 3),
                     "events_per_step": {"per_transfer": events[False] / rounds,
                                         "per_step": events[True] / rounds}})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transfers", default="2,4,8,16",
                    help="transfers in a step, comma-separated (default 2,4,8,16)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--json", type=Path, help="write the rows here too")
    opts = ap.parse_args()
    transfers = [int(x) for x in opts.transfers.split(",")]
    try:
        import torch
    except ImportError:
        print("gpu_step_events: no GPU measured: torch is not installed")
        return 3
    if not torch.cuda.is_available():
        print("gpu_step_events: no GPU measured: torch sees no CUDA device")
        return 3
    from lmcache_mp.ipc.cuda import CudaBindingsDriver, CudaKVCache

    counting = Counting(CudaBindingsDriver())
    # A small vLLM-shaped cache (HND: 2, blocks, heads, block size, head dim): the events
    # do not depend on its size.
    layers = [torch.zeros(2, 64, 8, 16, 128, dtype=torch.bfloat16, device="cuda")
              for _ in range(4)]
    cache = CudaKVCache.from_torch(layers, driver=counting)  # type: ignore[arg-type]
    stream = torch.cuda.Stream()
    try:
        rows = measure(cache, counting, stream.cuda_stream, torch.cuda.synchronize,
                       transfers, opts.rounds)
    finally:
        cache.close()
    name = torch.cuda.get_device_name()
    for row in rows:
        print(f"gpu_step_events: {row['transfers']:>3} transfers a step: "
              f"{row['per_transfer_us']:8.1f} us an event each, {row['per_step_us']:8.1f} us "
              f"one a step ({row['ratio']:.2f}x); events {row['events_per_step']}")
    summary = ", ".join(f"N={r['transfers']} {r['per_transfer_us']:.0f}->{r['per_step_us']:.0f} us"
                        for r in rows)
    print(f"gpu_step_events: {name}, median of {opts.rounds}: {summary}")
    if opts.json:
        opts.json.write_text(json.dumps({"device": name, "rounds": opts.rounds, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
