"""A CudaDriver double for machines without a GPU (used by the CUDA cache tests).

It models allocations on several devices, per-thread context state and events, and
records every call, so tests can check the event protocol (what was opened, waited on
and destroyed, on which stream) and the error paths. ``DEVICE_ORDINAL`` reads 0 for
every pointer, as it does on cuda-bindings 13.3.x-13.4.1, so code that still trusted
it would fail the multi-device tests.

VMM memory is modelled as the CUDA driver API documents it (docs.nvidia.com/cuda/
cuda-driver-api, "Virtual Memory Management" and "Memory Management"): a reservation
holds chunks (each one cuMemCreate allocation, with the handle types it was created
with) mapped side by side; cuMemGetAddressRange answers the chunk holding a pointer,
never the reservation; cuMemRetainAllocationHandle the chunk's own handle; an address
reserved but not mapped is unknown to the pointer queries and faults when copied.

Streams, events and host waits follow CUDA's rules (fake_streams.py), and
alloc_buffer / free_buffer follow torch's caching allocator: a block freed goes back
to the pool of the stream it was allocated on with whatever is still queued on it,
and the next allocation on that stream gets it (engine_temporary leaves such blocks).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Container, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from lmcache_mp.ipc.cuda import IPC_HANDLE_SIZE, CudaError, DeviceInfo, torch_uuid_string
from lmcache_mp.ipc.cuda.vmm import HANDLE_TYPE_POSIX_FD

from .fake_streams import StreamModel, torch_on_stream

UUID16 = bytes.fromhex("1f2e3d4c5b6a7988a7b6c5d4e3f2a1b0")
UUID_STR = "1f2e3d4c-5b6a-7988-a7b6-c5d4e3f2a1b0"
#: CUDA's VMM granularity on current GPUs (cuMemGetAllocationGranularity, MINIMUM).
GRANULE = 2 << 20
#: The page of PyTorch's expandable segments in its large pool (one handle each).
EXPANDABLE_PAGE = 20 << 20


class FakeDriver:
    """``kinds`` of allocation: "malloc" (legacy IPC ok), "vmm" (cuMemCreate), "pool"
    (cudaMallocAsync), "host"."""

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.device = 0
        self.context = 1  # a current context; 0 models a fresh thread
        self.allocs: dict[int, tuple[int, int, str]] = {}  # base -> (size, device, kind)
        self.freed: list[int] = []
        self.next_ptr = 0x7F00_0000_0000
        self.events: dict[int, dict[str, Any]] = {}
        self.next_event = 1
        self.calls: list[tuple[Any, ...]] = []
        self.opened: dict[bytes, int] = {}  # server handle -> times opened
        self.set_device_calls: list[int] = []
        self.vmm_types: dict[int, int] = {}
        self.vmm_retained: dict[int, int] = {}
        self.vmm_fds: list[int] = []
        # VMM as vLLM's extensible cache and PyTorch's expandable segments use it: VA
        # reservations (base -> (size, their bytes)), chunks made by vmm_create
        # (handle id -> its record), which chunk is mapped where (mapped base ->
        # handle id; a chunk from add_alloc(kind="vmm") is its own handle, id = base)
        # and the mapped chunks no cuMemSetAccess has made accessible yet.
        self.reservations: dict[int, tuple[int, np.ndarray]] = {}
        self.vmm_chunks: dict[int, dict[str, Any]] = {}
        self.vmm_mapped: dict[int, int] = {}
        self.vmm_no_access: set[int] = set()
        self.next_handle = 1
        # Engine-driven copies and the doctor (staging.CopyDriver): device memory is
        # backed by numpy buffers (made on first use), host memory is real memory;
        # copies are queued per stream and run at its synchronisation, so a transfer
        # that did not synchronise before COMMIT leaves nothing in the pool.
        self.backing: dict[int, np.ndarray] = {}
        self.pinned: dict[int, int] = {}  # host address -> bytes (cudaHostRegister)
        self.unpinned: list[int] = []
        self.allow_pageable = False  # copies from unpinned host memory (else asserted)
        self.fail_host_register = False
        self.refuse_3d = False  # memcpy_3d_async raises (the 2-D fallback)
        # Streams, events and host waits by CUDA's rules (fake_streams.py): copies run
        # as late as CUDA allows, an unordered access across streams is a race.
        self.streams = StreamModel()
        self.next_stream = 0x57_0000
        self.live_streams: set[int] = set()
        self.host_allocs: dict[int, np.ndarray] = {}  # cudaMallocHost: address -> bytes
        self.buffer_limit: int | None = None  # bytes alloc_buffer may hold (None: any)
        # torch's caching allocator (alloc_buffer / free_buffer): the stream each block
        # was allocated on, and per (stream, pool) the blocks freed and not handed out
        # again, whatever work is still queued on them.
        self.block_stream: dict[int, int] = {}
        self.torch_cached: dict[tuple[int, bool], list[int]] = {}
        #: torch's current stream outside :meth:`torch_stream` blocks (vLLM's: torch's
        #: default stream, or the one it runs its forward pass on).
        self.torch_current_stream = 0
        self._torch_current = threading.local()
        self.slow_host_register = 0.0  # seconds a cudaHostRegister takes
        self.host_register_gate: threading.Event | None = None  # it waits for this
        self.ipc_supported = True  # False: Tegra (cudaIpcGetMemHandle unsupported)
        self.compute_capability = (9, 0)
        self.total_memory = 1 << 30
        self.free_memory = 1 << 29
        self.attributes: dict[str, int] = {"Integrated": 0, "PageableMemoryAccess": 0,
                                           "ConcurrentManagedAccess": 1}

    def gb10(self) -> FakeDriver:
        """Look like a DGX Spark: sm_121, integrated, pageable memory access."""
        self.compute_capability = (12, 1)
        self.total_memory = 128 << 30
        self.free_memory = 100 << 30
        self.attributes.update(Integrated=1, PageableMemoryAccess=1,
                               PageableMemoryAccessUsesHostPageTables=1)
        return self

    # versions / devices
    def bindings_version(self) -> str:
        return "fake"

    def driver_version(self) -> int:
        return 13000

    def runtime_version(self) -> int:
        return 13000

    def device_count(self) -> int:
        return self.devices

    def device_info(self, device: int) -> DeviceInfo:
        raw = bytes([device]) + UUID16[1:]
        return DeviceInfo(device, f"Fake GPU {device}", torch_uuid_string(raw),
                          self.total_memory, self.compute_capability)

    def get_device(self) -> int:
        return self.device

    def set_device(self, device: int) -> None:
        self.set_device_calls.append(device)
        self.device = device
        self.context = 100 + device

    def current_context(self) -> int:
        return self.context

    # memory
    def add_alloc(self, size: int, kind: str = "malloc", device: int | None = None) -> int:
        base = self.next_ptr
        self.next_ptr += (size + 0xFFFFF) & ~0xFFFFF
        self.allocs[base] = (size, self.device if device is None else device, kind)
        return base

    def malloc(self, nbytes: int) -> int:
        self.calls.append(("malloc", nbytes, self.device))
        return self.add_alloc(nbytes)

    def free(self, ptr: int) -> None:
        assert ptr in self.allocs and ptr not in self.freed
        self.calls.append(("free", ptr, self.device))
        self.freed.append(ptr)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self.calls.append(("memset", ptr, value, nbytes))

    def synchronize_device(self) -> None:
        self.calls.append(("sync_device",))
        self.run_queued()

    def _find(self, ptr: int) -> tuple[int, int, int, str] | None:
        """The allocation holding ``ptr`` (for VMM memory: the chunk mapped there), as
        (base, size, device, kind)."""
        for base, (size, dev, kind) in self.allocs.items():
            if base <= ptr < base + size and base not in self.freed:
                return base, size, dev, kind
        return None

    def address_range(self, ptr: int) -> tuple[int, int]:
        """cuMemGetAddressRange: "the allocation that contains the input pointer". For
        VMM memory that is the cuMemCreate chunk mapped there, not the reservation:
        chunks mapped side by side answer one each (what UCX PR #11461 and libfabric
        PR #12473 met on CUDA); a reserved address with nothing mapped is not found."""
        found = self._find(ptr)
        if found is None:
            raise CudaError("cuMemGetAddressRange failed: CUDA_ERROR_NOT_FOUND", code=500)
        return found[0], found[1]

    def pointer_attribute(self, ptr: int, name: str) -> int | None:
        found = self._find(ptr)
        if found is None:
            return None
        _, _, _, kind = found
        return {
            "MEMORY_TYPE": 1 if kind == "host" else 2,
            "IS_LEGACY_CUDA_IPC_CAPABLE": int(kind == "malloc"),
            "MEMPOOL_HANDLE": 0xABC if kind == "pool" else 0,
            "IS_MANAGED": 0,
            "DEVICE_ORDINAL": 0,  # the cuda-bindings 13.3.x-13.4.1 bug
        }.get(name)

    def pointer_device(self, ptr: int) -> int | None:
        found = self._find(ptr)
        return None if found is None else found[2]

    # VMM (cuMemCreate) chunks: the handle types each was created with (default, for a
    # chunk made by add_alloc: a POSIX fd), the references cuMemRetainAllocationHandle
    # took that are outstanding, and the fds exported (real memfds, so that closing
    # them is observable).
    def set_vmm_types(self, base: int, types: int) -> None:
        self.vmm_types[base] = types

    def vmm_retain(self, ptr: int) -> tuple[str, int]:
        """cuMemRetainAllocationHandle: the handle of the chunk mapped at ``ptr`` (the
        one it was mapped with), one more reference; fails where nothing is mapped."""
        found = self._find(ptr)
        if found is None or found[3] != "vmm":
            raise CudaError("cuMemRetainAllocationHandle failed: CUDA_ERROR_INVALID_VALUE",
                            code=1)
        handle = self.vmm_mapped.get(found[0], found[0])
        self.vmm_retained[handle] = self.vmm_retained.get(handle, 0) + 1
        self.calls.append(("vmm_retain", handle))
        return ("vmm", handle)

    def vmm_handle_types(self, handle: tuple[str, int]) -> int:
        return self.vmm_types.get(handle[1], 0x1)

    def vmm_export(self, handle: tuple[str, int], handle_type: int) -> int | bytes:
        assert self.vmm_types.get(handle[1], 0x1) & handle_type, "not requested at create"
        self.calls.append(("vmm_export", handle[1], handle_type))
        if handle_type == 0x8:
            return handle[1].to_bytes(8, "little") * 8
        fd = os.memfd_create(f"fake-vmm-{handle[1]:x}")
        self.vmm_fds.append(fd)
        return fd

    def vmm_release(self, handle: tuple[str, int]) -> None:
        """cuMemRelease: one reference less (a retained one first, else the one
        vmm_create made; the chunk's memory goes once it is also unmapped)."""
        if self.vmm_retained.get(handle[1], 0) > 0:
            self.vmm_retained[handle[1]] -= 1
            return
        chunk = self.vmm_chunks.get(handle[1])
        assert chunk is not None and chunk["created"], "released more than retained"
        chunk["created"] = False
        self.calls.append(("vmm_release", handle[1]))

    # -- VA reservations with chunks mapped into them, as vLLM 0.34's ExtensibleTensor
    # and PyTorch's expandable segments make them: cuMemAddressReserve, cuMemCreate
    # (one physical chunk, its requestedHandleTypes fixed), cuMemMap (a whole chunk at
    # an address of a reservation), cuMemSetAccess (nothing is accessible before),
    # cuMemUnmap (whole mappings only), cuMemAddressFree. A reservation's bytes are host
    # memory at its very addresses, so CPU tensors over them (vLLM's views of its
    # extensible cache) stand where CUDA tensors would; the copies check that every
    # byte they touch is mapped and accessible (_vmm_bytes).
    def vmm_address_reserve(self, size: int, alignment: int = GRANULE) -> int:
        assert size > 0 and size % 4096 == 0, "cuMemAddressReserve: whole host pages"
        raw = np.zeros(size + alignment, np.uint8)
        mem = raw[-raw.ctypes.data % alignment:][:size]
        self.reservations[mem.ctypes.data] = (size, mem)
        self.calls.append(("vmm_reserve", mem.ctypes.data, size))
        return int(mem.ctypes.data)

    def vmm_address_free(self, ptr: int, size: int) -> None:
        assert self.reservations.get(ptr, (0,))[0] == size, "not a reservation of that size"
        assert not any(ptr <= b < ptr + size for b in self.vmm_mapped), "chunks still mapped"
        del self.reservations[ptr]

    def vmm_create(self, size: int, device: int | None = None,
                   handle_types: int = 0) -> tuple[str, int]:
        assert size > 0 and size % GRANULE == 0, "cuMemCreate: a multiple of the granularity"
        handle = self.next_handle
        self.next_handle += 1
        self.vmm_chunks[handle] = {"size": size, "created": True, "mapped_at": None,
                                   "device": self.device if device is None else device}
        self.vmm_types[handle] = handle_types
        self.calls.append(("vmm_create", handle, size, handle_types))
        return ("vmm", handle)

    def _reservation(self, ptr: int) -> tuple[int, int, np.ndarray] | None:
        for base, (size, mem) in self.reservations.items():
            if base <= ptr < base + size:
                return base, size, mem
        return None

    def vmm_map(self, ptr: int, size: int, handle: tuple[str, int]) -> None:
        chunk = self.vmm_chunks[handle[1]]
        assert chunk["created"] or self.vmm_retained.get(handle[1], 0), "a released handle"
        assert size == chunk["size"] and chunk["mapped_at"] is None, "one whole mapping"
        found = self._reservation(ptr)
        assert found is not None and ptr + size <= found[0] + found[1], "not reserved"
        assert not any(b < ptr + size and ptr < b + self.allocs[b][0] for b in self.vmm_mapped), \
            "cuMemMap over a mapping"
        self.allocs[ptr] = (size, chunk["device"], "vmm")
        self.vmm_mapped[ptr] = handle[1]
        self.vmm_no_access.add(ptr)
        chunk["mapped_at"] = ptr
        # Fresh physical memory holds whatever it held: not zeros.
        found[2][ptr - found[0]: ptr - found[0] + size] = 0xA5
        self.calls.append(("vmm_map", ptr, size, handle[1]))

    def _mappings(self, ptr: int, size: int) -> list[int]:
        """The mapped chunks tiling [ptr, ptr + size) exactly (asserted)."""
        bases, at = [], ptr
        while at < ptr + size:
            assert at in self.vmm_mapped, f"0x{at:x} does not start a mapping"
            bases.append(at)
            at += self.allocs[at][0]
        assert at == ptr + size, "a range ending inside a mapping"
        return bases

    def vmm_set_access(self, ptr: int, size: int, device: int) -> None:
        for base in self._mappings(ptr, size):
            assert self.allocs[base][1] == device, "access for another device's chunk"
            self.vmm_no_access.discard(base)

    def vmm_unmap(self, ptr: int, size: int) -> None:
        for base in self._mappings(ptr, size):
            del self.allocs[base]
            self.backing.pop(base, None)
            self.vmm_no_access.discard(base)
            self.vmm_chunks[self.vmm_mapped.pop(base)]["mapped_at"] = None
        self.calls.append(("vmm_unmap", ptr, size))

    def vmm_reservation(self, chunks: Sequence[int], *, handle_types: int = 0,
                        devices: Sequence[int] | None = None, holes: Container[int] = (),
                        spare: int = 0) -> int:
        """A reservation with chunks of these sizes mapped side by side from its base
        (accessible to their device; ``devices``: one per chunk), chunks whose index
        is in ``holes`` left unmapped, ``spare`` bytes reserved after them."""
        base = self.vmm_address_reserve(sum(chunks) + spare)
        at = base
        for i, size in enumerate(chunks):
            if i not in holes:
                device = None if devices is None else devices[i]
                handle = self.vmm_create(size, device, handle_types)
                self.vmm_map(at, size, handle)
                self.vmm_set_access(at, size, self.allocs[at][1])
            at += size
        return base

    def expandable_segment(self, nbytes: int, page: int = EXPANDABLE_PAGE,
                           handle_types: int = HANDLE_TYPE_POSIX_FD) -> int:
        """PyTorch's expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
        holding ``nbytes``: a large reservation mapped one cuMemCreate handle per page
        (20 MiB in the large pool), each created with requestedHandleTypes POSIX_FD
        (c10/cuda/CUDACachingAllocator.cpp, ExpandableSegment::map; FABRIC where so
        configured)."""
        return self.vmm_reservation([page] * -(-nbytes // page), handle_types=handle_types,
                                    spare=page)

    def _vmm_bytes(self, ptr: int, nbytes: int) -> np.ndarray | None:
        """The ``nbytes`` at ``ptr`` if it lies in a reservation: every byte in a chunk
        mapped there and made accessible (elsewhere a copy faults on CUDA), across as
        many chunks as it spans."""
        found = self._reservation(ptr)
        if found is None:
            return None
        base, size, mem = found
        assert ptr + nbytes <= base + size, "a copy runs past its reservation"
        at = ptr
        while at < ptr + nbytes:
            chunk = self._find(at)
            assert chunk is not None and chunk[0] in self.vmm_mapped, \
                f"0x{at:x} is reserved but not mapped (a copy there faults)"
            assert chunk[0] not in self.vmm_no_access, \
                f"the chunk at 0x{chunk[0]:x} was never made accessible (cuMemSetAccess)"
            at = chunk[0] + chunk[1]
        return mem[ptr - base: ptr - base + nbytes]

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        assert ptr in self.allocs, "always exported at the base"
        if not self.ipc_supported:
            raise CudaError("cudaIpcGetMemHandle failed: cudaErrorNotSupported (801)",
                            call="cudaIpcGetMemHandle", code=801)
        self.calls.append(("ipc_mem", ptr))
        return ptr.to_bytes(8, "little") * 8

    # events
    def event_create_ipc(self) -> int:
        ev = self.next_event
        self.next_event += 1
        self.events[ev] = {"kind": "ours", "destroyed": False, "recorded_on": None,
                           "device": self.device, "captured": {}}
        return ev

    def event_create(self) -> int:
        """cudaEventCreateWithFlags(cudaEventDisableTiming): an event of this process."""
        ev = self.event_create_ipc()
        self.events[ev]["kind"] = "plain"
        self.calls.append(("event_create", ev))
        return ev

    def event_record(self, event: int, stream: int) -> None:
        assert not self.events[event]["destroyed"], "recorded a destroyed event"
        self.events[event]["recorded_on"] = stream
        # "Captures in event the contents of stream at the time of this call".
        self.events[event]["captured"] = self.streams.record(stream)

    def ipc_get_event_handle(self, event: int) -> bytes:
        return b"E" + event.to_bytes(8, "little") + bytes(IPC_HANDLE_SIZE - 9)

    def ipc_open_event_handle(self, handle: bytes) -> int:
        assert len(handle) == IPC_HANDLE_SIZE
        self.opened[handle] = self.opened.get(handle, 0) + 1
        ev = self.next_event
        self.next_event += 1
        self.events[ev] = {"kind": "opened", "handle": handle, "destroyed": False,
                           "device": self.device}
        self.calls.append(("open", handle, self.device))
        return ev

    def stream_wait_event(self, stream: int, event: int) -> None:
        assert not self.events[event]["destroyed"], "waited on a destroyed event"
        self.calls.append(("wait", stream, self.events[event].get("handle")))
        # A server's event (opened from its handle) orders none of this process's work.
        self.streams.wait(stream, self.events[event].get("captured", {}))

    def event_synchronize(self, event: int) -> None:
        assert not self.events[event]["destroyed"]
        self.calls.append(("event_sync", self.events[event].get("handle")))
        self.streams.synchronize_captured(self.events[event].get("captured", {}))

    def event_destroy(self, event: int) -> None:
        assert not self.events[event]["destroyed"], "destroyed twice"
        self.events[event]["destroyed"] = True
        self.calls.append(("destroy", self.events[event].get("handle", event)))

    def stream_synchronize(self, stream: int) -> None:
        self.calls.append(("stream_sync", stream))
        self.run_queued(stream)

    def stream_create(self) -> int:
        """cudaStreamCreateWithFlags(cudaStreamNonBlocking), as torch makes its own."""
        self.next_stream += 0x10
        self.live_streams.add(self.next_stream)
        self.calls.append(("stream_create", self.next_stream))
        return self.next_stream

    def stream_destroy(self, stream: int) -> None:
        # CUDA lets work still queued finish after cudaStreamDestroy returns.
        assert stream in self.live_streams, "destroyed a stream twice (or not ours)"
        self.live_streams.discard(stream)
        self.calls.append(("stream_destroy", stream))

    # engine-driven copies and the doctor
    def host_register(self, ptr: int, nbytes: int) -> None:
        self.calls.append(("host_register", ptr, nbytes))
        if self.slow_host_register:
            time.sleep(self.slow_host_register)
        if self.host_register_gate is not None:
            assert self.host_register_gate.wait(60), "the test never opened the gate"
        if self.fail_host_register:
            raise CudaError("cudaHostRegister failed: cudaErrorMemoryAllocation (2)",
                            call="cudaHostRegister", code=2)
        # As CUDA: a range overlapping page-locked memory (registered, or cudaMallocHost's)
        # is refused with an error the caller gets, not a crash.
        end = ptr + nbytes
        if any(base < end and ptr < base + n for base, n in self.pinned.items()):
            raise CudaError("cudaHostRegister failed: cudaErrorHostMemoryAlreadyRegistered "
                            "(712)", call="cudaHostRegister", code=712)
        self.pinned[ptr] = nbytes

    def host_unregister(self, ptr: int) -> None:
        self.calls.append(("host_unregister", ptr))
        # As CUDA: only the base address a cudaHostRegister returned for, once.
        if ptr not in self.pinned or ptr in self.host_allocs:
            raise CudaError("cudaHostUnregister failed: cudaErrorHostMemoryNotRegistered "
                            "(713)", call="cudaHostUnregister", code=713)
        del self.pinned[ptr]
        self.unpinned.append(ptr)

    def _memory(self, ptr: int, nbytes: int) -> np.ndarray:
        reserved = self._vmm_bytes(ptr, nbytes)  # VMM reservations: may span chunks
        if reserved is not None:
            return reserved
        found = self._find(ptr)
        if found is not None:
            base, size, _, _ = found
            assert ptr + nbytes <= base + size, "a copy runs past its allocation"
            buf = self.backing.setdefault(base, np.zeros(size, np.uint8))
            return buf[ptr - base: ptr - base + nbytes]
        pinned = any(a <= ptr and ptr + nbytes <= a + n for a, n in self.pinned.items())
        assert pinned or self.allow_pageable or _being_pinned(ptr, nbytes), \
            f"host memory 0x{ptr:x} is not page-locked"
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def _rows(self, ptr: int, pitch: int, width: int, rows: int) -> list[tuple[int, int]]:
        """The host address ranges of ``rows`` rows of ``width`` bytes, ``pitch`` apart
        (checked now: CUDA checks pointers when the copy is queued)."""
        out = []
        for r in range(rows):
            at = int(self._memory(ptr + r * pitch, width).ctypes.data)
            out.append((at, at + width))
        return out

    def memcpy_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                        height: int, stream: int) -> None:
        self.calls.append(("memcpy2d", dst, dpitch, src, spitch, width, height, stream))
        assert width <= dpitch and width <= spitch

        def run() -> None:
            for r in range(height):
                self._memory(dst + r * dpitch, width)[:] = self._memory(src + r * spitch, width)

        self.streams.enqueue("cudaMemcpy2DAsync", stream,
                             self._rows(src, spitch, width, height),
                             self._rows(dst, dpitch, width, height), run)

    def memcpy_3d_async(self, dst: int, dpitch: int, dheight: int, src: int, spitch: int,
                        sheight: int, width: int, height: int, depth: int,
                        stream: int) -> None:
        """Linear memory as CUDA addresses it: byte (x, y, z) of a pitched pointer is at
        ``ptr + z * pitch * pitch_height + y * pitch + x``."""
        self.calls.append(("memcpy3d", dst, dpitch, dheight, src, spitch, sheight, width,
                           height, depth, stream))
        if self.refuse_3d:
            raise CudaError("cudaMemcpy3DAsync failed: cudaErrorInvalidValue (1)",
                            call="cudaMemcpy3DAsync", code=1)
        assert width <= dpitch and width <= spitch and height <= dheight and height <= sheight

        def run() -> None:
            for z in range(depth):
                for y in range(height):
                    self._memory(dst + (z * dheight + y) * dpitch, width)[:] = self._memory(
                        src + (z * sheight + y) * spitch, width)

        reads, writes = [], []
        for z in range(depth):
            reads += self._rows(src + z * sheight * spitch, spitch, width, height)
            writes += self._rows(dst + z * dheight * dpitch, dpitch, width, height)
        self.streams.enqueue("cudaMemcpy3DAsync", stream, reads, writes, run)

    def torch_bytes(self, ptr: int, nbytes: int, device: int) -> Any:
        """The fake's device memory as a CPU torch tensor over its numpy backing: the
        gather path runs its torch operations on it, as on CUDA tensors (inside
        :meth:`torch_stream`, which queues them on a stream)."""
        import torch

        self.calls.append(("torch_bytes", ptr, nbytes, device))
        return torch.from_numpy(self._memory(ptr, nbytes))

    @contextmanager
    def torch_stream(self, stream: int, device: int) -> Iterator[None]:
        """Torch operations of this thread inside the block are queued on ``stream``
        (on CUDA: torch.cuda.stream over that handle), and torch allocates for that
        stream (:meth:`alloc_buffer`). The fake runs them at once, on CPU tensors,
        after what they are ordered after, and checks the memory they touch against
        other streams' unfinished work."""
        outer = getattr(self._torch_current, "stream", None)
        self._torch_current.stream = stream
        try:
            with torch_on_stream(self.streams, stream):
                yield
        finally:
            self._torch_current.stream = outer

    def current_torch_stream(self) -> int:
        """torch.cuda.current_stream() of this thread."""
        current = getattr(self._torch_current, "stream", None)
        return self.torch_current_stream if current is None else current

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        """cudaMemcpy: queued on the legacy default stream, and the host waits for it."""
        self.calls.append(("memcpy", dst, src, nbytes))
        d, s = self._memory(dst, nbytes), self._memory(src, nbytes)

        def run() -> None:
            d[:] = s

        self.streams.enqueue("cudaMemcpy", 0, [(s.ctypes.data, s.ctypes.data + nbytes)],
                             [(d.ctypes.data, d.ctypes.data + nbytes)], now=run)
        self.streams.synchronize_stream(0)

    # -- what the gather path allocates: staging through torch's caching allocator
    # (alloc_buffer), its pinned index buffer (malloc_host); counted by live_*.
    #
    # torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp; "CUDA semantics"
    # in torch's notes): a block belongs to the stream current when it was allocated;
    # a tensor dropped gives its block back to that stream's pool at once, with no
    # event (unless Tensor.record_stream named other streams), and the next
    # allocation on that stream may get it while work queued there earlier still
    # reads or writes it: safe for work queued later on that same stream only.
    # Blocks of 1 MiB or less come from the small pool, larger ones from the large
    # pool; the smallest free block that fits is handed out, whole (torch would split
    # off the rest: the memory handed out, and what is queued on it, is the same).
    SMALL_BLOCK = 1 << 20

    def alloc_buffer(self, nbytes: int, device: int) -> int:
        """torch.empty(nbytes, uint8) on the device, on torch's current stream: a
        block of that stream's cache first (whatever is still queued on it), else
        fresh memory, refused (as torch raises OutOfMemoryError) beyond
        :attr:`buffer_limit` bytes held at once."""
        stream = self.current_torch_stream()
        pool = self.torch_cached.get((stream, nbytes <= self.SMALL_BLOCK), [])
        fits = [b for b in pool if self.allocs[b][0] >= nbytes and self.allocs[b][1] == device]
        if fits:
            base = min(fits, key=lambda b: self.allocs[b][0])
            pool.remove(base)
            self.freed.remove(base)
            self.calls.append(("alloc_buffer", nbytes, device))
            self.calls.append(("alloc_buffer_cached", base, stream))
            return base
        held = sum(self.allocs[b][0] for b in self.live_device_allocations()
                   if self.allocs[b][2] == "torch")
        if self.buffer_limit is not None and held + nbytes > self.buffer_limit:
            self.calls.append(("alloc_buffer_refused", nbytes, device))
            raise CudaError(f"torch.empty({nbytes}) on cuda:{device}: CUDA out of memory",
                            call="torch.empty", code=2)
        ptr = self.add_alloc(nbytes, "torch", device)
        self.block_stream[ptr] = stream
        self.calls.append(("alloc_buffer", nbytes, device))
        return ptr

    def free_buffer(self, ptr: int) -> None:
        """The tensor dropped: its block goes back to the cache of the stream it was
        allocated on, for the next allocation there at once; unfinished work of
        another stream on it not ordered before that stream's is a race."""
        size, _, kind = self.allocs[ptr]
        assert kind == "torch"
        stream = self.block_stream[ptr]
        mem = self._memory(ptr, size)
        at = int(mem.ctypes.data)
        self.streams.check_reuse(f"the reuse of a torch block freed on stream {stream:#x}",
                                 [(at, at + size)], stream)
        self.free(ptr)
        self.torch_cached.setdefault((stream, size <= self.SMALL_BLOCK), []).append(ptr)

    def engine_temporary(self, nbytes: int, stream: int, device: int = 0) -> int:
        """What an engine leaves in torch's cache many times a step: a tensor allocated
        on ``stream``, a kernel queued there writing all of it (not complete: it runs
        when something ordered after it runs, or the host waits), then the tensor
        dropped. Its block is the next allocation of that size on ``stream``."""
        ptr = self.add_alloc(nbytes, "torch", device)  # fresh: not another temporary's
        self.block_stream[ptr] = stream
        mem = self._memory(ptr, nbytes)
        at = int(mem.ctypes.data)

        def kernel() -> None:
            mem[:] = 0xEE

        self.streams.enqueue("the engine's kernel on a temporary", stream, [],
                             [(at, at + nbytes)], kernel)
        self.free_buffer(ptr)
        return ptr

    def malloc_host(self, nbytes: int) -> int:
        """cudaMallocHost: page-locked host memory."""
        mem = np.zeros(max(1, nbytes), np.uint8)
        self.host_allocs[mem.ctypes.data] = mem
        self.pinned[mem.ctypes.data] = nbytes
        self.calls.append(("malloc_host", nbytes))
        return int(mem.ctypes.data)

    def free_host(self, ptr: int) -> None:
        assert ptr in self.host_allocs, "cudaFreeHost of memory cudaMallocHost did not give"
        del self.host_allocs[ptr], self.pinned[ptr]
        self.calls.append(("free_host", ptr))

    def live_device_allocations(self) -> list[int]:
        """Device allocations not freed (malloc, alloc_buffer), by base address."""
        return [b for b, (_, _, kind) in self.allocs.items()
                if kind in ("malloc", "torch") and b not in self.freed]

    def live_resources(self) -> dict[str, int]:
        """What a leak would grow: device allocations, pinned host buffers, streams and
        events of this process not destroyed."""
        return {"device": len(self.live_device_allocations()),
                "host": len(self.host_allocs), "streams": len(self.live_streams),
                "events": sum(1 for e in self.events.values()
                              if e["kind"] == "plain" and not e["destroyed"])}

    def host_access(self, what: str, array: np.ndarray, write: bool = False) -> None:
        """Assert the host may read (or write) ``array`` now: no unfinished device work
        writes it (or, for a write, reads it). What a COMMIT lets the server do."""
        at = int(array.ctypes.data)
        self.streams.host_access(what, [(at, at + array.nbytes)], write)

    @property
    def queued(self) -> list[tuple[int, Any]]:
        """Driver copies queued and not run yet: (stream, run)."""
        return self.streams.queued()

    @property
    def races(self) -> list[str]:
        return self.streams.races

    def mem_get_info(self) -> tuple[int, int]:
        return self.free_memory, self.total_memory

    def device_attribute(self, device: int, name: str) -> int | None:
        return self.attributes.get(name)

    def run_queued(self, stream: int | None = None) -> None:
        """The host waits for ``stream`` (None: for the whole device)."""
        if stream is None:
            self.streams.synchronize_all()
        else:
            self.streams.synchronize_stream(stream)


def _being_pinned(ptr: int, nbytes: int) -> bool:
    """Whether the copies' own page-locking of this pool is still running (a large
    pool's, on its own thread: the copies meanwhile go pageable, by design; CUDA
    allows that, slower). Anything else pageable is a forgotten pinning."""
    from lmcache_mp.ipc.cuda import staging

    return any(p.address <= ptr and ptr + nbytes <= p.address + p.nbytes
               and not p.done.is_set() for p in list(staging._pinned.values()))


class FakeTensor:
    """Just what from_torch reads from a torch tensor."""

    class Device:
        def __init__(self, index: int, type: str = "cuda") -> None:
            self.type, self.index = type, index

        def __eq__(self, other: object) -> bool:
            return isinstance(other, FakeTensor.Device) and (self.type, self.index) == (
                other.type, other.index)

        def __repr__(self) -> str:
            return f"{self.type}:{self.index}"

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: str = "torch.bfloat16",
                 device: int = 0, contiguous: bool = True, kind: str = "cuda",
                 strides: tuple[int, ...] | None = None) -> None:
        self.ptr, self.shape, self.dtype = ptr, shape, dtype
        self.device = FakeTensor.Device(device, kind)
        if strides is None:
            acc, out = 1, []
            for d in reversed(shape):
                out.append(acc)
                acc *= d
            # Not contiguous: a gap after every innermost row.
            strides = tuple(reversed(out)) if contiguous else tuple(2 * s for s in reversed(out))
        self.strides = strides

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def dim(self) -> int:
        return len(self.shape)
