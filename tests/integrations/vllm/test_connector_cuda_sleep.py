"""Sleep / wake with a CUDA KV cache, offline (the fake CUDA driver, a real Client
against the scripted fake server): vLLM releases the KV cache's memory
(``unregister_kv_caches``: WorkerSide.unregister) and maps new memory on wake-up
(``restore_kv_caches``: the connector wraps it in a new cache). The cache the worker
drops is closed then, so its device resources (the gather path's staging buffer, up to
LMCACHE_MP_STAGING_MB per cycle) do not pile up over the cycles."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lmcache_mp import Client
from lmcache_mp.integrations.vllm.config import ConnectorConfig, placement
from lmcache_mp.integrations.vllm.kv_caches import wrap_layers
from lmcache_mp.integrations.vllm.worker import WorkerSide
from tests.integrations.vllm import test_connector_cuda as base
from tests.support.fake_cuda import FakeDriver
from tests.support.fake_server import FakeServer

pytest.importorskip("torch")

BS, CHUNK, NH, C, L = base.BS, base.CHUNK, base.NH, base.C, base.L
server = base.server  # the scripted fake server, as the connector's CUDA tests use it
no_pins_left = base.no_pins_left


def test_sleep_closes_the_cache_and_twenty_cycles_leak_nothing(
        server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """20 sleep / wake cycles of an engine-driven (blocks-first) vLLM cache, a STORE
    through the gather path in each: at every sleep the dropped cache is closed and the
    fake's device allocations, pinned buffers, streams and events are back to vLLM's own.
    On 1470964 the worker never closed the cache it dropped."""
    monkeypatch.setenv("LMCACHE_MP_GPU_COPY", "gather")
    drv = FakeDriver()
    base.CurrentStream(monkeypatch).value = 0x71
    tensors = base.vllm_layers(drv, "BLHNC")
    shape = [L, CHUNK, NH * C]
    server.slot_geometry = {"shape": shape, "dtype": "float16",
                            "length": int(np.prod(shape)) * 2}
    client = Client(server.url, timeout=5.0, heartbeat_interval=None)
    w = WorkerSide(ConnectorConfig(), client, placement([server.url], 1, 0), "m")
    caches: list[Any] = []

    def register(instance_id: int | None) -> Any:
        caches.append(wrap_layers(tensors, BS, "auto", driver=drv))  # new memory on wake
        return client.register(caches[-1], model_name="m", mode="auto",
                               instance_id=instance_id, timeout=5.0)

    before = drv.live_resources()  # vLLM's own KV allocation
    w.set_registration(register, BS)
    seen = []
    for cycle in range(20):
        assert w.reg is not None and w.reg.mode == "engine"
        server.state.stored.clear()  # so that every cycle's STORE copies
        base.store(w)
        assert base.collect(w, {"r"}) == ({"r"}, set())
        assert caches[-1].copy_path.startswith("gather"), caches[-1].copy_path
        w.unregister()  # vLLM goes to sleep
        assert caches[-1].closed, f"cycle {cycle}: the dropped cache was not closed"
        seen.append(drv.live_resources())
        w.restore()  # and wakes up
    assert w.stats["stored"] == 20 and len(caches) == 21
    assert seen == [before] * 20
    assert not drv.races
    w.shutdown()
