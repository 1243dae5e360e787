"""The CUDA exporter's logic, on machines without a GPU.

Every CUDA call of lmcache_mp.ipc.cuda goes through a driver object; these tests pass a
fake one (tests/support/fake_cuda.py) that models allocations, pointer attributes and contexts,
so the export rules, the wrapper forms and the error paths are checked here (the event
protocol: tests/ipc/test_cuda_events.py). Real GPUs: tests/ipc/test_gpu_live.py and
scripts/gpu_check.sh.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pickletools
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp.errors import InvalidArgument, LMCacheMPError, ProtocolMismatch
from lmcache_mp.ipc.base import CudaLayerExport, ExportableKVCache
from lmcache_mp.ipc.cuda import (
    IPC_HANDLE_SIZE,
    CudaError,
    CudaKVCache,
    export_allocation,
    handle_bytes,
    stream_handle,
    torch_uuid_string,
    uuid_bytes,
    write_handle_bytes,
)
from lmcache_mp.protocol import Profile, get_profile
from lmcache_mp.protocol.pickles.emitter import emit_cuda_ipc_wrapper, emit_raw_cuda_wrapper
from lmcache_mp.protocol.types import WrapperBlob

from ..support.fake_cuda import UUID16, UUID_STR, FakeDriver, FakeTensor

REPO = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((REPO / "fixtures" / "v0.5.3" / "pickles.json").read_text())
RAW_CASES = [c for c in FIXTURE["cases"] if c["template"] == "v0_5_3_raw_cuda"]
PROFILE = get_profile("0.5.3")


def small_cache(drv: FakeDriver, **kw: Any) -> CudaKVCache:
    args: dict[str, Any] = dict(num_layers=3, num_blocks=8, block_size=16, num_heads=2,
                                head_dim=64, dtype="bfloat16", driver=drv)
    args.update(kw)
    return CudaKVCache.allocate(**args)


# ------------------------------------------------------------------- UUIDs
def test_uuid_matches_torch_format() -> None:
    # torch's uuid_to_string: "%02x" per byte, grouped 4-2-2-2-6, no "GPU-" prefix.
    assert torch_uuid_string(UUID16) == UUID_STR
    assert torch_uuid_string(bytes(range(16))) == "00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert torch_uuid_string(b"\xff" * 16) == "ffffffff-ffff-ffff-ffff-ffffffffffff"
    for seed in range(50):
        raw = os.urandom(16) if seed else bytes(16)
        text = torch_uuid_string(raw)
        assert text == str(uuid.UUID(bytes=raw))
        assert text == text.lower() and not text.startswith("GPU-")
        assert [len(p) for p in text.split("-")] == [8, 4, 4, 4, 12]


def test_uuid_rejects_wrong_sizes() -> None:
    for bad in (b"", bytes(15), bytes(17), "GPU-" + UUID_STR, None):
        with pytest.raises(InvalidArgument):
            torch_uuid_string(bad)  # type: ignore[arg-type]


# ----------------------------------------------------- handle byte extraction
class ReservedStruct:
    """cuda-bindings <= 13.3: the bytes are the .reserved attribute."""

    def __init__(self, data: Any = bytes(64)) -> None:
        self.reserved = data


class PointerStruct:
    """cuda-bindings >= 13.4: only getPtr(), the address of the C struct."""

    def __init__(self, size: int = 64) -> None:
        self.buf = ctypes.create_string_buffer(size)

    def getPtr(self) -> int:  # noqa: N802 - the bindings' name
        return ctypes.addressof(self.buf)


def test_handle_bytes_from_reserved() -> None:
    data = bytes(range(64))
    assert handle_bytes(ReservedStruct(data)) == data
    # Some bindings hand back C chars as signed ints.
    signed = [b - 256 if b > 127 else b for b in bytes(range(192, 256))]
    assert handle_bytes(ReservedStruct(signed)) == bytes(range(192, 256))
    with pytest.raises(CudaError):
        handle_bytes(ReservedStruct(bytes(63)))


def test_handle_bytes_through_the_pointer() -> None:
    s = PointerStruct()
    ctypes.memmove(s.buf, bytes(range(100, 164)), 64)
    assert not hasattr(s, "reserved")
    assert handle_bytes(s) == bytes(range(100, 164))


def test_write_handle_bytes_both_ways() -> None:
    data = os.urandom(64)
    r = ReservedStruct()
    write_handle_bytes(r, data)
    assert r.reserved == data
    p = PointerStruct()
    write_handle_bytes(p, data)
    assert p.buf.raw == data and handle_bytes(p) == data
    with pytest.raises(InvalidArgument):
        write_handle_bytes(p, bytes(63))
    with pytest.raises(TypeError):
        handle_bytes(object())


def test_uuid_bytes_from_struct() -> None:
    class WithBytes:
        bytes = UUID16

    class Pointer(PointerStruct):
        pass

    assert uuid_bytes(WithBytes()) == UUID16
    p = Pointer(16)
    ctypes.memmove(p.buf, UUID16, 16)
    assert uuid_bytes(p) == UUID16


def test_stream_handle_forms() -> None:
    class TorchStream:
        cuda_stream = 0x55

    class ProtocolStream:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 0x66)

    class BindingsStream:
        def __int__(self) -> int:
            return 0x77

    assert stream_handle(None) == 0
    assert stream_handle(7) == 7
    assert stream_handle(TorchStream()) == 0x55
    assert stream_handle(ProtocolStream()) == 0x66
    assert stream_handle(BindingsStream()) == 0x77
    for bad in (True, -1, "s", 1.5j):
        with pytest.raises(InvalidArgument):
            stream_handle(bad)


# ----------------------------------------------------- the wrapper forms
@pytest.mark.parametrize("case", [c for c in RAW_CASES if c["fields"]["storage_offset"] == 0],
                         ids=lambda c: f"raw_cuda-{RAW_CASES.index(c)}")
def test_profile_wrap_cuda_is_byte_identical_to_lmcache(case: dict[str, Any]) -> None:
    f = case["fields"]
    record = CudaLayerExport(
        ipc_handle=bytes.fromhex(f["_ipc_handle_reserved"]["$bytes"]), nbytes=f["_nbytes"],
        alloc_offset=0, dtype=f["dtype"], shape=tuple(f["shape"]), stride=tuple(f["stride"]),
        device_index=0, device_uuid=f["device_uuid"], form="raw")
    (blob,) = PROFILE.wrappers.encode([record], "0.5.3")
    assert blob.data.hex() == case["pickle"]


def wrappers(cache: CudaKVCache, profile: Profile = PROFILE) -> list[WrapperBlob]:
    return profile.wrappers.encode(cache.export_layers(), profile.name)


def test_auto_is_torch_ipc_on_053_because_raw_cannot_open_there() -> None:
    drv = FakeDriver()
    cache = small_cache(drv)
    assert cache.wrapper_format == "auto"
    g = cache.geometry
    blobs = wrappers(cache)
    assert len(blobs) == g.num_layers
    for blob, exp in zip(blobs, cache.exports, strict=True):
        expected = emit_cuda_ipc_wrapper(
            handle=(0, exp.handle, g.layer_nbytes, 0, b"/lmcache_mp_no_refcounter_file", 0,
                    bytes(64), False),
            dtype="bfloat16", shape=g.layer_shape, stride=g.layer_strides,
            device_uuid=cache.device_uuid)
        assert blob.data == expected
        text = _disassemble(blob.data)
        assert "CudaIPCWrapper" in text and "RawCudaIPCWrapper" not in text
    assert cache.device_uuid == torch_uuid_string(b"\x00" + UUID16[1:])
    assert g.layer_shape == (2, 8, 2, 16, 64) and g.layer_nbytes == 2 * 8 * 2 * 16 * 64 * 2
    assert cache.kv_layout == "HND"
    assert small_cache(drv, mla=True, num_heads=1).kv_layout is None


def test_raw_form_on_053_is_the_raw_cuda_pickle() -> None:
    drv = FakeDriver()
    cache = small_cache(drv, wrapper="raw")
    g = cache.geometry
    for blob, exp in zip(wrappers(cache), cache.exports, strict=True):
        assert blob.data == emit_raw_cuda_wrapper(
            ipc_handle=exp.handle, nbytes=g.layer_nbytes, dtype="bfloat16",
            shape=g.layer_shape, stride=g.layer_strides, device_uuid=cache.device_uuid)
        assert "RawCudaIPCWrapper" in _disassemble(blob.data)


@pytest.mark.parametrize("release, auto_marker", [
    ("0.5.3", b"CudaIPCWrapper"), ("0.5.5", b"_alloc_offset"), ("0.5.6", b"cuda_raw"),
])
def test_every_profile_opens_both_forms_and_resolves_auto(release: str,
                                                          auto_marker: bytes) -> None:
    drv = FakeDriver()
    profile = get_profile(release)
    assert set(profile.wrappers.cuda) == {"raw", "torch_ipc"}
    blobs = {form: wrappers(small_cache(drv, wrapper=form), profile)[0]
             for form in ("auto", "raw", "torch_ipc")}
    assert auto_marker in blobs["auto"].data
    default = profile.wrappers.default_cuda_form
    # auto is exactly the default form (the caches differ only in their handles)
    assert len(blobs["auto"].data) == len(blobs[default].data)
    assert blobs["raw"].data != blobs["torch_ipc"].data
    assert next(iter(profile.wrappers.cuda)) == default  # listed first (README table)


def test_unknown_form_is_refused_by_the_profile() -> None:
    rec = CudaLayerExport(ipc_handle=bytes(64), nbytes=64, alloc_offset=0, dtype="uint8",
                          shape=(64,), stride=(1,), device_index=0, device_uuid=UUID_STR,
                          form="cupy")  # type: ignore[arg-type]
    for release in ("0.5.3", "0.5.5", "0.5.6"):
        with pytest.raises(ProtocolMismatch, match="'cupy'"):
            get_profile(release).wrappers.encode([rec], release)
    with pytest.raises(InvalidArgument, match="wrapper"):
        small_cache(FakeDriver(), wrapper="cupy")  # type: ignore[arg-type]


def test_offsets_travel_in_every_form_but_053_raw() -> None:
    drv = FakeDriver()
    nbytes = 2 * 4 * 2 * 16 * 64 * 2
    big = drv.add_alloc(4 * nbytes)
    for form in ("auto", "raw", "torch_ipc"):
        cache = CudaKVCache.from_pointers([big + nbytes], num_blocks=4, block_size=16,
                                          num_heads=2, head_dim=64, driver=drv, wrapper=form)
        assert cache.exports[0].offset == nbytes
        (rec,) = cache.export_layers()
        assert isinstance(rec, CudaLayerExport) and rec.alloc_offset == nbytes
        for release in ("0.5.5", "0.5.6"):
            wrappers(cache, get_profile(release))  # carries the offset: no error
        if form == "raw":
            with pytest.raises(InvalidArgument) as info:
                wrappers(cache, PROFILE)
            msg = str(info.value)
            assert f"{nbytes} bytes into" in msg and "torch_ipc" in msg
        else:
            wrappers(cache, PROFILE)


def _disassemble(data: bytes) -> str:
    import io

    out = io.StringIO()
    pickletools.dis(data, out=out)
    return out.getvalue()


# --------------------------------------------------------------- allocation
def test_allocate_one_malloc_per_layer_and_free_on_close() -> None:
    drv = FakeDriver()
    cache = small_cache(drv)
    assert isinstance(cache, ExportableKVCache)
    mallocs = [c for c in drv.calls if c[0] == "malloc"]
    assert len(mallocs) == 3 and all(c[1] == cache.geometry.layer_nbytes for c in mallocs)
    assert cache.layer_ptrs == list(drv.allocs)
    assert [e.offset for e in cache.exports] == [0, 0, 0]
    assert ("sync_device",) in drv.calls  # zero-fill finished before use
    assert not cache.closed and not cache.unlinked
    cache.unlink()  # a no-op for CUDA
    assert drv.freed == [] and not cache.unlinked
    cache.close()
    assert cache.closed
    assert sorted(drv.freed) == sorted(cache.layer_ptrs)
    cache.close()  # idempotent
    assert len(drv.freed) == 3
    with pytest.raises(InvalidArgument, match="closed"):
        cache.export_layers()
    with pytest.raises(InvalidArgument, match="closed"):
        cache.begin_transfer(None)


def test_dropped_cache_frees_its_memory() -> None:
    drv = FakeDriver()
    ptrs = small_cache(drv).layer_ptrs
    gc.collect()
    assert sorted(drv.freed) == sorted(ptrs)


def test_allocate_on_another_device_restores_the_callers_device() -> None:
    drv = FakeDriver(devices=2)
    cache = small_cache(drv, device=1)
    assert drv.device == 0
    assert all(c[2] == 1 for c in drv.calls if c[0] == "malloc")
    assert cache.device == 1 and cache.device_uuid.startswith("01")
    cache.close()
    assert all(c[2] == 1 for c in drv.calls if c[0] == "free") and drv.device == 0


def test_allocate_validates_arguments() -> None:
    drv = FakeDriver()
    for kw in ({"num_layers": 0}, {"dtype": "complex64"}, {"mla": True}, {"device": -1},
               {"block_size": True}):
        with pytest.raises(InvalidArgument):
            small_cache(drv, **kw)
    assert drv.calls == []


# ------------------------------------------------------------- export checks
def test_non_base_pointer_is_refused_with_what_to_do() -> None:
    drv = FakeDriver()
    base = drv.add_alloc(1 << 20)
    with pytest.raises(InvalidArgument) as info:
        export_allocation(base + 4096, 1024, driver=drv)
    msg = str(info.value)
    assert "4096 bytes into its CUDA allocation" in msg
    assert "CudaKVCache.allocate" in msg and "allow_offset=True" in msg
    assert "torch_ipc" in msg
    # The receiver gets the offset (torch_ipc, and raw from 0.5.5): export it.
    exp = export_allocation(base + 4096, 1024, driver=drv, allow_offset=True)
    assert exp.base == base and exp.offset == 4096 and exp.handle == drv.ipc_get_mem_handle(base)


def test_base_pointer_exports() -> None:
    drv = FakeDriver()
    base = drv.add_alloc(1 << 20)
    exp = export_allocation(base, 1 << 20, driver=drv)
    assert (exp.ptr, exp.base, exp.offset, exp.size, exp.device) == (base, base, 0, 1 << 20, 0)
    assert len(exp.handle) == IPC_HANDLE_SIZE
    with pytest.raises(InvalidArgument, match="run past the end"):
        export_allocation(base, (1 << 20) + 1, driver=drv)


@pytest.mark.parametrize("kind, words", [
    ("vmm", ["cudaIpcGetMemHandle", "expandable_segments:True", "CudaKVCache.allocate"]),
    ("pool", ["cudaMallocAsync"]),
])
def test_vmm_and_pool_memory_is_refused(kind: str, words: list[str]) -> None:
    drv = FakeDriver()
    base = drv.add_alloc(1 << 20, kind=kind)
    with pytest.raises(InvalidArgument) as info:
        export_allocation(base, 1 << 20, driver=drv)
    for word in words:
        assert word in str(info.value)
    assert not any(c[0] == "ipc_mem" for c in drv.calls)


def test_host_and_unknown_pointers_are_refused() -> None:
    drv = FakeDriver()
    host = drv.add_alloc(4096, kind="host")
    with pytest.raises(InvalidArgument, match="not device memory"):
        export_allocation(host, 4096, driver=drv)
    with pytest.raises(InvalidArgument, match="not memory CUDA knows"):
        export_allocation(0x1234, 16, driver=drv)
    for bad in (0, -5, True, "0x1"):
        with pytest.raises(InvalidArgument):
            export_allocation(bad, 16, driver=drv)  # type: ignore[arg-type]


def test_missing_context_is_refused_clearly() -> None:
    drv = FakeDriver()
    base = drv.add_alloc(4096)
    drv.context = 0
    with pytest.raises(CudaError) as info:
        export_allocation(base, 4096, driver=drv)
    assert isinstance(info.value, LMCacheMPError)
    assert "no CUDA context is current" in str(info.value)
    assert "cudaSetDevice" in str(info.value) and "torch.cuda.set_device" in str(info.value)


def test_cache_methods_make_the_primary_context_current() -> None:
    # A thread that never used CUDA: cudaGetDevice says 0 but nothing is current.
    drv = FakeDriver()
    drv.context = 0
    cache = small_cache(drv)
    assert drv.set_device_calls and drv.context != 0
    cache.close()


def test_from_torch_checks_bases_and_shapes() -> None:
    drv = FakeDriver()
    shape = (2, 4, 2, 16, 64)
    nbytes = 2 * 4 * 2 * 16 * 64 * 2
    good = [FakeTensor(drv.add_alloc(nbytes), shape) for _ in range(2)]
    cache = CudaKVCache.from_torch(good, driver=drv)
    g = cache.geometry
    assert (g.num_layers, g.num_blocks, g.num_heads, g.block_size, g.head_dim, g.dtype) == (
        2, 4, 2, 16, 64, "bfloat16")
    assert cache.torch_layers == good  # the caller's own tensors
    cache.close()
    assert drv.freed == []  # caller-owned memory is never freed by us

    # A tensor carved out of a larger allocation (PyTorch's caching allocator): the
    # offset is exported; only 0.5.3's raw form cannot carry it, and says so.
    big = drv.add_alloc(4 * nbytes)
    carved = [good[0], FakeTensor(big + nbytes, shape)]
    ok = CudaKVCache.from_torch(carved, driver=drv)
    assert [e.offset for e in ok.exports] == [0, nbytes]
    wrappers(ok)  # auto = torch_ipc on 0.5.3
    raw = CudaKVCache.from_torch(carved, driver=drv, wrapper="raw")
    with pytest.raises(InvalidArgument, match="bytes into its CUDA allocation"):
        wrappers(raw)
    wrappers(raw, get_profile("0.5.5"))

    with pytest.raises(InvalidArgument, match="dense in neither NHD nor HND"):
        CudaKVCache.from_torch([FakeTensor(good[0].ptr, shape, contiguous=False)], driver=drv)
    with pytest.raises(InvalidArgument, match="not contiguous"):
        CudaKVCache.from_torch([FakeTensor(good[0].ptr, (4, 16, 64), contiguous=False)],
                               mla=True, driver=drv)
    with pytest.raises(InvalidArgument, match="not a CUDA tensor"):
        CudaKVCache.from_torch([FakeTensor(good[0].ptr, shape, kind="cpu")], driver=drv)
    with pytest.raises(InvalidArgument, match="mla=True"):
        CudaKVCache.from_torch([FakeTensor(good[0].ptr, (4, 16, 64))], driver=drv)
    with pytest.raises(InvalidArgument, match="differs from layer 0"):
        CudaKVCache.from_torch([good[0], FakeTensor(good[1].ptr, shape, "torch.float16")],
                               driver=drv)
    with pytest.raises(InvalidArgument, match="none"):
        CudaKVCache.from_torch([], driver=drv)
    mla = CudaKVCache.from_torch([FakeTensor(drv.add_alloc(4 * 16 * 64 * 2), (4, 16, 64))],
                                 mla=True, driver=drv)
    assert mla.geometry.mla and mla.geometry.layer_shape == (4, 16, 64)


def test_from_pointers_refuses_memory_of_another_device() -> None:
    drv = FakeDriver(devices=2)
    ptr = drv.add_alloc(2 * 8 * 2 * 16 * 64 * 2, device=1)
    with pytest.raises(InvalidArgument, match="device 1, not device 0"):
        CudaKVCache.from_pointers([ptr], num_blocks=8, block_size=16, num_heads=2,
                                  head_dim=64, driver=drv)


def test_device_comes_from_the_pointer_not_device_ordinal() -> None:
    """cuda-bindings 13.3.x-13.4.1 read CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL as 0 (the
    fake does the same): memory on device 1 must still export as device 1."""
    drv = FakeDriver(devices=3)
    nbytes = 2 * 8 * 2 * 16 * 64 * 2
    ptrs = {d: drv.add_alloc(nbytes, device=d) for d in (1, 2)}
    assert drv.pointer_attribute(ptrs[2], "DEVICE_ORDINAL") == 0
    for d, ptr in ptrs.items():
        drv.set_device(d)
        assert export_allocation(ptr, nbytes, driver=drv).device == d
    drv.set_device(0)
    cache = CudaKVCache.from_pointers([ptrs[2]], num_blocks=8, block_size=16, num_heads=2,
                                      head_dim=64, device=2, driver=drv)
    assert cache.device == 2 and cache.device_uuid.startswith("02")
    (rec,) = cache.export_layers()
    assert isinstance(rec, CudaLayerExport) and rec.device_index == 2
    assert drv.device == 0  # the caller's device is restored
    # A device-0 cache of device-2 memory is refused even though DEVICE_ORDINAL says 0.
    with pytest.raises(InvalidArgument, match="device 2, not device 0"):
        CudaKVCache.from_pointers([ptrs[2]], num_blocks=8, block_size=16, num_heads=2,
                                  head_dim=64, device=0, driver=drv)


def test_bindings_driver_never_reads_device_ordinal() -> None:
    from lmcache_mp.ipc.cuda import CudaBindingsDriver

    drv = object.__new__(CudaBindingsDriver)  # no cuda-python needed for this check
    with pytest.raises(InvalidArgument, match="pointer_device"):
        drv.pointer_attribute(0x1000, "DEVICE_ORDINAL")


# ------------------------------------------------------------ import hygiene
def test_importing_the_package_loads_neither_torch_nor_cuda() -> None:
    code = ("import lmcache_mp, sys; "
            "assert 'torch' not in sys.modules, 'torch'; "
            "bad = [m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')]; "
            "assert not bad, bad; "
            "import lmcache_mp.ipc.cuda, lmcache_mp.cli.doctor; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('cuda')]; "
            "assert not bad, ('importing the CUDA module must stay lazy', bad)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------- doctor
def test_doctor_on_this_machine_does_not_raise() -> None:
    from lmcache_mp.cli.doctor import format_report, run_doctor

    rows = run_doctor(None, 1.0)
    names = [name for name, _, _ in rows]
    assert "/dev/shm" in names and "server" in names
    report = format_report(rows)
    cuda_rows = {name: (result, ok) for name, result, ok in rows if name.startswith("CUDA")}
    try:
        from lmcache_mp.ipc.cuda import CudaBindingsDriver

        drv = CudaBindingsDriver()
        has_gpu = drv.driver_version() > 0 and drv.device_count() > 0
    except LMCacheMPError:
        has_gpu = False
    if not has_gpu:
        result, ok = cuda_rows["CUDA"]
        assert result.startswith("absent (") and not ok, report
    else:
        assert any(n.startswith("IPC memory handle") and ok for n, _, ok in rows), report


def test_doctor_without_a_driver_or_device() -> None:
    from lmcache_mp.cli.doctor import run_doctor

    class NoDriver(FakeDriver):
        def driver_version(self) -> int:
            return 0

    class NoDevice(FakeDriver):
        def device_count(self) -> int:
            raise CudaError("cudaGetDeviceCount failed: cudaErrorNoDevice (100)", code=100)

    rows = {n: (r, ok) for n, r, ok in run_doctor(None, 1.0, driver=NoDriver())}
    assert rows["CUDA"][0].startswith("absent (") and "no NVIDIA driver" in rows["CUDA"][0]
    rows = {n: (r, ok) for n, r, ok in run_doctor(None, 1.0, driver=NoDevice())}
    assert rows["CUDA"][0].startswith("absent (") and "cudaErrorNoDevice" in rows["CUDA"][0]
    assert "/dev/shm" in rows


def test_doctor_with_a_fake_gpu_probes_ipc() -> None:
    from lmcache_mp.cli.doctor import run_doctor

    drv = FakeDriver()
    rows = {n: (r, ok) for n, r, ok in run_doctor(None, 1.0, driver=drv)}
    assert rows["CUDA"] == ("1 device(s)", True)
    assert rows["device 0"][0].startswith("Fake GPU 0, uuid 002e3d4c-5b6a-7988")
    assert rows["IPC memory handle (device 0)"][1] and rows["IPC event handle (device 0)"][1]
    assert rows["CUDA driver"][0] == "13.0 (13000)"
    # The probe released what it made.
    assert sorted(drv.freed) == sorted(drv.allocs)
    assert all(e["destroyed"] for e in drv.events.values())


def test_doctor_server_check_and_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    from lmcache_mp.cli.doctor import main_doctor

    assert main_doctor(None, 0.5) == 0
    out = capsys.readouterr().out
    assert "server" in out and "not checked" in out
    # Nothing listens on this port: the requested check fails, and so does the exit code.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main_doctor(f"tcp://127.0.0.1:{port}", 0.3) == 1
    out = capsys.readouterr().out
    assert "did not answer" in out


@pytest.mark.parametrize("release, default", [("0.5.3", "torch_ipc"), ("0.5.4", "torch_ipc"),
                                              ("0.5.5", "raw"), ("0.5.6", "raw")])
def test_doctor_names_the_forms_a_server_opens(release: str, default: str) -> None:
    from lmcache_mp.cli.doctor import _wrapper_forms

    text = _wrapper_forms(get_profile(release).wrappers)
    assert text.startswith(f"the server opens {default} (wrapper='auto' picks this; ")
    other = "raw" if default == "torch_ipc" else "torch_ipc"
    assert f"; {other} (" in text and text.count("wrapper='auto'") == 1
    if release in ("0.5.3", "0.5.4"):
        assert "cuda-bindings <= 13.3" in text and "never unmaps" in text


@pytest.mark.live
def test_doctor_reports_the_live_servers_forms(live_server: Any, expected_family: str) -> None:
    from lmcache_mp.cli.doctor import run_doctor

    rows = {n: (r, ok) for n, r, ok in run_doctor(live_server.url, 10.0, driver=FakeDriver())}
    assert rows["server"][1], rows["server"]
    default = get_profile(expected_family).wrappers.default_cuda_form
    forms, ok = rows["CUDA wrapper forms"]
    assert ok and forms.startswith(f"the server opens {default} (wrapper='auto' picks this")
