"""A fork server for real LMCache servers: import the server once, fork one per start.

Starting an LMCache MP server costs ~11 CPU-seconds on these machines, ~8 of them
importing it (torch, LMCache); the test suite starts ~100. This process, run with an
oracle venv's python (``lmcache-server.sh zygote``), imports
``lmcache.v1.multiprocess.server`` and nothing else (no thread, no socket but its own
listening one, no server state), then for each start forks a child that runs the
module as ``python -m lmcache.v1.multiprocess.server ARGS`` would: ``runpy`` executes
it as ``__main__`` with that argv, in a new session (as ``setsid``), stdout / stderr
to the log file. The server is the real server's own code, from a process that has
only imported modules; what differs from ``python -m`` is only the import, done once.

The child is double-forked: its parent exits at once, so the server is reparented
exactly as one started by ``lmcache-server.sh start`` (whose shell exits), and no
zombie keeps its pid alive after it dies (tests wait for a killed server's pid to go).
A forked server cannot change its command line, so it names itself
``lmcache-s:<port>`` (``/proc/PID/comm``), which ``lmcache-server.sh`` checks before it
signals a pid from a pid file.

    python server_zygote.py serve SOCKET            (the fork server; READY on stdout)
    python server_zygote.py spawn SOCKET LOG -- ARGS  (one server: prints its pid)

``spawn`` is what ``lmcache-server.sh start`` runs when ``LMCACHE_MP_SERVER_ZYGOTE`` is
``VERSION:SOCKET`` for the version it starts; it imports nothing but the standard
library's socket and json. The fork server ends when its socket is closed by the one
who started it (end of input on stdin) or when that parent dies.
"""

from __future__ import annotations

import json
import os
import socket
import sys

SERVER_MODULE = "lmcache.v1.multiprocess.server"


def comm_name(argv: list[str]) -> str:
    """``lmcache-s:<port>`` (15 bytes at most: the kernel's limit for a task's name)."""
    port = argv[argv.index("--port") + 1] if "--port" in argv else "?"
    return f"lmcache-s:{port}"[:15]


def set_comm(name: str) -> None:
    import ctypes

    pr_set_name = 15
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_name, ctypes.c_char_p(name.encode()), 0, 0, 0)


def read_line(conn: socket.socket) -> bytes:
    """One JSON line (requests and replies are one line each), or what came before EOF."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def run_server(request: dict[str, object], inherited: list[socket.socket]) -> None:
    """In the grandchild: become ``python -m lmcache.v1.multiprocess.server ARGS``."""
    import runpy
    import signal

    rc = 1
    try:
        for sock in inherited:  # the fork server's: not the server's to hold
            sock.close()
        os.setsid()
        # The handlers a fresh python starts with.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        log = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
        set_comm(comm_name(argv))
        sys.argv = [SERVER_MODULE, *argv]
        runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        rc = 130
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # what a fresh interpreter runs at its end
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)


def fork_server(request: dict[str, object], inherited: list[socket.socket]) -> int:
    """Double fork: returns the server's pid once its short-lived parent has exited."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        try:
            server = os.fork()
            if server == 0:
                os.close(write_end)
                run_server(request, inherited)
            os.write(write_end, str(server).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    with os.fdopen(read_end, "rb") as r:
        return int(r.read() or b"0")


def preload() -> None:
    import threading

    __import__(SERVER_MODULE)
    # A fork is only a fresh process if nothing but imports ran: no other thread (its
    # locks would be copied held).
    if threading.active_count() != 1:
        raise RuntimeError(f"importing the server started threads: {threading.enumerate()}")


def serve(path: str) -> None:
    preload()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path)
    listener.listen(16)
    listener.settimeout(1.0)
    print("READY", flush=True)
    os.set_blocking(0, False)
    try:
        while os.getppid() == parent:
            try:
                if os.read(0, 4096) == b"":
                    return  # our starter closed our stdin: the end
            except BlockingIOError:
                pass
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                try:
                    pid = fork_server(json.loads(read_line(conn)), [listener, conn])
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except Exception as exc:  # noqa: BLE001  (said to the caller)
                    conn.sendall(json.dumps({"error": repr(exc)}).encode() + b"\n")
    finally:
        listener.close()
        if os.path.exists(path):
            os.unlink(path)


def spawn(path: str, log: str, argv: list[str]) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(path)
        request = {"argv": argv, "log": log, "env": dict(os.environ)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        data = read_line(conn)
    reply = json.loads(data) if data else {"error": "the fork server closed the connection"}
    if "pid" not in reply or not reply["pid"]:
        print(f"server_zygote: {reply.get('error', reply)}", file=sys.stderr)
        return 1
    print(reply["pid"])
    return 0


def main() -> int:
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "serve":
        serve(args[1])
        return 0
    if len(args) >= 4 and args[0] == "spawn" and args[3] == "--":
        return spawn(args[1], args[2], args[4:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
