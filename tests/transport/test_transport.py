"""Transport behaviour against a scripted in-process ROUTER (no lmcache needed):
uid matching, out-of-order replies, many threads, deadlines, close()."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from lmcache_mp.errors import ClientClosed, RequestTimeout, ServerUnavailable
from lmcache_mp.transport import Transport

from ..conftest import free_port

Handler = Callable[[list[bytes]], "list[bytes] | None"]


class FakeRouter:
    """Replies to each request with the handler's frames (after the identity), or not."""

    def __init__(self, handler: Handler, port: int | None = None) -> None:
        self.port = port or free_port()
        self.handler = handler
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            if not self.sock.poll(20):
                continue
            msg = self.sock.recv_multipart()
            ident, body = msg[0], msg[1:]
            reply = self.handler(body)
            if reply is not None:
                self.sock.send_multipart([ident, *reply])

    def close(self) -> None:
        self.stop_flag.set()
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


def echo(body: list[bytes]) -> list[bytes]:
    return body  # [uid, type, payload...] echoed back


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    r = FakeRouter(echo)
    yield r
    r.close()


def test_request_reply_roundtrip(router: FakeRouter) -> None:
    t = Transport(router.url)
    try:
        p = t.submit([b"\x18", b"\xa1x"], 2.0, "NOOP")
        assert t.wait(p) == [b"\x18", b"\xa1x"]
        assert t.in_flight == 0
    finally:
        t.close()


def test_out_of_order_with_identities() -> None:
    """Replies sent in reverse order still complete the right requests."""
    port = free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    t = Transport(f"tcp://127.0.0.1:{port}")
    try:
        reqs = [t.submit([b"\x18", bytes([i])], 5.0, f"op{i}") for i in range(50)]
        got = []
        while len(got) < 50:
            for _ in range(5):
                t.poll(reqs[0])
            if router.poll(100):
                got.append(router.recv_multipart())
        for msg in reversed(got):
            ident, uid, typ, payload = msg
            router.send_multipart([ident, uid, typ, payload + b"!"])
        for i, p in enumerate(reqs):
            assert t.wait(p) == [b"\x18", bytes([i]) + b"!"]
    finally:
        t.close()
        router.close(0)
        ctx.term()


def test_many_threads_many_requests(router: FakeRouter) -> None:
    t = Transport(router.url)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(300):
                payload = f"{n}:{i}".encode()
                p = t.submit([b"\x18", payload], 5.0, "NOOP")
                assert t.wait(p) == [b"\x18", payload]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not errors, errors[:3]
        assert t.in_flight == 0
    finally:
        t.close()


def test_unanswered_request_times_out_within_deadline() -> None:
    r = FakeRouter(lambda body: None)
    t = Transport(r.url)
    try:
        p = t.submit([b"\x18"], 0.3, "NOOP")
        start = time.monotonic()
        with pytest.raises(RequestTimeout, match="no reply to NOOP from the LMCache server"):
            t.wait(p)
        assert 0.0 < time.monotonic() - start < 0.3 + 0.3  # deadline + room for a busy box
        assert t.in_flight == 0
    finally:
        t.close()
        r.close()


def test_late_reply_after_timeout_is_dropped() -> None:
    delay = threading.Event()

    def slow(body: list[bytes]) -> list[bytes]:
        delay.wait(1)
        return body

    r = FakeRouter(slow)
    t = Transport(r.url)
    try:
        p1 = t.submit([b"\x18", b"1"], 0.2, "NOOP")
        with pytest.raises(RequestTimeout):
            t.wait(p1)
        delay.set()
        p2 = t.submit([b"\x18", b"2"], 2.0, "NOOP")
        assert t.wait(p2) == [b"\x18", b"2"]  # the late reply to p1 did not confuse p2
    finally:
        t.close()
        r.close()


def test_absent_server_is_unavailable_within_deadline() -> None:
    t = Transport(f"tcp://127.0.0.1:{free_port()}")
    try:
        p = t.submit([b"\x18"], 0.4, "NOOP")
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="refused|no connection"):
            t.wait(p)
        assert time.monotonic() - start < 0.4 + 0.3  # deadline + room for a busy box
    finally:
        t.close()


def test_request_waits_for_a_server_that_starts_within_the_deadline() -> None:
    port = free_port()
    t = Transport(f"tcp://127.0.0.1:{port}")
    try:
        p = t.submit([b"\x18", b"x"], 3.0, "NOOP")
        time.sleep(0.3)
        r = FakeRouter(echo, port=port)
        try:
            assert t.wait(p) == [b"\x18", b"x"]
        finally:
            r.close()
    finally:
        t.close()


def test_close_fails_pending_requests_and_waiters() -> None:
    r = FakeRouter(lambda body: None)
    t = Transport(r.url)
    p = t.submit([b"\x18"], 30.0, "NOOP")
    result: list[BaseException] = []

    def waiter() -> None:
        try:
            t.wait(p)
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.2)
    start = time.monotonic()
    t.close()
    th.join(5)
    r.close()
    assert not th.is_alive()
    assert time.monotonic() - start < 1.0
    assert isinstance(result[0], ClientClosed)
    with pytest.raises(ClientClosed):
        t.submit([b"\x18"], 1.0, "NOOP")
    t.close()  # idempotent


def _os_threads() -> int:
    # ZMQ's I/O threads are not Python threads: count the process's kernel tasks.
    return len(os.listdir("/proc/self/task"))


def test_close_leaves_no_threads_behind(router: FakeRouter) -> None:
    before = _os_threads()
    for _ in range(5):
        t = Transport(router.url)
        t.wait(t.submit([b"\x18"], 2.0, "NOOP"))
        assert _os_threads() > before  # the transport's context runs its own threads
        t.close()
    assert _os_threads() == before


def test_dropped_transport_is_finalized(router: FakeRouter) -> None:
    import gc

    before = _os_threads()
    t = Transport(router.url)
    t.wait(t.submit([b"\x18"], 2.0, "NOOP"))
    del t
    gc.collect()
    assert _os_threads() == before
