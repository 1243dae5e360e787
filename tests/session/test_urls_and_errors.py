"""URL checks (malformed URLs refused, remote hosts only with allow_remote, every local
form accepted and reached) and the error hierarchy (every public error is an
LMCacheMPError). Issue 12, finding 5.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import msgspec
import pytest
import zmq

from lmcache_mp import (
    Client,
    InvalidArgument,
    LMCacheMPError,
    RequestTimeout,
    ServerUnavailable,
    ServerUnresponsive,
)

from ..conftest import free_port


@pytest.mark.parametrize("url", [
    "inproc://lmcache", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://127.0.0.1",
    "tcp://127.0.0.1:", "tcp://:5555", "tcp://*:5555", "tcp://127.0.0.1:55a", "tcp://::1:5555",
    "tcp://127.0.0.1:5555/x", " tcp://127.0.0.1:5555", "127.0.0.1:5555", "udp://127.0.0.1:5",
    "ipc://", "pgm://eth0;239.192.1.1:5555", "", 5555, None,
])
def test_malformed_urls_are_refused(url: Any) -> None:
    with pytest.raises(InvalidArgument):
        Client(url)


@pytest.mark.parametrize("url", ["tcp://10.1.2.3:5555", "tcp://example.com:5555",
                                 "tcp://[2001:db8::1]:5555", "tcp://192.168.0.7:5555"])
def test_remote_hosts_need_allow_remote(url: str) -> None:
    with pytest.raises(InvalidArgument, match="pickle.*allow_remote=True"):
        Client(url)
    Client(url, allow_remote=True, heartbeat_interval=None).close()


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:{port}", "tcp://127.8.9.10:{port}",
                                 "tcp://localhost:{port}", "tcp://[::1]:{port}",
                                 "tcp://0.0.0.0:{port}", "ipc://{tmp}/server.sock",
                                 "ipc://@lmcache-mp-test-{pid}"])
def test_loopback_and_ipc_urls_are_accepted_and_reached(url: str, tmp_path: Any) -> None:
    """Each form of a local address is accepted without allow_remote, and the client
    then reaches a server listening there (a NOOP answered)."""
    url = url.format(port=free_port(), tmp=tmp_path, pid=os.getpid())
    bind = url.replace("localhost", "127.0.0.1")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.IPV6, 1)
    router.bind(bind)

    def serve() -> None:
        if router.poll(3000):
            ident, uid, typ = router.recv_multipart()
            assert msgspec.msgpack.decode(typ) == 24  # NOOP
            router.send_multipart([ident, uid, typ, msgspec.msgpack.encode("OK")])

    th = threading.Thread(target=serve)
    th.start()
    try:
        with Client(url, protocol="0.5.3", heartbeat_interval=None, timeout=2.0) as c:
            assert c.noop() == "OK"
    finally:
        th.join()
        router.close(0)
        ctx.term()


def test_every_public_error_is_an_lmcache_mp_error() -> None:
    import lmcache_mp

    for name in lmcache_mp.errors.__all__:
        assert issubclass(getattr(lmcache_mp, name), LMCacheMPError)
    assert issubclass(ServerUnresponsive, ServerUnavailable)
    assert not issubclass(ServerUnresponsive, RequestTimeout)
