"""Drives vLLM's real Scheduler and worker-side connector machinery on a CPU, offline.

Real: ``VllmConfig`` (a local tiny Llama config, no weights, no tokenizer),
``Scheduler``, ``Request`` with vLLM's block hasher, the connector built by
``KVConnectorFactory`` for both roles, ``KVConnectorModelRunnerMixin``'s per-step
wiring, ``KVOutputAggregator`` over the ranks, ``update_from_output``, and the KV
caches: the layout resolved by vLLM's ``resolve_kv_cache_layout`` from an attention
backend's declared layouts (``VLLM_KV_CACHE_LAYOUT`` honoured, as in vLLM), the
``KVCacheConfig`` from vLLM's ``get_kv_cache_configs`` and the tensors from vLLM's
``allocate_kv_cache``: one allocation per rank, a 4-D ``[num_blocks, heads,
block_size, 2 * head_size]`` view per layer in that physical layout (MLA: one head,
the latent width). Faked: the model (no weights, no attention layers), the forward pass (it writes a
token-derived pattern into the KV blocks it computes, through the backend's own view
of the cache: CPU_ATTN splits each block's rows, FLASH_ATTN the content axis) and
sampling (a fixed next token). The scheduler output is pickled on its way to the
workers, as between processes.

When a request is first scheduled with ``c`` tokens already computed (vLLM's own
prefix cache, or a connector load), positions ``[0, c)`` of its blocks are checked
against the pattern on every rank: a load that wrote wrong bytes fails the run.

vLLM 0.34 (``.venv-vllm-0.34.0``): the worker hooks are driven by vLLM's V2
``ActiveKVConnector`` (``v1/worker/gpu/kv_connector.py``: the V1 model runner and its
mixin are gone), and the KV cache is what 0.34 allocates on CUDA by default when the
connector's ``kv_cache_access`` allows it (vLLM's own ``_resolve_extensible_kv_cache``
decides): the extensible cache, padded per layer, committed after warm-up, the
connector created and the committed views registered in ``extend_kv_cache``, all
vLLM's own code over host memory (``extensible.py``). ``sleep_wake`` phases release
and recommit it between ``unregister_kv_caches`` and ``restore_kv_caches``, as
``GPUWorker.sleep`` / ``wake_up`` do.

Runs under any Python with vLLM importable: ``.venv-vllm`` (our connector), or an
oracle venv with vLLM's tree on the path (LMCache's own connector), see ``cross.py``.
Also a script: ``python harness.py SPEC.json`` prints a JSON result.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

NUM_LAYERS, KV_HEADS, HEADS, HEAD_DIM, VOCAB = 2, 2, 4, 16, 1000
#: Blocks the extensible cache commits during "warm-up" (before its final size).
WARMUP_BLOCKS = 8
KV_LORA_RANK, QK_ROPE_DIM = 16, 8
MLA_HEAD = KV_LORA_RANK + QK_ROPE_DIM
OURS = ("LMCacheMPConnector", "lmcache_mp.integrations.vllm")
LMCACHE = ("LMCacheMPConnector", "lmcache.integration.vllm.lmcache_mp_connector")


def model_dir() -> str:
    """A directory holding only a tiny Llama config.json."""
    return _config_dir("lmcache_mp_vllm_tiny_llama", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HEADS * HEAD_DIM, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": NUM_LAYERS,
        "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "torch_dtype": "float16", "rms_norm_eps": 1e-5})


def mla_model_dir() -> str:
    """A directory holding only a tiny DeepSeek-V2 config.json: vLLM's ModelConfig
    reads it offline with ``use_mla`` True and head size ``MLA_HEAD``."""
    return _config_dir("lmcache_mp_vllm_tiny_deepseek_v2", {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": HEADS * HEAD_DIM, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "num_hidden_layers": NUM_LAYERS,
        "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": NUM_LAYERS, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "torch_dtype": "float16", "rms_norm_eps": 1e-5,
        "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None,
        "qk_rope_head_dim": QK_ROPE_DIM, "qk_nope_head_dim": 16, "v_head_dim": 16})


def _config_dir(name: str, cfg: dict[str, Any]) -> str:
    """``<tmp>/name/config.json`` holding ``cfg``, written atomically once (the same
    path every run, so the model name, part of the cache key, is the same for every
    engine)."""
    path = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, "config.json")
    if not os.path.exists(target):
        with open(target + ".tmp", "w") as f:
            json.dump(cfg, f)
        os.replace(target + ".tmp", target)
    return path


def pattern(rank: int, layer: int, tokens: torch.Tensor, positions: torch.Tensor,
            mla: bool = False, heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> torch.Tensor:
    """KV values for tokens at positions: [2, n, heads, head_dim] float16, exact
    small multiples of 1/8 (no rounding), different per rank, layer, plane, head, dim.
    ``mla``: [n, MLA_HEAD], the same on every rank (replicated over TP)."""
    if mla:
        d = torch.arange(MLA_HEAD).view(1, MLA_HEAD)
        t, p = tokens.view(-1, 1), positions.view(-1, 1)
        v = (t * 31 + p * 7 + layer * 13 + d * 5) % 997
        return (v.to(torch.float32) / 8).to(torch.float16)
    kv = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(heads).view(1, 1, heads, 1)
    d = torch.arange(head_dim).view(1, 1, 1, head_dim)
    t = tokens.view(1, -1, 1, 1)
    p = positions.view(1, -1, 1, 1)
    v = (t * 31 + p * 7 + layer * 13 + rank * 101 + kv * 3 + h * 11 + d * 5) % 997
    return (v.to(torch.float32) / 8).to(torch.float16)


@dataclass
class RequestResult:
    prompt_len: int
    first_computed: int = -1      # tokens already computed when first scheduled
    verified: bool = True
    #: Tokens already computed each time it was scheduled again after a preemption.
    resumed: list[int] | None = None
    aborted: bool = False  # aborted while waiting for its KV load (``Engine.run``)
    #: Times vLLM took computed tokens back from it while it kept running (a failed
    #: load's invalid blocks it holds), and its status when it left the engine.
    rewound: int = 0
    #: Times it was first scheduled with a synchronous load (``lmcache.mp.sync_load``)
    #: that failed in that step: its blocks were not checked then (vLLM rewinds it and
    #: discards that step's output for it).
    failed_sync_loads: int = 0
    status: str = ""
    output_tokens: int = 0


def v1_model_runner_mixin() -> Any:
    """vLLM's V1 model runner's connector wiring (0.32, 0.33), or None (0.34: the V2
    runner's ``ActiveKVConnector`` drives the worker hooks)."""
    try:
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin,
        )
    except ImportError:
        return None
    return KVConnectorModelRunnerMixin


