from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmcache_mp import CpuKVCache

from ..support.session_helpers import kv_cache


@pytest.fixture
def kv() -> Iterator[CpuKVCache]:
    """The session tests' cache: 2 layers x 80 blocks of 16 tokens, 2 heads x 8, of random
    bytes (tests/conftest.py's is zero-filled: a copy from the wrong block would not show)."""
    with kv_cache() as cache:
        yield cache
