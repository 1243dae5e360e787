"""Protocol detection (sans-I/O ``detect``) driven by the answers real servers gave.

fixtures/v<release>/probe.json holds each release's recorded answers to the probe's
questions (tools/record_probe.py; 0.5.6 with and without its event bus, whose
GET_EXPERIMENTAL then lists "kv_event_stream"). :class:`tests.support.probe_replay.Replay` plays
them back as ``detect``'s exchange, and refuses any request no recording proves
harmless. 0.4.7 and 0.5.0 have no oracle venv here; their answers are scripted from
lmcache-mp-versions.md section 7.3, which was measured live. A live test checks that
the release under test still answers as recorded.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from lmcache_mp import CacheKey, Client, LMCacheMPError, ProtocolMismatch, RequestTimeout
from lmcache_mp.protocol.detect import detect

from ..conftest import SERVER_VERSION, LiveServer
from ..support.fake_server import FakeServer
from ..support.fixture_values import FIXTURES, RELEASES, load
from ..support.polling import wait_until
from ..support.probe_replay import Replay, record

URL = "tcp://127.0.0.1:1"
RECORDED = [(rel, case) for rel in RELEASES for case in load(rel, "probe")]
FAMILY = RELEASES  # release -> profile


def hexed(*values: Any) -> list[str]:
    return [msgspec.msgpack.encode(v).hex() for v in values]


# lmcache-mp-versions.md 7.3: 0.5.0 answers id 21 as NOOP ("OK"); 0.4.7 has no handler
# for it (a blend op); neither answers ids 32 or 11 (decode fails / no handler).
ACK = ["02"]
V050 = {"unregister_unknown": ACK, "get_chunk_size_or_noop": hexed(21, "OK"),
        "get_experimental": None, "query_lookup_hits": None, "ping": None}
V047 = {**V050, "get_chunk_size_or_noop": None}


def _id(item: tuple[str, dict[str, Any]]) -> str:
    return f"{item[0]}-{item[1]['server']}"


def test_every_release_has_a_recording_and_0_5_6_has_both_event_bus_states() -> None:
    for release in RELEASES:
        assert (FIXTURES / f"v{release}" / "probe.json").exists(), release
    experimental = [c["replies"]["get_experimental"] for c in load("0.5.6", "probe")]
    lists = [msgspec.msgpack.decode(bytes.fromhex(r[1])) for r in experimental if r]
    assert [] in lists and ["kv_event_stream"] in lists


# What the probe asks each recorded server after the first round trip (its PING fences
# left out), in order: each question only if the ones before did not identify it.
FIRST = ["unregister_unknown", "get_chunk_size_or_noop", "get_experimental",
         "unregister_unknown"]
THEN = {
    ("0.5.3", "default"): [],
    ("0.5.4", "default"): [],
    ("0.5.5", "default"): ["free_locks_057", "query_lookup_hits"],
    ("0.5.6", "default"): ["free_locks_057", "query_lookup_hits", "free_locks_056"],
    ("0.5.6", "event_bus"): ["free_locks_056"],
    ("0.5.7rc2", "default"): ["free_locks_057"],
}
#: Questions each release cannot answer: each is an ERROR line (and a traceback) in its
#: log at every probe (0.5.3 / 0.5.4 log two lines for their one). Issue 37: the newest
#: releases, and 0.5.6 as it starts by default (its event bus on), log none. This must
#: never grow.
UNANSWERED = {("0.5.3", "default"): 1, ("0.5.4", "default"): 1, ("0.5.5", "default"): 1,
              ("0.5.6", "default"): 2, ("0.5.6", "event_bus"): 0, ("0.5.7rc2", "default"): 0}


@pytest.mark.parametrize("item", RECORDED, ids=_id)
def test_each_release_is_detected_from_its_recorded_answers(
        item: tuple[str, dict[str, Any]]) -> None:
    release, case = item
    replay = Replay(case["replies"])
    found = detect(replay, URL, timeout=0.5, grace=0.1)
    assert found.profile == FAMILY[release]
    assert found.releases == {"0.5.3": "0.5.3/0.5.4", "0.5.5": "0.5.5",
                              "0.5.6": "0.5.6", "0.5.7": "0.5.7"}[FAMILY[release]]
    asked = [q for q, _ in replay.sent]
    then = THEN[(release, case["server"])]
    assert asked == FIRST + [x for q in then for x in (q, "ping")]
    # One round trip per question, and a grace exchange for each one the server dropped.
    dropped = [q for q in then if case["replies"][q] is None]
    assert replay.calls == 1 + len(then) + len(dropped)
    v32 = case["replies"]["get_experimental"]
    evidence = ["id 2 -> <ack>", "id 21 -> 256",
                f"id 32 -> {msgspec.msgpack.decode(bytes.fromhex(v32[1])) if v32 else None!r}"]
    for q in then:
        if q == "query_lookup_hits":
            evidence.append("id 11 -> 0" if FAMILY[release] == "0.5.5" else "id 11 -> None")
        else:
            form = "0.5.6" if q == "free_locks_056" else "0.5.7"
            evidence.append(f"FREE_LOOKUP_LOCKS {form} form -> "
                            f"{'ack' if found.profile == form else None}")
    assert list(found.evidence) == evidence


@pytest.mark.parametrize("item", RECORDED, ids=_id)
def test_the_questions_a_release_cannot_answer_never_grow(
        item: tuple[str, dict[str, Any]]) -> None:
    release, case = item
    replay = Replay(case["replies"])
    detect(replay, URL, timeout=0.5, grace=0.0)
    unanswered = [q for q, _ in replay.sent if case["replies"][q] is None]
    assert len(unanswered) == UNANSWERED[(release, case["server"])], unanswered


def test_a_0_5_5_pool_answering_after_the_ping_fence_is_still_0_5_5() -> None:
    (case,) = load("0.5.5", "probe")
    replay = Replay(case["replies"], late=frozenset({"query_lookup_hits"}))
    assert detect(replay, URL, timeout=0.5, grace=0.1).profile == "0.5.5"
    assert len(replay.sent) == 8  # the grace exchanges send nothing new


def test_grace_zero_sends_no_grace_exchange() -> None:
    (case,) = [c for c in load("0.5.6", "probe") if c["server"] == "default"]
    replay = Replay(case["replies"])
    assert detect(replay, URL, timeout=0.5, grace=0.0).profile == "0.5.6"
    assert replay.calls == 4


@pytest.mark.parametrize("lost", ["unregister_unknown_first", "fence"])
def test_one_lost_liveness_reply_is_not_a_dead_server(lost: str) -> None:
    """Either UNREGISTER answered proves the message thread alive."""
    (case,) = load("0.5.3", "probe")

    class OneLost(Replay):
        def __call__(self, batch: Any, until: str, timeout: float) -> Any:
            out = super().__call__(batch, until, timeout)
            out["alive" if lost == "unregister_unknown_first" else "fence"] = None
            return out

    assert detect(OneLost(case["replies"]), URL, timeout=0.5).profile == "0.5.3"


def test_probe_instance_ids_never_repeat() -> None:
    """The UNREGISTER probes name random instances >= 2**48 that no worker uses."""
    ids = set()
    for _ in range(60):
        replay = Replay(load("0.5.3", "probe")[0]["replies"])
        detect(replay, URL, timeout=0.5)
        ids.update(frames[1] for q, frames in replay.sent if q == "unregister_unknown")
    assert len(ids) == 120 and min(ids) >= 2**48 and max(ids) < 2**63


def test_0_5_0_is_refused_with_the_upgrade_advice() -> None:
    with pytest.raises(ProtocolMismatch, match=r"0\.5\.0.*upgrade the server"):
        detect(Replay(V050), URL, timeout=0.5)


def test_0_4_7_is_refused_as_older_than_0_5_0() -> None:
    with pytest.raises(ProtocolMismatch, match="older than 0.5.0"):
        detect(Replay(V047), URL, timeout=0.5)


def test_a_server_that_answers_nothing_is_a_timeout_not_a_mismatch() -> None:
    silent = dict.fromkeys(V050)
    with pytest.raises(RequestTimeout, match="answered no probe"):
        detect(Replay(silent), URL, timeout=0.5)


@pytest.mark.parametrize(("change", "error"), [
    ({"get_experimental": hexed(32, 7)}, "unexpected reply to id 32"),
    ({"query_lookup_hits": hexed(11, "zero")}, "unexpected reply to id 11"),
    ({"get_chunk_size_or_noop": hexed(21, True)}, "did not answer GET_CHUNK_SIZE"),
    ({"get_experimental": ["20", "c1"]}, "id 32 from .*'<undecodable>'"),
])
def test_answers_no_release_gives_are_refused(change: dict[str, Any], error: str) -> None:
    (case,) = load("0.5.5", "probe")
    with pytest.raises(ProtocolMismatch, match=error):
        detect(Replay({**case["replies"], **change}), URL, timeout=0.5)


def test_a_server_that_stops_answering_mid_probe_is_a_timeout() -> None:
    (case,) = load("0.5.5", "probe")
    with pytest.raises(RequestTimeout, match="stopped answering"):
        detect(Replay({**case["replies"], "ping": None}), URL, timeout=0.5)


@pytest.mark.parametrize("family", ["0.5.3", "0.5.5", "0.5.6", "0.5.7"])
def test_client_auto_detects_the_scripted_server_of_each_family(family: str) -> None:
    """End to end through Client and its connection's probe exchange."""
    fake = FakeServer(profile=family, engine_driven=False)
    try:
        with Client(fake.url, timeout=2) as c:
            assert c.server_protocol == family
            assert c.detection is not None and c.detection.profile == family
            assert c.noop() == "OK"
    finally:
        fake.close()


