"""A fork server for harness engines: import vLLM (and the connector) once, fork per engine.

Importing torch and vLLM takes ~9 s here (~11 s with LMCache's connector), and an engine
run takes ~4 s after that; the live vLLM tests run ~15 engines per server release. This
parent imports what an engine needs and nothing else (no engine, no thread, no socket,
no CUDA), then forks one child per engine: each engine is still its own process, starting
from the state of a process that has only imported modules, so what one engine stores
another can load through the server only, as with a fresh interpreter.

``python zygote.py [--lmcache | --real]`` (``--lmcache``: also import LMCache's
connector, under an oracle venv through ``with_vllm.py``; ``--real``: real vLLM
engines, ``real_engine.py`` specs, each child one in-process ``vllm.LLM``: set
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the OpenMP binding in the environment, as
``real_engine.apply_env`` does, since vLLM reads them at import). Line protocol on
stdin / stdout:

* the parent prints ``READY`` once the imports are done;
* each request is one JSON line ``{"spec": PATH, "stdout": PATH, "stderr": PATH}``: the
  parent forks, prints ``PID <pid>``, and the child runs ``harness.main(spec)`` with its
  stdout / stderr in those files; the parent prints ``EXIT <pid> <returncode>`` when it
  ends (negative: killed by that signal, e.g. by a test's timeout);
* end of input ends the parent.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import traceback


def preload(lmcache: bool, real: bool = False) -> None:
    if real:
        import real_engine

        # No engine core process spawned from a fork: every engine in-process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        real_engine.apply_env({})
        real_engine.preload("ours")  # it checks: no thread, no CUDA
        return
    import harness  # noqa: F401  (torch)
    import vllm  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: F401
    import vllm.distributed.kv_transfer.kv_connector.utils  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401
    import vllm.v1.request  # noqa: F401
    import vllm.v1.structured_output  # noqa: F401

    if lmcache:
        import lmcache.integration.vllm.lmcache_mp_connector  # noqa: F401
    else:
        import lmcache_mp.integrations.vllm  # noqa: F401
    # A fork is only a fresh process if nothing but imports ran: no other thread (its
    # locks would be copied held) and no CUDA context (it does not survive a fork).
    if threading.active_count() != 1:
        raise RuntimeError(f"an import started threads: {threading.enumerate()}")
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():
        raise RuntimeError("an import initialised CUDA: a forked child could not use it")


def run_child(request: dict[str, str], real: bool = False) -> None:
    """In the forked child: the engine, then exit as an interpreter would (atexit
    handlers run: they unlink the KV caches' shared memory), never returning."""
    rc = 1
    try:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if real:
            import real_engine

            rc = real_engine.child_main(request["spec"])
        else:
            import harness

            harness.main(request["spec"])
            rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)


def serve() -> None:
    real = "--real" in sys.argv[1:]
    preload("--lmcache" in sys.argv[1:], real)
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request, real)
        print(f"PID {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    serve()
