"""The connector's state machine and error paths against a fake client (no vLLM, no
server): lookups that are not answered yet, hits split between vLLM's prefix cache and
the server, lock frees, store ranges, failed loads, dead servers, configuration."""

from __future__ import annotations

import array
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_mp.errors import InvalidArgument, RequestTimeout, ServerUnavailable
from lmcache_mp.integrations.vllm.config import ConnectorConfig, placement
from lmcache_mp.integrations.vllm.ops import StepOps, TransferOp
from lmcache_mp.integrations.vllm.scheduler import SchedulerSide, State
from lmcache_mp.integrations.vllm.worker import WorkerSide
from lmcache_mp.keys import CacheKey, unpack_token_bytes

CHUNK, BS = 64, 16


def packed(token_ids: Any) -> bytes:
    """Token ids as the scheduler sends them (``StepOps.tokens``)."""
    return CacheKey(model_name="m", world_size=1, worker_id=None, token_ids=list(token_ids),
                    start=0, end=0, request_id="r").token_bytes


def with_tokens(ops: list[TransferOp], first: int = 0, **kw: Any) -> StepOps:
    """A step as the scheduler sends a request's first orders: their token ids with them
    (``first``, ``first + 1``, ... up to each order's end)."""
    return StepOps(ops, tokens={o.wire_id: packed(range(first, first + o.end)) for o in ops},
                   **kw)


class Future:
    def __init__(self, value: Any = None, error: Exception | None = None,
                 ready: bool = True) -> None:
        self.value, self.error, self.ready = value, error, ready

    def done(self) -> bool:
        return self.ready

    def wait(self, seconds: float) -> bool:
        return self.ready  # the scheduler's tests run with lookup_wait=0 unless they say

    def result(self) -> Any:
        if self.error:
            raise self.error
        return self.value


def vllm_id(session_id: str) -> str:
    """vLLM's request id in a session id (``<vLLM id>~<unique suffix>``)."""
    rid, sep, suffix = session_id.rpartition("~")
    assert sep and suffix, f"{session_id!r} is vLLM's id, not a session id of its own"
    return rid


class FakeClient:
    def __init__(self, hits: int = 0) -> None:
        self.hits = hits
        self.calls: list[tuple[Any, ...]] = []
        self.down = False
        self.healthy = True
        self.ack = Future(None)
        self.answers: list[Any] = []
        self.lookup_kw: list[tuple[int, bool]] = []
        self.free_kw: list[tuple[int, bool]] = []
        #: The request ids sent on the wire (session ids), QUERY and END.
        self.sessions: list[str] = []

    def noop(self, timeout: float) -> str:
        if self.down:
            raise ServerUnavailable("down")
        return "ok"

    def chunk_size(self, timeout: float) -> int:
        return CHUNK

    def submit_lookup_async(self, key: Any, tp: int, timeout: float,
                            mla: bool = False) -> Future:
        self.lookup_kw.append((tp, mla))
        self.sessions.append(key.request_id)
        self.calls.append(("LOOKUP", key.start, key.end, key.cache_salt, key.world_size))
        return self.ack

    def query_prefetch_status_async(self, rid: str, timeout: float) -> Future:
        self.sessions.append(rid)
        self.calls.append(("QUERY", vllm_id(rid)))
        return self.answers.pop(0) if self.answers else Future(self.hits)

    def free_lookup_locks_async(self, key: Any, tp: int, timeout: float,
                                mla: bool = False) -> Future:
        self.free_kw.append((tp, mla))
        self.sessions.append(key.request_id)
        self.calls.append(("FREE", key.start, key.end))
        return Future(None)

    def end_session_async(self, rid: str, timeout: float) -> Future:
        self.sessions.append(rid)
        self.calls.append(("END", vllm_id(rid)))
        return Future(None)

    def ops(self, name: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == name]


def request(n: int, rid: str = "r", salt: str | None = None, **kw: Any) -> Any:
    fields = {"prompt_embeds": None, "mm_features": [], **kw}
    return SimpleNamespace(request_id=rid, all_token_ids=list(range(1, n + 1)),
                           num_prompt_tokens=n, cache_salt=salt, num_computed_tokens=0,
                           **fields)


def side(*clients: FakeClient, lookup_wait: float = 0.0) -> SchedulerSide:
    # No waiting for lookups by default: each call polls once (the tests step the
    # server's answers by hand); the waits have their own tests.
    cfg = ConnectorConfig(server_urls=tuple(f"tcp://127.0.0.1:{i}" for i in range(len(clients))),
                          lookup_wait=lookup_wait)
    return SchedulerSide(cfg, dict(zip(cfg.server_urls, clients, strict=True)),
                         model_name="m", kv_world_size=1, block_size=BS, start_health=False)


def out(new: dict[str, int], cached: dict[str, list[int]] | None = None) -> Any:
    cached = cached or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new if r not in cached],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached),
                                              new_block_ids=[(b,) for b in cached.values()],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=new, preempted_req_ids=None)


class Answering(Future):
    """A reply that is not in yet and arrives while the scheduler waits for it (after
    ``after`` seconds), or never; records how long each wait was allowed."""

    def __init__(self, value: Any = None, after: float | None = 0.001) -> None:
        super().__init__(value, ready=False)
        self.after = after
        self.waits: list[float] = []

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        if self.after is not None and self.after <= seconds:
            time.sleep(self.after)
            self.ready = True
        else:
            time.sleep(seconds)
        return self.ready


def test_a_lookup_answered_within_the_wait_is_a_hit_in_the_same_step() -> None:
    # Without the wait, a hit costs two scheduler steps of "not yet" before its load
    # is even ordered; a local server answers in about a millisecond.
    a = FakeClient(hits=2)
    a.ack = Answering(None)
    a.answers = [Answering(2)]
    s = side(a, lookup_wait=0.05)
    assert s.get_num_new_matched_tokens(request(4 * CHUNK), 0) == (2 * CHUNK, True)
    assert [c[0] for c in a.calls] == ["LOOKUP", "QUERY"]


def test_lookups_share_one_wait_per_scheduler_step() -> None:
    a = FakeClient()
    a.ack = Answering(None, after=None)  # the server never answers
    s = side(a, lookup_wait=0.02)
    t0 = time.monotonic()
    assert s.get_num_new_matched_tokens(request(4 * CHUNK, "r1"), 0) == (None, True)
    assert s.get_num_new_matched_tokens(request(4 * CHUNK, "r2"), 0) == (None, True)
    # The second found the budget spent: one wait, for at most the budget (the wall
    # clock only guards against a hang: a busy machine may delay either call).
    assert time.monotonic() - t0 < 5.0
    assert len(a.ack.waits) == 1 and 0 < a.ack.waits[0] <= 0.02
    s.build_step(out({}))  # a new step: a new budget
    assert s.get_num_new_matched_tokens(request(4 * CHUNK, "r1"), 0) == (None, True)
    assert len(a.ack.waits) == 2


def test_lookup_reports_not_yet_until_every_server_answered() -> None:
    a, b = FakeClient(hits=3), FakeClient(hits=2)
    a.ack = Future(ready=False)
    b.answers = [Future(None), Future(None), Future(2)]  # still running, then 2 chunks
    s = side(a, b)
    r = request(4 * CHUNK + 10)
    assert s.get_num_new_matched_tokens(r, 0) == (None, True)
    assert a.ops("LOOKUP") == [("LOOKUP", 0, 4 * CHUNK, "", 1)]  # chunk-aligned prefix
    a.ack.ready = True
    assert s.get_num_new_matched_tokens(r, 0) == (None, True)   # b: still running
    assert s.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, True)
    # The hit is the minimum; a's lock on its third chunk is freed, once.
    assert a.ops("FREE") == [("FREE", 2 * CHUNK, 3 * CHUNK)] and b.ops("FREE") == []
    assert len(a.ops("LOOKUP")) == 1
    # Asked again before allocation (no budget this step): same answer, nothing sent.
    assert s.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, True)
    assert [c[0] for c in a.calls] == ["LOOKUP", "QUERY", "FREE"]


