"""Recorded answers of real servers to the protocol probe, and their replay.

:func:`record` asks a live server the questions of lmcache-mp-versions.md section 7.4
itself, in its own order and with generous waits (it does not run
:func:`lmcache_mp.protocol.detect.detect`, so a recording never depends on the logic it
is used to test). ``tools/record_probe.py`` stores the answers of each release in
``fixtures/v<release>/probe.json``; :class:`Replay` answers a probe from them, as the
``exchange`` that sans-I/O ``detect`` drives.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

_enc = msgspec.msgpack.encode

# What each probe question sends (after the uid): op id, then its payloads. ``big`` is
# a random instance id >= 2**48 that no worker uses, ``rid`` a random request id.
QUESTIONS: dict[str, tuple[int, str | None]] = {
    "unregister_unknown": (2, "big"),
    "get_chunk_size_or_noop": (21, None),
    "get_experimental": (32, None),
    "query_lookup_hits": (11, "rid"),
    "ping": (22, "nil"),
    # Asked of 0.5.5 and later only: FREE_LOOKUP_LOCKS of an empty token range (every
    # such release returns before touching state), with each release's key and payloads.
    "free_locks_056": (12, "key056"),
    "free_locks_057": (12, "key057"),
}
NEWER_QUESTIONS = ("free_locks_056", "free_locks_057")

#: ERROR lines one protocol probe leaves in a real server's log, per release, as the
#: tests start servers (scripts/lmcache-server.sh: observability off, so 0.5.6 lists no
#: "kv_event_stream"; started by default, with its event bus, it logs none). 0.5.3 /
#: 0.5.4: the unanswered id 32, logged as two lines. Measured by
#: tests/live/test_probe_log.py; never to grow (issue 37).
PROBE_ERROR_LINES = {"0.5.3": 2, "0.5.4": 2, "0.5.5": 1, "0.5.6": 2, "0.5.7rc2": 0}


def error_records(log: str) -> list[str]:
    """Each ERROR line of a server's log with what follows it up to the next log line
    (its traceback)."""
    records: list[list[str]] = []
    current: list[str] | None = None
    for line in log.splitlines():
        if " ERROR" in line:
            current = [line]
            records.append(current)
        elif line.startswith(("\x1b[", "[")):  # another log line ("[time] LMCache ...")
            current = None
        elif current is not None:
            current.append(line)  # the ERROR's traceback
    return ["\n".join(r) for r in records]


#: What the server logs for the probe's questions it cannot answer (0.5.3 / 0.5.4: no
#: handler for id 32; 0.5.5+: a key form with the wrong payload count; 0.5.6+: id 11).
PROBE_ERRORS = ("No handler registered for request type", "Available handlers",
                "Payload count does not match", "Unknown legacy ZMQ operation id")


def is_probe_error(record: str) -> bool:
    return any(sign in record for sign in PROBE_ERRORS)


def _empty_key(**tokens: Any) -> dict[str, Any]:
    # Field order as LMCache's IPCCacheServerKey (0.5.6 / 0.5.7) declares it.
    return {"model_name": "lmcache-mp-record", "world_size": 1, "worker_id": None, **tokens,
            "start": 0, "end": 0, "request_id": f"lmcache-mp-record-{secrets.token_hex(6)}",
            "cache_salt": "", "request_configs": None, "num_kv_readers": 1}


def _frames(op: int, payload: str | None) -> list[bytes]:
    frames = [_enc(op)]
    if payload == "big":
        frames.append(_enc(2**48 + secrets.randbelow(2**60)))
    elif payload == "rid":
        frames.append(_enc(f"lmcache-mp-record-{secrets.token_hex(6)}"))
    elif payload == "nil":
        frames.append(_enc(None))
    elif payload == "key056":
        frames += [_enc(_empty_key(token_ids=[])), _enc(1)]
    elif payload == "key057":
        frames += [_enc(_empty_key(token_bytes=b"")), _enc(1), _enc([])]
    return frames


def record(url: str, wait: float = 3.0, newer: bool = False) -> dict[str, list[str] | None]:
    """Each question's reply frames (after the uid, hex) from the server at ``url``, or
    None where it gave none within ``wait`` seconds (SYNC questions are fenced by a
    later UNREGISTER on the same thread; pool-run ones get the whole wait). ``newer``:
    also the questions only ever asked of 0.5.6 and later."""
    from lmcache_mp.transport import Transport

    t = Transport(url)
    try:
        sent = {name: t.submit(_frames(*QUESTIONS[name]), wait + 5, name)
                for name in ("unregister_unknown", "get_chunk_size_or_noop",
                             "get_experimental")}
        fence = t.submit(_frames(2, "big"), wait + 5, "fence")
        t.wait_for(fence, wait)
        sent.update({name: t.submit(_frames(*QUESTIONS[name]), wait + 5, name)
                     for name in ("query_lookup_hits", "ping",
                                  *(NEWER_QUESTIONS if newer else ()))})
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not all(t.poll(p) for p in sent.values()):
            time.sleep(0.02)
        out: dict[str, list[str] | None] = {}
        for name, p in sent.items():
            done = t.poll(p) and p.error is None
            out[name] = [f.hex() for f in p.frames] if done else None
            if not done:
                t.cancel(p)
        return out
    finally:
        t.close()


def _is_empty_free(form: str, rest: list[Any]) -> bool:
    """A FREE_LOOKUP_LOCKS of an empty range in ``form``: nothing for a server to free."""
    if form == "key056":
        ok = len(rest) == 2 and rest[1] == 1 and isinstance(rest[0], dict) \
            and rest[0].get("token_ids") == [] and "token_bytes" not in rest[0]
    else:
        ok = len(rest) == 3 and rest[1] == 1 and rest[2] == [] and isinstance(rest[0], dict) \
            and rest[0].get("token_bytes") == b"" and "token_ids" not in rest[0]
    return ok and rest[0].get("start") == rest[0].get("end") == 0 \
        and rest[0].get("num_kv_readers") == 1


class Replay:
    """An ``exchange`` for :func:`detect` that answers from recorded replies.

    Each request is matched to the recorded question with its op id and payload shape;
    a request the recording has no question for fails the test (the probe must only
    send what was proven harmless). ``late`` names questions whose reply arrives only
    in a later exchange (a busy multi-worker pool answering after the PING fence).
    """

    def __init__(self, replies: Mapping[str, Sequence[str] | None],
                 late: frozenset[str] = frozenset()) -> None:
        self.replies = replies
        self.late = late
        self.sent: list[tuple[str, list[Any]]] = []
        self.calls = 0
        self._names: set[str] = set()
        self._answered: dict[str, list[bytes] | None] = {}
        self._held: dict[str, list[bytes]] = {}

    def question(self, frames: list[bytes]) -> str:
        assert frames, "the probe sent a request without an op frame"
        decoded = [msgspec.msgpack.decode(f) for f in frames]
        for name, (op, payload) in QUESTIONS.items():
            if decoded[0] != op:
                continue
            rest = decoded[1:]
            if payload is None and rest == []:
                return name
            if payload == "big" and len(rest) == 1 and isinstance(rest[0], int) \
                    and not isinstance(rest[0], bool) and rest[0] >= 2**48:
                return name
            if payload == "rid" and len(rest) == 1 and isinstance(rest[0], str) and rest[0]:
                return name
            if payload == "nil" and rest == [None]:
                return name
            if payload in ("key056", "key057") and _is_empty_free(payload, rest):
                return name
        raise AssertionError(f"the probe sent {decoded}, which no recording proves harmless")

    def __call__(self, batch: Sequence[tuple[str, list[bytes]]], until: str,
                 timeout: float) -> dict[str, list[bytes] | None]:
        self.calls += 1
        self._names.update(name for name, _ in batch)
        assert until in self._names, f"detect waits for {until!r}, which it never sent"
        # Replies held back in an earlier exchange arrive now.
        for name, frames in list(self._held.items()):
            self._answered[name] = frames
            del self._held[name]
        for name, frames in batch:
            q = self.question(frames)
            self.sent.append((q, [msgspec.msgpack.decode(f) for f in frames]))
            reply = self.replies[q]
            value = None if reply is None else [bytes.fromhex(h) for h in reply]
            if value is not None and q in self.late:
                self._held[name] = value
                value = None
            self._answered[name] = value
        return dict(self._answered)
