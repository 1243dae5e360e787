"""A short tour of lmcache_mp against a running LMCache MP server.

    python examples/demo.py tcp://127.0.0.1:5555

`make demo` starts a real server, runs this, and stops the server.
"""

from __future__ import annotations

import sys
import time

import lmcache_mp
from lmcache_mp import CacheKey, Client, ServerUnavailable
from lmcache_mp.hashing import chunk_hashes


def step(title: str) -> None:
    print(f"\n== {title}")


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
