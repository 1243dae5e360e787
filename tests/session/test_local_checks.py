"""What is refused before anything is sent, and what is refused in a reply: URLs (remote
hosts only with allow_remote; every local form reached), liveness settings,
wait_for_lookup's arguments, block allocation records, a CPU cache's size, the server's
chunk size, a reply of another request type; the API's shape (an async twin per blocking
call) and its errors (every one an LMCacheMPError).
"""

from __future__ import annotations

import errno
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

import lmcache_mp.ipc.cpu_cache as cpu_cache_mod
from lmcache_mp import (
    BlockAllocationRecord,
    CacheKey,
    Client,
    CpuKVCache,
    EngineGroupInfo,
    InvalidArgument,
    LMCacheMPError,
    ProtocolMismatch,
    Registration,
    ReplyFuture,
    Request,
    RequestTimeout,
    ServerUnavailable,
    ServerUnresponsive,
)
from lmcache_mp.ipc import shm
from lmcache_mp.ipc.shm import SHM_DIR

from ..conftest import free_port
from ..support.fake_server import FakeServer
from ..support.live_helpers import our_segments
from ..support.session_helpers import CHUNK, PER_CHUNK, key, tokens


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


def test_liveness_settings_are_checked() -> None:
    with pytest.warns(UserWarning, match="heartbeat_interval=15"):
        Client("tcp://127.0.0.1:9", heartbeat_interval=15).close()
    for bad in (dict(heartbeat_interval=0), dict(heartbeat_interval=True),
                dict(reap_timeout=-1), dict(timeout="5")):
        with pytest.raises(InvalidArgument):
            Client("tcp://127.0.0.1:9", **bad)  # type: ignore[arg-type]


