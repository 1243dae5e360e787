"""The CUDA exporter on a real GPU (skipped, with the reason, where there is none).

The IPC test plays the server in a child process exactly as LMCache does: it opens our
memory handle, waits on our event, writes the memory on its own stream, and answers
with its own event, which our stream then waits on.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp.errors import InvalidArgument, LMCacheMPError

REPO = Path(__file__).resolve().parents[2]


def _bindings() -> tuple[Any, str | None]:
    """(runtime module, reason to skip GPU tests or None)."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError as exc:
        return None, f"cuda-bindings is not installed ({exc}): pip install 'lmcache-mp[cuda]'"
    try:
        from lmcache_mp.ipc.cuda import CudaBindingsDriver

        drv = CudaBindingsDriver()
        if drv.driver_version() <= 0:
            return rt, "no NVIDIA driver on this machine"
        if drv.device_count() < 1:
            return rt, "no CUDA device visible"
    except LMCacheMPError as exc:
        return rt, f"no usable CUDA device: {exc}"
    return rt, None


RT, NO_GPU = _bindings()
needs_bindings = pytest.mark.skipif(RT is None, reason=str(NO_GPU))
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=str(NO_GPU))


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture
def cache() -> Iterator[Any]:
    from lmcache_mp.ipc.cuda import CudaKVCache

    c = CudaKVCache.allocate(num_layers=2, num_blocks=4, block_size=16, num_heads=2,
                             head_dim=64, dtype="bfloat16")
    yield c
    c.close()


@needs_bindings
def test_real_handle_structs_round_trip() -> None:
    # Works on cuda-bindings with (<= 13.3) and without (>= 13.4) the .reserved field.
    from lmcache_mp.ipc.cuda import handle_bytes, write_handle_bytes

    for cls in (RT.cudaIpcMemHandle_t, RT.cudaIpcEventHandle_t):
        data = os.urandom(64)
        struct = cls()
        write_handle_bytes(struct, data)
        assert handle_bytes(struct) == data
        assert ctypes.string_at(struct.getPtr(), 64) == data


@needs_gpu
def test_allocate_and_export(cache: Any) -> None:
    from lmcache_mp.ipc.cuda import get_driver
    from lmcache_mp.protocol import get_profile

    assert len(cache.layer_ptrs) == 2 and len(set(cache.layer_ptrs)) == 2
    for exp in cache.exports:
        assert exp.offset == 0 and exp.size >= cache.geometry.layer_nbytes
        assert len(exp.handle) == 64 and any(exp.handle)
    assert cache.device_uuid == get_driver().device_info(0).uuid
    assert [e.device for e in cache.exports] == [0, 0]
    profile = get_profile("0.5.3")
    blobs = profile.wrappers.encode(cache.export_layers(), "0.5.3")
    # wrapper="auto" is torch's CudaIPCWrapper on 0.5.3
    assert len(blobs) == 2 and b"CudaIPCWrapper" in blobs[0].data
    assert b"RawCudaIPCWrapper" not in blobs[0].data


@needs_gpu
def test_pointer_device_on_every_device() -> None:
    """The device comes from cudaPointerGetAttributes, not from DEVICE_ORDINAL (which
    reads 0 on cuda-bindings 13.3.x-13.4.1): checked on every visible device."""
    from lmcache_mp.ipc.cuda import export_allocation, get_driver, on_device

    drv = get_driver()
    for dev in range(drv.device_count()):
        with on_device(drv, dev):
            ptr = drv.malloc(1 << 20)
            try:
                assert drv.pointer_device(ptr) == dev
                assert export_allocation(ptr, 1 << 20).device == dev
            finally:
                drv.free(ptr)


@needs_gpu
def test_uuid_matches_torch() -> None:
    from lmcache_mp.ipc.cuda import get_driver

    torch = _torch_cuda()
    drv = get_driver()
    for i in range(torch.cuda.device_count()):
        assert drv.device_info(i).uuid == str(torch.cuda.get_device_properties(i).uuid)


