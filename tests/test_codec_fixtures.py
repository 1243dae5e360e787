"""Our frames are byte-identical to LMCache's own encoder; our decoders read its replies.

Fixtures come from tools/gen_fixtures.py run in the oracle venv (LMCache's real classes
and msgspec_encode); these tests run without lmcache installed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from lmcache_mp.protocol import decode_reply, encode_request, get_profile
from lmcache_mp.protocol.types import PrepareRetrieveResponse, PrepareStoreResponse

from .fixture_values import build, load

PROFILE = get_profile("0.5.3")
REQUESTS = load("0.5.3", "requests")
REPLIES = load("0.5.3", "replies")


def _id(case: dict[str, Any]) -> str:
    return case["op"]


def test_every_profile_op_has_request_and_reply_fixtures() -> None:
    ops = set(PROFILE.operations)
    assert {c["op"] for c in REQUESTS} == ops
    assert {c["op"] for c in REPLIES} == ops


def test_fixture_op_ids_and_groups_match_the_profile() -> None:
    for case in REQUESTS:
        op = PROFILE.op(case["op"])
        assert op.id == case["id"], case["op"]
        assert op.group == case["group"], case["op"]


@pytest.mark.parametrize("case", REQUESTS, ids=_id)
def test_request_frames_are_byte_identical_to_lmcache(case: dict[str, Any]) -> None:
    op = PROFILE.op(case["op"])
    payloads = [build(p, PROFILE.key_type) for p in case["payloads"]]
    frames = encode_request(op, payloads)
    uid = msgspec.msgpack.encode(case["uid"])
    assert [f.hex() for f in [uid, *frames]] == case["frames"]


@pytest.mark.parametrize("case", REPLIES, ids=_id)
def test_replies_encoded_by_lmcache_decode(case: dict[str, Any]) -> None:
    op = PROFILE.op(case["op"])
    frames = [bytes.fromhex(f) for f in case["frames"]]
    value = decode_reply(op, frames[1:])  # the transport strips the uid
    expected = build(case["value"], PROFILE.key_type)
    if isinstance(value, (PrepareStoreResponse, PrepareRetrieveResponse)) or hasattr(
        value, "__struct_fields__"
    ):
        value = {f: getattr(value, f) for f in value.__struct_fields__}
    if isinstance(expected, list) and isinstance(value, tuple):
        expected = tuple(expected)
    assert value == expected
