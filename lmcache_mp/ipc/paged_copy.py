"""Vectorised copies between a paged KV cache and LMCache's chunk objects.

A chunk object (what the server stores, and what an engine-driven SHM slot holds) is
``[2, num_layers, chunk_tokens, num_heads * head_dim]`` token-major (MLA:
``[num_layers, chunk_tokens, head_dim]``). A paged HND layer is ``[2, num_blocks,
num_heads, block_size, head_dim]``, so a chunk is the per-layer transpose of its
blocks. Copies run per layer as numpy strided copies: contiguous runs of block ids are
copied as slices (no temporaries), scattered ids with one fancy-indexed copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .cpu_cache import KVGeometry

__all__ = ["block_runs", "gather_chunk", "scatter_chunk"]

# Beyond this many runs, one fancy-indexed copy beats a Python loop of slice copies.
_MAX_SLICE_RUNS = 8


def block_runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids as ``(position, first_id, length)``."""
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ids)]))
    return [(int(s), int(ids[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def _chunk_view(obj: np.ndarray, layer: int, g: KVGeometry, nblocks: int) -> np.ndarray:
    """One layer of a chunk object, shaped like the blocks it holds (token-major)."""
    view: np.ndarray = obj[layer] if g.mla else obj[:, layer]
    view = view.view()
    # Assigning .shape (unlike reshape) raises instead of silently copying, so writes
    # through this view always land in the chunk object.
    view.shape = ((nblocks, g.block_size, g.head_dim) if g.mla
                  else (2, nblocks, g.block_size, g.num_heads, g.head_dim))
    return view


def _paged_view(layer: np.ndarray, g: KVGeometry) -> np.ndarray:
    """A paged layer with tokens before heads, matching ``_chunk_view`` (a view)."""
    return layer if g.mla or g.layout == "NHD" else layer.transpose(0, 1, 3, 2, 4)


def gather_chunk(
    layers: Sequence[np.ndarray], ids: np.ndarray, out: np.ndarray, g: KVGeometry
) -> None:
    """Copy the blocks ``ids`` of every layer into the chunk object ``out``."""
    runs = block_runs(ids)
    axis_blocks = 0 if g.mla else 1
    for li, layer in enumerate(layers):
        dst = _chunk_view(out, li, g, len(ids))
        src = _paged_view(layer, g)
        if len(runs) <= _MAX_SLICE_RUNS:
            for pos, first, n in runs:
                if axis_blocks == 0:
                    dst[pos : pos + n] = src[first : first + n]
                else:
                    dst[:, pos : pos + n] = src[:, first : first + n]
        elif axis_blocks == 0:
            dst[...] = src[ids]
        else:
            dst[...] = src[:, ids]


def scatter_chunk(
    obj: np.ndarray,
    layers: Sequence[np.ndarray],
    ids: np.ndarray,
    g: KVGeometry,
    skip_blocks: int = 0,
) -> None:
    """Copy the chunk object ``obj`` into blocks ``ids`` of every layer, leaving the
    first ``skip_blocks`` target blocks untouched."""
    if skip_blocks >= len(ids):
        return
    targets = ids[skip_blocks:]
    runs = block_runs(targets)
    for li, layer in enumerate(layers):
        src = _chunk_view(obj, li, g, len(ids))
        dst = _paged_view(layer, g)
        if g.mla:
            src = src[skip_blocks:]
            if len(runs) <= _MAX_SLICE_RUNS:
                for pos, first, n in runs:
                    dst[first : first + n] = src[pos : pos + n]
            else:
                dst[targets] = src
        else:
            src = src[:, skip_blocks:]
            if len(runs) <= _MAX_SLICE_RUNS:
                for pos, first, n in runs:
                    dst[:, first : first + n] = src[:, pos : pos + n]
            else:
                dst[:, targets] = src
