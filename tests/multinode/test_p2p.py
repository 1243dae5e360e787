"""LMCache's P2P second tier: node B reads node A's L1 directly (a coordinator hands
each server its peer's ``p2p`` adapter; ``mooncake_te`` moves the bytes over TCP). A
prefix stored through A is found, retrieved and byte-identical through B, in both
transfer modes (LMCache 0.5.7rc2; the tier's packages from the registries:
scripts/p2p.sh)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

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
