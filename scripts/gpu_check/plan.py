"""The run's plan: its arguments, the sides and what they need (block ids, the L1 the
server must hold), what this machine lacks for some of them."""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DESCRIPTION = ("The GPU round trip against one real LMCache MP server in GPU mode (run by "
               "gpu_check.sh).")

SIDES = ("torch_ipc", "raw", "auto", "lmcache", "engine", "engine_plan", "engine_nhd",
         "engine_expandable", "nhd_views", "vllm_views", "vllm_views_engine",
         "vllm_blocks_first", "mla", "mla_engine")
DEFAULT_SIDES = ("torch_ipc,raw,lmcache,engine,engine_plan,engine_nhd,engine_expandable,"
                 "nhd_views,vllm_views,vllm_views_engine,vllm_blocks_first,mla,mla_engine")
#: The MLA sides' latent row (DeepSeek-V3: kv_lora_rank 512 + rope 64), one "head".
MLA_DIM = 576
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
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--url", required=True, help="the server, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--release", default="?", help="the server's LMCache release (label)")
    # Llama-3-8B by default: a 4096-token transfer is 512 MiB, so the fixed cost of a
    # request is small beside the copy (8 layers made it as long as the DMA: the
    # store / pinned ratios read 0.4-0.5x whatever the copy did, 2026-12-04).
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--consecutive-ids", action="store_true",
                   help="source and destination blocks in runs (default: scattered over "
                        "twice the blocks, as vLLM's block table is after a while; runs "
                        "flatter the copy plan)")
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
    args.scattered = not args.consecutive_ids
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
    """Block ids per size: a source and a destination set, disjoint, among blocks that
    leave guard blocks at both ends untouched. Scattered (the default): drawn at random
    from a cache twice the size the transfers need, as vLLM's block table is after a
    while (runs of consecutive ids flatter the copy plan); ``num_blocks`` given (a
    recorded vLLM geometry): drawn among that many."""

    def __init__(self, sizes: list[int], block_size: int, scattered: bool = True,
                 num_blocks: int | None = None, seed: int = 0) -> None:
        need = sum(2 * (size // block_size) for size in sizes)
        if num_blocks is None:
            num_blocks = 8 + (2 * need if scattered else need)
        self.num_blocks = num_blocks
        usable = list(range(4, num_blocks - 4))  # 4 guard blocks at each end
        if len(usable) < need:
            raise ValueError(f"{num_blocks} blocks cannot hold {need} plus the guards")
        if scattered:
            usable = random.Random(seed).sample(usable, need)
        self.ranges: dict[int, tuple[list[int], list[int]]] = {}
        at = 0
        for size in sizes:
            n = size // block_size
            self.ranges[size] = (usable[at:at + n], usable[at + n:at + 2 * n])
            at += 2 * n


def blocks_of(t: Any, idx: Any, axis: int) -> Any:
    """The blocks ``idx`` of layer tensor ``t``, whose block axis is ``axis``."""
    return t[idx] if axis == 0 else t[:, idx]


def zero_blocks(t: Any, idx: Any, axis: int) -> None:
    if axis == 0:
        t[idx] = 0
    else:
        t[:, idx] = 0


def l1_gib(args: argparse.Namespace) -> int:
    """The L1 this run needs, in GiB: the server's cache is cleared after every side
    (CLEAR), so the largest side's round trips (each rep a key of its own) and profiled
    transfers, plus the restart step's, a quarter more and 1 GiB. (A 1 GiB L1 filled
    after two sides and failed every later one, LMCache's own client included,
    2026-12-04: the server does not evict fast enough to make room for a STORE in a
    full pool; and a pool the size of every side's keys at Llama-3-8B's 128 KiB per
    token, ~40 GiB, takes the server and the client each seconds to page-lock.)"""
    per_token = 2 * args.layers * args.heads * args.head_dim * 2  # K + V, bf16 (MLA: less)
    largest = 0
    for side in args.sides:
        if args.cpu_dry_run and side in GPU_ONLY_SIDES:
            continue
        stored = 0
        sizes = [256, 4096] if side.startswith("vllm_") else args.sizes
        for size in sizes:
            reps = args.small_reps if size <= SMALL else args.reps
            stored += reps * size * per_token * (2 if side == "nhd_views" else 1)
        if side in args.profile:
            stored += 20 * min(sizes) * per_token
        largest = max(largest, stored)
    largest += 4 * 2 * 512 * per_token  # the restart step: two registrations, two rounds
    return int(-(-largest * 5 // 4 // (1 << 30))) + 1


def synchronize(args: argparse.Namespace) -> None:
    if not args.cpu_dry_run:
        import torch

        torch.cuda.synchronize()
