"""What a request's keys carry and what it leaves locked on the servers, in the cases
the review of issue 34 found wrong (findings F2-F10): engines resetting beside each
other, LoRA adapters, requests aborted or left queued before their lookup's answer,
a shutdown with requests still queued, lookups older than the servers' read locks,
vLLM 0.34's async admission, a load failure reported on a block a request no longer
holds, requests alive across a reset, a weights version the keys cannot carry,
stores that fail after their KV event, and a hit vLLM grants only in part.

Offline, with the fake servers of test_connector_units.py; where the behaviour is
vLLM's (its scheduler's queues, LoRA requests, data-parallel configs, its KV events)
test_vllm_034.py drives vLLM's own code. Each test says what 1470964 / 4549dee did."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_mp.errors import InvalidArgument
from lmcache_mp.integrations.vllm.config import ConnectorConfig
from lmcache_mp.integrations.vllm.ops import StepOps
from lmcache_mp.integrations.vllm.scheduler import SchedulerSide

from .test_connector_units import (
    BS,
    CHUNK,
    Answering,
    FakeClient,
    FakeReg,
    Future,
    op,
    out,
    request,
    with_tokens,
    worker,
)


def side(client: FakeClient, **cfg: Any) -> SchedulerSide:
    options = {"server_urls": ("tcp://127.0.0.1:1",), "lookup_wait": 0.0, **cfg}
    kw = {k: options.pop(k) for k in ("events", "idle_waits") if k in options}
    return SchedulerSide(ConnectorConfig(**options), {"tcp://127.0.0.1:1": client},
                         model_name="m", kv_world_size=1, block_size=BS,
                         start_health=False, **kw)


def looked_up_salts(c: FakeClient) -> list[str]:
    return [call[3] for call in c.ops("LOOKUP")]


# ------------------------------------------------------------- F2: reset tags
def test_engines_sharing_a_server_never_share_a_reset_tag() -> None:
    """Engine X (weights v1) resets for v2; engine Y starts from the v2 checkpoint
    without a weights version; both reset for v3. Y's v3 keys must not be X's v2 keys
    (nor X's v3 Y's v2 ...): every reset tags the keys with a tag of its own. Before
    (4549dee) the tag counted this process's resets: X's v2 and Y's v3 were both
    ``#reset1``, and Y loaded the v2 weights' KV as v3's."""
    x_client, y_client = FakeClient(), FakeClient()
    x, y = side(x_client), side(y_client)
    x.reset()
    x.get_num_new_matched_tokens(request(CHUNK, "x2"), 0)
    y.get_num_new_matched_tokens(request(CHUNK, "y2"), 0)
    x.reset()
    y.reset()
    x.get_num_new_matched_tokens(request(CHUNK, "x3"), 0)
    y.get_num_new_matched_tokens(request(CHUNK, "y3"), 0)
    x_v2, x_v3 = looked_up_salts(x_client)
    y_v2, y_v3 = looked_up_salts(y_client)
    assert y_v2 == ""  # no reset yet: the plain key, shared with X's v1 KV (documented)
    assert len({x_v2, x_v3, y_v3, ""}) == 4, (x_v2, x_v3, y_v3)


# --------------------------------------------------------------------- F3: LoRA
def lora(name: str, path: str, lora_id: int = 1) -> Any:
    """vLLM's LoRARequest as the connector reads it (the live test uses vLLM's own)."""
    return SimpleNamespace(lora_name=name, lora_int_id=lora_id, lora_path=path,
                           name=name, adapter_id=lora_id, path=path)


