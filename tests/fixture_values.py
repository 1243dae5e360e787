"""Rebuild tagged fixture values (see tools/gen_fixtures.py) as lmcache_mp types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmcache_mp.protocol.types import (
    BlockAllocationRecord,
    EngineGroupInfo,
    LayoutHints,
    RegisterEngineDrivenContextPayload,
    WrapperBlob,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def load(version: str, name: str) -> list[dict[str, Any]]:
    data = json.loads((FIXTURES / f"v{version}" / f"{name}.json").read_text())
    cases: list[dict[str, Any]] = data["cases"]
    return cases


def build(value: Any, key_type: Any) -> Any:
    """A fixture payload as the value lmcache_mp's codec takes."""
    if isinstance(value, list):
        return [build(v, key_type) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, inner), = value.items()
    if tag == "$key":
        return key_type(**{**inner, "token_ids": tuple(inner["token_ids"])})
    if tag == "$bytes":
        return bytes.fromhex(inner)
    if tag == "$float":
        return float(inner)
    if tag == "$engine":
        return inner
    if tag == "$wrappers":
        return [WrapperBlob(bytes.fromhex(h)) for h in inner]
    if tag == "$hints":
        return LayoutHints(**inner)
    if tag == "$groups":
        return [EngineGroupInfo(**{**g, "layer_indices": tuple(g["layer_indices"])}) for g in inner]
    if tag == "$records":
        return [BlockAllocationRecord(**r) for r in inner]
    if tag == "$engine_driven":
        return RegisterEngineDrivenContextPayload(**inner)
    if tag == "$json":
        return inner
    if tag == "$struct":
        return {k: build(v, key_type) for k, v in inner.items()}
    raise ValueError(f"unknown fixture tag {tag}")
