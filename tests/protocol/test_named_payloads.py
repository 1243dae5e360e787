"""Payloads by name (lmcache_mp.protocol.encode_request given a dict): the operation's
payload specs give the wire order, as LMCache's own encoder writes it, so only the
protocol profile knows that order; the session names every payload."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lmcache_mp import CacheKey, CpuKVCache, InvalidArgument
from lmcache_mp.protocol import PROFILES, encode_request, get_profile

from ..support.fixture_values import build, load_all, profile_for

REQUESTS = load_all("requests")
SESSION = Path(__file__).resolve().parents[2] / "lmcache_mp" / "session"


def _id(item: tuple[str, dict[str, Any]]) -> str:
    return f"{item[0]}-{item[1]['op']}"


@pytest.mark.parametrize("item", REQUESTS, ids=_id)
def test_named_payloads_are_byte_identical_to_lmcache(item: tuple[str, dict[str, Any]]) -> None:
    release, case = item
    op = profile_for(release).op(case["op"])
    # Given in reverse: the order of the dict says nothing, the names do.
    named = {spec.name: build(p, spec.type)
             for p, spec in reversed(list(zip(case["payloads"], op.payloads, strict=True)))}
    frames = encode_request(op, named)
    uid = msgspec.msgpack.encode(case["uid"])
    assert [f.hex() for f in [uid, *frames]] == case["frames"]


@pytest.mark.parametrize("family", list(PROFILES))
def test_every_payload_of_an_operation_has_its_own_name(family: str) -> None:
    for op in PROFILES[family].operations.values():
        names = [p.name for p in op.payloads]
        assert len(set(names)) == len(names), op.name


def key() -> CacheKey:
    return CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=list(range(256)),
                    start=0, end=256, request_id="r")


def test_a_payload_with_a_default_may_be_left_out() -> None:
    # COMMIT_STORE's cpu_data (empty: the data is in the shared-memory pool) and 0.5.7's
    # PREPARE_STORE skipped_chunks: the session never names them.
    for family in PROFILES:
        profile = get_profile(family)
        wire = profile.transfer_key(key(), 0)
        commit = profile.op("COMMIT_STORE")
        assert encode_request(commit, {"key": wire, "instance_id": 7}) == \
            encode_request(commit, (wire, 7, b""))
        prepare = profile.op("PREPARE_STORE")
        full = (wire, 7, ()) if family == "0.5.7" else (wire, 7)
        assert encode_request(prepare, {"key": wire, "instance_id": 7}) == \
            encode_request(prepare, full)


def test_a_missing_or_unknown_name_is_refused_before_anything_is_sent() -> None:
    profile = get_profile("0.5.3")
    store = profile.op("STORE")
    wire = profile.transfer_key(key(), 0)
    with pytest.raises(InvalidArgument, match="STORE: no block_ids given .*it takes key, "
                                              "instance_id, block_ids, event_ipc_handle"):
        encode_request(store, {"key": wire, "instance_id": 1, "event_ipc_handle": b""})
    with pytest.raises(InvalidArgument, match="STORE has no payload skip_first_n_tokens"):
        encode_request(store, {"key": wire, "instance_id": 1, "block_ids": [[0]],
                               "event_ipc_handle": b"", "skip_first_n_tokens": 0})
    with pytest.raises(InvalidArgument, match="NOOP has no payload x .*no payload"):
        encode_request(profile.op("NOOP"), {"x": 1})
    with pytest.raises(InvalidArgument, match="STORE: invalid instance_id"):
        encode_request(store, {"key": wire, "instance_id": "1", "block_ids": [[0]],
                               "event_ipc_handle": b""})


def test_the_profile_names_what_differs_between_families() -> None:
    k = key()
    for family in PROFILES:
        profile = get_profile(family)
        lookup = profile.all_ranks_payloads(k, 2)
        assert set(lookup) == {"key", "tp_size"} and lookup["tp_size"] == 2
        assert profile.clear_payloads(False) == ({} if family in ("0.5.3", "0.5.5")
                                                 else {"force": False})
        with CpuKVCache.allocate(num_layers=1, num_blocks=2, block_size=16, num_heads=1,
                                 head_dim=8, dtype="float16") as cache:
            register = profile.register_payloads(
                instance_id=1, exports=cache.export_layers(), model_name="m", world_size=1,
                kv_layout="HND", groups=[])
        assert list(register) == [p.name for p in profile.op("REGISTER_KV_CACHE").payloads]
        assert register["engine_type"] == "vllm"


def _payload_literals(path: Path) -> list[str]:
    """Calls ``x.submit / call / request(op, <tuple or list literal>, ...)``: payloads
    in wire order written in the session."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("submit", "call", "request") and len(node.args) >= 2
                and isinstance(node.args[1], (ast.Tuple, ast.List))):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_session_names_every_payload() -> None:
    files = sorted(SESSION.glob("*.py"))
    assert files
    assert [hit for f in files for hit in _payload_literals(f)] == []
