"""CacheKey validation and the token hasher mirror (fixtures from LMCache's own hasher)."""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_mp import CacheKey, InvalidArgument
from lmcache_mp.protocol import get_profile
from lmcache_mp.protocol.hashing import NONE_HASH, chunk_hashes, kv_rank, object_keys

from ..support.fixture_values import load

HASHES = load("0.5.3", "hashes")


def make(**kw: object) -> CacheKey:
    args: dict[str, object] = dict(
        model_name="m", world_size=1, worker_id=0, token_ids=list(range(512)), start=0,
        end=512, request_id="r",
    )
    args.update(kw)
    return CacheKey(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", HASHES, ids=lambda c: f"{c['name']}-{c['chunk_size']}")
def test_chunk_hashes_match_lmcache_token_hasher(case: dict) -> None:  # type: ignore[type-arg]
    assert NONE_HASH.hex() == case["none_hash"]
    tokens = case["token_ids"]
    assert [h.hex() for h in chunk_hashes(tokens, case["chunk_size"])] == case["hashes"]
    as_array = np.array(tokens, dtype=np.uint32)
    assert [h.hex() for h in chunk_hashes(as_array, case["chunk_size"])] == case["hashes"]
    got = [h.hex() for h in chunk_hashes(tokens, case["chunk_size"], start=256)]
    assert got == case["hashes_from_256"]


@pytest.mark.parametrize("case", [c for c in HASHES if c["hashes"]], ids=lambda c: c["name"])
def test_kv_ranks_match_lmcache_object_keys(case: dict) -> None:  # type: ignore[type-arg]
    for spec, ranks in case["kv_ranks"].items():
        ws, wid = spec.split("/")
        world = int(ws)
        worker = None if wid == "None" else int(wid)
        expected_ranks = range(world) if worker is None else [worker]
        assert [kv_rank(world, r) for r in expected_ranks] == ranks


def test_object_keys_expand_all_ranks_for_lookup_keys() -> None:
    keys = object_keys(list(range(600)), model_name="m", world_size=2, cache_salt="s")
    assert [(k.chunk_index, k.rank) for k in keys] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert keys[0].chunk_hash == keys[1].chunk_hash != keys[2].chunk_hash


def test_key_accepts_list_tuple_and_numpy_tokens_identically() -> None:
    toks = [5, 0, 2**32 - 1, 7]
    a = make(token_ids=toks, end=4)
    b = make(token_ids=tuple(toks), end=4)
    c = make(token_ids=np.array(toks, dtype=np.uint64), end=4)
    assert a == b == c
    assert a.token_ids == tuple(toks)
    assert all(type(t) is int for t in c.token_ids)


def test_request_id_is_not_part_of_identity() -> None:
    assert make(request_id="a") == make(request_id="b")
    assert hash(make(request_id="a")) == hash(make(request_id="b"))
    assert make(cache_salt="x") != make()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(token_ids=[2**32]), "uint32"),
        (dict(token_ids=[-1]), "uint32"),
        (dict(token_ids=[True, 2], end=2), "uint32"),
        (dict(token_ids=[1.0], end=1), "uint32"),
        (dict(token_ids=np.array([1.5]), end=1), "integers"),
        (dict(token_ids=np.array([-3]), end=1), "uint32"),
        (dict(token_ids=np.zeros((2, 2), dtype=np.int64), end=0), "one-dimensional"),
        (dict(token_ids="abc"), "list, tuple"),
        (dict(cache_salt="a@b"), "must not contain"),
        (dict(cache_salt="a/b"), "must not contain"),
        (dict(cache_salt="a\\b"), "must not contain"),
        (dict(cache_salt="a\x00b"), "must not contain"),
        (dict(cache_salt="s" * 129), "at most 128"),
        (dict(model_name="a@b"), "must not contain '@'"),
        (dict(model_name=""), "non-empty"),
        (dict(world_size=0), "world_size"),
        (dict(world_size=True), "world_size"),
        (dict(worker_id=1), "worker_id"),
        (dict(worker_id=-1), "worker_id"),
        (dict(start=-256), "start"),
        (dict(start=256, end=0), "start"),
        (dict(end=513), "len\\(token_ids\\)"),
        (dict(request_id=None), "request_id"),
    ],
)
def test_key_validation_rejects_what_the_server_would_drop(kw: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidArgument, match=message):
        make(**kw)


def test_key_is_immutable_and_replace_validates() -> None:
    k = make()
    with pytest.raises(AttributeError):
        k.start = 5  # type: ignore[misc]
    assert k.replace(start=256).start == 256
    with pytest.raises(InvalidArgument):
        k.replace(cache_salt="@")


def test_salt_of_exactly_128_chars_is_allowed() -> None:
    assert make(cache_salt="s" * 128).cache_salt == "s" * 128


def test_wire_key_has_exactly_the_eight_0_5_3_fields_in_order() -> None:
    profile = get_profile("0.5.3")
    assert profile.key_type.__struct_fields__ == (
        "model_name", "world_size", "worker_id", "token_ids", "start", "end", "request_id",
        "cache_salt",
    )
    # Every field set to a non-default value, so a builder that drops or defaults one
    # (the salt to "", the worker id to None) shows.
    key = make(world_size=4, worker_id=3, token_ids=list(range(7, 519)), start=256, end=512,
               request_id="rid-9", cache_salt="tenant-3", model_name="model-x")
    payloads = profile.all_ranks_payloads(key, 2)
    lookup, tp = payloads["key"], payloads["tp_size"]
    transfer = profile.transfer_key(key, 1)
    expected = ["model-x", 4, None, tuple(range(7, 519)), 256, 512, "rid-9", "tenant-3"]
    assert [getattr(lookup, f) for f in profile.key_type.__struct_fields__] == expected
    assert tp == 2  # LOOKUP's second payload on 0.5.3: readers are the server's to derive
    expected[2] = 1  # a transfer names the rank it moves, not the key's
    assert [getattr(transfer, f) for f in profile.key_type.__struct_fields__] == expected


def test_chunk_hashes_refuse_what_the_server_cannot_hash() -> None:
    for bad in (0, -256):
        with pytest.raises(ValueError, match="positive"):
            chunk_hashes([1, 2], bad)
    assert len(chunk_hashes([5, 6, 7], 1)) == 3  # a chunk of one token is a chunk
    for tokens in ([-1], [2**32], [3, 2**33 - 1]):
        with pytest.raises(ValueError, match="uint32"):
            chunk_hashes(tokens, 1)
    assert len(chunk_hashes([0, 2**32 - 1], 1)) == 2


def test_object_keys_defaults_and_integer_chunk_indices() -> None:
    (case,) = [c for c in HASHES if c["name"] == "one_chunk" and c["chunk_size"] == 256]
    (k,) = object_keys(case["token_ids"], model_name="m")
    # One world, rank 0, no salt, as the server derives for a plain key.
    assert (k.rank, k.kv_rank, k.cache_salt, k.chunk_index) == (0, case["kv_ranks"]["1/None"][0],
                                                               "", 0)
    keys = object_keys(list(range(1024)), model_name="m", start=512, end=1024)
    assert [k.chunk_index for k in keys] == [2, 3]
    assert all(type(k.chunk_index) is int for k in keys)
