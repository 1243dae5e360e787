"""What the client needs from a KV cache it registers, whatever memory backs it.

The memory layer never imports :mod:`lmcache_mp.protocol`: a cache describes each
layer tensor with a plain *export record* (:class:`ShmLayerExport`,
:class:`CudaLayerExport`), and the server's protocol profile turns those records into
its wire format (pickled wrappers or descriptors). :class:`~lmcache_mp.ipc.cpu_cache.
CpuKVCache` (POSIX SHM) and the CUDA cache (:mod:`lmcache_mp.ipc.cuda`, imported only
when used) both implement :class:`ExportableKVCache`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "STORAGE_DTYPES",
    "KVGeometry",
    "KVLayout",
    "ShmLayerExport",
    "CudaLayerExport",
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

#: The order of the head and token axes of a paged layer: HND ``[2, blocks, heads,
#: block_size, head_dim]`` or NHD ``[2, blocks, block_size, heads, head_dim]``.
KVLayout = Literal["HND", "NHD"]


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

    @property
    def layer_shape(self) -> tuple[int, ...]:
        if self.mla:
            return (self.num_blocks, self.block_size, self.head_dim)
        if self.layout == "NHD":
            return (2, self.num_blocks, self.block_size, self.num_heads, self.head_dim)
        return (2, self.num_blocks, self.num_heads, self.block_size, self.head_dim)

    @property
    def itemsize(self) -> int:
        return int(STORAGE_DTYPES[self.dtype][1])

    @property
    def layer_nbytes(self) -> int:
        return math.prod(self.layer_shape) * self.itemsize

    @property
    def layer_strides(self) -> tuple[int, ...]:
        """Contiguous strides in elements, as torch reports them."""
        strides, acc = [], 1
        for d in reversed(self.layer_shape):
            strides.append(acc)
            acc *= d
        return tuple(reversed(strides))

    @property
    def hidden_dim(self) -> int:
        """Elements per token per plane: ``num_heads * head_dim`` (MLA: ``head_dim``)."""
        return self.head_dim if self.mla else self.num_heads * self.head_dim

    @property
    def kv_planes(self) -> int:
        return 1 if self.mla else 2


@dataclass(frozen=True)
class ShmLayerExport:
    """One layer tensor in a POSIX shared-memory segment (offset 0, contiguous)."""

    shm_name: str  # with the leading slash, as shm_open takes it
    nbytes: int
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements


@dataclass(frozen=True)
class CudaLayerExport:
    """One layer tensor in GPU memory, exported with ``cudaIpcGetMemHandle``.

    ``ipc_handle`` names the whole allocation (it maps at its base); the tensor starts
    ``alloc_offset`` bytes into it. ``form`` is the wrapper the caller asked for
    (``"raw"``: LMCache's RawCudaIPCWrapper / ``cuda_raw`` descriptor; ``"torch_ipc"``:
    LMCache's CudaIPCWrapper / ``cuda`` descriptor, torch's storage-sharing tuple;
    ``"auto"``: the profile's default); the profile refuses a form its servers cannot
    open.
    """

    ipc_handle: bytes
    nbytes: int
    alloc_offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device_index: int
    device_uuid: str  # torch form: lower-case 8-4-4-4-12 hex
    form: Literal["auto", "raw", "torch_ipc"] = "auto"


LayerExport = ShmLayerExport | CudaLayerExport


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
        """The layout of the 5-D layers (None for MLA, which has no head axis)."""
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
