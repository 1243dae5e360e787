"""Caller-owned host arrays as paged KV layers, without copying them.

:meth:`CpuKVCache.wrap <lmcache_mp.ipc.cpu_cache.CpuKVCache.wrap>` takes an engine's own
per-layer CPU tensors (numpy arrays or torch tensors, possibly strided views into one
allocation) and this module turns them into numpy views of the same memory, typed by
their storage dtype, plus the :class:`KVGeometry` they describe. Nothing here copies:
engine-driven transfers read and write the caller's memory directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..checks import one_of, positive_int
from ..errors import InvalidArgument
from .base import STORAGE_DTYPES, KVGeometry, KVLayout

__all__ = ["host_layers"]

# Integer torch dtypes of each width: bfloat16 / float8 tensors have no numpy
# equivalent, so they are reinterpreted bit for bit before .numpy().
_TORCH_INT_BY_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _is_torch_tensor(obj: object) -> bool:
    # Without importing torch: a caller that passes tensors has imported it already.
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def _from_torch(t: Any, dtype: str | None, index: int) -> tuple[np.ndarray, str]:
    import torch

    if t.device.type != "cpu":
        raise InvalidArgument(
            f"layer {index} is on {t.device}: CpuKVCache.wrap takes host tensors; register "
            f"GPU memory with lmcache_mp.ipc.cuda.CudaKVCache.from_torch")
    name = str(t.dtype).removeprefix("torch.")
    if name not in STORAGE_DTYPES:
        raise InvalidArgument(f"layer {index} has dtype {t.dtype}, which the server does not "
                              f"store; use one of {', '.join(STORAGE_DTYPES)}")
    if dtype is not None and dtype != name:
        raise InvalidArgument(f"layer {index} is {name}, but dtype={dtype!r} was passed")
    as_int = t.detach().view(getattr(torch, _TORCH_INT_BY_SIZE[t.element_size()]))
    return as_int.numpy().view(STORAGE_DTYPES[name][0]), name


def _from_numpy(a: np.ndarray, dtype: str | None, index: int) -> tuple[np.ndarray, str]:
    name = dtype if dtype is not None else a.dtype.name
    if name not in STORAGE_DTYPES:
        hint = " (bfloat16 bits? pass dtype='bfloat16')" if a.dtype == np.uint16 else ""
        raise InvalidArgument(
            f"layer {index} has numpy dtype {a.dtype}{hint}: pass dtype= one of "
            f"{', '.join(STORAGE_DTYPES)} with the same item size")
    storage, itemsize = STORAGE_DTYPES[name]
    if a.dtype.itemsize != itemsize:
        raise InvalidArgument(f"layer {index} has {a.dtype.itemsize}-byte items, but {name} "
                              f"has {itemsize}")
    if not a.flags.writeable:
        raise InvalidArgument(f"layer {index} is read-only: retrieves write into the layers")
    return a.view(storage), name


def host_layers(
    layers: Sequence[Any], layout: KVLayout, block_size: int | None, dtype: str | None,
    fused: bool = False,
) -> tuple[KVGeometry, list[np.ndarray], list[Any] | None]:
    """The geometry of ``layers``, numpy views of them (storage dtype, same memory), and
    the torch tensors as given when they were tensors (else None)."""
    one_of("layout", layout, ("HND", "NHD"))
    if block_size is not None:
        positive_int("block_size", block_size)
    if dtype is not None and dtype not in STORAGE_DTYPES:
        raise InvalidArgument(f"dtype {dtype!r} is not supported; use one of "
                              f"{', '.join(STORAGE_DTYPES)}")
    if isinstance(layers, (np.ndarray, str, bytes)) or _is_torch_tensor(layers) or not (
            isinstance(layers, Sequence) and len(layers) > 0):
        raise InvalidArgument("layers must be a non-empty list with one array per layer "
                              "(to wrap one stacked array, pass list(stacked))")
    tensors = [_is_torch_tensor(t) for t in layers]
    if any(tensors) and not all(tensors):
        raise InvalidArgument("layers mixes torch tensors and numpy arrays: pass one kind")
    views: list[np.ndarray] = []
    names: set[str] = set()
    for i, layer in enumerate(layers):
        if tensors[i]:
            view, name = _from_torch(layer, dtype, i)
        elif isinstance(layer, np.ndarray):
            view, name = _from_numpy(layer, dtype, i)
        else:
            raise InvalidArgument(f"layer {i} is a {type(layer).__name__}: pass numpy arrays "
                                  f"or torch tensors")
        views.append(view)
        names.add(name)
    shapes = {v.shape for v in views}
    if len(shapes) != 1 or len(names) != 1:
        raise InvalidArgument(f"all layers must have one shape and dtype, got shapes "
                              f"{sorted(shapes)} and dtypes {sorted(names)}")
    shape, name = shapes.pop(), names.pop()
    geometry = _geometry(shape, layout, name, len(views), fused)
    if block_size is not None and block_size != geometry.block_size:
        lead = "" if fused else "2, "
        raise InvalidArgument(
            f"layers shaped {shape} read as {layout} have {geometry.block_size} tokens per "
            f"block, not block_size={block_size}: is the layout right? HND is [{lead}"
            f"blocks, heads, block_size, head_dim], NHD [{lead}blocks, block_size, heads, "
            f"head_dim]")
    return geometry, views, list(layers) if all(tensors) else None


def _geometry(shape: tuple[int, ...], layout: KVLayout, dtype: str,
              num_layers: int, fused: bool) -> KVGeometry:
    if any(d <= 0 for d in shape):
        raise InvalidArgument(f"layers shaped {shape} are empty")
    if fused:
        if len(shape) != 4:
            raise InvalidArgument(
                f"fused K/V layers shaped {shape}: expected 4-D [num_blocks, heads, "
                f"block_size, 2 * head_size] (HND) or [num_blocks, block_size, heads, "
                f"2 * head_size] (NHD)")
        nb, a, b, row = shape
        heads, bs = (a, b) if layout == "HND" else (b, a)
        return KVGeometry(num_layers, nb, bs, heads, row, dtype, False, layout, True)
    if len(shape) == 3:  # MLA: [num_blocks, block_size, head_dim], no head axis to order
        return KVGeometry(num_layers, shape[0], shape[1], 1, shape[2], dtype, True)
    if len(shape) != 5 or shape[0] != 2:
        raise InvalidArgument(
            f"layers shaped {shape}: expected [2, num_blocks, ...] (K and V, then blocks; "
            f"for a [num_blocks, 2, ...] tensor pass t.transpose(0, 1), a view) or a 3-D "
            f"MLA layer [num_blocks, block_size, head_dim]")
    _, nb, a, b, hd = shape
    heads, bs = (a, b) if layout == "HND" else (b, a)
    return KVGeometry(num_layers, nb, bs, heads, hd, dtype, False, layout)
