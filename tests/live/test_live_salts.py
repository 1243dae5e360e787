"""Per-user cache isolation on a real server: what one salt stored, another salt (or
none) never finds, and the same salt finds and retrieves byte for byte. Runs against
every release in CI's per-release live loop."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from lmcache_mp import CacheKey, Client, CpuKVCache, Registration

from ..conftest import LiveServer
from ..support.live_helpers import fill_random, same_blocks

pytestmark = pytest.mark.live
CHUNK = 256


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> Iterator[Client]:
    with Client(live_server.url, timeout=10.0) as c:
        yield c


def hits_when_visible(reg: Registration, toks: list[int], salt: str, want: int,
                      timeout: float = 10.0) -> int:
    """Lookup with ``salt`` until ``want`` tokens show (the server commits stores
    asynchronously), releasing each lookup's locks."""
    deadline = time.monotonic() + timeout
    while True:
        with reg.request(toks, cache_salt=salt) as req:
            found = req.lookup()
        if found >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


@pytest.mark.parametrize("mode", ["lmcache", "engine"])
def test_another_salt_finds_nothing_the_same_salt_finds_everything(client: Client,
                                                                   mode: str) -> None:
    with CpuKVCache.allocate(num_layers=2, num_blocks=3 * 2 * CHUNK // 16 + 2, block_size=16,
                             num_heads=2, head_dim=32, dtype="bfloat16") as kv:
        fill_random(kv, 7)
        reg = client.register(kv, model_name=f"salts-{uuid.uuid4().hex[:8]}", mode=mode)
        try:
            toks = np.random.default_rng(5).integers(0, 2**31, 2 * CHUNK).tolist()
            src, dst = list(range(1, 33)), list(range(40, 72))
            with reg.request(toks, cache_salt="tenant-a") as writer:
                assert writer.store(src) is True
            # Visible to its own salt first, so the misses below are not "not yet".
            assert hits_when_visible(reg, toks, "tenant-a", 2 * CHUNK) == 2 * CHUNK
            for other in ("tenant-b", "", "tenant-a2"):
                with reg.request(toks, cache_salt=other) as req:
                    assert req.lookup() == 0, f"salt {other!r} found tenant-a's chunks"
            # The control-plane lookup keeps the salt too.
            key = CacheKey(model_name=reg.model_name, world_size=1, worker_id=None,
                           token_ids=toks, start=0, end=len(toks),
                           request_id=f"s-{uuid.uuid4().hex}", cache_salt="tenant-b")
            assert client.lookup(key) == 0
            client.end_session(key.request_id)
            with reg.request(toks, cache_salt="tenant-a") as reader:
                assert reader.lookup() == 2 * CHUNK
                assert reader.retrieve(dst) is True
            assert same_blocks(kv, src, dst)
        finally:
            reg.unregister()
