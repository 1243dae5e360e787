"""Engine-driven GPU copies as one gather (STORE) or scatter (RETRIEVE) per layer and
K/V plane, through a device staging buffer, and one DMA per chunk object.

Why. A chunk object is token-major (``[planes, layers, tokens, heads * head_dim]``)
and the cache's blocks are wherever vLLM's block table says, in the layout the engine
chose (HND, NHD, fused K/V, blocks-first, MLA, padded strides). Copying that with the
copy engine alone (:func:`~lmcache_mp.ipc.cuda.staging.run_plan`) takes one
``cudaMemcpy2D/3DAsync`` per (plane, layer, head, run of consecutive blocks):
thousands of small DMAs per transfer, 4-5 GB/s on an H200 against a 52-55 GB/s pinned
copy, 1.4 GB/s for blocks-first layouts (2026-12-04). Here the reordering is done by
the GPU, at HBM speed, and the PCIe side is one large DMA per chunk object:

* STORE: for each (plane, layer) one ``index_select`` of the transfer's blocks into
  the staging buffer ``[planes, layers, k * tokens, hidden]`` (k chunk objects at a
  time), the blocks read through a strided view of the layer in token-major order;
  then one ``cudaMemcpy2DAsync`` per chunk object into its (page-locked) pool slot.
* RETRIEVE: one 2-D DMA per chunk object into the staging buffer, then one
  ``index_copy_`` per (plane, layer) into the blocks (the skipped leading blocks are
  left out of the index).

Everything is queued on the caller's stream, after the work already there; the
caller synchronises that stream as before. The staging buffer is allocated once per
cache with the driver, grown up to :data:`STAGING_LIMIT_BYTES` (more chunks than fit
are moved in several rounds through the same buffer, ordered by the stream), reused
under a lock, and freed with the cache.

The gather and scatter are torch operations on tensors over raw device addresses
(:meth:`GatherDriver.torch_bytes`), viewed as the widest integer type the layout
allows (bits are moved, never floats: random bf16 bits hold NaNs). With a driver whose
"device" memory is host memory (the tests' fake) the very same code runs on CPU
tensors, so CI proves the bytes against the copy plan for every layout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from ...errors import InvalidArgument
from ..base import KVGeometry
from .driver import CudaDriver, CudaError

__all__ = ["GatherDriver", "GatherCopier", "STAGING_LIMIT_BYTES", "StagingUnavailable",
           "gather_unavailable", "block_views"]


class StagingUnavailable(CudaError):
    """The staging buffer could not be allocated; nothing of the transfer was queued."""


def _staging_limit() -> int:
    raw = os.environ.get("LMCACHE_MP_STAGING_MB", "")
    try:
        mib = int(raw) if raw else 256
    except ValueError:
        raise InvalidArgument(f"LMCACHE_MP_STAGING_MB={raw!r} is not a whole number of "
                              f"MiB (default 256)") from None
    return max(1, mib) << 20


#: Most device memory one cache's staging buffer takes (``LMCACHE_MP_STAGING_MB``,
#: default 256 MiB); at least one chunk object whatever this says.
STAGING_LIMIT_BYTES = _staging_limit()


class GatherDriver(CudaDriver, Protocol):
    """The driver calls the gather path needs beyond :class:`CudaDriver`."""

    def memcpy_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                        height: int, stream: int) -> None: ...

    def torch_bytes(self, ptr: int, nbytes: int, device: int) -> Any:
        """The memory at ``ptr`` as a 1-D uint8 torch tensor on the device (no copy,
        no ownership)."""
        ...


def gather_unavailable(driver: object) -> str | None:
    """Why this driver's caches cannot use the gather path (None: they can)."""
    if os.environ.get("LMCACHE_MP_GPU_COPY", "") == "plan":
        return "LMCACHE_MP_GPU_COPY=plan"
    if not hasattr(driver, "torch_bytes") or not hasattr(driver, "memcpy_2d_async"):
        return f"the driver {type(driver).__name__} has no torch_bytes / memcpy_2d_async"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed"
    return None


_INT_TYPES = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


def _unit(g: KVGeometry, ptrs: Sequence[int]) -> int:
    """The widest integer (bytes) every head row, block stride and layer address is a
    multiple of: a head row of 256 bytes moves as 32 int64s instead of 128 int16s."""
    row = g.head_dim * g.itemsize
    for unit in (8, 4, 2):
        if not (row % unit or (g.block_stride * g.itemsize) % unit
                or any(p % unit for p in ptrs)):
            return unit
    return 1