@needs_gpu
def test_non_base_pointer_and_pool_memory_are_refused() -> None:
    from lmcache_mp.ipc.cuda import export_allocation, get_driver

    drv = get_driver()
    drv.set_device(0)
    ptr = drv.malloc(1 << 20)
    try:
        with pytest.raises(InvalidArgument, match="into its CUDA allocation"):
            export_allocation(ptr + 4096, 4096)
        exp = export_allocation(ptr + 4096, 4096, allow_offset=True)
        assert exp.base == ptr and exp.offset == 4096
    finally:
        drv.free(ptr)
    err, pool_ptr = RT.cudaMallocAsync(1 << 20, 0)
    if int(err) != 0:
        pytest.skip(f"cudaMallocAsync unsupported here: {err}")
    try:
        with pytest.raises(InvalidArgument, match="stream-ordered memory pool"):
            export_allocation(int(pool_ptr), 1 << 20)
    finally:
        RT.cudaFreeAsync(pool_ptr, 0)
        RT.cudaDeviceSynchronize()


@needs_gpu
def test_event_create_and_export(cache: Any) -> None:
    handle, token = cache.begin_transfer(None)
    assert len(handle) == 64 and not token.destroyed
    token.destroy()
    assert token.destroyed


_FAKE_SERVER = r"""
import sys
from cuda.bindings import runtime as rt
from lmcache_mp.ipc.cuda import handle_bytes, write_handle_bytes

def ok(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    assert int(err) == 0, err
    return rest[0] if rest else None

mem, nbytes, event = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
ok(rt.cudaSetDevice(0))
mh = rt.cudaIpcMemHandle_t(); write_handle_bytes(mh, mem)
ptr = ok(rt.cudaIpcOpenMemHandle(mh, rt.cudaIpcMemLazyEnablePeerAccess))
eh = rt.cudaIpcEventHandle_t(); write_handle_bytes(eh, event)
client_event = ok(rt.cudaIpcOpenEventHandle(eh))
stream = ok(rt.cudaStreamCreate())
ok(rt.cudaStreamWaitEvent(stream, client_event, 0))
ok(rt.cudaMemsetAsync(ptr, 0xAB, nbytes, stream))
done = ok(rt.cudaEventCreateWithFlags(rt.cudaEventInterprocess | rt.cudaEventDisableTiming))
ok(rt.cudaEventRecord(done, stream))
print(handle_bytes(ok(rt.cudaIpcGetEventHandle(done))).hex(), flush=True)
sys.stdin.readline()  # keep the mapping and the event until the parent has checked
ok(rt.cudaStreamSynchronize(stream))
ok(rt.cudaIpcCloseMemHandle(ptr))
"""


