"""Issue 12, leaks: 1000 cycles against a real server leave nothing behind, here or on
the server; a SIGKILLed client's shared memory is swept by the next client.

Run once, against 0.5.3 (CI runs the suite against every release: this is slow and
tests the client, not the release). The server keeps every SHM cache it ever mapped
(LMCache's behaviour, also with its own client), so the cycles use one-layer caches,
most of them engine-driven (the server maps nothing of ours then) and part of them
re-use one registration; the server's growth per LMCache-driven registration is
measured and asserted exactly.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from lmcache_mp import Client, CpuKVCache, Registration
from lmcache_mp.ipc.shm import SCOPE_ENV, SHM_DIR

from ..conftest import SERVER_VERSION, LiveServer, start_server
from ..support.live_helpers import both_modes_args, lookup_all, our_segments

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(SERVER_VERSION != "0.5.3", reason="slow: run once, against 0.5.3"),
]
CHUNK = 256
SRC = list(range(1, 17))  # one chunk of 16-token blocks
DST = list(range(17, 33))
CYCLES_LMCACHE = 100  # full cycles, LMCache-driven: the server maps each new cache
CYCLES_ENGINE = 600  # full cycles, engine-driven: the server maps nothing of ours
CYCLES_REUSED = 300  # request cycles on one long-lived registration
# Bounds on this process after warm-up (the first 50 cycles): threads and fds must
# come back exactly; RSS may move by allocator noise only.
RSS_BOUND_MIB = 16


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    s = start_server(*both_modes_args(f"leak{os.getpid()}"))
    yield s
    s.stop()


def new_cache() -> CpuKVCache:
    return CpuKVCache.allocate(num_layers=1, num_blocks=33, block_size=16, num_heads=1,
                               head_dim=8, dtype="bfloat16")


def fill(kv: CpuKVCache, seed: int) -> bytes:
    """Random bytes in blocks SRC (seeded: the final check regenerates them)."""
    data = np.random.default_rng(seed).integers(0, 256, (2, len(SRC), 1, 16, 8 * 2),
                                                dtype=np.uint8)
    kv.layers[0].view(np.uint8)[:, SRC[0]:SRC[-1] + 1] = data
    return data.tobytes()


def prompt(seed: int) -> list[int]:
    return np.random.default_rng(10_000 + seed).integers(0, 2**31, CHUNK).tolist()


def cycle_requests(reg: Registration, seed: int) -> None:
    """store / lookup / retrieve / free locks / end session, for one prompt."""
    kv = reg.cache
    assert isinstance(kv, CpuKVCache)
    expect = fill(kv, seed)
    tokens = prompt(seed)
    with reg.request(tokens) as writer:
        assert writer.store(SRC) is True
    with lookup_all(reg, tokens) as reader:  # LOOKUP (read locks) + RETRIEVE
        assert reader.retrieve(DST) is True
        assert kv.layers[0].view(np.uint8)[:, DST[0]:DST[-1] + 1].tobytes() == expect
        assert reader.held_locks == 0
    with reg.request(tokens) as idle:  # a lookup never retrieved: freed on exit
        assert idle.lookup() == CHUNK and idle.held_locks == 1
    assert idle.held_locks == 0


def process_state() -> tuple[int, int, int, int]:
    gc.collect()
    rss_kib = next(int(line.split()[1]) for line in open("/proc/self/status")
                   if line.startswith("VmRSS"))
    return (threading.active_count(), len(os.listdir("/proc/self/task")),
            len(os.listdir("/proc/self/fd")), rss_kib)


def server_state(server: LiveServer) -> tuple[int, int]:
    """(open fds, mappings) of our segments in the server process. Only those: its TCP
    sockets close asynchronously after a client leaves, so its total fd count moves."""
    pid = server.pid
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += "/dev/shm/lmcache_mp_" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass  # closed meanwhile
    maps = open(f"/proc/{pid}/maps").read().splitlines()
    return fds, sum("lmcache_mp_" in m for m in maps)


def test_a_thousand_cycles_leave_nothing_behind(server: LiveServer) -> None:
    segments_before = our_segments()
    start = time.monotonic()
    warm: tuple[int, int, int, int] | None = None
    growth: list[tuple[int, int]] = []
    seeds: list[int] = []

    def full_cycle(i: int, mode: str) -> None:
        with Client(server.url, timeout=5.0) as c, new_cache() as kv:
            reg = c.register(kv, model_name="leaks", mode=mode)
            assert reg.mode == mode
            cycle_requests(reg, i)
            reg.unregister()  # also unlinks the cache's SHM names
        seeds.append(i)

    i = 0
    for _ in range(CYCLES_LMCACHE):
        before = server_state(server)
        full_cycle(i, "lmcache")
        after = server_state(server)
        growth.append((after[0] - before[0], after[1] - before[1]))
        i += 1
        if i == 50:
            warm = process_state()
    for _ in range(CYCLES_ENGINE):
        before = server_state(server)
        full_cycle(i, "engine")
        assert server_state(server) == before  # engine-driven: the server maps nothing
        i += 1
    with Client(server.url, timeout=5.0) as c, new_cache() as kv:
        reg = c.register(kv, model_name="leaks", mode="lmcache")
        for _ in range(CYCLES_REUSED):
            cycle_requests(reg, i)
            seeds.append(i)
            i += 1
        reg.unregister()
    elapsed = time.monotonic() - start
    end = process_state()
    assert warm is not None
    print(f"\n{i} cycles in {elapsed:.1f} s; this process (threads, tasks, fds, RSS KiB) "
          f"after 50: {warm}, after {i}: {end}; server growth per LMCache-driven "
          f"1-layer registration (SHM fds, mappings): {sorted(set(growth))}, in all "
          f"{server_state(server)} after {CYCLES_LMCACHE + 1} such registrations")
    assert i == 1000
    # Nothing of ours in /dev/shm; no thread or fd left; RSS flat.
    assert our_segments() == segments_before
    assert end[:3] == warm[:3], (warm, end)
    assert end[3] - warm[3] < RSS_BOUND_MIB * 1024, (warm, end)
    # The server keeps each mapped cache: 2 fds and 2 mappings per layer, never
    # released after UNREGISTER.
    assert all(g == (2, 2) for g in growth), growth

    # No lock held and every object intact: a new registration's LOOKUP + RETRIEVE of
    # every key stored above succeeds, byte for byte.
    with Client(server.url, timeout=5.0) as c, new_cache() as kv:
        reg = c.register(kv, model_name="leaks", mode="engine")
        for seed in seeds:
            expect = fill(kv, seed)
            kv.layers[0][:, DST] = 0
            with reg.request(prompt(seed)) as reader:
                assert reader.lookup() == CHUNK, f"key {seed} is gone or locked"
                assert reader.retrieve(DST) is True
            assert kv.layers[0].view(np.uint8)[:, DST[0]:DST[-1] + 1].tobytes() == expect
        reg.unregister()
    assert "Traceback" not in server.log
    assert our_segments() == segments_before


_KILLED_CLIENT = """
import sys, time
from lmcache_mp import Client, CpuKVCache
kv = CpuKVCache.allocate(num_layers=2, num_blocks=33, block_size=16, num_heads=1, head_dim=8)
c = Client(sys.argv[1])
reg = c.register(kv, model_name="killed", mode="lmcache")
with reg.request(list(range(256))) as req:
    assert req.store(list(range(1, 17)))
