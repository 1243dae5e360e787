#!/usr/bin/env python3
"""The GPU round trip against a real LMCache MP server in GPU mode (run by gpu_check.sh).

For each client side: allocate a paged bf16 KV cache on the GPU (several layers), fill it
with random bits, REGISTER_KV_CACHE (timed), then for 256 and 4096 tokens: STORE from
source blocks, wait until LOOKUP sees every chunk, RETRIEVE into other (zeroed) blocks,
and compare on the GPU: destination == source bit for bit, every other block unchanged.
Then UNREGISTER. Sides:

* ours (raw):       lmcache_mp + CudaKVCache, RawCudaIPCWrapper (server: cupy + bindings)
* ours (torch_ipc): lmcache_mp + CudaKVCache, CudaIPCWrapper built without torch
* LMCache:          LMCache's own worker client (MessageQueueClient,
                    LMCacheDrivenTransferContext, CudaIPCWrapper from torch tensors,
                    torch.cuda.Event(interprocess=True)), as vLLM's adapter drives it

Timings include the request, the server's copy and a host wait for its completion event
(LMCache's future waits on the host, so ours runs with wait_host=True); best of --reps.

Exit status: 0 all sides round-tripped, 1 a side failed, 3 no GPU here.
``--cpu-dry-run`` runs the same flow against a CPU-mode server with CpuKVCache and CPU
tensors, to check this script on a machine without a GPU; it proves nothing about CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sizes", default="256,4096", help="token counts to move, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="round trips per size (best is reported)")
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--register-timeout", type=float, default=120.0)
    p.add_argument("--sides", default="raw,torch_ipc,lmcache",
                   help="which clients to run: raw, torch_ipc, lmcache")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="exercise this script against a CPU-mode server (no CUDA involved)")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.sides = [s for s in args.sides.split(",") if s]
    for side in args.sides:
        if side not in ("raw", "torch_ipc", "lmcache"):
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


def raw_wrapper_blocker() -> str | None:
    """Why the server (same Python environment as this script) cannot open a
    RawCudaIPCWrapper, if it cannot."""
    try:
        import cuda.bindings as cb
        from cuda.bindings import runtime as rt
    except ImportError as exc:
        return f"cuda-bindings does not import: {exc}"
    if not hasattr(rt.cudaIpcMemHandle_t(), "reserved"):
        return (f"cuda-bindings {cb.__version__} has no cudaIpcMemHandle_t.reserved, which "
                f"LMCache 0.5.3's RawCudaIPCWrapper.to_tensor assigns (removed in 13.4)")
    try:
        import cupy  # noqa: F401
    except Exception as exc:
        return f"cupy does not import ({exc!r}); RawCudaIPCWrapper.to_tensor needs it"
    return None


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


class Side:
    name = "?"
    chunk = 256
    layers: list[Any]

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
        self.client = Client(args.url, timeout=args.timeout)
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
        return self.client.wait_for_lookup(self._key(tokens, size, rid), timeout=10.0)

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


class LMCacheSide(Side):
    """LMCache's own worker-side client, the way vLLM's MP adapter drives it."""

    def __init__(self, args: argparse.Namespace, layout: Layout, model: str) -> None:
        import torch
        import zmq
        from lmcache import torch_dev
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
        from lmcache.v1.multiprocess.mq import MessageQueueClient
        from lmcache.v1.multiprocess.protocol import get_response_class
        from lmcache.v1.multiprocess.protocols.base import RequestType
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
            LMCacheDrivenTransferContext,
        )

        self.name = "LMCache"
        self.args, self.model = args, model
        self.torch_dev, self.Key, self.RT = torch_dev, IPCCacheServerKey, RequestType
        self.get_response_class = get_response_class
        self.zctx = zmq.Context()
        self.mq = MessageQueueClient(args.url, self.zctx)
        self.chunk = int(self._call(RequestType.GET_CHUNK_SIZE, []))
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
            from lmcache.v1.platform.cpu.shm import migrate_to_shm_and_wrap

            self.shm_names = [migrate_to_shm_and_wrap(t).shm_name for t in self.layers]
        self.ctx = LMCacheDrivenTransferContext()
        self.instance_id = random.getrandbits(62)
        self.registered = False

    def _send(self, rt: Any, payloads: list[Any]) -> Any:
        return self.mq.submit_request(rt, payloads, self.get_response_class(rt))

    def _call(self, rt: Any, payloads: list[Any], timeout: float | None = None) -> Any:
        return self._send(rt, payloads).result(timeout=timeout or self.args.timeout)

    def _key(self, tokens: list[int], size: int, rid: str, worker: int | None = 0) -> Any:
        return self.Key(self.model, 1, worker, tuple(tokens), 0, size, rid)

    def register(self) -> float:
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo

        start = time.perf_counter()
        self.ctx.register(
            self.instance_id, self.kv_caches, self.model, 1, self.blocks_in_chunk, self.mq,
            self.args.register_timeout, send_request=lambda mq, rt, p: self._send(rt, p),
            layout_hints={"kv_layout": "HND"},
            engine_group_infos=[EngineGroupInfo(0, tuple(range(self.args.layers)),
                                                self.args.block_size)],
            engine_type=EngineType.VLLM)
        self.registered = True
        return time.perf_counter() - start

    def _event(self) -> Any:
        # vLLM records the event on its stream after the work the transfer must follow.
        event = self.torch_dev.Event(interprocess=True)
        event.record()
        return event

    def store(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool:
        fut = self.ctx.submit_store(rid, self._key(tokens, size, rid), self.instance_id,
                                    self.kv_caches, [blocks], self._event(), self.blocks_in_chunk)
        return bool(fut.result(timeout=self.args.timeout))  # waits for the server's event

    def wait_visible(self, tokens: list[int], size: int, rid: str) -> int:
        want = size // self.chunk
        key = self._key(tokens, size, rid, worker=None)
        deadline = time.monotonic() + 10.0
        while True:
            self._call(self.RT.LOOKUP, [key, 1])
            hits = int(self._call(self.RT.WAIT_PREFETCH_STATUS, [rid, 5.0]) or 0)
            if hits >= want or time.monotonic() > deadline:
                return hits
            if hits:
                self._call(self.RT.FREE_LOOKUP_LOCKS, [
                    self.Key(self.model, 1, None, tuple(tokens), 0, hits * self.chunk, rid), 1])
            time.sleep(0.02)

    def retrieve(self, tokens: list[int], size: int, blocks: list[int], rid: str) -> bool:
        fut = self.ctx.submit_retrieve(rid, self._key(tokens, size, rid), self.instance_id,
                                       self.kv_caches, [blocks], self._event(),
                                       self.blocks_in_chunk, 0)
        return bool(fut.result(timeout=self.args.timeout))

    def unregister(self) -> None:
        if self.registered:
            self.registered = False
            self._call(self.RT.UNREGISTER_KV_CACHE, [self.instance_id])

    def close(self) -> None:
        import gc

        self.ctx.close()
        self.kv_caches.clear()
        self.layers = []
        gc.collect()
        if self.shm_names:
            from lmcache.v1.multiprocess.posix_shm import shm_unlink

            for name in self.shm_names:
                shm_unlink(name)
        self.mq.close()
        self.zctx.term()


def synchronize(args: argparse.Namespace) -> None:
    if not args.cpu_dry_run:
        import torch

        torch.cuda.synchronize()


def run_side(side_name: str, args: argparse.Namespace, layout: Layout, seed: int) -> dict[str, Any]:
    import torch

    res: dict[str, Any] = {"side": side_name, "ok": False, "register_ms": None,
                           "store_gbps": {}, "retrieve_gbps": {}, "store_s": {},
                           "retrieve_s": {}, "checks": [], "error": None}
    bytes_per_token = 2 * args.layers * args.heads * args.head_dim * 2  # K+V, bf16
    rng = random.Random(seed)
    side: Side | None = None
    try:
        model = f"gpu-check-{side_name}-{seed}"
        if side_name == "lmcache":
            side = LMCacheSide(args, layout, model)
        else:
            side = OursSide(args, layout, side_name, model)
        res["side"] = side.name
        dev = side.layers[0].device
        for t in side.layers:
            bits = t.view(torch.int16)
            bits.copy_(torch.randint(-32768, 32768, bits.shape, dtype=torch.int16, device=dev))
        synchronize(args)
        res["register_ms"] = side.register() * 1e3
        ok = True
        for size in args.sizes:
            src, dst = layout.ranges[size]
            src_i = torch.tensor(src, device=dev)
            dst_i = torch.tensor(dst, device=dev)
            written = set(dst)
            keep = torch.tensor([b for b in range(layout.num_blocks) if b not in written],
                                device=dev)
            stores, retrieves = [], []
            for rep in range(args.reps):
                rid = f"{model}-{size}-{rep}"
                tokens = [rng.randrange(1, 100_000) for _ in range(size)]
                for t in side.layers:  # the retrieve must write these
                    t[:, dst_i] = 0
                snapshot = [t.view(torch.int16).clone() for t in side.layers]
                synchronize(args)
                start = time.perf_counter()
                if not side.store(tokens, size, src, rid):
                    raise RuntimeError(f"STORE of {size} tokens answered ok=false")
                stores.append(time.perf_counter() - start)
                hits = side.wait_visible(tokens, size, rid)
                if hits * side.chunk < size:
                    raise RuntimeError(f"LOOKUP saw {hits} chunks of {size} tokens")
                start = time.perf_counter()
                if not side.retrieve(tokens, size, dst, rid):
                    raise RuntimeError(f"RETRIEVE of {size} tokens answered ok=false")
                retrieves.append(time.perf_counter() - start)
                synchronize(args)
                same = all(torch.equal(t.view(torch.int16)[:, src_i], t.view(torch.int16)[:, dst_i])
                           for t in side.layers)
                untouched = all(torch.equal(t.view(torch.int16)[:, keep], s[:, keep])
                                for t, s in zip(side.layers, snapshot, strict=True))
                res["checks"].append({"size": size, "rep": rep, "dst_equals_src": same,
                                      "others_untouched": untouched})
                ok = ok and same and untouched
                del snapshot
            moved = size * bytes_per_token
            res["store_s"][size] = stores
            res["retrieve_s"][size] = retrieves
            res["store_gbps"][size] = moved / min(stores) / 1e9
            res["retrieve_gbps"][size] = moved / min(retrieves) / 1e9
            res.setdefault("store_gbps_median", {})[size] = moved / statistics.median(stores) / 1e9
            res.setdefault("retrieve_gbps_median", {})[size] = (
                moved / statistics.median(retrieves) / 1e9)
        side.unregister()
        res["ok"] = ok
        if not ok:
            res["error"] = "data mismatch (see checks)"
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
    finally:
        if side is not None:
            try:
                side.unregister()
            except Exception:
                pass
            try:
                side.close()
            except Exception as exc:
                res.setdefault("close_error", repr(exc))
    return res


def table(results: list[dict[str, Any]], sizes: list[int]) -> str:
    def cell(r: dict[str, Any], key: str, size: int | None = None) -> str:
        if r.get("skipped"):
            return "skipped"
        v = r.get(key) if size is None else r.get(key, {}).get(size)
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    rows = [["", *(r["side"] for r in results)]]
    rows.append(["round trip ok", *("skipped" if r.get("skipped") else
                                    "yes" if r["ok"] else "NO" for r in results)])
    rows.append(["register ms", *(cell(r, "register_ms") for r in results)])
    for size in sizes:
        rows.append([f"store GB/s {size} tok", *(cell(r, "store_gbps", size) for r in results)])
        rows.append([f"retrieve GB/s {size} tok",
                     *(cell(r, "retrieve_gbps", size) for r in results)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu_dry_run:
        reason = no_gpu_reason()
        if reason is not None:
            print(f"gpu_check: no GPU here ({reason}); nothing was run. "
                  f"Use --cpu-dry-run to exercise the script against a CPU server.",
                  file=sys.stderr)
            return 3
    sys.path.insert(0, str(REPO))
    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cpu_dry_run": args.cpu_dry_run}
    if not args.cpu_dry_run:
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            import cuda.bindings as cb

            env["cuda_bindings"] = cb.__version__
        except ImportError:
            pass
    layout = Layout(args.sizes, args.block_size)
    results: list[dict[str, Any]] = []
    for i, side in enumerate(args.sides):
        blocker = raw_wrapper_blocker() if side == "raw" and not args.cpu_dry_run else None
        if args.cpu_dry_run and side == "torch_ipc":
            blocker = "CPU dry run: the wrapper form only matters on GPU"
        if blocker:
            results.append({"side": f"ours ({side})", "ok": False, "skipped": blocker})
            print(f"gpu_check: {side}: skipped: {blocker}", flush=True)
            continue
        started = time.perf_counter()
        r = run_side(side, args, layout, seed=1000 + i)
        r["wall_s"] = time.perf_counter() - started
        results.append(r)
        status = "ok" if r["ok"] else f"FAILED: {r['error']}"
        print(f"gpu_check: {r['side']}: {status} ({r['wall_s']:.1f} s)", flush=True)
        if not r["ok"] and r.get("traceback"):
            print(r["traceback"], file=sys.stderr, flush=True)
    title = "CPU DRY RUN (no CUDA involved)" if args.cpu_dry_run else env.get("gpu", "GPU")
    print(f"\n{title}: {args.layers} layers x {args.heads} heads x {args.head_dim} dim, bf16, "
          f"block {args.block_size}, best of {args.reps}\n")
    print(table(results, args.sizes))
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "args": vars(args),
                                              "results": results}, indent=1, default=str))
    ran = [r for r in results if not r.get("skipped")]
    return 0 if ran and all(r["ok"] for r in ran) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
