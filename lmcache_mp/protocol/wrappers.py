"""KV-cache export records -> the wrapper each server family maps, in its wire format.

REGISTER_KV_CACHE carries one serialised wrapper per layer tensor (msgpack ext type 1).
What that wrapper is differs by family and by memory kind:

==========  ==========================  =============================================
family      CPU SHM layer               CUDA layer (``form``; the default first)
==========  ==========================  =============================================
0.5.3/0.5.4 pickled CpuShmTensorWrapper  ``torch_ipc``: pickled CudaIPCWrapper;
                                        ``raw``: pickled 0.5.3 RawCudaIPCWrapper
0.5.5       same pickle                 ``raw``: 0.5.5 RawCudaIPCWrapper pickle;
                                        ``torch_ipc``: pickled CudaIPCWrapper
0.5.6,      ``cpu_shm`` descriptor      ``raw``: ``cuda_raw`` descriptor;
0.5.7                                   ``torch_ipc``: ``cuda`` descriptor;
                                        VMM memory: ``cuda_vmm`` descriptor (fabric)
==========  ==========================  =============================================

VMM memory (:mod:`lmcache_mp.ipc.cuda.vmm`) has no legacy handle: only the descriptor
families open it, and only as a fabric handle. A ``posix_fd`` export needs the fd
handed to the server out of band, which no release up to 0.5.7rc2 can receive (its
``set_vmm_fd_resolver`` is never installed: the fd transport is not in the package), so
it is refused here rather than left to fail on the server.

``torch_ipc`` is torch's ``UntypedStorage._share_cuda_()`` 8-tuple built without
torch; the server opens it with ``torch.UntypedStorage._new_shared_cuda`` (torch only,
mapping closed with the storage). ``raw`` is the bare 64-byte memory handle, opened
with cuda-bindings and cupy. A cache asking for ``"auto"`` gets the family's
:attr:`WrapperFormats.default_cuda_form`: 0.5.3's ``raw`` cannot work against a stock
server with cuda-bindings >= 13.4 (its ``to_tensor`` assigns
``cudaIpcMemHandle_t.reserved``, which 13.4 removed) and never unmaps, so there it is
``torch_ipc``; 0.5.5+ open ``raw`` with 13.4 and unmap it, so there it stays ``raw``.

The memory layer hands plain records (:mod:`lmcache_mp.layer_exports`); only this module
knows the wire forms, and :class:`WrapperFormats` refuses a form a family cannot open.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from ..errors import InvalidArgument, ProtocolMismatch
from ..layer_exports import CudaLayerExport, LayerExport, ShmLayerExport, VmmLayerExport
from .types import WrapperBlob

__all__ = [
    "WrapperFormats",
    "PICKLE_V053",
    "PICKLE_V055",
    "DESCRIPTOR_V056",
    "cpu_shm_descriptor",
    "cuda_raw_descriptor",
    "cuda_torch_descriptor",
    "vmm_descriptor",
    "torch_storage_handle",
]

IPC_HANDLE_SIZE = 64

# The torch_ipc form names a ref-counter file that torch only opens, best effort, when
# the server frees its view; a name that cannot exist makes that a silent no-op (a real
# file of another process would have its counter decremented).
_NO_REFCOUNTER = b"/lmcache_mp_no_refcounter_file"


# ------------------------------------------------------------ pickled wrappers
def pickle_cpu_shm(rec: ShmLayerExport) -> WrapperBlob:
    """0.5.3-0.5.5: a pickled ``CpuShmTensorWrapper``, emitted from its template."""
    from .pickles.emitter import emit_cpu_shm_wrapper

    return WrapperBlob(emit_cpu_shm_wrapper(
        shm_name=rec.shm_name, nbytes=rec.nbytes, dtype=rec.dtype, shape=rec.shape,
        stride=rec.stride))


def _base_only(rec: CudaLayerExport, what: str) -> None:
    if rec.alloc_offset:
        raise InvalidArgument(
            f"{what} carries no offset, but this layer starts {rec.alloc_offset} bytes into "
            f"its CUDA allocation: the server would map the allocation's base. Allocate "
            f"with CudaKVCache.allocate (one cudaMalloc per layer) or use wrapper='torch_ipc'")


def pickle_raw_cuda_v053(rec: CudaLayerExport) -> WrapperBlob:
    """A pickled 0.5.3 ``RawCudaIPCWrapper``: the bare 64-byte handle of an allocation
    base, no offset (the server needs cupy to open it)."""
    from .pickles.emitter import emit_raw_cuda_wrapper

    _base_only(rec, "LMCache 0.5.3's RawCudaIPCWrapper")
    return WrapperBlob(emit_raw_cuda_wrapper(
        ipc_handle=rec.ipc_handle, nbytes=rec.nbytes, dtype=rec.dtype, shape=rec.shape,
        stride=rec.stride, device_uuid=rec.device_uuid))


def pickle_raw_cuda_v055(rec: CudaLayerExport) -> WrapperBlob:
    """A pickled 0.5.5 ``RawCudaIPCWrapper`` (gains ``_alloc_offset`` and ``_opens``)."""
    from .pickles.emitter import emit

    return WrapperBlob(emit("v0_5_5_raw_cuda", {
        "_ipc_handle_reserved": rec.ipc_handle, "_alloc_offset": rec.alloc_offset,
        "_nbytes": rec.nbytes, "dtype": rec.dtype, "shape": rec.shape, "stride": rec.stride,
        "storage_offset": 0, "_opens": 0, "device_uuid": rec.device_uuid,
    }))


TorchStorageHandle = tuple[int, bytes, int, int, bytes, int, bytes, bool]


def torch_storage_handle(rec: CudaLayerExport) -> TorchStorageHandle:
    """torch's ``_share_cuda_()`` 8-tuple for ``rec``, built without torch: device,
    the bare 64-byte memory handle (torch >= 2.5 reads a 64-byte handle as a plain
    cudaMalloc share; longer ones are its versioned form), storage bytes, byte offset
    inside the allocation, ref-counter file, ref-counter offset, producer event handle,
    event_sync_required. Ordering is done per transfer with our own events, so no
    producer event (and the server never opens the zero event handle)."""
    return (rec.device_index, rec.ipc_handle, rec.nbytes, rec.alloc_offset,
            _NO_REFCOUNTER, 0, bytes(IPC_HANDLE_SIZE), False)


def pickle_torch_ipc(rec: CudaLayerExport) -> WrapperBlob:
    """A pickled ``CudaIPCWrapper``: the same class path and ``__dict__`` in 0.5.3,
    0.5.4 and 0.5.5 (``platform/cuda/ipc_wrapper.py``), so one template serves all."""
    from .pickles.emitter import emit_cuda_ipc_wrapper

    return WrapperBlob(emit_cuda_ipc_wrapper(
        handle=torch_storage_handle(rec), dtype=rec.dtype, shape=rec.shape,
        stride=rec.stride, device_uuid=rec.device_uuid))


# --------------------------------------------------- 0.5.6 msgpack descriptors
# Mirrors of lmcache 0.5.6 ipc_wire.py, same options, so msgspec writes the same
# bytes (the tag, then kw_only base fields after the subclass's own fields).
class _TensorMetadata(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device_uuid: str


class _IPCData(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    version: Literal[1]
    metadata: _TensorMetadata


class _CpuShmIPCData(_IPCData, tag="cpu_shm"):
    shm_name: str
    nbytes: int


class _RawCudaIPCData(_IPCData, tag="cuda_raw"):
    ipc_handle: bytes
    alloc_offset: int
    nbytes: int


class _CudaIPCData(_IPCData, tag="cuda"):
    # ipc_wire.py types the items as (int, bytes|None, int, int, bytes|None, int,
    # bytes|None, bool); we always send bytes.
    handle: tuple[int, bytes, int, int, bytes, int, bytes, bool]


class _VmmCudaIPCData(_IPCData, tag="cuda_vmm"):
    export_id: bytes
    kind: Literal["posix_fd", "fabric"]
    fabric_blob: bytes | None
    alloc_size: int
    alloc_offset: int
    nbytes: int


def _metadata(dtype: str, shape: Sequence[int], stride: Sequence[int],
              device_uuid: str) -> _TensorMetadata:
    from .pickles.emitter import TORCH_DTYPES

    if dtype not in TORCH_DTYPES:
        raise InvalidArgument(f"unsupported dtype {dtype!r}")
    return _TensorMetadata(dtype=dtype, shape=tuple(shape), stride=tuple(stride),
                           storage_offset=0, device_uuid=device_uuid)


def cpu_shm_descriptor(
    shm_name: str, nbytes: int, dtype: str, shape: Sequence[int], stride: Sequence[int]
) -> bytes:
    return msgspec.msgpack.encode(_CpuShmIPCData(
        version=1, metadata=_metadata(dtype, shape, stride, "cpu"), shm_name=shm_name,
        nbytes=nbytes))


def cuda_raw_descriptor(
    ipc_handle: bytes, nbytes: int, dtype: str, shape: Sequence[int],
    stride: Sequence[int], device_uuid: str, alloc_offset: int = 0,
) -> bytes:
    if len(ipc_handle) != IPC_HANDLE_SIZE:
        raise InvalidArgument("a cudaIpcMemHandle_t is exactly 64 bytes")
    return msgspec.msgpack.encode(_RawCudaIPCData(
        version=1, metadata=_metadata(dtype, shape, stride, device_uuid),
        ipc_handle=ipc_handle, alloc_offset=alloc_offset, nbytes=nbytes))


def cuda_torch_descriptor(rec: CudaLayerExport) -> bytes:
    """0.5.6's ``cuda`` descriptor (``CudaIPCData``): torch's storage-sharing 8-tuple
    and the view's metadata (``storage_offset`` 0: the tuple's byte offset places the
    storage, and the view starts at the storage)."""
    if len(rec.ipc_handle) != IPC_HANDLE_SIZE:
        raise InvalidArgument("a cudaIpcMemHandle_t is exactly 64 bytes")
    return msgspec.msgpack.encode(_CudaIPCData(
        version=1, metadata=_metadata(rec.dtype, rec.shape, rec.stride, rec.device_uuid),
        handle=torch_storage_handle(rec)))


def vmm_descriptor(rec: VmmLayerExport) -> bytes:
    """0.5.6+'s ``cuda_vmm`` descriptor (``VmmCudaIPCData``): the export id, kind and
    fabric blob, the physical chunk's size and the view's place in it; never the fd."""
    if len(rec.export_id) != 16:
        raise InvalidArgument("a VMM export id is exactly 16 bytes")
    if (rec.kind == "fabric") != (rec.fabric_blob is not None):
        raise InvalidArgument("a fabric blob goes with kind 'fabric' only")
    if rec.alloc_offset + rec.nbytes > rec.alloc_size:
        raise InvalidArgument("the VMM view runs past its chunk")
    return msgspec.msgpack.encode(_VmmCudaIPCData(
        version=1, metadata=_metadata(rec.dtype, rec.shape, rec.stride, rec.device_uuid),
        export_id=rec.export_id, kind=rec.kind, fabric_blob=rec.fabric_blob,
        alloc_size=rec.alloc_size, alloc_offset=rec.alloc_offset, nbytes=rec.nbytes))


def descriptor_cpu_shm(rec: ShmLayerExport) -> WrapperBlob:
    return WrapperBlob(cpu_shm_descriptor(rec.shm_name, rec.nbytes, rec.dtype, rec.shape,
                                          rec.stride))


def descriptor_cuda_raw(rec: CudaLayerExport) -> WrapperBlob:
    return WrapperBlob(cuda_raw_descriptor(rec.ipc_handle, rec.nbytes, rec.dtype, rec.shape,
                                           rec.stride, rec.device_uuid, rec.alloc_offset))


def descriptor_cuda_torch(rec: CudaLayerExport) -> WrapperBlob:
    return WrapperBlob(cuda_torch_descriptor(rec))


# ----------------------------------------------------------------- per family
CudaEncoder = Callable[[CudaLayerExport], WrapperBlob]


@dataclass(frozen=True)
class WrapperFormats:
    """How one family serialises each kind of layer export."""

    name: str  # "pickle (protocol 4)" or "msgpack descriptor", for the compat table
    cpu_shm: Callable[[ShmLayerExport], WrapperBlob]
    cuda: Mapping[str, CudaEncoder]  # form -> encoder, the default first
    default_cuda_form: str  # what a cache asking for "auto" gets
    # form -> what the server needs to open it (lmcache-mp doctor prints these)
    cuda_notes: Mapping[str, str] = field(default_factory=dict)
    # VMM exports (None: the family cannot open VMM memory), and the kinds it receives
    vmm: Callable[[VmmLayerExport], bytes] | None = None
    vmm_kinds: tuple[str, ...] = ()

    def encode_vmm(self, rec: VmmLayerExport, family: str) -> WrapperBlob:
        if self.vmm is None:
            raise ProtocolMismatch(
                f"LMCache {family} servers cannot open CUDA VMM memory (cuMemCreate: "
                f"expandable segments, cumem allocators); the cuda_vmm descriptor arrived "
                f"in 0.5.6. Upgrade the server, or allocate the KV cache without VMM "
                f"(CudaKVCache.allocate, or PYTORCH_CUDA_ALLOC_CONF without "
                f"expandable_segments)")
        if rec.kind not in self.vmm_kinds:
            raise ProtocolMismatch(
                f"this VMM allocation can only be exported as a POSIX file descriptor, and "
                f"LMCache {family} servers cannot receive one: their cuda_vmm receiver asks "
                f"set_vmm_fd_resolver() for the fd, which nothing in the release installs "
                f"(no fd-passing socket ships with it), so the server could not map the "
                f"layer. Create the memory fabric-exportable (CU_MEM_HANDLE_TYPE_FABRIC, "
                f"with an IMEX channel), or without VMM (CudaKVCache.allocate, or "
                f"PYTORCH_CUDA_ALLOC_CONF without expandable_segments)")
        return WrapperBlob(self.vmm(rec))

    def resolve_form(self, form: str, family: str) -> str:
        """The form ``form`` stands for ("auto": the default); ProtocolMismatch if this
        family cannot open it."""
        resolved = self.default_cuda_form if form == "auto" else form
        if resolved not in self.cuda:
            raise ProtocolMismatch(
                f"LMCache {family} servers cannot open a {form!r} CUDA wrapper; they take "
                f"{', '.join(repr(f) for f in self.cuda)}: allocate the cache with "
                f"wrapper='auto' (here {self.default_cuda_form!r})")
        return resolved

    def encode(self, exports: Sequence[LayerExport], family: str) -> list[WrapperBlob]:
        if not exports:
            raise InvalidArgument("a KV cache needs at least one layer to register")
        out: list[WrapperBlob] = []
        for rec in exports:
            if isinstance(rec, ShmLayerExport):
                out.append(self.cpu_shm(rec))
            elif isinstance(rec, CudaLayerExport):
                out.append(self.cuda[self.resolve_form(rec.form, family)](rec))
            elif isinstance(rec, VmmLayerExport):
                out.append(self.encode_vmm(rec, family))
            else:
                raise InvalidArgument(f"unknown layer export {type(rec).__name__}")
        return out


_TORCH_IPC_NOTE = ("torch's CUDA storage sharing (the server opens it with torch alone and "
                   "unmaps it with the storage)")
_RAW_NOTE = "the bare memory handle (the server opens it with cuda-bindings and cupy"

PICKLE_V053 = WrapperFormats(
    "pickle (protocol 4)", pickle_cpu_shm,
    {"torch_ipc": pickle_torch_ipc, "raw": pickle_raw_cuda_v053}, "torch_ipc",
    {"torch_ipc": _TORCH_IPC_NOTE,
     "raw": _RAW_NOTE + "; 0.5.3 needs cuda-bindings <= 13.3 on the server, never unmaps, "
            "and each layer must start at its allocation's base)"})
PICKLE_V055 = WrapperFormats(
    "pickle (protocol 4)", pickle_cpu_shm,
    {"raw": pickle_raw_cuda_v055, "torch_ipc": pickle_torch_ipc}, "raw",
    {"raw": _RAW_NOTE + "; carries the offset, unmapped on close)",
     "torch_ipc": _TORCH_IPC_NOTE})
DESCRIPTOR_V056 = WrapperFormats(
    "msgpack descriptor", descriptor_cpu_shm,
    {"raw": descriptor_cuda_raw, "torch_ipc": descriptor_cuda_torch}, "raw",
    {"raw": "`cuda_raw` descriptor: " + _RAW_NOTE + "; carries the offset)",
     "torch_ipc": "`cuda` descriptor: " + _TORCH_IPC_NOTE},
    vmm=vmm_descriptor, vmm_kinds=("fabric",))
