"""The whole client (Client, Registration, Request, heartbeat, recovery) against the
scripted server in tests/support/fake_server.py: no lmcache needed, every behaviour that is
hard to provoke on a real server (restarts mid-traffic, reaping, silence) on demand."""

from __future__ import annotations

import inspect
import threading
import time

import numpy as np
import pytest

from lmcache_mp import (
    CacheKey,
    Client,
    CpuKVCache,
    InvalidArgument,
    Registration,
    ReplyFuture,
    Request,
    RequestTimeout,
)

from ..support.fake_server import FakeServer, slot_geometry

CHUNK = 256



def tokens(n_chunks: int = 2, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**31, n_chunks * CHUNK).tolist()


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lmcache-mp-heartbeat"]


def wait_until(predicate: object, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def restart(fake: FakeServer, client: Client) -> None:
    """Restart the fake and wait until the client has reconnected. A real restart takes
    seconds, so the client sees the connection drop long before the next request; a
    request sent in the moment between fails (in flight across a restart)."""
    epoch = client._conn.transport.epoch
    fake.restart()
    assert wait_until(lambda: client._conn.transport.refresh() > epoch)


# ------------------------------------------------------------------ register
def test_register_auto_picks_engine_driven_when_the_server_has_a_pool(
        fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m")
        assert reg.mode == "engine" and reg.pool_info is not None
        assert reg.pool_info.shm_name == fake.pool.name  # type: ignore[union-attr]
        assert 0 < reg.instance_id < 2**63 and reg.chunk_size == CHUNK
        assert fake.state.registered == {reg.instance_id: "engine"}
        reg.unregister()
        assert fake.state.registered == {} and not reg.registered


def test_register_auto_falls_back_without_an_engine_driven_handler(kv: CpuKVCache) -> None:
    fake = FakeServer(engine_driven=False)
    try:
        with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
            start = time.monotonic()
            reg = c.register(kv, model_name="m")
            # The NOOP fence answers for the missing handler: no deadline is waited out.
            assert time.monotonic() - start < 1.0
            assert reg.mode == "lmcache"
            assert fake.ops()[-3:] == ["REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT", "NOOP",
                                       "REGISTER_KV_CACHE"]
            reg.unregister()
    finally:
        fake.close()


def test_register_twice_and_bad_arguments_are_refused_locally(fake: FakeServer,
                                                               kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="lmcache", instance_id=7)
        sent = len(fake.seen)
        with pytest.raises(InvalidArgument, match="already registered"):
            c.register(kv, model_name="m", instance_id=7)
        for bad in [dict(mode="gpu"), dict(world_size=0), dict(worker_id=1),
                    dict(instance_id=-1), dict(instance_id=True), dict(model_name="a@b")]:
            args = {"model_name": "m", **bad}
            with pytest.raises(InvalidArgument):
                c.register(kv, **args)  # type: ignore[arg-type]
        assert len(fake.seen) == sent  # nothing reached the server
        assert c.registration(7) is reg and c.registrations == [reg]
        reg.unregister()
        with pytest.raises(InvalidArgument, match="not registered"):
            c.registration(7)


# ------------------------------------------------------------------- request
def test_request_frees_unretrieved_locks_and_ends_its_session(fake: FakeServer,
                                                              kv: CpuKVCache) -> None:
    toks = tokens(3)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        with reg.request(toks, request_id="writer") as w:
            assert w.store(list(range(48))) is True
        with reg.request(toks, request_id="reader", cache_salt="") as r:
            assert r.lookup() == 3 * CHUNK and r.held_locks == 3
            # Retrieve only the first chunk: chunks 1 and 2 stay locked until exit.
            assert r.retrieve(list(range(16)), end=CHUNK) is True
            assert r.held_locks == 2
        frees = fake.requests("FREE_LOOKUP_LOCKS")
        assert [(f.payloads[0]["start"], f.payloads[0]["end"]) for f in frees] == [(CHUNK, 3 * CHUNK)]
        assert frees[0].payloads[0]["worker_id"] is None  # every rank's locks
        assert all(v == 0 for v in fake.state.locks.values())
        ends = [s.payloads[0] for s in fake.requests("END_SESSION")]
        assert ends == ["writer", "reader"] and not fake.state.sessions
        reg.unregister()


def test_request_defaults_and_salt_travel_in_every_key(fake: FakeServer, kv: CpuKVCache) -> None:
    toks = tokens(2) + [5] * 100  # a partial last chunk is never stored
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="lmcache", worker_id=0)
        with reg.request(toks, cache_salt="user-7") as req:
            assert req.request_id.startswith("lmcache-mp-")
            req.store(list(range(32)))
            with pytest.raises(InvalidArgument, match="nothing to retrieve"):
                req.retrieve([])
        (store,) = fake.requests("STORE")
        key = store.payloads[0]
        assert (key["start"], key["end"], key["cache_salt"]) == (0, 2 * CHUNK, "user-7")
        assert key["worker_id"] == 0 and len(key["token_ids"]) == len(toks)
        # Another salt is another cache: nothing found.
        with reg.request(toks, cache_salt="user-8") as other:
            assert other.lookup() == 0
        with reg.request(toks, cache_salt="user-7") as same:
            assert same.lookup() == 2 * CHUNK
        reg.unregister()


def test_unregister_closes_open_requests_first(fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        req = reg.request(tokens(1))
        req.store(list(range(16)))
        reg.unregister()
        ops = fake.ops()
        assert ops.index("END_SESSION") < ops.index("UNREGISTER_KV_CACHE")
        with pytest.raises(InvalidArgument, match="closed"):
            req.store(list(range(16)))
        with pytest.raises(InvalidArgument, match="unregistered"):
            reg.store(CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=tokens(1),
                               start=0, end=CHUNK, request_id="x"), list(range(16)))


def test_engine_driven_store_and_retrieve_use_checked_slots(fake: FakeServer,
                                                            kv: CpuKVCache) -> None:
    fake.slot_geometry = slot_geometry(kv)
    kv.layers[0][...] = np.arange(kv.layers[0].size, dtype=np.float16).reshape(kv.layers[0].shape)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="engine")
        with reg.request(tokens(2)) as req:
            assert req.store(list(range(1, 33))) is True
            assert req.lookup() == 2 * CHUNK
            assert req.retrieve(list(range(40, 72))) is True
        for a, b in zip(range(1, 33), range(40, 72), strict=True):
            assert kv.block_bytes(0, a) == kv.block_bytes(0, b)
        ops = fake.ops()
        assert ops.count("COMMIT_STORE") == 1 and ops.count("COMMIT_RETRIEVE") == 1
        # A slot of the wrong dtype is refused before a byte is copied.
        fake.slot_geometry = {**slot_geometry(kv), "dtype": "bfloat16"}
        fake.state.stored.clear()
        with reg.request(tokens(2, seed=9)) as req:
            from lmcache_mp import ProtocolMismatch

            with pytest.raises(ProtocolMismatch, match="slot"):
                req.store(list(range(1, 33)))
        reg.unregister()


