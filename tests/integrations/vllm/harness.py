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

Runs under any Python with vLLM importable: ``.venv-vllm`` (our connector), or an
oracle venv with vLLM's tree on the path (LMCache's own connector), see ``cross.py``.
Also a script: ``python harness.py SPEC.json`` prints a JSON result.
"""

from __future__ import annotations

import copy
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
            mla: bool = False, heads: int = KV_HEADS) -> torch.Tensor:
    """KV values for tokens at positions: [2, n, heads, HEAD_DIM] float16, exact
    small multiples of 1/8 (no rounding), different per rank, layer, plane, head, dim.
    ``mla``: [n, MLA_HEAD], the same on every rank (replicated over TP)."""
    if mla:
        d = torch.arange(MLA_HEAD).view(1, MLA_HEAD)
        t, p = tokens.view(-1, 1), positions.view(-1, 1)
        v = (t * 31 + p * 7 + layer * 13 + d * 5) % 997
        return (v.to(torch.float32) / 8).to(torch.float16)
    kv = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(heads).view(1, 1, heads, 1)
    d = torch.arange(HEAD_DIM).view(1, 1, 1, HEAD_DIM)
    t = tokens.view(1, -1, 1, 1)
    p = positions.view(1, -1, 1, 1)
    v = (t * 31 + p * 7 + layer * 13 + rank * 101 + kv * 3 + h * 11 + d * 5) % 997
    return (v.to(torch.float32) / 8).to(torch.float16)


@dataclass
class RequestResult:
    prompt_len: int
    first_computed: int = -1      # tokens already computed when first scheduled
    verified: bool = True


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
                 backend: str = "CPU_ATTN") -> None:
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
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.block_size, self.tp = block_size, tp
        self.mla, self.backend = mla, backend
        model_cfg = ModelConfig(model=model or (mla_model_dir() if mla else model_dir()),
                                skip_tokenizer_init=True, dtype="float16", max_model_len=1024)
        assert model_cfg.use_mla == mla, f"vLLM's use_mla is {model_cfg.use_mla}"
        kv_cfg = KVTransferConfig(kv_connector=connector[0],
                                  kv_connector_module_path=connector[1], kv_role="kv_both",
                                  kv_connector_extra_config=extra,
                                  kv_load_failure_policy="recompute")
        self.config = VllmConfig(
            model_config=model_cfg,
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching,
                                     num_gpu_blocks_override=num_blocks),
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                             max_model_len=1024, is_encoder_decoder=False),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=kv_cfg,
        )
        layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
        # A rank holds its share of the KV heads (MLA's one latent head is replicated).
        self.heads = 1 if mla else KV_HEADS // tp
        spec = (MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=MLA_HEAD,
                                 dtype=torch.float16) if mla else
                FullAttentionSpec(block_size=block_size, num_kv_heads=self.heads,
                                  head_size=HEAD_DIM, dtype=torch.float16))
        specs = {n: spec for n in layer_names}
        backend_cls = _backend_class(backend)
        declared = backend_cls.supported_kv_cache_layouts()
        with set_current_vllm_config(self.config):
            # What the engine core does before profiling: resolve one layout from what
            # the workers' backends declare, then size the cache for every worker.
            layout = resolve_kv_cache_layout(
                self.config, [[x.name for x in declared]] if declared else
                [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]], list(specs.values()))
            configs = kv_cache_configs(self.config, [specs] * tp,
                                       [spec.page_size_bytes * num_blocks * NUM_LAYERS] * tp)
        self.layout = layout.name
        for c in configs:
            c.kv_cache_layout = self.layout
        self.kv_cache_config = configs[0]
        self.num_blocks = self.kv_cache_config.num_blocks
        self.config.cache_config.num_gpu_blocks = self.num_blocks
        init_none_hash(sha256)
        self.hasher_fn = sha256
        with set_current_vllm_config(self.config):
            self.scheduler = Scheduler(
                vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=block_size, log_stats=False)
            self.workers: list[Any] = []
            self.kv: list[dict[str, torch.Tensor]] = []
            self.planes: list[dict[str, list[torch.Tensor]]] = []
            for rank in range(tp):
                cfg = copy.deepcopy(self.config)
                cfg.parallel_config.rank = rank
                with set_current_vllm_config(cfg):
                    w = KVConnectorFactory.create_connector(
                        config=cfg, role=KVConnectorRole.WORKER,
                        kv_cache_config=configs[rank])
                caches = allocate_kv_cache(configs[rank], torch.device("cpu"), layout)
                with set_current_vllm_config(cfg):
                    w.register_kv_caches(caches)
                self.workers.append(w)
                self.kv.append(caches)
                self.planes.append({n: backend_planes(backend, t, mla)
                                    for n, t in caches.items()})
        self.layer_names = layer_names
        self.results: dict[str, RequestResult] = {}
        self.tokens: dict[str, list[int]] = {}
        self._aggregator: Any = None
        #: Called once, when a step first carries a RETRIEVE, before the workers run.
        self.on_retrieve: Any = None

    # ------------------------------------------------------------------ requests
    def add(self, rid: str, prompt: list[int], *, max_tokens: int = 3,
            cache_salt: str | None = None) -> None:
        from vllm import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        req = Request(request_id=rid, prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                      pooling_params=None, cache_salt=cache_salt,
                      block_hasher=get_request_block_hasher(self.block_size, self.hasher_fn))
        self.scheduler.add_request(req)
        self.results[rid] = RequestResult(len(prompt))
        self.tokens[rid] = list(prompt)

    def run(self, deadline_s: float = 120.0, on_step: Any = None) -> dict[str, RequestResult]:
        """Step until every request finished (a wall-clock limit: in-flight transfers
        have their own deadlines, and an engine that never finishes is the failure)."""
        import time as _time

        limit = _time.monotonic() + deadline_s
        steps = 0
        while self.scheduler.has_requests():
            if _time.monotonic() > limit:
                raise RuntimeError(f"requests still unfinished after {deadline_s} s: "
                                   f"{self._states()}")
            self.step()
            steps += 1
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
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin,
        )

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        if self.on_retrieve and getattr(getattr(meta, "step", None), "retrieves", list)():
            # Between the scheduler's lookup and the workers' RETRIEVE (our connector).
            hook, self.on_retrieve = self.on_retrieve, None
            hook()
        wire = pickle.dumps(out)
        outputs = []
        for rank, worker in enumerate(self.workers):
            sout = pickle.loads(wire)
            kv_transfer_state._KV_CONNECTOR_AGENT = worker
            with set_forward_context(None, self.config), \
                    KVConnectorModelRunnerMixin._get_kv_connector_output(sout) as kvo:
                self._forward(rank, sout)
            outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                             kv_connector_output=kvo))
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        if self._aggregator is None:  # one for the engine's life: it counts across steps
            self._aggregator = KVOutputAggregator.from_connector(self.workers[0],
                                                                 len(self.workers))
        kvo = self._aggregator.aggregate(outputs).kv_connector_output
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid]
            sampled.append([7 + len(req.output_token_ids)] if done >= req.num_tokens else [])
        mro = ModelRunnerOutput(req_ids=req_ids,
                                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=kvo)
        self.scheduler.update_from_output(out, mro)
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
        for rid, computed in sched:
            n = sout.num_scheduled_tokens[rid]
            blocks = self._blocks(rid, sout)
            req = self.scheduler.requests[rid]
            tokens = list(req.all_token_ids)
            res = self.results[rid]
            if res.first_computed < 0 and rank == 0:
                res.first_computed = computed
            if computed and res.first_computed == computed:
                res.verified &= self._check(rank, blocks, tokens, computed)
            pos = torch.arange(computed, computed + n)
            tok = torch.tensor(tokens[computed:computed + n])
            for li, name in enumerate(self.layer_names):
                values = pattern(rank, li, tok, pos, mla=self.mla, heads=self.heads)
                at = self._slots(blocks, pos)
                for plane, v in zip(self.planes[rank][name], [values] if self.mla else values,
                                    strict=True):
                    plane[at] = v

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
            want = pattern(rank, li, tok, pos, mla=self.mla, heads=self.heads)
            at = self._slots(blocks, pos)
            for plane, w in zip(self.planes[rank][name], [want] if self.mla else want,
                                strict=True):
                if not torch.equal(plane[at], w):
                    return False
        return True

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
        not store, e.g. with its server down, just runs out the time)."""
        import time as _time

        reg = getattr(self.workers[0].worker, "reg", None) if self.workers else None
        chunk = getattr(reg, "chunk_size", None)
        if reg is None or not chunk:
            return
        from lmcache_mp.errors import RequestTimeout  # an engine of ours: it is there
        limit = _time.monotonic() + timeout_s
        for r in requests:
            want = len(r["prompt"]) // chunk * chunk
            salt = r.get("salt") or ""
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


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def main(spec_path: str) -> None:
    """Run one scripted engine from a JSON spec and print its result as one JSON line.

    Spec: ``connector`` ("ours" | "lmcache"), ``extra`` (kv_connector_extra_config),
    ``tp``, ``mla`` (the tiny DeepSeek-V2 engine), ``backend`` (CPU_ATTN | FLASH_ATTN),
    ``layout`` (a KVCacheLayout name for ``VLLM_KV_CACHE_LAYOUT``), ``phases``: a list of ``{"requests":
    [{"id", "prompt", "salt"?}], "on_step": {"N": [argv...]}, "on_retrieve": [argv...]}``
    run one after the other on the same engine (``on_step`` runs a command after step N
    of the phase, ``on_retrieve`` when a step first orders a RETRIEVE, before the
    workers run: e.g. to stop the server between lookup and load).
    """
    import subprocess
    import time

    with open(spec_path) as f:
        spec = json.load(f)
    which = LMCACHE if spec["connector"] == "lmcache" else OURS
    if spec.get("layout"):
        os.environ["VLLM_KV_CACHE_LAYOUT"] = spec["layout"]
    eng = Engine(which, spec["extra"], tp=spec.get("tp", 1), mla=spec.get("mla", False),
                 backend=spec.get("backend", "CPU_ATTN"))
    out: dict[str, Any] = {"requests": {}, "phase_seconds": []}
    try:
        for phase in spec["phases"]:
            t0 = time.monotonic()
            for r in phase["requests"]:
                eng.add(r["id"], r["prompt"], cache_salt=r.get("salt"))
            hooks = {int(k): v for k, v in phase.get("on_step", {}).items()}
            if "on_retrieve" in phase:
                argv = phase["on_retrieve"]
                eng.on_retrieve = lambda argv=argv: subprocess.run(argv, check=True)

            def on_step(n: int, hooks: dict[int, list[str]] = hooks) -> None:
                if n in hooks:
                    subprocess.run(hooks[n], check=True)

            eng.run(on_step=on_step)
            eng.drain()
            if which is OURS:
                eng.wait_visible(phase["requests"])
            out["phase_seconds"].append(round(time.monotonic() - t0, 3))
            if "sleep_after" in phase:
                time.sleep(phase["sleep_after"])
        out["requests"] = {rid: vars(r) for rid, r in eng.results.items()}
        if which is OURS:
            stats: dict[str, int] = {}
            for w in eng.workers:
                for k, v in w.worker.stats.items():
                    stats[k] = stats.get(k, 0) + v
            out["stats"] = stats
    finally:
        eng.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


def sleep_mode_check() -> None:
    """Print whether vLLM refuses ``enable_sleep_mode`` with our connector (vLLM 0.33
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
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--sleep-mode":
        sleep_mode_check()
    else:
        main(sys.argv[1])
