"""Registering a cache, against the scripted server (tests/support/fake_server.py): the
mode picked (engine-driven where the server has a pool, LMCache-driven where it has none,
refused and undone where engine-driven was asked for and is absent), what a registration
carries (the layout hint, the readers of an MLA cache, one geometry per model), when it is
sent again, and unregistering.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from lmcache_mp import (
    CacheKey,
    Client,
    CpuKVCache,
    InvalidArgument,
    ProtocolMismatch,
    RequestTimeout,
    ServerUnresponsive,
)

from ..support.fake_server import FakeServer
from ..support.session_helpers import CHUNK, PER_CHUNK, key, kv_cache, slot, tokens


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


@pytest.mark.parametrize("answer", [{"shm_name": "", "pool_size": 0},
                                    {"shm_name": "somepool", "pool_size": 0},
                                    {"shm_name": "", "pool_size": 4096}])
def test_a_server_without_a_pool_gets_a_server_copy_registration_in_auto_mode(
        fake: FakeServer, kv: CpuKVCache, answer: dict[str, Any]) -> None:
    fake.hooks["REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT"] = lambda p: answer
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m")
        assert reg.mode == "lmcache" and reg.pool_info is None
        ops = fake.ops()
        # The half-made engine-driven context is taken back before the fallback.
        undo = ops.index("UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT")
        assert undo < ops.index("REGISTER_KV_CACHE")
        assert fake.requests("UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT")[0].payloads == \
            [reg.instance_id]
        assert len(c._registry.pools) == 0
        reg.unregister()


@pytest.mark.parametrize("answer", [{"shm_name": "", "pool_size": 0},
                                    {"shm_name": "somepool", "pool_size": 0}])
def test_engine_mode_on_a_server_without_a_pool_is_refused_and_undone(
        fake: FakeServer, kv: CpuKVCache, answer: dict[str, Any]) -> None:
    fake.hooks["REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT"] = lambda p: answer
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        with pytest.raises(ProtocolMismatch, match="--shm-name"):
            c.register(kv, model_name="m", mode="engine", instance_id=5)
        assert [s.payloads for s in fake.requests(
            "UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT")] == [[5]]
        assert c.registrations == [] and len(c._registry.pools) == 0


def test_any_named_pool_of_some_size_is_taken(fake: FakeServer, kv: CpuKVCache) -> None:
    assert fake.pool is not None
    fake.hooks["REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT"] = lambda p: {
        "shm_name": fake.pool.name, "pool_size": 1}  # type: ignore[union-attr]
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m")
        assert reg.mode == "engine" and reg.pool_info is not None
        assert reg.pool_info.pool_size == 1
        reg.unregister()


def test_auto_mode_engine_registration_transfers_without_registering_again(
        fake: FakeServer, kv: CpuKVCache) -> None:
    fake.slot_geometry = slot(kv, 0)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m")
        assert reg.mode == "engine"
        assert reg.pool_info is not None and reg.pool_info.shm_name == fake.pool.name  # type: ignore[union-attr]
        for seed in range(2):
            assert reg.store(key(reg, tokens(1, seed)), list(range(PER_CHUNK))) is True
        assert len(fake.requests("REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT")) == 1
        reg.unregister()


def test_explicit_engine_mode_keeps_the_pool_info_and_takes_a_small_pool(
        fake: FakeServer, kv: CpuKVCache) -> None:
    assert fake.pool is not None
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="engine")
        assert reg.pool_info is not None and reg.pool_info.shm_name == fake.pool.name
        reg.unregister(unlink=False)
        fake.hooks["REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT"] = lambda p: {
            "shm_name": fake.pool.name, "pool_size": 1}  # type: ignore[union-attr]
        reg = c.register(kv, model_name="m", mode="engine")
        assert reg.pool_info is not None and reg.pool_info.pool_size == 1
        reg.unregister()


def test_auto_register_fails_cleanly_when_the_fence_is_not_answered(
        fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=30) as c:
        c.chunk_size()
        fake.drop.add("NOOP")
        start = time.monotonic()
        with pytest.raises((RequestTimeout, ServerUnresponsive)):
            c.register(kv, model_name="m", timeout=0.3)
        assert time.monotonic() - start < 2.0
        assert c.registrations == []


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


def test_one_geometry_per_model_and_world_size(fake: FakeServer, kv: CpuKVCache) -> None:
    other = CpuKVCache.allocate(num_layers=2, num_blocks=80, block_size=16, num_heads=4,
                                head_dim=8, dtype="float16")
    more_blocks = CpuKVCache.allocate(num_layers=2, num_blocks=96, block_size=16,
                                      num_heads=2, head_dim=8, dtype="float16")
    try:
        with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c, \
                Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c2:
            reg = c.register(kv, model_name="geo", mode="lmcache")
            registers = fake.ops().count("REGISTER_KV_CACHE")
            for client in (c, c2):  # also from another client of the same server
                with pytest.raises(InvalidArgument, match="one memory layout per"):
                    client.register(other, model_name="geo", mode="lmcache")
            assert fake.ops().count("REGISTER_KV_CACHE") == registers  # nothing sent
            # The same object shape (more blocks) is fine; so is another model.
            c2.register(more_blocks, model_name="geo", mode="lmcache").unregister(unlink=False)
            c.register(other, model_name="geo-2", mode="lmcache").unregister(unlink=False)
            c.register(other, model_name="geo", world_size=2, mode="lmcache").unregister(
                unlink=False)
            reg.unregister(unlink=False)
            c.register(other, model_name="geo", mode="lmcache")  # the first one is gone
        with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
            # close() without unregister released the claim of the closed client
            c.register(kv, model_name="geo", mode="lmcache").unregister(unlink=False)
    finally:
        other.close()
        more_blocks.close()


def test_an_unlinked_cache_cannot_be_registered_again(fake: FakeServer) -> None:
    with kv_cache() as cache, Client(fake.url, protocol="0.5.3", heartbeat_interval=None,
                                     timeout=3) as c:
        reg = c.register(cache, model_name="m", mode="lmcache")
        cache.unlink()  # the server could not map it again
        epoch = c._conn.transport.epoch
        fake.restart()
        deadline = time.monotonic() + 3
        while c._conn.transport.refresh() == epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(InvalidArgument, match="closed or unlinked"):
            reg.store(key(reg, tokens(1)), list(range(PER_CHUNK)))
        assert fake.requests("REGISTER_KV_CACHE")[1:] == []


@pytest.mark.parametrize("mla", [False, True])
def test_register_sends_the_layout_hint_of_the_cache(fake: FakeServer, mla: bool) -> None:
    with kv_cache(mla=mla) as cache, Client(fake.url, protocol="0.5.3",
                                            heartbeat_interval=None, timeout=2) as c:
        reg = c.register(cache, model_name="m", mode="lmcache")
        (register,) = fake.requests("REGISTER_KV_CACHE")
        # CPU servers read 5-D layers as HND; MLA layers have no head axis: no hint.
        assert register.payloads[5] == ({} if mla else {"kv_layout": "HND"})
        assert register.payloads[4] == "vllm"
        reg.unregister()


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


@pytest.mark.parametrize("mode", ["lmcache", "engine"])
def test_registering_again_happens_only_when_needed(fake: FakeServer, kv: CpuKVCache,
                                                    mode: str) -> None:
    fake.slot_geometry = slot(kv, 0)
    register_op = "REGISTER_KV_CACHE" if mode == "lmcache" else \
        "REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT"
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=3) as c:
        reg = c.register(kv, model_name="m", mode=mode)  # type: ignore[arg-type]
        for seed in range(2):  # a fresh registration is bound: no REGISTER before these
            assert reg.store(key(reg, tokens(1, seed)), list(range(PER_CHUNK))) is True
        assert len(fake.requests(register_op)) == 1
        for n in (1, 2):
            epoch = c._conn.transport.epoch
            fake.restart()
            deadline = time.monotonic() + 3
            while c._conn.transport.refresh() == epoch and time.monotonic() < deadline:
                time.sleep(0.01)
            for seed in range(2):  # one REGISTER per restart, not per transfer
                assert reg.store(key(reg, tokens(1, 10 * n + seed)),
                                 list(range(PER_CHUNK))) is True
            assert len(fake.requests(register_op)) == 1 + n
            assert reg.recoveries == n
            # The old connection's pool mapping is given back.
            assert len(c._registry.pools) == (1 if mode == "engine" else 0)
        reg.unregister(unlink=False)
        assert fake.ops()[-1] == ("UNREGISTER_KV_CACHE" if mode == "lmcache"
                                  else "UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT")
        assert len(c._registry.pools) == 0


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
