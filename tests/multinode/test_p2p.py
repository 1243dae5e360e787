"""LMCache's P2P second tier: node B reads node A's L1 directly (a coordinator hands
each server its peer's ``p2p`` adapter; ``mooncake_te`` moves the bytes over TCP). A
prefix stored through A is found, retrieved and byte-identical through B, in both
transfer modes (LMCache 0.5.7rc2; the tier's packages from the registries:
scripts/p2p.sh). These nodes run LMCache's HTTP front, so ``lmcache-mp doctor --status``
reads and compares their status replies here too."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from lmcache_mp.cli.doctor import run_doctor

from ..support.p2p import P2PNodes
from .conftest import NodeCache, prefix, share

pytestmark = pytest.mark.live
_seeds = itertools.count(36_500)


@pytest.fixture(scope="module")
def p2p() -> Iterator[P2PNodes]:
    nodes = P2PNodes()
    yield nodes
    nodes.close()


@pytest.mark.parametrize("mode", ["lmcache", "engine"])
def test_prefix_stored_through_a_is_read_from_a_by_b(p2p: P2PNodes, mode: str) -> None:
    with NodeCache(p2p.a, mode, seed=11) as a, NodeCache(p2p.b, mode, seed=12) as b:
        took = share(a, b, prefix(next(_seeds), chunks=8))
    print(f"p2p {mode}: {took}")
    assert "timed out; treating as a miss" not in p2p.log("b")  # no lookup stalled


def status_rows(nodes: P2PNodes) -> dict[str, tuple[str, bool]]:
    rows = run_doctor(None, 5.0, status_urls=[nodes.http["a"], nodes.http["b"]])
    return {name: (text, ok) for name, text, ok in rows
            if name.startswith(("status ", "nodes' "))}


def test_doctor_compares_the_nodes_status_replies(p2p: P2PNodes) -> None:
    rows = status_rows(p2p)
    assert rows["nodes' hash algorithm"] == ("blake3 on every node", True)
    assert rows["nodes' chunk size"] == ("256 on every node", True)
    # the types as each adapter names itself (p2p: P2PL2Adapter; resp: LMCacheRedisClient)
    assert rows["nodes' L2 adapters"] == ("['P2PL2Adapter'] on every node", True)
    assert all(ok for _, ok in rows.values()), rows


def test_doctor_sees_a_node_that_hashes_differently() -> None:
    """Node B hashes with sha256_cbor: every lookup across misses, silently; only the
    status replies say why."""
    with P2PNodes("--hash-algorithm", "sha256_cbor") as nodes:
        text, ok = status_rows(nodes)["nodes' hash algorithm"]
    assert not ok and "blake3" in text and "sha256_cbor" in text, text
