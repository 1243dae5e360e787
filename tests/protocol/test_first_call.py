"""The first request of each operation costs what later ones cost: msgspec learns every
payload's Struct when the profiles are built (at import), not in the first call on a
request's path (issue 38: 0.2 ms of the first LOOKUP's key on vLLM's scheduler
thread, a few ms over an engine's first transfers)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A fresh interpreter: this test process has used the payload types already.
_PROBE = textwrap.dedent("""
    import cProfile, pstats
    from lmcache_mp import CacheKey
    from lmcache_mp.protocol import PROFILES, encode_request

    key = CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=list(range(512)),
                   start=0, end=512, request_id="r")
    profile = cProfile.Profile()
    profile.enable()
    for p in PROFILES.values():
        encode_request(p.op("LOOKUP"), p.all_ranks_payloads(key, 1, False))
        encode_request(p.op("PREPARE_STORE"), {"key": p.transfer_key(key, 0),
                                               "instance_id": 7})
    profile.disable()
    learnt = [name for (_, _, name) in pstats.Stats(profile).stats
              if name == "get_class_annotations"]
    print("LEARNT", len(learnt), "PROFILES", len(PROFILES))
""")


def test_payload_structs_are_learnt_at_import_not_on_a_request() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    words = next(ln for ln in out.splitlines() if ln.startswith("LEARNT")).split()
    assert int(words[3]) >= 4  # every family's LOOKUP and PREPARE_STORE were encoded
    assert words[1] == "0", "a payload Struct was learnt on its first request, not at import"
