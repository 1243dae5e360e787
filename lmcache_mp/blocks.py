"""The local checks that stand in for the server's silent drops: a transfer's key must
match its registration (model, world size, chunk-aligned non-empty range), and its
block ids must be exactly one per block of the range, each inside the cache.

The server answers none of these mistakes; it logs them and the caller would wait for
its deadline. Checking here turns each into an :class:`InvalidArgument` naming the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .checks import is_int
from .errors import InvalidArgument
from .keys import CacheKey
from .protocol.types import EngineGroupInfo

__all__ = ["TransferLayout", "BlockIds", "normalize_block_ids"]

# One flat list of ids (one group), one list per group, or a numpy array of either.
BlockIds = Sequence[int] | Sequence[Sequence[int]] | np.ndarray


@dataclass(frozen=True)
class TransferLayout:
    """What a registration fixes for its transfers."""

    instance_id: int
    model_name: str
    world_size: int
    chunk_size: int
    groups: tuple[EngineGroupInfo, ...]
    block_size: int
    num_blocks: int

    def tokens_per_block(self, group: int) -> int:
        return self.groups[group].tokens_per_block or self.block_size

    def check_key(self, key: CacheKey, op: str) -> None:
        if not isinstance(key, CacheKey):
            raise InvalidArgument(f"{op}: expected a lmcache_mp.CacheKey, got {type(key).__name__}")
        if (key.model_name, key.world_size) != (self.model_name, self.world_size):
            raise InvalidArgument(
                f"{op}: key is for model {key.model_name!r} / world_size {key.world_size}, but "
                f"instance {self.instance_id} registered {self.model_name!r} / "
                f"{self.world_size}; the server files memory layouts by (model, world size)"
            )
        c = self.chunk_size
        if key.start % c or key.end % c:
            raise InvalidArgument(
                f"{op}: start={key.start} and end={key.end} must be multiples of the server's "
                f"chunk size {c} (the server drops misaligned transfers without replying)"
            )
        if key.end <= key.start:
            raise InvalidArgument(f"{op}: the key's range [{key.start}, {key.end}) is empty")


def normalize_block_ids(
    block_ids: BlockIds, key: CacheKey, layout: TransferLayout, op: str
) -> list[list[int]]:
    """Block ids as one list per group, checked against the key's range and the cache.

    A flat list is accepted for a single group. Each group's list must hold exactly one
    id per ``tokens_per_block`` tokens of ``[start, end)``, each in ``[0, num_blocks)``.
    """
    if isinstance(block_ids, np.ndarray):
        block_ids = block_ids.tolist()
    if not isinstance(block_ids, (list, tuple)):
        raise InvalidArgument(f"{op}: block_ids must be a list of ints (or one list per group)")
    groups: list[list[int]]
    if block_ids and all(isinstance(b, (list, tuple, np.ndarray)) for b in block_ids):
        groups = [list(np.asarray(g).tolist()) if isinstance(g, np.ndarray) else list(g)
                  for g in block_ids]
    else:
        groups = [list(block_ids)]
    if len(groups) != len(layout.groups):
        raise InvalidArgument(
            f"{op}: got {len(groups)} block-id list(s), the cache was registered with "
            f"{len(layout.groups)} group(s): pass one list per group"
        )
    num_blocks = layout.num_blocks
    for gi, ids in enumerate(groups):
        per_block = layout.tokens_per_block(gi)
        need = (key.end - key.start) // per_block
        if len(ids) != need:
            raise InvalidArgument(
                f"{op}: group {gi} needs exactly {need} block ids for tokens "
                f"[{key.start}, {key.end}) at {per_block} tokens per block, got {len(ids)}"
            )
        for b in ids:
            if not is_int(b) or not 0 <= b < num_blocks:
                raise InvalidArgument(
                    f"{op}: block id {b!r} is outside the registered cache (0..{num_blocks - 1})"
                )
    return groups
