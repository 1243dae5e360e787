"""LMCache's P2P second tier on loopback: a coordinator and two MP servers with the
HTTP front and P2P on (``mooncake_te`` over TCP), for tests/multinode/test_p2p.py.

P2P needs what ``scripts/lmcache-server.sh`` cannot start: the server's HTTP front
(``python -m lmcache.v1.multiprocess.http_server``, which registers with the
coordinator and gets its peer's ``p2p`` adapter from it) and a coordinator
(``python -m lmcache.v1.mp_coordinator``); and the transfer engine's package and
libraries (``scripts/p2p.sh``: PyPI's mooncake-transfer-engine-non-cuda and Debian's
libibverbs1, unpacked under .tools/p2p). Every address is 127.0.0.1 (the servers
advertise it to the coordinator: ``--coordinator-advertise-ip``); ports come from the
job's range. Every process dies with the test process (``PR_SET_PDEATHSIG``); ``close``
stops them, removes their L1 pools in /dev/shm and their temp dir
(``lmcache_mp_p2p_*``: their logs).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from ..conftest import REPO, LiveServer, free_port, oracle_python
from .valkey import die_with_parent

P2P_SCRIPT = REPO / "scripts" / "p2p.sh"
WAIT_READY = REPO / "scripts" / "wait_ready.py"
TMP_PREFIX = "lmcache_mp_p2p_"
RELEASE = "0.5.7rc2"  # P2P as tried and tested here


def p2p_env() -> dict[str, str]:
    """The environment of a P2P server: the transfer engine's package and libraries."""
    if os.environ.get("LMCACHE_MP_SKIP_LIVE") == "1":
        pytest.skip("LMCACHE_MP_SKIP_LIVE=1: live tests skipped")
    proc = subprocess.run([str(P2P_SCRIPT), "install"], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"scripts/p2p.sh install failed:\n{proc.stderr}")
    site, libs = proc.stdout.strip().splitlines()[-2:]
    return {**os.environ, "PYTHONPATH": site, "LD_LIBRARY_PATH": libs,
            "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false",
            "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "1"}


class P2PNodes:
    """The coordinator and servers A and B (``a`` / ``b``: :class:`LiveServer` for
    their MP port; both transfer modes, an L1 pool in shared memory each)."""

    def __init__(self, *more_b: str) -> None:
        """``more_b``: more server arguments for node B (a node that disagrees)."""
        env = p2p_env()
        python = str(oracle_python(RELEASE))
        self.dir = tempfile.mkdtemp(prefix=TMP_PREFIX)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pools: list[str] = []
        #: Each node's HTTP front (its /status, /config), by name.
        self.http: dict[str, str] = {}
        try:
            coordinator = free_port()
            self._spawn("coordinator", [python, "-m", "lmcache.v1.mp_coordinator", "--host",
                                        "127.0.0.1", "--port", str(coordinator)], env)
            servers = []
            for name in ("a", "b"):
                port, http, p2p = free_port(), free_port(), free_port()
                pool = f"p2p{name}{os.getpid()}"
                self.pools.append(f"lmcache_l1_pool_{pool}")
                self.http[name] = f"http://127.0.0.1:{http}"
                self._spawn(name, [
                    python, "-m", "lmcache.v1.multiprocess.http_server", "--host", "127.0.0.1",
                    "--port", str(port), "--l1-size-gb", "1", "--eviction-policy", "LRU",
                    "--supported-transfer-mode", "auto", "--shm-name", pool,
                    "--disable-observability", "--http-host", "127.0.0.1",
                    "--http-port", str(http), "--p2p-advertise-url", f"127.0.0.1:{p2p}",
                    "--p2p-transfer-engine", "mooncake_te",
                    "--coordinator-url", f"http://127.0.0.1:{coordinator}",
                    "--coordinator-advertise-ip", "127.0.0.1",
                    *(more_b if name == "b" else ())], env)
                servers.append((port, http))
            for (port, http), proc in zip(servers, self.procs[1:], strict=True):
                self._wait_ready(port, http, proc)
            self.a = LiveServer(servers[0][0], RELEASE)
            self.b = LiveServer(servers[1][0], RELEASE)
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(Path(self.dir) / f"{name}.log", "wb") as log:
            self.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                               stdout=log, stderr=subprocess.STDOUT,
                                               preexec_fn=die_with_parent))

    def log(self, name: str) -> str:
        return (Path(self.dir) / f"{name}.log").read_text(errors="replace")

    def _wait_ready(self, port: int, http: int, proc: subprocess.Popen[bytes],
                    timeout: float = 180.0) -> None:
        """The MP port answers, and the coordinator gave it its peer's p2p adapter."""
        deadline = time.monotonic() + timeout
        rc = subprocess.run([str(oracle_python(RELEASE)), str(WAIT_READY),
                             f"tcp://127.0.0.1:{port}", str(proc.pid), str(int(timeout))],
                            capture_output=True).returncode
        if rc != 0:
            raise RuntimeError(f"P2P server on {port} did not answer (rc {rc}):\n"
                               f"{self._tails()}")
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/config/adapters",
                                            timeout=5) as reply:
                    if b'"p2p"' in reply.read():
                        return
            except OSError:
                pass
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the P2P server on {port} got no p2p adapter:\n{self._tails()}")

    def _tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(Path(self.dir).glob("*.log")))

    def __enter__(self) -> P2PNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in reversed(self.procs):  # servers first, the coordinator last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for pool in self.pools:
            Path("/dev/shm", pool).unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
