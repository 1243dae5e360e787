"""A short tour of lmcache_mp against a running LMCache MP server.

    python examples/demo.py tcp://127.0.0.1:5555

`make demo` starts a real server, runs this, and stops the server.
"""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np

import lmcache_mp
from lmcache_mp import CacheKey, Client, CpuKVCache, ServerUnavailable
from lmcache_mp.hashing import chunk_hashes


def step(title: str) -> None:
    print(f"\n== {title}")


def data_path(client: Client, chunk: int, mode: str) -> None:
    """Allocate an SHM KV cache, register it, store 3 chunks, look them up, retrieve
    them into other blocks, verify byte for byte, clean up."""
    step(f"data path, {mode.replace('_', '-')} mode")
    layers, blocks, block_size, heads, head_dim = 4, 160, 16, 8, 64
    per_chunk = chunk // block_size
    n_chunks = 3
    with CpuKVCache.allocate(num_layers=layers, num_blocks=blocks, block_size=block_size,
                             num_heads=heads, head_dim=head_dim, dtype="bfloat16") as kv:
        print(f"allocated {kv!r} in /dev/shm ({layers} x {kv.geometry.layer_nbytes / 2**20:.1f} MiB)")
        rng = np.random.default_rng(0)
        for layer in kv.layers:
            layer[...] = rng.integers(0, 2**16, layer.shape, dtype=np.uint16)
        instance_id = random.getrandbits(62)
        model = f"demo-{mode}-{os.getpid()}"
        if mode == "lmcache_driven":
            client.register_kv_cache(kv, instance_id=instance_id, model_name=model)
            store, retrieve = client.store, client.retrieve
            print(f"REGISTER_KV_CACHE -> ok (instance {instance_id}, hand-emitted pickles)")
        else:
            info = client.register_kv_cache_engine_driven(kv, instance_id=instance_id,
                                                          model_name=model)
            store, retrieve = client.store_engine_driven, client.retrieve_engine_driven
            print(f"REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT -> pool {info.shm_name} "
                  f"({info.pool_size / 2**30:.0f} GiB), mapped by this client")
        tokens = [random.randrange(32000) for _ in range(n_chunks * chunk)]
        src = list(range(n_chunks * per_chunk))
        dst = list(range(n_chunks * per_chunk, 2 * n_chunks * per_chunk))

        def key(rid: str) -> CacheKey:
            return CacheKey(model_name=model, world_size=1, worker_id=0, token_ids=tokens,
                            start=0, end=len(tokens), request_id=rid)

        nbytes = layers * 2 * len(tokens) * heads * head_dim * 2
        t = time.perf_counter()
        ok = store(key("demo-store"), src, instance_id=instance_id)
        dt = time.perf_counter() - t
        print(f"store {n_chunks} chunks from blocks {src[0]}..{src[-1]} -> {ok} "
              f"({nbytes / 2**20:.1f} MiB, {nbytes / dt / 1e9:.2f} GB/s)")
        hits = client.wait_for_lookup(key("demo-retrieve"), timeout=5)
        print(f"lookup -> {hits} of {n_chunks} chunks cached (read-locked for the retrieve)")
        t = time.perf_counter()
        ok = retrieve(key("demo-retrieve"), dst, instance_id=instance_id)
        dt = time.perf_counter() - t
        print(f"retrieve into blocks {dst[0]}..{dst[-1]} -> {ok} ({nbytes / dt / 1e9:.2f} GB/s)")
        same = all(kv.block_bytes(li, d) == kv.block_bytes(li, s)
                   for li in range(layers) for s, d in zip(src, dst, strict=True))
        print(f"verify: retrieved blocks are byte-identical to the stored ones: {same}")
        if not same:
            raise SystemExit("demo: data mismatch")
        for rid in ("demo-store", "demo-retrieve"):
            client.end_session(rid)
        if mode == "lmcache_driven":
            client.unregister_kv_cache(instance_id)
        else:
            client.unregister_kv_cache_engine_driven(instance_id)
        print("unregistered; segments unlinked")
    leftover = [n for n in os.listdir("/dev/shm") if n.startswith(f"lmcache_mp_{os.getpid()}_")]
    print(f"shared-memory segments of this process left in /dev/shm: {len(leftover)}")


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

        data_path(client, chunk, "lmcache_driven")
        data_path(client, chunk, "engine_driven")

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
    print("\ndemo finished: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5555"))