# ----------------------------------------------------------------- liveness
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
    import gc

    before = len(heartbeat_threads())
    c = Client(fake.url, protocol="0.5.3", heartbeat_interval=0.05)
    c.register(kv, model_name="m", mode="lmcache")
    assert len(heartbeat_threads()) == before + 1
    del c
    gc.collect()
    assert wait_until(lambda: len(heartbeat_threads()) == before)


def test_liveness_settings_are_checked() -> None:
    with pytest.warns(UserWarning, match="heartbeat_interval=15"):
        Client("tcp://127.0.0.1:9", heartbeat_interval=15).close()
    for bad in (dict(heartbeat_interval=0), dict(heartbeat_interval=True),
                dict(reap_timeout=-1), dict(timeout="5")):
        with pytest.raises(InvalidArgument):
            Client("tcp://127.0.0.1:9", **bad)  # type: ignore[arg-type]


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


# ------------------------------------------------------------ deadlines, API
def test_per_call_timeout_is_honoured(fake: FakeServer) -> None:
    # NOOP stays answered: it is the probe that tells a dropped request (RequestTimeout)
    # from a server that answers nothing (ServerUnresponsive).
    fake.drop.update({"CLEAR", "GET_EXPERIMENTAL"})
    with Client(fake.url, protocol="0.5.3", timeout=10) as c:
        for call in (lambda: c.clear(timeout=0.2), lambda: c.get_experimental(timeout=0.2),
                     lambda: c.get_experimental_async(timeout=0.2).result()):
            start = time.monotonic()
            with pytest.raises(RequestTimeout):
                call()
            assert 0.2 <= time.monotonic() - start < 1.0


def test_every_blocking_call_has_an_async_twin() -> None:
    for cls in (Client, Registration, Request):
        names = {n for n, v in inspect.getmembers(cls) if callable(v) and not n.startswith("_")}
        for name in names:
            if name.endswith("_async"):
                assert name.removesuffix("_async") in names, f"{cls.__name__}.{name}"
        twins = {n for n in names if f"{n}_async" in names}
        expected = {"store", "retrieve", "lookup"}
        assert expected <= twins, cls.__name__
    assert {n for n in dir(Client) if n.endswith("_async")} == {
        f"{n}_async" for n in (
            "noop", "ping", "clear", "get_experimental", "submit_lookup", "query_prefetch_status",
            "wait_prefetch_status", "query_prefetch_lookup_hits", "lookup", "free_lookup_locks",
            "end_session", "report_block_allocation", "store", "retrieve", "store_engine_driven",
            "retrieve_engine_driven")}
    fut = Client.noop_async
    assert "ReplyFuture" in str(inspect.signature(fut).return_annotation)
    assert ReplyFuture.completed(3).result() == 3


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


@pytest.mark.parametrize("mla, readers", [(True, 2), (False, 1)])
def test_an_mla_registration_declares_every_tp_rank_a_reader(mla: bool, readers: int) -> None:
    """MLA, TP=2 over PP=2 (KV world size 2): LMCache 0.5.5+'s adapter declares both TP
    ranks readers of each replicated object; a non-MLA cache one. Lookups and the lock
    frees a request sends on exit carry the same count (test_key_building checks the
    rule against each release's adapter; this, that a registration applies it)."""
    server = FakeServer(profile="0.5.6")
    try:
        with CpuKVCache.allocate(num_layers=2, num_blocks=40, block_size=16, num_heads=1,
                                 head_dim=8, dtype="float16", mla=mla) as cache, \
                Client(server.url, protocol="0.5.6", timeout=2.0,
                       heartbeat_interval=None) as c:
            reg = c.register(cache, model_name="m", world_size=2, worker_id=1,
                             mode="lmcache")
            with reg.request(list(range(3 * CHUNK)), tp_size=2) as req:
                assert req.lookup() == 0
            for op in ("LOOKUP", "FREE_LOOKUP_LOCKS"):
                for seen in server.requests(op):
                    assert seen.payloads[0]["num_kv_readers"] == readers, (op, seen)
            assert server.requests("LOOKUP")
            reg.unregister()
    finally:
        server.close()


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
