"""The connector's worker side with CUDA KV caches, offline: fake CUDA tensors as vLLM
hands them (logical NHD, HND memory as a permuted view, views into one allocation) over
the fake CUDA driver, a real lmcache_mp Client against the scripted fake server.

What is checked: ``wrap_layers`` builds a CudaKVCache with the physical layout;
``mode="auto"`` registers it LMCache-driven when CUDA IPC can share it (the layout hint
travels) and engine-driven when it cannot (VMM memory); and the ordering on torch's
current stream: a STORE's event is recorded on the stream current in ``wait_for_save``
(after the forward pass), a RETRIEVE's on the one current in ``start_load_kv``, and
each reply's server event is waited on by that same stream when ``get_finished``
collects it, even if another stream is current by then."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lmcache_mp import Client, InvalidArgument
from lmcache_mp.integrations.vllm.config import ConnectorConfig, placement
from lmcache_mp.integrations.vllm.kv_caches import wrap_layers
from lmcache_mp.integrations.vllm.ops import StepOps, TransferOp
from lmcache_mp.integrations.vllm.worker import WorkerSide
from lmcache_mp.ipc.cuda import IPC_HANDLE_SIZE, CudaKVCache, staging

from ..fake_cuda import FakeDriver, FakeTensor
from ..fake_server import FakeServer

CHUNK, BS, NB, NH, HD, L = 256, 16, 40, 2, 8, 2
SERVER_EVENT = b"S" + b"\x07" * (IPC_HANDLE_SIZE - 1)


class CurrentStream:
    """torch.cuda's current stream, as the test sets it (torch with CUDA "initialised")."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        self.value = 0
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda device=None: type("S", (), {"cuda_stream": self.value})())


@pytest.fixture
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    s.hooks["STORE"] = lambda payloads: [SERVER_EVENT, True]
    s.hooks["RETRIEVE"] = lambda payloads: [SERVER_EVENT, True]
    yield s
    s.close()


@pytest.fixture(autouse=True)
def no_pins_left() -> Iterator[None]:
    yield
    for address in list(staging.pinned_pools()):
        staging._pinned.pop(address, None)


def vllm_layers(drv: FakeDriver, kind: str = "malloc") -> list[FakeTensor]:
    """vLLM's per-layer tensors of an HND attention backend: logical NHD [2, NB, BS, NH,
    HD] views (permuted, non-contiguous) of HND memory, all in one allocation."""
    nbytes = 2 * NB * NH * BS * HD * 2
    base = drv.add_alloc(L * nbytes + 4096, kind)
    hnd = (NB * NH * BS * HD, NH * BS * HD, BS * HD, HD, 1)  # [2, NB, NH, BS, HD] dense
    nhd_view = (hnd[0], hnd[1], hnd[3], hnd[2], hnd[4])
    return [FakeTensor(base + 4096 + i * nbytes, (2, NB, BS, NH, HD), strides=nhd_view)
            for i in range(L)]


