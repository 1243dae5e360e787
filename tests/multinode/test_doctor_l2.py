"""``lmcache-mp doctor --peer URL --server-log FILE`` against real servers sharing a
real ``fs`` tier: a pair that shares passes the probe; a peer with another chunk size,
or another hash algorithm, is reported (each is a silent 0 % hit rate for engines);
a node whose engine has another KV layout is seen in its log (the L2 objects of the
other layout have another size: a miss, never read). A resp adapter that stays down
after its Valkey restarted is checked in test_l2_faults.py (the same log scan)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from lmcache_mp import Client, CpuKVCache
from lmcache_mp.cli.doctor import run_doctor

from ..conftest import SERVER_VERSION, LiveServer
from .conftest import (
    GEOMETRY,
    NodeCache,
    Tier,
    log_path,
    make_tier,
    node_server,
    prefix,
    require_l2_release,
)

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def tier() -> Iterator[Tier]:
    require_l2_release()
    t = make_tier("fs")
    yield t
    t.close()


@pytest.fixture(scope="module")
def servers(tier: Tier) -> Iterator[dict[str, LiveServer]]:
    made: dict[str, LiveServer] = {}
    try:
        made["a"] = node_server(tier, "da")
        made["b"] = node_server(tier, "db")
        made["chunk"] = node_server(tier, "dc", SERVER_VERSION, "--chunk-size", "128")
        made["hash"] = node_server(tier, "dh", SERVER_VERSION, "--hash-algorithm",
                                   "sha256_cbor")
        yield made
    finally:
        for s in made.values():
            s.stop()


def l2_rows(url: str, peer: str, wait: float = 10.0) -> dict[str, tuple[str, bool]]:
    rows = run_doctor(url, 5.0, peer=peer, l2_wait=wait)
    return {name: (text, ok) for name, text, ok in rows
            if name in ("peer", "chunk size", "L2 probe")}


def test_a_sharing_pair_passes_the_probe(servers: dict[str, LiveServer]) -> None:
    rows = l2_rows(servers["a"].url, servers["b"].url)
    assert rows["chunk size"] == ("256 on both", True)
    text, ok = rows["L2 probe"]
    assert ok and "share their L2" in text, text
    # the command line, as an operator runs it (exit 0)
    proc = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "doctor", servers["a"].url,
                           "--peer", servers["b"].url, "--server-log",
                           str(log_path(servers["a"]))], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "share their L2" in proc.stdout and "no L2 failure logged" in proc.stdout


def test_a_peer_with_another_chunk_size(servers: dict[str, LiveServer]) -> None:
    rows = l2_rows(servers["a"].url, servers["chunk"].url)
    text, ok = rows["chunk size"]
    assert not ok and "256 here, 128 on the peer" in text, text
    proc = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "doctor", servers["a"].url,
                           "--peer", servers["chunk"].url], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout


def test_a_peer_hashing_differently_does_not_see_the_probe(
        servers: dict[str, LiveServer]) -> None:
    t0 = time.monotonic()
    rows = l2_rows(servers["a"].url, servers["hash"].url, wait=2.0)
    assert rows["chunk size"][1]
    text, ok = rows["L2 probe"]
    assert not ok and "did NOT find" in text, text
    assert time.monotonic() - t0 < 30


def test_a_node_with_another_kv_layout_shows_in_its_log(
        servers: dict[str, LiveServer]) -> None:
    """A stores with one KV shape; an engine on B with twice the head size looks the
    prefix up: a miss (never wrong bytes), and B's log says why."""
    tokens = prefix(36_900)
    with NodeCache(servers["a"], "lmcache", seed=9) as a:
        with a.reg.request(tokens) as w:
            assert w.store(a.blocks(tokens))
    time.sleep(0.5)
    other = {**GEOMETRY, "head_dim": 2 * int(GEOMETRY["head_dim"])}  # type: ignore[call-overload]
    with Client(servers["b"].url, timeout=10) as client, \
            CpuKVCache.allocate(num_blocks=80, **other) as kv, \
            client.register(kv, model_name="multinode-test", mode="lmcache") as reg:
        with reg.request(tokens) as r:
            assert r.lookup() == 0
    rows = run_doctor(None, 5.0, server_logs=[str(log_path(servers["b"]))])
    sizes = [text for name, text, ok in rows if name == "L2 object sizes" and not ok]
    assert sizes and "this server's layout needs 65536" in sizes[0], rows
