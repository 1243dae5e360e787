"""A registration's binding (lmcache_mp.session.binding): every transition of its table
one by one, the illegal ones refused, then a registration moving it as a server
restarts, reaps, falls silent and refuses a re-registration."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import numpy as np
import pytest

from lmcache_mp import Client, CpuKVCache, Registration, RequestTimeout
from lmcache_mp.session.binding import (
    TRANSITIONS,
    Binding,
    BindingError,
    BindingEvent,
    BindingState,
    BindingStatus,
)

from ..support.fake_server import FakeServer

S, E = BindingStatus, BindingEvent

#: The table as this test reads the module's docstring, written out independently: a
#: changed row of TRANSITIONS fails the tests below.
EXPECTED = {
    (S.NEW, E.REGISTERED): S.BOUND,
    (S.NEW, E.UNREGISTERED): S.UNREGISTERED,
    (S.BOUND, E.HEARTBEAT_FAILED): S.SUSPECT,
    (S.BOUND, E.CONNECTION_CHANGED): S.SUSPECT,
    (S.BOUND, E.RENEW_STARTED): S.RENEWING,
    (S.BOUND, E.UNREGISTERED): S.UNREGISTERED,
    (S.SUSPECT, E.HEARTBEAT_FAILED): S.SUSPECT,
    (S.SUSPECT, E.CONNECTION_CHANGED): S.SUSPECT,
    (S.SUSPECT, E.RE_REGISTER_STARTED): S.RE_REGISTERING,
    (S.SUSPECT, E.UNREGISTERED): S.UNREGISTERED,
    (S.RENEWING, E.RE_REGISTERED): S.BOUND,
    (S.RENEWING, E.RE_REGISTER_FAILED): S.BOUND,
    (S.RENEWING, E.HEARTBEAT_FAILED): S.RE_REGISTERING,
    (S.RE_REGISTERING, E.RE_REGISTERED): S.BOUND,
    (S.RE_REGISTERING, E.RE_REGISTER_FAILED): S.SUSPECT,
    (S.RE_REGISTERING, E.HEARTBEAT_FAILED): S.RE_REGISTERING,
    (S.UNREGISTERED, E.HEARTBEAT_FAILED): S.UNREGISTERED,
    (S.UNREGISTERED, E.UNREGISTERED): S.UNREGISTERED,
}

#: Legal paths from NEW into each state.
PATHS = {
    S.NEW: [],
    S.BOUND: [E.REGISTERED],
    S.SUSPECT: [E.REGISTERED, E.HEARTBEAT_FAILED],
    S.RENEWING: [E.REGISTERED, E.RENEW_STARTED],
    S.RE_REGISTERING: [E.REGISTERED, E.HEARTBEAT_FAILED, E.RE_REGISTER_STARTED],
    S.UNREGISTERED: [E.REGISTERED, E.UNREGISTERED],
}

STALE_AFTER = 10.0


def state_in(status: BindingStatus) -> BindingState:
    """A binding driven into ``status`` through legal moves only."""
    s = BindingState(STALE_AFTER)
    for event in PATHS[status]:
        s.fire(event)
    assert s.state is status
    return s


# ------------------------------------------------------------------ the table
def test_the_table_is_the_expected_one() -> None:
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize(("state", "event"), sorted(EXPECTED, key=str))
def test_every_legal_transition(state: BindingStatus, event: BindingEvent) -> None:
    s = state_in(state)
    assert s.fire(event) is EXPECTED[state, event]
    assert s.state is EXPECTED[state, event]


ILLEGAL = sorted(set(itertools.product(S, E)) - set(EXPECTED), key=str)


@pytest.mark.parametrize(("state", "event"), ILLEGAL)
def test_every_illegal_transition_raises_and_changes_nothing(
        state: BindingStatus, event: BindingEvent) -> None:
    s = state_in(state)
    with pytest.raises(BindingError, match=f"cannot take {event.value!r} while {state.value}"):
        s.fire(event)
    assert s.state is state


def test_every_state_is_reached_and_only_unregistered_is_final() -> None:
    def reach(start: BindingStatus) -> set[BindingStatus]:
        seen, todo = {start}, [start]
        while todo:
            here = todo.pop()
            for (state, _), nxt in TRANSITIONS.items():
                if state is here and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert reach(S.NEW) == set(S)
    for state in (S.BOUND, S.SUSPECT, S.RENEWING, S.RE_REGISTERING):
        assert S.BOUND in reach(state), state  # every live state can be bound again
    assert reach(S.UNREGISTERED) == {S.UNREGISTERED}


# -------------------------------------------------------- the moves with data
def test_a_first_register_binds_and_is_fresh_on_its_connection_only() -> None:
    s = BindingState(STALE_AFTER)
    assert not s.fresh(1) and s.epoch is None and s.binding is None
    b = Binding(1)
    now = time.monotonic()
    s.registered(b, now)
    assert (s.state, s.binding, s.last_refresh, s.epoch) == (S.BOUND, b, now, 1)
    assert s.fresh(1)
    assert not s.fresh(2)  # a new connection may reach a restarted server


def test_a_binding_silent_too_long_is_not_fresh_and_a_reply_refreshes_it() -> None:
    s = BindingState(0.2)
    s.registered(Binding(1), time.monotonic() - 1.0)
    assert not s.fresh(1)
    s.touch(time.monotonic())
    assert s.fresh(1) and s.state is S.BOUND  # touching is no move
    before = s.last_refresh
    s.touch(before - 5.0)  # an older request's reply does not move the clock back
    assert s.last_refresh == before


def test_a_suspect_binding_is_not_fresh_whatever_its_clock() -> None:
    s = state_in(S.BOUND)
    s.binding = Binding(1)
    s.touch(time.monotonic())
    assert s.fresh(1)
    s.fire(E.HEARTBEAT_FAILED)
    assert not s.fresh(1)
    s.touch(time.monotonic() + 1.0)
    assert not s.fresh(1) and s.state is S.SUSPECT


def test_renewing_a_binding_silent_too_long() -> None:
    s = BindingState(STALE_AFTER)
    old, new = Binding(1), Binding(1)
    s.registered(old, 0.0)
    assert s.begin_again(1) is False and s.state is S.RENEWING  # nothing was lost
    assert not s.fresh(1)
    assert s.registered_again(new, 123.0) is old
    assert (s.state, s.binding, s.last_refresh) == (S.BOUND, new, 123.0)


def test_a_failed_renewal_leaves_the_binding_bound_and_still_stale() -> None:
    s = BindingState(STALE_AFTER)
    s.registered(Binding(1), 0.0)
    s.begin_again(1)
    s.fire(E.RE_REGISTER_FAILED)
    assert s.state is S.BOUND and not s.fresh(1)
    assert s.begin_again(1) is False  # the next check renews again, not a restart


def test_a_binding_on_an_older_connection_is_registered_again_as_a_restart() -> None:
    s = BindingState(STALE_AFTER)
    s.registered(Binding(1), time.monotonic())
    assert s.begin_again(2) is True and s.state is S.RE_REGISTERING
    s.fire(E.RE_REGISTER_FAILED)
    assert s.state is S.SUSPECT  # still in doubt: the next check re-registers
    assert s.begin_again(2) is True
    s.registered_again(Binding(2), time.monotonic())
    assert s.state is S.BOUND and s.fresh(2)


def test_a_suspect_binding_is_registered_again_as_a_restart() -> None:
    s = BindingState(STALE_AFTER)
    s.registered(Binding(1), time.monotonic())
    s.fire(E.HEARTBEAT_FAILED)
    assert s.begin_again(1) is True and s.state is S.RE_REGISTERING


def test_a_heartbeat_failing_during_a_renewal_leaves_the_doubt_if_the_renewal_fails() -> None:
    s = BindingState(STALE_AFTER)
    s.registered(Binding(1), 0.0)
    s.begin_again(1)
    s.fire(E.HEARTBEAT_FAILED)
    assert s.state is S.RE_REGISTERING
    s.fire(E.RE_REGISTER_FAILED)
    assert s.state is S.SUSPECT


@pytest.mark.parametrize("state", [S.NEW, S.RENEWING, S.RE_REGISTERING, S.UNREGISTERED])
def test_registering_again_starts_only_from_a_bound_or_suspect_binding(
        state: BindingStatus) -> None:
    s = state_in(state)
    with pytest.raises(BindingError):
        s.begin_again(0)
    assert s.state is state


def test_binding_data_is_written_only_by_a_legal_move() -> None:
    s = state_in(S.BOUND)
    with pytest.raises(BindingError):
        s.registered(Binding(7), 5.0)  # registered twice
    with pytest.raises(BindingError):
        s.registered_again(Binding(7), 5.0)  # not registering again
    assert s.binding is None and s.last_refresh == 0.0 and s.state is S.BOUND


def test_unregistering_is_final_and_gives_back_the_binding() -> None:
    s = BindingState(STALE_AFTER)
    b = Binding(1)
    s.registered(b, time.monotonic())
    assert s.unregistered() is b
    assert (s.state, s.binding, s.fresh(1)) == (S.UNREGISTERED, None, False)
    assert s.unregistered() is None  # again: nothing held
    assert s.fire(E.HEARTBEAT_FAILED) is S.UNREGISTERED  # a PING that was in flight
    with pytest.raises(BindingError):
        s.fire(E.REGISTERED)


# ----------------------------------------------------- a registration drives it
Moves = list[tuple[BindingEvent, BindingStatus]]


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> Iterator[Moves]:
    """Every move any binding makes during the test, in order."""
    log: Moves = []
    move = BindingState._move

    def recording(self: BindingState, event: BindingEvent) -> BindingStatus:
        new = move(self, event)
        log.append((event, new))
        return new

    monkeypatch.setattr(BindingState, "_move", recording)
    yield log


CHUNK = 256


def store(reg: Registration, seed: int = 0, timeout: float | None = None) -> bool:
    toks = np.random.default_rng(seed).integers(0, 2**31, CHUNK).tolist()
    with reg.request(toks) as req:
        return req.store(list(range(16)), timeout=timeout)


def reconnect(fake: FakeServer, c: Client) -> None:
    epoch = c._conn.transport.epoch
    fake.restart()
    deadline = time.monotonic() + 3
    while c._conn.transport.refresh() == epoch and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_registration_through_restart_reap_and_unregister(
        fake: FakeServer, kv: CpuKVCache, moves: Moves) -> None:
    recovered: list[Registration] = []
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=3,
                reap_timeout=0.5, on_recovered=recovered.append) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        assert moves == [(E.REGISTERED, S.BOUND)]
        assert store(reg) and len(moves) == 1  # fresh: no move on the hot path
        reconnect(fake, c)
        assert store(reg, 1)
        assert moves[1:] == [(E.CONNECTION_CHANGED, S.SUSPECT),
                             (E.RE_REGISTER_STARTED, S.RE_REGISTERING),
                             (E.RE_REGISTERED, S.BOUND)]
        assert recovered == [reg]
        time.sleep(0.45)  # silent longer than stale_after (0.8 x 0.5 s)
        assert store(reg, 2)
        assert moves[4:] == [(E.RENEW_STARTED, S.RENEWING), (E.RE_REGISTERED, S.BOUND)]
        assert recovered == [reg] and reg.recoveries == 2  # a renewal is no restart
        reg.unregister()
        assert moves[6:] == [(E.UNREGISTERED, S.UNREGISTERED)] and not reg.registered


def test_a_failed_heartbeat_makes_the_next_transfer_re_register(
        fake: FakeServer, kv: CpuKVCache, moves: Moves) -> None:
    recovered: list[Registration] = []
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=0.5,
                on_recovered=recovered.append) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        fake.drop.add("PING")
        assert not c._registry.beat([reg], 0.3)
        assert moves[-1] == (E.HEARTBEAT_FAILED, S.SUSPECT)
        fake.drop.clear()
        assert store(reg)
        assert moves[-2:] == [(E.RE_REGISTER_STARTED, S.RE_REGISTERING),
                              (E.RE_REGISTERED, S.BOUND)]
        assert recovered == [reg]
        reg.unregister()


def test_a_failed_renewal_is_retried_as_a_renewal(
        fake: FakeServer, kv: CpuKVCache, moves: Moves) -> None:
    recovered: list[Registration] = []
    with Client(fake.url, protocol="0.5.3", heartbeat_interval=None, timeout=3,
                reap_timeout=0.5, on_recovered=recovered.append) as c:
        reg = c.register(kv, model_name="m", mode="lmcache")
        time.sleep(0.45)
        fake.drop.add("REGISTER_KV_CACHE")
        with pytest.raises(RequestTimeout):
            store(reg, timeout=0.3)
        assert moves[-2:] == [(E.RENEW_STARTED, S.RENEWING), (E.RE_REGISTER_FAILED, S.BOUND)]
        fake.drop.clear()
        assert store(reg, 1)
        assert moves[-2:] == [(E.RENEW_STARTED, S.RENEWING), (E.RE_REGISTERED, S.BOUND)]
        assert recovered == [] and reg.recoveries == 1  # never in doubt: no callback
        reg.unregister()
