#!/usr/bin/env python3
"""Wait until an LMCache MP server answers: GET_CHUNK_SIZE (id 21 in every release: ids
1-24 are frozen since 0.5.3) with raw pyzmq + msgspec, every 0.5 s, from one process.
Asking, not reading the server's log: an operator's LMCACHE_LOG_LEVEL=WARNING hides the
INFO line it prints when ready.

    python scripts/wait_ready.py URL PID SECONDS

Exit 0 when answered, 3 if PID ended (0: not watched), 1 after SECONDS. Used by
scripts/lmcache-server.sh (the oracle) and scripts/gpu_check.py (the device check);
runs in any interpreter with pyzmq and msgspec (an oracle venv, the device's wheels).
"""

from __future__ import annotations

import sys
import time


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended); always True for 0."""
    if not pid:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_ready(url: str, pid: int, seconds: float) -> int:
    import msgspec
    import zmq

    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not alive(pid):
                return 3
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(url)
            sock.send_multipart([msgspec.msgpack.encode(0), msgspec.msgpack.encode(21)])
            ok = sock.poll(500)
            sock.close()
            if ok:
                return 0
        return 1
    finally:
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(wait_ready(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
