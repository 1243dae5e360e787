"""A few persistent threads that run a copy plan alongside the calling thread.

numpy releases the GIL inside large array copies, so a plan of independent copies
(one per chunk and layer, or per layer of a run of chunks) runs on every core given to
it; one core of memcpy does not saturate a machine's memory bandwidth. The threads are
started on the first copy and belong to one client (stopped by its ``close()``): no
thread per call, and none left behind. Tasks are taken one at a time from a shared counter, so a
core that other work slows down simply takes fewer of them.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CopyWorkers", "default_threads"]

#: Beyond four threads a copy is bound by memory bandwidth on the machines measured.
MAX_THREADS = 4


def default_threads() -> int:
    """Threads a copy uses, the caller included: ``LMCACHE_MP_COPY_THREADS`` or the
    cores this process may run on, at most :data:`MAX_THREADS`."""
    env = os.environ.get("LMCACHE_MP_COPY_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_THREADS))


class _Job:
    """One plan being run: the tasks, the shared counter and the first error."""

    def __init__(self, tasks: Sequence[Any], run: Callable[[Any], None], helpers: int) -> None:
        self.tasks, self.run = tasks, run
        self.next = itertools.count()  # next() is atomic under the GIL
        self.error: BaseException | None = None
        self.pending = helpers
        self.done = threading.Condition(threading.Lock())

    def work(self) -> None:
        n = len(self.tasks)
        try:
            while self.error is None:
                i = next(self.next)
                if i >= n:
                    break
                self.run(self.tasks[i])
        except BaseException as exc:  # the caller re-raises it
            self.error = self.error or exc


class CopyWorkers:
    """``threads - 1`` helper threads; :meth:`run` uses them and the caller."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = default_threads() if threads is None else max(1, threads)
        self._lock = threading.Lock()
        self._helpers: list[threading.Thread] = []
        self._wake = threading.Condition(threading.Lock())
        self._job: _Job | None = None
        self._generation = 0
        self._closed = False
        self._pid = os.getpid()

    def run(self, tasks: Sequence[Any], run: Callable[[Any], None]) -> None:
        """``run(task)`` for every task, spread over the threads; returns when all are
        done (the first error is raised after every thread has stopped writing)."""
        if self.threads == 1 or len(tasks) < 2 or self._closed:
            for t in tasks:
                run(t)
            return
        with self._lock:  # one plan at a time: concurrent callers would only contend
            self._start()
            job = _Job(tasks, run, len(self._helpers))
            with self._wake:
                self._job, self._generation = job, self._generation + 1
                self._wake.notify_all()
            job.work()
            with job.done:
                while job.pending:
                    job.done.wait()
            self._job = None
        if job.error is not None:
            raise job.error

    def _start(self) -> None:
        if self._pid != os.getpid():
            # A forked child inherits the list but not the threads: start its own.
            self._pid, self._helpers = os.getpid(), []
            self._wake = threading.Condition(threading.Lock())
        while len(self._helpers) < self.threads - 1:
            t = threading.Thread(target=self._loop, args=(self._generation,),
                                 name="lmcache-mp-copy", daemon=True)
            t.start()
            self._helpers.append(t)

    def _loop(self, seen: int) -> None:
        while True:
            with self._wake:
                while self._generation == seen and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                seen, job = self._generation, self._job
            assert job is not None
            job.work()
            with job.done:
                job.pending -= 1
                job.done.notify()

    def close(self) -> None:
        """Stop the helper threads (waiting for a plan in progress to finish)."""
        with self._lock:
            self._closed = True
            with self._wake:
                self._wake.notify_all()
            helpers, self._helpers = self._helpers, []
        for t in helpers:
            if t is not threading.current_thread():
                t.join()