def test_a_lora_adapter_keys_apart_from_the_base_model_and_other_adapters() -> None:
    """vLLM puts the adapter's name and path in its block hashes: the base model's KV
    and each adapter's differ for the same tokens. Same adapter (another id, as after a
    reload): same key. Before (1470964 and 4549dee) every request of the same tokens
    shared one key: an adapter request loaded the base model's KV."""
    c = FakeClient()
    s = side(c)
    s.get_num_new_matched_tokens(request(CHUNK, "base"), 0)
    s.get_num_new_matched_tokens(request(CHUNK, "a1", lora_request=lora("a", "/p/a")), 0)
    s.get_num_new_matched_tokens(request(CHUNK, "a2", lora_request=lora("a", "/p/a", 7)), 0)
    s.get_num_new_matched_tokens(request(CHUNK, "a3", lora_request=lora("a", "/p/a2")), 0)
    s.get_num_new_matched_tokens(request(CHUNK, "b", lora_request=lora("b", "/p/a")), 0)
    s.get_num_new_matched_tokens(request(CHUNK, "as", salt="u1",
                                         lora_request=lora("a", "/p/a")), 0)
    base, a1, a2, a3, b, salted = looked_up_salts(c)
    assert base == "" and a1 == a2 and a1.startswith("#lora-")
    assert len({base, a1, a3, b, salted}) == 5 and salted.startswith("u1#lora-")


# ------------------------------------------------ F4: read locks of lookups
def test_an_abort_before_the_lookups_answer_frees_what_the_server_says_it_locked() -> None:
    """Aborted while its eager lookup is unanswered (an L2 load running): no FREE until
    the server says how many chunks it locked (QUERY), then exactly those, then
    END_SESSION. Before (4549dee) FREE of every looked-up chunk went out at once: on
    0.5.3 it frees other requests' locks, on 0.5.6+ nothing (the prefetch runs), and
    the locks stayed to the TTL."""
    c = FakeClient()
    c.ack = Future(None, ready=False)  # the server has not taken the LOOKUP yet
    s = side(c)
    r = request(4 * CHUNK)
    s.on_new_request(r)
    assert s.request_finished(r) is False
    s.build_step(out({}))
    assert c.ops("FREE") == [] and c.ops("QUERY") == [] and c.ops("END") == []
    c.ack.ready = True
    c.answers = [Future(None), Future(1)]  # the L2 prefetch still runs, then 1 chunk
    s.build_step(out({}))
    assert c.ops("FREE") == []
    s.build_step(out({}))
    assert c.ops("FREE") == [("FREE", 0, CHUNK)]
    assert c.calls[-1] == ("END", "r")


def test_a_reset_before_the_lookups_answer_also_waits_for_it() -> None:
    c = FakeClient()
    c.ack = Future(None, ready=False)
    s = side(c)
    s.on_new_request(request(4 * CHUNK))
    s.reset()
    assert c.ops("FREE") == []
    c.ack.ready = True
    c.answers = [Future(2)]
    s.build_step(out({}))
    assert c.ops("FREE") == [("FREE", 0, 2 * CHUNK)] and c.calls[-1] == ("END", "r")


