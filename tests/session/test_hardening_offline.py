"""Issue 12, offline: one test (at least) per finding, against the scripted server in
tests/support/fake_server.py or a raw ROUTER; each fails without its fix.

1. a server that answers nothing is told from one that rejected a request
   (ServerUnresponsive, fail fast, lift on an answer or a reconnect);
2. local validation gaps (timeouts, wait_for_lookup, block allocation records, huge
   caches, one geometry per model, the server's chunk size, no bare exceptions);
4. malformed engine-driven contexts still send the releasing COMMIT; oversized replies.

Findings 3 (the SHM sweep) and 5 (URL checks) are tested in tests/ipc/test_shm_sweep.py
and tests/session/test_urls_and_errors.py.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

import lmcache_mp.ipc.cpu_cache as cpu_cache_mod
from lmcache_mp import (
    BlockAllocationRecord,
    CacheKey,
    Client,
    CpuKVCache,
    EngineGroupInfo,
    InvalidArgument,
    ProtocolMismatch,
    RequestTimeout,
    ServerUnavailable,
    ServerUnresponsive,
)
from lmcache_mp.ipc import shm
from lmcache_mp.ipc.shm import SHM_DIR
from lmcache_mp.transport import MAX_REPLY_BYTES

from ..support.fake_server import FakeServer, slot_geometry
from ..support.live_helpers import our_segments

CHUNK = 256
# A call resolves within its deadline plus this; "at once" is under FAST. Both leave room
# for a loaded machine (make test runs pytest jobs side by side on 2 cores) and still
# tell "at once" from "at the deadline" (every deadline here is >= 0.3 s).
SLACK = 0.3
FAST = 0.2


def tokens(n_chunks: int = 1, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**31, n_chunks * CHUNK).tolist()


def timed(call: Any) -> tuple[float, BaseException | None]:
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return time.monotonic() - start, exc
    return time.monotonic() - start, None


def wait_until(predicate: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


# ===================================================== 1. nothing answers at all
def test_a_server_that_answers_nothing_is_unresponsive_then_calls_fail_at_once(
        fake: FakeServer) -> None:
    with Client(fake.url, protocol="0.5.3", timeout=0.5, heartbeat_interval=None) as c:
        assert c.noop() == "OK"
        fake.silent.set()  # like a dead message thread: received, never answered
        took, err = timed(c.noop)
        assert isinstance(err, ServerUnresponsive), err
        assert "message thread has died" in str(err)
        assert 0.5 <= took < 0.5 + SLACK
        sent = len(fake.seen)
        for call in (c.noop, c.chunk_size, c.get_experimental, lambda: c.ping(7)):
            took, err = timed(call)
            assert isinstance(err, ServerUnresponsive) and took < FAST, (took, err)
        # Failed calls were not sent; at most one fresh probe (one per second).
        assert len(fake.seen) - sent <= 1
        fake.silent.clear()
        # The next probe's answer lifts the gate: calls work again on their own.
        assert wait_until(lambda: timed(c.noop)[1] is None, timeout=2.5)
        assert c.noop() == "OK"


def test_a_dropped_request_on_a_live_server_stays_a_plain_timeout(fake: FakeServer) -> None:
    fake.drop.add("CLEAR")
    with Client(fake.url, protocol="0.5.3", timeout=5.0, heartbeat_interval=None) as c:
        took, err = timed(lambda: c.clear(timeout=0.4))
        assert type(err) is RequestTimeout and 0.4 <= took < 0.4 + SLACK
        assert "although the server is answering" in str(err)
        took, err = timed(c.noop)  # not gated
        assert err is None and took < 1.0  # not gated (its deadline is 5 s)
        assert fake.ops().count("NOOP") == 2  # the probe and this call


def test_an_unresponsive_server_is_forgotten_on_reconnect_and_recovered(
        fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", timeout=0.6, heartbeat_interval=0.1) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        fake.silent.set()
        with reg.request(tokens()) as req:
            took, err = timed(lambda: req.store(list(range(1, 17))))
        assert isinstance(err, ServerUnresponsive) and took < 0.6 + SLACK
        fake.silent.clear()
        epoch = c._conn.transport.epoch
        fake.restart()  # a new server process: the client connects again by itself
        # Until the reconnection is seen, calls fail fast by design (the server was judged
        # unresponsive); under load the first call could come before it (CI, stop 17).
        assert wait_until(lambda: c._conn.transport.refresh() > epoch)
        with reg.request(tokens(seed=1)) as req:
            assert req.store(list(range(1, 17)), timeout=3.0) is True
        assert reg.recoveries >= 1 and fake.state.registered == {reg.instance_id: "lmcache"}
        reg.unregister()


def test_waiting_for_another_threads_re_registration_keeps_the_deadline(
        fake: FakeServer, kv: CpuKVCache) -> None:
    with Client(fake.url, protocol="0.5.3", timeout=2.0, heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        fake.restart()  # the next transfer re-registers first...
        assert wait_until(lambda: c._conn.transport.refresh() > 1)
        fake.hooks["REGISTER_KV_CACHE"] = lambda payloads: time.sleep(1.5)  # ...slowly
        first = threading.Thread(target=timed, args=(lambda: reg.store(
            CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=tokens(), start=0,
                     end=CHUNK, request_id="a"), list(range(1, 17)), timeout=1.2),))
        first.start()
        time.sleep(0.2)  # the first thread holds the re-registration
        key = CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=tokens(seed=1),
                       start=0, end=CHUNK, request_id="b")
        took, err = timed(lambda: reg.store(key, list(range(1, 17)), timeout=0.3))
        assert isinstance(err, (RequestTimeout, ServerUnavailable)) and took < 0.3 + SLACK, took
        first.join()


def test_protocol_detection_against_a_silent_server_is_unresponsive(fake: FakeServer) -> None:
    fake.silent.set()
    with Client(fake.url, timeout=0.5, heartbeat_interval=None) as c:  # protocol="auto"
        took, err = timed(c.noop)
        assert isinstance(err, ServerUnresponsive) and took < 0.5 + SLACK
        took, err = timed(c.noop)
        assert isinstance(err, ServerUnresponsive) and took < FAST
        fake.silent.clear()
        # The detection's fence, answered late, lifts the gate (the fake answers
        # what it received once it speaks again only for new requests: a re-probe).
        assert wait_until(lambda: timed(c.noop)[1] is None, timeout=2.5)


def test_waiting_for_another_threads_protocol_probe_keeps_the_deadline() -> None:
    """A call that waits while another thread probes a new connection has only its own
    time left for its probe (it used to get its whole timeout again: a 1 s STORE took
    2 s in the chaos test when four threads met a restarted server)."""
    with socket.socket() as s:  # a port nothing listens on: every probe waits it out
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with Client(url, timeout=0.5, heartbeat_interval=None) as c:  # protocol="auto"
        results: list[tuple[float, BaseException | None]] = []
        first = threading.Thread(target=lambda: results.append(timed(c.chunk_size)))
        first.start()
        time.sleep(0.2)  # the first thread holds the probe
        took, err = timed(c.chunk_size)
        first.join()
        assert isinstance(err, ServerUnavailable) and took < 0.5 + SLACK, took
        assert isinstance(results[0][1], ServerUnavailable) and results[0][0] < 0.5 + SLACK


# ======================================================= 2. local validation
@pytest.mark.parametrize("bad", [float("inf"), 1e10, float("nan"), -1, 0, "1", True])
def test_timeouts_are_finite_and_checked_before_anything_is_sent(fake: FakeServer,
                                                                 bad: Any) -> None:
    with pytest.raises(InvalidArgument):
        Client(fake.url, timeout=bad)
    with pytest.raises(InvalidArgument):
        Client(fake.url, heartbeat_interval=bad)
    with pytest.raises(InvalidArgument):
        Client(fake.url, reap_timeout=bad)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        for call in (lambda: c.noop(timeout=bad), lambda: c.ping(timeout=bad),
                     lambda: c.noop_async(timeout=bad),
                     lambda: c.wait_prefetch_status("r", bad),
                     lambda: c.wait_prefetch_status("r", 1.0, rpc_timeout=bad)):
            with pytest.raises(InvalidArgument):
                call()
    assert fake.seen == []


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


@pytest.mark.parametrize("value", [-256, 0, "256", 1.5])
def test_a_bad_chunk_size_from_the_server_is_a_protocol_mismatch(fake: FakeServer,
                                                                 value: Any) -> None:
    fake.hooks["GET_CHUNK_SIZE"] = lambda payloads: value
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        with pytest.raises(ProtocolMismatch):
            c.chunk_size()


def test_one_geometry_per_model_and_world_size(fake: FakeServer, kv: CpuKVCache) -> None:
    other = CpuKVCache.allocate(num_layers=2, num_blocks=80, block_size=16, num_heads=4,
                                head_dim=8, dtype="float16")
    more_blocks = CpuKVCache.allocate(num_layers=2, num_blocks=96, block_size=16,
                                      num_heads=2, head_dim=8, dtype="float16")
    try:
        with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c, \
                Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c2:
            reg = c.register(kv, model_name="geo", mode="lmcache")
            registers = fake.ops().count("REGISTER_KV_CACHE")
            for client in (c, c2):  # also from another client of the same server
                with pytest.raises(InvalidArgument, match="one memory layout per"):
                    client.register(other, model_name="geo", mode="lmcache")
            assert fake.ops().count("REGISTER_KV_CACHE") == registers  # nothing sent
            # The same object shape (more blocks) is fine; so is another model.
            c2.register(more_blocks, model_name="geo", mode="lmcache").unregister(unlink=False)
            c.register(other, model_name="geo-2", mode="lmcache").unregister(unlink=False)
            c.register(other, model_name="geo", world_size=2, mode="lmcache").unregister(
                unlink=False)
            reg.unregister(unlink=False)
            c.register(other, model_name="geo", mode="lmcache")  # the first one is gone
        with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
            # close() without unregister released the claim of the closed client
            c.register(kv, model_name="geo", mode="lmcache").unregister(unlink=False)
    finally:
        other.close()
        more_blocks.close()


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


def test_argument_errors_are_lmcache_mp_errors(fake: FakeServer, kv: CpuKVCache) -> None:
    """Calls that raised bare TypeError / ValueError / AttributeError before."""
    key = CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=tokens(), start=0,
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


# ================================ 4. malformed engine-driven contexts, big replies
def _corrupt_store(fake: FakeServer, how: str) -> None:
    def hook(payloads: list[Any]) -> Any:
        reply = fake._op_prepare_store(*payloads)  # reserves, as the server would
        ctx = reply["context"]
        if how == "index out of range":
            ctx["chunk_indices"] = [i + 5 for i in ctx["chunk_indices"]]
        elif how == "more slots than indices":
            ctx["chunk_indices"] = ctx["chunk_indices"][:-1]
        elif how == "a repeated index":
            ctx["chunk_indices"] = [ctx["chunk_indices"][0]] * len(ctx["chunk_indices"])
        elif how == "slot outside the pool":
            ctx["slots"][-1] = {**ctx["slots"][-1], "offset": 1 << 40}
        elif how == "undecodable":
            ctx["slots"] = 5
        return reply

    fake.hooks["PREPARE_STORE"] = hook


@pytest.mark.parametrize("how", ["index out of range", "more slots than indices",
                                 "a repeated index", "slot outside the pool", "undecodable"])
def test_a_malformed_prepare_store_still_releases_the_reservation(
        fake: FakeServer, kv: CpuKVCache, how: str) -> None:
    fake.slot_geometry = slot_geometry(kv)
    assert fake.pool is not None
    kv.layers[0][...] = 1
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="engine")
        _corrupt_store(fake, how)
        with reg.request(tokens(2)) as req:
            with pytest.raises(ProtocolMismatch, match="COMMIT_STORE"):
                req.store(list(range(1, 33)))
        ops = fake.ops()
        assert ops[ops.index("PREPARE_STORE") + 1] == "COMMIT_STORE"
        assert not any(bytes(fake.pool.buffer[: 4 << 10]))  # nothing was copied
        del fake.hooks["PREPARE_STORE"]
        with reg.request(tokens(2, seed=1)) as req:
            assert req.store(list(range(1, 33))) is True  # the client keeps working
        reg.unregister()


@pytest.mark.parametrize("how", ["one slot short", "wrong dtype", "undecodable"])
def test_a_malformed_prepare_retrieve_still_releases_the_read_locks(
        fake: FakeServer, kv: CpuKVCache, how: str) -> None:
    fake.slot_geometry = slot_geometry(kv)
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None) as c:
        reg = c.register(kv, model_name="m", mode="engine")
        with reg.request(tokens(2)) as req:
            assert req.store(list(range(1, 33))) is True

        def hook(payloads: list[Any]) -> Any:
            reply = fake._op_prepare_retrieve(*payloads)
            if how == "one slot short":
                reply["context"]["slots"].pop()
            elif how == "wrong dtype":
                reply["context"]["slots"][0]["dtype"] = "bfloat16"
            else:
                reply["success"] = "yes"
            return reply

        fake.hooks["PREPARE_RETRIEVE"] = hook
        kv.layers[0][:, 40:72] = 7
        with reg.request(tokens(2)) as req:
            assert req.lookup() == 2 * CHUNK
            with pytest.raises(ProtocolMismatch, match="COMMIT_RETRIEVE"):
                req.retrieve(list(range(40, 72)))
        ops = fake.ops()
        assert ops[ops.index("PREPARE_RETRIEVE") + 1] == "COMMIT_RETRIEVE"
        assert (kv.layers[0][:, 40:72] == 7).all()  # no block was written
        assert not any(fake.state.locks.values())  # the lookup's locks were released
        reg.unregister()


def test_an_oversized_reply_fails_fast_and_the_client_reconnects(fake: FakeServer) -> None:
    with Client(fake.url, protocol="0.5.3", timeout=3.0, heartbeat_interval=None) as c:
        assert c.noop() == "OK"
        fake.hooks["GET_EXPERIMENTAL"] = lambda payloads: ["x" * (MAX_REPLY_BYTES + 1)]
        took, err = timed(c.get_experimental)
        assert isinstance(err, ServerUnavailable) and "MAXMSGSIZE" in str(err), err
        assert took < 1.0  # at once, not at the deadline
        del fake.hooks["GET_EXPERIMENTAL"]
        # ZMQ ends a connection for good after such a frame; the transport starts a
        # new one, so the next call works.
        took, err = timed(c.get_experimental)
        assert err is None and took < 1.0