@needs_gpu
def test_ipc_round_trip_with_a_child_process(cache: Any) -> None:
    nbytes = cache.geometry.layer_nbytes
    exp = cache.exports[1]
    handle, token = cache.begin_transfer(None)
    child = subprocess.Popen(
        [sys.executable, "-c", _FAKE_SERVER, exp.handle.hex(), str(nbytes), handle.hex()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_child_env())
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline().strip()
        assert len(line) == 128, child.stderr.read() if child.stderr else line
        cache.end_transfer(bytes.fromhex(line), None, token)
        assert token.destroyed
        cache.synchronize()
        host = (ctypes.c_ubyte * nbytes)()
        err, = RT.cudaMemcpy(ctypes.addressof(host), exp.ptr, nbytes,
                             RT.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        assert int(err) == 0
        assert bytes(host) == b"\xab" * nbytes
        # Layer 0 was not touched.
        err, = RT.cudaMemcpy(ctypes.addressof(host), cache.exports[0].ptr, nbytes,
                             RT.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        assert bytes(host) == bytes(nbytes)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0, child.stderr.read() if child.stderr else ""
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@needs_gpu
def test_torch_views(cache: Any) -> None:
    torch = _torch_cuda()
    layers = cache.torch_layers
    g = cache.geometry
    assert [t.data_ptr() for t in layers] == cache.layer_ptrs
    assert layers[0].shape == g.layer_shape and layers[0].dtype == torch.bfloat16
    assert int(layers[0].count_nonzero()) == 0  # allocate() zero-fills
    layers[1].fill_(1.5)
    assert float(layers[1].float().mean()) == 1.5
    view = layers[1]
    cache.close()
    # A view handed out keeps its memory alive after close.
    assert float(view.float().sum()) == 1.5 * view.numel()


@needs_gpu
def test_torch_allocator_memory() -> None:
    from lmcache_mp.ipc.cuda import CudaKVCache

    torch = _torch_cuda()
    from lmcache_mp.protocol import get_profile

    big = torch.zeros((2, 2, 4, 2, 16, 64), dtype=torch.bfloat16, device="cuda")
    raw = CudaKVCache.from_torch([big[1]], wrapper="raw")
    with pytest.raises(InvalidArgument, match="into its CUDA allocation"):
        get_profile("0.5.3").wrappers.encode(raw.export_layers(), "0.5.3")
    get_profile("0.5.5").wrappers.encode(raw.export_layers(), "0.5.5")  # carries it
    c = CudaKVCache.from_torch([big[0], big[1]])
    assert c.exports[1].offset == c.exports[0].offset + big[0].numel() * 2
    c.close()
    raw.close()


@needs_gpu
def test_vllm_style_permuted_views_copy_like_the_cpu_path() -> None:
    """Logical NHD views of HND memory, all in one torch allocation (what vLLM hands an
    HND backend's connector): from_torch registers HND at each layer's offset, and an
    engine-driven STORE puts the same bytes in the slots as CpuKVCache.wrap of the same
    views copied to the host."""
    import numpy as np

    from lmcache_mp import CpuKVCache
    from lmcache_mp.ipc.cuda import CudaKVCache, staging
    from lmcache_mp.session.engine_driven import copy_into_slots

    from .test_cuda_engine_driven import CHUNK, pool_and_slots

    torch = _torch_cuda()
    nl, nb, bs, nh, hd = 2, 12, 16, 4, 32
    n = 2 * nb * nh * bs * hd
    big = torch.randn(256 + nl * n, device="cuda").to(torch.float16)
    views = [big[256 + i * n: 256 + (i + 1) * n].view(2, nb, nh, bs, hd).permute(0, 1, 3, 2, 4)
             for i in range(nl)]
    cache = CudaKVCache.from_torch(views, layout="NHD")
    assert cache.kv_layout == "HND" and [e.offset for e in cache.exports][1] - \
        cache.exports[0].offset == n * 2
    cpu = CpuKVCache.wrap([v.cpu().numpy() for v in views], layout="NHD", block_size=bs)
    ids = np.array([3, 4, 9, 1, 2, 5, 7, 8][: 2 * CHUNK // bs], np.int64)
    got = []
    try:
        for c in (cache, cpu):
            pool, slots, buf = pool_and_slots(c.geometry, 2)
            copy_into_slots(c, ids, slots, [1, 0], pool, CHUNK)  # type: ignore[arg-type]
            got.append(buf.tobytes())
            if c is cache:
                staging.unpin(pool.view)
    finally:
        cache.close()
    assert got[0] == got[1] and any(got[0])


@needs_gpu
def test_default_stream_is_torchs_current_stream(cache: Any) -> None:
    torch = _torch_cuda()
    side = torch.cuda.Stream()  # torch's pool streams are cudaStreamNonBlocking
    with torch.cuda.stream(side):
        _, token = cache.begin_transfer(None)
    assert token.stream == side.cuda_stream != 0
    token.destroy()


@needs_gpu
def test_expandable_segments_export_as_vmm_and_round_trip_engine_driven() -> None:
    """PyTorch's expandable segments are CUDA VMM memory (cuMemCreate): from_torch
    exports them as a POSIX-fd VMM share (not a cudaIpcMemHandle_t, which cannot name
    them), which no released server opens, so the cache is engine-driven only; and an
    engine-driven round trip (the gather path: blocks -> a page-locked pool -> other
    blocks) moves every bit. In a child: the allocator setting must precede CUDA."""
    pytest.importorskip("torch")
    code = (
        "import mmap, numpy as np, torch\n"
        "from lmcache_mp.ipc.cuda import CudaKVCache, staging\n"
        "from lmcache_mp.protocol.types import PoolSlot\n"
        "from lmcache_mp.session.engine_driven import Pool, copy_from_slots, copy_into_slots\n"
        # 8 MiB: from the large pool, where expandable segments surely apply.
        "t = torch.zeros((2, 256, 8, 16, 64), dtype=torch.bfloat16, device='cuda')\n"
        "bits = t.view(torch.int16)\n"
        "bits.copy_(torch.randint(-32768, 32768, bits.shape, dtype=torch.int16, device='cuda'))\n"
        "cache = CudaKVCache.from_torch([t])\n"
        "kinds = sorted({e.vmm.kind if e.vmm else 'legacy' for e in cache.exports})\n"
        "print('EXPORT', kinds, cache.server_mappable)\n"
        "g, chunk = cache.geometry, 256\n"
        "shape = [2, 1, chunk, g.hidden_dim]\n"
        "nbytes = 2 * chunk * g.hidden_dim * 2\n"
        "m = mmap.mmap(-1, 3 * nbytes)\n"
        "buf = np.frombuffer(m, dtype=np.uint8)\n"
        "pool = Pool('vmm-test', len(buf), 0, buf)\n"
        "slots = [PoolSlot(offset=(1 - i) * nbytes, length=nbytes, shape=shape,\n"
        "                  dtype='bfloat16') for i in range(2)]\n"
        "src = np.arange(10, 42, dtype=np.int64)\n"
        "dst = np.array(list(range(100, 116)) + list(range(60, 76)), dtype=np.int64)\n"
        "copy_into_slots(cache, src, slots, [0, 1], pool, chunk)\n"
        "copy_from_slots(cache, dst, slots, pool, chunk, 0)\n"
        "torch.cuda.synchronize()\n"
        "same = torch.equal(bits[:, torch.as_tensor(src).cuda()], bits[:, torch.as_tensor(dst).cuda()])\n"
        "print('ROUNDTRIP', same, cache.gather_copier() is not None)\n"
        "staging.unpin(buf)\n"
        "cache.close()\n"
    )
    env = _child_env()
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "EXPORT ['posix_fd'] False" in lines, proc.stdout
    assert "ROUNDTRIP True True" in lines, proc.stdout


# ------------------------------------------- the gather path under CUDA's rules
def _gather_setup(layers: int = 8, blocks: int = 1024) -> tuple[Any, Any, Any]:
    """torch with CUDA, a CudaKVCache (HND, 8 heads of 128, bf16) of random bits, and
    the size of one chunk object of 256 tokens."""
    torch = _torch_cuda()
    from lmcache_mp.ipc.cuda import CudaKVCache

    cache = CudaKVCache.allocate(num_layers=layers, num_blocks=blocks, block_size=16,
                                 num_heads=8, head_dim=128, dtype="bfloat16")
    for t in cache.torch_layers:
        bits = t.view(torch.int16)
        bits.copy_(torch.randint(-32768, 32768, bits.shape, dtype=torch.int16, device="cuda"))
    torch.cuda.synchronize()
    return torch, cache, 2 * layers * 256 * 8 * 128 * 2


def _pool(nbytes: int) -> tuple[Any, Any]:
    import mmap

    import numpy as np

    from lmcache_mp.session.engine_driven import Pool

    buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    return Pool("gpu-live", nbytes, 0, buf), buf


@needs_gpu
def test_two_threads_on_two_streams_share_one_cache_on_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads, each on a torch stream of its own, STORE (then RETRIEVE) different
    blocks through one cache at the same time, 10 times over, with staging for two
    chunk objects (rounds through both regions, the copy stream, the events): every
    pool's bytes equal a one-thread run's, every retrieved block its source."""
    import threading

    import numpy as np

    from lmcache_mp.ipc.cuda import gather, staging
    from lmcache_mp.protocol.types import PoolSlot
    from lmcache_mp.session.engine_driven import copy_from_slots, copy_into_slots

    torch, cache, obj = _gather_setup()
    monkeypatch.setattr(gather, "STAGING_LIMIT_BYTES", 2 * obj)
    rng = np.random.default_rng(3)
    ids = rng.permutation(1024)[:4 * 16 * 4].astype(np.int64).reshape(4, -1)  # 4 sets
    shape = [2, 8, 256, 8 * 128]
    slots = [PoolSlot(offset=i * obj, length=obj, shape=shape, dtype="bfloat16")
             for i in range(4)]
    pools = [_pool(4 * obj) for _ in range(4)]
    try:
        refs = []
        for k in (0, 1):  # one thread, one after the other: the reference
            copy_into_slots(cache, ids[k], slots, [3, 1, 0, 2], pools[k][0], 256)
            refs.append(pools[k][1].tobytes())
        errors: list[BaseException] = []
        # Slot i of pool k holds chunk order[i] of set k; a RETRIEVE of set 2 + k from
        # it puts that chunk's blocks into chunk i's blocks of set 2 + k.
        order = [3, 1, 0, 2]
        sources = [torch.as_tensor(np.concatenate([ids[k][c * 16:(c + 1) * 16] for c in order]),
                                   device="cuda") for k in (0, 1)]
        targets = [torch.as_tensor(ids[2 + k], device="cuda") for k in (0, 1)]

        def worker(k: int, barrier: threading.Barrier) -> None:
            stream = torch.cuda.Stream()
            try:
                with torch.cuda.stream(stream):
                    for _ in range(10):
                        barrier.wait(30)
                        pools[2 + k][1][:] = 0
                        copy_into_slots(cache, ids[k], slots, order, pools[2 + k][0], 256)
                        assert pools[2 + k][1].tobytes() == refs[k], "store bytes differ"
                        # Back into the blocks of set 2 + k, from this thread's pool.
                        copy_from_slots(cache, ids[2 + k], slots, pools[k][0], 256, 0)
                        torch.cuda.current_stream().synchronize()
                        for t in cache.torch_layers:
                            b = t.view(torch.int16)
                            assert torch.equal(b[:, sources[k]], b[:, targets[k]]), \
                                "retrieved blocks differ"
            except BaseException as exc:
                errors.append(exc)

        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=worker, args=(k, barrier)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert cache.copy_path.startswith("gather")
    finally:
        for _, buf in pools:
            staging.unpin(buf)
        cache.close()


@needs_gpu
def test_twenty_replacements_of_a_cache_leak_no_device_memory() -> None:
    """vLLM's sleep / wake: the same memory wrapped in a new cache 20 times, a transfer
    through each, each dropped unclosed: torch's allocated device memory (the staging
    and index buffers come from its caching allocator) is what it was after the first."""
    import gc

    import numpy as np

    from lmcache_mp.ipc.cuda import CudaKVCache, staging
    from lmcache_mp.protocol.types import PoolSlot
    from lmcache_mp.session.engine_driven import copy_into_slots

    torch, first, obj = _gather_setup(blocks=256)
    layers = first.torch_layers
    pool, buf = _pool(2 * obj)
    slots = [PoolSlot(offset=i * obj, length=obj, shape=[2, 8, 256, 8 * 128],
                      dtype="bfloat16") for i in range(2)]
    ids = np.arange(32, dtype=np.int64)
    seen = []
    try:
        for _ in range(20):
            cache = CudaKVCache.from_torch(layers, layout="HND")
            copy_into_slots(cache, ids, slots, [0, 1], pool, 256)
            assert cache.copy_path.startswith("gather")
            del cache
            gc.collect()
            torch.cuda.synchronize()
            seen.append(torch.cuda.memory_allocated())
        assert seen == [seen[0]] * 20, seen
    finally:
        staging.unpin(buf)
        first.close()


def _chunk_objects(torch: Any, cache: Any, ids: Any, chunks: int) -> Any:
    """What the blocks of ``ids`` are as chunk objects of 256 tokens (HND layers
    ``[2, blocks, 8, 16, 128]`` -> ``[2, layers, 256, 8 * 128]``), as int16 bits."""
    out = []
    for c in range(chunks):
        blocks = torch.as_tensor(ids[c * 16:(c + 1) * 16], device="cuda")
        layers = [t.view(torch.int16)[:, blocks].permute(0, 1, 3, 2, 4).reshape(2, 256, 1024)
                  for t in cache.torch_layers]
        out.append(torch.stack(layers, dim=1))
    return torch.stack(out)


@needs_gpu
@pytest.mark.parametrize("direction", ["store", "retrieve"])
@pytest.mark.parametrize("freed_on, transfer_on", [
    ("current", "current"), ("side", "side"), ("current", "side")])
def test_fresh_staging_after_the_engine_freed_a_tensor_on_cuda(
        direction: str, freed_on: str, transfer_on: str) -> None:
    """What only a GPU shows of issue 35's review F1: the engine drops a tensor the size
    of the staging buffer on ``freed_on`` with a kernel still queued on it (a 50 ms
    sleep, then a fill of every byte), and a new cache's first transfer on
    ``transfer_on`` follows at once. torch hands that block to the next allocation on
    the same stream: the staging (asserted to be that block where the streams are the
    same). The stored objects / retrieved blocks must be the right bytes: with the
    RETRIEVE's first DMA unordered against the engine's stream (the code before the
    review fix), the late fill lands in staging after the DMA and the scatter copies
    0xEE into the blocks."""
    import numpy as np

    from lmcache_mp.ipc.cuda import staging
    from lmcache_mp.protocol.types import PoolSlot
    from lmcache_mp.session.engine_driven import copy_from_slots, copy_into_slots

    torch, cache, obj = _gather_setup()
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("this torch has no torch.cuda._sleep to hold a kernel on the stream")
    side = torch.cuda.Stream()
    streams = {"current": torch.cuda.current_stream(), "side": side}
    chunks = 4  # staging of 4 objects: two regions, the copy stream, the events
    ids = np.random.default_rng(5).permutation(1024)[:chunks * 16].astype(np.int64)
    slots = [PoolSlot(offset=i * obj, length=obj, shape=[2, 8, 256, 1024],
                      dtype="bfloat16") for i in range(chunks)]
    pool, buf = _pool(chunks * obj)
    try:
        if direction == "retrieve":
            buf[:] = np.random.default_rng(6).integers(0, 256, len(buf), dtype=np.uint8)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        with torch.cuda.stream(streams[freed_on]):
            engine = torch.empty(chunks * obj, dtype=torch.uint8, device="cuda")
            freed = engine.data_ptr()
            torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz
            engine.fill_(0xEE)
            del engine
        with torch.cuda.stream(streams[transfer_on]):
            if direction == "store":
                copy_into_slots(cache, ids, slots, list(range(chunks)), pool, 256)
            else:
                copy_from_slots(cache, ids, slots, pool, 256, 0)
        copier = cache.gather_copier()
        assert copier is not None and copier.staging_bytes == chunks * obj
        assert (copier._staging_ptr == freed) == (freed_on == transfer_on), \
            "torch handed the engine's block to the staging of its own stream only"
        torch.cuda.synchronize()
        objects = _chunk_objects(torch, cache, ids, chunks).cpu().numpy()
        assert objects.tobytes() == buf.view(np.int16).tobytes(), \
            f"{direction}: the bytes differ (the engine's late 0xEE fill reached them?)"
    finally:
        staging.unpin(buf)
        cache.close()


@needs_gpu
@pytest.mark.parametrize("direction", ["store", "retrieve"])
def test_the_rounds_overlap_on_cuda(direction: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35's review F2 on a GPU: 16 chunk objects (128 MiB) through staging of 4 (8
    rounds of 2), timed as the code does it (each region's reuse wait at the round
    that reuses it) and with the wait right after each round (the code before the fix:
    every round held behind the last). The overlapped transfer is not slower (a
    round's kernel is short beside its DMAs, so the gain is modest; the numbers are in
    the message when it fails)."""
    import time

    import numpy as np

    from lmcache_mp.ipc.cuda import gather, staging
    from lmcache_mp.protocol.types import PoolSlot
    from lmcache_mp.session.engine_driven import copy_from_slots, copy_into_slots

    torch, cache, obj = _gather_setup()
    monkeypatch.setattr(gather, "STAGING_LIMIT_BYTES", 4 * obj)
    chunks = 16
    ids = np.random.default_rng(7).permutation(1024)[:chunks * 16].astype(np.int64)
    slots = [PoolSlot(offset=i * obj, length=obj, shape=[2, 8, 256, 1024],
                      dtype="bfloat16") for i in range(chunks)]
    pool, buf = _pool(chunks * obj)
    caller = torch.cuda.current_stream().cuda_stream

    def transfer() -> None:
        if direction == "store":
            copy_into_slots(cache, ids, slots, list(range(chunks)), pool, 256)
        else:
            copy_from_slots(cache, ids, slots, pool, 256, 0)

    def best_of(reps: int = 7) -> float:
        took = []
        for _ in range(reps):
            t0 = time.perf_counter()
            transfer()
            took.append(time.perf_counter() - t0)
        return min(took)

    def serial_mark(self: Any, rounds: Any, r: int, kind: str, region: int,
                    stream: int) -> None:
        other = caller if stream == self._copy_stream else self._copy_stream
        self._hand_over(kind, region, stream, other)

    try:
        transfer()
        assert pool.pinning["cuda"].done.wait(60) and pool.pinning["cuda"].pinned
        overlapped = best_of()
        with monkeypatch.context() as m:
            m.setattr(gather.GatherCopier, "_mark", serial_mark)
            serial = best_of()
        overlapped = min(overlapped, best_of())
        assert overlapped <= 1.05 * serial, (
            f"{direction}: overlapped {overlapped * 1e3:.2f} ms, serial "
            f"{serial * 1e3:.2f} ms ({chunks * obj / overlapped / 1e9:.1f} GB/s vs "
            f"{chunks * obj / serial / 1e9:.1f})")
    finally:
        staging.unpin(buf)
        cache.close()
