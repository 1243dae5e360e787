"""Moved to :mod:`lmcache_mp.protocol.hashing` (the mirror of the server's token
hasher belongs to the protocol layer). This module stays so that code importing
``lmcache_mp.hashing`` keeps working: it re-exports the public names, the very same
objects."""

from __future__ import annotations

from .protocol.hashing import (
    DEFAULT_CHUNK_SIZE,
    NONE_HASH,
    ObjectKeyInfo,
    chunk_hashes,
    kv_rank,
    object_keys,
)

__all__ = ["NONE_HASH", "DEFAULT_CHUNK_SIZE", "chunk_hashes", "kv_rank", "ObjectKeyInfo",
           "object_keys"]
