"""vLLM's per-layer KV tensors as a lmcache_mp cache, without copying them.

vLLM allocates one tensor per attention layer, ``[2, num_blocks, block_size, heads,
head_dim]`` (NHD, vLLM's default) or ``[2, num_blocks, heads, block_size, head_dim]``
(HND), possibly views into one shared allocation. The engine-driven mode copies
between these and the server's shared-memory pool with numpy, so CPU tensors are used
in place: each layer becomes a numpy view with the HND axis order the copy routines
index (a transpose for NHD: strides only, no copy).

Written here because ``CpuKVCache.wrap`` (the performance work) had not landed when
this connector was; only the engine-driven mode can use a wrapped cache (the server
cannot map memory that is not a shared-memory segment or a CUDA allocation).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import InvalidArgument
from ...ipc.base import KVGeometry, LayerExport
from ...ipc.cpu_cache import CpuKVCache

__all__ = ["WrappedKVCache", "wrap_layers"]

_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


class WrappedKVCache(CpuKVCache):
    """Existing CPU arrays as a :class:`CpuKVCache` for the engine-driven mode."""

    def __init__(self, geometry: KVGeometry, layers: list[np.ndarray]) -> None:
        self.geometry = geometry
        self._segments = []
        self.layers = layers
        self._torch_layers = None
        self._finalizer = weakref.finalize(self, _nothing, [])

    def export_layers(self) -> list[LayerExport]:
        raise InvalidArgument(
            "vLLM's own KV tensors are not shared memory the server can map: use "
            "lmcache.mp.mp_transfer_mode 'auto' or 'engine_driven' for CPU KV caches")


def _nothing(segments: Sequence[Any]) -> None:
    return None


def wrap_layers(tensors: Sequence[Any], layout: str = "NHD") -> WrappedKVCache:
    """Wrap vLLM's per-layer torch tensors (CPU, 5-D, one geometry) in place."""
    if not tensors:
        raise InvalidArgument("no KV cache layers to register")
    if layout not in ("NHD", "HND"):
        raise InvalidArgument(f"KV cache layout must be NHD or HND, got {layout!r}")
    first = tensors[0]
    dtype = str(first.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise InvalidArgument(f"KV cache dtype {first.dtype} is not supported "
                              f"(float16, bfloat16, float32)")
    shape = tuple(first.shape)
    if len(shape) != 5 or shape[0] != 2:
        raise InvalidArgument(
            f"expected per-layer KV tensors [2, num_blocks, ...] (5-D), got {shape}: MLA "
            f"and other attention layouts are not supported yet")
    layers: list[np.ndarray] = []
    for t in tensors:
        if tuple(t.shape) != shape or t.dtype != first.dtype:
            raise InvalidArgument("every KV cache layer must have the same shape and dtype "
                                  "(hybrid KV-cache groups are not supported yet)")
        if t.device.type != "cpu":
            raise InvalidArgument(
                f"KV tensors on {t.device} are not supported by this connector yet "
                f"(CPU tensors only; CUDA needs the exporter path, see docs/vllm.md)")
        import torch

        raw = t.view(torch.uint16) if t.dtype == torch.bfloat16 else t
        arr = raw.numpy()  # shares memory, keeps the strides
        layers.append(arr.transpose(0, 1, 3, 2, 4) if layout == "NHD" else arr)
    _, nb, a, b, d = shape
    heads, block = (b, a) if layout == "NHD" else (a, b)
    geometry = KVGeometry(len(tensors), nb, block, heads, d, dtype, False)
    return WrappedKVCache(geometry, layers)
