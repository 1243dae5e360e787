"""``lmcache.mp.sync_load``: a hit loaded in the step that computes the request (vLLM's
synchronous load), offline with the fake servers of test_connector_units.py. vLLM's
real scheduler runs it in test_vllm_live.py
(``test_sync_load_is_in_the_blocks_before_the_forward_pass``,
``test_server_gone_between_lookup_and_load[sync_load]``) and a real engine in
test_real_engine.py (``test_cold_and_loaded_engines_match_no_connector``, 0.5.7rc2)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from lmcache_mp.integrations.vllm import worker as worker_module
from lmcache_mp.integrations.vllm.config import ConnectorConfig
from lmcache_mp.integrations.vllm.ops import StepOps

from ...support.polling import wait_until
from .test_connector_units import (
    BS,
    CHUNK,
    FakeClient,
    FakeReg,
    Future,
    op,
    out,
    request,
    with_tokens,
    worker,
)
from .test_keys_and_locks import side


def loaded_step(**cfg: Any) -> tuple[Any, Any, StepOps]:
    """A 3-chunk request with 2 chunks on the server, granted by vLLM and scheduled in
    the same step (what vLLM does with ``(n, False)``): the scheduler side, the request,
    and the step's orders."""
    s = side(FakeClient(hits=2), sync_load=True, **cfg)
    r = request(3 * CHUNK)
    assert s.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, False)
    s.update_state_after_alloc(r, list(range(1, 3 * CHUNK // BS + 1)), 2 * CHUNK)
    step = s.build_step(out({"r": CHUNK}))
    step.tokens = {o.wire_id: bytes(4 * 3 * CHUNK) for o in step.ops}
    return s, r, step


def test_config_reads_sync_load() -> None:
    assert ConnectorConfig.from_extra({"lmcache.mp.sync_load": "true"}).sync_load is True
    assert ConnectorConfig.from_extra({}).sync_load is False


def test_without_sync_load_the_load_stays_asynchronous() -> None:
    s = side(FakeClient(hits=2))
    assert s.get_num_new_matched_tokens(request(3 * CHUNK), 0) == (2 * CHUNK, True)


def test_a_sync_load_is_done_before_the_forward_pass_and_never_reported_received() -> None:
    """The RETRIEVE and the STORE of what the step computes are ordered together; the
    worker's ``start_load_kv`` ends the load before returning, reports it through the
    step's ``WorkerReport`` and never as "finished receiving" (vLLM asserts that only a
    request waiting for its load is). The request finishing in that step keeps its blocks
    for its STORE (held), and its session ends once the load's end is reported."""
    s, r, step = loaded_step()
    (load,) = step.retrieves()
    (store,) = step.stores()
    assert load.sync and (load.start, load.end) == (0, 2 * CHUNK)
    assert (store.start, store.end) == (2 * CHUNK, 3 * CHUNK)
    reg = FakeReg()
    w = worker(reg, FakeClient())
    w.start_loads(step)
    assert [d for d, *_ in reg.sent] == ["RETRIEVE"]
    assert w.stats["retrieved"] == 1 and w.load_errors() == set()
    w.start_stores(step)
    assert [d for d, *_ in reg.sent] == ["RETRIEVE", "STORE"]
    assert w.get_finished(set()) == (set(), set())  # never "finished receiving"
    assert w.sync_loads_ended() == {"r"} and w.sync_loads_ended() == set()
    assert s.request_finished(r) is True  # held for its STORE, not dropped with the load
    s.update_connector_output(None, None, None, None, {"r"})
    assert not s._finishing[0].load_ordered
    s.update_connector_output(None, {"r"})  # its STORE done: the session ends
    assert s._finishing == []


@pytest.mark.parametrize("outcome", ["refused", "late"])
def test_a_failed_sync_load_reports_its_blocks_and_the_request_stores_nothing_more(
        outcome: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load fails (the server finds a chunk missing, or no reply within the
    deadline): its blocks go to vLLM with this step's output, and neither this step's
    STORE of the request (its later tokens were computed over the failed blocks) nor any
    later one is made, by the worker (which knows at once) and the scheduler (told with
    the step's output); another request's STORE is made. A request of the same id
    after this one finished stores again."""
    s, r, step = loaded_step()
    (load,) = step.retrieves()
    reg = FakeReg()
    w = worker(reg, FakeClient())
    if outcome == "late":
        monkeypatch.setattr(worker_module, "SYNC_LOAD_GRACE_S", 0.0)
        w.cfg = ConnectorConfig(transfer_timeout=0.01)
        reg.next = Future(True, ready=False)
    else:
        reg.next = Future(False)
    w.start_loads(step)
    failed = w.load_errors()
    assert failed == set(load.written_block_ids) and w.stats["load_errors"] == 1
    reg.next = Future(True)
    other = with_tokens([op("STORE", "q")])
    w.start_stores(StepOps([*step.stores(), *other.ops], tokens={**step.tokens, **other.tokens}))
    assert [(d, k.request_id) for d, k, _ in reg.sent][1:] == [("STORE", "q")]  # not "r"
    assert w.failed_stores() == {("r", 2 * CHUNK, 3 * CHUNK)}
    w.start_stores(step)  # a later step's STORE of it: not made either
    assert len(reg.sent) == 2
    s.update_connector_output(None, None, failed, None, w.sync_loads_ended())
    t = s.trackers["r"]
    assert t.load_failed and not t.load_ordered
    assert s.build_step(out({}, {"r": [99]})).stores() == []
    w.get_finished({"r"})  # vLLM finished it: the id may come back as a new request
    w.start_stores(step)
    assert [d for d, *_ in reg.sent] == ["RETRIEVE", "STORE", "STORE"]


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu_cache", "cuda_cache"])
def test_a_cpu_cache_sends_its_loads_before_vllm_prepares_the_step(
        cpu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 / 0.33's model runner calls ``handle_preemptions`` before it prepares
    the step's inputs and ``start_load_kv`` after (the harness calls them so): a CPU
    cache's RETRIEVEs of a step with a synchronous load go out at the first (their copy
    overlaps the preparation), a CUDA cache's at the second (the current stream's order
    there); never twice, and a synchronous load is waited for at ``start_load_kv``
    either way. Asynchronous loads alone wait for ``start_load_kv`` (which vLLM calls
    after the forward pass then)."""
    monkeypatch.setattr(worker_module, "_is_cpu", lambda reg: cpu)
    _s, _r, step = loaded_step()
    reg = FakeReg()
    w = worker(reg, FakeClient())  # a CPU cache's transfers run on the load thread

    def sent(n: int) -> bool:
        return wait_until(lambda: len(reg.sent) >= n, 10.0)

    try:
        w.start_loads(step, early=True)
        assert sent(1) if cpu else reg.sent == []
        assert w.stats["early_loads"] == int(cpu)
        assert w.sync_loads_ended() == set()  # not waited for before start_load_kv
        w.start_loads(step)
        assert [d for d, *_ in reg.sent] == ["RETRIEVE"]
        assert w.sync_loads_ended() == {"r"} and w.stats["retrieved"] == 1
        w.start_loads(step)  # called again in the step: nothing sent again
        assert len(reg.sent) == 1
        async_step = StepOps([replace(op, sync=False) for op in step.retrieves()],
                             tokens=step.tokens)
        w.start_loads(async_step, early=True)
        assert len(reg.sent) == 1
        w.start_loads(async_step)
        assert sent(2) and len(reg.sent) == 2
    finally:
        w.shutdown()
