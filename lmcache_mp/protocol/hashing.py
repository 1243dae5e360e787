"""A bit-exact mirror of the LMCache MP server's token hasher (blake3, the default).

The server turns a key's token ids into one rolling prefix hash per complete chunk
(``lmcache/v1/multiprocess/token_hasher.py``):

* ``NONE_HASH = blake3(int 0 as 8-byte signed big-endian || uint32 0 big-endian)``;
* ``h[0] = blake3(NONE_HASH || tokens[0:C] as big-endian uint32)``,
  ``h[i] = blake3(h[i-1] || tokens[iC:(i+1)C])``; partial chunks are never hashed.

Each chunk hash becomes one storage key per KV rank, with
``kv_rank = world_size << 24 | rank << 16 | world_size << 8 | rank``. Comparing these
between a store and a lookup shows why a lookup missed (salt, model, tokens).
Only the blake3 algorithm is mirrored; servers started with ``--hash-algorithm``
other than blake3 hash differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

__all__ = ["NONE_HASH", "DEFAULT_CHUNK_SIZE", "chunk_hashes", "kv_rank", "ObjectKeyInfo", "object_keys"]

DEFAULT_CHUNK_SIZE = 256
NONE_HASH: bytes = blake3.blake3((0).to_bytes(8, "big", signed=True) + b"\0\0\0\0").digest()


def chunk_hashes(
    token_ids: Sequence[int] | np.ndarray | bytes,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    start: int = 0,
    end: int | None = None,
) -> list[bytes]:
    """Rolling 32-byte hashes of the complete chunks in ``[start, end)``.

    Like the server, the rolling hash always starts at token 0; ``start`` and ``end``
    (chunk-aligned token indices) only select which hashes are returned.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        # Already packed (CacheKey.token_bytes, LMCache 0.5.7's token_bytes).
        packed = bytes(token_ids)
        if len(packed) % 4:
            raise ValueError("packed token ids must be a whole number of 4-byte words")
        count = len(packed) // 4
    else:
        tokens = np.asarray(token_ids, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() > 2**32 - 1):
            raise ValueError("token ids must fit in uint32")
        packed = tokens.astype(">u4").tobytes()
        count = len(tokens)
    limit = count if end is None else min(count, end)
    num_complete = limit - limit % chunk_size
    step = 4 * chunk_size
    out: list[bytes] = []
    prefix = NONE_HASH
    for i in range(0, num_complete, chunk_size):
        prefix = blake3.blake3(prefix + packed[4 * i : 4 * i + step]).digest()
        if i >= start:
            out.append(prefix)
    return out


def kv_rank(world_size: int, rank: int) -> int:
    """The server's ``ObjectKey.kv_rank`` for a worker (local world = world size)."""
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank


@dataclass(frozen=True)
class ObjectKeyInfo:
    """One storage object the server derives from a key: chunk, rank and identity."""

    chunk_index: int
    chunk_hash: bytes
    model_name: str
    kv_rank: int
    rank: int
    cache_salt: str
    object_group_id: int = 0


def object_keys(
    token_ids: Sequence[int] | np.ndarray | bytes,
    *,
    model_name: str,
    world_size: int = 1,
    worker_id: int | None = None,
    cache_salt: str = "",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    start: int = 0,
    end: int | None = None,
) -> list[ObjectKeyInfo]:
    """Storage keys for each complete chunk; ``worker_id=None`` expands to every rank."""
    ranks = range(world_size) if worker_id is None else (worker_id,)
    first = start // chunk_size
    return [
        ObjectKeyInfo(first + i, h, model_name, kv_rank(world_size, r), r, cache_salt)
        for i, h in enumerate(chunk_hashes(token_ids, chunk_size, start=start, end=end))
        for r in ranks
    ]