def test_vllm_hit_inside_a_chunk_is_skipped_by_the_retrieve() -> None:
    c = FakeClient(hits=3)
    s = side(c)
    r = request(3 * CHUNK + 5)
    vllm_hit = CHUNK + 2 * BS
    assert s.get_num_new_matched_tokens(r, vllm_hit) == (3 * CHUNK - vllm_hit, True)
    s.update_state_after_alloc(r, list(range(1, 3 * CHUNK // BS + 2)), 3 * CHUNK - vllm_hit)
    # Locks of the chunk vLLM fully holds are freed; the partly held one is retrieved.
    assert c.ops("FREE") == [("FREE", 0, CHUNK)]
    step = s.build_step(out({}))
    (op,) = step.retrieves()
    assert (op.start, op.end, op.skip_first_n_tokens) == (CHUNK, 3 * CHUNK, 2 * BS)
    assert op.block_ids == tuple(range(1 + CHUNK // BS, 1 + 3 * CHUNK // BS))
    assert s.trackers["r"].state is State.READY


def test_vllm_covers_the_hit_frees_every_lock_and_loads_nothing() -> None:
    c = FakeClient(hits=2)
    s = side(c)
    r = request(3 * CHUNK)
    assert s.get_num_new_matched_tokens(r, 2 * CHUNK) == (0, False)
    s.update_state_after_alloc(r, list(range(1, 13)), 0)
    assert c.ops("FREE") == [("FREE", 0, 2 * CHUNK)]
    assert s.build_step(out({})).retrieves() == []


def test_full_prompt_hit_leaves_the_last_token_to_compute() -> None:
    s = side(FakeClient(hits=2))
    assert s.get_num_new_matched_tokens(request(2 * CHUNK), 0) == (2 * CHUNK - 1, True)


def test_dead_server_reports_no_hit_and_sends_nothing() -> None:
    c = FakeClient(hits=2)
    c.down = True
    s = side(c)
    assert s.healthy == {"tcp://127.0.0.1:0": False}
    r = request(3 * CHUNK)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, list(range(1, 13)), 0)
    assert s.build_step(out({"r": 3 * CHUNK})).ops == []  # no STORE either
    assert s.request_finished(r) is False  # nothing stored: vLLM frees the blocks now
    assert c.ops("LOOKUP") == c.ops("END") == []


def test_lookup_errors_count_as_no_hit() -> None:
    a, b = FakeClient(hits=2), FakeClient(hits=2)
    b.ack = Future(error=ServerUnavailable("gone"))
    s = side(a, b)
    assert s.get_num_new_matched_tokens(request(3 * CHUNK), 0) == (0, False)
    assert a.ops("FREE") == [("FREE", 0, 2 * CHUNK)]  # a's locks are not retrieved
    assert b.ops("FREE") == []  # b never answered: no locks of its to free


def test_timed_out_lookup_frees_the_locks_the_server_took() -> None:
    """A LOOKUP whose answer timed out may still have read-locked chunks on the server:
    the request goes on as a miss, the server is asked again until it says how many,
    and those are freed; only then does END_SESSION go out."""
    c = FakeClient(hits=2)
    c.ack = Future(error=RequestTimeout("slow"))
    s = side(c)
    r = request(3 * CHUNK)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert c.ops("FREE") == []
    c.answers = [Future(None), Future(error=RequestTimeout("again")), Future(2)]
    s.update_state_after_alloc(r, list(range(1, 13)), 0)
    s.build_step(out({"r": 3 * CHUNK}))  # still running on the server
    s.build_step(out({}))                # that answer timed out too: ask again
    assert c.ops("FREE") == []
    s.build_step(out({}))                # 2 chunks were locked: freed
    assert c.ops("FREE") == [("FREE", 0, 2 * CHUNK)]
    assert s.request_finished(r) is True  # its chunks were stored
    assert c.ops("END") == []             # its stores are not reported done yet
    s.update_connector_output(None, {"r"})
    assert c.calls[-1] == ("END", "r")   # after the FREE was answered


@pytest.mark.parametrize("salt", ["a@b", "x" * 129, "p/q", "nul\x00"])
def test_salt_lmcache_rejects_bypasses(salt: str) -> None:
    c = FakeClient(hits=2)
    s = side(c)
    r = request(3 * CHUNK, salt=salt)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, list(range(1, 13)), 0)
    assert s.build_step(out({"r": 3 * CHUNK})).ops == [] and c.calls == []


def test_token_ids_outside_uint32_bypass() -> None:
    c = FakeClient(hits=2)
    s = side(c)
    r = request(3 * CHUNK)
    r.all_token_ids[5] = 2**32
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.trackers["r"].state is State.BYPASS and c.calls == []


def test_a_request_s_tokens_go_to_the_workers_packed_and_once() -> None:
    """The tokens are checked and packed once per request (not per lookup, free and
    step) and sent to the workers with the request's first order only: big-endian
    uint32 bytes, LMCache 0.5.7's token_bytes; the workers drop them when told."""
    class ConstantList(Sequence[int]):  # as vLLM hands request.all_token_ids over
        def __init__(self, x: list[int]) -> None:
            self._x = x

        def __getitem__(self, i: Any) -> Any:
            return self._x[i]

        def __len__(self) -> int:
            return len(self._x)

    c = FakeClient(hits=0)
    s = side(c)
    r = request(2 * CHUNK + 5)
    r.all_token_ids = ConstantList(r.all_token_ids)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(1, 10)), 0)
    step = s.build_step(out({"r": CHUNK}))
    (st,) = step.stores()
    sid = s.trackers["r"].session_id
    assert list(step.tokens) == [sid] and st.wire_id == sid
    tokens = step.tokens[sid]
    assert isinstance(tokens, bytes) and len(tokens) == 4 * (2 * CHUNK + 5)
    assert tokens[:8] == bytes([0, 0, 0, 1, 0, 0, 0, 2])
    assert tokens is s.trackers["r"].key.token_bytes  # packed once, shared
    # The next order of the same request comes without them; the worker has them.
    later = s.build_step(out({}, {"r": []}))
    assert later.stores() == [] and later.tokens == {}
    s.trackers["r"].scheduled += CHUNK + 5
    later = s.build_step(out({}, {"r": []}))
    (st2,) = later.stores()
    assert later.tokens == {} and (st2.start, st2.end) == (CHUNK, 2 * CHUNK)
    reg = FakeReg()
    w = worker(reg, FakeClient())
    w.start_stores(step)
    w.start_stores(later)
    keys = [sent[1] for sent in reg.sent]
    assert [(k.start, k.end) for k in keys] == [(0, CHUNK), (CHUNK, 2 * CHUNK)]
    assert keys[1].token_ids == tuple(r.all_token_ids) and keys[1].request_id == sid
    assert keys[0]._tokens is keys[1]._tokens  # checked once on the worker too
    # Finished and done with: the next step tells the workers to forget them.
    s.request_finished(r)
    s.update_connector_output(None, {"r"})
    forget = s.build_step(out({}))
    assert forget.forget == [sid]
    w.start_loads(forget)
    assert sid not in w._tokens and sid not in w._keys


def test_an_order_whose_tokens_never_came_fails_cleanly() -> None:
    reg = FakeReg()
    w = worker(reg, FakeClient())
    w.start_stores(StepOps([op("STORE")]))  # no tokens: a scheduler bug, not a crash
    assert reg.sent == [] and w.stats["store_errors"] == 1
    w.start_loads(StepOps([op("RETRIEVE", "q")]))
    assert w.get_finished(set())[1] == {"q"} and w.load_errors() == {1, 2, 3, 4}


def test_prompt_embeds_and_multimodal_bypass() -> None:
    s = side(FakeClient(hits=2))
    assert s.get_num_new_matched_tokens(request(200, "e", prompt_embeds=object()), 0) == (0, False)
    r = request(200, "m")
    r.mm_features = [object()]
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)


def test_stores_whole_prompt_chunks_as_they_are_computed() -> None:
    c = FakeClient(hits=0)
    s = side(c)
    r = request(3 * CHUNK + 20)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    blocks = list(range(1, 14))
    s.update_state_after_alloc(r, blocks[:8], 0)
    # Chunked prefill: 100 tokens, then the rest, then decode steps.
    (op,) = s.build_step(out({"r": 100})).stores()
    assert (op.start, op.end, op.block_ids) == (0, CHUNK, tuple(blocks[:4]))
    (op,) = s.build_step(out({"r": 3 * CHUNK + 20 - 100}, {"r": blocks[8:]})).stores()
    assert (op.start, op.end) == (CHUNK, 3 * CHUNK)
    assert op.block_ids == tuple(blocks[4:12])
    assert s.build_step(out({"r": 1}, {"r": []})).ops == []  # decode: not stored
    # vLLM keeps the blocks until the workers report the stores done; the session
    # ends after that (a STORE the server handled after END_SESSION would make the
    # session again, with this prompt's hashes, for 600 s).
    assert s.request_finished(r) is True and c.ops("END") == []
    assert s.build_step(out({})).held == ["r"]
    s.update_connector_output(None, {"other"})
    assert c.ops("END") == []
    s.update_connector_output(None, {"r"})
    assert c.ops("END") == [("END", "r")]


