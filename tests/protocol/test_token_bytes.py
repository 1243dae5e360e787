"""LMCache 0.5.7's packed keys: CacheKey gives the bytes 0.5.7rc2's own token_codec packs,
from every input form, without a Python int per token for numpy / array('I') input;
and the payloads 0.5.7 added are filled with their defaults as its client does."""

from __future__ import annotations

import array
from typing import Any

import msgspec
import numpy as np
import pytest

from lmcache_mp import CacheKey
from lmcache_mp.protocol import encode_request, get_profile

from ..support.fixture_values import build, load

KEY_CASES = load("0.5.7rc2", "keys")


def key(tokens: Any, end: int = 0) -> CacheKey:
    return CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=tokens, start=0,
                    end=end, request_id="r")


def forms(ids: list[int]) -> dict[str, Any]:
    return {"list": ids, "tuple": tuple(ids), "int64": np.array(ids, dtype=np.int64),
            "uint32": np.array(ids, dtype=np.uint32), ">u4": np.array(ids, dtype=">u4"),
            "array I": array.array("I", ids), "array q": array.array("q", ids)}


@pytest.mark.parametrize("case", KEY_CASES[:6], ids=lambda c: c["name"])
def test_every_input_form_packs_to_0_5_7rc2s_token_bytes(case: dict[str, Any]) -> None:
    expected = bytes.fromhex(case["transfer"]["key"]["token_bytes"]["$bytes"])
    for name, tokens in forms(case["token_ids"]).items():
        k = key(tokens)
        assert k.token_bytes == expected, name
        assert k.token_ids == tuple(case["token_ids"]), name
        assert k.num_token_ids == len(case["token_ids"])


class NoInts(np.ndarray):
    """An array that refuses to become Python ints."""

    def tolist(self) -> Any:  # type: ignore[override]
        raise AssertionError("a Python int per token was made")

    def __iter__(self) -> Any:
        raise AssertionError("iterated token by token")


def test_numpy_tokens_reach_the_0_5_7_wire_without_python_ints() -> None:
    tokens = np.arange(4096, dtype=np.int64).view(NoInts)
    k = CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=tokens, start=0,
                 end=4096, request_id="r")
    profile = get_profile("0.5.7")
    frames = encode_request(profile.op("STORE"), [profile.transfer_key(k, 0), 1, [[0]], b""])
    assert np.arange(4096, dtype=">u4").tobytes() in frames[1]
    assert k._tokens.ids is None  # never unpacked


def test_list_tokens_are_never_packed_for_older_servers() -> None:
    k = key(list(range(512)), end=256)
    profile = get_profile("0.5.6")
    encode_request(profile.op("STORE"), [profile.transfer_key(k, 0), 1, [[0]], b""])
    assert k._tokens.packed is None


def test_keys_from_different_forms_are_equal_and_hash_alike() -> None:
    ids = list(range(300))
    made = [key(t) for t in forms(ids).values()]
    assert all(m == made[0] and hash(m) == hash(made[0]) for m in made)
    assert made[0] != key(ids[:-1])
    copy = made[2].replace(request_id="other")  # a packed key's copy stays packed
    assert copy._tokens.ids is None and copy == made[2]
    assert made[0].with_range(0, 256).token_bytes == made[0].token_bytes


def test_ranges_cut_from_a_key_derive_the_other_form_once_for_all() -> None:
    # The vLLM workers cut every STORE / RETRIEVE of a request from one key: the
    # tuple an older server's key carries is unpacked once per request, not per range.
    base = key(np.arange(1024, dtype=np.int64))
    first, second = base.with_range(0, 256), base.with_range(256, 512)
    ids = first.token_ids
    assert second._tokens.ids is ids and base.token_ids is ids
    assert base.replace(request_id="x").token_ids is ids


@pytest.mark.parametrize("op_name, tail", [("FREE_LOOKUP_LOCKS", "extra_ranges"),
                                           ("PREPARE_STORE", "skipped_chunks")])
def test_0_5_7s_new_trailing_payloads_default_to_empty_as_its_client_sends(
        op_name: str, tail: str) -> None:
    """0.5.7's RequestClient applies the defaults (``bind_payloads``) and its server needs
    every frame: leaving the new payload out sends ``()``, byte-identical to the fixture
    LMCache's encoder wrote for an empty one."""
    op = get_profile("0.5.7").op(op_name)
    assert op.payloads[-1].name == tail and op.payloads[-1].default == ()
    cases = [c for c in load("0.5.7rc2", "requests") if c["op"] == op_name
             and c["payloads"][-1] == []]
    assert cases
    for case in cases:
        payloads = [build(p, spec.type)
                    for p, spec in zip(case["payloads"], op.payloads, strict=True)]
        frames = encode_request(op, payloads[:-1])
        assert [f.hex() for f in [msgspec.msgpack.encode(case["uid"]), *frames]] == case["frames"]
