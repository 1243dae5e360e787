"""A Request's life against the scripted server (lookup locks taken, freed once, its
session ended on close) and what every key carries (the salt, the readers per protocol
family, the request's defaults); lookups that count tokens; CLEAR per family. Expected
values come from LMCache's behaviour (the fake's rules cite LMCache's source).
"""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_mp import (
    CacheKey,
    Client,
    CpuKVCache,
    InvalidArgument,
)

from ..support.fake_server import FakeServer
from ..support.session_helpers import CHUNK, FAMILIES, PER_CHUNK, key, kv_cache, slot, tokens


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


def test_held_runs_frees_each_lock_once() -> None:
    from lmcache_mp.session.request import _held_runs

    assert _held_runs([2, 2, 1, 0, 1]) == [(0, 3), (4, 5), (0, 2)]
    assert _held_runs([0, 1, 1, 0, 0, 3]) == [(1, 3), (5, 6), (5, 6), (5, 6)]
    assert _held_runs([0, 0]) == []


def test_an_unused_request_closes_without_a_word(fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        mark = len(fake.seen)
        with reg.request(tokens(1)) as req:
            assert req.held_locks == 0
        assert fake.ops()[mark:] == []
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
