"""The tests' fork server (scripts/server_zygote.py) starts real servers that
lmcache-server.sh recognises and stops, and that die as a started server dies."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lmcache_mp import Client
from tests.conftest import start_server
from tests.support.server_fork import ENV

pytestmark = pytest.mark.live


def gone(pid: int, within: float = 10.0) -> bool:
    """No process of that pid (a zombie would count as there: the fork server must not
    leave one, as the shell that starts a server does not)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.1)
    return False


def test_a_forked_server_answers_and_stop_ends_it() -> None:
    if os.environ.get("LMCACHE_MP_SERVER_FORK") == "0":
        pytest.skip("LMCACHE_MP_SERVER_FORK=0: servers start as fresh interpreters")
    server = start_server()
    try:
        assert os.environ.get(ENV, "").startswith(f"{server.version}:")
        assert Path(f"/proc/{server.pid}/comm").read_text().strip() == f"lmcache-s:{server.port}"
        assert os.getsid(server.pid) == server.pid  # its own session, as setsid gives
        with Client(server.url, timeout=10) as client:
            assert client.chunk_size() > 0
        pid = server.pid
    finally:
        server.stop()
    assert gone(pid), f"server pid {pid} still there after stop"


def test_a_killed_forked_server_leaves_no_zombie() -> None:
    server = start_server()
    pid = server.pid
    server.kill()
    assert gone(pid), f"server pid {pid} still there after SIGKILL"
