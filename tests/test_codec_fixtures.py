"""Our frames are byte-identical to each LMCache release's own encoder, and our
decoders read its replies.

Fixtures come from tools/gen_fixtures.py run in the oracle venv of each release
(LMCache's real classes and encoder); these tests run without lmcache installed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from lmcache_mp.ipc.base import CudaLayerExport, LayerExport, ShmLayerExport
from lmcache_mp.protocol import decode_reply, encode_request

from .fixture_values import RELEASES, build, build_reply, load, load_all, profile_for

REQUESTS = load_all("requests")
REPLIES = load_all("replies")


def _id(item: tuple[str, dict[str, Any]]) -> str:
    return f"{item[0]}-{item[1]['op']}"


@pytest.mark.parametrize("release", list(RELEASES))
def test_every_profile_op_has_request_and_reply_fixtures(release: str) -> None:
    ops = set(profile_for(release).operations)
    assert {c["op"] for c in load(release, "requests")} == ops
    assert {c["op"] for c in load(release, "replies")} == ops


@pytest.mark.parametrize("release", list(RELEASES))
def test_fixture_op_ids_and_groups_match_the_profile(release: str) -> None:
    profile = profile_for(release)
    for case in load(release, "requests"):
        op = profile.op(case["op"])
        assert op.id == case["id"], case["op"]
        assert op.group == case["group"], case["op"]


@pytest.mark.parametrize("item", REQUESTS, ids=_id)
def test_request_frames_are_byte_identical_to_lmcache(item: tuple[str, dict[str, Any]]) -> None:
    release, case = item
    op = profile_for(release).op(case["op"])
    payloads = [build(p, spec.type) for p, spec in zip(case["payloads"], op.payloads, strict=True)]
    frames = encode_request(op, payloads)
    uid = msgspec.msgpack.encode(case["uid"])
    assert [f.hex() for f in [uid, *frames]] == case["frames"]


@pytest.mark.parametrize("item", REPLIES, ids=_id)
def test_replies_encoded_by_lmcache_decode(item: tuple[str, dict[str, Any]]) -> None:
    release, case = item
    op = profile_for(release).op(case["op"])
    frames = [bytes.fromhex(f) for f in case["frames"]]
    value = decode_reply(op, frames[1:])  # the transport strips the uid
    expected = build_reply(case["value"])
    if isinstance(value, msgspec.Struct):
        # Typed replies (e.g. the engine-driven slot contexts) compare as their type.
        assert value == msgspec.convert(expected, type(value))
        return
    if isinstance(value, tuple):
        value = list(value)
    assert value == expected


WRAPPERS = load_all("wrappers")


@pytest.mark.parametrize("item", WRAPPERS, ids=lambda i: f"{i[0]}-{i[1]['kind']}")
def test_wrappers_are_byte_identical_to_the_release_serializer(
    item: tuple[str, dict[str, Any]],
) -> None:
    """0.5.5: pickles (CPU SHM as 0.5.3, RawCudaIPCWrapper with _alloc_offset/_opens);
    0.5.6: msgpack descriptors."""
    release, case = item
    profile = profile_for(release)
    f = case["fields"]
    shape, stride = tuple(f["shape"]), tuple(f["stride"])
    record: LayerExport
    if case["kind"] == "cpu_shm":
        record = ShmLayerExport(f["shm_name"], f["nbytes"], f["dtype"], shape, stride)
    else:
        record = CudaLayerExport(ipc_handle=bytes.fromhex(f["ipc_handle"]), nbytes=f["nbytes"],
                                 alloc_offset=f.get("alloc_offset", 0), dtype=f["dtype"],
                                 shape=shape, stride=stride, device_index=0,
                                 device_uuid=f["device_uuid"], form="raw")
    (blob,) = profile.wrappers.encode([record], release)
    assert blob.data.hex() == case["data"]