def test_stores_start_after_the_loaded_prefix() -> None:
    s = side(FakeClient(hits=1))
    r = request(3 * CHUNK)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(1, 13)), CHUNK)
    step = s.build_step(out({}))
    assert [o.direction for o in step.ops] == ["RETRIEVE"]
    (op,) = s.build_step(out({"r": 2 * CHUNK})).stores()
    assert (op.start, op.end) == (CHUNK, 3 * CHUNK)


def test_failed_load_is_recomputed_and_stored_again() -> None:
    s = side(FakeClient(hits=2))
    r = request(3 * CHUNK)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(1, 13)), 2 * CHUNK)
    s.build_step(out({}))
    # vLLM got the load error, freed the blocks, and schedules the request from 0.
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, list(range(20, 32)), 0)
    (op,) = s.build_step(out({"r": 3 * CHUNK})).stores()
    assert (op.start, op.end, op.block_ids[0]) == (0, 3 * CHUNK, 20)


def test_preempted_request_restarts_with_its_new_blocks() -> None:
    s = side(FakeClient(hits=0))
    r = request(2 * CHUNK + 8)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(1, 6)), 0)
    (op,) = s.build_step(out({"r": CHUNK + 8})).stores()
    assert op.end == CHUNK
    # Preempted (blocks freed), scheduled again from 0 with a vLLM hit of one block:
    # the old block list is dropped, stores restart from the new blocks.
    assert s.get_num_new_matched_tokens(r, BS) == (0, False)
    s.update_state_after_alloc(r, [40, 41], 0)
    resumed = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r"], new_block_ids=[(list(range(40, 49)),)],
                                              resumed_req_ids={"r"}),
        num_scheduled_tokens={"r": 2 * CHUNK + 8 - BS}, preempted_req_ids=None)
    (op,) = s.build_step(resumed).stores()
    assert (op.start, op.end, op.block_ids) == (0, 2 * CHUNK, tuple(range(40, 48)))


def test_a_load_never_queues_behind_stores() -> None:
    """A warm request's first token waits for its load: on a CPU engine-driven
    registration the load runs on its own thread while a slow store holds the other."""
    from lmcache_mp import CpuKVCache

    reg = FakeReg()
    reg.cache = CpuKVCache.allocate(num_layers=1, num_blocks=8, block_size=BS, num_heads=1,
                                    head_dim=8, dtype="float16")
    gate = threading.Event()
    stored = reg.store_async
    loaded_on: list[str] = []

    def slow_store(*args: Any, **kwargs: Any) -> Future:
        gate.wait(10)
        return stored(*args, **kwargs)

    def retrieve_async(*args: Any, **kwargs: Any) -> Future:
        loaded_on.append(threading.current_thread().name)
        return Future(True)

    reg.store_async = slow_store  # type: ignore[method-assign]
    reg.retrieve_async = retrieve_async  # type: ignore[method-assign]
    w = worker(reg, FakeClient())
    try:
        w.start_stores(with_tokens([op("STORE", "cold")]))
        w.start_loads(with_tokens([op("RETRIEVE", "warm")]))
        deadline = time.monotonic() + 5
        while "warm" not in w.get_finished(set())[1]:
            assert time.monotonic() < deadline, "the load waited for the store"
            time.sleep(0.005)
        assert loaded_on[0].startswith("lmcache-mp-vllm-loads") and not gate.is_set()
    finally:
        gate.set()
        w.shutdown()
        reg.cache.close()


def test_a_preemption_waits_only_for_the_preempted_requests_stores() -> None:
    s = side(FakeClient(hits=0))
    step = s.build_step(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={}, preempted_req_ids={"b", "a"}))
    assert step.preempted == ["a", "b"]

    class Pending(Future):
        def result(self) -> Any:
            waited.append(self.value)
            return True

    waited: list[str] = []
    reg = FakeReg()
    w = worker(reg, FakeClient())
    for rid in ("a", "other"):
        reg.next = Pending(rid, ready=False)
        w.start_stores(with_tokens([op("STORE", rid)]))
    w.flush_stores(step.preempted)  # "b" has none: nothing to wait for
    assert waited == ["a"]  # the other request's store goes on in the background
    assert w.get_finished(set()) == (set(), set()) and w.stats["stored"] == 1


def test_aborted_during_lookup_frees_its_locks() -> None:
    c = FakeClient(hits=3)
    s = side(c)
    r = request(3 * CHUNK)
    assert s.get_num_new_matched_tokens(r, 0) == (3 * CHUNK - 1, True)
    s.request_finished(r)
    assert c.ops("FREE") == [("FREE", 0, 3 * CHUNK)] and c.ops("END") == [("END", "r")]


# ------------------------------------------------------------------ worker side
class FakeReg:
    def __init__(self) -> None:
        self.mode, self.instance_id = "engine", 1
        self.sent: list[tuple[str, Any, list[int]]] = []
        self.next: Future = Future(True)

    def retrieve_async(self, key: Any, ids: list[int], *, skip_first_n_tokens: int,
                       timeout: float, stream: Any) -> Future:
        assert stream is None  # torch's current stream at the call (CUDA caches)
        self.sent.append(("RETRIEVE", key, ids))
        return self.next

    def store_async(self, key: Any, ids: list[int], *, timeout: float, stream: Any) -> Future:
        assert stream is None
        self.sent.append(("STORE", key, ids))
        return self.next

    def unregister(self, timeout: float) -> None:
        pass


def worker(reg: FakeReg, client: FakeClient) -> WorkerSide:
    client.close = lambda: None  # type: ignore[attr-defined]
    w = WorkerSide(ConnectorConfig(), client, placement(["tcp://h:1", "tcp://h:2"], 4, 3), "m")
    w.set_registration(lambda _instance_id: reg, BS)
    return w


def op(direction: str, rid: str = "r", blocks: tuple[int, ...] = (1, 2, 3, 4)) -> TransferOp:
    return TransferOp(direction, rid, 0, CHUNK, blocks)


def test_worker_keys_carry_the_rank_placement() -> None:
    reg = FakeReg()
    w = worker(reg, FakeClient())
    w.start_stores(with_tokens([op("STORE")]))
    key = reg.sent[0][1]
    assert (w.place.url, key.world_size, key.worker_id) == ("tcp://h:2", 2, 1)


@pytest.mark.parametrize("outcome", [Future(False), Future(error=ServerUnavailable("gone"))])
def test_failed_retrieve_reports_its_blocks(outcome: Future) -> None:
    reg = FakeReg()
    reg.next = Future(ready=False)
    w = worker(reg, FakeClient())
    w.start_loads(with_tokens([op("RETRIEVE", blocks=(5, 6, 7, 8))]))
    assert w.get_finished(set()) == (set(), set())  # in flight: only polled
    reg.next.ready, reg.next.value, reg.next.error = True, outcome.value, outcome.error
    assert w.get_finished(set()) == (set(), {"r"})
    assert w.load_errors() == {5, 6, 7, 8} and w.load_errors() == set()


def test_unhealthy_server_fails_loads_at_once_and_skips_stores() -> None:
    reg, client = FakeReg(), FakeClient()
    w = worker(reg, client)
    client.healthy = False
    w.start_loads(with_tokens([op("RETRIEVE", "a")], held=["b"]))
    w.start_stores(with_tokens([op("STORE", "b")]))
    assert reg.sent == []
    assert w.get_finished({"b"}) == ({"b"}, {"a"}) and w.load_errors() == {1, 2, 3, 4}
    assert w.stats["skipped_stores"] == 1


