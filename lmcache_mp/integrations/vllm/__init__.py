"""vLLM KV connector on lmcache_mp: ``kv_connector_module_path =
"lmcache_mp.integrations.vllm"``, ``kv_connector = "LMCacheMPConnector"``.

vLLM is imported only when the connector class is first asked for, so the
scheduler / worker logic (and its unit tests) run without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LMCacheMPConnector"]


def __getattr__(name: str) -> Any:
    if name in ("LMCacheMPConnector", "LMCacheMPClientMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
