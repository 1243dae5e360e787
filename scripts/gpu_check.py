#!/usr/bin/env python3
"""The GPU round trip against one real LMCache MP server in GPU mode (run by gpu_check.sh).

The check lives in the package next to this file (scripts/gpu_check/: its docstring
says what each side does): ``plan`` (arguments, sides, block ids, L1 sizing),
``side_base`` / ``side_ours`` / ``side_views`` / ``side_lmcache`` (the clients),
``flow`` (one side's round trip, the floor, the warm-up), ``report`` (the JSON and the
table), ``restart`` (the SIGKILL step), ``main`` (the run). This file is the entry
point gpu_check.sh and the tests call.

Exit status: 0 every side that ran round-tripped, 1 a side failed or hung, 3 no GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# scripts/ (wait_ready, the gpu_check package) and the repository (lmcache_mp).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check.main import main  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never wait on a hung side's thread or a zmq context at exit