print(" ".join(n[1:] for n in kv.segment_names), flush=True)
time.sleep(120)
"""


def test_a_sigkilled_registered_client_leaves_nothing_after_the_next_ones_sweep(
        server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # A sweep scope of this test's own (the child inherits it): another pytest job's
    # allocation would otherwise sweep the killed child's segments before they are
    # asserted on (issue 37).
    scope = f"leaks{os.getpid()}"
    monkeypatch.setenv(SCOPE_ENV, scope)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, server.url],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    names = child.stdout.readline().split()
    assert len(names) == 2
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    paths = [os.path.join(SHM_DIR, n) for n in names]
    assert all(os.path.exists(p) for p in paths)  # SIGKILL unlinks nothing
    # The server still maps them (until it reaps the registration, and LMCache keeps
    # the mapping even then): removing the names is what frees the memory eventually.
    maps = open(f"/proc/{server.pid}/maps").read()
    assert all(n in maps for n in names)
    with Client(server.url, timeout=5.0) as c, new_cache() as kv:  # the next client
        assert not any(os.path.exists(p) for p in paths)
        reg = c.register(kv, model_name="leaks", mode="lmcache")
        cycle_requests(reg, 4242)
        reg.unregister()
    assert not any(n.startswith(f"lmcache_mp_{scope}.{child.pid}_") for n in os.listdir(SHM_DIR))
