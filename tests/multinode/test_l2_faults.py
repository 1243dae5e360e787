"""Faults of the second tier under traffic: the Valkey both nodes share is killed and
started again, stopped (SIGSTOP) and continued, and filled up; meanwhile one thread
stores new prefixes through node A and looks each up (and retrieves every hit) through
node B.

What must hold: every call returns within its bound (node B's lookup: the adapter's
own deadline, never the client's), no retrieved byte is wrong, and the client's health
says what happened: both LMCache servers stay healthy (it is the tier that failed,
and a lookup then reports a miss). What each adapter does is LMCache's and is pinned
here as measured: ``valkey`` (glide) stalls each lookup for its ``request_timeout``
while Valkey does not answer and reconnects by itself; ``resp`` answers misses at once
and, after Valkey restarts, does not reconnect (0.5.6 and 0.5.7rc2): every L2 write of
that server fails from then on, which ``lmcache-mp doctor --server-log`` reports.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from lmcache_mp.cli.l2_doctor import scan_server_log

from ..support.live_helpers import lookup_all
from ..support.valkey import ValkeyError
from .conftest import (
    NodeCache,
    Nodes,
    Tier,
    log_path,
    prefix,
    share,
    sharing,
)

pytestmark = pytest.mark.live
#: The valkey adapter's deadline per Valkey command (its default is 5 s).
GLIDE_TIMEOUT = 1.0
_seeds = itertools.count(36_000)


@pytest.fixture(params=["resp", "valkey"])
def pair(request: pytest.FixtureRequest) -> Iterator[Nodes]:
    extra = {"request_timeout": GLIDE_TIMEOUT} if request.param == "valkey" else {}
    with sharing(request.param, **extra) as nodes:
        yield nodes


def lookup_bound(tier: Tier) -> float:
    """How long node B's lookup may take while the tier does not answer: the valkey
    adapter's deadline (plus a busy machine's slack); resp answers at once."""
    return (GLIDE_TIMEOUT if tier.adapter["type"] == "valkey" else 0.0) + 5.0


@dataclass
class Traffic:
    """A thread: store a new prefix through A, look it up once through B and retrieve
    a whole hit, byte-compared; every call's time and outcome recorded."""

    a: NodeCache
    b: NodeCache
    stop: threading.Event = field(default_factory=threading.Event)
    slowest_lookup: float = 0.0
    slowest_store: float = 0.0
    hits: int = 0
    misses: int = 0
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        while not self.stop.is_set():
            tokens = prefix(next(_seeds), chunks=2)
            src = self.a.blocks(tokens)
            dst = self.b.blocks(tokens, first=len(src) + 1)
            try:
                t0 = time.monotonic()
                with self.a.reg.request(tokens) as w:
                    if not w.store(src):
                        self.errors.append("A's STORE returned False")
                self.slowest_store = max(self.slowest_store, time.monotonic() - t0)
                time.sleep(0.1)  # A's background L2 write
                with self.b.reg.request(tokens) as r:
                    t0 = time.monotonic()
                    found = r.lookup()
                    self.slowest_lookup = max(self.slowest_lookup, time.monotonic() - t0)
                    if found == len(tokens):
                        assert r.retrieve(dst)
                        for layer in range(2):
                            for s, d in zip(src, dst, strict=True):
                                if self.a.kv.block_bytes(layer, s) != \
                                        self.b.kv.block_bytes(layer, d):
                                    self.errors.append(f"wrong bytes in B's block {d}")
                        self.hits += 1
                    else:
                        self.misses += 1
            except Exception as exc:  # recorded, the test fails on it
                self.errors.append(repr(exc))
            time.sleep(0.02)

    def __enter__(self) -> Traffic:
        self.thread = threading.Thread(target=self.run, name="l2-traffic", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)

    def snapshot(self) -> tuple[int, int]:
        return self.hits, self.misses


def wait_until(what: str, check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def test_tier_killed_stopped_and_restarted_under_traffic(pair: Nodes) -> None:
    tier = pair.tier
    assert tier.valkey is not None
    kind = str(tier.adapter["type"])
    with NodeCache(pair.a, "lmcache", seed=5) as a, NodeCache(pair.b, "lmcache", seed=6) as b, \
            Traffic(a, b) as traffic:
        wait_until("a hit through the tier", lambda: traffic.hits >= 2)
        # Killed: every call still returns in time, as a miss; both servers healthy.
        tier.valkey.kill()
        misses = traffic.misses
        wait_until("misses while Valkey is down", lambda: traffic.misses >= misses + 2)
        assert a.client.healthy and b.client.healthy
        # Stopped (SIGSTOP: connections open, nothing answers) and continued.
        tier.valkey.start()
        tier.valkey.pause()
        try:
            misses = traffic.misses
            wait_until("misses while Valkey is stopped", lambda: traffic.misses >= misses + 2)
        finally:
            tier.valkey.resume()
        restarted_at = time.time()
        # After the restart: the valkey adapter reconnects by itself; resp does not.
        hits = traffic.hits
        if kind == "valkey":
            wait_until("hits again after the restart", lambda: traffic.hits >= hits + 2, 60)
        else:
            time.sleep(3)
            misses = traffic.misses
            wait_until("more lookups", lambda: traffic.misses >= misses + 2)
    assert not traffic.errors, traffic.errors
    assert traffic.slowest_lookup <= lookup_bound(tier), traffic.slowest_lookup
    assert traffic.slowest_store <= 10.0, traffic.slowest_store  # L1 only: no tier wait
    if kind == "resp":
        # Pinned as measured (0.5.6, 0.5.7rc2): no reconnection, nothing written since.
        assert traffic.hits == hits, "resp reconnected after Valkey restarted"
        assert tier.objects() == 0
        # What an operator sees: node A's log says its adapter keeps failing.
        report = scan_server_log(log_path(pair.a))
        (adapter,) = report.adapters.values()
        assert adapter.store_failures >= 2 and adapter.last_failure is not None
        assert adapter.last_failure.timestamp() >= restarted_at - 1
        assert report.down(), report


def test_full_tier_misses_and_recovers(pair: Nodes) -> None:
    """Valkey at its maxmemory with noeviction: L2 writes fail, B misses (never reads
    a partial object), A still serves its own L1; with room again B hits again
    (valkey: its pool; resp: its connection never broke)."""
    tier = pair.tier
    assert tier.valkey is not None
    with NodeCache(pair.a, "lmcache", seed=7) as a, NodeCache(pair.b, "lmcache", seed=8) as b:
        share(a, b, prefix(next(_seeds)))
        used = tier.valkey.command("INFO", "memory")
        assert isinstance(used, bytes)
        tier.valkey.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        tier.valkey.command("CONFIG", "SET", "maxmemory", "1")  # below what it uses
        with pytest.raises(ValkeyError, match="OOM"):
            tier.valkey.command("SET", "probe", "x")
        tokens = prefix(next(_seeds))
        with a.reg.request(tokens) as w:
            assert w.store(a.blocks(tokens))
        lookup_all(a.reg, tokens).close()  # A's own L1 has it (after its async commit)
        time.sleep(0.5)
        with b.reg.request(tokens) as r:
            assert r.lookup() == 0
        tier.valkey.command("CONFIG", "SET", "maxmemory", "0")
        share(a, b, prefix(next(_seeds)))
    report = scan_server_log(log_path(pair.a))
    assert sum(x.store_failures for x in report.adapters.values()) >= 1, report
