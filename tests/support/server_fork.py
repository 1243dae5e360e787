"""One fork server of real LMCache servers per pytest session (scripts/server_zygote.py).

Every ``lmcache-server.sh start`` of the session's release, from this process or any
it runs (tests/integrations/vllm restarts servers through the script), then forks its server from
this one instead of importing LMCache anew: ~8 of a start's ~11 CPU-seconds, ~100
starts a ``make test``. Set ``LMCACHE_MP_SERVER_FORK=0`` to start every server as a
fresh interpreter (the demos and benchmarks always do).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ENV = "LMCACHE_MP_SERVER_ZYGOTE"  # read by scripts/lmcache-server.sh: "VERSION:SOCKET"


class ServerFork:
    """The running fork server; :meth:`close` ends it (its servers live on, as started)."""

    def __init__(self, script: Path, version: str) -> None:
        self.socket = os.path.join(tempfile.gettempdir(),
                                   f"lmcache_mp_server_fork_{os.getpid()}.sock")
        self.log = os.path.join(tempfile.gettempdir(),
                                f"lmcache_mp_server_fork_{os.getpid()}.log")
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [str(script), "zygote", "--version", version, "--", self.socket],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        ready = threading.Event()

        def wait_ready() -> None:
            assert self.proc.stdout is not None
            if self.proc.stdout.readline().strip() == b"READY":
                ready.set()

        threading.Thread(target=wait_ready, daemon=True, name="server-fork-ready").start()
        deadline = time.monotonic() + 180
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                tail = Path(self.log).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the LMCache server fork server did not start:\n{tail}")
        self.env = f"{version}:{self.socket}"

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # end of input: it removes its socket and ends
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        if os.path.exists(self.log):
            os.unlink(self.log)


_running: list[ServerFork] = []


def use_server_fork(script: Path, version: str) -> None:
    """Start the session's fork server on first use and point the script at it."""
    if _running or os.environ.get("LMCACHE_MP_SERVER_FORK") == "0":
        return
    fork = ServerFork(script, version)
    _running.append(fork)
    os.environ[ENV] = fork.env
    atexit.register(stop_server_fork)


def stop_server_fork() -> None:
    while _running:
        os.environ.pop(ENV, None)
        _running.pop().close()
