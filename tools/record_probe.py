#!/usr/bin/env python3
"""Record how real LMCache servers answer the protocol probe (run with the .venv python).

    .venv/bin/python tools/record_probe.py [--versions 0.5.3 0.5.4 0.5.5 0.5.6 0.5.7rc2]

For each release it starts a server from the oracle venv (scripts/lmcache-server.sh, as
the live tests do), asks the probe's questions (tests/support/probe_replay.py:record) and writes
the reply frames, as the server encoded them, to fixtures/v<release>/probe.json. 0.5.6
is recorded twice: as the script starts it (observability off) and with its event bus
on, when GET_EXPERIMENTAL also lists "kv_event_stream". 0.5.5 and later are also asked
the questions detection sends only to them (FREE_LOOKUP_LOCKS of an empty range in the
0.5.6 and the 0.5.7 form). tests/protocol/test_detect.py replays
these answers offline; a live test checks each release still answers the same.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import version as dist_version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import free_port  # noqa: E402
from tests.support.probe_replay import record  # noqa: E402

SCRIPT = REPO / "scripts" / "lmcache-server.sh"
ORACLE = Path(os.environ.get("LMCACHE_MP_ORACLE_DIR", REPO / ".oracle"))
QUIET = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
         "OMP_NUM_THREADS": "1"}


def newer(version: str) -> bool:
    """Asked the FREE_LOOKUP_LOCKS questions (0.5.5 and later)."""
    return version not in ("0.5.3", "0.5.4")


def with_script(version: str) -> dict[str, object]:
    port = free_port()
    subprocess.run([str(SCRIPT), "start", "--version", version, "--port", str(port)],
                   check=True, capture_output=True)
    try:
        return {"server": "default", "args": "scripts/lmcache-server.sh start (observability off)",
                "replies": record(f"tcp://127.0.0.1:{port}", newer=newer(version))}
    finally:
        subprocess.run([str(SCRIPT), "stop", "--port", str(port)], capture_output=True)


def with_event_bus(version: str) -> dict[str, object]:
    """The server as `lmcache server` starts it by default: observability (and with it
    the KV event bus) on; metrics off so that no HTTP port is opened."""
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--l1-size-gb", "1",
            "--eviction-policy", "LRU", "--disable-metrics"]
    python = ORACLE / f"venv-{version}" / "bin" / "python"
    log_path = ORACLE / "run" / f"record-probe-{port}.log"
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen([str(python), "-m", "lmcache.v1.multiprocess.server", *args],
                            env={**os.environ, **QUIET}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        url = f"tcp://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            replies = record(url, wait=1.0)
            if replies["unregister_unknown"] is not None:
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the server did not start; see {log_path}")
        answers = record(url, newer=newer(version))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
    log_path.unlink()  # kept only when the server failed
    return {"server": "event_bus", "args": " ".join(args[4:]), "replies": answers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", nargs="+",
                    default=["0.5.3", "0.5.4", "0.5.5", "0.5.6", "0.5.7rc2"])
    ap.add_argument("--out", default=str(REPO / "fixtures"))
    args = ap.parse_args()
    for version in args.versions:
        cases = [with_script(version)]
        if version == "0.5.6":
            cases.append(with_event_bus(version))
        meta = {"lmcache_version": version, "recorded_with": "tools/record_probe.py",
                "lmcache_mp": dist_version("lmcache-mp")}
        path = Path(args.out) / f"v{version}" / "probe.json"
        path.write_text(json.dumps({"meta": meta, "cases": cases}, indent=1) + "\n")
        print(f"wrote {path}: {[c['replies'] for c in cases]}")


if __name__ == "__main__":
    main()
