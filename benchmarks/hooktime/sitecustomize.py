"""Per-hook cost of a vLLM KV connector, measured at vLLM's boundary, in every process
of an engine (the scheduler's and each worker's), and a timeline of where one
request's time goes.

Loaded by Python at start-up as ``sitecustomize`` when this folder is on PYTHONPATH
(benchmarks/vllm_e2e.py puts it there for its engines; a spawned engine core inherits
it). Does nothing unless ``LMCACHE_MP_HOOK_TIMES`` names a folder. Then, once vLLM's
connector factory is imported, every connector it creates (ours or LMCache's: the same
wrapping) has its hooks wrapped: calls, thread CPU time and wall time per hook, and the
pickled size of each step's connector metadata (what vLLM sends the workers); and the
CPU time of the connectors' own background threads (names starting with one of
``_BACKGROUND``: ours ``lmcache-mp-*``, LMCache's client loop ``mq-client-*`` and its
``lmcache*`` threads), read from each thread's CPU-time clock (``/proc``'s 10 ms ticks
where there is none), since work moved off the hooks' threads still costs the engine's
CPU. Each process writes ``hooks-<pid>.json`` there
(at most every half second, and at exit): cumulative totals, so the last write is the
answer.

With ``LMCACHE_MP_HOOK_TRACE=1`` (or ``LMCACHE_MP_HOOK_PHASES=1``) each process also
appends a timeline to ``trace-<pid>.jsonl`` (only what is new at each write): one
``[monotonic start, wall us, name, brief result, request id, data]`` per call of every
connector hook and of a few vLLM and client methods, wrapped from here, not in the
connectors (benchmarks/ttft_phases.py reads it into a per-request breakdown):

* vLLM's front end: ``LLMEngine.add_request`` (the request's arrival; its id as the
  engine core sees it), ``OutputProcessor.process_outputs`` (the requests with new
  tokens: the first is the first token vLLM's TTFT counts);
* its engine core: ``Scheduler.add_request``, ``Scheduler.schedule`` (tokens
  scheduled per request), ``Scheduler.update_from_output`` (finished loads reported
  by the workers, requests that got tokens), the model runner's ``execute_model`` /
  ``sample_tokens`` (the forward pass, or the empty step of a batch with no tokens);
* ours (lmcache_mp): the lookup sent (``submit_lookup_async``), the RETRIEVE
  (``Registration.retrieve_async``: PREPARE_RETRIEVE, the copy, COMMIT sent; the copy
  alone: ``copy_from_slots``);
* LMCache's: the lookup sent (``maybe_submit_lookup_request``), the RETRIEVE
  (``batched_submit_retrieve_requests``).

All times are ``time.monotonic`` / ``perf_counter`` (one clock for every process on
Linux), so the processes' timelines merge.
"""

import os

_DIR = os.environ.get("LMCACHE_MP_HOOK_TIMES")