def runner_output(cls: Any, req_ids: list[str], **fields: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` for ``req_ids`` (0.32 / 0.33 also want
    ``req_id_to_index``, which 0.34 dropped)."""
    import dataclasses

    if "req_id_to_index" in {f.name for f in dataclasses.fields(cls)}:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return cls(req_ids=req_ids, **fields)


def extensible_by_vllm(config: Any) -> bool:
    """Whether vLLM would allocate its extensible KV cache for ``config`` on a CUDA
    device (0.34+; False before): its own ``_resolve_extensible_kv_cache``, on a copy
    of the config whose platform says CUDA and whose block count is not fixed (the
    harness fixes it). It asks the connector's ``kv_cache_access``."""
    try:
        import vllm.v1.worker.extensible_kv_cache  # noqa: F401
    except ImportError:
        return False
    from vllm.platforms import current_platform

    cfg = copy.copy(config)
    cfg.cache_config = copy.copy(config.cache_config)
    cfg.cache_config._extensible_kv_cache_resolved = False
    cfg.cache_config.enable_extensible_kv_cache = None
    cfg.cache_config.num_gpu_blocks_override = None
    cfg.cache_config.kv_cache_memory_bytes = None
    platform = type(current_platform)
    real = platform.is_cuda_alike
    platform.is_cuda_alike = lambda self: True  # type: ignore[method-assign]
    try:
        cfg._resolve_extensible_kv_cache()
    finally:
        platform.is_cuda_alike = real  # type: ignore[method-assign]
    return bool(cfg.cache_config.enable_extensible_kv_cache)


def kv_cache_configs(config: Any, specs: list[dict[str, Any]], memory: list[int]) -> Any:
    """vLLM's ``KVCacheConfig`` per worker, as its engine core computes them
    (``v1/engine/core.py`` ``_initialize_kv_caches``): 0.32 in ``kv_cache_utils``,
    0.33 in ``kv_cache_planning`` with the model's KV-cache groups computed first."""
    try:
        from vllm.v1.core.kv_cache_planning import (  # vLLM 0.33
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(config, specs, memory)
    return get_kv_cache_configs(config, specs, memory,
                                get_global_kv_cache_groups(config, specs))


def _backend_class(name: str) -> Any:
    """vLLM's own attention backend class called ``name``."""
    if name == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    if name == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend
    raise ValueError(f"no such backend in the harness: {name}")


def backend_planes(backend: str, kv: torch.Tensor, mla: bool) -> list[torch.Tensor]:
    """The K and V planes of one layer's 4-D cache as the backend itself reads them
    (vLLM 0.32 ``v1/attention/backends/cpu_attn.py`` / ``flash_attn.py``), indexable
    ``[block, slot]`` (CPU_ATTN: ``[block, :, slot]``); MLA: the one latent plane."""
    if mla:
        return [kv[:, 0]]  # [num_blocks, 1, block_size, latent]
    nb, heads, bs, c = kv.shape
    if backend == "CPU_ATTN":
        return list(kv.view(nb, heads, 2 * bs, c // 2).chunk(2, dim=2))
    return list(kv.transpose(1, 2).split(c // 2, dim=-1))


class Engine:
    """One vLLM engine: a scheduler and ``tp`` worker ranks, each with its KV tensors
    from vLLM's allocator. ``backend``: the attention backend whose declared layouts
    vLLM resolves and whose view of the cache the fake forward pass writes through
    (CPU_ATTN, as vLLM's CPU engine; FLASH_ATTN, as a GPU engine); the layout can be
    forced with ``VLLM_KV_CACHE_LAYOUT``, as in vLLM."""

    def __init__(self, connector: tuple[str, str], extra: dict[str, Any], *, tp: int = 1,
                 num_blocks: int = 96, block_size: int = 16, model: str | None = None,
                 prefix_caching: bool = True, mla: bool = False,
                 backend: str = "CPU_ATTN", extensible: bool | None = None,
                 kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
                 warmup_blocks: int = WARMUP_BLOCKS,
                 failure_policy: str = "recompute", observe: bool = False) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.utils.hashing import sha256
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.block_size, self.tp = block_size, tp
        self.warmup_blocks = warmup_blocks
        self.mla, self.backend = mla, backend
        model_cfg = ModelConfig(model=model or (mla_model_dir() if mla else model_dir()),
                                skip_tokenizer_init=True, dtype="float16", max_model_len=1024)
        assert model_cfg.use_mla == mla, f"vLLM's use_mla is {model_cfg.use_mla}"
        kv_cfg = KVTransferConfig(kv_connector=connector[0],
                                  kv_connector_module_path=connector[1], kv_role="kv_both",
                                  kv_connector_extra_config=extra,
                                  kv_load_failure_policy=failure_policy)
        # ``observe`` (0.34): what vLLM's scheduler asks the connector beyond the
        # transfers: KV events on (a null publisher, its batches recorded), stats on
        # (hit sources), async admission of loads (--max-num-inflight-kv-loads 2).
        observed: dict[str, Any] = {}
        sched_extra: dict[str, Any] = {}
        if observe:
            from vllm.config import KVEventsConfig

            observed["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True,
                                                          publisher="null")
            sched_extra["max_num_inflight_kv_loads"] = 2
        self.config = VllmConfig(
            model_config=model_cfg,
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching,
                                     num_gpu_blocks_override=num_blocks),
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                             max_model_len=1024, is_encoder_decoder=False,
                                             **sched_extra),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=kv_cfg,
            **observed,
        )
        self.observe = observe
        #: With ``observe``: the KV events vLLM published, the hit sources it got from
        #: the connector, each request's waiting queue at admission, and whether
        #: ``has_pending_block_frees`` ever disagreed with the held requests.
        self.observed: dict[str, Any] = {"events": [], "hit_sources": [], "queues": {},
                                         "pending_frees": [0, 0], "pending_wrong": 0}
        # vLLM 0.34 on CUDA: the extensible cache unless the connector's kv_cache_access
        # rules it out (``extensible=None``: as vLLM decides).
        self.extensible = (extensible_by_vllm(self.config) if extensible is None
                           else extensible)
        #: The extensible cache reserves a capacity (here twice the blocks) and
        #: commits the final count, ``num_blocks``, after warm-up.
        reserve = 2 if self.extensible else 1
        if self.extensible:
            self.config.cache_config.enable_extensible_kv_cache = True
            self.config.cache_config.num_gpu_blocks_override = num_blocks * reserve
        self.mixin = v1_model_runner_mixin()
        layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
        # A rank holds its share of the KV heads (MLA's one latent head is replicated).
        self.heads = 1 if mla else kv_heads // tp
        self.head_dim = head_dim
        spec = (MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=MLA_HEAD,
                                 dtype=torch.float16) if mla else
                FullAttentionSpec(block_size=block_size, num_kv_heads=self.heads,
                                  head_size=head_dim, dtype=torch.float16))
        specs = {n: spec for n in layer_names}
        backend_cls = _backend_class(backend)
        declared = backend_cls.supported_kv_cache_layouts()
        with set_current_vllm_config(self.config):
            # What the engine core does before profiling: resolve one layout from what
            # the workers' backends declare, then size the cache for every worker.
            layout = resolve_kv_cache_layout(
                self.config, [[x.name for x in declared]] if declared else
                [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]], list(specs.values()))
            configs = kv_cache_configs(
                self.config, [specs] * tp,
                [spec.page_size_bytes * num_blocks * NUM_LAYERS * reserve] * tp)
        self.layout = layout.name
        for c in configs:
            c.kv_cache_layout = self.layout
        self.kv_cache_config = copy.copy(configs[0])
        self.kv_cache_config.num_blocks = configs[0].num_blocks // reserve
        self.num_blocks = self.kv_cache_config.num_blocks
        self.config.cache_config.num_gpu_blocks = self.num_blocks
        init_none_hash(sha256)
        self.hasher_fn = sha256
        with set_current_vllm_config(self.config):
            self.scheduler = Scheduler(
                vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=block_size, log_stats=observe)
            if observe:
                self._observe()
            self.workers: list[Any] = []
            #: Per rank: vLLM's V2 ActiveKVConnector (0.34), None with the V1 mixin.
            self.drivers: list[Any] = []
            #: Per rank: the ExtensibleKVCache (0.34 extensible), else None.
            self.caches: list[Any] = []
            self.kv: list[dict[str, torch.Tensor]] = []
            self.planes: list[dict[str, list[torch.Tensor]]] = []
            for rank in range(tp):
                cfg = copy.deepcopy(self.config)
                cfg.parallel_config.rank = rank
                with set_current_vllm_config(cfg):
                    w, driver, cache, caches = self._rank(cfg, configs[rank], layout)
                self.workers.append(w)
                self.drivers.append(driver)
                self.caches.append(cache)
                self.kv.append(caches)
                self.planes.append({n: backend_planes(backend, t, mla)
                                    for n, t in caches.items()})
        self.layer_names = layer_names
        self.results: dict[str, RequestResult] = {}
        #: Every vLLM Request added (they leave the scheduler when finished).
        self.finished_requests: list[Any] = []
        self.tokens: dict[str, list[int]] = {}
        self._aggregator: Any = None
        #: Called once, when a step first carries a RETRIEVE, before the workers run.
        self.on_retrieve: Any = None
        #: Request id -> called once, when a step first orders that request's RETRIEVE.
        self.on_retrieve_of: dict[str, Any] = {}
        #: num_computed_tokens of the running requests after the last step (rewinds).
        self._computed: dict[str, int] = {}
        #: The step's checks of loaded blocks (rank, request id, blocks, tokens, upto),
        #: made once the step's output says which loads failed.
        self._checks: list[tuple[int, str, list[int], list[int], int]] = []

    def _observe(self) -> None:
        """Record what vLLM publishes and asks (``observe``)."""
        s, seen = self.scheduler, self.observed
        publish = s.kv_event_publisher.publish

        def published(batch: Any) -> None:
            seen["events"].extend({"type": type(e).__name__, "medium": getattr(e, "medium", None),
                                   "hashes": [str(h) for h in getattr(e, "block_hashes", ())],
                                   "tokens": len(getattr(e, "token_ids", ()) or ()),
                                   "group_idx": getattr(e, "group_idx", None)}
                                  for e in batch.events)
            publish(batch)

        s.kv_event_publisher.publish = published
        sources = s.connector.get_external_cache_hit_sources

        def hit_sources(request: Any, n: int) -> Any:
            got = sources(request, n)
            seen["hit_sources"].append({str(k): v for k, v in got.items()})
            return got

        s.connector.get_external_cache_hit_sources = hit_sources
        seen["requires_kv_delivery"] = bool(s.requires_kv_delivery)

    def _rank(self, cfg: Any, kv_cache_config: Any, layout: Any
              ) -> tuple[Any, Any, Any, dict[str, torch.Tensor]]:
        """One worker rank as vLLM makes it: (its connector, the V2 driver or None, the
        extensible cache or None, its per-layer KV views)."""
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.worker.utils import allocate_kv_cache

        if self.extensible:
            import extensible

            padded, cache = extensible.allocate(kv_cache_config, layout, self.warmup_blocks,
                                                device=cfg.parallel_config.rank,
                                                vllm_config=cfg)
            # Warm-up ran without a connector: it is created once the memory is final.
            assert kv_transfer_state._KV_CONNECTOR_AGENT is None
            runner = extensible.extend(cfg, padded, cache, self.num_blocks,
                                       device=cfg.parallel_config.rank)
            w = kv_transfer_state._KV_CONNECTOR_AGENT
            kv_transfer_state._KV_CONNECTOR_AGENT = None
            self.final_kv_cache_config = runner.kv_cache_config
            return w, runner.kv_connector, cache, dict(runner.kv_caches_by_layer)
        w = KVConnectorFactory.create_connector(config=cfg, role=KVConnectorRole.WORKER,
                                                kv_cache_config=kv_cache_config)
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        if self.mixin is not None:
            w.register_kv_caches(caches)
            return w, None, None, caches
        from vllm.v1.worker.gpu.kv_connector import get_kv_connector

        kv_transfer_state._KV_CONNECTOR_AGENT = w
        try:  # vLLM's V2 wiring: it registers the caches
            return w, get_kv_connector(cfg, caches), None, caches
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None

    # ---------------------------------------------------------------- sleep mode
    def sleep(self, reset_connector: bool = True) -> None:
        """``LLM.sleep(level=1, reset_connector=...)`` as 0.33 / 0.34 run it: the
        scheduler pauses and clears its caches as ``EngineCore._reset_caches`` does
        (vLLM's prefix cache, and with ``reset_connector``, vLLM's default, the
        connector's ``reset_cache``; vLLM raises when that reports failure); each worker
        unregisters the connector's caches, then the KV cache's memory goes (the
        extensible cache's pages released; an ordinary one, sleep mode's allocator:
        discarded, here zeroed)."""
        assert self.scheduler.reset_prefix_cache(reset_running_requests=True,
                                                 reset_connector=reset_connector)
        for rank, w in enumerate(self.workers):
            w.unregister_kv_caches()
            if self.caches[rank] is not None:
                self.caches[rank].release_physical()
            else:
                for t in self.kv[rank].values():
                    t.zero_()

    def wake(self) -> None:
        """``LLM.wake_up()``: fresh memory behind the same views (the extensible cache
        recommitted), then ``restore_kv_caches``."""
        for rank, w in enumerate(self.workers):
            if self.caches[rank] is not None:
                self.caches[rank].recommit()
            w.restore_kv_caches()

    # ------------------------------------------------------------------ requests
    def add(self, rid: str, prompt: list[int], *, max_tokens: int = 3,
            cache_salt: str | None = None, prompt_logprobs: int | None = None,
            lora: dict[str, Any] | None = None) -> None:
        """``lora``: ``{"name", "id", "path"}`` of a LoRA adapter, as vLLM's own
        ``LoRARequest`` (the scheduler needs no LoRA config for it: no adapter is
        loaded, the forward pass is the harness's)."""
        from vllm import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                prompt_logprobs=prompt_logprobs)
        lora_request = None
        if lora is not None:
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest(lora["name"], lora["id"], lora["path"])
        req = Request(request_id=rid, prompt_token_ids=list(prompt),
                      sampling_params=params, pooling_params=None, cache_salt=cache_salt,
                      lora_request=lora_request,
                      block_hasher=get_request_block_hasher(self.block_size, self.hasher_fn))
        self.scheduler.add_request(req)
        if self.observe:
            s = self.scheduler
            self.observed["queues"][rid] = next(
                name for name, q in (("async_kv_waiting", s.async_kv_waiting),
                                     ("waiting", s.waiting),
                                     ("kv_holding_waiting", s.kv_holding_waiting))
                if any(r.request_id == rid for r in q))
        self.finished_requests.append(req)
        self.results[rid] = RequestResult(len(prompt))
        self.tokens[rid] = list(prompt)

    def run(self, deadline_s: float = 120.0, on_step: Any = None,
            abort: Any = ()) -> dict[str, RequestResult]:
        """Step until every request finished (a wall-clock limit: in-flight transfers
        have their own deadlines, and an engine that never finishes is the failure).
        ``abort``: requests aborted (as a client disconnecting does) in the first step
        after which they wait for their KV load (``aborted`` in their result)."""
        import time as _time

        from vllm.v1.request import RequestStatus

        limit = _time.monotonic() + deadline_s
        steps = 0
        pending = set(abort)
        while self.scheduler.has_requests():
            if _time.monotonic() > limit:
                raise RuntimeError(f"requests still unfinished after {deadline_s} s: "
                                   f"{self._states()}")
            self.step()
            steps += 1
            for rid in list(pending):
                req = self.scheduler.requests.get(rid)
                if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                    self.results[rid].aborted = True
                    pending.discard(rid)
            if on_step is not None:
                on_step(steps)
        return self.results

    def _states(self) -> dict[str, str]:
        return {rid: f"{r.status.name} computed={r.num_computed_tokens}"
                for rid, r in self.scheduler.requests.items()}

    def step(self) -> None:
        import time as _time

        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        retrieves = getattr(getattr(meta, "step", None), "retrieves", list)()
        if self.on_retrieve and retrieves:
            # Between the scheduler's lookup and the workers' RETRIEVE (our connector).
            hook, self.on_retrieve = self.on_retrieve, None
            hook()
        for op in retrieves:
            if op.request_id in self.on_retrieve_of:
                self.on_retrieve_of.pop(op.request_id)()
        wire = pickle.dumps(out)
        outputs = []
        for rank, worker in enumerate(self.workers):
            sout = pickle.loads(wire)
            kv_transfer_state._KV_CONNECTOR_AGENT = worker
            driver = self.drivers[rank]
            if driver is None:  # vLLM 0.32 / 0.33: the V1 model runner's mixin
                # GPUModelRunner.execute_model's first connector call, before it
                # prepares the step's inputs (our connector starts CPU loads there).
                worker.handle_preemptions(sout.kv_connector_metadata)
                with set_forward_context(None, self.config), \
                        self.mixin._get_kv_connector_output(sout) as kvo:
                    self._forward(rank, sout)
            else:  # vLLM 0.34: the V2 model runner's ActiveKVConnector
                driver.pre_forward(sout)
                with set_forward_context(None, self.config):
                    self._forward(rank, sout)
                driver.finish_forward()
                kvo = driver.post_forward(sout.finished_req_ids)
            outputs.append(runner_output(ModelRunnerOutput, [], kv_connector_output=kvo))
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        if self._aggregator is None:  # one for the engine's life: it counts across steps
            self._aggregator = KVOutputAggregator.from_connector(self.workers[0],
                                                                 len(self.workers))
        kvo = self._aggregator.aggregate(outputs).kv_connector_output
        self._run_checks(set(getattr(kvo, "invalid_block_ids", None) or ()))
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid]
            sampled.append([7 + len(req.output_token_ids)] if done >= req.num_tokens else [])
        mro = runner_output(ModelRunnerOutput, req_ids, sampled_token_ids=sampled,
                            kv_connector_output=kvo)
        self.scheduler.update_from_output(out, mro)
        for req in self.scheduler.running:  # computed tokens taken back: a rewind
            if req.num_computed_tokens < self._computed.get(req.request_id, 0):
                self.results[req.request_id].rewound += 1
        self._computed = {r.request_id: r.num_computed_tokens for r in self.scheduler.running}
        if self.observe:  # finished requests whose blocks vLLM still holds: stores
            held = any(r.is_finished() for r in self.scheduler.requests.values())
            pending = self.scheduler.connector.has_pending_block_frees()
            self.observed["pending_frees"][int(pending)] += 1
            self.observed["pending_wrong"] += int(pending != held)
        if not req_ids:
            _time.sleep(0.005)  # only transfers in flight: let them progress

    def _blocks(self, rid: str, sout: Any) -> list[int]:
        req = self.scheduler.requests.get(rid)
        if req is None:
            return []
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def _forward(self, rank: int, sout: Any) -> None:
        sched = [(n.req_id, n.num_computed_tokens) for n in sout.scheduled_new_reqs]
        cached = sout.scheduled_cached_reqs
        sched += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        # A request scheduled again after a preemption: in scheduled_new_reqs (vLLM
        # 0.34, and V2 runners), or resumed_req_ids (0.32 / 0.33's V1 runner).
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        resumed |= {n.req_id for n in sout.scheduled_new_reqs
                    if rank > 0 or self.results[n.req_id].first_computed >= 0}
        for rid, computed in sched:
            n = sout.num_scheduled_tokens[rid]
            blocks = self._blocks(rid, sout)
            req = self.scheduler.requests[rid]
            tokens = list(req.all_token_ids)
            res = self.results[rid]
            first = res.first_computed < 0
            if first:
                res.first_computed = computed
            elif rid in resumed and rank == 0:
                res.resumed = [*(res.resumed or []), computed]
            if computed and (first or rid in resumed):
                self._checks.append((rank, rid, blocks, tokens, computed))
            pos = torch.arange(computed, computed + n)
            tok = torch.tensor(tokens[computed:computed + n])
            for li, name in enumerate(self.layer_names):
                values = pattern(rank, li, tok, pos, mla=self.mla, heads=self.heads,
                                 head_dim=self.head_dim)
                at = self._slots(blocks, pos)
                for plane, v in zip(self.planes[rank][name], [values] if self.mla else values,
                                    strict=True):
                    plane[at] = v

    def _run_checks(self, invalid: set[int]) -> None:
        """The step's checks of what a request found computed when first scheduled
        (or resumed): after the forward pass, which writes only past it. A synchronous
        load is made in the step itself; one that failed (its blocks in the step's
        ``invalid_block_ids``) is not checked: vLLM rewinds the request and drops its
        output of the step."""
        checks, self._checks = self._checks, []
        for rank, rid, blocks, tokens, upto in checks:
            if invalid & set(blocks[:-(-upto // self.block_size)]):
                self.results[rid].failed_sync_loads += rank == 0
                continue
            self.results[rid].verified &= self._check(rank, blocks, tokens, upto)

    def _slots(self, blocks: list[int], pos: torch.Tensor) -> tuple[Any, ...]:
        """The index of the tokens at ``pos`` in a plane of ``backend_planes``: it
        selects [n, heads, head_dim] ([n, latent] for MLA)."""
        bs = self.block_size
        b = torch.tensor([blocks[p // bs] for p in pos.tolist()], dtype=torch.long)
        o = pos % bs
        return (b, o) if self.mla or self.backend != "CPU_ATTN" else (b, slice(None), o)

    def _check(self, rank: int, blocks: list[int], tokens: list[int], upto: int) -> bool:
        pos = torch.arange(0, upto)
        tok = torch.tensor(tokens[:upto])
        for li, name in enumerate(self.layer_names):
            want = pattern(rank, li, tok, pos, mla=self.mla, heads=self.heads,
                           head_dim=self.head_dim)
            at = self._slots(blocks, pos)
            for plane, w in zip(self.planes[rank][name], [want] if self.mla else want,
                                strict=True):
                if not torch.equal(plane[at], w):
                    return False
        return True

    def views(self) -> list[dict[str, Any]]:
        """What each rank registered: per layer its storage's bytes and data pointer,
        with the block count and one layer's bytes per block (a padded layer stride
        shows as pointers further apart than ``num_blocks * block_bytes``)."""
        out = []
        for rank, caches in enumerate(self.kv):
            layers = [caches[n] for n in self.layer_names]
            out.append({
                "extensible": self.extensible, "layout": self.layout,
                "num_blocks": int(layers[0].shape[0]),
                "block_bytes": int(layers[0][0].numel() * layers[0].element_size()),
                "storage_nbytes": [int(t.untyped_storage().nbytes()) for t in layers],
                "data_ptrs": [int(t.data_ptr()) for t in layers],
                "registered_blocks": int(self.workers[rank].worker.reg.cache.geometry.num_blocks)
                if getattr(self.workers[rank], "worker", None) is not None
                and self.workers[rank].worker.reg is not None else None,
                "registered_as": f"{type(self.workers[rank].worker.reg.cache).__name__} "
                                 f"{self.workers[rank].worker.reg.mode}"
                if getattr(self.workers[rank], "worker", None) is not None
                and self.workers[rank].worker.reg is not None else None,
                # The extensible cache: cuMemCreate chunks under each layer's view.
                "chunks": extensible_chunks(caches, self.layer_names)
                if self.caches[rank] is not None else None})
        return out

    def drain(self, deadline_s: float = 60.0) -> None:
        """Step until every finished request's blocks are released, i.e. the workers
        reported its stores done (vLLM keeps such requests until then)."""
        import time as _time

        limit = _time.monotonic() + deadline_s
        while self.scheduler.requests or self.scheduler.has_requests():
            if _time.monotonic() > limit:
                raise RuntimeError(f"requests still held after {deadline_s} s (stores "
                                   f"never reported done): {self._states()}")
            self.step()

    def wait_visible(self, requests: list[dict[str, Any]], timeout_s: float = 5.0) -> None:
        """Until the server's LOOKUP sees every whole prompt chunk of ``requests`` (or
        ``timeout_s``): some releases commit a STORE's chunks shortly after its reply,
        and the next engine must not start before (best effort: a request that could
        not store, e.g. with its server down, just runs out the time). The key is the
        connector's (its salt with the request's LoRA adapter and the last reset's
        tag)."""
        import time as _time
        from types import SimpleNamespace

        reg = getattr(self.workers[0].worker, "reg", None) if self.workers else None
        chunk = getattr(reg, "chunk_size", None)
        if reg is None or not chunk:
            return
        from lmcache_mp.errors import RequestTimeout  # an engine of ours: it is there
        sched = self.scheduler.connector.scheduler
        limit = _time.monotonic() + timeout_s
        for r in requests:
            want = len(r["prompt"]) // chunk * chunk
            lora = None
            if r.get("lora"):
                from vllm.lora.request import LoRARequest

                lora = LoRARequest(r["lora"]["name"], r["lora"]["id"], r["lora"]["path"])
            salt = sched.wire_salt(SimpleNamespace(cache_salt=r.get("salt"),
                                                   lora_request=lora))
            if not want or "@" in salt:
                continue
            while _time.monotonic() < limit:
                lookup = reg.request(r["prompt"], cache_salt=salt)
                try:
                    found = lookup.lookup(timeout=1.0)
                except RequestTimeout:  # a loaded machine: ask again, within timeout_s
                    found = 0
                except Exception:  # noqa: BLE001 - best effort (server down, ...)
                    return
                finally:
                    try:  # its read locks and session, within a second too
                        lookup.close(timeout=1.0)
                    except Exception:  # noqa: BLE001
                        pass
                if found >= want:
                    break
                _time.sleep(0.02)

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        conn = getattr(self.scheduler, "connector", None)
        if conn is not None:
            conn.shutdown()


def extensible_chunks(caches: dict[str, torch.Tensor], names: list[str]) -> list[int]:
    import extensible

    return extensible.chunks_per_layer({n: caches[n] for n in names})


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def main(spec_path: str) -> None:
    """Run one scripted engine from a JSON spec and print its result as one JSON line.

    Spec: ``connector`` ("ours" | "lmcache"), ``extra`` (kv_connector_extra_config),
    ``tp``, ``mla`` (the tiny DeepSeek-V2 engine), ``backend`` (CPU_ATTN | FLASH_ATTN),
    ``layout`` (a KVCacheLayout name for ``VLLM_KV_CACHE_LAYOUT``), ``num_blocks`` (96),
    ``prefix_caching`` (true), ``extensible`` (vLLM 0.34's extensible cache: null, as
    vLLM decides; or true / false), ``phases``: a list of ``{"requests": [{"id",
    "prompt", "salt"?, "max_tokens"?, "prompt_logprobs"?, "lora"?: {"name", "id",
    "path"}}], "on_step": {"N": [argv...]}, "on_retrieve": [argv...], "sleep_wake": bool,
    "abort_when_loading": [id...]}`` run
    one after the other on the same
    engine (``on_step`` runs a command after step N of the phase, ``on_retrieve`` when a
    step first orders a RETRIEVE, before the workers run: e.g. to stop the server
    between lookup and load; ``on_retrieve_of``: ``{id: [argv...]}`` commands run when a
    step first orders that request's RETRIEVE, with ``then_wait`` until the workers see
    the server gone (``unhealthy``) or back (``usable``); ``later``: ``{"N":
    [request...]}`` added after step N; ``sleep_wake``:
    ``Engine.sleep(reset_connector)`` (``reset_connector``, true by default as in vLLM)
    then ``Engine.wake`` after the phase). More engine keys:
    ``kv_heads``, ``head_dim``, ``warmup_blocks`` (the extensible cache's warm-up
    commit), ``failure_policy`` (vLLM's ``kv_load_failure_policy``), ``observe`` (KV
    events, stats and async load admission on, recorded: ``Engine.observed``),
    ``refuse_registration`` (every REGISTER refused: ``_refuse_registrations``).

    The result: per request its :class:`RequestResult`; with our connector the
    workers' summed stats, LOOKUPs sent per request (``lookups``), every
    registration's instance id per rank (``instances``), the preemptions, and the
    KV views each rank registered (``views``: storage bytes, data pointers, the block
    count and bytes of a block of one layer, the layout, whether extensible, the cache
    type and mode registered, the VMM chunks under each layer), the model name the
    connector keys under (``model``), and with ``observe`` what vLLM asked.
    """
    import subprocess
    import time

    with open(spec_path) as f:
        spec = json.load(f)
    which = LMCACHE if spec["connector"] == "lmcache" else OURS
    if spec.get("refuse_registration"):
        _refuse_registrations()
    if spec.get("layout"):
        os.environ["VLLM_KV_CACHE_LAYOUT"] = spec["layout"]
    eng = Engine(which, spec["extra"], tp=spec.get("tp", 1), mla=spec.get("mla", False),
                 backend=spec.get("backend", "CPU_ATTN"),
                 num_blocks=spec.get("num_blocks", 96),
                 prefix_caching=spec.get("prefix_caching", True),
                 extensible=spec.get("extensible"),
                 kv_heads=spec.get("kv_heads", KV_HEADS), head_dim=spec.get("head_dim", HEAD_DIM),
                 warmup_blocks=spec.get("warmup_blocks", WARMUP_BLOCKS),
                 failure_policy=spec.get("failure_policy", "recompute"),
                 observe=spec.get("observe", False))
    out: dict[str, Any] = {"requests": {}, "phase_seconds": [], "vllm": vllm_release()}
    lookups: dict[str, int] = {}
    instances: list[list[int]] = [[] for _ in eng.workers]
    if which is OURS:
        _watch(eng, lookups, instances)
        out["views"] = eng.views()
        out["model"] = eng.scheduler.connector.model_name
    try:
        for phase in spec["phases"]:
            t0 = time.monotonic()
            for r in phase["requests"]:
                eng.add(r["id"], r["prompt"], cache_salt=r.get("salt"),
                        max_tokens=r.get("max_tokens", 3),
                        prompt_logprobs=r.get("prompt_logprobs"), lora=r.get("lora"))
            hooks = {int(k): v for k, v in phase.get("on_step", {}).items()}
            later = {int(k): v for k, v in phase.get("later", {}).items()}
            if "on_retrieve" in phase:
                argv = phase["on_retrieve"]
                eng.on_retrieve = lambda argv=argv: subprocess.run(argv, check=True)
            for rid, argvs in phase.get("on_retrieve_of", {}).items():
                eng.on_retrieve_of[rid] = functools.partial(
                    _run_then_wait, eng, rid, argvs, phase.get("then_wait", ""))

            def on_step(n: int, hooks: dict[int, list[str]] = hooks,
                        later: dict[int, list[dict[str, Any]]] = later) -> None:
                if n in hooks:
                    subprocess.run(hooks[n], check=True)
                for r in later.get(n, ()):
                    eng.add(r["id"], r["prompt"], cache_salt=r.get("salt"),
                            max_tokens=r.get("max_tokens", 3))

            eng.run(on_step=on_step, abort=phase.get("abort_when_loading", ()))
            eng.drain()
            if which is OURS:
                eng.wait_visible(phase["requests"])
            out["phase_seconds"].append(round(time.monotonic() - t0, 3))
            if phase.get("sleep_wake"):
                eng.sleep(reset_connector=phase.get("reset_connector", True))
                eng.wake()
            if "sleep_after" in phase:
                time.sleep(phase["sleep_after"])
        for req in eng.finished_requests:
            res = eng.results[req.request_id]
            res.status, res.output_tokens = req.status.name, len(req.output_token_ids)
        out["requests"] = {rid: vars(r) for rid, r in eng.results.items()}
        out["preemptions"] = sum(getattr(r, "num_preemptions", 0)
                                 for r in eng.finished_requests)
        if eng.observe or eng.observed.get("running_at_hook"):
            out["observed"] = eng.observed
        if which is OURS:
            stats: dict[str, int] = {}
            for w in eng.workers:
                for k, v in w.worker.stats.items():
                    stats[k] = stats.get(k, 0) + v
            out["stats"] = stats
            out["lookups"] = lookups
            out["instances"] = [list(i) for i in instances]
    finally:
        eng.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


def _refuse_registrations() -> None:
    """Every REGISTER_KV_CACHE of this engine's workers is refused, as by a server that
    answers everything else (probes, lookups: another engine stored the prefixes):
    an error the worker retries in the background, meanwhile its loads fail at once.
    The one stand-in of the harness for a server's behaviour."""
    from lmcache_mp.client import Client
    from lmcache_mp.errors import LMCacheMPError

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise LMCacheMPError("REGISTER_KV_CACHE refused (the harness's refusing server)")

    Client.register = refused  # type: ignore[method-assign]


def _run_then_wait(eng: Engine, rid: str, argvs: list[list[str]], wait: str) -> None:
    """When ``rid``'s RETRIEVE is ordered: the commands ``argvs`` (e.g. stopping the
    server, or restarting it empty), then until every worker's client sees the server
    gone (``wait="unhealthy"``: a RETRIEVE ordered now fails at once instead of at its
    deadline) or usable again, to the workers and to the scheduler side's health
    probes, which order no STORE while a server looks down (``"usable"``), at most
    30 s. The requests running then are recorded (``running_at_hook``)."""
    import subprocess
    import time

    eng.observed.setdefault("running_at_hook", {})[rid] = sorted(
        r.request_id for r in eng.scheduler.running)
    for argv in argvs:
        subprocess.run(argv, check=True)
    limit = time.monotonic() + 30
    sched = eng.scheduler.connector.scheduler  # its health probes decide on stores
    while wait and time.monotonic() < limit and not (
            all(w.worker.client.healthy for w in eng.workers) and all(sched.healthy.values())
            if wait == "usable" else not any(w.worker.client.healthy for w in eng.workers)):
        time.sleep(0.05)


def vllm_release() -> str:
    import vllm

    return str(vllm.__version__)


def _watch(eng: Engine, lookups: dict[str, int], instances: list[list[int]]) -> None:
    """Count the LOOKUPs our scheduler side sends per vLLM request id, and record the
    instance id of every registration each worker makes (wrapping their clients)."""
    sched = eng.scheduler.connector.scheduler
    for client in sched.clients.values():
        submit = client.submit_lookup_async

        def counted(key: Any, *args: Any, submit: Any = submit, **kw: Any) -> Any:
            rid = key.request_id.rpartition("~")[0]
            lookups[rid] = lookups.get(rid, 0) + 1
            return submit(key, *args, **kw)

        client.submit_lookup_async = counted
    for rank, w in enumerate(eng.workers):
        side = w.worker
        if side.reg is not None:
            instances[rank].append(side.reg.instance_id)
        register = side.client.register

        def recorded(*args: Any, register: Any = register, rank: int = rank,
                     **kw: Any) -> Any:
            reg = register(*args, **kw)
            instances[rank].append(reg.instance_id)
            return reg

        side.client.register = recorded


def sleep_mode_check() -> dict[str, Any]:
    """Print whether vLLM refuses ``enable_sleep_mode`` with our connector (vLLM 0.33+
    asks the connector's ``supports_sleep_mode`` in ``VllmConfig``), as one JSON line."""
    import vllm
    from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.platforms import current_platform

    # Sleep mode is a GPU feature: stand in for a platform that has it, so the config
    # gets as far as asking the connector (which is what is tested).
    current_platform.is_sleep_mode_available = lambda: True  # type: ignore[method-assign]
    out: dict[str, Any] = {"vllm": vllm.__version__}
    try:
        VllmConfig(model_config=ModelConfig(model=model_dir(), skip_tokenizer_init=True,
                                            dtype="float16", enable_sleep_mode=True),
                   device_config=DeviceConfig("cpu"),
                   kv_transfer_config=KVTransferConfig(
                       kv_connector=OURS[0], kv_connector_module_path=OURS[1],
                       kv_role="kv_both"))
        out["refused"] = False
    except Exception as exc:  # noqa: BLE001 - reported
        out["refused"], out["error"] = True, f"{type(exc).__name__}: {exc}"
    return out


def kv_cache_access_check() -> dict[str, Any]:
    """Per ``lmcache.mp.mp_transfer_mode``: the ``KVCacheAccess`` vLLM 0.34 reads from
    our connector (its own ``KVTransferConfig.kv_cache_access``, through its factory)
    and whether vLLM then allocates its extensible cache on a GPU (its own
    resolution, :func:`extensible_by_vllm`); and what a wrong mode makes vLLM's config
    raise. One JSON line."""
    from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    def transfer_config(mode: str | None) -> Any:
        extra = {} if mode is None else {"lmcache.mp.mp_transfer_mode": mode}
        return KVTransferConfig(kv_connector=OURS[0], kv_connector_module_path=OURS[1],
                                kv_role="kv_both", kv_connector_extra_config=extra)

    out: dict[str, Any] = {}
    for mode in (None, "auto", "engine_driven", "lmcache_driven"):
        ktc = transfer_config(mode)
        config = VllmConfig(model_config=ModelConfig(model=model_dir(), skip_tokenizer_init=True,
                                                     dtype="float16"),
                            device_config=DeviceConfig("cpu"), kv_transfer_config=ktc)
        out[mode or "default"] = {"access": ktc.kv_cache_access().name,
                                  "extensible": extensible_by_vllm(config)}
    try:
        transfer_config("gpu_driven").kv_cache_access()
        out["wrong"] = None
    except Exception as exc:  # noqa: BLE001 - reported
        out["wrong"] = f"{type(exc).__name__}: {exc}"
    return out


def token_buffer_check() -> dict[str, Any]:
    """vLLM 0.34's own ``Request``: its ``all_token_ids`` (a ``ConstantList`` of a
    ``TokenBuffer``) packed by the connector with the buffer's per-token reads made to
    fail, the key's bytes compared with a list's, and the buffer still growable after
    (no export of it left behind). One JSON line."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from lmcache_mp.integrations.vllm.compat import token_ids
    from lmcache_mp.keys import CacheKey

    ids = prompt(7, 5000)
    req = Request(request_id="t", prompt_token_ids=list(ids), pooling_params=None,
                  sampling_params=SamplingParams(max_tokens=2))
    buffer_type = type(req.all_token_ids._x)

    def per_token(*args: Any) -> Any:
        raise AssertionError("the TokenBuffer was read token by token")

    saved = {name: buffer_type.__dict__.get(name) for name in ("__iter__", "__getitem__")}
    buffer_type.__iter__ = per_token  # type: ignore[method-assign]
    buffer_type.__getitem__ = per_token  # type: ignore[method-assign]
    try:
        packed = token_ids(req.all_token_ids)
    finally:
        for name, fn in saved.items():
            if fn is None:
                delattr(buffer_type, name)
            else:
                setattr(buffer_type, name, fn)

    def key(tokens: Any) -> CacheKey:
        return CacheKey(model_name="m", world_size=1, worker_id=None, token_ids=tokens,
                        start=0, end=len(ids), request_id="t")

    req.append_output_token_ids(11)  # vLLM grows the buffer as it decodes
    return {"buffer": f"{buffer_type.__module__}.{buffer_type.__name__}",
            "bases": [b.__name__ for b in buffer_type.__mro__],
            "packed_as": type(packed).__name__,
            "same_bytes": key(packed).token_bytes == key(list(ids)).token_bytes,
            "grew_to": len(req.all_token_ids)}


def connector_config_check() -> dict[str, Any]:
    """What our connector makes of vLLM configs it must refuse or key apart, created as
    vLLM creates it (``KVConnectorFactory.create_connector``, scheduler role): the
    model name it keys objects under without speculative decoding, with a draft model
    (a drafter with KV layers of its own) and with n-gram speculation (none); the
    refusal of prefill-context parallelism. One JSON line."""
    from vllm.config import (
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float16")

    def config(**spec: Any) -> Any:
        speculative = (SpeculativeConfig(**spec, target_model_config=model,
                                         target_parallel_config=ParallelConfig())
                       if spec else None)
        return VllmConfig(model_config=model, device_config=DeviceConfig("cpu"),
                          speculative_config=speculative,
                          kv_transfer_config=KVTransferConfig(
                              kv_connector=OURS[0], kv_connector_module_path=OURS[1],
                              kv_role="kv_both",
                              kv_connector_extra_config={"lmcache.mp.health_interval": 60}))

    def model_name(cfg: Any) -> str:
        connector = KVConnectorFactory.create_connector(
            config=cfg, role=KVConnectorRole.SCHEDULER, kv_cache_config=None)
        try:
            return str(connector.model_name)
        finally:
            connector.shutdown()

    out = {"model": model_dir(), "plain": model_name(config()),
           "draft_model": model_name(config(method="draft_model", model=model_dir(),
                                            num_speculative_tokens=2)),
           "ngram": model_name(config(method="ngram", num_speculative_tokens=2,
                                      prompt_lookup_max=3))}
    pcp = config()
    pcp.parallel_config.prefill_context_parallel_size = 2
    try:
        model_name(pcp)
        out["pcp"] = "accepted"
    except Exception as exc:  # noqa: BLE001 - reported
        out["pcp"] = f"{type(exc).__name__}: {exc}"
    return out


def handshake_check() -> dict[str, Any]:
    """Which handshake metadata our worker-role connector hands vLLM (issue 37: its
    protocol family, for the scheduler), made as vLLM makes it, by where vLLM's worker
    holds it: itself (its families), inside a MultiConnector (vLLM's own, built from
    its config: none, since only the first sub-connector's metadata that is not None
    travels, and NIXL's scheduler refuses any other), no group (none). One JSON line."""
    from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float16")
    url = "tcp://127.0.0.1:9"  # never connected: the family is named
    ours = {"kv_connector": OURS[0], "kv_connector_module_path": OURS[1], "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.server_urls": [url],
                                          "lmcache.mp.protocol": "0.5.7"}}

    def vllm_config(ktc: Any) -> Any:
        return VllmConfig(model_config=model, device_config=DeviceConfig("cpu"),
                          kv_transfer_config=ktc)

    def families(meta: Any) -> Any:
        return None if meta is None else getattr(meta, "families", type(meta).__name__)

    out: dict[str, Any] = {}
    alone = KVConnectorFactory.create_connector(
        config=vllm_config(KVTransferConfig(**ours)), role=KVConnectorRole.WORKER,
        kv_cache_config=None)
    multi_cfg = vllm_config(KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both",
        kv_connector_extra_config={"connectors": [ours]}))
    multi = MultiConnector(vllm_config=multi_cfg, role=KVConnectorRole.WORKER,
                           kv_cache_config=None)
    saved = kv_transfer_state._KV_CONNECTOR_AGENT
    try:
        out["no_group"] = families(alone.get_handshake_metadata())
        kv_transfer_state._KV_CONNECTOR_AGENT = alone
        out["alone"] = families(alone.get_handshake_metadata())
        kv_transfer_state._KV_CONNECTOR_AGENT = multi
        out["in_multi"] = families(multi.get_handshake_metadata())
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved
        alone.shutdown()
        multi.shutdown()
    return out


def data_parallel_check() -> dict[str, Any]:
    """Whether a step that schedules no tokens lets our workers wait for their loads
    (``StepOps.idle``), under vLLM configs of one and of two data-parallel ranks: our
    connector as vLLM's factory creates it (scheduler role) builds the metadata of
    vLLM's own empty ``SchedulerOutput``. Under DP an idle rank runs a dummy batch
    right after such a step, and every other rank's collectives wait for it. One JSON
    line."""
    from vllm.config import (
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput

    model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float16")
    out: dict[str, Any] = {}
    for dp in (1, 2):
        config = VllmConfig(
            model_config=model, device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(data_parallel_size=dp),
            kv_transfer_config=KVTransferConfig(
                kv_connector=OURS[0], kv_connector_module_path=OURS[1], kv_role="kv_both",
                kv_connector_extra_config={"lmcache.mp.server_urls": ["tcp://127.0.0.1:9"],
                                           "lmcache.mp.protocol": "0.5.7",
                                           "lmcache.mp.health_interval": 60}))
        connector = KVConnectorFactory.create_connector(
            config=config, role=KVConnectorRole.SCHEDULER, kv_cache_config=None)
        try:
            empty = SchedulerOutput.make_empty()
            assert empty.total_num_scheduled_tokens == 0
            out[f"dp{dp}"] = {"data_parallel_size": config.parallel_config.data_parallel_size,
                              "idle": connector.build_connector_meta(empty).step.idle}
        finally:
            connector.shutdown()
    return out


#: ``python harness.py --CHECK [--CHECK ...]``: one RESULT line, ``{CHECK: its result}``
#: (one vLLM import for them all).
CHECKS = {"--sleep-mode": sleep_mode_check, "--kv-cache-access": kv_cache_access_check,
          "--token-buffer": token_buffer_check, "--connector-config": connector_config_check,
          "--handshake": handshake_check, "--data-parallel": data_parallel_check}

if __name__ == "__main__":
    if sys.argv[1] in CHECKS:
        print("RESULT " + json.dumps({c: CHECKS[c]() for c in sys.argv[1:]}), flush=True)
    else:
        main(sys.argv[1])
