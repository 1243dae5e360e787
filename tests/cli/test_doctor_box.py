"""``lmcache-mp doctor`` on co-located boxes (lmcache_mp.cli.host_facts): every fact through
the fake CUDA driver (a GB10-like integrated GPU, a discrete one, a Tegra-like one
without CUDA IPC), the recommendation made from them, and the CPU-visible parts (the
SHM round trip, /dev/shm, namespaces) against a real server."""

from __future__ import annotations

import os

import pytest

from lmcache_mp.cli import main as cli_main
from lmcache_mp.cli.doctor import run_doctor
from lmcache_mp.cli.host_facts import GIB, HEADROOM, Box, recommend, server_pid

from ..conftest import LiveServer
from ..support.fake_cuda import FakeDriver


def rows_of(drv: FakeDriver, url: str | None = None, fraction: float = 0.9,
            box: Box | None = None) -> dict[str, tuple[str, bool]]:
    return {n: (r, ok) for n, r, ok in run_doctor(url, 2.0, driver=drv, engine_fraction=fraction,
                                                 box=box)}


def test_gb10_like_box_is_integrated_with_pageable_access() -> None:
    box = Box()
    rows = rows_of(FakeDriver().gb10(), box=box)
    mem = rows["GPU 0 memory"][0]
    assert mem.startswith("integrated: GPU and CPU share one memory pool")
    assert "compute capability 12.1 (sm_121)" in mem
    assert rows["GPU 0 pageable access"][0] == (
        "yes: the GPU reads pageable host memory through the host page tables")
    assert rows["GPU 0 free memory"][0].startswith("100.0 GiB of 128.0 GiB (cudaMemGetInfo; "
                                                   "the whole unified pool)")
    assert box.integrated and box.pageable_access and box.ipc_memory
    assert (box.gpu_free, box.gpu_total) == (100 << 30, 128 << 30)


def test_discrete_box() -> None:
    box = Box()
    rows = rows_of(FakeDriver(), box=box)
    assert rows["GPU 0 memory"][0].startswith("discrete: GPU memory of its own; compute "
                                              "capability 9.0 (sm_90)")
    assert rows["GPU 0 pageable access"][0].startswith("no: host memory must be page-locked")
    assert rows["GPU 0 free memory"][0] == "512.0 MiB of 1.0 GiB (cudaMemGetInfo)"
    assert box.integrated is False and "host memory available" in rows


def test_tegra_like_box_recommends_engine_driven() -> None:
    drv = FakeDriver().gb10()
    drv.ipc_supported = False
    box = Box()
    rows = rows_of(drv, box=box)
    assert not rows["IPC memory handle (device 0)"][1] and box.ipc_memory is False
    assert rows["recommended mode"][0].startswith("mode='engine' for GPU caches: CUDA IPC "
                                                  "is not available")


def test_bindings_without_the_attributes_say_unknown() -> None:
    drv = FakeDriver()
    drv.attributes = {}
    rows = rows_of(drv)
    assert rows["GPU 0 memory"][0].startswith("unknown; compute capability")
    assert rows["GPU 0 pageable access"][0].startswith("unknown")


def test_shm_and_memlock_facts() -> None:
    box = Box()
    rows = rows_of(FakeDriver(), box=box)
    st = os.statvfs("/dev/shm")
    assert box.shm_size == st.f_frsize * st.f_blocks
    assert rows["/dev/shm"][0].startswith("size ") and "page-lock limit" in rows


def test_l1_advice_on_unified_memory() -> None:
    box = Box(cuda=True, integrated=True, gpu_total=128 * GIB, shm_free=120 * GIB,
              ipc_memory=True)
    advice = dict((n, r) for n, r, _ in recommend(box, 0.6))["recommended L1 size"]
    # 128 - 0.6 * 128 - 8 = 43.2 GiB
    assert advice.startswith("--l1-size-gb 43 at most: unified memory of 128.0 GiB minus the "
                             "engine's 60% (76.8 GiB")
    assert "--no-l1-use-lazy" in advice
    box.shm_free = 20 * GIB  # /dev/shm is the tighter limit
    assert dict((n, r) for n, r, _ in recommend(box, 0.6))["recommended L1 size"].startswith(
        "--l1-size-gb 20 at most")
    tight = dict((n, r) for n, r, _ in recommend(box, 0.95))["recommended L1 size"]
    assert "leaves no room for an L1" in tight and HEADROOM == 8 * GIB


def test_modes_follow_the_facts() -> None:
    def modes(box: Box) -> tuple[str, bool]:
        return next((r, ok) for n, r, ok in recommend(box, 0.9) if n == "transfer modes")

    shared = Box(cuda=True, ipc_memory=True, server=True, pool_shared=True, same_ipc_ns=True)
    text, ok = modes(shared)
    assert ok and text.startswith("engine-driven (CPU caches; GPU caches of any allocator")
    assert "LMCache-driven for GPU caches from cudaMalloc" in text
    other_ns = Box(cuda=True, ipc_memory=True, server=True, pool_shared=True, same_ipc_ns=False)
    assert "cudaMalloc" not in modes(other_ns)[0]
    nothing = Box(cuda=True, ipc_memory=True, server=True, pool_shared=False, same_ipc_ns=False)
    text, ok = modes(nothing)
    assert not ok and text.startswith("none verified")
    assert not any(n == "transfer modes" for n, _, _ in recommend(Box(), 0.9))  # no server


def test_cli_doctor_takes_a_positional_url(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli_main(["doctor", f"tcp://127.0.0.1:{port}", "--timeout", "0.3"]) == 1
    assert "did not answer" in capsys.readouterr().out


# ----------------------------------------------------------------- live
@pytest.mark.live
def test_live_doctor_sees_the_shared_pool_and_namespace(live_server: LiveServer) -> None:
    box = Box()
    rows = rows_of(FakeDriver().gb10(), live_server.url, fraction=0.6, box=box)
    shared, ok = rows["/dev/shm shared with the server"]
    assert ok and shared.startswith("yes: its L1 pool 'lmcache_l1_pool_test")
    assert box.pool_shared and box.pool_size and box.pool_size > 0
    # Same host, same namespaces: the server's process is visible and shares ours.
    assert server_pid(live_server.url) == live_server.pid
    assert rows["IPC namespace"][0].startswith("shared with the server") and box.same_ipc_ns
    assert rows["transfer modes"][1] and "engine-driven" in rows["transfer modes"][0]
    assert rows["recommended L1 size"][0].startswith("--l1-size-gb ")


@pytest.mark.live
def test_live_doctor_without_a_pool(private_server: LiveServer) -> None:
    """A default server (0.5.4+: LMCache-driven only; 0.5.3: no --shm-name) offers no
    pool here: the round trip falls back to the server mapping our CPU cache."""
    box = Box()
    rows = rows_of(FakeDriver(), private_server.url, box=box)
    shared, ok = rows["/dev/shm shared with the server"]
    assert ok, rows
    if box.pool_shared:  # 0.5.3 names a pool by default on CPU hosts
        assert shared.startswith("yes: its L1 pool")
    else:
        assert shared.startswith("yes: it mapped a CPU cache of this process")
        assert box.server_maps_ours