def test_wait_for_lookup_checks_its_arguments_first(fake: FakeServer) -> None:
    key = CacheKey(model_name="m", world_size=1, worker_id=None, token_ids=tokens(2),
                   start=0, end=2 * CHUNK, request_id="r")
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        for bad in (dict(poll_interval=-1), dict(poll_interval=float("inf")),
                    dict(min_chunks=-1), dict(min_chunks=1.5), dict(tp_size=0),
                    dict(timeout=-2)):
            with pytest.raises(InvalidArgument):
                c.wait_for_lookup(key, **bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            c.wait_for_lookup("not a key")  # type: ignore[arg-type]
        # Servers hold at most 128 read locks per object and clamp silently.
        with pytest.raises(InvalidArgument, match="at most 128"):
            c.lookup(key, tp_size=129)
        assert "LOOKUP" not in fake.ops()
        assert c.wait_for_lookup(key, 0, timeout=0.2, poll_interval=0) == 0


def test_block_allocation_records_are_checked(fake: FakeServer) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        for bad in (5, "abc", [5], [{"foo": 1}], [{"req_id": 1, "new_block_ids": [],
                                                  "new_token_ids": []}],
                    [{"req_id": "r", "new_block_ids": ["x"], "new_token_ids": []}],
                    [BlockAllocationRecord(req_id=3, new_block_ids=[],  # type: ignore[arg-type]
                                           new_token_ids=[])],
                    {"req_id": "r"}):
            with pytest.raises(InvalidArgument):
                c.report_block_allocation(1, "m", bad)  # type: ignore[arg-type]
        assert "REPORT_BLOCK_ALLOCATION" not in fake.ops()
        fake.hooks["REPORT_BLOCK_ALLOCATION"] = lambda payloads: None
        c.report_block_allocation(1, "m", [{"req_id": "r", "new_block_ids": [1, 2],
                                            "new_token_ids": [3]}])
        assert fake.requests("REPORT_BLOCK_ALLOCATION")[0].payloads[2] == [
            {"req_id": "r", "new_block_ids": [1, 2], "new_token_ids": [3]}]


def test_cpu_cache_allocation_is_checked_and_reserved_up_front(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dims = dict(num_layers=1, block_size=16, num_heads=8, head_dim=128)
    for bad in (dict(num_blocks=2**40), dict(num_blocks=2**70), dict(num_blocks=0),
                dict(num_layers=100_000), dict(dtype=["x"]), dict(dtype="bool"),
                dict(mla="yes"), dict(num_heads=1.0)):
        with pytest.raises(InvalidArgument):
            CpuKVCache.allocate(**{**dims, "num_blocks": 4, **bad})  # type: ignore[arg-type]
    # Pages are allocated now (a sparse file would SIGBUS on a full /dev/shm later).
    with CpuKVCache.allocate(**dims, num_blocks=64) as cache:  # type: ignore[arg-type]
        st = os.stat(os.path.join(SHM_DIR, cache.segment_names[0][1:]))
        assert st.st_blocks * 512 >= cache.geometry.layer_nbytes
    # More than /dev/shm has free: refused before any segment is made.
    before = our_segments()  # other pytest jobs may run side by side
    monkeypatch.setattr(cpu_cache_mod, "shm_free_bytes", lambda: 1 << 20)
    with pytest.raises(InvalidArgument, match="free"):
        CpuKVCache.allocate(**dims, num_blocks=64)  # type: ignore[arg-type]
    monkeypatch.undo()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    with pytest.raises(InvalidArgument, match="not enough shared memory"):
        CpuKVCache.allocate(**dims, num_blocks=64)  # type: ignore[arg-type]
    assert our_segments() - before == set()


@pytest.mark.parametrize("value", [-256, 0, "256", 1.5])
def test_a_bad_chunk_size_from_the_server_is_a_protocol_mismatch(fake: FakeServer,
                                                                 value: Any) -> None:
    fake.hooks["GET_CHUNK_SIZE"] = lambda payloads: value
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        with pytest.raises(ProtocolMismatch):
            c.chunk_size()


@pytest.mark.parametrize("op, call", [
    ("NOOP", lambda c, reg: c.noop()),
    ("PING", lambda c, reg: c.ping()),
    ("GET_EXPERIMENTAL", lambda c, reg: c.get_experimental()),
    ("END_SESSION", lambda c, reg: c.end_session("r")),
    ("LOOKUP", lambda c, reg: c.lookup(key(reg, tokens(1)))),
    ("STORE", lambda c, reg: reg.store(key(reg, tokens(1)), list(range(PER_CHUNK)))),
])
def test_a_reply_echoing_another_request_type_is_refused(
        fake: FakeServer, kv: CpuKVCache, op: str,
        call: Callable[[Client, Registration], Any]) -> None:
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=2) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        # The reply carries this request's uid but another op's type (what a server of
        # another protocol family would send back): never taken as this op's answer.
        fake.reply_type[op] = 6 if op != "STORE" else 7
        with pytest.raises(ProtocolMismatch, match="echoed request type"):
            call(c, reg)
        fake.reply_type.clear()
        assert c.noop() == "OK"  # the connection itself is fine
        reg.unregister()


def test_every_blocking_call_has_an_async_twin() -> None:
    for cls in (Client, Registration, Request):
        names = {n for n, v in inspect.getmembers(cls) if callable(v) and not n.startswith("_")}
        for name in names:
            if name.endswith("_async"):
                assert name.removesuffix("_async") in names, f"{cls.__name__}.{name}"
        twins = {n for n in names if f"{n}_async" in names}
        expected = {"store", "retrieve", "lookup"}
        assert expected <= twins, cls.__name__
    assert {n for n in dir(Client) if n.endswith("_async")} == {
        f"{n}_async" for n in (
            "noop", "ping", "clear", "get_experimental", "submit_lookup", "query_prefetch_status",
            "wait_prefetch_status", "query_prefetch_lookup_hits", "lookup", "free_lookup_locks",
            "end_session", "report_block_allocation", "store", "retrieve", "store_engine_driven",
            "retrieve_engine_driven")}
    fut = Client.noop_async
    assert "ReplyFuture" in str(inspect.signature(fut).return_annotation)
    assert ReplyFuture.completed(3).result() == 3


def test_argument_errors_are_lmcache_mp_errors(fake: FakeServer, kv: CpuKVCache) -> None:
    """Calls that raised bare TypeError / ValueError / AttributeError before."""
    key = CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=tokens(1), start=0,
                   end=CHUNK, request_id="r")
    torch = pytest.importorskip("torch")
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        bad_calls = [
            lambda: key.replace(bogus=1),
            lambda: key.replace(start="x"),
            lambda: CacheKey(model_name="m", world_size=1, worker_id=0,
                             token_ids=torch.zeros((2, 2), dtype=torch.int64), start=0, end=0,
                             request_id="r"),
            lambda: CacheKey(model_name="m", world_size=1, worker_id=0,
                             token_ids=torch.tensor([-1]), start=0, end=0, request_id="r"),
            lambda: c.registration([1]),  # type: ignore[arg-type]
            lambda: c.unregister_kv_cache([1]),  # type: ignore[arg-type]
            lambda: c.unregister_kv_cache_engine_driven({}),  # type: ignore[arg-type]
            lambda: c.store(key, [1], instance_id={}),  # type: ignore[arg-type]
            lambda: c.register(kv, model_name="m", engine_group_infos=5),  # type: ignore[arg-type]
            lambda: c.register(kv, model_name="m", engine_group_infos=[
                EngineGroupInfo(engine_group_id=0, tokens_per_block=-16)]),
            lambda: c.register(kv, model_name="m", engine_group_infos=[
                EngineGroupInfo(engine_group_id=0, layer_indices=(0, 9))]),
            lambda: Client(fake.url, protocol=5),  # type: ignore[arg-type]
            lambda: Client(fake.url, on_recovered=5),  # type: ignore[arg-type]
            lambda: Client(fake.url, allow_remote="yes"),  # type: ignore[arg-type]
        ]
        for call in bad_calls:
            with pytest.raises(InvalidArgument):
                call()
    # A torch tensor of token ids is read like the list it converts to.
    k = CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=torch.arange(4),
                 start=0, end=4, request_id="r")
    assert k.token_ids == (0, 1, 2, 3)


def test_every_public_error_is_an_lmcache_mp_error() -> None:
    import lmcache_mp

    for name in lmcache_mp.errors.__all__:
        assert issubclass(getattr(lmcache_mp, name), LMCacheMPError)
    assert issubclass(ServerUnresponsive, ServerUnavailable)
    assert not issubclass(ServerUnresponsive, RequestTimeout)
