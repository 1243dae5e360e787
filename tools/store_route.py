#!/usr/bin/env python3
"""The route of one STORE through the package: which files it enters, in order, from
``Request.store()`` until its reply is decoded, against a real LMCache server.

It starts a server (scripts/lmcache-server.sh, 0.5.3 unless --version), registers a
small CpuKVCache (LMCache-driven mode), stores one chunk once untraced (so one-time
work, as a first registration or protocol probe, is not counted), then traces a second
STORE with ``sys.settrace``: every Python function entered in ``lmcache_mp/`` is a stop;
consecutive stops in the same file are one entry into that file.

    .venv/bin/python tools/store_route.py [--version 0.5.3] [--root DIR]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="0.5.3")
    ap.add_argument("--root", type=Path, default=REPO,
                    help="the checkout whose lmcache_mp is traced (the server: this one's)")
    args = ap.parse_args()
    sys.path.insert(0, str(args.root))
    from lmcache_mp import Client, CpuKVCache

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = REPO / "scripts" / "lmcache-server.sh"
    subprocess.run([str(server), "start", "--version", args.version, "--port", str(port)],
                   check=True, stdout=subprocess.DEVNULL)
    pkg = str(args.root / "lmcache_mp")
    stops: list[tuple[str, str]] = []

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(pkg):
            stops.append((frame.f_code.co_filename[len(pkg) + 1:], frame.f_code.co_name))

    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=10) as client, \
                CpuKVCache.allocate(num_layers=2, num_blocks=64, block_size=16, num_heads=2,
                                    head_dim=8, dtype="float16") as kv, \
                client.register(kv, model_name="route", mode="lmcache") as reg:
            chunk = reg.chunk_size
            for n, traced in ((0, False), (1, True)):
                tokens = [n * 7 + i for i in range(chunk)]
                with reg.request(tokens) as req:
                    if traced:
                        sys.settrace(tracer)  # type: ignore[arg-type]
                    ok = req.store(list(range(chunk // 16)), start=0, end=chunk)
                    sys.settrace(None)
                    assert ok is True
    finally:
        subprocess.run([str(server), "stop", "--port", str(port)], check=False,
                       stdout=subprocess.DEVNULL)
    entries: list[str] = []
    for file, _ in stops:
        if not entries or entries[-1] != file:
            entries.append(file)
    per_file = Counter(entries)
    print(f"STORE: {len(stops)} function calls in lmcache_mp, {len(entries)} file entries "
          f"in {len(per_file)} files")
    print("route:", " -> ".join(entries))
    print("entries per file:", ", ".join(f"{f} {n}" for f, n in per_file.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
