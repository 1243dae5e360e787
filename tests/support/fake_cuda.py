"""A CudaDriver double for machines without a GPU (used by the CUDA cache tests).

It models allocations on several devices, per-thread context state and events, and
records every call, so tests can check the event protocol (what was opened, waited on
and destroyed, on which stream) and the error paths. ``DEVICE_ORDINAL`` reads 0 for
every pointer, as it does on cuda-bindings 13.3.x-13.4.1, so code that still trusted
it would fail the multi-device tests.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from lmcache_mp.ipc.cuda import IPC_HANDLE_SIZE, CudaError, DeviceInfo, torch_uuid_string

UUID16 = bytes.fromhex("1f2e3d4c5b6a7988a7b6c5d4e3f2a1b0")
UUID_STR = "1f2e3d4c-5b6a-7988-a7b6-c5d4e3f2a1b0"


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
        self.queued: list[tuple[int, Any]] = []  # (stream, copy)
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
        for base, (size, dev, kind) in self.allocs.items():
            if base <= ptr < base + size and base not in self.freed:
                return base, size, dev, kind
        return None

    def address_range(self, ptr: int) -> tuple[int, int]:
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

    # VMM (cuMemCreate) chunks: the handle types each was created with (default: a
    # POSIX fd), the retained references outstanding, and the fds exported (real
    # memfds, so that closing them is observable).
    def set_vmm_types(self, base: int, types: int) -> None:
        self.vmm_types[base] = types

    def vmm_retain(self, ptr: int) -> tuple[str, int]:
        found = self._find(ptr)
        if found is None or found[3] != "vmm":
            raise CudaError("cuMemRetainAllocationHandle failed: CUDA_ERROR_INVALID_VALUE",
                            code=1)
        self.vmm_retained[found[0]] = self.vmm_retained.get(found[0], 0) + 1
        self.calls.append(("vmm_retain", found[0]))
        return ("vmm", found[0])

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
        assert self.vmm_retained.get(handle[1], 0) > 0, "released more than retained"
        self.vmm_retained[handle[1]] -= 1

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
                           "device": self.device}
        return ev

    def event_record(self, event: int, stream: int) -> None:
        self.events[event]["recorded_on"] = stream

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

    def event_synchronize(self, event: int) -> None:
        assert not self.events[event]["destroyed"]
        self.calls.append(("event_sync", self.events[event].get("handle")))

    def event_destroy(self, event: int) -> None:
        assert not self.events[event]["destroyed"], "destroyed twice"
        self.events[event]["destroyed"] = True
        self.calls.append(("destroy", self.events[event].get("handle", event)))

    def stream_synchronize(self, stream: int) -> None:
        self.calls.append(("stream_sync", stream))
        self.run_queued(stream)

    # engine-driven copies and the doctor
    def host_register(self, ptr: int, nbytes: int) -> None:
        self.calls.append(("host_register", ptr, nbytes))
        if self.fail_host_register:
            raise CudaError("cudaHostRegister failed: cudaErrorMemoryAllocation (2)",
                            call="cudaHostRegister", code=2)
        assert ptr not in self.pinned, "pinned twice"
        self.pinned[ptr] = nbytes

    def host_unregister(self, ptr: int) -> None:
        self.calls.append(("host_unregister", ptr))
        assert ptr in self.pinned, "unregistering memory that was not registered"
        del self.pinned[ptr]
        self.unpinned.append(ptr)

    def _memory(self, ptr: int, nbytes: int) -> np.ndarray:
        found = self._find(ptr)
        if found is not None:
            base, size, _, _ = found
            assert ptr + nbytes <= base + size, "a copy runs past its allocation"
            buf = self.backing.setdefault(base, np.zeros(size, np.uint8))
            return buf[ptr - base: ptr - base + nbytes]
        pinned = any(a <= ptr and ptr + nbytes <= a + n for a, n in self.pinned.items())
        assert pinned or self.allow_pageable, f"host memory 0x{ptr:x} is not page-locked"
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def memcpy_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                        height: int, stream: int) -> None:
        self.calls.append(("memcpy2d", dst, dpitch, src, spitch, width, height, stream))
        assert width <= dpitch and width <= spitch

        def run() -> None:
            for r in range(height):
                self._memory(dst + r * dpitch, width)[:] = self._memory(src + r * spitch, width)

        self.queued.append((stream, run))

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

        self.queued.append((stream, run))

    def torch_bytes(self, ptr: int, nbytes: int, device: int) -> Any:
        """The fake's device memory as a CPU torch tensor over its numpy backing: the
        gather path runs its torch operations on it, as on CUDA tensors."""
        import torch

        self.calls.append(("torch_bytes", ptr, nbytes, device))
        return torch.from_numpy(self._memory(ptr, nbytes))

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        self.calls.append(("memcpy", dst, src, nbytes))
        self._memory(dst, nbytes)[:] = self._memory(src, nbytes)

    def mem_get_info(self) -> tuple[int, int]:
        return self.free_memory, self.total_memory

    def device_attribute(self, device: int, name: str) -> int | None:
        return self.attributes.get(name)

    def run_queued(self, stream: int | None = None) -> None:
        keep = []
        for s, run in self.queued:
            if stream is None or s == stream:
                run()
            else:
                keep.append((s, run))
        self.queued = keep


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
