"""The public API (Client, Registration, Request) end to end against the scripted server
(tests/support/fake_server.py), for what lies between the API and the encoder: reply types,
per-call deadlines, engine-driven slot contexts good and malformed, a group's
tokens_per_block, salts, reader counts per family, recovery step by step.

Each test says which wire fact it checks; expected values come from LMCache's
behaviour (the fake's rules cite LMCache's source) or from a plain reference copy
(tests/support/kv_reference.py), never from the code under test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from lmcache_mp import (
    CacheKey,
    Client,
    CpuKVCache,
    InvalidArgument,
    ProtocolMismatch,
    Registration,
    RequestTimeout,
    ServerUnresponsive,
)
from lmcache_mp.protocol.types import EngineGroupInfo

from ..support.fake_server import FakeServer
from ..support.kv_reference import chunk_shape, reference_gather, reference_scatter

CHUNK = 256
BS = 16
PER_CHUNK = CHUNK // BS
FAMILIES = ["0.5.3", "0.5.5", "0.5.6", "0.5.7"]


def kv_cache(*, mla: bool = False, dtype: str = "float16", num_blocks: int = 80,
             num_layers: int = 2) -> CpuKVCache:
    cache = CpuKVCache.allocate(num_layers=num_layers, num_blocks=num_blocks, block_size=BS,
                                num_heads=1 if mla else 2, head_dim=8, dtype=dtype, mla=mla)
    rng = np.random.default_rng(11)
    for layer in cache.layers:
        raw = layer.view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    return cache


@pytest.fixture
def kv() -> Iterator[CpuKVCache]:
    with kv_cache() as cache:
        yield cache


def tokens(n_chunks: int = 2, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**31, n_chunks * CHUNK).tolist()


def key(reg: Registration, toks: list[int], start: int = 0, end: int | None = None,
        worker_id: int | None = None, salt: str = "") -> CacheKey:
    return CacheKey(model_name=reg.model_name, world_size=reg.world_size, worker_id=worker_id,
                    token_ids=toks, start=start, end=len(toks) if end is None else end,
                    request_id="rq", cache_salt=salt)


def elapsed(call: Callable[[], Any]) -> float:
    start = time.monotonic()
    call()
    return time.monotonic() - start


# ------------------------------------------------------------------ reply types
@pytest.mark.parametrize("op, call", [
    ("NOOP", lambda c, reg: c.noop()),
    ("PING", lambda c, reg: c.ping()),
    ("GET_EXPERIMENTAL", lambda c, reg: c.get_experimental()),
    ("END_SESSION", lambda c, reg: c.end_session("r")),
    ("LOOKUP", lambda c, reg: c.lookup(key(reg, tokens(1)))),
    ("STORE", lambda c, reg: reg.store(key(reg, tokens(1)), list(range(PER_CHUNK)))),
])
def test_a_reply_echoing_another_request_type_is_refused(
        fake: FakeServer, kv: CpuKVCache, op: str,
        call: Callable[[Client, Registration], Any]) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        # The reply carries this request's uid but another op's type (what a server of
        # another protocol family would send back): never taken as this op's answer.
        fake.reply_type[op] = 6 if op != "STORE" else 7
        with pytest.raises(ProtocolMismatch, match="echoed request type"):
            call(c, reg)
        fake.reply_type.clear()
        assert c.noop() == "OK"  # the connection itself is fine
        reg.unregister()


# ------------------------------------------------------------- per-call deadlines
@pytest.mark.parametrize("op, call", [
    ("STORE", lambda c, reg, t: reg.store(key(reg, tokens(1)), list(range(PER_CHUNK)),
                                          timeout=t)),
    ("RETRIEVE", lambda c, reg, t: reg.retrieve(key(reg, tokens(1)), list(range(PER_CHUNK)),
                                                timeout=t)),
    ("LOOKUP", lambda c, reg, t: reg.lookup(key(reg, tokens(1)), timeout=t)),
    ("WAIT_PREFETCH_STATUS", lambda c, reg, t: c.lookup(key(reg, tokens(1)), timeout=t)),
    ("FREE_LOOKUP_LOCKS", lambda c, reg, t: c.free_lookup_locks(key(reg, tokens(1)), timeout=t)),
    ("PING", lambda c, reg, t: c.ping(timeout=t)),
    ("CLEAR", lambda c, reg, t: c.clear(timeout=t)),
    ("UNREGISTER_KV_CACHE", lambda c, reg, t: reg.unregister(timeout=t, unlink=False)),
])
def test_a_short_per_call_timeout_wins_over_the_client_default(
        fake: FakeServer, kv: CpuKVCache, op: str,
        call: Callable[[Client, Registration, float], Any]) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=30) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        fake.drop.add(op)
        start = time.monotonic()
        with pytest.raises(RequestTimeout):
            call(c, reg, 0.3)
        assert 0.25 <= time.monotonic() - start < 2.0
        fake.drop.clear()


def test_a_long_per_call_timeout_wins_over_a_short_default(fake: FakeServer,
                                                           kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=0.2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache", timeout=5)

        def slow(handler: Callable[..., Any]) -> Callable[[list[Any]], Any]:
            def hook(payloads: list[Any]) -> Any:
                time.sleep(0.5)
                return handler(*payloads)
            return hook

        fake.hooks["STORE"] = slow(fake._op_store)
        fake.hooks["NOOP"] = slow(fake._op_noop)
        assert reg.store(key(reg, tokens(1)), list(range(PER_CHUNK)), timeout=3) is True
        assert c.noop(timeout=3) == "OK"
        reg.unregister(timeout=3)
        # The 0.2 s default: its NOOP probe is as slow, so the server is unresponsive.
        with pytest.raises((RequestTimeout, ServerUnresponsive)):
            c.noop()


def test_register_honours_its_timeout(fake: FakeServer, kv: CpuKVCache) -> None:
    fake.drop.add("REGISTER_KV_CACHE")
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=30) as c:
        c.chunk_size()
        with pytest.raises(RequestTimeout):
            assert elapsed(lambda: c.register(kv, model_name="m", mode="lmcache",
                                              timeout=0.3)) < 2.0
        assert c.registrations == []


# -------------------------------------------------------- engine-driven contexts
def engine_client(fake: FakeServer, cache: CpuKVCache) -> tuple[Client, Registration]:
    c = Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2)
    return c, c.register(cache, model_name="m", mode="engine")


def slot(cache: CpuKVCache, offset: int, **change: Any) -> dict[str, Any]:
    g = cache.geometry
    shape = list(chunk_shape(g, CHUNK))
    length = int(np.prod(shape)) * cache.layers[0].dtype.itemsize
    return {"offset": offset, "length": length, "shape": shape, "dtype": g.dtype, **change}


def reference_chunks(cache: CpuKVCache, ids: list[int]) -> list[np.ndarray]:
    return [reference_gather(cache.layers, ids[i:i + PER_CHUNK], cache.geometry,
                             cache.layers[0].dtype) for i in range(0, len(ids), PER_CHUNK)]


@pytest.mark.parametrize("mla", [False, True])
def test_engine_store_fills_exactly_the_slots_the_server_names(fake: FakeServer,
                                                               mla: bool) -> None:
    with kv_cache(mla=mla) as cache:
        c, reg = engine_client(fake, cache)
        with c:
            ids = [int(b) for b in np.random.default_rng(3).permutation(80)[:3 * PER_CHUNK]]
            n = slot(cache, 0)["length"]
            # Chunk 0 is cached already; chunks 2 and 1 get slots out of order, apart.
            offsets = [5 * n + 64, n]
            fake.hooks["PREPARE_STORE"] = lambda p: {"context": {
                "slots": [slot(cache, o) for o in offsets], "chunk_indices": [2, 1]}}
            pool = fake.pool_bytes()
            pool[:] = 0xEE
            assert reg.store(key(reg, tokens(3)), ids) is True
            want = reference_chunks(cache, ids)
            for off, ci in zip(offsets, [2, 1], strict=True):
                assert pool[off:off + n].tobytes() == want[ci].tobytes()
            # Nothing else of the pool was written.
            written = np.zeros(len(pool), dtype=bool)
            for off in offsets:
                written[off:off + n] = True
            assert (pool[~written] == 0xEE).all()
            assert fake.ops()[-2:] == ["PREPARE_STORE", "COMMIT_STORE"]
            reg.unregister()


def test_an_mla_slot_with_a_leading_kv_size_of_1_is_the_same_object(fake: FakeServer) -> None:
    # Objects stored through REGISTER_KV_CACHE carry [1, layers, tokens, dim] on MLA.
    with kv_cache(mla=True) as cache:
        c, reg = engine_client(fake, cache)
        with c:
            s = slot(cache, 0)
            fake.hooks["PREPARE_STORE"] = lambda p: {"context": {
                "slots": [{**s, "shape": [1, *s["shape"]]}], "chunk_indices": [0]}}
            ids = list(range(10, 10 + PER_CHUNK))
            assert reg.store(key(reg, tokens(1)), ids) is True
            assert fake.pool_bytes()[:s["length"]].tobytes() == \
                reference_chunks(cache, ids)[0].tobytes()
            reg.unregister()


@pytest.mark.parametrize("skip", [0, 16, 40, 255, 256, 300])
def test_engine_retrieve_copies_each_slot_into_its_blocks(fake: FakeServer, skip: int) -> None:
    with kv_cache() as cache:
        c, reg = engine_client(fake, cache)
        with c:
            n = slot(cache, 0)["length"]
            rng = np.random.default_rng(skip)
            objects = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(2)]
            pool = fake.pool_bytes()
            offsets = [3 * n, 0]
            for off, obj in zip(offsets, objects, strict=True):
                pool[off:off + n] = obj
            fake.hooks["PREPARE_RETRIEVE"] = lambda p: {
                "success": True, "data": b"", "context": {"slots": [slot(cache, o) for o in offsets]}}
            ids = list(range(40, 40 + 2 * PER_CHUNK))
            expected = [layer.copy() for layer in cache.layers]
            dtype = cache.layers[0].dtype
            for ci, obj in enumerate(objects):
                # skip_first_n_tokens leaves whole leading blocks (rounded down) alone.
                reference_scatter(obj.view(dtype).reshape(chunk_shape(cache.geometry, CHUNK)),
                                  expected, ids[ci * PER_CHUNK:(ci + 1) * PER_CHUNK],
                                  cache.geometry, skip_blocks=max(0, skip // BS - ci * PER_CHUNK))
            assert reg.retrieve(key(reg, tokens(2)), ids, skip_first_n_tokens=skip) is True
            for layer, want in zip(cache.layers, expected, strict=True):
                assert np.array_equal(layer.view(np.uint8), want.view(np.uint8))
            assert fake.ops()[-1] == "COMMIT_RETRIEVE"
            reg.unregister()


def bad_store_contexts(cache: CpuKVCache, pool_size: int) -> dict[str, dict[str, Any]]:
    good = slot(cache, 0)
    n = good["length"]
    shape = good["shape"]
    return {
        "wrong dtype": {"slots": [slot(cache, 0, dtype="bfloat16")], "chunk_indices": [0]},
        "wrong shape": {"slots": [slot(cache, 0, shape=[*shape[:-1], shape[-1] + 1])],
                        "chunk_indices": [0]},
        "leading 1 on a non-MLA object": {"slots": [slot(cache, 0, shape=[1, *shape])],
                                          "chunk_indices": [0]},
        "short length": {"slots": [slot(cache, 0, length=n - 2)], "chunk_indices": [0]},
        "negative offset": {"slots": [slot(cache, -n)], "chunk_indices": [0]},
        "past the pool": {"slots": [slot(cache, pool_size - n + 1)], "chunk_indices": [0]},
        "chunk index past the key": {"slots": [slot(cache, 0)], "chunk_indices": [2]},
        "negative chunk index": {"slots": [slot(cache, 0)], "chunk_indices": [-1]},
        "more slots than indices": {"slots": [slot(cache, 0), slot(cache, n)],
                                    "chunk_indices": [0]},
        "a bad second slot": {"slots": [slot(cache, 0), slot(cache, n, dtype="float32")],
                              "chunk_indices": [0, 1]},
    }


BAD_STORE = ["wrong dtype", "wrong shape", "leading 1 on a non-MLA object", "short length",
             "negative offset", "past the pool", "chunk index past the key",
             "negative chunk index", "more slots than indices", "a bad second slot"]


@pytest.mark.parametrize("case", BAD_STORE)
def test_a_malformed_store_context_is_refused_before_a_byte_is_copied(
        fake: FakeServer, kv: CpuKVCache, case: str) -> None:
    c, reg = engine_client(fake, kv)
    with c:
        assert fake.pool is not None
        ctx = bad_store_contexts(kv, fake.pool.nbytes)[case]
        fake.hooks["PREPARE_STORE"] = lambda p: {"context": ctx}
        pool = fake.pool_bytes()
        pool[:] = 0xEE
        with pytest.raises(ProtocolMismatch):
            reg.store(key(reg, tokens(2)), list(range(2 * PER_CHUNK)))
        assert (pool == 0xEE).all(), "the pool was written before the context was checked"
        # The COMMIT still goes out: it releases the server's reservation (issue 12).
        assert fake.ops()[-2:] == ["PREPARE_STORE", "COMMIT_STORE"]
        reg.unregister()


@pytest.mark.parametrize("case", ["wrong dtype", "wrong shape", "short length",
                                  "past the pool", "one slot for two chunks"])
def test_a_malformed_retrieve_context_is_refused_and_still_releases_the_locks(
        fake: FakeServer, kv: CpuKVCache, case: str) -> None:
    c, reg = engine_client(fake, kv)
    with c:
        assert fake.pool is not None
        n = slot(kv, 0)["length"]
        slots = {"wrong dtype": [slot(kv, 0), slot(kv, n, dtype="bfloat16")],
                 "wrong shape": [slot(kv, 0), slot(kv, n, shape=[2, 2, CHUNK, 15])],
                 "short length": [slot(kv, 0), slot(kv, n, length=n - 1)],
                 "past the pool": [slot(kv, 0), slot(kv, fake.pool.nbytes - n + 1)],
                 "one slot for two chunks": [slot(kv, 0)]}[case]
        fake.hooks["PREPARE_RETRIEVE"] = lambda p: {"success": True, "data": b"",
                                                    "context": {"slots": slots}}
        ids = list(range(2 * PER_CHUNK))
        before = [layer.copy() for layer in kv.layers]
        with pytest.raises(ProtocolMismatch):
            reg.retrieve(key(reg, tokens(2)), ids)
        # Every slot is checked before the first copy: no block was written.
        for layer, old in zip(kv.layers, before, strict=True):
            assert layer.tobytes() == old.tobytes()
        # COMMIT_RETRIEVE releases the LOOKUP's read locks even when the copy failed.
        assert fake.ops()[-1] == "COMMIT_RETRIEVE"
        reg.unregister()


def test_a_wrong_dtype_slot_is_refused_on_store_and_retrieve(fake: FakeServer,
                                                            kv: CpuKVCache) -> None:
    c, reg = engine_client(fake, kv)
    with c:
        fake.slot_geometry = {**slot(kv, 0), "dtype": "float32"}
        pool = fake.pool_bytes()
        pool[:] = 0xEE
        with pytest.raises(ProtocolMismatch, match="float32"):
            reg.store(key(reg, tokens(1)), list(range(PER_CHUNK)))
        assert (pool == 0xEE).all()
        fake.state.stored.update(fake._hashes({"token_ids": tokens(1), "start": 0,
                                               "end": CHUNK, "cache_salt": ""}))
        before = kv.layers[0].tobytes()
        with pytest.raises(ProtocolMismatch, match="float32"):
            reg.retrieve(key(reg, tokens(1)), list(range(PER_CHUNK)))
        assert kv.layers[0].tobytes() == before
        reg.unregister()


# ------------------------------------------------------------ tokens_per_block
def test_a_groups_tokens_per_block_sets_how_many_block_ids_a_range_takes(
        fake: FakeServer, kv: CpuKVCache) -> None:
    groups = [EngineGroupInfo(engine_group_id=0, layer_indices=(0,), tokens_per_block=32),
              EngineGroupInfo(engine_group_id=1, layer_indices=(1,), tokens_per_block=64)]
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache", engine_group_infos=groups)
        (register,) = fake.requests("REGISTER_KV_CACHE")
        assert [g["tokens_per_block"] for g in register.payloads[6]] == [32, 64]
        k = key(reg, tokens(2), worker_id=0)
        # 512 tokens: 16 blocks of 32 tokens for group 0, 8 blocks of 64 for group 1.
        ids = [list(range(16)), list(range(30, 38))]
        assert reg.store(k, ids) is True
        (store,) = fake.requests("STORE")
        assert store.payloads[2] == ids
        for bad in ([list(range(32)), list(range(8))], [list(range(16)), list(range(16))],
                    list(range(32))):
            with pytest.raises(InvalidArgument, match="block"):
                reg.store(k, bad)
        with reg.request(tokens(2)) as req:
            assert req.store(ids, end=2 * CHUNK)
            with pytest.raises(InvalidArgument, match="group 0 needs exactly 8"):
                req.store([list(range(16)), list(range(4))], start=CHUNK, end=2 * CHUNK)
        reg.unregister()


def test_a_tokens_per_block_that_does_not_divide_the_chunk_is_refused(
        fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        with pytest.raises(InvalidArgument, match="48 tokens per block"):
            c.register(kv, model_name="m", mode="lmcache", engine_group_infos=[
                EngineGroupInfo(engine_group_id=0, layer_indices=(0, 1), tokens_per_block=48)])
        assert fake.requests("REGISTER_KV_CACHE") == []


# ------------------------------------------------------- readers, keys, salts
def lookup_keys(fake: FakeServer, op: str = "LOOKUP") -> list[dict[str, Any]]:
    return [s.payloads[0] for s in fake.requests(op)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world_size, tp_size, readers", [
    (1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 4, 4), (2, 4, 4), (2, 8, 8), (4, 2, 1)])
def test_reader_count_per_family_and_locks_balance_on_close(
        family: str, world_size: int, tp_size: int, readers: int) -> None:
    """Readers per object (LMCache 0.5.3's rule: TP ranks beyond the KV world size read
    the same MLA object) travel as LOOKUP's tp_size payload (0.5.3) or the key's
    num_kv_readers (0.5.5+, where a key without it is dropped); FREE_LOOKUP_LOCKS sends
    the same, so the server's locks balance."""
    fake = FakeServer(profile=family)
    try:
        with kv_cache() as cache, Client(fake.url, protocol=family, heartbeat_interval=None,
                                         timeout=2) as c:
            reg = c.register(cache, model_name="m", mode="lmcache", world_size=world_size,
                             worker_id=world_size - 1)
            toks = tokens(3)
            with reg.request(toks) as writer:
                assert writer.store(list(range(3 * PER_CHUNK))) is True
            with reg.request(toks, tp_size=tp_size) as reader:
                assert reader.lookup() == 3 * CHUNK
                assert set(fake.state.locks.values()) == {readers}  # the server's count
                assert reader.retrieve(list(range(PER_CHUNK)), end=CHUNK) is True
            (lookup,) = lookup_keys(fake)
            (free,) = fake.requests("FREE_LOOKUP_LOCKS")
            assert (free.payloads[0]["start"], free.payloads[0]["end"]) == (CHUNK, 3 * CHUNK)
            if family == "0.5.3":
                assert "num_kv_readers" not in lookup
                assert fake.requests("LOOKUP")[0].payloads[1] == tp_size == free.payloads[1]
            else:
                assert lookup["num_kv_readers"] == readers == free.payloads[0]["num_kv_readers"]
            assert lookup["worker_id"] is None and lookup["world_size"] == world_size
            # Retrieving chunk 0 released one reader's lock; FREE released the rest.
            hashes = fake._hashes({**lookup, "start": 0, "end": 3 * CHUNK})
            assert [fake.state.locks[h] for h in hashes] == [readers - 1, 0, 0]
            reg.unregister()
    finally:
        fake.close()


