"""Our frames are byte-identical to each LMCache release's own encoder, and our
decoders read its replies.

Fixtures come from tools/gen_fixtures.py run in the oracle venv of each release
(LMCache's real classes and encoder); these tests run without lmcache installed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from lmcache_mp import ProtocolMismatch
from lmcache_mp.ipc.base import CudaLayerExport, LayerExport, ShmLayerExport, VmmLayerExport
from lmcache_mp.protocol import decode_reply, encode_request
from lmcache_mp.protocol.wrappers import vmm_descriptor

from ..support.fixture_values import RELEASES, build, build_reply, load, load_all, profile_for

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
# fixture kind -> the CUDA wrapper form of lmcache_mp that must produce it
CUDA_FORMS = {"cuda_raw": "raw", "cuda_ipc": "torch_ipc"}


def _record(case: dict[str, Any], form: str) -> LayerExport:
    f = case["fields"]
    shape, stride = tuple(f["shape"]), tuple(f["stride"])
    if case["kind"] == "cuda_vmm":
        blob = f["fabric_blob"]
        return VmmLayerExport(export_id=bytes.fromhex(f["export_id"]), kind=f["vmm_kind"],
                              fabric_blob=None if blob is None else bytes.fromhex(blob),
                              alloc_size=f["alloc_size"], alloc_offset=f["alloc_offset"],
                              nbytes=f["nbytes"], dtype=f["dtype"], shape=shape, stride=stride,
                              device_index=0, device_uuid=f["device_uuid"])
    if case["kind"] == "cpu_shm":
        return ShmLayerExport(f["shm_name"], f["nbytes"], f["dtype"], shape, stride)
    return CudaLayerExport(ipc_handle=bytes.fromhex(f["ipc_handle"]), nbytes=f["nbytes"],
                           alloc_offset=f["alloc_offset"], dtype=f["dtype"], shape=shape,
                           stride=stride, device_index=f.get("device_index", 0),
                           device_uuid=f["device_uuid"], form=form)  # type: ignore[arg-type]


@pytest.mark.parametrize("release", list(RELEASES))
def test_every_release_has_every_wrapper_kind(release: str) -> None:
    kinds = {c["kind"] for c in load(release, "wrappers")}
    # cuda_vmm: the descriptor releases (0.5.6+) open CUDA VMM memory.
    vmm = {"cuda_vmm"} if profile_for(release).wrappers.vmm is not None else set()
    assert kinds == {"cpu_shm", "cuda_raw", "cuda_ipc"} | vmm
    # 0.5.5+ raw wrappers carry an offset; the fixtures must exercise one.
    if release in ("0.5.5", "0.5.6", "0.5.7rc2"):
        assert any(c["fields"].get("alloc_offset") for c in load(release, "wrappers")
                   if c["kind"] == "cuda_raw")


@pytest.mark.parametrize("item", WRAPPERS,
                         ids=lambda i: f"{i[0]}-{i[1]['kind']}-{i[1]['fields'].get('alloc_offset', 0)}")
def test_wrappers_are_byte_identical_to_the_release_serializer(
    item: tuple[str, dict[str, Any]],
) -> None:
    """Every wrapper form, against the release's own DeviceIPCWrapper.Serialize:
    pickles up to 0.5.5 (CPU SHM; RawCudaIPCWrapper, with _alloc_offset/_opens from
    0.5.5; CudaIPCWrapper), msgpack descriptors in 0.5.6 (cpu_shm, cuda_raw, cuda)."""
    release, case = item
    profile = profile_for(release)
    form = CUDA_FORMS.get(case["kind"], "")
    rec = _record(case, form)
    if isinstance(rec, VmmLayerExport) and rec.kind == "posix_fd":
        # Encoded byte-exact, but never sent: no release receives the fd (see below).
        assert vmm_descriptor(rec).hex() == case["data"]
        return
    (blob,) = profile.wrappers.encode([rec], release)
    assert blob.data.hex() == case["data"]


@pytest.mark.parametrize("release", list(RELEASES))
def test_vmm_layers_are_sent_as_fabric_handles_only(release: str) -> None:
    """A fabric export rides in the cuda_vmm descriptor; a POSIX-fd export is refused
    before sending (no LMCache release up to 0.5.7rc2 installs the fd resolver its
    receiver needs), and families without cuda_vmm refuse VMM memory outright."""
    profile = profile_for(release)
    cases = [c for c in load("0.5.7rc2", "wrappers") if c["kind"] == "cuda_vmm"]
    fabric = next(_record(c, "") for c in cases if c["fields"]["vmm_kind"] == "fabric")
    fd = next(_record(c, "") for c in cases if c["fields"]["vmm_kind"] == "posix_fd")
    if profile.wrappers.vmm is None:
        for rec in (fabric, fd):
            with pytest.raises(ProtocolMismatch, match="cannot open CUDA VMM memory"):
                profile.wrappers.encode([rec], release)
        return
    (blob,) = profile.wrappers.encode([fabric], release)
    assert blob.data == vmm_descriptor(fabric)  # type: ignore[arg-type]
    with pytest.raises(ProtocolMismatch, match="set_vmm_fd_resolver"):
        profile.wrappers.encode([fd], release)


@pytest.mark.parametrize("release", list(RELEASES))
def test_auto_form_is_the_profiles_default(release: str) -> None:
    """wrapper='auto' gives exactly the bytes of the profile's default form (0.5.3:
    torch_ipc, the CudaIPCWrapper; 0.5.5/0.5.6: raw)."""
    profile = profile_for(release)
    expected_default = "torch_ipc" if profile.name == "0.5.3" else "raw"
    assert profile.wrappers.default_cuda_form == expected_default
    case = next(c for c in load(release, "wrappers")
                if CUDA_FORMS.get(c["kind"]) == expected_default)
    (blob,) = profile.wrappers.encode([_record(case, "auto")], release)
    assert blob.data.hex() == case["data"]


EVENTS = load_all("events")


@pytest.mark.parametrize("item", EVENTS, ids=lambda i: f"{i[0]}-{i[1]['kind']}")
def test_non_cuda_event_replies_are_refused_accurately(item: tuple[str, dict[str, Any]]) -> None:
    """A reply's event that is not a cudaIpcEventHandle_t, as the release encodes it: a
    CPU server's stub, or an --isolated-ipc server's timeline semaphore (0.5.5+)."""
    from lmcache_mp.errors import ProtocolMismatch
    from lmcache_mp.ipc.cuda import UnsupportedServerEvent, check_server_event

    release, case = item
    data = bytes.fromhex(case["data"])
    with pytest.raises(UnsupportedServerEvent) as info:
        check_server_event(data)
    assert isinstance(info.value, ProtocolMismatch)
    if case["kind"] == "timeline_semaphore":
        assert len(data) == 81 and "--isolated-ipc" in str(info.value)
    else:
        assert "not running in GPU mode" in str(info.value)


def test_isolated_ipc_fixtures_exist_from_055() -> None:
    kinds = {(rel, c["kind"]) for rel, c in EVENTS}
    assert ("0.5.5", "timeline_semaphore") in kinds and ("0.5.6", "timeline_semaphore") in kinds
    assert ("0.5.3", "timeline_semaphore") not in kinds
