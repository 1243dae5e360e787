"""Which LMCache wire family a server speaks, found by a probe that cannot harm it.

Sans-I/O: :func:`detect` decides what to send and how to read the answers; the caller
supplies ``exchange(batch)``, which sends a batch of ``(name, frames)`` requests in order
on one connection and returns ``{name: reply frames (after the uid) or None}``.

The probe follows lmcache-mp-versions.md section 7, with four refinements:

* only integer op ids <= 32 (valid on every release from 0.4.7), every message at least
  ``[uid, op]``, and never ids 16, 17 or 20 with an empty payload (CLEAR somewhere);
* **fences instead of timeouts.** SYNC handlers run on the server's message thread in
  arrival order, so a request answered there (UNREGISTER of an unknown instance) sent
  after a probe is answered only after that probe was handled: once the fence's reply
  is in, a missing reply means "no handler", not "slow". A 0.5.3 server is thus
  identified in one round trip instead of a 1.5 s timeout. Pool-run probes (id 11)
  are fenced by a PING on the same pool, plus a short grace for multi-worker pools;
* **a positive fingerprint past 0.5.5.** The document's step 3 ("kv_event_stream" ->
  0.5.6+) no longer names a release: 0.5.7rc2 dropped that tag, and a later release may
  keep or add it. So a server is asked which cache key it accepts (FREE_LOOKUP_LOCKS of
  an empty range: a no-op from 0.5.5 on, decoded on the message thread, so a wrong
  form is dropped before the fence); a server accepting neither form (nor answering
  id 11 as 0.5.5) is a release this client does not know, refused with
  ProtocolMismatch before any data-plane request is sent;
* **the fewest errors in the server's log.** Every question a release cannot answer
  leaves an ERROR line (with a traceback) in its log, at every engine start, from
  every worker. So the questions after GET_EXPERIMENTAL are asked one at a time, each
  only if the one before did not identify the server, in the order that costs the
  newest releases nothing: 0.5.7 and an event-bus 0.5.6 (its default) log no error,
  0.5.5 one, 0.5.6 without its event bus two, 0.5.3 / 0.5.4 the one unanswered id 32
  (two lines). Naming the family (``protocol="0.5.7"``) sends no probe at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import ProtocolMismatch, RequestTimeout
from .v0_5_5 import CacheKeyV055
from .v0_5_7 import CacheKeyV057

__all__ = ["Detection", "detect", "Exchange", "unregister_unknown"]

# (name, frames after the uid); a reply is its frames after the uid, or None.
Exchange = Callable[[Sequence[tuple[str, list[bytes]]], str, float], Mapping[str, "list[bytes] | None"]]

_enc = msgspec.msgpack.encode

# The only op ids the probe ever sends, and what each means on the families it knows:
#   2  UNREGISTER_KV_CACHE in every release (an unknown instance: a no-op ack, SYNC)
#   21 GET_CHUNK_SIZE from 0.5.3 (NOOP in 0.5.0, a blend op in 0.4.7)
#   32 GET_EXPERIMENTAL from 0.5.5 (an unregistered blend op in 0.5.3/0.5.4)
#   11 QUERY_PREFETCH_LOOKUP_HITS up to 0.5.5 (retired in 0.5.6)
#   22 PING from 0.5.3 (NORMAL pool, like id 11)
#   12 FREE_LOOKUP_LOCKS, only once a server is known to be 0.5.5 or later: of an empty
#      token range, which 0.5.5, 0.5.6 and 0.5.7 return from before touching any state
#      (modules/lookup.py: ``if key.start >= key.end: return``); the wrong form's payload
#      count is refused before decoding (mq.py: unwrap_request_payloads)

#: What the client speaks, for messages.
SPOKEN = "0.5.3, 0.5.4, 0.5.5, 0.5.6 and 0.5.7 (0.5.7rc2)"


@dataclass(frozen=True)
class Detection:
    """The outcome of a probe: the profile name, and what the server answered."""

    profile: str
    releases: str
    evidence: tuple[str, ...]


def unregister_unknown() -> list[bytes]:
    """The frames of an UNREGISTER of a random instance id >= 2**48 that no worker uses:
    a no-op every release answers. Detection's first and last probe; the connection
    also hands it to the transport as the probe of a server that went silent."""
    return [_enc(2), _enc(2**48 + int.from_bytes(os.urandom(8), "big") % 2**60)]


def _value(frames: list[bytes] | None) -> object:
    if frames is None:
        return None
    if len(frames) < 2:
        return "<ack>"
    try:
        return msgspec.msgpack.decode(frames[1])
    except msgspec.DecodeError:
        return "<undecodable>"


def detect(exchange: Exchange, url: str, timeout: float = 2.0, grace: float = 0.25) -> Detection:
    """Run the probe over ``exchange``; raise ProtocolMismatch for an unsupported or
    unidentifiable server and RequestTimeout for one that does not answer at all."""
    first = exchange(
        [("alive", unregister_unknown()), ("id21", [_enc(21)]), ("id32", [_enc(32)]),
         ("fence", unregister_unknown())],
        "fence", timeout,
    )
    if first.get("alive") is None and first.get("fence") is None:
        raise RequestTimeout(
            f"the server at {url} accepted the connection but answered no probe within "
            f"{timeout:g} s: its message thread has died or it is not an LMCache MP server. "
            f"Restart it, or name the protocol (protocol='0.5.3') to skip detection."
        )
    v21, v32 = _value(first.get("id21")), _value(first.get("id32"))
    evidence = [f"id 2 -> {_value(first.get('alive'))}", f"id 21 -> {v21!r}",
                f"id 32 -> {v32!r}"]
    if v21 == "OK":
        raise ProtocolMismatch(
            f"the server at {url} is LMCache 0.5.0 (id 21 answered NOOP's 'OK'); this client "
            f"speaks {SPOKEN}: upgrade the server"
        )
    if not isinstance(v21, int) or isinstance(v21, bool):
        raise ProtocolMismatch(
            f"the server at {url} did not answer GET_CHUNK_SIZE (id 21 -> {v21!r}): an LMCache "
            f"release older than 0.5.0, or not LMCache; this client speaks {SPOKEN}"
        )
    if v32 is None:
        return Detection("0.5.3", "0.5.3/0.5.4", tuple(evidence))
    if not isinstance(v32, list):
        raise ProtocolMismatch(f"unexpected reply to id 32 from {url}: {v32!r}")
    if "kv_event_stream" in v32:
        # 0.5.6 with its event bus on (its default; 0.5.7 dropped the tag): its own key
        # form first, so that the usual 0.5.6 server logs no error at all.
        return _key_forms(exchange, url, timeout, grace, evidence, ("0.5.6", "0.5.7"))
    # 0.5.5, 0.5.6 with its event bus off, or 0.5.7. Asked in the order that leaves the
    # fewest errors in the server's log (each question a release cannot answer is one
    # ERROR there): the 0.5.7 key form first (the newest release: none), then id 11
    # (0.5.5 answers it: one, the 0.5.7 form it dropped), then the 0.5.6 form (0.5.6
    # without its event bus: two). FREE_LOOKUP_LOCKS of an empty range is harmless on
    # 0.5.5 too: it returns before touching state, as 0.5.6 and 0.5.7 do, and a form
    # with the wrong payload count is dropped before any handler runs.
    if _accepts_key_form(exchange, url, timeout, grace, evidence, "0.5.7"):
        return Detection("0.5.7", "0.5.7", tuple(evidence))
    v11 = _value(_ask(exchange, url, timeout, grace, "id11",
                      [_enc(11), _enc(f"lmcache-mp-probe-{os.urandom(6).hex()}")]))
    evidence.append(f"id 11 -> {v11!r}")
    if isinstance(v11, int) and not isinstance(v11, bool):
        return Detection("0.5.5", "0.5.5", tuple(evidence))
    if v11 is not None:
        raise ProtocolMismatch(f"unexpected reply to id 11 from {url}: {v11!r}")
    return _key_forms(exchange, url, timeout, grace, evidence, ("0.5.6",))


def _ask(exchange: Exchange, url: str, timeout: float, grace: float, name: str,
         frames: list[bytes]) -> list[bytes] | None:
    """One pool-run question fenced by a PING on the same pool: its reply frames, or
    None if the server dropped it. A reply may still come after the fence from another
    worker of a multi-worker pool: waited for ``grace`` more seconds."""
    replies = exchange([(name, frames), (f"{name}-ping", [_enc(22), _enc(None)])],
                       f"{name}-ping", timeout)
    if replies.get(f"{name}-ping") is None:
        raise RequestTimeout(f"the server at {url} stopped answering during detection (PING)")
    reply = replies.get(name)
    if reply is None and grace > 0:
        reply = exchange([], name, grace).get(name)
    return reply


def _free_locks_probe(form: str) -> list[bytes]:
    """FREE_LOOKUP_LOCKS of an empty range, in the 0.5.6 or the 0.5.7 form: each
    release decodes (on its message thread) and answers only its own form, and drops
    the other (0.5.7 keys carry ``token_bytes``, and a third payload ``extra_ranges``)."""
    common: dict[str, Any] = {"model_name": "lmcache-mp-probe", "world_size": 1, "worker_id": None,
              "start": 0, "end": 0, "request_id": f"lmcache-mp-probe-{os.urandom(6).hex()}",
              "num_kv_readers": 1}
    if form == "0.5.6":
        return [_enc(12), _enc(CacheKeyV055(token_ids=(), **common)), _enc(1)]
    return [_enc(12), _enc(CacheKeyV057(token_bytes=b"", **common)), _enc(1), _enc(())]


def _accepts_key_form(exchange: Exchange, url: str, timeout: float, grace: float,
                      evidence: list[str], form: str) -> bool:
    acked = _ask(exchange, url, timeout, grace, f"free{form.replace('.', '')}",
                 _free_locks_probe(form)) is not None
    evidence.append(f"FREE_LOOKUP_LOCKS {form} form -> {'ack' if acked else None}")
    return acked


def _key_forms(exchange: Exchange, url: str, timeout: float, grace: float,
               evidence: list[str], forms: tuple[str, ...]) -> Detection:
    """The first of ``forms`` whose key the server accepts (each asked only if the one
    before was dropped); a server that accepts none (a newer release) is refused
    before anything else is sent to it."""
    for form in forms:
        if _accepts_key_form(exchange, url, timeout, grace, evidence, form):
            return Detection(form, form, tuple(evidence))
    raise ProtocolMismatch(
        f"the LMCache server at {url} answers like none of the releases this client speaks "
        f"({SPOKEN}): {'; '.join(evidence)}. It is likely a newer LMCache release whose "
        f"wire format changed (its cache key, or FREE_LOOKUP_LOCKS's payloads); nothing else "
        f"was sent to it. Upgrade lmcache-mp, or, only if you know that release is "
        f"wire-compatible with one this client speaks, pin it: protocol='0.5.7'."
    )
