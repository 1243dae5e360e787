"""Wire keys built from the public CacheKey, per profile, against each release's own key
code (fixtures/v<release>/keys.json, written by tools/gen_fixtures.py in the oracle venv).

Each fixture case is a vLLM deployment (MLA or not, TP, PP, a worker) as the release's
own adapter describes it (``ParallelStrategy``: KV world size, KV rank, reader count),
its keys encoded by the release's own encoder (LOOKUP, FREE_LOOKUP_LOCKS over a range
not starting at 0, a transfer key), the read locks the release's server takes per
looked-up object, and the ObjectKeys its server derives for the range. Salts, unicode
model names, TP > 1 and world sizes where the readers rule matters are all covered.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from lmcache_mp import CacheKey
from lmcache_mp.protocol import encode_request
from lmcache_mp.protocol.hashing import object_keys

from ..support.fake_server import server_read_locks
from ..support.fixture_values import FIXTURES, RELEASES, load, load_all, profile_for

KEYS = load_all("keys")


def _id(item: tuple[str, dict[str, Any]]) -> str:
    return f"{item[0]}-{item[1]['name']}"


def public_key(case: dict[str, Any], *, worker_id: int | None, start: int,
               end: int) -> CacheKey:
    return CacheKey(model_name=case["model_name"], world_size=case["kv_world_size"],
                    worker_id=worker_id, token_ids=case["token_ids"], start=start, end=end,
                    request_id=case["request_id"], cache_salt=case["cache_salt"])


def decoded(frame_hex: str) -> dict[str, Any]:
    value: dict[str, Any] = msgspec.msgpack.decode(bytes.fromhex(frame_hex))
    return value


def check_all_ranks_frames(release: str, case: dict[str, Any], op: str, ours: list[bytes],
                           theirs: list[str]) -> None:
    mine = [f.hex() for f in ours]
    if mine == theirs:
        return
    # Say first whether anything beyond the reader count differs (the one field where
    # the releases' rules have parted ways before: MLA with TP <= PP).
    a, b = decoded(mine[0]), decoded(theirs[0])
    a.pop("num_kv_readers", None)
    b.pop("num_kv_readers", None)
    assert (a, mine[1:]) == (b, theirs[1:]), f"{op} key differs beyond num_kv_readers"
    raise AssertionError(f"{op} frames differ in num_kv_readers only: {mine} != {theirs}")


def test_every_release_has_key_fixtures() -> None:
    # A missing file would silently drop a release from the parametrised tests below.
    for release in RELEASES:
        assert (FIXTURES / f"v{release}" / "keys.json").exists(), release
        cases = load(release, "keys")
        assert len(cases) >= 20
        assert {c["cache_salt"] for c in cases} >= {"", "tenant-42"}
        assert any(c["tp_size"] > c["kv_world_size"] for c in cases)  # the readers rule
        assert any(c["kv_world_size"] > 1 and c["tp_size"] > 1 for c in cases)
        assert any(c["start"] > 0 for c in cases)


@pytest.mark.parametrize("item", KEYS, ids=_id)
def test_lookup_key_matches_the_release_adapter(item: tuple[str, dict[str, Any]]) -> None:
    release, case = item
    profile = profile_for(release)
    tokens = case["token_ids"]
    end = len(tokens) - len(tokens) % case["chunk_size"]
    # The public key's worker id is ignored: a LOOKUP is for every rank.
    key = public_key(case, worker_id=case["kv_worker_id"], start=0, end=end)
    frames = encode_request(profile.op("LOOKUP"),
                            profile.all_ranks_payloads(key, case["tp_size"], case["mla"]))
    check_all_ranks_frames(release, case, "LOOKUP", frames[1:], case["lookup"]["frames"])


@pytest.mark.parametrize("item", KEYS, ids=_id)
def test_free_lookup_locks_key_matches_the_release_adapter(
        item: tuple[str, dict[str, Any]]) -> None:
    release, case = item
    profile = profile_for(release)
    key = public_key(case, worker_id=None, start=case["start"], end=case["end"])
    frames = encode_request(profile.op("FREE_LOOKUP_LOCKS"),
                            profile.all_ranks_payloads(key, case["tp_size"], case["mla"]))
    check_all_ranks_frames(release, case, "FREE_LOOKUP_LOCKS", frames[1:],
                           case["free"]["frames"])


@pytest.mark.parametrize("item", KEYS, ids=_id)
def test_transfer_key_matches_the_release_adapter(item: tuple[str, dict[str, Any]]) -> None:
    release, case = item
    profile = profile_for(release)
    key = public_key(case, worker_id=None, start=case["start"], end=case["end"])
    wire = profile.transfer_key(key, case["kv_worker_id"])
    (frame,) = case["transfer"]["frames"]
    ours = encode_request(profile.op("STORE"), (wire, 1, [[0]], b""))[1]
    theirs = decoded(frame)
    if theirs.get("num_kv_readers", 1) == 1:
        assert ours.hex() == frame
    else:
        # The adapter repeats its lookup reader count in transfer keys; servers read it
        # only for LOOKUP / FREE_LOOKUP_LOCKS (require_num_kv_readers), so this client
        # sends 1. Every other field must be identical.
        mine = decoded(ours.hex())
        assert mine.pop("num_kv_readers") == 1
        theirs.pop("num_kv_readers")
        assert mine == theirs


@pytest.mark.parametrize("item", KEYS, ids=_id)
def test_object_keys_match_the_server_for_ranges_not_at_0(
        item: tuple[str, dict[str, Any]]) -> None:
    _, case = item
    common = dict(model_name=case["model_name"], world_size=case["kv_world_size"],
                  cache_salt=case["cache_salt"], chunk_size=case["chunk_size"],
                  start=case["start"], end=case["end"])
    for worker, expected in ((None, case["free"]["object_keys"]),
                             (case["kv_worker_id"], case["transfer"]["object_keys"])):
        got = object_keys(case["token_ids"], worker_id=worker, **common)  # type: ignore[arg-type]
        assert [{"chunk_index": k.chunk_index, "chunk_hash": k.chunk_hash.hex(),
                 "kv_rank": k.kv_rank, "model_name": k.model_name,
                 "cache_salt": k.cache_salt} for k in got] == expected


@pytest.mark.parametrize("item", KEYS, ids=_id)
def test_the_fake_server_takes_the_read_locks_the_real_one_does(
        item: tuple[str, dict[str, Any]]) -> None:
    """tests/support/fake_server.py counts read locks like each family's server, so offline
    lock bookkeeping tests mean what they say."""
    release, case = item
    key = decoded(case["lookup"]["frames"][0])
    assert server_read_locks(RELEASES[release], key, case["tp_size"]) == \
        case["lookup"]["read_locks"]


@pytest.mark.parametrize("family", ["0.5.3", "0.5.5", "0.5.6"])
def test_salt_reaches_every_key_the_client_builds(family: str) -> None:
    from lmcache_mp.protocol import get_profile

    profile = get_profile(family)
    key = CacheKey(model_name="m", world_size=2, worker_id=1, token_ids=list(range(64)),
                   start=16, end=48, request_id="r", cache_salt="tenant-7")
    lookup = profile.all_ranks_payloads(key, 1)["key"]
    for wire in (lookup, profile.transfer_key(key, 1)):
        assert msgspec.to_builtins(wire)["cache_salt"] == "tenant-7"
    assert msgspec.to_builtins(lookup)["worker_id"] is None
    assert msgspec.to_builtins(profile.transfer_key(key, 1))["worker_id"] == 1
