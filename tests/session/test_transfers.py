"""STORE and RETRIEVE, against the scripted server: engine-driven slot contexts, good and
malformed (every slot checked before the first byte is copied; the releasing COMMIT still
sent), block ranges from a group's tokens_per_block, skip_first_n_tokens, the rank a
transfer names, the calls' defaults. Expected bytes come from a plain reference copy
(tests/support/kv_reference.py), never from the code under test.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest

from lmcache_mp import (
    Client,
    CpuKVCache,
    EngineGroupInfo,
    InvalidArgument,
    ProtocolMismatch,
    Registration,
)

from ..support.fake_server import FakeServer, slot_geometry
from ..support.kv_reference import chunk_shape, reference_gather, reference_scatter
from ..support.session_helpers import BS, CHUNK, PER_CHUNK, key, kv_cache, slot, tokens


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
        ops = fake.wait_seen("COMMIT_RETRIEVE")
        assert ops.count("COMMIT_STORE") == 1 and ops.count("COMMIT_RETRIEVE") == 1
        # A slot of the wrong dtype is refused before a byte is copied.
        fake.slot_geometry = {**slot_geometry(kv), "dtype": "bfloat16"}
        fake.state.stored.clear()
        with reg.request(tokens(2, seed=9)) as req:
            with pytest.raises(ProtocolMismatch, match="slot"):
                req.store(list(range(1, 33)))
        reg.unregister()


def engine_client(fake: FakeServer, cache: CpuKVCache) -> tuple[Client, Registration]:
    c = Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2)
    return c, c.register(cache, model_name="m", mode="engine")


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
            assert fake.wait_seen("COMMIT_RETRIEVE")[-1] == "COMMIT_RETRIEVE"
            reg.unregister()


def test_an_engine_retrieve_is_done_when_its_blocks_are_written(fake: FakeServer,
                                                                kv: CpuKVCache) -> None:
    # Issue 38: the COMMIT_RETRIEVE only releases the read locks (its reply is True on
    # every release), so the retrieve does not wait for that reply: a warm request's
    # load is reported a server round trip sooner. The reply is still read.
    fake.slot_geometry = slot_geometry(kv)
    answer = fake._op_commit_retrieve

    def slow_commit(payloads: list[Any]) -> Any:
        time.sleep(2.0)
        return answer(*payloads)

    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=5) as c:
        reg = c.register(kv, model_name="m", mode="engine")
        with reg.request(tokens(2)) as req:
            assert req.store(list(range(1, 33))) is True
            assert req.lookup() == 2 * CHUNK
            fake.hooks["COMMIT_RETRIEVE"] = slow_commit
            t0 = time.monotonic()
            assert req.retrieve(list(range(40, 72))) is True
            took = time.monotonic() - t0
        assert took < 1.5, f"the retrieve waited {took:.2f} s, for its COMMIT's reply"
        for a, b in zip(range(1, 33), range(40, 72), strict=True):
            assert kv.block_bytes(0, a) == kv.block_bytes(0, b)
        assert "COMMIT_RETRIEVE" in fake.wait_seen("COMMIT_RETRIEVE")
        reg.unregister()
        assert not any(fake.state.locks.values())  # the lookup's locks were released


def test_an_unanswered_commit_retrieve_is_logged_not_raised(
        fake: FakeServer, kv: CpuKVCache, caplog: pytest.LogCaptureFixture) -> None:
    fake.slot_geometry = slot_geometry(kv)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=5) as c:
        reg = c.register(kv, model_name="m", mode="engine")
        with reg.request(tokens(2)) as req:
            assert req.store(list(range(1, 33))) is True
            assert req.lookup() == 2 * CHUNK
            fake.drop.add("COMMIT_RETRIEVE")
            # The blocks are written under the locks: True, whatever the reply.
            assert req.retrieve(list(range(40, 72)), timeout=1.0) is True
        time.sleep(1.1)  # past the COMMIT's deadline (the retrieve's)
        with caplog.at_level(logging.WARNING, logger="lmcache_mp"):
            reg.unregister()
        assert "COMMIT_RETRIEVE sent after a completed retrieve was not confirmed" in caplog.text


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


def corrupt_store(fake: FakeServer, how: str) -> None:
    def hook(payloads: list[Any]) -> Any:
        reply = fake._op_prepare_store(*payloads)  # reserves, as the server would
        ctx = reply["context"]
        if how == "index out of range":
            ctx["chunk_indices"] = [i + 5 for i in ctx["chunk_indices"]]
        elif how == "more slots than indices":
            ctx["chunk_indices"] = ctx["chunk_indices"][:-1]
        elif how == "a repeated index":
            ctx["chunk_indices"] = [ctx["chunk_indices"][0]] * len(ctx["chunk_indices"])
        elif how == "slot outside the pool":
            ctx["slots"][-1] = {**ctx["slots"][-1], "offset": 1 << 40}
        elif how == "undecodable":
            ctx["slots"] = 5
        return reply

    fake.hooks["PREPARE_STORE"] = hook


@pytest.mark.parametrize("how", ["index out of range", "more slots than indices",
                                 "a repeated index", "slot outside the pool", "undecodable"])
def test_a_malformed_prepare_store_still_releases_the_reservation(
        fake: FakeServer, kv: CpuKVCache, how: str) -> None:
    fake.slot_geometry = slot_geometry(kv)
    assert fake.pool is not None
    kv.layers[0][...] = 1
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="engine")
        corrupt_store(fake, how)
        with reg.request(tokens(2)) as req:
            with pytest.raises(ProtocolMismatch, match="COMMIT_STORE"):
                req.store(list(range(1, 33)))
        ops = fake.ops()
        assert ops[ops.index("PREPARE_STORE") + 1] == "COMMIT_STORE"
        assert not any(bytes(fake.pool.buffer[: 4 << 10]))  # nothing was copied
        del fake.hooks["PREPARE_STORE"]
        with reg.request(tokens(2, seed=1)) as req:
            assert req.store(list(range(1, 33))) is True  # the client keeps working
        reg.unregister()


@pytest.mark.parametrize("how", ["one slot short", "wrong dtype", "undecodable"])
def test_a_malformed_prepare_retrieve_still_releases_the_read_locks(
        fake: FakeServer, kv: CpuKVCache, how: str) -> None:
    fake.slot_geometry = slot_geometry(kv)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="engine")
        with reg.request(tokens(2)) as req:
            assert req.store(list(range(1, 33))) is True

        def hook(payloads: list[Any]) -> Any:
            reply = fake._op_prepare_retrieve(*payloads)
            if how == "one slot short":
                reply["context"]["slots"].pop()
            elif how == "wrong dtype":
                reply["context"]["slots"][0]["dtype"] = "bfloat16"
            else:
                reply["success"] = "yes"
            return reply

        fake.hooks["PREPARE_RETRIEVE"] = hook
        kv.layers[0][:, 40:72] = 7
        with reg.request(tokens(2)) as req:
            assert req.lookup() == 2 * CHUNK
            with pytest.raises(ProtocolMismatch, match="COMMIT_RETRIEVE"):
                req.retrieve(list(range(40, 72)))
        ops = fake.ops()
        assert ops[ops.index("PREPARE_RETRIEVE") + 1] == "COMMIT_RETRIEVE"
        assert (kv.layers[0][:, 40:72] == 7).all()  # no block was written
        assert not any(fake.state.locks.values())  # the lookup's locks were released
        reg.unregister()