def op(direction: str, rid: str = "r") -> TransferOp:
    return TransferOp(direction, rid, tuple(range(1, CHUNK + 1)), 0, CHUNK,
                      tuple(range(1, CHUNK // BS + 1)))


def worker_for(server: FakeServer, cache: Any) -> WorkerSide:
    client = Client(server.url, timeout=5.0, heartbeat_interval=None)
    w = WorkerSide(ConnectorConfig(), client, placement([server.url], 1, 0), "m")
    w.set_registration(lambda: client.register(cache, model_name="m", mode="auto",
                                               timeout=5.0), BS)
    assert w.reg is not None
    return w


def collect(w: WorkerSide, finished: set[str]) -> tuple[set[str], set[str]]:
    """get_finished until something is reported (it only polls; the fake server replies
    on its own thread)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        sending, recving = w.get_finished(finished)
        if sending or recving:
            return sending, recving
        time.sleep(0.01)
    raise AssertionError("no transfer finished")


def test_wrap_layers_makes_a_cuda_cache_in_the_physical_layout() -> None:
    drv = FakeDriver()
    cache = wrap_layers(vllm_layers(drv), BS, driver=drv)
    assert isinstance(cache, CudaKVCache) and cache.kv_layout == "HND"
    g = cache.geometry
    assert (g.num_layers, g.num_blocks, g.block_size, g.num_heads, g.head_dim) == (
        L, NB, BS, NH, HD)
    assert [e.offset for e in cache.exports] == [4096, 4096 + g.layer_nbytes]
    dense_nhd = [FakeTensor(t.ptr, (2, NB, BS, NH, HD)) for t in vllm_layers(drv)]
    assert wrap_layers(dense_nhd, BS, driver=drv).kv_layout == "NHD"  # type: ignore[attr-defined]
    # Blocks-first layers (FlashInfer) are refused, naming a backend that works.
    with pytest.raises(InvalidArgument, match="blocks-first.*FLASH_ATTN"):
        wrap_layers([FakeTensor(1, (NB, 2, BS, NH, HD))], BS, driver=drv)
    # Devices other than CPU / CUDA, and CPU tensors in LMCache-driven mode, are refused.
    with pytest.raises(InvalidArgument, match="CPU or CUDA KV caches only"):
        wrap_layers([FakeTensor(1, (2, NB, BS, NH, HD), kind="xpu")], BS, driver=drv)
    with pytest.raises(InvalidArgument, match="'lmcache_driven' needs memory"):
        wrap_layers([FakeTensor(1, (2, NB, BS, NH, HD), kind="cpu")], BS, "lmcache")


def test_lmcache_driven_transfers_are_ordered_on_the_current_stream(
        server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    drv = FakeDriver()
    current = CurrentStream(monkeypatch)
    w = worker_for(server, wrap_layers(vllm_layers(drv), BS, driver=drv))
    assert w.reg.mode == "lmcache"
    register = server.requests("REGISTER_KV_CACHE")[0].payloads
    assert register[5] == {"kv_layout": "HND"}  # the physical layout, as a hint

    # wait_for_save: the forward pass was queued on stream 0x51.
    current.value = 0x51
    w.start_stores(StepOps([op("STORE")]))
    ours = [e for e in drv.events.values() if e.get("kind") == "ours"]
    assert [e["recorded_on"] for e in ours] == [0x51]
    current.value = 0x99  # something else is current when the reply is collected
    assert collect(w, {"r"}) == ({"r"}, set())
    sent_event = server.requests("STORE")[0].payloads[3]  # the server waits for it
    assert sent_event == drv.ipc_get_event_handle(next(
        k for k, e in drv.events.items() if e.get("kind") == "ours"))
    waits = [c for c in drv.calls if c[0] == "wait"]
    assert waits == [("wait", 0x51, SERVER_EVENT)]

    # start_load_kv on stream 0x61; the reply makes 0x61 wait for the server's copy.
    current.value = 0x61
    w.start_loads(StepOps([op("RETRIEVE", "q")]))
    current.value = 0x98
    assert collect(w, set()) == (set(), {"q"})
    assert [c for c in drv.calls if c[0] == "wait"][-1] == ("wait", 0x61, SERVER_EVENT)
    assert w.load_errors() == set() and w.stats["retrieved"] == 1
    w.shutdown()


def test_memory_cuda_ipc_cannot_share_goes_engine_driven(
        server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """VMM memory (vLLM's cumem allocator, expandable segments): 'auto' registers it
    engine-driven; the copies run on the current stream, synchronised before the
    COMMIT, and put the logical NHD view's blocks into the pool's chunk objects."""
    drv = FakeDriver()
    current = CurrentStream(monkeypatch)
    tensors = vllm_layers(drv, kind="vmm")
    cache = wrap_layers(tensors, BS, driver=drv)
    g = cache.geometry
    shape = [2, L, CHUNK, NH * HD]
    server.slot_geometry = {"shape": shape, "dtype": g.dtype,
                            "length": int(np.prod(shape)) * g.itemsize}
    w = worker_for(server, cache)
    assert w.reg.mode == "engine"
    layers = []
    rng = np.random.default_rng(1)
    for t in tensors:
        raw = drv._memory(t.ptr, g.layer_nbytes)
        raw[:] = rng.integers(0, 256, len(raw), dtype=np.uint8)
        # The logical NHD view vLLM reads: [2, NB, BS, NH, HD].
        layers.append(raw.view(np.uint16).reshape(2, NB, NH, BS, HD).transpose(0, 1, 3, 2, 4))
    current.value = 0x71
    w.start_stores(StepOps([op("STORE")]))
    assert collect(w, {"r"}) == ({"r"}, set()) and w.stats["stored"] == 1
    copies = [c for c in drv.calls if c[0] in ("memcpy2d", "memcpy3d")]
    assert copies and {c[-1] for c in copies} == {0x71}
    assert ("stream_sync", 0x71) in drv.calls
    pool = server.pool_bytes()[: server.slot_geometry["length"]].view(np.uint16).reshape(shape)
    ids = np.arange(1, CHUNK // BS + 1)
    for kv in range(2):
        for layer in range(L):
            want = layers[layer][kv][ids].reshape(CHUNK, NH * HD)  # tokens in block order
            assert pool[kv, layer].tobytes() == want.tobytes()
    w.shutdown()


def test_wrap_layers_mla_cuda_registers_and_stores(server: FakeServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSeek-style MLA layers: [num_blocks, block_size, kv_lora_rank + rope dim], views
    # into one allocation; wrapped in place as an MLA CudaKVCache (one latent plane).
    CurrentStream(monkeypatch)
    drv = FakeDriver()
    head = 24
    nbytes = NB * BS * head * 2
    base = drv.add_alloc(L * nbytes, "malloc")
    layers = [FakeTensor(base + i * nbytes, (NB, BS, head)) for i in range(L)]
    cache = wrap_layers(layers, BS, driver=drv, mla=True)
    assert isinstance(cache, CudaKVCache) and cache.geometry.mla
    g = cache.geometry
    assert (g.num_layers, g.num_blocks, g.block_size, g.num_heads, g.head_dim) == (
        L, NB, BS, 1, head)
    with pytest.raises(InvalidArgument, match="MLA model's per-layer KV tensors"):
        wrap_layers(vllm_layers(drv), BS, driver=drv, mla=True)
    with pytest.raises(InvalidArgument, match="does not say use_mla"):
        wrap_layers(layers, BS, driver=drv)
    w = worker_for(server, cache)
    w.start_stores(StepOps([op("STORE")]))
    assert collect(w, {"r"}) == ({"r"}, set()) and w.stats["stored"] == 1
    w.shutdown()
