"""Fixtures that run real LMCache MP servers from the oracle venv.

The oracle (scripts/lmcache-server.sh) installs LMCache into its own virtualenv on
first use; lmcache_mp itself never imports it. Set LMCACHE_MP_SKIP_LIVE=1 to skip
live tests on a machine that cannot install the oracle.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp import CpuKVCache
from lmcache_mp.protocol import PROFILES

from .support.server_fork import use_server_fork

REPO = Path(__file__).resolve().parent.parent
SERVER_SCRIPT = REPO / "scripts" / "lmcache-server.sh"
SERVER_VERSION = os.environ.get("LMCACHE_MP_SERVER_VERSION", "0.5.3")
# The protocol family each release must be detected as.
# release -> the profile that must speak it, as the profiles declare it
EXPECTED_FAMILY = {rel: p.name for p in PROFILES.values() for rel in p.releases}


# tools/run_suites.py gives each pytest job it runs side by side a port range of its own
# ("LO:HI"): a port the kernel picks (bind to 0) is free when picked, but another job may
# pick it too before the server that is to use it has bound it.
_PORT_RANGE = os.environ.get("LMCACHE_MP_PORT_RANGE")
_next_port = [int(_PORT_RANGE.split(":")[0])] if _PORT_RANGE else []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on: the next free one of this job's
    range under tools/run_suites.py, else one the kernel picks."""
    if not _next_port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    hi = int(_PORT_RANGE.split(":")[1]) if _PORT_RANGE else 0
    while _next_port[0] < hi:
        port = _next_port[0]
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"LMCACHE_MP_PORT_RANGE={_PORT_RANGE}: every port of the range used")


@dataclass
class LiveServer:
    port: int
    version: str
    args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        pid_file = _oracle_dir() / "run" / f"server-{self.port}.pid"
        return int(pid_file.read_text())

    @property
    def log(self) -> str:
        return (_oracle_dir() / "run" / f"server-{self.port}.log").read_text(errors="replace")

    def stop(self) -> None:
        subprocess.run([str(SERVER_SCRIPT), "stop", "--port", str(self.port)], check=False,
                       capture_output=True)

    def kill(self) -> None:
        """SIGKILL the server (no clean shutdown), then clean up after it."""
        os.kill(self.pid, signal.SIGKILL)
        self.stop()

    def start_again(self) -> float:
        """Start a new server on the same port with the same arguments; returns the
        ``time.monotonic()`` at which it answered its first request."""
        _run_start(self.port, self.args, self.version)
        return time.monotonic()


def _oracle_dir() -> Path:
    return Path(os.environ.get("LMCACHE_MP_ORACLE_DIR", REPO / ".oracle"))


def oracle_python(version: str = SERVER_VERSION) -> Path:
    """The python of the oracle venv of ``version``, for tests that run LMCache itself.

    Where the oracle is expected (``CI=1``, or an oracle directory exists, as after
    ``make oracle``) a missing venv FAILS the test: an oracle test that skips there
    would pass CI while checking nothing. Elsewhere it skips, saying how to install.
    """
    python = _oracle_dir() / f"venv-{version}" / "bin" / "python"
    if python.exists():
        return python
    why = (f"the LMCache {version} oracle venv is missing ({python}); install it with "
           f"scripts/lmcache-server.sh install --version {version}")
    if os.environ.get("CI") == "1" or _oracle_dir().exists():
        pytest.fail(why)
    pytest.skip(why)


def start_server(*extra: str, version: str = SERVER_VERSION) -> LiveServer:
    if os.environ.get("LMCACHE_MP_SKIP_LIVE") == "1":
        pytest.skip("LMCACHE_MP_SKIP_LIVE=1: live tests against a real LMCache server skipped")
    port = free_port()
    _run_start(port, extra, version)
    return LiveServer(port, version, tuple(extra))


def _run_start(port: int, extra: tuple[str, ...], version: str = SERVER_VERSION) -> None:
    cmd = [str(SERVER_SCRIPT), "start", "--version", version, "--port", str(port)]
    if extra:
        cmd += ["--", *extra]
    use_server_fork(SERVER_SCRIPT, SERVER_VERSION)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not start the LMCache server:\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    """One real server shared by the tests that leave it healthy, with both transfer
    modes (the default is LMCache-driven only from 0.5.4) and an L1 pool in shared
    memory for engine-driven copies (off unless named from 0.5.4)."""
    server = start_server("--supported-transfer-mode", "auto",
                          "--shm-name", f"lmcache_l1_pool_test{os.getpid()}")
    yield server
    server.stop()


@pytest.fixture
def private_server() -> Iterator[LiveServer]:
    """A server of the test's own, for tests that kill it or its message thread."""
    server = start_server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def expected_family() -> str:
    return EXPECTED_FAMILY[SERVER_VERSION]


# ------------------------------------------------- offline client tests (fake server)
@pytest.fixture
def fake() -> Iterator[Any]:
    """A scripted LMCache 0.5.3 server (tests/support/fake_server.py), closed after the test."""
    from .support.fake_server import FakeServer  # it imports this module

    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def kv() -> Iterator[CpuKVCache]:
    """A small zero-filled CPU cache: 2 layers x 80 blocks of 16 tokens, 2 heads x 8."""
    with CpuKVCache.allocate(num_layers=2, num_blocks=80, block_size=16, num_heads=2,
                             head_dim=8, dtype="float16") as cache:
        yield cache