def test_held_request_is_reported_after_its_stores_and_no_other() -> None:
    reg = FakeReg()
    reg.next = Future(True, ready=False)
    w = worker(reg, FakeClient())
    w.start_loads(StepOps())
    w.start_stores(with_tokens([op("STORE")]))
    # vLLM says r finished; the scheduler holds it (next step): reported once stored.
    assert w.get_finished({"r", "other"}) == (set(), set())
    w.start_loads(StepOps(held=["r"]))
    assert w.get_finished(set()) == (set(), set())
    reg.next.ready = True
    assert w.get_finished(set()) == ({"r"}, set()) and w.stats["stored"] == 1
    assert w.get_finished({"other"}) == (set(), set())  # never held: never "sent"


def test_cpu_engine_driven_transfers_leave_the_forward_thread() -> None:
    """An engine-driven CPU registration: STORE / RETRIEVE (a server round trip and a
    copy each) run on the worker's transfer thread, so the hook returns at once; the
    results are reported as before, errors included; shutdown joins the thread."""
    import threading

    from lmcache_mp import CpuKVCache, ServerUnavailable

    reg = FakeReg()
    reg.cache = CpuKVCache.allocate(num_layers=1, num_blocks=8, block_size=BS, num_heads=1,
                                    head_dim=8, dtype="float16")
    threads: list[str] = []
    gate = threading.Event()
    sent = reg.store_async

    def store_async(*args: Any, **kwargs: Any) -> Future:
        threads.append(threading.current_thread().name)
        gate.wait(10)  # the server's PREPARE round trip, slow
        if len(threads) == 2:
            raise ServerUnavailable("gone")
        return sent(*args, **kwargs)

    reg.store_async = store_async  # type: ignore[method-assign]
    w = worker(reg, FakeClient())
    try:
        w.start_stores(with_tokens([op("STORE")]))  # returns while the "round trip" waits
        w.start_loads(StepOps(held=["r"]))
        assert w.get_finished(set()) == (set(), set())
        gate.set()
        w.start_stores(with_tokens([op("STORE", "q")]))
        w.flush_stores(["r", "q"])  # waits for both (both preempted)
        assert w.get_finished(set()) == ({"r"}, set())
        assert threads and all(t.startswith("lmcache-mp-vllm-stores") for t in threads)
        assert (w.stats["stored"], w.stats["store_errors"]) == (1, 1)
    finally:
        gate.set()
        w.shutdown()
    assert not any(t.name.startswith(("lmcache-mp-vllm-loads", "lmcache-mp-vllm-stores"))
                   for t in threading.enumerate())


def test_abort_during_a_pending_load_never_reports_it_sent() -> None:
    """vLLM's scheduler frees a request's blocks on its first "finished" report and
    asserts it still exists on the next: a request aborted while its load is pending
    must be reported "finished receiving" once, and never "finished sending"
    (vLLM 0.32 scheduler.py:3224)."""
    c = FakeClient(hits=3)
    s = side(c)
    r = request(3 * CHUNK + 5)
    assert s.get_num_new_matched_tokens(r, 0) == (3 * CHUNK, True)
    s.update_state_after_alloc(r, list(range(1, 14)), 3 * CHUNK)
    (load,) = s.build_step(out({})).retrieves()
    assert s.request_finished(r) is False  # vLLM keeps the blocks for the load
    assert c.ops("END") == []  # the load is in flight: the session stays
    reg = FakeReg()
    reg.next = Future(True, ready=False)
    w = worker(reg, FakeClient())
    step = s.build_step(out({}))
    assert step.held == []
    w.start_loads(with_tokens([load]))
    assert w.get_finished({"r"}) == (set(), set())
    reg.next.ready = True
    assert w.get_finished(set()) == (set(), {"r"})
    s.update_connector_output({"r"})
    assert c.ops("END") == [("END", "r")]


def test_abort_before_the_retrieve_was_ordered_still_orders_it() -> None:
    """Aborted after allocation, before the step that orders its RETRIEVE: vLLM waits
    for its "finished receiving", so the RETRIEVE still goes out (it also consumes the
    lookup's read locks)."""
    c = FakeClient(hits=2)
    s = side(c)
    r = request(2 * CHUNK + 5)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(1, 10)), 2 * CHUNK)
    assert s.request_finished(r) is False
    (load,) = s.build_step(out({})).retrieves()
    assert (load.request_id, load.end) == ("r", 2 * CHUNK)
    assert s.build_step(out({})).retrieves() == [] and c.ops("END") == []
    s.update_connector_output({"r"})
    assert c.ops("END") == [("END", "r")]


def test_end_session_waits_for_the_lock_frees() -> None:
    """FREE_LOOKUP_LOCKS and END_SESSION of one request are never in flight together:
    a server that handled END_SESSION first would lose what to free."""
    c = FakeClient(hits=2)
    slow = Future(None, ready=False)
    c.free_lookup_locks_async = lambda *a, **k: (c.calls.append(("FREE",)), slow)[1]  # type: ignore[method-assign]
    s = side(c)
    r = request(3 * CHUNK)
    s.get_num_new_matched_tokens(r, 2 * CHUNK)  # vLLM holds the hit: locks freed
    s.update_state_after_alloc(r, list(range(1, 13)), 0)
    assert s.request_finished(r) is False
    assert c.ops("FREE") == [("FREE",)] and c.ops("END") == []
    slow.ready = True
    s.build_step(out({}))
    assert c.ops("END") == [("END", "r")]


def test_preempted_request_looks_up_again_and_loads() -> None:
    """A preempted request lost its blocks; scheduled again, it looks up again (what
    it stored is on the server now) and loads, as LMCache's connector does."""
    c = FakeClient(hits=0)
    s = side(c)
    r = request(3 * CHUNK + 8)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(1, 14)), 0)
    (st,) = s.build_step(out({"r": 3 * CHUNK + 8})).stores()
    assert st.end == 3 * CHUNK
    r.status = SimpleNamespace(name="PREEMPTED")
    c.hits = 3
    assert s.get_num_new_matched_tokens(r, 0) == (3 * CHUNK, True)
    assert len(c.ops("LOOKUP")) == 2
    s.update_state_after_alloc(r, list(range(40, 53)), 3 * CHUNK)
    (load,) = s.build_step(out({})).retrieves()
    assert (load.start, load.end, load.block_ids[0]) == (0, 3 * CHUNK, 40)


def test_each_request_instance_has_its_own_server_session() -> None:
    """Every LMCache release keys a session by request id alone and keeps the chunk
    hashes it computed from the first prompt it saw under that id: a reused id (vLLM
    with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, another engine, a session an engine
    that died left) made a RETRIEVE after a hit find nothing (CI's MLA TP=2 failure),
    and a STORE land under another prompt's key. So the wire id is unique per request
    instance, on every operation of it, and a preempted request keeps its own."""
    c = FakeClient(hits=0)
    s = side(c)
    first = request(2 * CHUNK + 3, rid="v")
    s.get_num_new_matched_tokens(first, 0)
    s.update_state_after_alloc(first, list(range(1, 10)), 0)
    (st,) = s.build_step(out({"v": 2 * CHUNK + 3})).stores()
    first.status = SimpleNamespace(name="PREEMPTED")
    c.hits = 2
    s.get_num_new_matched_tokens(first, 0)  # preempted: looks up again, same session
    s.update_state_after_alloc(first, list(range(20, 29)), 2 * CHUNK)
    (ld,) = s.build_step(out({})).retrieves()
    s.update_connector_output({"v"}, None)
    assert s.request_finished(first) is False  # nothing stored since it resumed
    assert c.ops("END") == [("END", "v")]
    one = set(c.sessions) | {st.wire_id, ld.wire_id}
    assert len(one) == 1 and st.request_id == ld.request_id == "v"
    (sid,) = one
    assert vllm_id(sid) == "v"
    # The same vLLM id again (this engine or another): a session of its own.
    again = request(2 * CHUNK + 3, rid="v")
    c.sessions.clear()
    s.get_num_new_matched_tokens(again, 0)
    other = side(FakeClient(hits=0))
    other.get_num_new_matched_tokens(request(2 * CHUNK, rid="v"), 0)
    (sid2,) = set(c.sessions)
    (sid3,) = set(other.clients["tcp://127.0.0.1:0"].sessions)
    assert len({sid, sid2, sid3}) == 3 and vllm_id(sid2) == vllm_id(sid3) == "v"