@pytest.mark.parametrize("family", ["0.5.5", "0.5.6", "0.5.7"])
def test_0_5_5_keys_always_carry_num_kv_readers(family: str) -> None:
    fake = FakeServer(profile=family)
    try:
        with kv_cache() as cache, Client(fake.url, protocol=family, heartbeat_interval=None,
                                         timeout=2) as c:
            reg = c.register(cache, model_name="m", mode="lmcache")
            toks = tokens(1)
            assert c.lookup(key(reg, toks)) == 0
            c.free_lookup_locks(key(reg, toks))
            reg.store(key(reg, toks, worker_id=0), list(range(PER_CHUNK)))
            for op in ("LOOKUP", "FREE_LOOKUP_LOCKS", "STORE"):
                (k,) = lookup_keys(fake, op)
                assert k["num_kv_readers"] == 1, op
                assert k["request_configs"] is None
            reg.unregister()
    finally:
        fake.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["lmcache", "engine"])
def test_cache_salt_travels_in_every_key_and_isolates(family: str, mode: str) -> None:
    fake = FakeServer(profile=family)
    try:
        with kv_cache() as cache, Client(fake.url, protocol=family, heartbeat_interval=None,
                                         timeout=2) as c:
            fake.slot_geometry = slot(cache, 0)
            reg = c.register(cache, model_name="m", mode=mode)  # type: ignore[arg-type]
            toks = tokens(2)
            with reg.request(toks, cache_salt="tenant-a") as w:
                assert w.store(list(range(2 * PER_CHUNK))) is True
            with reg.request(toks, cache_salt="tenant-b") as other:
                assert other.lookup() == 0
            assert c.lookup(key(reg, toks, salt="tenant-b")) == 0
            assert c.lookup(key(reg, toks)) == 0  # no salt is a salt too
            with reg.request(toks, cache_salt="tenant-a") as same:
                assert same.lookup() == 2 * CHUNK
                assert same.retrieve(list(range(40, 40 + 2 * PER_CHUNK))) is True
            def salts(op: str) -> set[str]:
                return {s.payloads[0]["cache_salt"] for s in fake.requests(op)}

            transfer = ({"STORE", "RETRIEVE"} if mode == "lmcache" else
                        {"PREPARE_STORE", "COMMIT_STORE", "PREPARE_RETRIEVE", "COMMIT_RETRIEVE"})
            for op in transfer:
                assert salts(op) == {"tenant-a"}, op
            assert salts("LOOKUP") == {"tenant-a", "tenant-b", ""}
            assert salts("FREE_LOOKUP_LOCKS") <= {"tenant-a"}
            reg.unregister()
    finally:
        fake.close()


