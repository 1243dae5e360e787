"""The plain records a KV cache hands the protocol: one per exported layer tensor.

They sit below both layers that use them: the memory layer (:mod:`lmcache_mp.ipc`)
makes them and the protocol (:mod:`lmcache_mp.protocol`) turns them into a server's
wire format, and neither imports the other. Importing the protocol therefore loads no
cache, no shared-memory code. Data only: no imports from the package.
:mod:`lmcache_mp.ipc.base` re-exports every name, where callers have always found them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["KVLayout", "ShmLayerExport", "CudaLayerExport", "VmmLayerExport", "LayerExport"]

#: The order of the head and token axes of a paged layer: HND ``[2, blocks, heads,
#: block_size, head_dim]`` or NHD ``[2, blocks, block_size, heads, head_dim]`` (fused:
#: the same without the leading 2).
KVLayout = Literal["HND", "NHD"]


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


@dataclass(frozen=True)
class VmmLayerExport:
    """One layer tensor in CUDA VMM memory (``cuMemCreate``), exported with
    ``cuMemExportToShareableHandle`` (see :mod:`lmcache_mp.ipc.cuda.vmm`): the fields of
    LMCache's ``cuda_vmm`` descriptor. The fd of a ``posix_fd`` export is process-local
    and never part of the record; the cache that exported it holds and closes it."""

    export_id: bytes  # 16 bytes
    kind: Literal["posix_fd", "fabric"]
    fabric_blob: bytes | None
    alloc_size: int  # the physical chunk
    alloc_offset: int  # where the layer starts in it
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device_index: int
    device_uuid: str


LayerExport = ShmLayerExport | CudaLayerExport | VmmLayerExport
