"""Per-hook cost of a vLLM KV connector, measured at vLLM's boundary, in every process
of an engine (the scheduler's and each worker's).

Loaded by Python at start-up as ``sitecustomize`` when this folder is on PYTHONPATH
(benchmarks/vllm_e2e.py puts it there for its engines; a spawned engine core inherits
it). Does nothing unless ``LMCACHE_MP_HOOK_TIMES`` names a folder. Then, once vLLM's
connector factory is imported, every connector it creates (ours or LMCache's: the same
wrapping) has its hooks wrapped: calls, thread CPU time and wall time per hook, and the
pickled size of each step's connector metadata (what vLLM sends the workers); and the
CPU time of the connectors' own background threads (names starting with one of
``_BACKGROUND``: ours ``lmcache-mp-*``, LMCache's client loop ``mq-client-*`` and its
``lmcache*`` threads), read from /proc (10 ms ticks), since work moved off the hooks'
threads still costs the engine's CPU. Each
process writes ``hooks-<pid>.json`` there (at most every half second, and at exit):
cumulative totals, so the last write is the answer.
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

    _TARGET = "vllm.distributed.kv_transfer.kv_connector.factory"
    _HOOKS = (
        # scheduler side
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
        "update_connector_output", "request_finished", "get_kv_connector_stats",
        # worker side
        "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
        "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    )
    _lock = threading.Lock()
    #: "role.hook" -> [calls, thread CPU ns, wall ns]
    _stats: dict = {}
    _meta = {"steps": 0, "bytes": 0}
    _last_dump = [0.0]
    #: LMCACHE_MP_HOOK_TRACE=1: also a timeline, (monotonic start, wall us, hook, result)
    #: per call, for reading where one request's time goes (last 20000 calls).
    _TRACE = os.environ.get("LMCACHE_MP_HOOK_TRACE") == "1"
    _trace: list = []
    _BACKGROUND = ("lmcache", "mq-client", "zmq-event")
    #: native thread id -> (name, CPU seconds last read): ended threads keep theirs.
    _threads: dict = {}
    _TICK = os.sysconf("SC_CLK_TCK")

    def _read_threads() -> None:
        for t in threading.enumerate():
            if t.native_id is None or not t.name.startswith(_BACKGROUND):
                continue
            try:
                with open(f"/proc/self/task/{t.native_id}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            _threads[t.native_id] = (t.name, (int(fields[11]) + int(fields[12])) / _TICK)

    def _dump(force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - _last_dump[0] < 0.5:
            return
        _last_dump[0] = now
        _read_threads()
        with _lock:
            data = {"pid": os.getpid(), "argv0": sys.argv[0] if sys.argv else "",
                    "stats": {k: list(v) for k, v in _stats.items()}, "meta": dict(_meta),
                    "threads": {str(k): list(v) for k, v in _threads.items()},
                    "trace": _trace[-20000:]}
        tmp = os.path.join(_DIR, f".hooks-{os.getpid()}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, os.path.join(_DIR, f"hooks-{os.getpid()}.json"))

    def _wrap(role: str, name: str, fn):
        rec = _stats.setdefault(f"{role}.{name}", [0, 0, 0])
        measure_meta = name == "build_connector_meta"

        def timed(*args, **kwargs):
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                result = fn(*args, **kwargs)
            finally:
                cpu, wall = time.thread_time_ns() - c0, time.perf_counter_ns() - w0
                with _lock:
                    rec[0] += 1
                    rec[1] += cpu
                    rec[2] += wall
                    if _TRACE:
                        _trace.append((w0 / 1e9, wall // 1000, f"{role}.{name}",
                                       _brief(result) if "result" in locals() else "raised"))
            if measure_meta:
                size = len(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
                with _lock:
                    _meta["steps"] += 1
                    _meta["bytes"] += size
            _dump()
            return result

        return timed

    def _brief(result) -> str:
        if result is None or isinstance(result, (bool, int, float)):
            return repr(result)
        if isinstance(result, tuple):
            return repr(tuple(_brief(r) for r in result))
        if isinstance(result, (set, frozenset, list)):
            return f"{type(result).__name__}[{len(result)}]"
        return type(result).__name__

    def _patch(module) -> None:
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

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def patched(module):
                exec_module(module)
                _patch(module)

            spec.loader.exec_module = patched
            return spec

    sys.meta_path.insert(0, _Finder())
    atexit.register(_dump, True)
