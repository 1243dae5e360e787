"""The connector's worker side with CUDA KV caches, offline: fake CUDA tensors shaped and
strided exactly as vLLM 0.32's allocator makes them (``fixtures/vllm/kv_layouts.json``,
recorded from vLLM's own ``allocate_kv_cache`` by ``tools/gen_vllm_kv_layouts.py``:
4-D fused K/V views of one allocation in each layout vLLM resolves), and as vLLM 0.34's
extensible cache hands them over (``kv_layouts_extensible.json``: the committed views
of ``extend_kv_cache``, layer regions padded to the VMM granule), over the fake CUDA
driver, a real lmcache_mp Client against the scripted fake server.

What is checked: ``wrap_layers`` builds a CudaKVCache of vLLM's physical layout;
``mode="auto"`` registers a layer-compact cache LMCache-driven when CUDA IPC can share
it (the layout hint travels, each layer's shape and strides as LMCache's own
connector sends them) and engine-driven when it cannot (VMM memory) or when the layout
is blocks-first; engine-driven copies put each layer's (token, head) rows into the
chunk object ``[layers, chunk, heads * C]``, as LMCache's connector does; and the
ordering on torch's current stream: a STORE's event is recorded on the stream current
in ``wait_for_save`` (after the forward pass), a RETRIEVE's on the one current in
``start_load_kv``, and each reply's server event is waited on by that same stream when
``get_finished`` collects it, even if another stream is current by then."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmcache_mp import Client, InvalidArgument
from lmcache_mp.integrations.vllm.config import ConnectorConfig, placement
from lmcache_mp.integrations.vllm.kv_caches import registration_mode, wrap_layers
from lmcache_mp.integrations.vllm.ops import StepOps, TransferOp
from lmcache_mp.integrations.vllm.worker import WorkerSide
from lmcache_mp.ipc.cuda import IPC_HANDLE_SIZE, CudaKVCache, staging
from tests.integrations.vllm.test_connector_units import with_tokens
from tests.support.fake_cuda import FakeDriver, FakeTensor
from tests.support.fake_server import FakeServer

FIXTURES = Path(__file__).parents[3] / "fixtures" / "vllm"
LAYOUTS = {(x["layout"], x["mla"]): x for x in json.loads(
    (FIXTURES / "kv_layouts.json").read_text()) if x["geometry"] == "tiny"}
#: vLLM 0.34's extensible cache: the committed views extend_kv_cache registers
#: (tools/gen_vllm_kv_layouts.py --extensible: its own code over host memory).
EXTENSIBLE = {(x["layout"], x["mla"]): x for x in json.loads(
    (FIXTURES / "kv_layouts_extensible.json").read_text())}
_ATT = LAYOUTS[("LBHNC", False)]
CHUNK, BS, NB, NH, L = 256, _ATT["block_size"], _ATT["num_blocks"], _ATT["heads"], len(
    _ATT["layers"])
C = 2 * _ATT["head_size"]  # K and V packed in one row per (token, head)
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


def vllm_layers(drv: FakeDriver, layout: str = "LBHNC", kind: str = "malloc",
                mla: bool = False) -> list[FakeTensor]:
    """vLLM's per-layer KV views in ``layout``, as its allocator made them: one
    allocation, each layer at its offset with its strides (elements, float16)."""
    rec = LAYOUTS[(layout, mla)]
    base = drv.add_alloc(rec["alloc_bytes"], kind)
    return [FakeTensor(base + 2 * x["storage_offset"], tuple(x["shape"]), "torch.float16",
                       strides=tuple(x["stride"])) for x in rec["layers"]]


def extensible_layers(drv: FakeDriver, layout: str, mla: bool = False) -> list[FakeTensor]:
    """vLLM 0.34's committed views of its extensible cache in ``layout``: one VMM
    reservation, each layer in its own segment (padded to the granule: layer-compact
    layouts) or all in one (blocks-first), at the offsets vLLM computed; the granules
    vLLM committed are chunks created with no shareable handle type (the connector
    declares IN_PROCESS), the others reserved only."""
    rec = EXTENSIBLE[(layout, mla)]
    g = rec["granule"]
    granules = -(-rec["reservation_bytes"] // g)
    used = {i for x in rec["layers"] for i in range(
        x["offset_bytes"] // g, -(-(x["offset_bytes"] + x["storage_bytes"]) // g))}
    base = drv.vmm_reservation([g] * granules, holes=set(range(granules)) - used)
    return [FakeTensor(base + x["offset_bytes"] + 2 * x["storage_offset"], tuple(x["shape"]),
                       "torch.float16", strides=tuple(x["stride"])) for x in rec["layers"]]


def logical(drv: FakeDriver, tensors: list[FakeTensor]) -> list[np.ndarray]:
    """numpy views of the fake device memory with each tensor's shape and strides."""
    out = []
    for t in tensors:
        span = (sum((n - 1) * st for n, st in zip(t.shape, t.strides, strict=True)) + 1) * 2
        raw = drv._memory(t.ptr, span).view(np.uint16)
        out.append(np.lib.stride_tricks.as_strided(
            raw, t.shape, tuple(2 * st for st in t.strides), writeable=True))
    return out


