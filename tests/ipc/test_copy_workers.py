"""The copy threads: every task runs once, errors reach the caller after all threads
stopped, close() stops them, a forked child starts its own, and engine-driven copies
through them are byte-exact (the plans are also checked task by task elsewhere)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from lmcache_mp.ipc.copy_workers import CopyWorkers, default_threads
from lmcache_mp.ipc.cpu_cache import KVGeometry
from lmcache_mp.ipc.paged_copy import gather_tasks, run_task, scatter_tasks


def helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lmcache-mp-copy"]


def test_every_task_runs_once_on_several_threads() -> None:
    w = CopyWorkers(3)
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        with lock:
            seen.append((i, threading.current_thread().name))

    for _ in range(20):
        w.run(list(range(100)), run)
    assert sorted(i for i, _ in seen) == sorted(list(range(100)) * 20)
    assert len(helpers()) >= 2
    w.close()
    assert not helpers()
    w.run([1, 2], run)  # closed: still runs, on the caller's thread


def test_the_first_error_is_raised_after_every_thread_stopped() -> None:
    w = CopyWorkers(2)

    def run(i: int) -> None:
        if i == 3:
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        w.run(list(range(50)), run)
    w.run([0], lambda i: None)  # usable afterwards
    w.close()


def test_default_threads_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_MP_COPY_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.setenv("LMCACHE_MP_COPY_THREADS", "x")
    assert 1 <= default_threads() <= 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_starts_its_own_threads() -> None:
    w = CopyWorkers(2)
    w.run([1, 2, 3], lambda i: None)
    pid = os.fork()
    if pid == 0:  # the child: the parent's helper is gone; must not hang
        try:
            out: list[int] = []
            w.run(list(range(10)), out.append)
            os._exit(0 if sorted(out) == list(range(10)) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    w.close()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_threaded_plans_match_serial_copies(layout: str) -> None:
    g = KVGeometry(4, 40, 16, 4, 32, "bfloat16", False, layout)  # type: ignore[arg-type]
    rng = np.random.default_rng(9)
    layers = [rng.integers(0, 2**16, g.layer_shape, dtype=np.uint16) for _ in range(4)]
    ids = np.array([3, 4, 5, 6, 20, 21, 22, 23, 9, 1, 30, 31, 32, 33, 34, 35])
    objs = [np.empty((2, 4, 64, 128), np.uint16) for _ in range(4)]
    w = CopyWorkers(2)
    w.run([t for c in range(4) for t in gather_tasks(layers, ids[4 * c:4 * c + 4], objs[c], g)],
          run_task)
    ref = np.empty_like(objs[0])
    for c in range(4):
        for t in gather_tasks(layers, ids[4 * c:4 * c + 4], ref, g):
            run_task(t)
        assert np.array_equal(objs[c], ref)
    back = [np.zeros_like(x) for x in layers]
    w.run([t for c in range(4) for t in scatter_tasks(objs[c], back, ids[4 * c:4 * c + 4], g)],
          run_task)
    for a, b in zip(layers, back, strict=True):
        assert np.array_equal(a[:, ids], b[:, ids])
    w.close()