def test_worker_sends_the_session_id_and_reports_vllms_id() -> None:
    reg = FakeReg()
    w = worker(reg, FakeClient())
    o = TransferOp("STORE", "r", 0, CHUNK, (1, 2, 3, 4),
                   session_id="r~abc0")
    w.start_stores(with_tokens([o], held=["r"]))
    assert reg.sent[0][1].request_id == "r~abc0"
    w.start_loads(StepOps(held=["r"]))
    assert w.get_finished({"r"})[0] == {"r"}


def test_save_decode_cache_stores_chunks_of_generated_tokens() -> None:
    s = side(FakeClient())
    s.cfg = ConnectorConfig(save_decode_cache=True)
    r = request(CHUNK + 8)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(1, 6)), 0)
    (first,) = s.build_step(out({"r": CHUNK + 8})).stores()
    assert first.end == CHUNK
    # Decoding: one token a step; vLLM's token list grows, new blocks come.
    for i in range(CHUNK - 8):
        r.all_token_ids.append(5000 + i)
        step = s.build_step(out({"r": 1}, {"r": [6 + i // BS] if i % BS == 8 else []}))
        if i < CHUNK - 9:
            assert step.stores() == []
    (decoded,) = step.stores()
    assert (decoded.start, decoded.end) == (CHUNK, 2 * CHUNK)
    # The tokens grew by a chunk: the workers get them again, with this order.
    grown = unpack_token_bytes(step.tokens[decoded.wire_id])
    assert grown[CHUNK + 8:2 * CHUNK] == tuple(5000 + i for i in range(CHUNK - 8))
    # Without the key only whole prompt chunks are stored.
    plain = side(FakeClient())
    r2 = request(CHUNK + 8, "p")
    plain.get_num_new_matched_tokens(r2, 0)
    plain.update_state_after_alloc(r2, list(range(1, 6)), 0)
    plain.build_step(out({"p": CHUNK + 8}))
    r2.all_token_ids.extend(range(CHUNK))
    assert plain.build_step(out({"p": CHUNK}, {"p": [6, 7]})).stores() == []


@pytest.mark.parametrize(("role", "looks_up", "stores"), [
    ("kv_both", True, True), ("kv_consumer", True, False), ("kv_producer", False, True)])
def test_kv_role_is_honoured(role: str, looks_up: bool, stores: bool) -> None:
    c = FakeClient(hits=1)
    cfg = ConnectorConfig(server_urls=("tcp://127.0.0.1:0",))
    s = SchedulerSide(cfg, {cfg.server_urls[0]: c}, model_name="m", kv_world_size=1,
                      block_size=BS, start_health=False, kv_role=role)
    r = request(3 * CHUNK)
    hit = s.get_num_new_matched_tokens(r, 0)
    assert hit == ((CHUNK, True) if looks_up else (0, False))
    assert bool(c.ops("LOOKUP")) is looks_up
    s.update_state_after_alloc(r, list(range(1, 13)), hit[0] or 0)
    s.build_step(out({}))
    step = s.build_step(out({"r": 3 * CHUNK - (hit[0] or 0)}))
    assert bool(step.stores()) is stores


def test_registration_is_retried_in_the_background_while_the_server_is_down() -> None:
    calls = []
    slow = threading.Event()

    def register(_instance_id: int | None) -> FakeReg:
        calls.append(1)
        if len(calls) == 1:
            raise ServerUnavailable("not yet")
        slow.wait(5)  # a registration waiting for its deadline: never on vLLM's thread
        return FakeReg()

    client = FakeClient()
    client.close = lambda: None  # type: ignore[attr-defined]
    w = WorkerSide(ConnectorConfig(health_interval=0.01), client,
                   placement(["tcp://h:1"], 1, 0), "m")
    w.set_registration(register, BS)  # vLLM's start-up: the first attempt, here
    assert w.reg is None
    t0 = time.monotonic()
    w.start_loads(with_tokens([op("RETRIEVE")]))  # fails at once, reported as an error
    assert w.get_finished(set())[1] == {"r"} and w.load_errors()
    w.start_stores(with_tokens([op("STORE")]))  # skipped, does not wait for the retry
    assert time.monotonic() - t0 < 1.0 and w.stats["skipped_stores"] == 1
    assert [t.name for t in threading.enumerate()].count("lmcache-mp-vllm-register") == 1
    slow.set()
    deadline = time.monotonic() + 5
    while w.reg is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.reg is not None and len(calls) == 2
    w.start_stores(with_tokens([op("STORE", "s")]))
    assert len(w.reg.sent) == 1
    w.shutdown()
    assert "lmcache-mp-vllm-register" not in [t.name for t in threading.enumerate()]


def test_no_registration_is_tried_while_heartbeats_go_unanswered() -> None:
    calls = []

    def register(_instance_id: int | None) -> FakeReg:
        calls.append(1)
        raise ServerUnavailable("down")

    client = FakeClient()
    client.close = lambda: None  # type: ignore[attr-defined]
    client.healthy = False
    w = WorkerSide(ConnectorConfig(health_interval=0.01), client,
                   placement(["tcp://h:1"], 1, 0), "m")
    w.set_registration(register, BS)
    time.sleep(0.1)
    assert calls == [1]  # no retry: the heartbeat says the server is down
    client.healthy = True
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) >= 2
    w.shutdown()


def test_config_keys_are_lmcaches() -> None:
    c = ConnectorConfig.from_extra({"lmcache.mp.host": "127.0.0.1", "lmcache.mp.port": "6000",
                                    "lmcache.mp.mq_timeout": 7, "lmcache.mp.isolated_ipc": False,
                                    "lmcache.mp.mp_transfer_mode": "engine_driven",
                                    "other.key": 1})
    assert c.server_urls == ("tcp://127.0.0.1:6000",) and c.mq_timeout == 7.0
    assert c.mode == "engine"
    assert ConnectorConfig.from_extra({}).server_urls == ("tcp://localhost:5555",)
    c = ConnectorConfig.from_extra({"lmcache.mp.server_urls": "tcp://a:1, tcp://b:2",
                                    "lmcache.mp.host": "ignored"})
    assert c.server_urls == ("tcp://a:1", "tcp://b:2")
    with pytest.raises(InvalidArgument, match="unknown"):
        ConnectorConfig.from_extra({"lmcache.mp.prot": 1})
    with pytest.raises(InvalidArgument, match="mp_transfer_mode"):
        ConnectorConfig.from_extra({"lmcache.mp.mp_transfer_mode": "fast"})
    with pytest.raises(InvalidArgument, match="mq_timeout"):
        ConnectorConfig.from_extra({"lmcache.mp.mq_timeout": 0})
    assert ConnectorConfig.from_extra({}).lookup_wait == 0.005
    assert ConnectorConfig.from_extra({"lmcache.mp.lookup_wait": 0}).lookup_wait == 0.0
    for bad in (-0.001, "inf", "soon"):
        with pytest.raises(InvalidArgument, match="lookup_wait"):
            ConnectorConfig.from_extra({"lmcache.mp.lookup_wait": bad})


@pytest.mark.parametrize(("key", "value", "why"), [
    ("lazy_offload", True, "stores are submitted after each forward pass"),
    ("lazy_offload_threshold", 100, "lazy offload is not supported"),
    ("lazy_offload_policy", "fifo", "lazy offload is not supported"),
    ("autostart", "true", "the server is started separately"),
    ("autostart.server_args", "--port 1", "does not start the server"),
    ("nonblocking_lookup_status", False, "never block"),
    ("hash_algorithm", "sha256", "blake3"),
    ("isolated_ipc", True, "same IPC namespace"),
    ("transfer_intermediate_tensors", True, "only KV caches"),
])
def test_lmcaches_keys_are_never_silently_ignored(key: str, value: Any, why: str) -> None:
    """Each of LMCache's keys is honoured, accepted with a value that asks for what
    this connector does anyway, or refused saying what to do."""
    with pytest.raises(InvalidArgument, match=why):
        ConnectorConfig.from_extra({f"lmcache.mp.{key}": value})


def test_lmcaches_keys_with_our_behaviour_are_accepted_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO, "lmcache_mp")
    ConnectorConfig.from_extra({"lmcache.mp.lazy_offload": "false",
                                "lmcache.mp.hash_algorithm": "blake3",
                                "lmcache.mp.use_vmm_api": False,
                                "lmcache.mp.nonblocking_lookup_status": True})
    said = caplog.text
    for key in ("lazy_offload", "hash_algorithm", "use_vmm_api", "nonblocking_lookup_status"):
        assert f"lmcache.mp.{key}" in said


def test_use_vmm_api_true_is_refused_saying_why() -> None:
    """LMCache's ``use_vmm_api=true`` makes vLLM 0.34 allocate a POSIX-fd exportable
    cache for the server to map (EXPORTS_FD), which no LMCache release can receive:
    refused when vLLM reads the config, saying so (issue 34 item 6). Before
    (1470964) it was accepted and silently meant in-process copies."""
    with pytest.raises(InvalidArgument, match="use_vmm_api=True.*EXPORTS_FD.*no LMCache "
                                              "release"):
        ConnectorConfig.from_extra({"lmcache.mp.use_vmm_api": True})


def test_rank_placement_is_lmcaches() -> None:
    urls = ["tcp://a:1", "tcp://b:2"]
    got = [placement(urls, 4, r) for r in range(4)]
    assert [(p.url, p.kv_world_size, p.kv_worker_id) for p in got] == [
        ("tcp://a:1", 2, 0), ("tcp://a:1", 2, 1), ("tcp://b:2", 2, 0), ("tcp://b:2", 2, 1)]
    with pytest.raises(InvalidArgument):
        placement(urls, 3, 0)


# -------------------------------------------------------------------------- MLA
def test_mla_detection_is_lmcaches_mla_only() -> None:
    from lmcache_mp.integrations.vllm.kv_caches import mla_only

    assert mla_only(SimpleNamespace(use_mla=True, is_hybrid=False))
    assert not mla_only(SimpleNamespace(use_mla=False, is_hybrid=False))
    assert not mla_only(SimpleNamespace())               # no attribute: not MLA
    assert not mla_only(SimpleNamespace(use_mla="yes"))  # LMCache: a bool only
    with pytest.raises(InvalidArgument, match="hybrid"):
        mla_only(SimpleNamespace(use_mla=True, is_hybrid=True))


def test_mla_cpu_layers_are_wrapped_in_place() -> None:
    import torch

    from lmcache_mp.integrations.vllm.kv_caches import wrap_layers

    # vLLM 0.32's MLA views: [num_blocks, 1, block_size, latent], one allocation.
    backing = torch.zeros(2, 10, 1, BS, 24, dtype=torch.float16)
    cache = wrap_layers(list(backing), BS, "engine", mla=True)
    g = cache.geometry
    assert g.mla and (g.num_layers, g.num_blocks, g.block_size, g.num_heads, g.head_dim) == (
        2, 10, BS, 1, 24)
    assert g.kv_planes == 1
    backing[1, 3, 0, 5] = 7.0  # the cache reads vLLM's memory, not a copy
    assert float(cache.torch_layers[1][3, 5, 0]) == 7.0  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match="should have one head"):
        wrap_layers(list(torch.zeros(2, 10, 2, BS, 24)), BS, mla=True)
    with pytest.raises(InvalidArgument, match="--block-size"):
        wrap_layers(list(backing), 8, mla=True)  # block size on the wrong axis
    with pytest.raises(InvalidArgument, match="'lmcache_driven' needs memory"):
        wrap_layers(list(backing), BS, "lmcache", mla=True)


def test_fused_cpu_layers_are_wrapped_in_place_as_lmcaches_objects() -> None:
    """vLLM's 4-D fused K/V views (a permuted LBNHC view here) are wrapped without a
    copy, and a chunk's object is what LMCache's connector writes for them:
    [layers, tokens, heads * C], each (token, head) row as vLLM holds it."""
    import numpy as np
    import torch

    from lmcache_mp.integrations.vllm.kv_caches import wrap_layers
    from lmcache_mp.ipc.paged_copy import gather_chunk, scatter_chunk

    heads, c, nb = 2, 8, 12
    physical = torch.arange(2 * nb * BS * heads * c, dtype=torch.int16).view(
        2, nb, BS, heads, c)  # LBNHC memory
    layers = [physical[i].permute(0, 2, 1, 3) for i in range(2)]  # logical [B, H, N, C]
    cache = wrap_layers(layers, BS, "engine")
    g = cache.geometry
    assert g.fused and g.kv_planes == 1 and (g.num_heads, g.head_dim) == (heads, c)
    ids = np.array([3, 4, 9, 1])
    obj = np.zeros((2, len(ids) * BS, heads * c), np.int16)
    gather_chunk(cache.layers, ids, obj, g)  # type: ignore[attr-defined]
    for layer in range(2):
        want = physical[layer][torch.from_numpy(ids)].reshape(len(ids) * BS, heads * c)
        assert np.array_equal(obj[layer], want.numpy())
    physical.zero_()
    scatter_chunk(obj, cache.layers, ids, g, skip_blocks=1)  # type: ignore[attr-defined]
    assert not physical[:, 3].any() and physical[:, 4].any() and physical[:, 1].any()


def test_mla_rank_placement_is_lmcaches() -> None:
    # LMCache's ParallelStrategy (0.5.3: world // tp, rank // tp; 0.5.6+: pp stages x
    # dcp shards): MLA KV is split by pipeline stage only; the first TP rank per server
    # stores.
    def rows(urls: list[str], world: int, tp: int) -> list[tuple[str, int, int, bool]]:
        return [(p.url, p.kv_world_size, p.kv_worker_id, p.writer)
                for p in (placement(urls, world, r, mla=True, tp_size=tp)
                          for r in range(world))]

    assert rows(["a"], 1, 1) == [("a", 1, 0, True)]
    assert rows(["a"], 2, 2) == [("a", 1, 0, True), ("a", 1, 0, False)]
    # Two servers, TP 4: each server's first rank stores, all keys world 1 / rank 0.
    assert rows(["a", "b"], 4, 4) == [("a", 1, 0, True), ("a", 1, 0, False),
                                      ("b", 1, 0, True), ("b", 1, 0, False)]
    # PP 2 x TP 2 on one server: a stage is a KV shard.
    assert rows(["a"], 4, 2) == [("a", 2, 0, True), ("a", 2, 0, False),
                                 ("a", 2, 1, True), ("a", 2, 1, False)]
    assert placement(["a"], 2, 1, tp_size=2).writer  # not MLA: every rank stores
    with pytest.raises(InvalidArgument, match="MLA"):
        placement(["a", "b", "c"], 3, 0, mla=True, tp_size=1)


def test_mla_non_writer_rank_loads_but_never_stores() -> None:
    reg, client = FakeReg(), FakeClient()
    client.close = lambda: None  # type: ignore[attr-defined]
    w = WorkerSide(ConnectorConfig(), client, placement(["tcp://h:1"], 2, 1, mla=True,
                                                        tp_size=2), "m")
    w.set_registration(lambda _instance_id: reg, BS)
    w.start_stores(with_tokens([op("STORE")]))
    assert reg.sent == [] and w.stats["skipped_stores"] == 0
    w.start_loads(StepOps(held=["r"]))
    assert w.get_finished({"r"}) == ({"r"}, set())  # nothing to wait for
    w.start_loads(with_tokens([op("RETRIEVE", "x")]))
    ((name, key, _),) = reg.sent
    assert (name, key.world_size, key.worker_id) == ("RETRIEVE", 1, 0)


def test_mla_lookups_declare_every_tp_rank_a_reader() -> None:
    c = FakeClient(hits=2)
    cfg = ConnectorConfig(server_urls=("tcp://h:1",))
    s = SchedulerSide(cfg, {"tcp://h:1": c}, model_name="m", kv_world_size=1,
                      block_size=BS, lookup_tp_size=2, mla=True, start_health=False)
    r = request(3 * CHUNK)
    # vLLM's prefix cache covers the hit: the LOOKUP's locks are freed, same readers.
    assert s.get_num_new_matched_tokens(r, 2 * CHUNK) == (0, False)
    s.update_state_after_alloc(r, list(range(1, 13)), 0)
    assert c.lookup_kw == [(2, True)] and c.free_kw == [(2, True)]


# ------------------------------------------------------------------ metrics
def test_scheduler_metrics_count_lookups_and_hits_once_per_interval() -> None:
    c = FakeClient(hits=2)
    s = side(c)
    r = request(3 * CHUNK + 10)
    assert s.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, True)
    s.get_num_new_matched_tokens(r, 0)  # asked again: the same lookup, not counted twice
    data = s.metrics.take()
    assert data is not None
    assert (data["lookups"], data["lookup_tokens"], data["hit_tokens"]) == (1, 3 * CHUNK,
                                                                           2 * CHUNK)
    assert len(data["lookup_seconds"]) == 1 and data["lookup_seconds"][0] >= 0
    assert s.metrics.take() is None  # taken: the next interval starts empty


