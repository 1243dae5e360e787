"""Liveness and recovery against the scripted server: heartbeats (one per client, stopped
with the last registration or a dropped client), a server that answers nothing
(ServerUnresponsive, calls fail at once, lifted by an answer or a reconnect), silence past
the reaper's budget, restarts (recovered before the next call, step by step, under
engine-driven traffic; a restart with another chunk size refused), an oversized reply.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest

from lmcache_mp import (
    Client,
    CpuKVCache,
    ProtocolMismatch,
    Registration,
    RequestTimeout,
    ServerUnavailable,
    ServerUnresponsive,
)
from lmcache_mp.transport import MAX_REPLY_BYTES

from ..support.fake_server import FakeServer, slot_geometry
from ..support.polling import wait_until
from ..support.session_helpers import (
    FAST,
    PER_CHUNK,
    SLACK,
    heartbeat_threads,
    key,
    restart,
    slot,
    timed,
    tokens,
)


def test_heartbeat_pings_each_registration_and_stops_with_the_last(fake: FakeServer,
                                                                   kv: CpuKVCache) -> None:
    before = len(heartbeat_threads())
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=0.05) as c:
        assert len(heartbeat_threads()) == before  # none without a registration
        reg = c.register(kv, model_name="m", mode="lmcache")
        assert wait_until(lambda: len(fake.requests("PING")) >= 3)
        assert {s.payloads[0] for s in fake.requests("PING")} == {reg.instance_id}
        assert len(heartbeat_threads()) == before + 1
        reg.unregister(unlink=False)  # keep the SHM names: registered again below
        assert wait_until(lambda: len(heartbeat_threads()) == before)
        # A new registration starts a new heartbeat; close() stops it.
        reg2 = c.register(kv, model_name="m", mode="lmcache")
        assert reg2.registered and len(heartbeat_threads()) == before + 1
    assert len(heartbeat_threads()) == before


def test_a_dropped_client_stops_its_heartbeat(fake: FakeServer, kv: CpuKVCache) -> None:
    before = len(heartbeat_threads())
    c = Client(fake.url, protocol="0.5.3", heartbeat_interval=0.05)
    c.register(kv, model_name="m", mode="lmcache")
    assert len(heartbeat_threads()) == before + 1
    del c
    gc.collect()
    assert wait_until(lambda: len(heartbeat_threads()) == before)


def test_cuda_registration_is_re_sent_from_the_heartbeat_without_cuda_calls(
        fake: FakeServer) -> None:
    """A GPU registration is re-sent by the heartbeat thread, which has no CUDA context:
    the handles exported at registration are sent again, and no CUDA call is made."""
    from lmcache_mp.ipc.cuda import CudaKVCache

    from ..support.fake_cuda import FakeDriver

    drv = FakeDriver()
    cache = CudaKVCache.allocate(num_layers=2, num_blocks=8, block_size=16, num_heads=2,
                                 head_dim=64, dtype="bfloat16", driver=drv)
    recovered: list[Registration] = []
    try:
        with Client(fake.url, protocol="0.5.3", heartbeat_interval=0.05,
                    on_recovered=recovered.append) as c:
            reg = c.register(cache, model_name="gpu")
            assert reg.mode == "lmcache"  # GPU caches: the server copies
            (first,) = fake.requests("REGISTER_KV_CACHE")
            calls = len(drv.calls)
            restart(fake, c)
            assert wait_until(lambda: recovered == [reg])  # the heartbeat re-registered
            second = fake.requests("REGISTER_KV_CACHE")[-1]
            assert second.payloads == first.payloads  # same handles, same wrappers
            assert len(drv.calls) == calls, drv.calls[calls:]
            reg.unregister()
    finally:
        cache.close()


def test_a_server_that_answers_nothing_is_unresponsive_then_calls_fail_at_once(
        fake: FakeServer) -> None:
    with Client(fake.url, protocol="0.5.3", timeout=0.5, heartbeat_interval=None) as c:
        assert c.noop() == "OK"
        fake.silent.set()  # like a dead message thread: received, never answered
        took, err = timed(c.noop)
        assert isinstance(err, ServerUnresponsive), err
        assert "message thread has died" in str(err)
        assert 0.5 <= took < 0.5 + SLACK
        sent = len(fake.seen)
        for call in (c.noop, c.chunk_size, c.get_experimental, lambda: c.ping(7)):
            took, err = timed(call)
            assert isinstance(err, ServerUnresponsive) and took < FAST, (took, err)
        # Failed calls were not sent; at most one fresh probe (one per second).
        assert len(fake.seen) - sent <= 1
        fake.silent.clear()
        # The next probe's answer lifts the gate: calls work again on their own.
        assert wait_until(lambda: timed(c.noop)[1] is None, timeout=2.5)
        assert c.noop() == "OK"


def test_a_dropped_request_on_a_live_server_stays_a_plain_timeout(fake: FakeServer) -> None:
    fake.drop.add("CLEAR")
    with Client(fake.url, protocol="0.5.3", timeout=5.0, heartbeat_interval=None) as c:
        took, err = timed(lambda: c.clear(timeout=0.4))
        assert type(err) is RequestTimeout and 0.4 <= took < 0.4 + SLACK
        assert "although the server is answering" in str(err)
        took, err = timed(c.noop)  # not gated
        assert err is None and took < 1.0  # not gated (its deadline is 5 s)
        assert fake.ops().count("NOOP") == 2  # the probe and this call


def test_an_unresponsive_server_is_forgotten_on_reconnect_and_recovered(
        fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", timeout=0.6, heartbeat_interval=0.1) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        fake.silent.set()
        with reg.request(tokens(1)) as req:
            took, err = timed(lambda: req.store(list(range(1, 17))))
        assert isinstance(err, ServerUnresponsive) and took < 0.6 + SLACK
        fake.silent.clear()
        epoch = c._conn.transport.epoch
        fake.restart()  # a new server process: the client connects again by itself
        # Until the reconnection is seen, calls fail fast by design (the server was judged
        # unresponsive); under load the first call could come before it (CI, stop 17).
        assert wait_until(lambda: c._conn.transport.refresh() > epoch)
        with reg.request(tokens(1, seed=1)) as req:
            assert req.store(list(range(1, 17)), timeout=3.0) is True
        assert reg.recoveries >= 1 and fake.state.registered == {reg.instance_id: "lmcache"}
        reg.unregister()


def test_protocol_detection_against_a_silent_server_is_unresponsive(fake: FakeServer) -> None:
    fake.silent.set()
    with Client(fake.url, timeout=0.5, heartbeat_interval=None) as c:  # protocol="auto"
        took, err = timed(c.noop)
        assert isinstance(err, ServerUnresponsive) and took < 0.5 + SLACK
        took, err = timed(c.noop)
        assert isinstance(err, ServerUnresponsive) and took < FAST
        fake.silent.clear()
        # The detection's fence, answered late, lifts the gate (the fake answers
        # what it received once it speaks again only for new requests: a re-probe).
        assert wait_until(lambda: timed(c.noop)[1] is None, timeout=2.5)


def test_protocol_identified_says_when_a_call_would_probe_first(fake: FakeServer) -> None:
    # The vLLM scheduler skips calls until this is True (a probe waits up to 2 s).
    with Client(fake.url, timeout=5.0, heartbeat_interval=None) as client:
        assert not client.protocol_identified  # nothing asked yet: "auto" probes first
        client.noop()
        assert client.protocol_identified
        restart(fake, client)
        assert not client.protocol_identified  # a new connection: identified again
        client.noop()
        assert client.protocol_identified
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as fixed:
        assert fixed.protocol_identified  # a fixed protocol is never probed


def test_silent_server_turns_unhealthy_then_recovers_with_a_re_register(
        fake: FakeServer, kv: CpuKVCache) -> None:
    changes: list[bool] = []
    recovered: list[Registration] = []
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=0.05, timeout=0.2,
                on_health_change=changes.append, on_recovered=recovered.append) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        fake.silent.set()
        assert wait_until(lambda: changes == [False]) and not c.healthy
        registers = len(fake.requests("REGISTER_KV_CACHE"))
        fake.silent.clear()
        assert wait_until(lambda: changes == [False, True]) and c.healthy
        # The server may have reaped us while silent: registered again, reported.
        assert len(fake.requests("REGISTER_KV_CACHE")) == registers + 1
        assert recovered == [reg] and reg.recoveries == 1
        reg.unregister()


def test_silence_longer_than_the_reap_budget_re_registers(fake: FakeServer,
                                                          kv: CpuKVCache) -> None:
    recovered: list[Registration] = []
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, reap_timeout=0.3,
                on_recovered=recovered.append) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        fake.state.registered.clear()  # the server's reaper dropped us
        time.sleep(0.3)
        with reg.request(tokens(1)) as req:
            assert req.store(list(range(16))) is True
        assert reg.recoveries == 1
        assert recovered == []  # not a restart: the cache was not lost
        reg.unregister()


def test_restart_is_recovered_before_the_next_store(fake: FakeServer, kv: CpuKVCache) -> None:
    recovered: list[Registration] = []
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=3,
                on_recovered=recovered.append) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        with reg.request(tokens(1)) as req:
            assert req.store(list(range(16)))
        restart(fake, c)  # forgets the registration: a STORE alone would get no reply
        start = time.monotonic()
        with reg.request(tokens(1, seed=3)) as req:
            assert req.store(list(range(16))) is True
        assert time.monotonic() - start < 2.0
        ops = fake.ops()
        last_register = len(ops) - 1 - ops[::-1].index("REGISTER_KV_CACHE")
        assert ops.index("STORE", last_register) > last_register
        assert recovered == [reg] and reg.recoveries == 1
        reg.unregister()


def test_recovery_after_a_restart_step_by_step(fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=3) as c:
        reg = c.register(kv, model_name="m", mode="lmcache", world_size=2, worker_id=1)
        (first,) = fake.requests("REGISTER_KV_CACHE")
        epoch = c._conn.transport.epoch
        fake.restart()
        deadline = time.monotonic() + 3
        while c._conn.transport.refresh() == epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        mark = len(fake.seen)
        assert reg.store(key(reg, tokens(1), worker_id=1), list(range(PER_CHUNK))) is True
        # 1. the chunk size is asked again (a restarted server may use another), 2. the
        # same registration is sent again, 3. then the transfer.
        assert fake.ops()[mark:] == ["GET_CHUNK_SIZE", "REGISTER_KV_CACHE", "STORE"]
        second = fake.requests("REGISTER_KV_CACHE")[-1]
        assert second.payloads == first.payloads
        assert fake.state.registered == {reg.instance_id: "lmcache"}
        reg.unregister()


def test_restart_under_engine_driven_traffic_rebinds_the_pool(fake: FakeServer,
                                                              kv: CpuKVCache) -> None:
    fake.slot_geometry = slot_geometry(kv)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=3) as c:
        reg = c.register(kv, model_name="m", mode="engine")
        restart(fake, c)
        with reg.request(tokens(1)) as req:
            assert req.store(list(range(16))) is True
        assert reg.recoveries == 1 and fake.state.registered == {reg.instance_id: "engine"}
        reg.unregister()


@pytest.mark.parametrize("mode", ["lmcache", "engine"])
def test_a_transfer_checked_on_a_connection_that_then_changed_is_sent_again_registered(
        fake: FakeServer, kv: CpuKVCache, mode: str) -> None:
    """The race the epochs close: the binding was checked, then the socket reconnected
    to a restarted server before the request went out. The request must fail unsent and
    be sent again after registering anew, not reach the new server unregistered."""
    fake.slot_geometry = slot(kv, 0)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=3) as c:
        reg = c.register(kv, model_name="m", mode=mode)  # type: ignore[arg-type]
        stale = reg._state.binding
        checked = reg._bound

        def bound_once_stale(deadline: float) -> Any:
            reg.__dict__.pop("_bound")  # later checks are the real ones
            return stale

        epoch = c._conn.transport.epoch
        fake.restart()
        deadline = time.monotonic() + 3
        while c._conn.transport.refresh() == epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        reg._bound = bound_once_stale  # type: ignore[method-assign]
        assert reg.store(key(reg, tokens(1)), list(range(PER_CHUNK))) is True
        assert checked is not None and reg.recoveries == 1
        ops = fake.ops()
        first = "STORE" if mode == "lmcache" else "PREPARE_STORE"
        assert ops.count(first) == 1  # nothing reached the new server unregistered
        assert ops.index(first) > len(ops) - 1 - ops[::-1].index(
            "REGISTER_KV_CACHE" if mode == "lmcache" else "REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT")
        reg.unregister()


def test_a_restarted_server_with_another_chunk_size_is_refused(fake: FakeServer,
                                                               kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=3) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        epoch = c._conn.transport.epoch
        fake.restart()
        fake.state.chunk_size = 512
        deadline = time.monotonic() + 3
        while c._conn.transport.refresh() == epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ProtocolMismatch, match="chunk size 512"):
            reg.store(key(reg, tokens(1)), list(range(PER_CHUNK)))
        assert "STORE" not in fake.ops()


def test_an_oversized_reply_fails_fast_and_the_client_reconnects(fake: FakeServer) -> None:
    with Client(fake.url, protocol="0.5.3", timeout=3.0, heartbeat_interval=None) as c:
        assert c.noop() == "OK"
        fake.hooks["GET_EXPERIMENTAL"] = lambda payloads: ["x" * (MAX_REPLY_BYTES + 1)]
        took, err = timed(c.get_experimental)
        assert isinstance(err, ServerUnavailable) and "MAXMSGSIZE" in str(err), err
        assert took < 1.0  # at once, not at the deadline
        del fake.hooks["GET_EXPERIMENTAL"]
        # ZMQ ends a connection for good after such a frame; the transport starts a
        # new one, so the next call works.
        took, err = timed(c.get_experimental)
        assert err is None and took < 1.0
