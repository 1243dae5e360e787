"""Issue 12, chaos: a real server is killed, stopped, and has its message thread killed
by a raw bad frame, under store / lookup / retrieve traffic from several threads, in
both transfer modes at once. Every call resolves within its deadline + 100 ms, the
client recovers by itself, round trips are byte-exact afterwards, and nothing is left
in /dev/shm.

tests/live/test_live_lifecycle.py already restarts a server under store + lookup traffic on
every release; these scenarios add retrieves, per-call deadline accounting, SIGSTOP and
message-thread deaths. Run once, against 0.5.3 (a few restarts: slow).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import zmq

from lmcache_mp import (
    Client,
    CpuKVCache,
    LMCacheMPError,
    Registration,
    RequestTimeout,
    ServerUnavailable,
    ServerUnresponsive,
)

from ..conftest import SERVER_VERSION, LiveServer, start_server
from ..support.live_helpers import (
    SETUP_S,
    both_modes_args,
    fill_random,
    our_segments,
    round_trip,
)
from ..support.polling import wait_until

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(SERVER_VERSION != "0.5.3", reason="slow: run once, against 0.5.3"),
]
CHUNK = 256
DEADLINE = 1.0  # every call of the traffic threads
# ... resolves within DEADLINE + SLACK. Unloaded the worst call is 1-3 ms past its
# deadline; beside a CPU-bound process 3-11 ms; beside three make-test jobs and server
# restarts up to 102 ms; on CI's machine (2 cores, 84% busy) one store took 403 ms. A
# client bug that makes a call wait for another's deadline (a lock, a probe, a
# re-registration) overstays by a whole DEADLINE: still caught. watch() says where a
# late call was.
SLACK = 0.6
THREADS = 4
EXPECTED = (ServerUnavailable, RequestTimeout)  # ServerUnresponsive is a ServerUnavailable


def prompt(seed: int, chunks: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**31, chunks * CHUNK).tolist()


@dataclass
class Traffic:
    """Threads doing store / lookup / retrieve; every call's duration and outcome."""

    regs: list[Registration]
    calls: list[tuple[float, float, str, str]] = field(default_factory=list)  # start, took
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    unexpected: list[BaseException] = field(default_factory=list)
    #: thread id -> (op, start) of the call it is in
    running: dict[int, tuple[str, float]] = field(default_factory=dict)
    #: (op, seconds in, stack) of calls seen past DEADLINE + SLACK / 2 by the watchdog
    overstays: list[tuple[str, float, str]] = field(default_factory=list)

    def timed(self, op: str, call: Callable[[], object]) -> object:
        start = time.monotonic()
        outcome = "ok"
        self.running[threading.get_ident()] = (op, start)
        try:
            return call()
        except EXPECTED as err:
            outcome = type(err).__name__
            return None
        except BaseException as err:  # noqa: BLE001 - reported by check()
            outcome = type(err).__name__
            self.unexpected.append(err)
            return None
        finally:
            self.running.pop(threading.get_ident(), None)
            with self.lock:
                self.calls.append((start, time.monotonic() - start, op, outcome))

    def watch(self) -> None:
        """Where a call that overstays spends its time: its stack, sampled once it is
        DEADLINE + SLACK / 2 into the call (the first per call), for check()'s message."""
        seen: set[tuple[int, float]] = set()
        while not self.stop.wait(0.02):
            now = time.monotonic()
            frames = sys._current_frames()
            for tid, (op, start) in list(self.running.items()):
                if now - start > DEADLINE + SLACK / 2 and (tid, start) not in seen:
                    seen.add((tid, start))
                    frame = frames.get(tid)
                    stack = "".join(traceback.format_stack(frame)[-8:]) if frame else "?"
                    self.overstays.append((op, round(now - start, 3), stack))

    def run(self, i: int) -> None:
        rng = random.Random(i)
        reg = self.regs[i % len(self.regs)]
        src = list(range(100 + 32 * i, 116 + 32 * i))  # this thread's own blocks
        dst = list(range(116 + 32 * i, 132 + 32 * i))
        while not self.stop.is_set():
            try:
                with reg.request(prompt(rng.randrange(2**30))) as req:
                    if self.timed("store", lambda: req.store(src, timeout=DEADLINE)) is None:
                        time.sleep(0.02)
                        continue
                    hits = self.timed("lookup", lambda: req.lookup(timeout=DEADLINE))
                    if hits:
                        self.timed("retrieve", lambda: req.retrieve(dst, timeout=DEADLINE))
            except BaseException as err:  # noqa: BLE001 - Request.close never raises
                self.unexpected.append(err)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True)
                        for i in range(THREADS)]
        self.threads.append(threading.Thread(target=self.watch, daemon=True))
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)
            assert not t.is_alive(), "a traffic thread hung"

    def ok_after(self, t: float) -> set[str]:
        with self.lock:
            return {op for start, _, op, outcome in self.calls if start > t and outcome == "ok"}

    def check(self) -> tuple[float, int, dict[str, int]]:
        """Worst overshoot past the deadline, number of calls, outcomes."""
        assert not self.unexpected, self.unexpected[:3]
        worst = max(took - DEADLINE for _, took, _, _ in self.calls)
        outcomes: dict[str, int] = {}
        for _, _, _, outcome in self.calls:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        late = [(op, outcome, round(took, 3)) for _, took, op, outcome in self.calls
                if took > DEADLINE + SLACK]
        assert not late, "\n".join([f"late calls: {late[:5]}", *(
            f"a {op} {t} s in was at:\n{stack}" for op, t, stack in self.overstays[:3])])
        return worst, len(self.calls), outcomes