def test_a_family_adopted_from_another_process_sends_no_probe_until_a_reconnect() -> None:
    """What vLLM's scheduler does with its workers' answer (issue 37): adopted before
    the first connection or on it, no probe question reaches the server; once
    identified, nothing more is adopted; a reconnect (maybe a restarted server of
    another release) probes again."""
    fake = FakeServer(profile="0.5.7", engine_driven=False)
    try:
        with Client(fake.url, timeout=2) as c:
            assert c.adopt_protocol("0.5.7", source="vLLM's workers")
            assert c.protocol_identified and c.server_protocol == "0.5.7"
            assert c.noop() == "OK" and c.chunk_size() > 0
            assert c.detection is not None and c.detection.evidence == ("told by vLLM's workers",)
            assert fake.ops() == ["NOOP", "GET_CHUNK_SIZE"]  # no probe question
            assert not c.adopt_protocol("0.5.6")  # already identified: kept
            assert c.server_protocol == "0.5.7"
            fake.restart()

            def answered() -> bool:
                try:
                    return bool(c.noop() == "OK")
                except LMCacheMPError:
                    return False

            # Probed again on the new connection (the first call after the restart may
            # still go out before the client has seen the connection change).
            assert wait_until(lambda: answered() and c.detection is not None
                              and c.detection.evidence[0] == "id 2 -> <ack>", timeout=10)
            assert "GET_EXPERIMENTAL" in fake.ops()
        with Client(fake.url, timeout=2, protocol="0.5.7") as named:
            assert not named.adopt_protocol("0.5.6")  # a named family is never replaced
            assert named.server_protocol == "0.5.7"
        with pytest.raises(ProtocolMismatch, match="no protocol profile"), \
                Client(fake.url, timeout=2) as c:
            c.adopt_protocol("0.9")
    finally:
        fake.close()