def test_worker_metrics_count_tokens_moved_and_failures() -> None:
    reg = FakeReg()
    w = worker(reg, FakeClient())
    w.start_loads(with_tokens([TransferOp("RETRIEVE", "a", 0, CHUNK,
                                      (1, 2, 3, 4), "", 2 * BS)]))
    w.start_stores(with_tokens([op("STORE", "b")]))
    w.get_finished(set())
    data = w.metrics.take()
    assert data is not None
    # The retrieve skipped vLLM's 2 blocks: it wrote CHUNK - 2 * BS tokens.
    assert (data["loads"], data["loaded_tokens"]) == (1, CHUNK - 2 * BS)
    assert (data["stores"], data["stored_tokens"]) == (1, CHUNK)
    assert len(data["load_seconds"]) == len(data["store_seconds"]) == 1
    reg.next = Future(False)
    w.start_loads(with_tokens([op("RETRIEVE", "c")]))
    w.start_stores(with_tokens([op("STORE", "d")]))
    w.get_finished(set())
    data = w.metrics.take()
    assert data is not None
    assert (data["loads"], data["load_failures"], data["loaded_tokens"]) == (0, 1, 0)
    assert (data["stores"], data["store_failures"]) == (0, 1)


def test_stats_aggregate_and_reduce_as_vllm_uses_them() -> None:
    from lmcache_mp.integrations.vllm import stats

    rank0 = {"loads": 1, "loaded_tokens": 256, "load_seconds": [0.002]}
    rank1 = {"loads": 1, "loaded_tokens": 256, "load_seconds": [0.004]}
    sched = {"lookups": 2, "lookup_tokens": 1024, "hit_tokens": 256, "lookup_seconds": [0.001]}
    total = stats.aggregate(stats.aggregate(dict(rank0), rank1), sched)
    assert total["loaded_tokens"] == 512 and total["load_seconds"] == [0.002, 0.004]
    assert not stats.is_empty(total) and stats.is_empty({}) and stats.is_empty(
        {"loads": 0, "load_seconds": []})
    line = stats.reduce(total)
    assert line["hit_rate"] == 0.25 and line["load_avg_ms"] == 3.0
    assert line["lookup_avg_ms"] == 1.0 and "store_avg_ms" not in line
    # Every Prometheus metric is fed by a key the sides record.
    assert {m.key for m in stats.METRICS} <= set(stats.COUNTERS) | set(stats.DURATIONS)