@pytest.fixture
def traffic(setup: tuple[Client, list[Registration]]) -> Iterator[Traffic]:
    """The traffic threads, stopped and joined whatever the test's outcome."""
    t = Traffic(setup[1])
    yield t
    t.stop.set()
    for th in t.threads:
        th.join(timeout=10)


@pytest.fixture
def server() -> Iterator[LiveServer]:
    s = start_server(*both_modes_args(f"chaos{os.getpid()}"))
    yield s
    s.stop()


@pytest.fixture
def setup(server: LiveServer) -> Iterator[tuple[Client, list[Registration]]]:
    before = our_segments()
    kvs = [CpuKVCache.allocate(num_layers=2, num_blocks=240, block_size=16, num_heads=2,
                               head_dim=32, dtype="bfloat16") for _ in range(2)]
    for n, kv in enumerate(kvs):
        fill_random(kv, seed=n)
    client = Client(server.url, timeout=DEADLINE, heartbeat_interval=0.25)
    try:
        # The setup's calls get a setup's deadline; the traffic of the tests keeps DEADLINE.
        regs = [client.register(kvs[0], model_name="chaos-engine", mode="engine",
                                timeout=SETUP_S),
                client.register(kvs[1], model_name="chaos-lmcache", mode="lmcache",
                                timeout=SETUP_S)]
        for reg in regs:
            round_trip(reg, prompt(1, 2), list(range(1, 33)), list(range(40, 72)))
        yield client, regs
        for reg in regs:
            reg.unregister()
    finally:
        client.close()
        for kv in kvs:
            kv.close()
    assert our_segments() == before


def recovered_round_trips(regs: list[Registration], since: float, seed: int) -> float:
    """Seconds from ``since`` to byte-exact round trips in both modes (retrying while
    the client recovers on its own)."""
    for reg in regs:
        deadline = time.monotonic() + 15
        while True:
            try:
                round_trip(reg, prompt(seed, 2), list(range(1, 33)), list(range(40, 72)),
                           timeout=DEADLINE)
                break
            except LMCacheMPError:
                assert time.monotonic() < deadline, "the client did not recover"
                time.sleep(0.02)
    return time.monotonic() - since


def wait_for_ok_traffic(traffic: Traffic, since: float) -> None:
    deadline = time.monotonic() + 10
    while traffic.ok_after(since) != {"store", "lookup", "retrieve"}:
        assert time.monotonic() < deadline, traffic.ok_after(since)
        time.sleep(0.05)


