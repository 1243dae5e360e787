"""A registration an engine can run for days, against real servers: reaping after
silence, SIGKILL and restart under traffic, recovered without the application acting."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from lmcache_mp import Client, CpuKVCache, Registration, RequestTimeout, ServerUnavailable, ServerUnresponsive

from ..conftest import SERVER_VERSION, LiveServer, start_server
from ..support.live_helpers import both_modes_args, fill_random, our_segments, round_trip

pytestmark = pytest.mark.live
CHUNK = 256


def new_cache(num_blocks: int = 96) -> CpuKVCache:
    kv = CpuKVCache.allocate(num_layers=2, num_blocks=num_blocks, block_size=16, num_heads=2,
                             head_dim=32, dtype="bfloat16")
    fill_random(kv, seed=num_blocks)
    return kv


def prompt(seed: int, chunks: int = 2) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**31, chunks * CHUNK).tolist()


@pytest.fixture
def restartable() -> Iterator[LiveServer]:
    server = start_server(*both_modes_args(f"restart{os.getpid()}"))
    yield server
    server.stop()


@pytest.mark.skipif(SERVER_VERSION != "0.5.3", reason="slow (45 s idle): run once, on 0.5.3")
def test_idle_past_the_reap_budget_then_a_byte_exact_round_trip() -> None:
    """Server reaping after 30 s. The client with a heartbeat is never reaped; the one
    without (heartbeat_interval=None) is reaped after 30 s of silence, and registers again
    before its next store, so both round trips are byte-exact with no action here."""
    server = start_server("--worker-reap-timeout-seconds", "30",
                          "--worker-registration-grace-seconds", "30",
                          *both_modes_args(f"reap{os.getpid()}"))
    kept, bare = new_cache(), new_cache(num_blocks=97)
    try:
        with Client(server.url, heartbeat_interval=5.0) as c1, \
                Client(server.url, heartbeat_interval=None) as c2:
            reg_kept = c1.register(kept, model_name="reap-kept", mode="lmcache")
            reg_bare = c2.register(bare, model_name="reap-bare", mode="engine")
            time.sleep(45)
            log = server.log
            # "Reaped non-GPU instance N: silent for 3x.xs (pinged=False)"
            assert f"Reaped non-GPU instance {reg_bare.instance_id}:" in log, log[-2000:]
            assert f"instance {reg_kept.instance_id}: silent" not in log
            round_trip(reg_kept, prompt(1), list(range(1, 33)), list(range(40, 72)))
            round_trip(reg_bare, prompt(2), list(range(1, 33)), list(range(40, 72)))
            assert reg_kept.recoveries == 0  # the heartbeat kept it alive
            assert reg_bare.recoveries == 1  # silent too long: registered again first
            reg_kept.unregister()
            reg_bare.unregister()
    finally:
        kept.close()
        bare.close()
        server.stop()


@pytest.mark.parametrize("mode", ["lmcache", "engine"])
def test_sigkill_and_restart_under_traffic_recovers_on_its_own(
        restartable: LiveServer, mode: str) -> None:
    recovered: list[Registration] = []
    health: list[bool] = []
    before = our_segments()
    kv = new_cache(num_blocks=200)
    client = Client(restartable.url, timeout=5.0, heartbeat_interval=0.5,
                    on_recovered=recovered.append, on_health_change=health.append)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        reg = client.register(kv, model_name=f"restart-{mode}", mode=mode)
        assert reg.mode == mode
        round_trip(reg, prompt(10), list(range(1, 33)), list(range(40, 72)))

        outcomes: dict[int, list[tuple[float, str]]] = {i: [] for i in range(4)}

        def traffic(i: int) -> None:
            rng = random.Random(i)
            base = 80 + 16 * i  # each thread stores from its own blocks
            while not stop.is_set():
                try:
                    with reg.request(prompt(rng.randrange(2**30), chunks=1)) as req:
                        req.store(list(range(base, base + 16)), timeout=3.0)
                        req.lookup(timeout=3.0)
                    outcomes[i].append((time.monotonic(), "ok"))
                # While the server is down or starting, a call fails within its deadline
                # (unreachable, or its deadline passed waiting to re-register); on a
                # loaded box a restart can outlast the 3 s deadline.
                except (ServerUnavailable, RequestTimeout) as err:
                    outcomes[i].append((time.monotonic(), type(err).__name__))
                    time.sleep(0.05)

        threads += [threading.Thread(target=traffic, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        restartable.kill()
        # Down until the client has seen it (its heartbeats fail): a server started
        # from the fork server is back in ~1 s, within the heartbeats' grace.
        deadline = time.monotonic() + 10
        while not health and time.monotonic() < deadline:
            time.sleep(0.05)
        listening = restartable.start_again()
        # No application action: the same Registration, a store as soon as the new
        # server answers (the traffic threads may get there first). A traffic thread's
        # protocol probe that the starting server left unanswered for its whole budget
        # judged it unresponsive: calls then fail at once until a re-probe (at most one
        # a second) is answered, by design (a dead server costs its callers nothing).
        while True:
            try:
                with reg.request(prompt(11)) as req:
                    assert req.store(list(range(1, 33)), timeout=5.0) is True
                break
            except ServerUnresponsive:
                assert time.monotonic() - listening < 2.0, "still judged unresponsive"
                time.sleep(0.05)
        first_ok = time.monotonic()
        assert first_ok - listening < 2.0, f"recovery took {first_ok - listening:.2f} s"
        round_trip(reg, prompt(12), list(range(1, 33)), list(range(40, 72)))

        def recovered_all() -> bool:  # every thread stored and looked up again
            return all(any(t > listening and o == "ok" for t, o in seen)
                       for seen in outcomes.values())

        deadline = time.monotonic() + 10
        while not recovered_all() and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=10)
            assert not t.is_alive(), "a traffic thread hung"
        assert recovered_all(), {i: seen[-4:] for i, seen in outcomes.items()}
        assert all(any(o == "ok" for _, o in seen) for seen in outcomes.values())
        assert reg.recoveries >= 1 and recovered and recovered[0] is reg
        deadline = time.monotonic() + 3
        while not client.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health[:1] == [False] and client.healthy
        reg.unregister()
    finally:
        # Stopped on every path: a traffic thread left running after a failure loops on
        # the closed client (ClientClosed is a ServerUnavailable) and, not a daemon,
        # kept the pytest process from exiting (an hour-long CI hang, 2026-12-06).
        stop.set()
        for t in threads:
            t.join(timeout=10)
        client.close()
        kv.close()
    assert our_segments() == before