def op(direction: str, rid: str = "r") -> TransferOp:
    return TransferOp(direction, rid, 0, CHUNK,
                      tuple(range(1, CHUNK // BS + 1)))


def worker_for(server: FakeServer, cache: Any, mode: str = "auto") -> WorkerSide:
    client = Client(server.url, timeout=5.0, heartbeat_interval=None)
    w = WorkerSide(ConnectorConfig(), client, placement([server.url], 1, 0), "m")
    w.set_registration(lambda _iid: client.register(cache, model_name="m", mode=mode,
                                                    timeout=5.0), BS)
    assert w.reg is not None
    return w


def store(w: WorkerSide) -> None:
    """wait_for_save's STORE of request "r", which then finishes: the scheduler holds
    it (the next step's ``held``), so the worker reports it once stored."""
    w.start_stores(with_tokens([op("STORE")], first=1))
    w.start_loads(StepOps(held=["r"]))


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


@pytest.mark.parametrize(("layout", "physical", "block_stride"), [
    ("LBHNC", "HND", 0), ("LBNHC", "NHD", 0), ("BLHNC", "HND", L * NH * BS * C),
    ("BLNHC", "NHD", L * NH * BS * C)])
def test_wrap_layers_makes_a_cuda_cache_in_the_physical_layout(
        layout: str, physical: str, block_stride: int) -> None:
    drv = FakeDriver()
    tensors = vllm_layers(drv, layout)
    cache = wrap_layers(tensors, BS, driver=drv)
    assert isinstance(cache, CudaKVCache) and cache.kv_layout == physical
    g = cache.geometry
    assert g.fused and not g.mla and g.kv_planes == 1 and g.block_stride == block_stride
    assert (g.num_layers, g.num_blocks, g.block_size, g.num_heads, g.head_dim) == (
        L, NB, BS, NH, C)
    assert cache.layer_ptrs == [t.ptr for t in tensors]
    if block_stride:
        # Blocks-first: only engine-driven transfers (auto picks them); no export.
        assert not cache.server_mappable
        with pytest.raises(InvalidArgument, match="blocks-first.*engine-driven only"):
            cache.export_layers()
        return
    assert cache.server_mappable
    # What the server maps: each layer's memory in its physical order, dense, as
    # LMCache's connector sends it (its wrapper permutes the view to its strides).
    (first, *_) = cache.export_layers()
    assert first.shape == ((NB, NH, BS, C) if physical == "HND" else (NB, BS, NH, C))
    assert first.stride == (NH * BS * C, *((BS * C, C, 1) if physical == "HND"
                                           else (NH * C, C, 1)))
    assert [e.offset for e in cache.exports] == [t.ptr - tensors[0].ptr for t in tensors]


def test_wrap_layers_refuses_what_it_cannot_map() -> None:
    drv = FakeDriver()
    (t, *_) = vllm_layers(drv)
    # The pre-0.32 5-D form, devices other than CPU / CUDA, CPU tensors in
    # LMCache-driven mode, and kernel blocks smaller than the scheduler's, by name.
    with pytest.raises(InvalidArgument, match="4-D"):
        wrap_layers([FakeTensor(t.ptr, (2, NB, BS, NH, C // 2))], BS, driver=drv)
    with pytest.raises(InvalidArgument, match="CPU or CUDA KV caches only"):
        wrap_layers([FakeTensor(1, t.shape, kind="xpu")], BS, driver=drv)
    with pytest.raises(InvalidArgument, match="'lmcache_driven' needs memory"):
        wrap_layers([FakeTensor(1, t.shape, kind="cpu")], BS, "lmcache")
    with pytest.raises(InvalidArgument, match="--block-size 16"):
        wrap_layers([t], 2 * BS, driver=drv)
    # Strides no vLLM layout has (a gap after every row) are refused, naming them.
    with pytest.raises(InvalidArgument, match="strides"):
        wrap_layers([FakeTensor(t.ptr, t.shape, contiguous=False)], BS, driver=drv)


def test_lmcache_driven_transfers_are_ordered_on_the_current_stream(
        server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    drv = FakeDriver()
    current = CurrentStream(monkeypatch)
    w = worker_for(server, wrap_layers(vllm_layers(drv, "LBNHC"), BS, driver=drv))
    assert w.reg.mode == "lmcache"
    register = server.requests("REGISTER_KV_CACHE")[0].payloads
    assert register[5] == {"kv_layout": "NHD"}  # the physical layout, as a hint

    # wait_for_save: the forward pass was queued on stream 0x51.
    current.value = 0x51
    store(w)
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
    w.start_loads(with_tokens([op("RETRIEVE", "q")], first=1))
    current.value = 0x98
    assert collect(w, set()) == (set(), {"q"})
    assert [c for c in drv.calls if c[0] == "wait"][-1] == ("wait", 0x61, SERVER_EVENT)
    assert w.load_errors() == set() and w.stats["retrieved"] == 1
    w.shutdown()


@pytest.mark.parametrize(("layout", "kind"), [
    ("LBHNC", "vmm"), ("LBNHC", "vmm"), ("BLHNC", "malloc"), ("BLNHC", "malloc"),
    ("LBHNC", "extensible"), ("LBNHC", "extensible"), ("BLHNC", "extensible"),
    ("BLNHC", "extensible")])
def test_engine_driven_copies_write_lmcaches_objects(
        server: FakeServer, monkeypatch: pytest.MonkeyPatch, layout: str, kind: str) -> None:
    """VMM memory (vLLM's cumem allocator, expandable segments, vLLM 0.34's extensible
    cache: its committed views, layer regions padded apart) and blocks-first layouts:
    'auto' registers them engine-driven (under 0.34 the connector asks for it:
    kv_caches.registration_mode); the copies run on the current stream, synchronised
    before the COMMIT, and put each (token, head) row of vLLM's views into the chunk
    object [layers, chunk, heads * C] (LMCache's connector's object); a RETRIEVE puts
    them back."""
    drv = FakeDriver()
    current = CurrentStream(monkeypatch)
    if kind == "extensible":
        tensors = extensible_layers(drv, layout)
        rec = EXTENSIBLE[(layout, False)]
        if not layout.startswith("BL"):  # the regions vLLM padded to the 2 MiB granule
            gap = rec["layers"][1]["offset_bytes"] - rec["layers"][0]["offset_bytes"]
            assert gap % rec["granule"] == 0 and gap > rec["layers"][0]["storage_bytes"]
        mode = registration_mode("auto", "cuda", declared=True)
    else:
        tensors, mode = vllm_layers(drv, layout, kind), "auto"
    cache = wrap_layers(tensors, BS, mode, driver=drv)
    g = cache.geometry
    shape = [L, CHUNK, NH * C]
    server.slot_geometry = {"shape": shape, "dtype": g.dtype,
                            "length": int(np.prod(shape)) * g.itemsize}
    w = worker_for(server, cache, mode)
    assert w.reg.mode == "engine"
    views = logical(drv, tensors)
    rng = np.random.default_rng(1)
    for v in views:
        v[...] = rng.integers(0, 2**16, v.shape, dtype=np.uint16)
    current.value = 0x71
    store(w)
    assert collect(w, {"r"}) == ({"r"}, set()) and w.stats["stored"] == 1
    copies = [c for c in drv.calls if c[0] in ("memcpy2d", "memcpy3d")]
    assert copies and {c[-1] for c in copies} == {0x71}
    assert ("stream_sync", 0x71) in drv.calls
    pool = server.pool_bytes()[: server.slot_geometry["length"]].view(np.uint16).reshape(shape)
    ids = np.arange(1, CHUNK // BS + 1)
    want = [v[ids].transpose(0, 2, 1, 3).reshape(CHUNK, NH * C) for v in views]
    for layer in range(L):  # tokens in block order, each token's heads' rows in order
        assert pool[layer].tobytes() == want[layer].tobytes()
    before = [v.copy() for v in views]
    for v in views:
        v[ids] = 0
    w.start_loads(with_tokens([op("RETRIEVE", "q")], first=1))
    assert collect(w, set()) == (set(), {"q"}) and w.load_errors() == set()
    for v, b in zip(views, before, strict=True):
        assert np.array_equal(v, b)  # the retrieved blocks, and nothing else touched
    w.shutdown()


def test_wrap_layers_mla_cuda_registers_and_stores(server: FakeServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSeek-style MLA layers as vLLM 0.32 allocates them: [num_blocks, 1,
    # block_size, kv_lora_rank + rope dim] views of one allocation; wrapped in place as
    # an MLA CudaKVCache (one latent plane).
    CurrentStream(monkeypatch)
    drv = FakeDriver()
    layers = vllm_layers(drv, "LBNHC", mla=True)
    rec = LAYOUTS[("LBNHC", True)]
    cache = wrap_layers(layers, BS, driver=drv, mla=True)
    assert isinstance(cache, CudaKVCache) and cache.geometry.mla
    g = cache.geometry
    assert (g.num_layers, g.num_blocks, g.block_size, g.num_heads, g.head_dim) == (
        L, NB, BS, 1, rec["head_size"])
    with pytest.raises(InvalidArgument, match="should have one head"):
        wrap_layers(vllm_layers(drv), BS, driver=drv, mla=True)
    w = worker_for(server, cache)
    store(w)
    assert collect(w, {"r"}) == ({"r"}, set()) and w.stats["stored"] == 1
    w.shutdown()
