"""vLLM's side of the connector's metrics (imports vLLM; the data is ``stats.py``).

``LMCacheMPClientStats`` is what ``get_kv_connector_stats`` returns and what vLLM
rebuilds from the pickled dict (``build_kv_connector_stats``); vLLM logs its
``reduce()`` as "KV Transfer metrics: ..." and, under ``vllm serve``, feeds
``LMCacheMPClientPromMetrics``: the counters and histograms of ``stats.METRICS`` as
``vllm:lmcache_mp_client_*`` with vLLM's per-engine labels.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from . import stats

__all__ = ["LMCacheMPClientStats", "LMCacheMPClientPromMetrics", "PREFIX"]

PREFIX = "vllm:lmcache_mp_client_"
#: Latency buckets (seconds): a lookup or a CPU transfer takes ~1 ms, a long prompt's
#: transfer or a server under load up to seconds.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LMCacheMPClientStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's observations of the scheduler and every worker (``data``)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, LMCacheMPClientStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into "
                            f"LMCacheMPClientStats")
        self.data = stats.aggregate(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class LMCacheMPClientPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The Prometheus metrics of ``stats.METRICS``, one child per engine label."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, tuple[str, dict[int, Any]]] = {}
        for m in stats.METRICS:
            if m.kind == "counter":
                metric = self._counter_cls(name=PREFIX + m.name, documentation=m.documentation,
                                           labelnames=labelnames)
            else:
                metric = self._histogram_cls(name=PREFIX + m.name,
                                             documentation=m.documentation,
                                             labelnames=labelnames, buckets=list(BUCKETS))
            self._metrics[m.key] = (m.kind, {engine: metric.labels(*values) for engine, values
                                             in per_engine_labelvalues.items()})

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, (kind, per_engine) in self._metrics.items():
            child = per_engine.get(engine_idx)
            value = transfer_stats_data.get(key)
            if child is None or not value:
                continue
            if kind == "counter":
                child.inc(value)
            else:
                for seconds in value:
                    child.observe(seconds)
