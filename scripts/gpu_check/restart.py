"""The restart step: a registration of each mode round-trips, the server is SIGKILLed
and started again by the same script, both round-trip again through the same
Registration objects (which re-register themselves), bits compared."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any

from wait_ready import wait_ready

from .flow import _call_with_timeout, unlink_own_segments
from .plan import synchronize


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
