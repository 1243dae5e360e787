"""Rebuild tagged fixture values (see tools/gen_fixtures.py) as lmcache_mp values.

Map-like values are converted with the operation's own payload type, so each family's
schema (0.5.3 keys, 0.5.5 keys with num_kv_readers, ...) is what the fixture is read as.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from lmcache_mp.protocol import PROFILES, get_profile
from lmcache_mp.protocol.types import WrapperBlob

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
# Every release with fixtures, and the profile that must speak it.
RELEASES = {rel: p.name for p in PROFILES.values() for rel in p.releases}


def load(version: str, name: str) -> list[dict[str, Any]]:
    data = json.loads((FIXTURES / f"v{version}" / f"{name}.json").read_text())
    cases: list[dict[str, Any]] = data["cases"]
    return cases


def load_all(name: str) -> list[tuple[str, dict[str, Any]]]:
    """(release, case) for every release that has this fixture file."""
    return [(rel, case) for rel in RELEASES
            if (FIXTURES / f"v{rel}" / f"{name}.json").exists()
            for case in load(rel, name)]


def profile_for(release: str) -> Any:
    return get_profile(RELEASES[release])


def build(value: Any, tp: Any) -> Any:
    """A fixture payload as the value lmcache_mp's codec takes for payload type ``tp``."""
    if not isinstance(value, dict):
        return value
    (tag, inner), = value.items()
    if tag == "$bytes":
        return bytes.fromhex(inner)
    if tag == "$float":
        return float(inner)
    if tag == "$engine":
        return inner
    if tag == "$wrappers":
        return [WrapperBlob(bytes.fromhex(h)) for h in inner]
    if tag == "$key":  # 0.5.7 keys hold token_bytes as {"$bytes": hex}
        return msgspec.convert({k: build(v, None) for k, v in inner.items()}, tp)
    if tag in ("$hints", "$groups", "$records", "$engine_driven"):
        return msgspec.convert(inner, tp)
    raise ValueError(f"unknown fixture tag {tag}")


def build_reply(value: Any) -> Any:
    """A fixture reply value as plain data, for comparison with a decoded reply."""
    if isinstance(value, list):
        return [build_reply(v) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, inner), = value.items()
    if tag == "$bytes":
        return bytes.fromhex(inner)
    if tag == "$json":
        return inner
    if tag == "$struct":
        return {k: build_reply(v) for k, v in inner.items()}
    raise ValueError(f"unknown reply tag {tag}")
