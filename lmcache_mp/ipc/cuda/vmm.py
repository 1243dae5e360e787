"""Exporting CUDA virtual-memory (VMM) allocations, which legacy CUDA IPC cannot share.

Memory from ``cuMemCreate`` / ``cuMemMap`` (PyTorch's ``expandable_segments:True``,
vLLM's cumem allocator and sleep mode) has no ``cudaIpcMemHandle_t``:
``cudaIpcGetMemHandle`` fails with ``cudaErrorInvalidValue``. VMM has its own IPC: the
physical chunk is exported with ``cuMemExportToShareableHandle`` in a form fixed when
it was created (``requestedHandleTypes``), and the receiver imports and maps it.

This mirrors LMCache's ``VmmCudaIPCWrapper.__init__`` (0.5.6 and 0.5.7rc2,
``platform/devices/cuda/ipc_wrapper.py``) step by step, so its server reads our
``cuda_vmm`` descriptor (:func:`lmcache_mp.protocol.wrappers.vmm_descriptor`) exactly as
its own: retain the allocation handle from the pointer, export it (a POSIX fd when
the chunk allows one, else the 64-byte fabric handle), find the physical chunk with
``cuMemGetAddressRange`` (the view must fit in that one chunk: the server maps one
handle), drop the retained reference. A fresh 16-byte export id names the export.
A view over several chunks (vLLM 0.34's extensible cache maps one per commit, PyTorch's
expandable segments one per page) cannot be exported so; it stays usable for
engine-driven transfers (:func:`~.export.mapped_range`).

The two kinds travel differently. A fabric handle rides inside the descriptor (both
processes need IMEX channel access). A POSIX fd means nothing outside this process:
LMCache's receiver asks a resolver, installed with ``set_vmm_fd_resolver``, for the fd
of an export id, "delivered out of band (SCM_RIGHTS)". No LMCache release up to
0.5.7rc2 installs one: the server has no fd-passing socket (nothing in the package
calls ``set_vmm_fd_resolver`` or ``fd_payload``), so it cannot open a ``posix_fd``
descriptor, and the profiles refuse to send one (see :mod:`..protocol.wrappers`).
The fd is still exported and held, so that a release with a receiver needs only its
transport.
"""

from __future__ import annotations

import os
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ...errors import InvalidArgument

__all__ = ["HANDLE_TYPE_POSIX_FD", "HANDLE_TYPE_FABRIC", "VmmShare", "VmmDriver",
           "export_vmm", "NOT_EXPORTABLE_HELP"]

#: ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` and ``CU_MEM_HANDLE_TYPE_FABRIC``.
HANDLE_TYPE_POSIX_FD = 0x1
HANDLE_TYPE_FABRIC = 0x8

NOT_EXPORTABLE_HELP = (
    "the VMM allocation was created without an exportable handle type "
    "(requestedHandleTypes has neither POSIX_FILE_DESCRIPTOR nor FABRIC); that is fixed "
    "at cuMemCreate time. Allocate the KV cache with CudaKVCache.allocate (plain "
    "cudaMalloc), turn PYTORCH_CUDA_ALLOC_CONF=expandable_segments off, or have the "
    "allocator request CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR / FABRIC")


class VmmDriver(Protocol):
    """The driver calls a VMM export needs (:class:`~.driver.CudaBindingsDriver` has
    them; so does the test double)."""

    def address_range(self, ptr: int) -> tuple[int, int]: ...
    def vmm_retain(self, ptr: int) -> Any: ...
    def vmm_handle_types(self, handle: Any) -> int: ...
    def vmm_export(self, handle: Any, handle_type: int) -> int | bytes: ...
    def vmm_release(self, handle: Any) -> None: ...


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


@dataclass
class VmmShare:
    """One VMM chunk exported by this process: what LMCache's ``VmmCudaIPCData`` names
    (kind, export id, fabric blob, chunk size, where the view starts in it) and the
    process-local fd of a ``posix_fd`` export, closed by :meth:`close` (or when the
    share is garbage-collected)."""

    kind: Literal["posix_fd", "fabric"]
    export_id: bytes
    alloc_size: int
    alloc_offset: int
    fd: int | None = None
    fabric_blob: bytes | None = None
    _finalizer: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.fd is not None:
            self._finalizer = weakref.finalize(self, _close_fd, self.fd)

    def close(self) -> None:
        """Close the exported fd (idempotent; a fabric share holds nothing)."""
        if self._finalizer is not None:
            self._finalizer()
        self.fd = None


def export_vmm(driver: VmmDriver, ptr: int, nbytes: int) -> tuple[VmmShare, int, int]:
    """Export the VMM chunk holding the ``nbytes`` at ``ptr``: ``(share, chunk base,
    chunk size)``. The device's context must be current. InvalidArgument when the chunk
    is not exportable or the view spans chunks (one handle maps one chunk)."""
    handle = driver.vmm_retain(ptr)
    fd: int | None = None
    try:
        requested = driver.vmm_handle_types(handle)
        blob: bytes | None = None
        kind: Literal["posix_fd", "fabric"]
        if requested & HANDLE_TYPE_POSIX_FD:  # LMCache's order: fd first
            value = driver.vmm_export(handle, HANDLE_TYPE_POSIX_FD)
            fd, kind = int(value), "posix_fd"
        elif requested & HANDLE_TYPE_FABRIC:
            blob, kind = bytes(driver.vmm_export(handle, HANDLE_TYPE_FABRIC)), "fabric"
        else:
            raise InvalidArgument(f"cannot export the memory at 0x{ptr:x}: {NOT_EXPORTABLE_HELP}")
        base, size = driver.address_range(ptr)
        offset = ptr - base
        if offset + nbytes > size:
            raise InvalidArgument(
                f"{nbytes} bytes at 0x{ptr:x} span more than one cuMemCreate chunk (the "
                f"chunk at 0x{base:x} holds {size} bytes from offset {offset}); one exported "
                f"handle maps exactly one chunk, so LMCache cannot map this view (engine-"
                f"driven transfers can: they need only mapped memory)")
        share = VmmShare(kind, uuid.uuid4().bytes, size, offset, fd=fd, fabric_blob=blob)
    except BaseException:
        if fd is not None:
            _close_fd(fd)
        raise
    finally:
        # The export (or the caller's own mapping) keeps the chunk alive; the retained
        # reference is ours to drop, as LMCache drops it.
        driver.vmm_release(handle)
    return share, base, size
