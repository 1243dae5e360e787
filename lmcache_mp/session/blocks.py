"""The local checks that stand in for the server's silent drops: a transfer's key must
match its registration (model, world size, chunk-aligned non-empty range), and its
block ids must be exactly one per block of the range, each inside the cache.

The server answers none of these mistakes; it logs them and the caller would wait for
its deadline. Checking here turns each into an :class:`InvalidArgument` naming the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from ..checks import is_int
from ..errors import InvalidArgument
from ..keys import CacheKey
from ..protocol.types import EngineGroupInfo

__all__ = ["TransferLayout", "BlockIds", "normalize_block_ids"]

if TYPE_CHECKING:
    import numpy as np

# One flat list of ids (one group), one list per group, or a numpy array of either.
# (Union with a forward reference: numpy is not imported at run time here.)
BlockIds = Union[Sequence[int], Sequence[Sequence[int]], "np.ndarray"]  # noqa: UP007


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
    Checked without a Python loop per id (C-level min / max / type scans, numpy's for
    arrays): this runs on every STORE and RETRIEVE.
    """
    if _is_ndarray(block_ids):
        groups = _array_groups(block_ids, op)
    elif isinstance(block_ids, (list, tuple)):
        if block_ids and all(isinstance(b, (list, tuple)) or _is_ndarray(b) for b in block_ids):
            groups = [_array_groups(g, op)[0] if _is_ndarray(g) else list(g)
                      for g in block_ids]
        else:
            groups = [list(block_ids)]
    else:
        raise InvalidArgument(f"{op}: block_ids must be a list of ints (or one list per group)")
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
        # type() is int rejects bools (and numpy scalars, which msgpack cannot encode).
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= num_blocks):
            bad = next(b for b in ids if not is_int(b) or not 0 <= b < num_blocks)
            raise InvalidArgument(
                f"{op}: block id {bad!r} is outside the registered cache (0..{num_blocks - 1})"
            )
    return groups


def _is_ndarray(obj: object) -> bool:
    # numpy is not imported to ask: a caller passing arrays has imported it.
    return type(obj).__name__ == "ndarray" and type(obj).__module__ == "numpy"


def _array_groups(arr: Any, op: str) -> list[list[int]]:
    """A 1-D (one group) or 2-D (a row per group) integer array as lists of ints
    (``tolist`` makes the ints in C; the wire needs them as msgpack ints anyway)."""
    if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2):
        raise InvalidArgument(f"{op}: block_ids must be a 1-D or 2-D integer array, got "
                              f"{arr.ndim}-D {arr.dtype}")
    rows: list[Any] = arr.tolist()
    return [rows] if arr.ndim == 1 else rows