def block_views(g: KVGeometry, layers: Sequence[Any], unit: int) -> list[list[Any]]:
    """Per plane, per layer: the layer's blocks as ``[num_blocks, block_size, heads,
    row]`` (token-major inside a block, whatever the layout), ``row`` in ``unit``-byte
    integers, over the flat integer tensors ``layers``."""
    row = g.head_dim * g.itemsize // unit
    h = 1 if g.mla else g.num_heads
    bs, nb = g.block_size, g.num_blocks
    # (token, head) strides inside a block: NHD [block_size, heads, row], HND (and
    # MLA's one head) [heads, block_size, row].
    inner = (h * row, row) if g.layout == "NHD" else (row, bs * row)
    if g.mla or g.fused:  # one plane; blocks block_step apart (blocks-first: further)
        step, offsets = g.block_step * g.itemsize // unit, [0]
    else:  # [2, num_blocks, ...]: the V plane after the K plane's blocks
        step = bs * h * row
        offsets = [0, nb * step]
    return [[t.as_strided((nb, bs, h, row), (step, *inner, 1), off) for t in layers]
            for off in offsets]


class GatherCopier:
    """One cache's gather / scatter machinery: its layers' block views and the staging
    buffer. Thread-safe (one transfer at a time uses the buffer)."""

    def __init__(self, driver: GatherDriver, device: int, g: KVGeometry,
                 layer_ptrs: Sequence[int]) -> None:
        import torch

        self._torch = torch
        self._drv = driver
        self._device = device
        self._g = g
        self._unit = _unit(g, layer_ptrs)
        dtype = getattr(torch, _INT_TYPES[self._unit])
        raw = [driver.torch_bytes(p, g.layer_nbytes, device) for p in layer_ptrs]
        # The flat layers as integers of the unit (a blocks-first layer's span may not
        # end on one: the views never reach past its last block).
        flat = [t[: g.layer_nbytes // self._unit * self._unit].view(dtype) for t in raw]
        self._views = block_views(g, flat, self._unit)
        self._dtype = dtype
        self._row = g.head_dim * g.itemsize // self._unit
        self._hidden_units = (1 if g.mla else g.num_heads) * self._row
        self.is_cuda = raw[0].device.type == "cuda"
        self._lock = threading.Lock()
        self._staging_ptr = 0
        self._staging_bytes = 0
        self._staging: Any = None
        self._closed = False

    # ------------------------------------------------------------ staging
    def _ensure_staging(self, nbytes: int) -> Any:
        """The staging buffer, grown to ``nbytes`` if smaller. Raises
        :class:`StagingUnavailable` (nothing queued yet) when the device has no memory
        left for it: an engine running at its memory limit still moves its blocks, by
        the copy plan."""
        if nbytes > self._staging_bytes:
            self._free_staging()
            try:
                ptr = self._drv.malloc(nbytes)
            except CudaError as exc:
                raise StagingUnavailable(
                    f"cannot allocate a {nbytes}-byte staging buffer on device "
                    f"{self._device} ({exc}); set LMCACHE_MP_STAGING_MB lower, or leave "
                    f"the engine more free memory", call="cudaMalloc") from exc
            self._staging_ptr, self._staging_bytes = ptr, nbytes
            self._staging = self._drv.torch_bytes(ptr, nbytes, self._device)
        return self._staging

    def _free_staging(self) -> None:
        if self._staging_ptr:
            ptr, self._staging_ptr, self._staging_bytes, self._staging = \
                self._staging_ptr, 0, 0, None
            self._drv.free(ptr)

    @property
    def staging_bytes(self) -> int:
        """Device memory the staging buffer holds now."""
        return self._staging_bytes

    def close(self) -> None:
        """Free the staging buffer (the caller synchronised every stream it used)."""
        with self._lock:
            self._closed = True
            self._views = []
            self._free_staging()

    # ------------------------------------------------------------ copies
    @contextmanager
    def _on_stream(self, stream: int) -> Iterator[None]:
        if not self.is_cuda:
            yield
            return
        torch = self._torch
        dev = torch.device("cuda", self._device)
        # Usually torch's current stream (what stream=None resolves to); a handle of
        # the caller's own is wrapped. 0 is the legacy default stream, torch's default.
        current = torch.cuda.current_stream(dev)
        on = (current if current.cuda_stream == stream else
              torch.cuda.default_stream(dev) if stream == 0 else
              torch.cuda.ExternalStream(stream, device=dev))
        with torch.cuda.device(self._device), torch.cuda.stream(on):
            yield

    def _stream_order(self, stream: int) -> None:
        """Before torch touches what a queued driver copy writes or reads: on CUDA the
        stream orders them; CPU tensors (the tests' driver) run at once, so the
        stream's queued copies are run first."""
        if not self.is_cuda:
            self._drv.stream_synchronize(stream)

    def _index(self, ids: np.ndarray) -> Any:
        """The block ids as an index tensor on the device, queued on the stream."""
        arr = np.ascontiguousarray(ids, dtype=np.int64)
        if not self.is_cuda:
            return self._torch.from_numpy(arr)
        # Through pinned memory (torch's host allocator keeps the block until the copy
        # is done): an async copy from pageable memory first waits for everything
        # queued on the stream, the engine's work included.
        host = self._torch.empty(len(arr), dtype=self._torch.int64, pin_memory=True)
        host.numpy()[:] = arr
        return host.to(self._views[0][0].device, non_blocking=True)

    @contextmanager
    def _transfer(self, chunk_tokens: int, n_objects: int,
                  stream: int) -> Iterator[tuple[Any, int, int, int]]:
        """A transfer of ``n_objects`` chunk objects, holding the buffer, on ``stream``:
        (the staging buffer, blocks per chunk, bytes of one (plane, layer) row of a chunk
        object, chunk objects per round)."""
        per = chunk_tokens // self._g.block_size
        width = chunk_tokens * self._hidden_units * self._unit
        obj = len(self._views) * self._g.num_layers * width
        k_max = max(1, min(n_objects, STAGING_LIMIT_BYTES // max(1, obj)))
        with self._lock, self._on_stream(stream):
            self._check_open()
            yield self._ensure_staging(k_max * obj), per, width, k_max

    def _staged(self, staging: Any, k: int, per: int) -> Any:
        """A round's part of the staging buffer as ``[planes, layers, k * per blocks,
        block_size, heads, row]``: the chunk objects' rows, (plane, layer)-major."""
        planes, g = len(self._views), self._g
        n = planes * g.num_layers * k * per * g.block_size * self._hidden_units
        return staging[: n * self._unit].view(self._dtype).view(
            planes, g.num_layers, k * per, g.block_size, -1, self._row)

    def _dma(self, width: int, k: int, addrs: Sequence[int], stream: int,
             to_slots: bool) -> None:
        """One 2-D copy per chunk object between its slot (rows of ``width`` bytes, one
        per (plane, layer), contiguous) and its columns of the staging buffer (rows
        ``k * width`` apart)."""
        rows, base = len(self._views) * self._g.num_layers, self._staging_ptr
        for s, addr in enumerate(addrs):
            if to_slots:
                self._drv.memcpy_2d_async(int(addr), width, base + s * width, k * width,
                                          width, rows, stream)
            else:
                self._drv.memcpy_2d_async(base + s * width, k * width, int(addr), width,
                                          width, rows, stream)

    def store(self, ids: np.ndarray, slot_addrs: Sequence[int],
              chunk_indices: Sequence[int], chunk_tokens: int, stream: int) -> None:
        """Blocks -> slots: slot ``slot_addrs[i]`` gets chunk ``chunk_indices[i]`` of
        the key (its blocks ``ids[ci * per : (ci + 1) * per]``). Queued on ``stream``."""
        with self._transfer(chunk_tokens, len(slot_addrs), stream) as (staging, per, width,
                                                                     k_max):
            for first in range(0, len(slot_addrs), k_max):
                addrs = slot_addrs[first:first + k_max]
                if first:
                    self._stream_order(stream)  # the last round's DMAs read the buffer
                idx = self._index(np.concatenate(
                    [ids[ci * per:(ci + 1) * per] for ci in chunk_indices[first:first + k_max]]))
                stg = self._staged(staging, len(addrs), per)
                for p, views in enumerate(self._views):
                    for layer, view in enumerate(views):
                        self._torch.index_select(view, 0, idx, out=stg[p, layer])
                self._dma(width, len(addrs), addrs, stream, to_slots=True)

    def retrieve(self, ids: np.ndarray, slot_addrs: Sequence[int], chunk_tokens: int,
                 skip_blocks: int, stream: int) -> None:
        """Slots -> blocks: slot ``i`` holds chunk ``i`` of the key; the key's first
        ``skip_blocks`` blocks are left untouched. Queued on ``stream``. Block ids must
        be distinct (:meth:`can_scatter`)."""
        with self._transfer(chunk_tokens, len(slot_addrs), stream) as (staging, per, width,
                                                                     k_max):
            for first in range(0, len(slot_addrs), k_max):
                addrs = slot_addrs[first:first + k_max]
                start, end = first * per, (first + len(addrs)) * per
                skip = min(end - start, max(0, skip_blocks - start))
                if start + skip == end:
                    continue  # every block of this round is skipped
                self._dma(width, len(addrs), addrs, stream, to_slots=False)
                self._stream_order(stream)
                idx = self._index(ids[start + skip:end])
                stg = self._staged(staging, len(addrs), per)
                for p, views in enumerate(self._views):
                    for layer, view in enumerate(views):
                        view.index_copy_(0, idx, stg[p, layer, skip:])

    @staticmethod
    def can_scatter(ids: np.ndarray) -> bool:
        """A scatter writes every block once: block ids repeated within one RETRIEVE
        (the null block 0 of padded tables) keep the ordered copy plan, whose last
        write wins."""
        return len(np.unique(ids)) == len(ids)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this CudaKVCache is closed; allocate a new one")