# ------------------------------------------------------- vLLM releases (compat.py)
class _TokenBuffer(array.array):  # type: ignore[type-arg]
    """vLLM 0.34's ``TokenBuffer`` (``v1/token_buffer.py``: an ``array('i')`` subclass,
    handed out inside a ``ConstantList``), made to fail on any per-token read: the
    connector must pack it in bulk. The tree job checks vLLM's own class the same way
    (tests/integrations/vllm/test_vllm_034.py)."""

    def __new__(cls, tokens: Any) -> Any:
        return super().__new__(cls, "i", tokens)

    def __iter__(self) -> Any:
        raise AssertionError("a TokenBuffer read token by token")

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("a TokenBuffer read token by token")


class _ConstantList(Sequence[int]):
    """vLLM's ``v1/utils.py`` ``ConstantList``: a read-only view of ``_x``."""

    def __init__(self, x: Any) -> None:
        self._x = x

    def __getitem__(self, i: Any) -> Any:
        return self._x[i]

    def __iter__(self) -> Any:
        return iter(self._x)

    def __len__(self) -> int:
        return len(self._x)


def test_a_token_buffer_is_packed_without_a_python_loop() -> None:
    c = FakeClient(hits=0)
    s = side(c)
    r = request(2 * CHUNK + 5)
    r.all_token_ids = _ConstantList(_TokenBuffer(range(1, 2 * CHUNK + 6)))
    s.get_num_new_matched_tokens(r, 0)
    assert c.ops("LOOKUP") == [("LOOKUP", 0, 2 * CHUNK, "", 1)]
    key = s.trackers["r"].key
    assert key is not None and key.token_bytes == packed(range(1, 2 * CHUNK + 6))


@pytest.mark.parametrize("attribute", ["skip_reading_external_kv",  # vLLM 0.34
                                       "skip_reading_prefix_cache"])  # vLLM 0.32 / 0.33
def test_a_request_vllm_reads_no_external_kv_for_is_not_looked_up(attribute: str) -> None:
    """Prompt-logprob requests (and others that skip cached prefixes): vLLM zeroes the
    connector's hit, so a LOOKUP would take read locks nothing frees (the tracker never
    polls it again). Not looked up; its chunks are still stored."""
    c = FakeClient(hits=3)
    s = side(c)
    r = request(3 * CHUNK, **{attribute: True})
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, list(range(1, 13)), 0)
    (st,) = s.build_step(out({"r": 3 * CHUNK})).stores()
    assert (st.start, st.end) == (0, 3 * CHUNK)
    assert c.ops("LOOKUP") == [] and c.ops("QUERY") == [] and c.ops("FREE") == []
    other = request(3 * CHUNK, rid="o", **{attribute: False})
    s.get_num_new_matched_tokens(other, 0)
    assert len(c.ops("LOOKUP")) == 1


def test_the_resumed_ids_of_each_release() -> None:
    from lmcache_mp.integrations.vllm.compat import resumed_req_ids

    assert resumed_req_ids(SimpleNamespace(resumed_req_ids={"a"})) == {"a"}  # 0.32 / 0.33
    assert resumed_req_ids(SimpleNamespace(req_ids=["a"])) == set()  # 0.34: none


def test_the_registration_mode_follows_what_vllm_was_told() -> None:
    from lmcache_mp.integrations.vllm.kv_caches import registration_mode

    # vLLM 0.34 (it asks kv_cache_access): auto on a GPU is engine-driven (IN_PROCESS
    # keeps vLLM's extensible VMM cache, which CUDA IPC cannot share).
    assert registration_mode("auto", "cuda", True) == "engine"
    assert registration_mode("lmcache", "cuda", True) == "lmcache"
    assert registration_mode("engine", "cuda", True) == "engine"
    # 0.32 / 0.33, and CPU caches: lmcache_mp's own auto.
    assert registration_mode("auto", "cuda", False) == "auto"
    assert registration_mode("auto", "cpu", True) == "auto"


def test_a_registration_that_cannot_work_is_refused_at_start_not_retried() -> None:
    from lmcache_mp.errors import ProtocolMismatch
    from lmcache_mp.integrations.vllm.kv_caches import refusal

    calls = []

    def register(_instance_id: int | None) -> FakeReg:
        calls.append(1)
        raise InvalidArgument(refusal("auto", "engine", "cuda", True,
                                      ProtocolMismatch("no pool")))

    client = FakeClient()
    client.close = lambda: None  # type: ignore[attr-defined]
    w = WorkerSide(ConnectorConfig(health_interval=0.01), client,
                   placement(["tcp://h:1"], 1, 0), "m")
    with pytest.raises(InvalidArgument, match="--shm-name NAME") as err:
        w.set_registration(register, BS)
    assert "mp_transfer_mode=lmcache_driven" in str(err.value)
    assert "kv_cache_access IN_PROCESS" in str(err.value)
    time.sleep(0.05)
    assert calls == [1] and "lmcache-mp-vllm-register" not in [
        t.name for t in threading.enumerate()]
    w.shutdown()
    lmcache = refusal("lmcache", "lmcache", "cuda", True, InvalidArgument("VMM memory"))
    assert "set lmcache.mp.mp_transfer_mode=auto or engine_driven" in lmcache


def test_a_refusal_found_after_the_server_came_up_stops_the_retries() -> None:
    calls = []

    def register(_instance_id: int | None) -> FakeReg:
        calls.append(1)
        if len(calls) == 1:
            raise ServerUnavailable("not yet")
        raise InvalidArgument("the server has no pool")

    client = FakeClient()
    client.close = lambda: None  # type: ignore[attr-defined]
    w = WorkerSide(ConnectorConfig(health_interval=0.01), client,
                   placement(["tcp://h:1"], 1, 0), "m")
    w.set_registration(register, BS)
    deadline = time.monotonic() + 5
    while "lmcache-mp-vllm-register" in [t.name for t in threading.enumerate()]:
        assert time.monotonic() < deadline, "still retrying a registration that cannot work"
        time.sleep(0.01)
    time.sleep(0.05)
    assert calls == [1, 1] and w.reg is None
    w.shutdown()


