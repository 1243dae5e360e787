"""The wrapper forms a CUDA layer takes on the wire, read back with independent parsers:
pickletools (the stdlib's reader of the pickle format; nothing is ever unpickled) and
msgpack. A cache carved out of a larger allocation must say where it starts, in every
form that can; and each primitive the pickle emitter writes must be encoded exactly as
CPython's own pickler encodes that value (its length-prefix boundaries included).
"""

from __future__ import annotations

import pickle
import pickletools
from typing import Any

import msgspec
import pytest

from lmcache_mp import InvalidArgument
from lmcache_mp.ipc.base import CudaLayerExport
from lmcache_mp.protocol import get_profile
from lmcache_mp.protocol.pickles.emitter import emit_cuda_ipc_wrapper

HANDLE = bytes(range(7, 71))  # 64 bytes
UUID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
PRIMITIVE_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES",
                 "BINBYTES8", "BININT1", "BININT2", "BININT", "LONG1", "LONG4"}


def export(alloc_offset: int, form: str = "raw") -> CudaLayerExport:
    return CudaLayerExport(ipc_handle=HANDLE, nbytes=2 * 8 * 16 * 64 * 2,
                           alloc_offset=alloc_offset, dtype="bfloat16",
                           shape=(2, 8, 1, 16, 64), stride=(8192, 1024, 1024, 64, 1),
                           device_index=3, device_uuid=UUID, form=form)  # type: ignore[arg-type]


def ops(data: bytes) -> list[tuple[str, Any]]:
    return [(op.name, arg) for op, arg, _ in pickletools.genops(data)]


def values(data: bytes) -> list[Any]:
    """The primitive values of a pickle, in order (memo and framing opcodes dropped)."""
    return [arg for name, arg in ops(data) if name in PRIMITIVE_OPS]


def cpython_opcode(value: Any) -> str:
    """The opcode CPython's pickler (protocol 4) writes for one primitive value."""
    (name, _), = [(n, a) for n, a in ops(pickle.dumps(value, protocol=4)) if n in PRIMITIVE_OPS]
    return name


@pytest.mark.parametrize("offset", [0, 512, 12288, 2**33 + 256])
def test_the_torch_ipc_wrapper_carries_the_offset_into_the_allocation(offset: int) -> None:
    (blob,) = get_profile("0.5.3").wrappers.encode([export(offset, "torch_ipc")], "0.5.3")
    seq = values(blob.data)
    # torch's _share_cuda_() tuple: (device, handle, storage bytes, byte offset in the
    # allocation, ref-counter name, ref-counter offset, event handle, sync flag).
    at = seq.index(HANDLE)
    assert seq[at - 1] == 3
    assert seq[at + 1:at + 3] == [2 * 8 * 16 * 64 * 2, offset]
    # A ref-counter file that cannot exist (torch only opens it, best effort, on free),
    # at offset 0; no producer event (ordering is per transfer), so no sync needed.
    refcounter, counter_offset, event = seq[at + 3:at + 6]
    assert isinstance(refcounter, bytes) and refcounter.startswith(b"/lmcache_mp_no_")
    assert (counter_offset, event) == (0, bytes(64))
    seq_ops = [(n, a) for n, a in ops(blob.data) if n != "MEMOIZE"]
    (event_at,) = [i for i, (_, a) in enumerate(seq_ops) if a == bytes(64)]
    assert seq[seq.index("storage_offset") + 1] == 0  # the tensor starts its storage
    assert seq_ops[event_at + 1][0] == "NEWFALSE"  # event_sync_required