def test_shutdown_releases_queued_requests_locks_and_sessions() -> None:
    """vLLM shuts down with requests still queued (eager lookups answered: their chunks
    read-locked) and one whose blocks wait for its RETRIEVE: every lock is freed and
    every session ended. Before (4549dee) only finished requests were: the queued ones'
    locks stayed to the servers' TTL, their sessions 600 s."""
    c = FakeClient(hits=3)
    s = side(c)
    for i in range(3):
        s.on_new_request(request(4 * CHUNK, rid=f"q{i}"))
    loading = request(4 * CHUNK, rid="l")
    assert s.get_num_new_matched_tokens(loading, 0) == (3 * CHUNK, True)
    s.update_state_after_alloc(loading, list(range(1, 4 * CHUNK // BS + 1)), 3 * CHUNK)
    c.calls.clear()
    s.shutdown()
    assert sorted(c.ops("FREE")) == [("FREE", 0, 3 * CHUNK)] * 4
    assert sorted(c.ops("END")) == [("END", r) for r in ("l", "q0", "q1", "q2")]
    assert s.trackers == {} and s._finishing == []


def test_a_lookup_older_than_half_the_read_locks_life_is_made_again() -> None:
    """A request looked up eagerly, then queued past half the servers' read-lock
    lifetime (``lmcache.mp.read_lock_ttl``, here 0.2 s): when vLLM asks for its hit it
    is looked up again under a new session, the old locks freed and the old session
    ended, so its RETRIEVE never meets chunks whose locks expired (evicted: a failed
    load, under vLLM's ``fail`` policy a failed request). A younger lookup is used as
    is. Before (4549dee) the old answer was used whatever its age (and there was no
    key)."""
    c = FakeClient(hits=2)
    s = side(c, read_lock_ttl=0.2)
    young, old = request(3 * CHUNK, "young"), request(3 * CHUNK, "old")
    s.on_new_request(old)
    first_session = s.trackers["old"].session_id
    time.sleep(0.15)
    s.on_new_request(young)
    assert s.get_num_new_matched_tokens(young, 0) == (2 * CHUNK, True)
    assert len(c.ops("LOOKUP")) == 2
    c.calls.clear()
    c.sessions.clear()
    assert s.get_num_new_matched_tokens(old, 0) == (2 * CHUNK, True)
    assert [x[0] for x in c.calls] == ["FREE", "END", "LOOKUP", "QUERY"]
    assert c.sessions[:2] == [first_session] * 2 and c.sessions[2] != first_session
    assert s.trackers["old"].session_id == c.sessions[2]
    with pytest.raises(InvalidArgument, match="read_lock_ttl"):
        ConnectorConfig.from_extra({"lmcache.mp.read_lock_ttl": 0})
    assert ConnectorConfig.from_extra({"lmcache.mp.read_lock_ttl": 60}).read_lock_ttl == 60


# --------------------------------------------------- F7: vLLM 0.34's may_load_async
def test_may_load_says_yes_for_a_known_hit_only() -> None:
    """vLLM 0.34 asks ``may_load_async`` right after ``on_new_request`` (under
    ``--max-num-inflight-kv-loads``), and a yes holds its other async loads back.
    Before (4549dee) every request of a chunk or more said yes before its answer was
    in: a miss too. Now: the answer is waited for within ``lookup_wait`` (one budget
    between two steps), and only a hit says yes."""
    miss = FakeClient(hits=0)
    miss.ack = Answering(None)
    s = side(miss, lookup_wait=0.5)
    r = request(4 * CHUNK)
    s.on_new_request(r)
    assert s.may_load(r) is False
    hit = FakeClient(hits=2)
    hit.ack = Answering(None)
    s = side(hit, lookup_wait=0.5)
    s.on_new_request(r)
    assert s.may_load(r) is True
    silent = FakeClient(hits=2)
    silent.ack = Answering(None, after=None)  # never answers
    s = side(silent, lookup_wait=0.02)
    s.on_new_request(r)
    s.on_new_request(request(4 * CHUNK, "r2"))
    assert s.may_load(r) is False and s.may_load(request(4 * CHUNK, "r2")) is False
    assert len(silent.ack.waits) == 1  # the budget is shared
    late = side(FakeClient(hits=2), eager_prefetch=False)
    late.on_new_request(r)
    assert late.may_load(r) is False  # not looked up yet: not known


# ------------------------------------------ F8: a failed load on a block once owned
def test_a_load_failure_on_a_block_a_request_no_longer_holds_is_not_its() -> None:
    """Request A loaded into blocks 10-17 (done), was preempted (its blocks freed);
    another request's load into block 12 fails. A is not marked load_failed: it is
    looked up and loads when scheduled again. Before (4549dee) A's tracker kept its
    load's blocks and took the other's failure: never loaded from the cache again."""
    c = FakeClient(hits=2)
    s = side(c)
    a = request(3 * CHUNK, rid="a")
    assert s.get_num_new_matched_tokens(a, 0)[0] == 2 * CHUNK
    s.update_state_after_alloc(a, list(range(10, 22)), 2 * CHUNK)
    s.build_step(out({}))
    s.update_connector_output({"a"}, None, None)
    s.build_step(out({"a": CHUNK}))
    a.status = SimpleNamespace(name="PREEMPTED")
    s.update_connector_output(None, None, {12})
    assert not s.trackers["a"].load_failed
    assert s.get_num_new_matched_tokens(a, 0) == (2 * CHUNK, True)


# --------------------------------------------------------- F9: across a reset
def test_a_request_preempted_across_a_reset_is_keyed_under_a_new_session() -> None:
    """Running at the reset, then preempted (vLLM's reset preempts every running
    request): scheduled again, it is looked up under the reset's tag, in a new server
    session (the old one keeps the old key's chunk hashes, and is ended), and stores
    what it computes again."""
    c = FakeClient(hits=0)
    s = side(c)
    r = request(2 * CHUNK)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, list(range(1, 2 * CHUNK // BS + 1)), 0)
    assert len(s.build_step(out({"r": 2 * CHUNK})).stores()) == 1
    old_session = s.trackers["r"].session_id
    s.reset()
    r.status = SimpleNamespace(name="PREEMPTED")
    c.calls.clear()
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    t = s.trackers["r"]
    assert t.session_id != old_session and t.salt == s._reset_tag and not t.frozen
    assert looked_up_salts(c) == [s._reset_tag]
    s.update_state_after_alloc(r, list(range(30, 30 + 2 * CHUNK // BS)), 0)
    step = s.build_step(out({"r": 2 * CHUNK}))
    (store,) = step.stores()
    assert (store.cache_salt, store.session_id) == (s._reset_tag, t.session_id)
    s.update_connector_output(None, {"r"})  # the old session's store reported


def test_a_hit_offered_before_a_reset_is_loaded_if_vllm_allocated_for_it() -> None:
    """vLLM 0.34 under async scheduling allocates for an async load in one step and
    calls ``update_state_after_alloc`` in a later one (its deferred loads); a reset in
    between must not lose that load (vLLM would wait for its report forever): it goes
    out under the key it was looked up with (whose read locks it consumes). A request
    told a hit that vLLM asks about again (it had not allocated) is looked up afresh
    under the reset's tag, its old locks freed. Before (4549dee) both were forgotten at
    the reset: no RETRIEVE for the first."""
    c = FakeClient(hits=2)
    s = side(c)
    r, q = request(3 * CHUNK, "r"), request(3 * CHUNK, "q")
    assert s.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, True)
    assert s.get_num_new_matched_tokens(q, 0) == (2 * CHUNK, True)
    s.reset()
    c.calls.clear()
    s.update_state_after_alloc(r, list(range(1, 3 * CHUNK // BS + 1)), 2 * CHUNK)
    (load,) = s.build_step(out({})).retrieves()
    assert (load.cache_salt, load.start, load.end) == ("", 0, 2 * CHUNK)
    assert c.ops("FREE") == []
    assert s.get_num_new_matched_tokens(q, 0) == (2 * CHUNK, True)
    assert looked_up_salts(c) == [s._reset_tag] and c.ops("FREE") == [("FREE", 0, 2 * CHUNK)]


# -------------------------------------------------- F10: weights version, events
@pytest.mark.parametrize("version", ["run@42", "@"])
def test_a_weights_version_the_keys_cannot_carry_is_refused_at_start(version: str) -> None:
    """Before (4549dee) ``run@42`` was accepted and every request bypassed the cache
    (its key refused the model name), silently."""
    with pytest.raises(InvalidArgument, match="lmcache.mp.weights_version"):
        ConnectorConfig.from_extra({"lmcache.mp.weights_version": version})


def test_a_store_that_fails_withdraws_its_kv_event() -> None:
    """The scheduler announces a chunk stored (``BlockStored`` on CPU) when it orders
    the STORE; a worker whose STORE fails, or skips it (server down), reports it
    (vLLM unites the ranks' ``WorkerReport``), and the scheduler withdraws it
    (``BlockRemoved``). Before (4549dee) the event stood: a KV-aware router sent
    requests to a cache that never held the chunk."""
    reg, client = FakeReg(), FakeClient()
    reg.next = Future(False)  # the server refuses it
    w = worker(reg, client)
    w.start_stores(with_tokens([op("STORE", "a")]))
    w.get_finished(set())
    client.healthy = False
    w.start_stores(with_tokens([op("STORE", "b")]))
    assert w.failed_stores() == {("a", 0, CHUNK), ("b", 0, CHUNK)}
    assert w.failed_stores() == set()
    c = FakeClient()
    s = side(c, events=True)
    r = request(2 * CHUNK, rid="a")
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(1, 2 * CHUNK // BS + 1)), 0)
    s.build_step(out({"a": 2 * CHUNK}))
    s.update_connector_output(None, None, None, {("a", 0, CHUNK), ("gone", 0, CHUNK)})
    assert s.take_events() == [("stored", r, 0, 2 * CHUNK // BS),
                               ("removed", r, 0, CHUNK // BS)]


def test_a_hit_vllm_grants_in_part_loads_only_what_it_granted() -> None:
    """vLLM 0.34 may grant fewer external tokens than offered (a hit trimmed to a block
    boundary for a bounded-replay model) and allocates blocks for those only: the
    RETRIEVE covers the whole chunks inside the grant, the locks beyond it are freed,
    and the granted blocks past the last whole chunk are reported failed with the load
    (vLLM computes them, instead of reading blocks nothing wrote). Before (4549dee) the
    RETRIEVE asked for the whole hit, into blocks vLLM had not allocated."""
    c = FakeClient(hits=3)
    s = side(c)
    r = request(3 * CHUNK)
    assert s.get_num_new_matched_tokens(r, 0) == (3 * CHUNK - 1, True)
    granted = 3 * CHUNK - BS  # trimmed to a block boundary
    blocks = list(range(1, granted // BS + 1))
    s.update_state_after_alloc(r, blocks, granted)
    assert c.ops("FREE") == [("FREE", 2 * CHUNK, 3 * CHUNK)]
    (load,) = s.build_step(out({})).retrieves()
    assert (load.start, load.end) == (0, 2 * CHUNK)
    assert load.unloaded_block_ids == tuple(blocks[2 * CHUNK // BS:])
    reg = FakeReg()
    w = worker(reg, FakeClient())
    w.start_loads(with_tokens([load]))
    assert w.get_finished(set()) == (set(), {"r"})
    assert w.load_errors() == set(load.unloaded_block_ids)
    # Less than a chunk granted: nothing to RETRIEVE, the granted blocks reported.
    s2 = side(FakeClient(hits=1))
    r2 = request(CHUNK + 5)
    assert s2.get_num_new_matched_tokens(r2, 0) == (CHUNK, True)
    s2.update_state_after_alloc(r2, [1, 2, 3], 3 * BS)
    (empty,) = s2.build_step(out({})).retrieves()
    assert empty.start == empty.end == 0 and empty.unloaded_block_ids == (1, 2, 3)
    reg2 = FakeReg()
    w2 = worker(reg2, FakeClient())
    w2.start_loads(with_tokens([empty]))
    assert reg2.sent == [] and w2.get_finished(set()) == (set(), {"r"})
    assert w2.load_errors() == {1, 2, 3}


# ----------------------------------------------------------- F5: DP's idle ranks
def test_no_idle_wait_under_data_parallelism() -> None:
    """A step without a forward pass lets the workers wait for the loads in flight
    (issue 38), except under data parallelism: there the idle rank's dummy batch, whose
    collectives every other DP rank waits for, would wait too. The connector says so
    from vLLM's ``data_parallel_size`` (test_vllm_034 reads it through vLLM's own
    config). Before (4549dee) every idle step was marked."""
    idle = SimpleNamespace(**vars(out({})), total_num_scheduled_tokens=0)
    assert side(FakeClient()).build_step(idle).idle
    assert not side(FakeClient(), idle_waits=False).build_step(idle).idle
    assert StepOps().idle is False

