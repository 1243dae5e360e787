"""KV shared across nodes through LMCache's second tier: a prefix stored through node A
is found, retrieved and byte-identical through node B, which never saw it.

Each tier is real and made here: a shared directory (``fs``, ``fs_native``), one Valkey
server (``resp``: LMCache's C++ RESP client; ``valkey``: valkey-glide), and a
three-node Valkey cluster (``valkey`` with ``cluster_mode``). Both transfer modes
(LMCache-driven and engine-driven), two servers of the job's release, and of two
releases (0.5.6 <-> 0.5.7rc2) where they share the format. B is asked before A stores
(it must find nothing) and the tier must hold the chunks afterwards: B's hit can only
have come through the tier.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from ..conftest import SERVER_VERSION
from .conftest import (
    OTHER_RELEASE,
    NodeCache,
    Nodes,
    prefix,
    require_l2_release,
    share,
    sharing,
)

pytestmark = pytest.mark.live
MODES = ["lmcache", "engine"]
TIERS = ["fs", "fs_native", "resp", "valkey", "valkey_cluster"]
_seeds = itertools.count(3600)


@pytest.fixture(scope="module", params=TIERS)
def nodes(request: pytest.FixtureRequest) -> Iterator[Nodes]:
    with sharing(request.param) as pair:
        yield pair


@pytest.mark.parametrize("mode", MODES)
def test_prefix_stored_through_a_is_retrieved_through_b(nodes: Nodes, mode: str) -> None:
    tokens = prefix(next(_seeds), chunks=8)
    before = nodes.tier.objects()
    with NodeCache(nodes.a, mode, seed=1) as a, NodeCache(nodes.b, mode, seed=2) as b:
        assert (a.reg.mode, b.reg.mode) == (mode, mode)
        took = share(a, b, tokens)
    assert nodes.tier.objects() >= before + 8, "the tier does not hold the 8 chunks"
    if nodes.tier.cluster is not None:
        spread = nodes.tier.cluster.keys_per_node()
        assert sum(1 for n in spread if n) >= 2, f"one cluster node holds every key: {spread}"
    print(f"{nodes.tier.name} {mode}: {took}")


CROSS_TIERS = ["fs", "resp", "valkey"]


@pytest.fixture(scope="module", params=CROSS_TIERS)
def cross_nodes(request: pytest.FixtureRequest) -> Iterator[Nodes]:
    """A of the other release, B of the job's, one tier."""
    require_l2_release()
    with sharing(request.param, (OTHER_RELEASE[SERVER_VERSION], SERVER_VERSION)) as pair:
        yield pair


@pytest.mark.parametrize("mode", MODES)
def test_prefix_shared_across_releases_both_ways(cross_nodes: Nodes, mode: str) -> None:
    pair = cross_nodes
    with NodeCache(pair.a, mode, seed=3) as a, NodeCache(pair.b, mode, seed=4) as b:
        share(a, b, prefix(next(_seeds)))  # old release -> new
        share(b, a, prefix(next(_seeds)))  # new -> old
