"""``LMCacheMPConnector`` for vLLM, on the lmcache_mp client (no ``lmcache`` import).

Load it with ``--kv-transfer-config '{"kv_connector": "LMCacheMPConnector",
"kv_connector_module_path": "lmcache_mp.integrations.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port":
5555}}'``. The scheduler role runs :class:`~.scheduler.SchedulerSide`, each worker a
:class:`~.worker.WorkerSide`; this class only adapts vLLM's interface (0.32, 0.33 and
0.34; what differs between them is read through compat.py).
MLA models (``model_config.use_mla``) follow LMCache's rules: see kv_caches.py and
config.placement.
With metrics.py (imported here), the only modules of lmcache_mp that import vLLM.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from ...client import Client
from ...errors import InvalidArgument, ProtocolMismatch
from .amx import request_amx_tiles
from .compat import (
    asks_kv_cache_access,
    draft_kv_suffix,
    host_hit_source,
    kv_cache_access,
    kv_events,
)
from .config import ConnectorConfig, placement
from .kv_caches import check_one_group, mla_only, refusal, registration_mode, wrap_layers
from .metrics import LMCacheMPClientPromMetrics, LMCacheMPClientStats
from .ops import StepOps
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = ["LMCacheMPConnector", "LMCacheMPClientMetadata"]

log = logging.getLogger("lmcache_mp")


class LMCacheMPClientMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's transfer orders, sent from the scheduler to every worker."""

    def __init__(self, step: StepOps) -> None:
        self.step = step


