"""One CUDA event per step's batch in LMCache-driven GPU mode (issue 38 item 4), offline:
the fake CUDA driver counts the interprocess events the worker creates and exports,
vLLM 0.32's layer views (fixtures/vllm/kv_layouts.json), a real lmcache_mp Client
against the scripted fake server (tests/integrations/vllm/test_connector_cuda.py's
set-up). LMCache's own connector records one event per step for the step's RETRIEVEs
and one for its STOREs (``create_recorded_event`` before its batched submit); ours
created and exported one per transfer."""

from __future__ import annotations

import time
from typing import Any

import pytest

from lmcache_mp.integrations.vllm.kv_caches import wrap_layers
from lmcache_mp.integrations.vllm.ops import StepOps, TransferOp
from lmcache_mp.integrations.vllm.worker import WorkerSide
from lmcache_mp.ipc.cuda.cache import CudaKVCache
from tests.integrations.vllm.test_connector_cuda import (  # noqa: F401  (the fixture)
    BS,
    CHUNK,
    SERVER_EVENT,
    CurrentStream,
    collect,
    server,
    vllm_layers,
    worker_for,
)
from tests.integrations.vllm.test_connector_units import with_tokens
from tests.support.fake_cuda import FakeDriver
from tests.support.fake_server import FakeServer


def transfer(direction: str, rid: str, first_block: int) -> TransferOp:
    return TransferOp(direction, rid, 0, CHUNK,
                      tuple(range(first_block, first_block + CHUNK // BS)))


class Counting:
    """The driver's event creations and exports, per step."""

    def __init__(self, drv: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
        self.created: list[int] = []
        self.exported: list[int] = []
        create, export = drv.event_create_ipc, drv.ipc_get_event_handle

        def event_create_ipc() -> int:
            ev = create()
            self.created.append(ev)
            return ev

        def ipc_get_event_handle(event: int) -> bytes:
            self.exported.append(event)
            return export(event)

        monkeypatch.setattr(drv, "event_create_ipc", event_create_ipc)
        monkeypatch.setattr(drv, "ipc_get_event_handle", ipc_get_event_handle)

    def take(self) -> tuple[int, int]:
        counts = (len(self.created), len(self.exported))
        self.created, self.exported = [], []
        return counts


def received(srv: FakeServer, op: str, n: int) -> list[Any]:
    """The server's ``op`` requests once ``n`` came in (the client sends on its own)."""
    deadline = time.monotonic() + 10
    while len(srv.requests(op)) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return list(srv.requests(op))


def lmcache_driven(srv: FakeServer, drv: FakeDriver) -> WorkerSide:
    cache = wrap_layers(vllm_layers(drv, "LBNHC"), BS, driver=drv)
    w = worker_for(srv, cache)
    assert w.reg is not None and w.reg.mode == "lmcache" and isinstance(cache, CudaKVCache)
    return w


def test_a_steps_retrieves_and_stores_send_one_event_each(
        server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    drv = FakeDriver()
    current = CurrentStream(monkeypatch)
    w = lmcache_driven(server, drv)
    count = Counting(drv, monkeypatch)
    try:
        # start_load_kv: three requests' RETRIEVEs in one step, on stream 0x61.
        current.value = 0x61
        loads = [transfer("RETRIEVE", rid, 1 + 4 * i) for i, rid in enumerate("abc")]
        w.start_loads(with_tokens(loads, first=1))
        assert count.take() == (1, 1)
        sent = [r.payloads[3] for r in received(server, "RETRIEVE", 3)]
        assert len(sent) == 3 and len(set(sent)) == 1  # the server waits for that one
        (event,) = {k for k, e in drv.events.items() if e.get("kind") == "ours"}
        assert drv.events[event]["recorded_on"] == 0x61
        current.value = 0x98  # another stream is current when the replies come in
        done: set[str] = set()
        while done != {"a", "b", "c"}:
            done |= collect(w, set())[1]
        # Each reply made the recording stream wait for the server's copy; our event
        # went once every transfer had its reply, destroyed once.
        waits = [c for c in drv.calls if c[0] == "wait"]
        assert waits == [("wait", 0x61, SERVER_EVENT)] * 3
        assert drv.events[event]["destroyed"]

        # wait_for_save: two STOREs of the step, after its forward pass on 0x51.
        current.value = 0x51
        w.start_stores(with_tokens([transfer("STORE", "d", 13), transfer("STORE", "e", 17)],
                                   first=1))
        w.start_loads(StepOps(held=["d", "e"]))
        assert count.take() == (1, 1)
        assert len({r.payloads[3] for r in received(server, "STORE", 2)}) == 1
        sending: set[str] = set()
        while sending != {"d", "e"}:
            sending |= collect(w, {"d", "e"})[0]
        assert all(e["destroyed"] for e in drv.events.values() if e.get("kind") == "ours")
        assert w.load_errors() == set() and w.stats["retrieved"] == 3
    finally:
        w.shutdown()


def test_transfers_of_one_batch_on_two_streams_get_one_event_per_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The cache's batch scope keys the shared event by stream: a transfer on another
    # stream must not send an event that captured other work.
    drv = FakeDriver()
    cache = wrap_layers(vllm_layers(drv, "LBNHC"), BS, driver=drv)
    assert isinstance(cache, CudaKVCache)
    count = Counting(drv, monkeypatch)
    tokens: list[Any] = []
    with cache.one_event():
        tokens.append(cache.begin_transfer(0x61))
        tokens.append(cache.begin_transfer(0x61))
        tokens.append(cache.begin_transfer(0x71))
    assert count.take() == (2, 2)
    assert tokens[0][0] == tokens[1][0] != tokens[2][0]
    ours = [k for k, e in drv.events.items() if e.get("kind") == "ours"]
    assert [drv.events[k]["recorded_on"] for k in ours] == [0x61, 0x71]
    # Released by their replies: each event goes with its last share.
    cache.end_transfer(SERVER_EVENT, None, tokens[0][1])
    assert not drv.events[ours[0]]["destroyed"]
    cache.end_transfer(SERVER_EVENT, None, tokens[1][1])
    assert drv.events[ours[0]]["destroyed"]
    del tokens[:2]
    tokens.clear()  # a transfer dropped without a reply (timed out): its event goes too
    assert drv.events[ours[1]]["destroyed"]
    # Outside a batch: one event per transfer, as before.
    _, token = cache.begin_transfer(0x61)
    assert count.take() == (1, 1)
    cache.end_transfer(SERVER_EVENT, None, token)