@pytest.mark.live
def test_the_live_server_still_answers_as_recorded(live_server: LiveServer) -> None:
    """The recordings above stay true: the release under test answers the same."""
    (default,) = [c for c in load(SERVER_VERSION, "probe") if c["server"] == "default"]
    newer = FAMILY[SERVER_VERSION] in ("0.5.5", "0.5.6", "0.5.7")  # asked the key-form questions
    assert record(live_server.url, wait=1.5, newer=newer) == default["replies"]


# ------------------------------------------------------- a server newer than the client
def test_a_release_accepting_neither_key_form_is_refused_with_what_to_do() -> None:
    """A newer release that answers like 0.5.7 on every harmless question but changed
    its key (or FREE_LOOKUP_LOCKS) again: refused, never mapped onto 0.5.7 or 0.5.6."""
    (case,) = load("0.5.7rc2", "probe")
    future = {**case["replies"], "free_locks_057": None}
    with pytest.raises(ProtocolMismatch) as err:
        detect(Replay(future), URL, timeout=0.5, grace=0.05)
    message = str(err.value)
    assert "answers like none of the releases" in message
    assert ("FREE_LOOKUP_LOCKS 0.5.7 form -> None; id 11 -> None; "
            "FREE_LOOKUP_LOCKS 0.5.6 form -> None") in message
    assert "id 32 -> []" in message
    assert "Upgrade lmcache-mp" in message and "protocol='0.5.7'" in message