def kill_message_thread(url: str, how: str) -> None:
    """What any client could send: one frame, or a request type the server cannot
    decode; either kills the 0.5.3 server's message thread, the process lives on."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(url)
    enc = msgspec.msgpack.encode
    raw.send_multipart([enc(0)] if how == "single frame" else [enc(0), enc(99)])
    raw.close(linger=2000)  # delivered before the socket goes, however loaded the host
    ctx.term()


def report(name: str, **figures: object) -> None:
    print(f"\n[chaos] {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


def test_sigkill_and_restart_under_mixed_traffic(
        server: LiveServer, setup: tuple[Client, list[Registration]], traffic: Traffic) -> None:
    client, regs = setup
    traffic.start()
    time.sleep(0.5)
    server.kill()
    time.sleep(0.5)  # calls made while nothing listens wait, then fail, on time
    listening = server.start_again()
    to_round_trip = recovered_round_trips(regs, listening, seed=2)
    wait_for_ok_traffic(traffic, listening)
    traffic.finish()
    worst, n, outcomes = traffic.check()
    report("SIGKILL + restart", worst_past_deadline_ms=round(worst * 1e3, 1), calls=n,
           outcomes=outcomes, restart_to_round_trip_s=round(to_round_trip, 3))
    assert all(reg.recoveries >= 1 for reg in regs)
    assert client.healthy or wait_until(lambda: client.healthy)


def test_sigstop_longer_than_the_deadlines_then_sigcont(
        server: LiveServer, setup: tuple[Client, list[Registration]], traffic: Traffic) -> None:
    client, regs = setup
    traffic.start()
    time.sleep(0.5)
    os.kill(server.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        time.sleep(3 * DEADLINE)
        # Nothing answered, nothing hung: each call failed within its deadline, and
        # once judged unresponsive, at once.
        during = [(took, outcome) for start, took, _, outcome in traffic.calls
                  if start > stopped + DEADLINE + SLACK]
        assert during and all(o != "ok" for _, o in during)
        fast = [took for took, o in during if o == "ServerUnresponsive" and took < 0.05]
        assert fast, during[:10]
    finally:
        os.kill(server.pid, signal.SIGCONT)
    resumed = time.monotonic()
    to_round_trip = recovered_round_trips(regs, resumed, seed=3)
    wait_for_ok_traffic(traffic, resumed)
    traffic.finish()
    worst, n, outcomes = traffic.check()
    report("SIGSTOP 3 s + SIGCONT", worst_past_deadline_ms=round(worst * 1e3, 1), calls=n,
           outcomes=outcomes, sigcont_to_round_trip_s=round(to_round_trip, 3))
    assert outcomes.get("ServerUnresponsive", 0) > 0
    assert wait_until(lambda: client.healthy)


@pytest.mark.parametrize("how", ["single frame", "invalid request type"])
def test_a_dead_message_thread_then_a_restart(
        server: LiveServer, setup: tuple[Client, list[Registration]], traffic: Traffic,
        how: str) -> None:
    client, regs = setup
    traffic.start()
    time.sleep(0.3)
    kill_message_thread(server.url, how)
    killed = time.monotonic()
    # The first calls wait their deadline, a NOOP probe goes unanswered too: then
    # every call fails at once with ServerUnresponsive.
    start = time.monotonic()
    while True:
        t0 = time.monotonic()
        try:
            client.noop()
        except ServerUnresponsive:
            if time.monotonic() - t0 < 0.05:
                break
        assert time.monotonic() - start < 3 * DEADLINE, "never judged unresponsive"
    judged = time.monotonic() - killed
    time.sleep(0.5)
    server.stop()  # the operator restarts it
    listening = server.start_again()
    to_round_trip = recovered_round_trips(regs, listening, seed=4)
    wait_for_ok_traffic(traffic, listening)
    traffic.finish()
    worst, n, outcomes = traffic.check()
    report(f"message thread killed ({how}) + restart",
           worst_past_deadline_ms=round(worst * 1e3, 1), calls=n, outcomes=outcomes,
           death_to_fail_fast_s=round(judged, 3), restart_to_round_trip_s=round(to_round_trip, 3))
    assert outcomes.get("ServerUnresponsive", 0) > 0
    assert all(reg.recoveries >= 1 for reg in regs)
    assert wait_until(lambda: client.healthy)
