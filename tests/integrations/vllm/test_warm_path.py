"""A warm request's way to its first token (issue 38): what the connector does between
the lookup's answer and vLLM scheduling the request. Offline (fake clients and
registrations; benchmarks/vllm_e2e.py measures the same on a real engine)."""

from __future__ import annotations

import time
from typing import Any

from lmcache_mp.integrations.vllm import worker as worker_module
from lmcache_mp.integrations.vllm.ops import StepOps

from .test_connector_units import (
    CHUNK,
    Answering,
    FakeClient,
    FakeReg,
    op,
    out,
    request,
    side,
    with_tokens,
    worker,
)


def test_a_step_without_a_forward_pass_reports_its_load_in_that_step() -> None:
    # vLLM runs no forward pass in a step that schedules no tokens (every request is
    # waiting, a warm one for its load): the worker waits there for the load's reply
    # and reports it, so the request is scheduled in the next step, not a poll later.
    reg = FakeReg()
    reg.next = Answering(True, after=0.005)
    w = worker(reg, FakeClient())
    w.start_loads(with_tokens([op("RETRIEVE")], idle=True))
    assert w.get_finished(set()) == (set(), {"r"})
    assert reg.next.waits and max(reg.next.waits) <= worker_module.IDLE_LOAD_WAIT_S


def test_a_step_with_a_forward_pass_only_polls_its_loads() -> None:
    reg = FakeReg()
    reg.next = Answering(True, after=0.005)
    w = worker(reg, FakeClient())
    w.start_loads(with_tokens([op("RETRIEVE")]))  # other requests compute: not idle
    assert w.get_finished(set()) == (set(), set()) and reg.next.waits == []
    reg.next.ready = True
    assert w.get_finished(set()) == (set(), {"r"})


def test_the_wait_of_a_step_without_a_forward_pass_is_bounded() -> None:
    reg = FakeReg()
    reg.next = Answering(True, after=None)  # the server does not answer
    w = worker(reg, FakeClient())
    w.start_loads(with_tokens([op("RETRIEVE")], idle=True))
    t0 = time.monotonic()
    assert w.get_finished(set()) == (set(), set())
    assert time.monotonic() - t0 < worker_module.IDLE_LOAD_WAIT_S + 1.0
    assert reg.next.waits and max(reg.next.waits) <= worker_module.IDLE_LOAD_WAIT_S
    reg.next.ready = True  # answered later: reported by a later step, as before
    w.start_loads(StepOps())
    assert w.get_finished(set()) == (set(), {"r"})


def test_the_scheduler_marks_the_steps_that_schedule_no_tokens() -> None:
    c = FakeClient(hits=2)
    s = side(c)
    r = request(3 * CHUNK)
    assert s.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, True)
    s.update_state_after_alloc(r, list(range(12)), 2 * CHUNK)
    waiting = out({})
    waiting.total_num_scheduled_tokens = 0
    step = s.build_step(waiting)  # the load's step: nothing else runs
    assert step.idle and [o.direction for o in step.ops] == ["RETRIEVE"]
    busy: Any = out({"other": 16})
    busy.total_num_scheduled_tokens = 16
    assert not s.build_step(busy).idle
    assert not s.build_step(out({})).idle  # not said: never assumed idle