def test_the_probe_stops_at_the_first_key_form_accepted() -> None:
    """Each key form is asked only if the one before was dropped: a 0.5.7 server is
    never sent the 0.5.6 form (which it would log as an error)."""
    (case,) = load("0.5.7rc2", "probe")
    replay = Replay(case["replies"])
    assert detect(replay, URL, timeout=0.5).profile == "0.5.7"
    assert "free_locks_056" not in [q for q, _ in replay.sent]


def test_an_event_bus_server_is_still_asked_for_its_key_form() -> None:
    """"kv_event_stream" alone no longer names 0.5.6: a later release may list it too."""
    (case,) = [c for c in load("0.5.6", "probe") if c["server"] == "event_bus"]
    future = {**case["replies"], "free_locks_056": None}
    with pytest.raises(ProtocolMismatch, match="answers like none"):
        detect(Replay(future), URL, timeout=0.5, grace=0.0)


def test_a_late_pool_reply_to_the_key_probe_is_waited_for() -> None:
    (case,) = load("0.5.7rc2", "probe")
    replay = Replay(case["replies"], late=frozenset({"free_locks_057"}))
    assert detect(replay, URL, timeout=0.5, grace=0.1).profile == "0.5.7"


class FutureServer(FakeServer):
    """A scripted ROUTER imitating a release after 0.5.7: it answers every harmless
    probe as 0.5.7 does, but its key carries the tokens under a field no release this
    client knows has (so, like a real server, it drops both key forms it is sent)."""

    def __init__(self) -> None:
        super().__init__(profile="0.5.7", engine_driven=False)
        self.token_field = "token_words"


def test_client_refuses_a_future_release_before_any_data_plane_request() -> None:
    fake = FutureServer()
    try:
        with Client(fake.url, timeout=2) as c:
            key = CacheKey(model_name="m", world_size=1, worker_id=None,
                           token_ids=list(range(512)), start=0, end=512, request_id="r")
            for call in (c.noop, lambda: c.lookup(key)):
                with pytest.raises(ProtocolMismatch, match="answers like none of the releases"):
                    call()
        # Only the probe's own questions reached it (the key probes were dropped, so
        # not even they were recorded): no NOOP, LOOKUP, STORE or anything else.
        assert set(fake.ops()) <= {"UNREGISTER_KV_CACHE", "GET_CHUNK_SIZE", "GET_EXPERIMENTAL",
                                   "PING"}
    finally:
        fake.close()
