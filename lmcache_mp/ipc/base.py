"""What the client needs from a KV cache it registers, whatever memory backs it.

The memory layer never imports :mod:`lmcache_mp.protocol`: a cache describes each
layer tensor with a plain *export record* (:class:`ShmLayerExport`,
:class:`CudaLayerExport`, :class:`VmmLayerExport`, defined in
:mod:`lmcache_mp.layer_exports` and re-exported here), and the server's protocol
profile turns those records into its wire format (pickled wrappers or descriptors).
:class:`~lmcache_mp.ipc.cpu_cache.CpuKVCache` (POSIX SHM) and the CUDA cache
(:mod:`lmcache_mp.ipc.cuda`, imported only when used) both implement
:class:`ExportableKVCache`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# The records live below both layers, so that the protocol can read them without
# importing the memory layer; they are part of this module's interface all the same.
from ..layer_exports import CudaLayerExport, KVLayout, LayerExport, ShmLayerExport, VmmLayerExport

__all__ = [
    "STORAGE_DTYPES",
    "KVGeometry",
    "KVLayout",
    "ShmLayerExport",
    "CudaLayerExport",
    "VmmLayerExport",
    "LayerExport",
    "ExportableKVCache",
]

# torch dtype name -> (numpy dtype name that holds the same bytes, itemsize). numpy has
# no bfloat16 or float8: their layers are exposed as raw unsigned ints of the same width
# (use .torch_layers for typed access). Names, not numpy types: importing this module
# must not import numpy (import lmcache_mp stays light).
STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "float16": ("float16", 2),
    "bfloat16": ("uint16", 2),
    "float32": ("float32", 4),
    "float64": ("float64", 8),
    "float8_e4m3fn": ("uint8", 1),
    "float8_e5m2": ("uint8", 1),
    "int8": ("int8", 1),
    "uint8": ("uint8", 1),
    "int16": ("int16", 2),
    "int32": ("int32", 4),
}

@dataclass(frozen=True)
class KVGeometry:
    """The shape of a paged KV cache, as the server will see it."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: str
    mla: bool
    #: Axis order of the 5-D layers (ignored for MLA). Last, with a default, so the
    #: seven-field positional form keeps meaning HND.
    layout: KVLayout = "HND"
    #: vLLM 0.32+'s fused K/V layers: ONE plane per layer, ``[num_blocks, num_heads,
    #: block_size, head_dim]`` (HND; NHD ``[num_blocks, block_size, num_heads,
    #: head_dim]``) where ``head_dim`` is the packed ``2 * head_size`` row, copied as
    #: it is. The server's objects are then ``[layers, chunk, num_heads * head_dim]``,
    #: as LMCache's own connector stores vLLM's fused layers (registered as one plane).
    fused: bool = False
    #: Elements from one block of a layer to the next, where that is not the block's
    #: own size (0: dense layers). Fused layers only: vLLM's blocks-first layouts
    #: (``BLHNC`` / ``BLNHC``) interleave every layer's block inside one page. Only
    #: CUDA caches, which describe memory by pointers, use it (numpy views carry
    #: their strides).
    block_stride: int = 0

    @property
    def block_elems(self) -> int:
        """Elements of one block of one layer (both planes)."""
        return self.kv_planes * self.block_size * self.num_heads * self.head_dim

    @property
    def block_step(self) -> int:
        """Elements from one block of a layer to the next (fused layers: first axis)."""
        return self.block_stride or (self.block_size * self.num_heads * self.head_dim)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        if self.mla:
            return (self.num_blocks, self.block_size, self.head_dim)
        if self.fused:
            return ((self.num_blocks, self.block_size, self.num_heads, self.head_dim)
                    if self.layout == "NHD" else
                    (self.num_blocks, self.num_heads, self.block_size, self.head_dim))
        if self.layout == "NHD":
            return (2, self.num_blocks, self.block_size, self.num_heads, self.head_dim)
        return (2, self.num_blocks, self.num_heads, self.block_size, self.head_dim)

    @property
    def itemsize(self) -> int:
        return int(STORAGE_DTYPES[self.dtype][1])

    @property
    def layer_nbytes(self) -> int:
        """Bytes a layer spans (a blocks-first layer: from its first block to the end
        of its last)."""
        if self.block_stride:
            return ((self.num_blocks - 1) * self.block_stride + self.block_elems) \
                * self.itemsize
        return math.prod(self.layer_shape) * self.itemsize

    @property
    def layer_strides(self) -> tuple[int, ...]:
        """Strides in elements, as torch reports them: contiguous, but for the block
        axis of a blocks-first layer."""
        strides, acc = [], 1
        for d in reversed(self.layer_shape):
            strides.append(acc)
            acc *= d
        if self.block_stride:
            strides[-1] = self.block_stride
        return tuple(reversed(strides))

    @property
    def hidden_dim(self) -> int:
        """Elements per token per plane: ``num_heads * head_dim`` (MLA: ``head_dim``)."""
        return self.head_dim if self.mla else self.num_heads * self.head_dim

    @property
    def kv_planes(self) -> int:
        """Planes of the server's objects: 2 (K, V), or 1 (MLA's latent, fused rows)."""
        return 1 if self.mla or self.fused else 2


@runtime_checkable
class ExportableKVCache(Protocol):
    """A paged KV cache the server can map (one export record per layer tensor)."""

    geometry: KVGeometry

    @property
    def closed(self) -> bool: ...

    @property
    def unlinked(self) -> bool:
        """True once the cache can no longer be registered (e.g. SHM names removed)."""
        ...

    @property
    def kv_layout(self) -> KVLayout | None:
        """The layout of the 5-D (or fused 4-D) layers (None for MLA, which has no
        head axis)."""
        ...

    def export_layers(self) -> list[LayerExport]:
        """One export record per layer, in layer order."""
        ...

    def begin_transfer(self, stream: Any) -> tuple[bytes, Any]:
        """Before a STORE / RETRIEVE: the event handle to send (b"" on CPU) and a token
        to keep alive until the reply (e.g. the CUDA event object)."""
        ...

    def end_transfer(self, server_event: bytes, stream: Any, token: Any) -> None:
        """After the reply: order the caller's ``stream`` after the server's copy (CUDA:
        wait on the server's event handle); a no-op on CPU, where copies are synchronous."""
        ...

    def unlink(self) -> None:
        """Called on unregister: stop other processes from mapping the memory anew."""
        ...
