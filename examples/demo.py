"""A short tour of lmcache_mp against a running LMCache MP server.

    python examples/demo.py tcp://127.0.0.1:5555

`make demo` starts a real server, runs this, and stops the server.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import numpy as np

import lmcache_mp
from lmcache_mp import CacheKey, Client, CpuKVCache, Registration, Request, ServerUnavailable
from lmcache_mp.protocol.hashing import chunk_hashes


def step(title: str) -> None:
    print(f"\n== {title}")


def data_path(client: Client, chunk: int, mode: str) -> None:
    """Allocate an SHM KV cache, register it, store 3 chunks, look them up, retrieve
    them into other blocks, verify byte for byte, clean up."""
    step(f"data path, mode={mode!r}")
    layers, blocks, block_size, heads, head_dim = 4, 160, 16, 8, 64
    per_chunk = chunk // block_size
    n_chunks = 3
    with CpuKVCache.allocate(num_layers=layers, num_blocks=blocks, block_size=block_size,
                             num_heads=heads, head_dim=head_dim, dtype="bfloat16") as kv:
        print(f"allocated {kv!r} in /dev/shm ({layers} x {kv.geometry.layer_nbytes / 2**20:.1f} MiB)")
        rng = np.random.default_rng(0)
        for layer in kv.layers:
            layer[...] = rng.integers(0, 2**16, layer.shape, dtype=np.uint16)
        with client.register(kv, model_name=f"demo-{mode}-{os.getpid()}", mode=mode) as reg:
            how = ("the server maps the cache (hand-emitted pickles) and copies" if reg.mode == "lmcache"
                   else f"this client copies through the server's pool {reg.pool_info.shm_name}"  # type: ignore[union-attr]
                   )
            print(f"register -> {reg!r}\n  {how}")
            tokens = [random.randrange(32000) for _ in range(n_chunks * chunk)]
            src = list(range(n_chunks * per_chunk))
            dst = list(range(n_chunks * per_chunk, 2 * n_chunks * per_chunk))
            nbytes = layers * 2 * len(tokens) * heads * head_dim * 2
            with reg.request(tokens) as req:
                t = time.perf_counter()
                ok = req.store(src)
                dt = time.perf_counter() - t
            print(f"store {n_chunks} chunks from blocks {src[0]}..{src[-1]} -> {ok} "
                  f"({nbytes / 2**20:.1f} MiB, {nbytes / dt / 1e9:.2f} GB/s)")
            with lookup_all(reg, tokens) as req:
                print(f"lookup -> {req.cached_tokens} of {len(tokens)} tokens cached "
                      f"(read-locked for the retrieve)")
                t = time.perf_counter()
                ok = req.retrieve(dst)
                dt = time.perf_counter() - t
            print(f"retrieve into blocks {dst[0]}..{dst[-1]} -> {ok} ({nbytes / dt / 1e9:.2f} GB/s)")
            same = all(kv.block_bytes(li, d) == kv.block_bytes(li, s)
                       for li in range(layers) for s, d in zip(src, dst, strict=True))
            print(f"verify: retrieved blocks are byte-identical to the stored ones: {same}")
            if not same:
                raise SystemExit("demo: data mismatch")
        print("unregistered on exit (sessions ended, locks freed, segments unlinked)")
    leftover = [n for n in os.listdir("/dev/shm") if n.startswith(f"lmcache_mp_{os.getpid()}_")]
    print(f"shared-memory segments of this process left in /dev/shm: {len(leftover)}")


def lookup_all(reg: Registration, tokens: list[int]) -> Request:
    """A request whose lookup found every token (the server commits a store
    asynchronously, so look again until it shows)."""
    for _ in range(200):
        req = reg.request(tokens)
        if req.lookup() == len(tokens):
            return req
        req.close()
        time.sleep(0.01)
    raise SystemExit("demo: the stored chunks never became visible")


def running_for_days(url: str, restart_cmd: str) -> None:
    """SIGKILL the server and start it again: the same Registration stores again with
    no action here (the client re-registers on the new connection)."""
    step("running for days: the server restarts under a live registration")
    events: list[str] = []
    with Client(url, timeout=5.0, heartbeat_interval=0.5,
                on_health_change=lambda ok: events.append("healthy" if ok else "unhealthy"),
                on_recovered=lambda reg: events.append(f"re-registered {reg.instance_id}")) as client, \
            CpuKVCache.allocate(num_layers=2, num_blocks=64, block_size=16, num_heads=2,
                                head_dim=64, dtype="float16") as kv:
        chunk = client.chunk_size()
        with client.register(kv, model_name="demo-days") as reg:
            tokens = list(range(chunk))
            with reg.request(tokens) as req:
                print(f"store before the restart -> {req.store(list(range(1, 1 + chunk // 16)))}")
            subprocess.run(restart_cmd, shell=True, check=True, stdout=subprocess.DEVNULL)
            listening = time.monotonic()
            print("server SIGKILLed and started again on the same port")
            with reg.request(tokens) as req:
                ok = req.store(list(range(1, 1 + chunk // 16)))
            print(f"store after the restart, same Registration -> {ok} "
                  f"({(time.monotonic() - listening) * 1e3:.0f} ms after the new server answered)")
            time.sleep(0.6)
            print(f"callbacks: {events}; reg.recoveries = {reg.recoveries}; "
                  f"client.healthy = {client.healthy}")


def main(url: str) -> int:
    print(f"lmcache_mp {lmcache_mp.__version__}: a client of {url} that never imports lmcache")
    with Client(url, timeout=5.0) as client:
        step("control plane")
        t = time.perf_counter()
        answer = client.noop()
        ms = (time.perf_counter() - t) * 1e3
        print(f"NOOP              -> {answer!r}  ({ms:.2f} ms, connecting included)")
        print(f"PING              -> {client.ping()}")
        chunk = client.chunk_size()
        print(f"GET_CHUNK_SIZE    -> {chunk} tokens per chunk")
        print(f"GET_EXPERIMENTAL  -> {client.get_experimental()}")
        print(f"protocol profile  -> {client.server_protocol} (LMCache {', '.join(client.profile.releases)})")

        step("lookup of a prompt nobody stored")
        tokens = list(range(1000, 1000 + 3 * chunk + 17))
        key = CacheKey(model_name="demo-model", world_size=1, worker_id=None, token_ids=tokens,
                       start=0, end=len(tokens), request_id="demo-lookup")
        for i, h in enumerate(chunk_hashes(tokens, chunk)):
            print(f"chunk {i}: server-side hash {h.hex()[:16]}...")
        hits = client.lookup(key)
        print(f"LOOKUP + WAIT_PREFETCH_STATUS -> {hits} chunk(s) cached")
        client.end_session(key.request_id)
        print("END_SESSION       -> acknowledged")

        data_path(client, chunk, "lmcache")
        data_path(client, chunk, "engine")

        step("pipelining")
        n = 500
        t = time.perf_counter()
        futures = [client.noop_async() for _ in range(n)]
        assert all(f.result() == "OK" for f in futures)
        dt = time.perf_counter() - t
        print(f"{n} NOOPs in flight at once: {dt * 1e3:.1f} ms ({n / dt:,.0f} req/s)")

        step("deadlines instead of hangs")
        try:
            with Client("tcp://127.0.0.1:1", timeout=0.3) as nobody:
                nobody.noop()
        except ServerUnavailable as exc:
            print(f"no server on port 1 -> ServerUnavailable after 0.3 s:\n  {exc}")
    restart_cmd = os.environ.get("DEMO_RESTART_CMD")
    if restart_cmd:
        running_for_days(url, restart_cmd)
    print("\ndemo finished: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5555"))