# ------------------------------------------------------------ recovery, stepwise
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


# ------------------------------------------------ registration bookkeeping
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


@pytest.mark.parametrize("mode", ["lmcache", "engine"])
def test_a_transfer_names_the_keys_rank_else_the_registrations(fake: FakeServer,
                                                               kv: CpuKVCache,
                                                               mode: str) -> None:
    fake.slot_geometry = slot(kv, 0)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode=mode, world_size=2,  # type: ignore[arg-type]
                         worker_id=1)
        op = "STORE" if mode == "lmcache" else "PREPARE_STORE"
        reg.store(key(reg, tokens(1, 1)), list(range(PER_CHUNK)))
        reg.store(key(reg, tokens(1, 2), worker_id=0), list(range(PER_CHUNK)))
        assert [s.payloads[0]["worker_id"] for s in fake.requests(op)] == [1, 0]
        reg.unregister()


def test_registration_lookup_counts_tokens_and_checks_the_key(fake: FakeServer,
                                                              kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        toks = tokens(3)
        reg.store(key(reg, toks), list(range(3 * PER_CHUNK)))
        assert reg.lookup(key(reg, toks)) == 3 * CHUNK
        assert c.lookup(key(reg, toks)) == 3  # the control plane counts chunks
        other = CacheKey(model_name="other", world_size=1, worker_id=None, token_ids=toks,
                         start=0, end=CHUNK, request_id="r")
        with pytest.raises(InvalidArgument, match="model 'm'"):
            reg.lookup(other)
        with pytest.raises(InvalidArgument):
            reg.lookup("not a key")  # type: ignore[arg-type]
        reg.unregister()


@pytest.mark.parametrize("skip, ok", [(0, True), (2 * CHUNK, True), (2 * CHUNK + 1, False),
                                      (-1, False), (True, False), (16.0, False)])
def test_skip_first_n_tokens_bounds(fake: FakeServer, kv: CpuKVCache, skip: Any,
                                    ok: bool) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        k = key(reg, tokens(2))
        if ok:
            reg.retrieve(k, list(range(2 * PER_CHUNK)), skip_first_n_tokens=skip)
            assert fake.requests("RETRIEVE")[-1].payloads[4] == skip
        else:
            with pytest.raises(InvalidArgument, match="skip_first_n_tokens"):
                reg.retrieve(k, list(range(2 * PER_CHUNK)), skip_first_n_tokens=skip)
            assert fake.requests("RETRIEVE") == []
        reg.unregister()


def test_engine_store_with_everything_cached_and_a_retrieve_miss(fake: FakeServer,
                                                                 kv: CpuKVCache) -> None:
    c, reg = engine_client(fake, kv)
    with c:
        fake.slot_geometry = slot(kv, 0)
        assert reg.store(key(reg, tokens(1)), list(range(PER_CHUNK))) is True
        (commit,) = fake.requests("COMMIT_STORE")
        assert commit.payloads[2] == b""  # SHM mode: the data travels in the pool
        # Already cached: no slot, nothing to copy or commit, and stored all the same.
        fake.hooks["PREPARE_STORE"] = lambda p: {"context": {"slots": [], "chunk_indices": []}}
        assert reg.store(key(reg, tokens(1)), list(range(PER_CHUNK))) is True
        assert len(fake.requests("COMMIT_STORE")) == 1
        # A miss is False, and nothing is committed.
        assert reg.retrieve(key(reg, tokens(1, seed=4)), list(range(PER_CHUNK))) is False
        assert fake.requests("COMMIT_RETRIEVE") == []
        reg.unregister()


# ------------------------------------------------------- request bookkeeping
def test_request_lock_counts_through_repeated_lookups_and_sub_range_retrieves(
        fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        toks = tokens(3)
        with reg.request(toks) as w:
            w.store(list(range(3 * PER_CHUNK)))
        req = reg.request(toks)
        assert req.held_locks == 0
        assert req.lookup() == 3 * CHUNK and req.lookup() == 3 * CHUNK
        assert req.held_locks == 6
        # Retrieving chunk 1 only gives back chunk 1's lock (one of its two).
        assert req.retrieve(list(range(PER_CHUNK)), start=CHUNK, end=2 * CHUNK) is True
        assert req.held_locks == 5
        req.close()
        assert req.held_locks == 0
        frees = [(f.payloads[0]["start"], f.payloads[0]["end"])
                 for f in fake.requests("FREE_LOOKUP_LOCKS")]
        assert sorted(frees) == sorted([(0, 3 * CHUNK), (0, CHUNK), (2 * CHUNK, 3 * CHUNK)])
        assert all(v == 0 for v in fake.state.locks.values())
        reg.unregister()


def test_an_unused_request_closes_without_a_word(fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        mark = len(fake.seen)
        with reg.request(tokens(1)) as req:
            assert req.held_locks == 0
        assert fake.ops()[mark:] == []
        reg.unregister()


def test_held_runs_frees_each_lock_once() -> None:
    from lmcache_mp.session.request import _held_runs

    assert _held_runs([2, 2, 1, 0, 1]) == [(0, 3), (4, 5), (0, 2)]
    assert _held_runs([0, 1, 1, 0, 0, 3]) == [(1, 3), (5, 6), (5, 6), (5, 6)]
    assert _held_runs([0, 0]) == []


@pytest.mark.parametrize("op, call", [
    ("STORE", lambda req, t: req.store(list(range(PER_CHUNK)), timeout=t)),
    ("WAIT_PREFETCH_STATUS", lambda req, t: req.lookup(timeout=t)),
    ("RETRIEVE", lambda req, t: req.retrieve(list(range(PER_CHUNK)), end=CHUNK, timeout=t)),
])
def test_request_calls_honour_their_timeout(fake: FakeServer, kv: CpuKVCache, op: str,
                                            call: Callable[[Any, float], Any]) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=30) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        req = reg.request(tokens(1))
        fake.drop.add(op)
        start = time.monotonic()
        with pytest.raises(RequestTimeout):
            call(req, 0.3)
        assert time.monotonic() - start < 2.0
        fake.drop.clear()
        req.close(timeout=2)


def test_request_close_honours_its_timeout(fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=30) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        with reg.request(tokens(1)) as w:
            w.store(list(range(PER_CHUNK)))
        req = reg.request(tokens(1))
        assert req.lookup() == CHUNK
        fake.drop.update({"FREE_LOOKUP_LOCKS", "END_SESSION"})
        # Errors are logged, not raised: the server's TTL frees what was not freed.
        assert elapsed(lambda: req.close(timeout=0.3)) < 2.0
        assert req.held_locks == 0
        fake.drop.clear()


@pytest.mark.parametrize("family, force, payload", [
    ("0.5.3", False, []), ("0.5.3", True, []), ("0.5.6", False, [False]), ("0.5.6", True, [True])])
def test_clear_sends_force_only_where_the_server_takes_it(family: str, force: bool,
                                                          payload: list[Any]) -> None:
    fake = FakeServer(profile=family, engine_driven=False)
    try:
        with Client(fake.url, protocol=family, timeout=2) as c:
            c.clear(force=force)
            assert fake.requests("CLEAR")[0].payloads == payload
    finally:
        fake.close()


# ------------------------------------------------ more paths mutation found open
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


def test_recovery_stays_within_the_transfers_deadline(fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=30) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        epoch = c._conn.transport.epoch
        fake.restart()
        fake.drop.add("GET_CHUNK_SIZE")  # the restarted server is slow to answer
        deadline = time.monotonic() + 3
        while c._conn.transport.refresh() == epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(RequestTimeout):
            reg.store(key(reg, tokens(1)), list(range(PER_CHUNK)), timeout=0.3)
        assert time.monotonic() - start < 2.0


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


def test_defaults_of_the_data_plane_calls(fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        toks = tokens(2)
        reg.retrieve(key(reg, toks), list(range(2 * PER_CHUNK)))
        assert fake.requests("RETRIEVE")[-1].payloads[4] == 0  # skip nothing
        reg.lookup(key(reg, toks))
        assert fake.requests("LOOKUP")[-1].payloads[1] == 1  # one reader
        with reg.request(toks) as req:
            req.store(list(range(PER_CHUNK)), end=CHUNK)
            assert (fake.requests("STORE")[-1].payloads[0]["start"],
                    fake.requests("STORE")[-1].payloads[0]["end"]) == (0, CHUNK)
            req.store(list(range(PER_CHUNK)), start=CHUNK)
            assert (fake.requests("STORE")[-1].payloads[0]["start"],
                    fake.requests("STORE")[-1].payloads[0]["end"]) == (CHUNK, 2 * CHUNK)
            assert req.lookup() == 2 * CHUNK
            (lookup,) = fake.requests("LOOKUP")[-1:]
            assert lookup.payloads[0]["start"] == 0  # a lookup covers the prompt from 0
            req.retrieve(list(range(PER_CHUNK)), end=CHUNK)
            assert fake.requests("RETRIEVE")[-1].payloads[4] == 0
            req.retrieve(list(range(PER_CHUNK)), start=CHUNK, skip_first_n_tokens=32)
            assert fake.requests("RETRIEVE")[-1].payloads[4] == 32
        reg.unregister()
        assert kv.unlinked  # unregister unlinks by default


def test_request_close_bounds_its_end_session_too(fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=30) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        req = reg.request(tokens(1))
        req.store(list(range(PER_CHUNK)))
        fake.drop.add("END_SESSION")
        assert elapsed(lambda: req.close(timeout=0.3)) < 2.0
        fake.drop.clear()