class WorkerReport(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What a worker did in a step that vLLM's own output does not carry, united over
    the ranks by vLLM (``aggregate``) for the scheduler side: the STOREs it could not
    make (vLLM's request id, start, end: the scheduler withdraws the ``BlockStored``
    events it published for them), and the requests whose synchronous load
    (``lmcache.mp.sync_load``) ended, well or not (every rank ends those in the step
    that ordered them: vLLM's output of that step carries the failed blocks)."""

    def __init__(self, failed: set[tuple[str, int, int]],
                 sync_loaded: set[str] | None = None) -> None:
        self.failed = failed
        self.sync_loaded = sync_loaded or set()

    def aggregate(self, other: Any) -> WorkerReport:
        return WorkerReport(self.failed | getattr(other, "failed", set()),
                            self.sync_loaded | getattr(other, "sync_loaded", set()))


#: How long the scheduler's first health check waits for a server its workers have just
#: registered with (once, at engine start).
FIRST_CHECK_S = 30.0


class ProtocolFamilies(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """A worker's answer to "which wire family does my server speak" (server URL ->
    family), handed by vLLM to the scheduler once every worker registered, so that the
    scheduler sends no protocol probe of its own (issue 37)."""

    def __init__(self, families: dict[str, str]) -> None:
        self.families = families


class LMCacheMPConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM KV connector for an LMCache MP server, built on lmcache_mp."""

    # vLLM 0.34 labels the hits it loads by tier: the servers' host-memory pool.
    _cache_hit_source = host_hit_source() or getattr(KVConnectorBase_V1,
                                                     "_cache_hit_source", None)

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.cfg = ConnectorConfig.from_extra(extra)
        pc = vllm_config.parallel_config
        # The drafter's layers (EAGLE, MTP, a draft model) are registered too: their
        # objects are keyed apart from the model's alone (compat.draft_kv_suffix).
        self.model_name = self.cfg.keyed_model_name(
            str(vllm_config.model_config.model)) + draft_kv_suffix(vllm_config)
        if getattr(pc, "decode_context_parallel_size", 1) > 1:
            raise InvalidArgument("decode-context parallelism is not supported by the "
                                  "lmcache_mp connector yet")
        if getattr(pc, "prefill_context_parallel_size", 1) > 1:
            raise InvalidArgument(
                "prefill-context parallelism (--prefill-context-parallel-size "
                f"{pc.prefill_context_parallel_size}) is not supported by the lmcache_mp "
                "connector: each PCP rank holds a part of every request's KV and would "
                "store it as a whole copy of its own, and the read locks would not count "
                "the PCP ranks; set --prefill-context-parallel-size 1")
        n = len(self.cfg.server_urls)
        if n > 1 and (getattr(pc, "pipeline_parallel_size", 1) > 1
                      or getattr(pc, "data_parallel_size", 1) > 1):
            raise InvalidArgument("several LMCache servers with pipeline or data parallelism "
                                  "are refused (as by LMCache's connector)")
        self.block_size = int(vllm_config.cache_config.block_size)
        world, rank = int(pc.world_size), int(pc.rank)
        tp = max(1, int(pc.tensor_parallel_size))
        self.mla = mla_only(vllm_config.model_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        cfg = self.cfg
        def client(url: str) -> Client:
            return Client(url, timeout=cfg.mq_timeout, heartbeat_interval=cfg.heartbeat_interval,
                          protocol=cfg.protocol)

        if role == KVConnectorRole.SCHEDULER:
            clients: dict[str, Any] = {url: client(url) for url in cfg.server_urls}
            kv_world = placement(cfg.server_urls, world, 0, mla=self.mla,
                                 tp_size=tp).kv_world_size
            self.scheduler = SchedulerSide(
                self.cfg, clients, model_name=self.model_name, kv_world_size=kv_world,
                events=bool(getattr(getattr(vllm_config, "kv_events_config", None),
                                    "enable_kv_cache_events", False)),
                lookup_tp_size=max(1, tp // n), block_size=self.block_size, mla=self.mla,
                kv_role=str(self._kv_transfer_config.kv_role or "kv_both"),
                # An idle DP rank runs a dummy batch after its step, whose collectives
                # the other ranks' forward passes wait for: no wait for loads there.
                idle_waits=int(getattr(pc, "data_parallel_size", 1) or 1) == 1,
                # Its first health check waits for the workers' protocol families
                # (set_xfer_handshake_metadata), or runs when a lookup first needs it.
                initial_check=False)
        else:
            place = placement(self.cfg.server_urls, world, rank, mla=self.mla, tp_size=tp)
            self.worker = WorkerSide(self.cfg, client(place.url), place,
                                     self.model_name)

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's KV cache, registered with the server (vLLM 0.34's extensible cache:
        called once its final size is committed, in ``extend_kv_cache``, with per-layer
        views whose storages span one layer's committed blocks each; nothing earlier).
        A cache and mode that cannot work together raise here, saying what to set."""
        assert self.worker is not None
        # One group (no hybrid KV-cache groups): layers in vLLM's registration order,
        # each a 4-D view (kv_caches.py). CPU tensors: engine-driven only; CUDA
        # tensors: either mode (under vLLM 0.34 the one kv_cache_access declared).
        check_one_group(self._kv_cache_config)
        layers = list(kv_caches.values())
        device = getattr(getattr(layers[0], "device", None), "type", None) if layers else None
        if device == "cpu":
            request_amx_tiles()  # before vLLM's CPU attention first runs: amx.py
        declared = asks_kv_cache_access()
        mode = registration_mode(self.cfg.mode, str(device), declared)
        first = [wrap_layers(layers, self.block_size, mode, mla=self.mla)]  # refused now
        worker, cfg = self.worker, self.cfg

        def register(instance_id: int | None) -> Any:
            # Wrapped again after a wake-up: the memory behind the same views is new
            # (CUDA IPC handles made before would be stale).
            cache = first.pop() if first else wrap_layers(layers, self.block_size, mode,
                                                          mla=self.mla)
            try:
                return worker.client.register(
                    cache, model_name=self.model_name, mode=mode,
                    world_size=worker.place.kv_world_size,
                    worker_id=worker.place.kv_worker_id, instance_id=instance_id,
                    timeout=cfg.mq_timeout)
            except (InvalidArgument, ProtocolMismatch) as err:
                raise InvalidArgument(refusal(cfg.mode, mode, str(device), declared,
                                              err)) from err

        worker.set_registration(register, self.block_size)

    def _step(self) -> StepOps:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheMPClientMetadata)
        return meta.step

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_loads(self._step())

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Called first in the step, before the model runner prepares its inputs:
        # preempted requests' blocks may be rewritten in it, so stores still reading
        # them must finish first; then the step's loads may start (a CPU cache's: see
        # WorkerSide.start_loads).
        if self.worker is None or not isinstance(kv_connector_metadata,
                                                 LMCacheMPClientMetadata):
            return
        step = kv_connector_metadata.step
        if step.preempted:
            self.worker.flush_stores(step.preempted)
        self.worker.start_loads(step, early=True)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.start_stores(self._step())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        assert self.worker is not None
        sending, recving = self.worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        """This rank's STOREs that failed or were skipped since the last step (for the
        scheduler side's KV events: ``take_events``), and its synchronous loads that
        ended (the scheduler's RETRIEVE is then done)."""
        if self.worker is None:
            return None
        failed, loaded = self.worker.failed_stores(), self.worker.sync_loads_ended()
        return WorkerReport(failed, loaded) if failed or loaded else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
            for client in self.scheduler.clients.values():
                client.close()

    # ================================================ one protocol probe per engine
    # Workers register (and so probe their server) before any other process could tell
    # them the answer; vLLM then collects each worker's handshake metadata for the
    # scheduler, which takes the families from there instead of probing again.
    def get_handshake_metadata(self) -> ProtocolFamilies | None:
        worker = self.worker
        if worker is None or not worker.client.protocol_identified or not self._top_level():
            return None
        return ProtocolFamilies({worker.place.url: worker.client.server_protocol})

    def _top_level(self) -> bool:
        """Whether vLLM's worker holds this connector itself, not a MultiConnector
        around it: a MultiConnector forwards only its first sub-connector's handshake
        metadata that is not None to every sub-connector's scheduler (NIXL's, which
        must travel, and whose scheduler refuses any other). Its sub-connectors' configs
        carry their own class names, so only the worker's group says which it is."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return bool(has_kv_transfer_group()) and get_kv_transfer_group() is self

    def set_xfer_handshake_metadata(self, metadata: dict[Any, Any]) -> None:
        if self.scheduler is None:
            return
        told = False
        for meta in metadata.values():
            for url, family in getattr(meta, "families", {}).items():
                client = self.scheduler.clients.get(url)
                told = told or client is not None
                if client is not None and client.adopt_protocol(family,
                                                                source="vLLM's workers"):
                    log.info("lmcache_mp connector: server %s speaks %s (its workers' "
                             "probe); the scheduler sends none", url, family)
        # The first health check, now (at engine start, before any request): a check
        # first run by the first request's lookup would, if it failed, make that request
        # and every one added with it a miss that stores nothing. The workers have just
        # registered with these servers, so they are alive: on a machine starved of CPU
        # (a TP engine's ranks spin-wait) their answer may take longer than a health
        # interval, and is worth waiting for here, once.
        self.scheduler.check_health(FIRST_CHECK_S if told else None)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[Any, Any]) -> None:
        self.set_xfer_handshake_metadata(metadata)  # every pipeline stage's workers

    # ========================================================= scheduler side
    def on_new_request(self, request: Any) -> None:
        if self.scheduler is not None:  # the lookup starts (lmcache.mp.eager_prefetch)
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        groups: tuple[list[int], ...] = blocks.get_block_ids() or ([],)
        self.scheduler.update_state_after_alloc(request, groups[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return LMCacheMPClientMetadata(self.scheduler.build_step(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        self.scheduler.update_connector_output(
            connector_output.finished_recving, connector_output.finished_sending,
            getattr(connector_output, "invalid_block_ids", None),
            getattr(report, "failed", None), getattr(report, "sync_loaded", None))

    @property
    def requires_kv_delivery(self) -> bool:
        """False: the servers are a best-effort cache; a store that a preemption drops
        is a later miss, never wrong output (vLLM 0.34 then keeps a preempted
        request's in-flight output instead of dropping it; its default, True for
        ``kv_both``, is for P/D hand-offs)."""
        return False

    def has_pending_block_frees(self) -> bool:
        """Whether blocks of finished requests are held only for stores in flight
        (bounded by ``lmcache.mp.transfer_timeout``): vLLM 0.34 then waits a step
        for them instead of preempting a running request."""
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    def may_load_async(self, request: Any) -> bool:
        """Whether this request may load from the servers (its hit, when its lookup
        answered already; otherwise whether it is looked up at all): vLLM 0.34 admits
        such requests while the batch is full under ``--max-num-inflight-kv-loads``."""
        return self.scheduler is not None and self.scheduler.may_load(request)

    def take_events(self) -> list[Any]:
        """KV events since the last call (with ``--kv-events-config`` enabled): blocks
        this engine stored on the servers, and blocks whose load failed, as vLLM's
        ``BlockStored`` / ``BlockRemoved`` on medium ``CPU`` (compat.kv_events)."""
        if self.scheduler is None:
            return []
        records = self.scheduler.take_events()
        return kv_events(records, self.block_size) if records else []

    def reset_cache(self) -> bool | None:
        """vLLM's cache reset (``LLM.sleep(reset_connector=True)``, the default; a pause
        that clears caches; a weight update): this engine never loads KV stored before
        it (scheduler.py ``SchedulerSide.reset``). True; None on a worker."""
        return None if self.scheduler is None else self.scheduler.reset()

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request), None

    # ================================================================ metrics
    def get_kv_connector_stats(self) -> LMCacheMPClientStats | None:
        """This side's observations since the last call (vLLM sums the workers' and the
        scheduler's, logs them and, under ``vllm serve``, exports them): stats.py."""
        side = self.worker if self.worker is not None else self.scheduler
        data = side.metrics.take() if side is not None else None
        return None if data is None else LMCacheMPClientStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> LMCacheMPClientStats:
        return LMCacheMPClientStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> LMCacheMPClientPromMetrics:
        return LMCacheMPClientPromMetrics(vllm_config, metric_types, labelnames,
                                          per_engine_labelvalues)

    # ============================================================ sleep mode
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+ releases the KV cache's memory on sleep (and 0.34 for weight
        updates that borrow it) between ``unregister_kv_caches`` and
        ``restore_kv_caches``: followed (worker.py ``unregister`` / ``restore``)."""
        return True

    def unregister_kv_caches(self) -> None:
        if self.worker is not None:
            self.worker.unregister()

    def restore_kv_caches(self) -> None:
        if self.worker is not None:
            self.worker.restore()

    # ============================================================= vLLM 0.34
    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """How this connector's workers reach vLLM's KV cache (vLLM 0.34 allocates it
        accordingly): what ``lmcache.mp.mp_transfer_mode`` makes them do
        (compat.kv_cache_access). ``auto`` and ``engine_driven``: ``IN_PROCESS``
        (this process copies; vLLM keeps its extensible VMM cache);
        ``lmcache_driven``: ``LEGACY_IPC`` (the server maps the cache through CUDA
        IPC; vLLM then allocates an ordinary one). A configuration that is wrong
        anyway is refused here, when vLLM reads its config."""
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        return kv_cache_access(ConnectorConfig.from_extra(extra, quiet=True).mode)