if _DIR:
    import atexit
    import importlib.abc
    import importlib.util
    import json
    import pickle
    import sys
    import threading
    import time

    _HOOKS = (
        # scheduler side
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
        "update_connector_output", "request_finished", "get_kv_connector_stats",
        "on_new_request",
        # worker side
        "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
        "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    )
    #: Hooks whose first argument is vLLM's Request: traced with its id.
    _REQUEST_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                      "request_finished", "on_new_request")
    _lock = threading.Lock()
    #: "role.hook" -> [calls, thread CPU ns, wall ns]
    _stats: dict = {}
    _meta = {"steps": 0, "bytes": 0}
    _last_dump = [0.0]
    _TRACE = (os.environ.get("LMCACHE_MP_HOOK_TRACE") == "1"
              or os.environ.get("LMCACHE_MP_HOOK_PHASES") == "1")
    #: Timeline entries not yet written (appended to trace-<pid>.jsonl at each dump).
    _trace: list = []
    _BACKGROUND = ("lmcache", "mq-client", "zmq-event")
    #: native thread id -> (name, CPU seconds last read): ended threads keep theirs.
    _threads: dict = {}
    _TICK = os.sysconf("SC_CLK_TCK")

    def _thread_cpu(t: threading.Thread) -> float | None:
        """``t``'s CPU seconds: its POSIX CPU-time clock (nanoseconds), else /proc's
        utime + stime (10 ms ticks: a short run's few ticks per thread were most of
        the background figure's noise, issue 38)."""
        try:
            return time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident)) / 1e9
        except (AttributeError, OSError, TypeError):
            pass
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / _TICK

    def _read_threads() -> None:
        for t in threading.enumerate():
            if t.native_id is None or not t.name.startswith(_BACKGROUND):
                continue
            cpu = _thread_cpu(t)
            if cpu is not None:  # None: it ended just now (it keeps its last reading)
                _threads[t.native_id] = (t.name, cpu)

    _dump_lock = threading.Lock()

    def _dump(force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - _last_dump[0] < 0.5:
            return
        with _dump_lock:  # the hooks' threads and the flusher write the same files
            _last_dump[0] = now
            _write()

    def _write() -> None:
        _read_threads()
        with _lock:
            data = {"pid": os.getpid(), "argv0": sys.argv[0] if sys.argv else "",
                    "cpus": len(os.sched_getaffinity(0)),  # vLLM binds its CPU workers
                    "stats": {k: list(v) for k, v in _stats.items()}, "meta": dict(_meta),
                    "threads": {str(k): list(v) for k, v in _threads.items()}}
            new = _trace[:]
            del _trace[:]
        if new:
            with open(os.path.join(_DIR, f"trace-{os.getpid()}.jsonl"), "a") as f:
                f.writelines(json.dumps(e) + "\n" for e in new)
        tmp = os.path.join(_DIR, f".hooks-{os.getpid()}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, os.path.join(_DIR, f"hooks-{os.getpid()}.json"))

    _flusher: list = []

    def _flush_loop() -> None:
        while True:
            time.sleep(0.25)
            if _trace:
                _dump(True)

    def _record(name: str, w0: int, wall: int, result, rid=None, data=None) -> None:
        """A timeline entry (under ``_lock``). A process may end without running its
        atexit hooks (vLLM kills its engine core and workers): a thread writes what
        is new every quarter second."""
        _trace.append((w0 / 1e9, wall // 1000, name, _brief(result), rid, data))
        if not _flusher:
            _flusher.append(threading.Thread(target=_flush_loop, daemon=True,
                                             name="hooktime-flush"))
            _flusher[0].start()

    def _wrap(role: str, name: str, fn):
        rec = _stats.setdefault(f"{role}.{name}", [0, 0, 0])
        measure_meta = name == "build_connector_meta"
        with_request = name in _REQUEST_HOOKS
        with_sets = name == "get_finished"

        def timed(*args, **kwargs):
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            result = "raised"
            try:
                result = fn(*args, **kwargs)
            finally:
                cpu, wall = time.thread_time_ns() - c0, time.perf_counter_ns() - w0
                with _lock:
                    rec[0] += 1
                    rec[1] += cpu
                    rec[2] += wall
                    if _TRACE:
                        rid = getattr(args[0], "request_id", None) if (
                            with_request and args) else None
                        data = _finished_sets(result) if with_sets else None
                        _record(f"{role}.{name}", w0, wall, result, rid, data)
            if measure_meta:
                size = len(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
                with _lock:
                    _meta["steps"] += 1
                    _meta["bytes"] += size
            _dump()
            return result

        return timed

    def _finished_sets(result):
        """get_finished's (sending, receiving) request ids, when there are any."""
        if not isinstance(result, tuple) or not any(result[:2]):
            return None
        return [sorted(map(str, s or ())) for s in result[:2]]

    def _brief(result) -> str:
        if result is None or isinstance(result, (bool, int, float)):
            return repr(result)
        if isinstance(result, tuple):
            return repr(tuple(_brief(r) for r in result))
        if isinstance(result, (set, frozenset, list)):
            return f"{type(result).__name__}[{len(result)}]"
        return type(result).__name__

    # ---------------------------------------------------- timeline-only wrappers
    def _timed(fn, name: str, describe=None):
        """``fn`` with each call a timeline entry ``name``; ``describe(args, kwargs,
        result)`` gives (request id, data), or None: the call is not recorded."""

        def traced(*args, **kwargs):
            w0 = time.perf_counter_ns()
            result = "raised"
            try:
                result = fn(*args, **kwargs)
                return result
            finally:
                wall = time.perf_counter_ns() - w0
                try:
                    what = describe(args, kwargs, result) if describe else (None, None)
                except Exception as err:  # a describer must never break the engine
                    what = (None, {"describe_error": repr(err)})
                if what is not None:
                    with _lock:
                        _record(name, w0, wall, None, what[0], what[1])
                    _dump()

        traced._hooktime = True
        return traced

    def _traced(cls, method: str, name: str, describe=None) -> None:
        fn = getattr(cls, method, None)
        if fn is not None and not getattr(fn, "_hooktime", False):
            setattr(cls, method, _timed(fn, name, describe))

    def _wire_rid(rid) -> str:
        """vLLM's request id from ours' wire id (``<vLLM id>~<scheduler nonce>``)."""
        return str(rid).split("~", 1)[0]

    def _arg(args, kwargs, index: int, name: str):
        return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)

    def _patch_scheduler(module) -> None:
        cls = getattr(module, "Scheduler", None)
        if cls is None:
            return
        _traced(cls, "add_request", "vllm.add_request",
                lambda a, k, r: (_arg(a, k, 1, "request").request_id, None))

        def scheduled(a, k, out):
            tokens = dict(getattr(out, "num_scheduled_tokens", None) or {})
            return (None, {"tokens": tokens}) if tokens else (None, None)

        _traced(cls, "schedule", "vllm.schedule", scheduled)

        def updated(a, k, result):
            runner_out = _arg(a, k, 2, "model_runner_output")
            kv = getattr(runner_out, "kv_connector_output", None)
            recving = sorted(map(str, getattr(kv, "finished_recving", None) or ()))
            tokens = sorted({o.request_id for outs in (result or {}).values()
                             for o in getattr(outs, "outputs", ()) or ()
                             if getattr(o, "new_token_ids", None)})
            if not recving and not tokens:
                return None, None
            return None, {"recving": recving, "tokens": tokens}

        _traced(cls, "update_from_output", "vllm.update_from_output", updated)

    def _patch_runner(module) -> None:
        cls = getattr(module, "GPUModelRunner", None)
        if cls is None:
            return
        _traced(cls, "execute_model", "vllm.execute_model", lambda a, k, r: (None, {
            "tokens": int(getattr(_arg(a, k, 1, "scheduler_output"),
                                  "total_num_scheduled_tokens", 0) or 0)}))
        _traced(cls, "sample_tokens", "vllm.sample_tokens")

    def _patch_llm_engine(module) -> None:
        cls = getattr(module, "LLMEngine", None)
        if cls is not None:
            _traced(cls, "add_request", "vllm.frontend_add_request",
                    lambda a, k, rid: (str(rid), None))

    def _patch_output_processor(module) -> None:
        cls = getattr(module, "OutputProcessor", None)
        if cls is None:
            return

        def outputs(a, k, r):
            ids = sorted({o.request_id for o in _arg(a, k, 1, "engine_core_outputs") or ()
                          if getattr(o, "new_token_ids", None)})
            return (None, {"tokens": ids}) if ids else None

        _traced(cls, "process_outputs", "vllm.frontend_outputs", outputs)

    def _patch_ours_registration(module) -> None:
        cls = getattr(module, "Registration", None)
        if cls is None:
            return
        key_rid = lambda a, k, r: (_wire_rid(_arg(a, k, 1, "key").request_id), None)  # noqa: E731
        _traced(cls, "retrieve_async", "ours.retrieve_async", key_rid)
        _traced(cls, "_prepare", "ours.prepare", lambda a, k, r: (
            _wire_rid(_arg(a, k, 2, "key").request_id), {"op": _arg(a, k, 1, "op_name")}))
        _traced(cls, "_commit", "ours.commit_sent", lambda a, k, r: (
            None, {"op": _arg(a, k, 1, "op_name")}))
        # A module global of registration.py, looked up at each call.
        _traced(module, "copy_from_slots", "ours.copy_from_slots")

    def _patch_ours_control(module) -> None:
        cls = getattr(module, "ControlPlane", None)
        if cls is not None:
            _traced(cls, "submit_lookup_async", "ours.lookup_sent",
                    lambda a, k, r: (_wire_rid(_arg(a, k, 1, "key").request_id), None))

    def _patch_lmcache_adapter(module) -> None:
        sched = getattr(module, "LMCacheMPSchedulerAdapter", None)
        if sched is not None:
            _traced(sched, "maybe_submit_lookup_request", "lmcache.lookup_sent",
                    lambda a, k, r: (str(_arg(a, k, 1, "request_id")), None))
        worker = getattr(module, "LMCacheMPWorkerAdapter", None)
        if worker is not None:
            _traced(worker, "batched_submit_retrieve_requests", "lmcache.retrieve",
                    lambda a, k, r: (None, {"requests": [
                        str(x) for x in _arg(a, k, 1, "request_ids") or ()]}))

    def _patch_factory(module) -> None:
        factory = module.KVConnectorFactory
        original = factory.create_connector.__func__

        def create_connector(cls, config, role, *args, **kwargs):
            connector = original(cls, config, role, *args, **kwargs)
            role_name = str(getattr(role, "name", role)).lower()
            for hook in _HOOKS:
                fn = getattr(connector, hook, None)
                if callable(fn):
                    setattr(connector, hook, _wrap(role_name, hook, fn))
            return connector

        factory.create_connector = classmethod(create_connector)

    _TARGETS = {"vllm.distributed.kv_transfer.kv_connector.factory": _patch_factory}
    if _TRACE:
        _TARGETS.update({
            "vllm.v1.core.sched.scheduler": _patch_scheduler,
            "vllm.v1.worker.gpu_model_runner": _patch_runner,
            "vllm.v1.engine.llm_engine": _patch_llm_engine,
            "vllm.v1.engine.output_processor": _patch_output_processor,
            "lmcache_mp.session.registration": _patch_ours_registration,
            "lmcache_mp.session.control": _patch_ours_control,
            "lmcache.integration.vllm.vllm_multi_process_adapter": _patch_lmcache_adapter,
        })

    class _Finder(importlib.abc.MetaPathFinder):
        """Patches each target module right after its first import."""

        _busy = threading.local()

        def find_spec(self, name, path, target=None):
            patch = _TARGETS.get(name)
            if patch is None or getattr(self._busy, "on", False):
                return None
            self._busy.on = True  # find_spec below must not come back here
            try:
                spec = importlib.util.find_spec(name)
            finally:
                self._busy.on = False
            if spec is None or spec.loader is None:
                return spec
            _TARGETS.pop(name, None)
            if not _TARGETS:
                sys.meta_path.remove(self)
            exec_module = spec.loader.exec_module

            def patched(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = patched
            return spec

    sys.meta_path.insert(0, _Finder())
    atexit.register(_dump, True)
