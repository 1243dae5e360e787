"""``import lmcache_mp`` stays light: numpy, torch, CUDA and asyncio load on first use
(numpy on the first copy or cache), never at import. The time itself is measured by
``lmcache-mp bench`` (benchmarks/README.md); here only what gets loaded is checked,
since timings on a shared CI machine are not reliable enough to assert."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("numpy", "torch", "cuda", "asyncio", "blake3", "lmcache")

CODE = """
import json, sys
import lmcache_mp
from lmcache_mp import *  # noqa: F403  (every public name, as a caller would use them)
from lmcache_mp import Client, CacheKey, CpuKVCache, Registration, Request  # noqa: F401
print(json.dumps(sorted(sys.modules)))
"""


def loaded(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return {m.split(".")[0] for m in json.loads(out)}


def test_import_loads_no_heavy_module() -> None:
    heavy = loaded(CODE) & set(HEAVY)
    assert not heavy, f"import lmcache_mp loaded {sorted(heavy)}"


def test_numpy_loads_on_first_cache_not_before() -> None:
    mods = loaded(CODE.replace("print(", "from lmcache_mp.ipc.cpu_cache import CpuKVCache as C\n"
                               "C.allocate(num_layers=1, num_blocks=1, block_size=16, "
                               "num_heads=1, head_dim=8).close()\nprint("))
    assert "numpy" in mods and "asyncio" not in mods and "torch" not in mods