@pytest.mark.parametrize("offset", [0, 4096, 2**40])
def test_the_0_5_5_raw_wrapper_and_the_0_5_6_descriptor_carry_the_offset(offset: int) -> None:
    (pickled,) = get_profile("0.5.5").wrappers.encode([export(offset)], "0.5.5")
    seq = values(pickled.data)
    assert seq[seq.index("_alloc_offset") + 1] == offset
    assert seq[seq.index("_ipc_handle_reserved") + 1] == HANDLE
    (desc,) = get_profile("0.5.6").wrappers.encode([export(offset)], "0.5.6")
    fields = msgspec.msgpack.decode(desc.data)
    assert (fields["alloc_offset"], fields["ipc_handle"]) == (offset, HANDLE)


def test_the_0_5_3_raw_wrapper_refuses_an_offset_it_cannot_carry() -> None:
    (blob,) = get_profile("0.5.3").wrappers.encode([export(0)], "0.5.3")
    assert HANDLE in values(blob.data)
    with pytest.raises(InvalidArgument, match="4096 bytes into"):
        get_profile("0.5.3").wrappers.encode([export(4096)], "0.5.3")


@pytest.mark.parametrize("length", [64, 254, 255, 256, 257, 1024])
def test_byte_strings_around_the_256_byte_boundary_are_encoded_as_cpython_does(
        length: int) -> None:
    storage_handle = bytes((i * 7) % 256 for i in range(length))
    data = emit_cuda_ipc_wrapper(
        handle=(0, storage_handle, 4096, 0, b"/torch_1_" + b"r" * 200, 0, bytes(64), False),
        dtype="float16", shape=(2, 1024), stride=(1024, 1), device_uuid=UUID)
    found = [(name, arg) for name, arg in ops(data) if arg == storage_handle]
    assert found == [(cpython_opcode(storage_handle), storage_handle)]
    assert ops(data)[-1] == ("STOP", None)


@pytest.mark.parametrize("offset", [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**63 - 1])
def test_every_primitive_is_encoded_as_cpython_encodes_it(offset: int) -> None:
    data = emit_cuda_ipc_wrapper(
        handle=(7, b"\x03c" + HANDLE, 2**20 + offset % 977, offset, b"/torch_1_2", offset,
                bytes(64), True),
        dtype="bfloat16", shape=(2, 8, 4, 16, 64), stride=(32768, 4096, 1024, 64, 1),
        device_uuid=UUID, storage_offset=offset % 1000)
    checked = 0
    for name, arg in ops(data):
        if name in PRIMITIVE_OPS:
            assert name == cpython_opcode(arg), (name, arg)
            checked += 1
    assert checked >= 20 and offset in values(data)


@pytest.mark.parametrize("stride0", [-1, -128, -129, -256, -(2**15), -(2**31), -(2**31) - 1,
                                     -(2**39), -(2**55), -(2**63)])
def test_negative_strides_are_encoded_as_cpython_encodes_them(stride0: int) -> None:
    # Negative strides are legal torch metadata; below -2**31 pickle uses LONG1 with a
    # minimal two's-complement body.
    data = emit_cuda_ipc_wrapper(
        handle=(0, b"\x03c" + HANDLE, 4096, 0, b"/torch_1_2", 0, bytes(64), False),
        dtype="float16", shape=(2, 1024), stride=(stride0, 1), device_uuid=UUID)
    assert stride0 in values(data)
    for name, arg in ops(data):
        if name in PRIMITIVE_OPS:
            assert name == cpython_opcode(arg), (name, arg)
    i = [n for n, a in ops(data) if a == stride0]
    assert i == [cpython_opcode(stride0)]


def test_the_torch_ipc_device_index_is_a_c_int() -> None:
    handle = (2**31 - 1, b"\x03c" + HANDLE, 4096, 0, b"/torch_1_2", 0, bytes(64), False)
    emit_cuda_ipc_wrapper(handle=handle, dtype="float16", shape=(2,), stride=(1,),
                          device_uuid=UUID)
    with pytest.raises(InvalidArgument, match=r"handle\[0\]"):
        emit_cuda_ipc_wrapper(handle=(2**31, *handle[1:]), dtype="float16", shape=(2,),
                              stride=(1,), device_uuid=UUID)