def test_sleep_unregisters_and_wake_registers_again_under_the_same_instance() -> None:
    """vLLM 0.33+ (sleep mode) and 0.34 (weight updates): ``unregister_kv_caches``
    before the memory is released, ``restore_kv_caches`` once fresh memory is behind
    the same views. Pending stores finish first; while unregistered loads fail (vLLM
    recomputes) and stores are skipped; the restored registration has the instance id."""
    regs: list[FakeReg] = []
    asked: list[int | None] = []

    def register(instance_id: int | None) -> FakeReg:
        asked.append(instance_id)
        reg = FakeReg()
        reg.instance_id = 77 if instance_id is None else instance_id
        reg.unregistered = False  # type: ignore[attr-defined]

        def unregister(timeout: float) -> None:
            reg.unregistered = True  # type: ignore[attr-defined]

        reg.unregister = unregister  # type: ignore[method-assign]
        regs.append(reg)
        return reg

    client = FakeClient()
    client.close = lambda: None  # type: ignore[attr-defined]
    w = WorkerSide(ConnectorConfig(), client, placement(["tcp://h:1"], 1, 0), "m")
    w.set_registration(register, BS)
    pending = Future(True, ready=False)
    regs[0].next = pending
    w.start_stores(with_tokens([op("STORE")]))
    finished = threading.Timer(0.1, lambda: setattr(pending, "ready", True))
    finished.start()
    w.unregister()
    finished.join()
    assert pending.ready, "unregistered while a store still read the cache"
    assert regs[0].unregistered and w.reg is None and w.stats["stored"] == 1
    w.unregister()  # idempotent
    w.start_loads(with_tokens([op("RETRIEVE", "x")]))
    w.start_stores(with_tokens([op("STORE", "y")]))
    assert w.get_finished(set())[1] == {"x"} and w.load_errors() == {1, 2, 3, 4}
    assert w.stats["skipped_stores"] == 1 and len(regs[0].sent) == 1
    w.restore()
    w.restore()  # idempotent
    assert asked == [None, 77] and w.reg is regs[1] and not regs[1].unregistered
    w.start_loads(with_tokens([op("RETRIEVE", "z")]))
    assert [s[0] for s in regs[1].sent] == ["RETRIEVE"]
    w.shutdown()


def test_the_amx_request_is_harmless_and_answered_once(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    from lmcache_mp.integrations.vllm import amx

    monkeypatch.setattr(amx, "_answer", None)
    with caplog.at_level("INFO", logger="lmcache_mp"):
        first = amx.request_amx_tiles()
        assert amx.request_amx_tiles() == first and first in amx.AMX_STATES
    assert len([r for r in caplog.records if "AMX tile permission" in r.message]) == 1
    if "amx_tile" not in open("/proc/cpuinfo").read().split():
        assert first == "no AMX"
    else:
        assert first in ("granted", "already granted")
    monkeypatch.setattr(amx, "_answer", None)
    monkeypatch.setattr(amx.platform, "machine", lambda: "aarch64")
    assert amx.request_amx_tiles() == "not x86-64 Linux"


def test_the_protocol_family_can_be_named_and_a_wrong_name_is_refused() -> None:
    """lmcache.mp.protocol (issue 37): the family `lmcache-mp info URL` prints, or a
    release name; each Client the connector makes then sends no probe."""
    assert ConnectorConfig.from_extra({}).protocol == "auto"
    assert ConnectorConfig.from_extra({"lmcache.mp.protocol": "0.5.7"}).protocol == "0.5.7"
    assert ConnectorConfig.from_extra({"lmcache.mp.protocol": "0.5.4"}).protocol == "0.5.4"
    with pytest.raises(InvalidArgument, match=r"lmcache.mp.protocol must be 'auto' or one of"):
        ConnectorConfig.from_extra({"lmcache.mp.protocol": "0.6.0"})


def test_a_retrieve_writes_only_the_blocks_after_its_skip() -> None:
    """What a failed load reports (issue 34 item 2): the blocks of the range after
    ``skip_first_n_tokens``, never vLLM's own computed blocks before it."""
    c = FakeClient(hits=3)
    s = side(c)
    r = request(3 * CHUNK + 5)
    vllm_hit = CHUNK + 2 * BS
    s.get_num_new_matched_tokens(r, vllm_hit)
    s.update_state_after_alloc(r, list(range(1, 3 * CHUNK // BS + 2)), 3 * CHUNK - vllm_hit)
    (op,) = s.build_step(out({})).retrieves()
    assert op.written_block_ids == op.block_ids[2:]
    assert s.trackers["r"].load_blocks == frozenset(op.block_ids[2:])
    # Reported invalid: the request is not loaded from the cache again (issue 34 item 3).
    s.update_connector_output({"r"}, None, set(op.block_ids[2:3]))
    assert s.trackers["r"].load_failed


def test_a_reset_keys_every_live_request_afresh() -> None:
    """``reset_cache`` (issue 34 item 4; review 34 F9): a request queued with its
    (eager) lookup answered, vLLM not having asked for its hit yet, starts afresh (its
    lookup's locks freed, its session ended; its new key carries the reset's tag, a
    salt too long for it hashed within LMCache's 128 characters); a
    request whose blocks wait for a load it was looked up for gets that load under the
    key and session it was looked up with (whose read locks the RETRIEVE consumes),
    and stores nothing after it (its KV is the old weights'). Before (1470964 had no
    reset; issue 34's first version) the load went out under the new key, which holds
    nothing: a failed load, under vLLM's ``fail`` policy a failed request."""
    c = FakeClient(hits=3)
    s = side(c)
    loading, waiting = request(4 * CHUNK, "a"), request(3 * CHUNK, "b", salt="x" * 128)
    s.get_num_new_matched_tokens(loading, CHUNK + BS)
    s.update_state_after_alloc(loading, list(range(1, 4 * CHUNK // BS + 1)), 2 * CHUNK - BS)
    s.on_new_request(waiting)
    a_session, b_session = s.trackers["a"].session_id, s.trackers["b"].session_id
    c.calls.clear()
    c.sessions.clear()
    assert s.reset() is True
    assert "b" not in s.trackers  # looked up afresh when vLLM asks again
    assert c.ops("FREE") == [("FREE", 0, 3 * CHUNK)] and c.sessions[0] == b_session
    assert ("END", "b") in c.calls and ("END", "a") not in c.calls
    t = s.trackers["a"]
    assert (t.session_id, t.salt) == (a_session, "")
    (op,) = s.build_step(out({})).retrieves()
    assert (op.cache_salt, op.session_id) == ("", a_session)
    s.update_connector_output({"a"})
    # Its last chunk computed: not stored (1470964's successor stored it under the
    # new key, the old weights' KV in the new generation).
    assert s.build_step(out({"a": CHUNK}, {"a": []})).stores() == []
    again = s._tracker(waiting)
    assert again.salt.startswith("h") and again.salt.endswith(s._reset_tag)
    assert len(again.salt) <= 128 and again.session_id != b_session


def test_a_local_hit_ending_mid_block_stores_its_last_chunk_at_once() -> None:
    """vLLM's prefix cache holds the whole prompt but the last token (recomputed),
    shown to the connector rounded down to a block; the servers hold nothing. The
    step that computes that last token completes the prompt's last chunk: it is stored
    then, not some blocks of decoding later (lost if the request ends first). Before
    (1470964) only the first chunk was stored in that step (issue 34 item 5)."""
    c = FakeClient(hits=0)
    s = side(c)
    r = request(2 * CHUNK)
    assert s.get_num_new_matched_tokens(r, 2 * CHUNK - BS) == (0, False)
    s.update_state_after_alloc(r, list(range(1, 2 * CHUNK // BS + 1)), 0)
    first = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=2 * CHUNK - 1)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={"r": 1}, preempted_req_ids=None)
    (op,) = s.build_step(first).stores()
    assert (op.start, op.end) == (0, 2 * CHUNK)
