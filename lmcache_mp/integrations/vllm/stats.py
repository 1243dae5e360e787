"""The connector's metrics, as plain data (no vLLM import: unit tests run without it).

Each side (the scheduler, every worker) owns a :class:`Counters` and hands vLLM the
observations of the last interval through ``get_kv_connector_stats`` (a dict of
ints and lists of floats, pickled from the workers to the scheduler and on to vLLM's
stats loggers). vLLM sums the workers' dicts and the scheduler's (``aggregate``),
logs a summary per logging interval (``reduce``) and, under ``vllm serve``, feeds
the Prometheus metrics of :data:`METRICS` (``metrics.py``, which imports vLLM).

Names and meanings (docs/vllm.md lists them beside LMCache's own connector's):

* scheduler: ``lookups`` (prompts looked up, answered), ``lookup_tokens`` (their
  chunk-aligned tokens asked for), ``hit_tokens`` (tokens found on every server),
  ``lookup_seconds`` (submit to answer, per lookup; measured at the scheduler's
  polls, so at most one step late), ``lookups_given_up`` (not answered within
  ``lmcache.mp.l2_load_timeout``: a miss);
* workers, summed over ranks (each TP rank moves its own shard): ``loads`` /
  ``load_failures`` (RETRIEVEs done / failed or not sent: vLLM recomputed those
  blocks), ``loaded_tokens`` (tokens written into vLLM's blocks), ``stores`` /
  ``store_failures`` / ``skipped_stores`` (the server down: not sent),
  ``stored_tokens``, ``load_seconds`` / ``store_seconds`` (submit to done, per
  transfer; seen at ``get_finished``'s polls).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["COUNTERS", "DURATIONS", "METRICS", "Counters", "Metric", "aggregate", "is_empty",
           "reduce"]

#: Counts, summed over workers and intervals.
COUNTERS = ("lookups", "lookup_tokens", "hit_tokens", "lookups_given_up", "loads",
            "load_failures",
            "loaded_tokens", "stores", "store_failures", "skipped_stores", "stored_tokens")
#: Per-operation durations in seconds, concatenated over workers and intervals.
DURATIONS = ("lookup_seconds", "load_seconds", "store_seconds")


@dataclass(frozen=True)
class Metric:
    """One Prometheus metric: ``vllm:lmcache_mp_client_<name>`` fed from ``key``."""

    key: str
    name: str
    kind: str  # "counter" or "histogram"
    documentation: str


METRICS = (
    Metric("lookups", "lookups", "counter", "Prompts looked up on the LMCache servers."),
    Metric("lookup_tokens", "lookup_tokens", "counter",
           "Chunk-aligned prompt tokens looked up."),
    Metric("hit_tokens", "hit_tokens", "counter",
           "Looked-up tokens found on every LMCache server (the hit)."),
    Metric("lookups_given_up", "lookups_given_up", "counter",
           "Lookups not answered within lmcache.mp.l2_load_timeout (an L2 load too slow, "
           "the tier stalled): the request went on as a miss."),
    Metric("loaded_tokens", "loaded_tokens", "counter",
           "Tokens of KV loaded into vLLM's blocks (summed over workers)."),
    Metric("stored_tokens", "stored_tokens", "counter",
           "Tokens of KV stored to the LMCache servers (summed over workers)."),
    Metric("load_failures", "load_failures", "counter",
           "RETRIEVEs that failed or were not sent (vLLM recomputed their blocks)."),
    Metric("store_failures", "store_failures", "counter",
           "STOREs that failed, or were not sent because the server was down."),
    Metric("lookup_seconds", "lookup_duration_seconds", "histogram",
           "Lookup latency, submit to answer, as seen by the scheduler."),
    Metric("load_seconds", "load_duration_seconds", "histogram",
           "RETRIEVE latency, submit to done, as seen by the workers."),
    Metric("store_seconds", "store_duration_seconds", "histogram",
           "STORE latency, submit to done, as seen by the workers."),
)


class Counters:
    """One side's observations since vLLM last took them. Thread-safe: the scheduler's
    health thread and vLLM's step thread may both record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()
        # vLLM asks every step, on every process; most steps record nothing.
        self._dirty = False

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._data[name] += n
            self._dirty = True

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self._data[name].append(seconds)
            self._dirty = True

    def take(self) -> dict[str, Any] | None:
        """The interval's observations (None when nothing happened), and a new one."""
        if not self._dirty:  # read without the lock: a racing add is taken next time
            return None
        with self._lock:
            data, self._data, self._dirty = self._data, _empty(), False
        return None if is_empty(data) else data


def _empty() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTERS}, **{k: [] for k in DURATIONS}}


def aggregate(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add ``other``'s observations to ``into`` (vLLM's contract: ``into`` is the
    accumulator, and is returned). Missing keys count as none (another release's
    dict, or a side that records only some)."""
    for k in COUNTERS:
        into[k] = int(into.get(k, 0)) + int(other.get(k, 0))
    for k in DURATIONS:
        into[k] = [*into.get(k, ()), *other.get(k, ())]
    return into


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(k) for k in (*COUNTERS, *DURATIONS))


def reduce(data: dict[str, Any]) -> dict[str, int | float]:
    """One logging interval, as vLLM's "KV Transfer metrics:" line shows it."""
    out: dict[str, int | float] = {k: int(data.get(k, 0)) for k in COUNTERS}
    asked = out["lookup_tokens"]
    out["hit_rate"] = round(out["hit_tokens"] / asked, 4) if asked else 0.0
    for k in DURATIONS:
        values = data.get(k) or []
        if values:
            out[k.replace("_seconds", "_avg_ms")] = round(sum(values) / len(values) * 1e3, 3)
    return out
