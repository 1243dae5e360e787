"""Copies between a paged KV cache and LMCache's chunk objects, as plans of
independent, GIL-releasing numpy copies (run by :mod:`.copy_workers` on several cores).

A chunk object (what the server stores, and what an engine-driven SHM slot holds) is
``[2, num_layers, chunk_tokens, num_heads * head_dim]`` token-major (one plane, MLA:
``[num_layers, chunk_tokens, head_dim]``, fused K/V rows: ``[num_layers,
chunk_tokens, num_heads * head_dim]``). A paged NHD layer ``[2, num_blocks,
block_size, num_heads, head_dim]`` is token-major already: a run of consecutive
blocks is one contiguous run of the chunk. An HND layer ``[2, num_blocks, num_heads,
block_size, head_dim]`` is the per-block transpose (runs of ``head_dim`` elements).
Fused layers are the same without the leading K/V axis.

One task per (chunk, layer), about a MiB each: the unit the workers share out. Chunk
objects lying one after another in the pool whose blocks are one run of ids (what a
request's key usually gets) are copied as one: one task per layer for the whole run
(:func:`gather_run_tasks`, :func:`scatter_run_tasks`), instead of a plan and a copy
per chunk and layer (8k tokens of a small model: 128 copies, whose planning and calls
took 40% of the copy's time, issue 38).

Block ids going up or down by one are copied as slices (step 1 or -1, no temporaries:
vLLM hands a request the blocks earlier requests freed in reverse order, so a warm
request's ids usually fall by one); a task with many runs uses one fancy-indexed
copy: ``np.take(..., out=)`` or an indexed assignment, neither with a temporary,
except gathers from a non-contiguous source (HND layers, wrapped strided views), whose
index copy makes a temporary of the task's size (one MiB, not the key's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import KVGeometry

__all__ = ["block_runs", "slice_runs", "block_slice", "gather_chunk", "scatter_chunk",
           "gather_tasks", "scatter_tasks", "gather_run_tasks", "scatter_run_tasks", "run_task"]

# Beyond this many runs, one fancy-indexed copy beats a Python loop of slice copies.
_MAX_SLICE_RUNS = 8

# Task kinds: (kind, dst, src, ids). ids is None for slices.
_SLICE, _TAKE, _GATHER_FANCY, _SCATTER_FANCY = range(4)
Task = tuple[int, np.ndarray, np.ndarray, Any]


def block_runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids as ``(position, first_id, length)``."""
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ids)]))
    return [(int(s), int(ids[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def slice_runs(ids: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Maximal runs of ids going up or down by one, left to right, as ``(position,
    first_id, length, step)`` (``step``: 1 or -1; a lone id: 1). vLLM frees a request's
    blocks tail first (``single_type_kv_cache_manager.free``) and hands them to the next
    request in that order: ids falling by one are as common as rising ones (a warm 8k
    request's were 257 down to 2), and a slice with step -1 copies them as one."""
    n = len(ids)
    if n == 0:
        return []
    steps = np.diff(ids)
    if n == 1 or bool((steps == 1).all()):
        return [(0, int(ids[0]), n, 1)]
    if bool((steps == -1).all()):
        return [(0, int(ids[0]), n, -1)]
    runs: list[tuple[int, int, int, int]] = []
    start, step = 0, 0
    for i, d in enumerate(steps.tolist(), 1):  # d: ids[i] - ids[i - 1]
        if d in (1, -1) and step in (0, d):  # the run goes on
            step = d
            continue
        runs.append((start, int(ids[start]), i - start, step or 1))
        start, step = i, 0
    runs.append((start, int(ids[start]), n - start, step or 1))
    return runs


def block_slice(first: int, n: int, step: int) -> slice:
    """The ``n`` block ids from ``first`` on, going by ``step`` (1 or -1), as a slice."""
    if step == 1:
        return slice(first, first + n)
    return slice(first, first - n if first >= n else None, -1)


def _chunk_view(obj: np.ndarray, layer: int, g: KVGeometry, nblocks: int) -> np.ndarray:
    """One layer of a chunk object, shaped like the blocks it holds (token-major)."""
    view: np.ndarray = obj[layer] if g.kv_planes == 1 else obj[:, layer]
    view = view.view()
    # Assigning .shape (unlike reshape) raises instead of silently copying, so writes
    # through this view always land in the chunk object.
    tokens = (nblocks, g.block_size, g.head_dim) if g.mla else (
        nblocks, g.block_size, g.num_heads, g.head_dim)
    view.shape = tokens if g.kv_planes == 1 else (2, *tokens)
    return view


def _chunk_run_view(objs: np.ndarray, layer: int, g: KVGeometry) -> np.ndarray:
    """One layer of ``m`` chunk objects lying one after another (``objs``: ``[m, *chunk
    object shape]``), shaped like the blocks they hold: ``(m, blocks per chunk,
    block_size, ...)`` after the K/V axis (a view)."""
    view: np.ndarray = objs[:, layer] if g.kv_planes == 1 else objs[:, :, layer].swapaxes(0, 1)
    view = view.view()
    m, per_chunk = objs.shape[0], view.shape[-2] // g.block_size
    tokens = (m, per_chunk, g.block_size, g.head_dim) if g.mla else (
        m, per_chunk, g.block_size, g.num_heads, g.head_dim)
    view.shape = tokens if g.kv_planes == 1 else (2, *tokens)  # raises rather than copies
    return view


def _paged_run_view(layer: np.ndarray, g: KVGeometry, first: int, m: int,
                    per_chunk: int, step: int) -> np.ndarray:
    """The ``m * per_chunk`` blocks from ``first`` on, going by ``step`` (1 or -1), of a
    paged layer, tokens before heads, shaped ``(m, per_chunk, block_size, ...)`` after
    the K/V axis (a view)."""
    src = _paged_view(layer, g)
    blocks = block_slice(first, m * per_chunk, step)
    view = (src[blocks] if g.kv_planes == 1 else src[:, blocks]).view()
    rest = view.shape[2:] if g.kv_planes == 2 else view.shape[1:]
    view.shape = (m, per_chunk, *rest) if g.kv_planes == 1 else (2, m, per_chunk, *rest)
    return view


def gather_run_tasks(layers: Sequence[np.ndarray], first: int, out: np.ndarray,
                     g: KVGeometry, step: int = 1) -> list[Task]:
    """The copies of the blocks from ``first`` on, going by ``step`` (1 or -1), of
    every layer into the chunk objects ``out`` (``[m, *chunk object shape]``, one after
    another): one per layer."""
    m, per_chunk = out.shape[0], out.shape[-2] // g.block_size
    return [(_SLICE, _chunk_run_view(out, li, g),
             _paged_run_view(layer, g, first, m, per_chunk, step), None)
            for li, layer in enumerate(layers)]


def scatter_run_tasks(objs: np.ndarray, layers: Sequence[np.ndarray], first: int,
                      g: KVGeometry, step: int = 1) -> list[Task]:
    """The copies of the chunk objects ``objs`` (``[m, *chunk object shape]``, one after
    another) into the blocks from ``first`` on, going by ``step`` (1 or -1), of every
    layer: one per layer."""
    m, per_chunk = objs.shape[0], objs.shape[-2] // g.block_size
    return [(_SLICE, _paged_run_view(layer, g, first, m, per_chunk, step),
             _chunk_run_view(objs, li, g), None) for li, layer in enumerate(layers)]


def _paged_view(layer: np.ndarray, g: KVGeometry) -> np.ndarray:
    """A paged layer with tokens before heads, matching ``_chunk_view`` (a view)."""
    if g.mla or g.layout == "NHD":
        return layer
    return layer.transpose(0, 2, 1, 3) if g.fused else layer.transpose(0, 1, 3, 2, 4)


def _planes(arr: np.ndarray, g: KVGeometry) -> list[np.ndarray]:
    """The K and V planes (MLA, fused: the one plane), blocks first."""
    return [arr] if g.kv_planes == 1 else [arr[0], arr[1]]


def gather_tasks(layers: Sequence[np.ndarray], ids: np.ndarray, out: np.ndarray,
                 g: KVGeometry) -> list[Task]:
    """The copies of blocks ``ids`` of every layer into the chunk object ``out``."""
    runs = slice_runs(ids)
    tasks: list[Task] = []
    for li, layer in enumerate(layers):
        dst = _chunk_view(out, li, g, len(ids))
        src = _paged_view(layer, g)
        if len(runs) <= _MAX_SLICE_RUNS:
            for pos, first, n, step in runs:
                blocks = block_slice(first, n, step)
                if g.kv_planes == 1:
                    tasks.append((_SLICE, dst[pos : pos + n], src[blocks], None))
                else:
                    tasks.append((_SLICE, dst[:, pos : pos + n], src[:, blocks], None))
        else:
            for d, s in zip(_planes(dst, g), _planes(src, g), strict=True):
                # np.take writes straight into a contiguous out from a contiguous
                # source; otherwise it would copy the whole layer first.
                kind = (_TAKE if s.flags.c_contiguous and d.flags.c_contiguous
                        else _GATHER_FANCY)
                tasks.append((kind, d, s, ids))
    return tasks


def scatter_tasks(obj: np.ndarray, layers: Sequence[np.ndarray], ids: np.ndarray,
                  g: KVGeometry, skip_blocks: int = 0) -> list[Task]:
    """The copies of the chunk object ``obj`` into blocks ``ids`` of every layer,
    leaving the first ``skip_blocks`` target blocks untouched."""
    if skip_blocks >= len(ids):
        return []
    targets = ids[skip_blocks:]
    runs = slice_runs(targets)
    tasks: list[Task] = []
    for li, layer in enumerate(layers):
        src = _chunk_view(obj, li, g, len(ids))
        dst = _paged_view(layer, g)
        src = src[skip_blocks:] if g.kv_planes == 1 else src[:, skip_blocks:]
        if len(runs) <= _MAX_SLICE_RUNS:
            for pos, first, n, step in runs:
                blocks = block_slice(first, n, step)
                if g.kv_planes == 1:
                    tasks.append((_SLICE, dst[blocks], src[pos : pos + n], None))
                else:
                    tasks.append((_SLICE, dst[:, blocks], src[:, pos : pos + n], None))
        else:
            # An indexed assignment writes in place through any strides.
            tasks.extend((_SCATTER_FANCY, d, s, targets)
                         for d, s in zip(_planes(dst, g), _planes(src, g), strict=True))
    return tasks


def run_task(task: Task) -> None:
    """One copy of a plan (releases the GIL for its bytes)."""
    kind, dst, src, ids = task
    if kind == _SLICE:
        np.copyto(dst, src)
    elif kind == _TAKE:
        # mode="clip": ids were checked against the cache, and "raise" buffers out.
        np.take(src, ids, axis=0, out=dst, mode="clip")
    elif kind == _GATHER_FANCY:
        np.copyto(dst, src[ids])
    else:
        dst[ids] = src


def gather_chunk(layers: Sequence[np.ndarray], ids: np.ndarray, out: np.ndarray,
                 g: KVGeometry) -> None:
    """Copy the blocks ``ids`` of every layer into the chunk object ``out``."""
    for t in gather_tasks(layers, ids, out, g):
        run_task(t)


def scatter_chunk(obj: np.ndarray, layers: Sequence[np.ndarray], ids: np.ndarray,
                  g: KVGeometry, skip_blocks: int = 0) -> None:
    """Copy the chunk object ``obj`` into blocks ``ids`` of every layer, leaving the
    first ``skip_blocks`` target blocks untouched."""
    for t in scatter_tasks(obj, layers, ids, g, skip_blocks):
        run_task(t)
