"""Engine-driven GPU copies as gathers (STORE) or scatters (RETRIEVE) on the GPU,
through a device staging buffer, and one DMA per chunk object.

Why. A chunk object is token-major (``[planes, layers, tokens, heads * head_dim]``)
and the cache's blocks are wherever vLLM's block table says, in the layout the engine
chose (HND, NHD, fused K/V, blocks-first, MLA, padded strides). Copying that with the
copy engine alone (:func:`~lmcache_mp.ipc.cuda.staging.run_plan`) takes one
``cudaMemcpy2D/3DAsync`` per (plane, layer, head, run of consecutive blocks):
thousands of small DMAs per transfer, 4-5 GB/s on an H200 against a 52-55 GB/s pinned
copy, 1.4 GB/s for blocks-first layouts (2026-12-04). Here the reordering is done by
the GPU, at HBM speed, and the PCIe side is one large DMA per chunk object:

* STORE, per round of chunk objects: one ``index_select`` of the round's blocks into
  a region of the staging buffer ``[planes, layers, k * tokens, hidden]``, then one
  ``cudaMemcpy2DAsync`` per chunk object into its (page-locked) pool slot.
* RETRIEVE, per round: one 2-D DMA per chunk object into a staging region, then one
  ``index_copy_`` into the blocks (the skipped leading blocks left out of the index).
* Kernels: where the layers sit at one constant stride in one allocation (vLLM's own
  layouts: one tensor for all layers), one gather / scatter per round moves every
  plane and layer; otherwise one per layer (both planes).

Ordering (what makes it safe for any caller; CUDA Runtime API: stream semantics,
``cudaEventRecord``, ``cudaStreamWaitEvent``, ``cudaStreamSynchronize``):

* The gathers and scatters run on the caller's stream, after the engine's work queued
  there; the DMAs on a copy stream of this cache's own (non-blocking, as torch's
  streams are). Two staging regions alternate, so a round's DMAs overlap the next
  round's gather (STORE) or the previous round's scatter (RETRIEVE). Events order
  each hand-over: a region is DMA'd only after its gather (an event on the caller's
  stream the copy stream waits for), and the reverse for RETRIEVE. The wait before a
  region is reused (its DMAs of round r - 2 done before round r gathers into it, or
  its scatter before round r's DMA) is made at round r, not right after round r - 2:
  ``cudaStreamWaitEvent`` holds *every* later operation of the waiting stream, so a
  wait placed earlier would hold round r - 1 too, which uses the other region.
* Staging and the device block ids are allocated for the caller's stream (inside
  its torch stream): torch's caching allocator may hand back a block an engine tensor
  freed on that stream with kernels still queued on it, safe only for work queued on
  that stream later. The gathers and scatters are; a RETRIEVE's first DMA into
  freshly allocated staging follows an event recorded on the caller's stream (a
  STORE's first DMA already follows the first gather's).
* One transfer at a time per cache holds the staging buffer and the pinned index
  buffer, and holds them until the host has waited for both streams
  (``cudaStreamSynchronize``, in a ``finally``: on an error path too). So transfers
  from any threads, on any streams, never share a byte of staging in flight, and
  when a transfer returns (or raises) nothing it queued is still running: the
  COMMIT that follows may publish the slots or release the server's read locks.
* The block ids reach the device through a page-locked buffer of this cache
  (``cudaMallocHost``), written by the host only while no transfer is in flight.

Memory. The staging buffer comes from torch's caching allocator (so blocks torch
holds free can serve it), sized for the transfer up to :data:`STAGING_LIMIT_BYTES`
(more chunk objects than fit move in more rounds), grown when a transfer needs more,
and freed with the cache (its ``close()``, or a finalizer when the cache is dropped).
Near the memory limit the allocation is retried smaller, down to one chunk object;
only when one chunk object does not fit do transfers use the copy plan
(:class:`StagingUnavailable`), and :attr:`GatherCopier.note` says what was chosen. A
refused size is asked again after :data:`STAGING_RETRY_S` (a moment of memory
pressure does not cap a cache for its life; a refusal is costly for the engine, so
not at every transfer), keeping the buffer held while the device still refuses.

The gather and scatter are torch operations on tensors over raw device addresses
(:meth:`GatherDriver.torch_bytes`), viewed as the widest integer type the layout
allows (bits are moved, never floats: random bf16 bits hold NaNs). With a driver whose
"device" memory is host memory (the tests' fake) the very same code runs on CPU
tensors, so CI proves the bytes against the copy plan for every layout, and the
fake's stream model proves the ordering.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import numpy as np

from ...errors import InvalidArgument
from ..base import KVGeometry
from .driver import CudaDriver, CudaError
from .export import on_device

__all__ = ["GatherDriver", "GatherCopier", "STAGING_LIMIT_BYTES", "STAGING_RETRY_S",
           "StagingUnavailable",
           "gather_unavailable", "block_views", "layer_stride"]

log = logging.getLogger("lmcache_mp")


class StagingUnavailable(CudaError):
    """Not even one chunk object of staging could be allocated; nothing of the
    transfer was queued (the copy plan moves it)."""


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

#: Seconds before a staging size the device refused is asked for again (then every
#: as long: each refusal makes torch free its cached blocks, a device-wide sync).
STAGING_RETRY_S = 60.0

_clock = time.monotonic  # for tests


class GatherDriver(CudaDriver, Protocol):
    """The driver calls the gather path needs beyond :class:`CudaDriver`."""

    def memcpy_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                        height: int, stream: int) -> None: ...

    def torch_bytes(self, ptr: int, nbytes: int, device: int) -> Any:
        """The memory at ``ptr`` as a 1-D uint8 torch tensor on the device (no copy,
        no ownership)."""
        ...

    def torch_stream(self, stream: int, device: int) -> AbstractContextManager[Any]:
        """Torch operations inside the block are queued on ``stream``."""
        ...

    def alloc_buffer(self, nbytes: int, device: int) -> int:
        """Device memory from torch's caching allocator for the current torch stream
        (CudaError when refused)."""
        ...

    def free_buffer(self, ptr: int) -> None: ...
    def malloc_host(self, nbytes: int) -> int: ...
    def free_host(self, ptr: int) -> None: ...
    def stream_create(self) -> int: ...
    def stream_destroy(self, stream: int) -> None: ...
    def event_create(self) -> Any: ...


_NEEDED = ("memcpy_2d_async", "torch_bytes", "torch_stream", "alloc_buffer", "free_buffer",
           "malloc_host", "free_host", "stream_create", "stream_destroy", "event_create")


def gather_unavailable(driver: object) -> str | None:
    """Why this driver's caches cannot use the gather path (None: they can)."""
    if os.environ.get("LMCACHE_MP_GPU_COPY", "") == "plan":
        return "LMCACHE_MP_GPU_COPY=plan"
    missing = [name for name in _NEEDED if not hasattr(driver, name)]
    if missing:
        return f"the driver {type(driver).__name__} has no {' / '.join(missing)}"
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


def layer_stride(driver: CudaDriver, g: KVGeometry, ptrs: Sequence[int]) -> int | None:
    """The bytes between consecutive layers when they are all at one stride in one
    allocation (so one view spans them all: one gather for every layer), else None."""
    if len(ptrs) == 1:
        return 0
    step = ptrs[1] - ptrs[0]
    if step <= 0 or any(b - a != step for a, b in zip(ptrs[:-1], ptrs[1:], strict=True)):
        return None
    try:
        base, size = driver.address_range(ptrs[0])
    except CudaError:
        return None
    return step if ptrs[-1] + g.layer_nbytes <= base + size else None


def _block_axes(g: KVGeometry, unit: int) -> tuple[tuple[int, ...], tuple[int, ...],
                                                   list[int]]:
    """A layer's blocks as ``[num_blocks, block_size, heads, row]`` (token-major inside
    a block, whatever the layout), ``row`` in ``unit``-byte integers: the shape, the
    strides, and each plane's offset (units)."""
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
    return (nb, bs, h, row), (step, *inner, 1), offsets


def block_views(g: KVGeometry, layers: Sequence[Any], unit: int) -> list[Any]:
    """Per layer: its planes' blocks as ``[planes, num_blocks, block_size, heads,
    row]`` over the flat integer tensors ``layers``."""
    shape, strides, offsets = _block_axes(g, unit)
    plane = offsets[1] if len(offsets) > 1 else 0
    return [t.as_strided((len(offsets), *shape), (plane, *strides), 0) for t in layers]


def all_layer_view(g: KVGeometry, flat: Any, unit: int, stride_units: int) -> Any:
    """Every plane and layer's blocks as one ``[planes, layers, num_blocks, block_size,
    heads, row]`` view over ``flat`` (the span from layer 0, layers ``stride_units``
    apart)."""
    shape, strides, offsets = _block_axes(g, unit)
    plane = offsets[1] if len(offsets) > 1 else 0
    return flat.as_strided((len(offsets), g.num_layers, *shape),
                           (plane, stride_units, *strides), 0)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f} MiB"


class _Rounds:
    """How one transfer of ``n`` chunk objects goes through a staging buffer holding
    ``capacity``: rounds of ``per_round`` objects alternating between ``regions``
    regions (two: a round's DMAs overlap the next round's GPU work)."""

    def __init__(self, n: int, capacity: int) -> None:
        self.per_round = max(1, min(n, capacity) // 2)
        self.regions = 2 if n > self.per_round and capacity >= 2 * self.per_round else 1
        self.count = -(-n // self.per_round)  # rounds

    @property
    def overlap(self) -> bool:
        """Two regions: the DMAs go on the copy stream, ordered by events. One region
        (one round, or room for one chunk object): all on the caller's stream."""
        return self.regions == 2

    def __call__(self, n: int) -> Iterator[tuple[int, int, int, int]]:
        """(round number, first object, objects, region)."""
        for r, first in enumerate(range(0, n, self.per_round)):
            yield r, first, min(self.per_round, n - first), r % self.regions


class GatherCopier:
    """One cache's gather / scatter machinery: the views of its blocks, the staging
    buffer, the pinned index buffer, a copy stream and the events between them.
    Thread-safe: one transfer at a time, held until its work is complete."""

    def __init__(self, driver: GatherDriver, device: int, g: KVGeometry,
                 layer_ptrs: Sequence[int]) -> None:
        import torch

        self._torch = torch
        self._drv = driver
        self._device = device
        self._g = g
        self._unit = _unit(g, layer_ptrs)
        dtype = getattr(torch, _INT_TYPES[self._unit])
        stride = layer_stride(driver, g, layer_ptrs)
        # (view, the axis of its blocks, which layer of a round's staging it fills:
        # None for all of them)
        self._parts: list[tuple[Any, int, int | None]]
        if stride is not None:
            span = stride * (g.num_layers - 1) + g.layer_nbytes
            # A span of whole units (a blocks-first layer may not end on one: the views
            # never reach past its last block).
            flat = driver.torch_bytes(layer_ptrs[0], span, device)
            flat = flat[: span // self._unit * self._unit].view(dtype)
            self._parts = [(all_layer_view(g, flat, self._unit, stride // self._unit), 2,
                            None)]
        else:
            raw = [driver.torch_bytes(p, g.layer_nbytes, device) for p in layer_ptrs]
            flat_layers = [t[: g.layer_nbytes // self._unit * self._unit].view(dtype)
                           for t in raw]
            self._parts = [(view, 1, layer) for layer, view in
                           enumerate(block_views(g, flat_layers, self._unit))]
        #: Every plane and layer in one gather per round (vLLM's layouts).
        self.one_gather = stride is not None
        self._planes = 1 if g.mla or g.fused else 2
        self._dtype = dtype
        self._row = g.head_dim * g.itemsize // self._unit
        self._hidden_units = (1 if g.mla else g.num_heads) * self._row
        self._lock = threading.Lock()
        self._closed = False
        self._staging_ptr = 0
        self._staging_bytes = 0
        self._staging: Any = None
        # Staging sizes refused so far: never asked for again (a refused allocation
        # makes torch free its cache and retry: not on every transfer).
        self._ceiling: int | None = None  # most chunk objects to ask for
        self._unavailable: StagingUnavailable | None = None
        self._retry_at: float | None = None  # when a refused size is asked again
        self._index_bytes = 0
        self._host_index = 0
        self._device_index = 0
        self._index: Any = None
        self._copy_stream = 0
        self._events: dict[str, list[Any]] = {}
        #: What the staging buffer holds and why, for ``copy_path`` ("" until a
        #: transfer sized it).
        self.note = ""

    # ------------------------------------------------------------ resources
    @property
    def copy_path(self) -> str:
        """What :attr:`CudaKVCache.copy_path` says of this cache (see there)."""
        if self._unavailable is not None:
            return f"plan: {self._unavailable}"
        kernels = ("one gather per round for every layer" if self.one_gather
                   else "one gather per layer and round")
        return f"gather ({kernels}" + (f"; {self.note})" if self.note else ")")

    @property
    def staging_bytes(self) -> int:
        """Device memory the staging buffer holds now."""
        return self._staging_bytes

    def _reserve(self, want: int, obj: int) -> tuple[int, bool]:
        """A staging buffer of at least ``want`` chunk objects of ``obj`` bytes (within
        the limit), else as many as the device gives, down to one: (how many it holds,
        whether it was allocated now). Raises :class:`StagingUnavailable` before
        anything is queued if not one. Called inside the transfer's torch stream: torch
        allocates for that stream.

        Near the memory limit a refused size is not asked again for
        :data:`STAGING_RETRY_S` seconds (a refusal makes torch free every cached block
        and retry, which synchronises the device and costs the engine its cache), then
        once more: an engine's memory peak passes, and a cache lives for days."""
        want = max(1, min(want, STAGING_LIMIT_BYTES // obj or 1))
        retry = self._retry_at is not None and _clock() >= self._retry_at
        if self._unavailable is not None and not retry:
            raise self._unavailable
        if self._ceiling is not None and not retry:
            want = min(want, self._ceiling)
        have = self._staging_bytes // obj
        if have >= want:
            return have, False
        was = self._ceiling
        if retry and have:
            # Larger only: the buffer held is kept if the device still refuses more.
            n, ptr, refused = self._allocate(want, have + 1, obj)
            if not n:
                self._refused(have, want, obj, refused, quiet=True)
                return have, False
        else:
            # Nothing is in flight (the transfer lock is held, every transfer ends
            # synced): the old buffer goes back to torch's cache, where the new one may
            # reuse it.
            self._free_staging()
            n, ptr, refused = self._allocate(want, 1, obj)
            if not n:
                self._unavailable = StagingUnavailable(
                    f"cannot allocate one chunk object ({obj} bytes) of staging on device "
                    f"{self._device} ({refused[-1][1]}); set LMCACHE_MP_STAGING_MB lower, "
                    f"or leave the engine more free memory (asked again in "
                    f"{STAGING_RETRY_S:.0f} s)", call="torch.empty")
                self._ceiling, self._retry_at = None, _clock() + STAGING_RETRY_S
                raise self._unavailable
        self._free_staging()
        self._staging_ptr, self._staging_bytes = ptr, n * obj
        self._staging = self._drv.torch_bytes(ptr, n * obj, self._device)
        self._unavailable = None
        if refused:
            self._refused(n, want, obj, refused, quiet=retry and n == was)
        else:
            if self._retry_at is not None:
                log.info("lmcache_mp: the gather path's staging buffer holds %d chunk "
                         "objects again (%s)", n, _mib(n * obj))
            self._ceiling = self._retry_at = None
            self.note = f"staging {n} chunk objects, {_mib(n * obj)}"
        return n, True

    def _allocate(self, want: int, least: int, obj: int
                  ) -> tuple[int, int, list[tuple[int, CudaError]]]:
        """Ask torch for ``want`` chunk objects, halving down to ``least``: how many it
        gave (0: none), where, and the sizes it refused."""
        refused: list[tuple[int, CudaError]] = []
        n = want
        while n:
            try:
                return n, self._drv.alloc_buffer(n * obj, self._device), refused
            except CudaError as exc:
                refused.append((n, exc))
                n = max(n // 2, least) if n > least else 0
        return 0, 0, refused

    def _refused(self, n: int, want: int, obj: int,
                 refused: list[tuple[int, CudaError]], quiet: bool) -> None:
        """Staging of ``n`` objects where ``want`` were asked: say so (a warning the
        first time, then in the debug log) and ask again in STAGING_RETRY_S."""
        self._ceiling, self._retry_at = n, _clock() + STAGING_RETRY_S
        self.note = (f"staging holds {n} of {want} chunk objects ({_mib(n * obj)}; "
                     f"{_mib(refused[0][0] * obj)} refused: {refused[-1][1]}; asked "
                     f"again every {STAGING_RETRY_S:.0f} s)")
        log.log(logging.DEBUG if quiet else logging.WARNING,
                "lmcache_mp: the gather path's staging buffer holds %d of %d chunk objects "
                "(%s; %s refused: %s): more rounds per transfer, the same bytes; asked "
                "again in %.0f s; set LMCACHE_MP_STAGING_MB or leave the engine more free "
                "memory", n, want, _mib(n * obj), _mib(refused[0][0] * obj),
                refused[-1][1], STAGING_RETRY_S)

    def _free_staging(self) -> None:
        if self._staging_ptr:
            ptr, self._staging_ptr, self._staging_bytes, self._staging = \
                self._staging_ptr, 0, 0, None
            self._drv.free_buffer(ptr)

    def _index_for(self, n: int) -> None:
        """Room for ``n`` block ids on the host (page-locked) and on the device."""
        nbytes = max(4096, n * 8)
        if nbytes <= self._index_bytes:
            return
        self._free_index()
        nbytes = 1 << (nbytes - 1).bit_length()
        try:
            self._host_index = self._drv.malloc_host(nbytes)
            self._device_index = self._drv.alloc_buffer(nbytes, self._device)
        except CudaError as exc:
            self._free_index()
            raise StagingUnavailable(f"cannot allocate the {nbytes}-byte block-id buffers: "
                                     f"{exc}", call="cudaMallocHost") from exc
        self._index_bytes = nbytes
        self._index = self._drv.torch_bytes(self._device_index, nbytes,
                                            self._device).view(self._torch.int64)

    def _free_index(self) -> None:
        host, dev = self._host_index, self._device_index
        self._host_index = self._device_index = self._index_bytes = 0
        self._index = None
        if host:
            self._drv.free_host(host)
        if dev:
            self._drv.free_buffer(dev)

    def _streams_and_events(self) -> None:
        if not self._copy_stream:
            self._copy_stream = self._drv.stream_create()
            self._events = {k: [self._drv.event_create(), self._drv.event_create()]
                            for k in ("staged", "copied")}

    def close(self) -> None:
        """Free the staging and index buffers, the copy stream and its events (every
        transfer was complete when it returned). Idempotent; a cache's finalizer calls
        it when the cache is dropped unclosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._parts = []
            with on_device(self._drv, self._device):
                self._free_staging()
                self._free_index()
                for events in self._events.values():
                    for ev in events:
                        self._drv.event_destroy(ev)
                self._events = {}
                if self._copy_stream:
                    stream, self._copy_stream = self._copy_stream, 0
                    self._drv.stream_destroy(stream)

    # ------------------------------------------------------------ a transfer
    @contextmanager
    def _transfer(self, stream: int) -> Iterator[None]:
        """Hold the buffers for one transfer on ``stream``, and release them only once
        the host has waited for everything it queued, on both streams, whatever
        happened (an error midway included)."""
        with self._lock:
            if self._closed:
                raise InvalidArgument("this CudaKVCache is closed; allocate a new one")
            try:
                yield
            finally:
                try:
                    if self._copy_stream:
                        self._drv.stream_synchronize(self._copy_stream)
                finally:
                    self._drv.stream_synchronize(stream)

    def _prepare(self, chunk_tokens: int, n: int, block_ids: np.ndarray,
                 stream: int) -> tuple[_Rounds, int, int, Any, bool]:
        """Staging for ``n`` chunk objects, the streams and events, and the block ids
        on the device (queued on ``stream``): (the rounds, bytes of one (plane, layer)
        row of a chunk object, blocks per chunk, the index tensor, whether the staging
        was allocated now and the copy stream uses it)."""
        per = chunk_tokens // self._g.block_size
        width = chunk_tokens * self._hidden_units * self._unit
        capacity, fresh = self._reserve(n, self._planes * self._g.num_layers * width)
        self._index_for(len(block_ids))
        rounds = _Rounds(n, capacity)
        if rounds.overlap:
            self._streams_and_events()
        host = (ctypes.c_int64 * len(block_ids)).from_address(self._host_index)
        np.ctypeslib.as_array(host)[:] = block_ids
        nbytes = 8 * len(block_ids)
        self._drv.memcpy_2d_async(self._device_index, nbytes, self._host_index, nbytes,
                                  nbytes, 1, stream)
        return rounds, width, per, self._index[: len(block_ids)], fresh and rounds.overlap

    def _staged(self, rounds: _Rounds, region: int, k: int, per: int) -> Any:
        """Region ``region``'s first ``k`` chunk objects as ``[planes, layers, k * per
        blocks, block_size, heads, row]`` (the objects' rows, (plane, layer)-major)."""
        n = self._planes * self._g.num_layers * rounds.per_round * per * \
            self._g.block_size * self._hidden_units
        used = n // rounds.per_round * k
        flat = self._staging[region * n * self._unit: (region * n + used) * self._unit]
        return flat.view(self._dtype).view(self._planes, self._g.num_layers, k * per,
                                           self._g.block_size, -1, self._row)

    def _region_ptr(self, rounds: _Rounds, region: int, width: int) -> int:
        return self._staging_ptr + region * rounds.per_round * self._planes * \
            self._g.num_layers * width

    def _dma(self, base: int, width: int, k: int, addrs: Sequence[int], stream: int,
             to_slots: bool) -> None:
        """One 2-D copy per chunk object, on ``stream``, between its slot (rows of
        ``width`` bytes, one per (plane, layer), contiguous) and its columns of a
        staging region at ``base`` (rows ``k * width`` apart)."""
        rows = self._planes * self._g.num_layers
        for s, addr in enumerate(addrs):
            if to_slots:
                self._drv.memcpy_2d_async(int(addr), width, base + s * width, k * width,
                                          width, rows, stream)
            else:
                self._drv.memcpy_2d_async(base + s * width, k * width, int(addr), width,
                                          width, rows, stream)

    def _hand_over(self, kind: str, region: int, recorded_on: int, waiting: int) -> None:
        """Work queued on ``waiting`` from now on runs after what ``recorded_on`` has
        queued so far (an event; nothing to do when they are one stream)."""
        if recorded_on != waiting:
            event = self._events[kind][region]
            self._drv.event_record(event, recorded_on)
            self._drv.stream_wait_event(waiting, event)

    def _mark(self, rounds: _Rounds, r: int, kind: str, region: int, stream: int) -> None:
        """Round ``r`` is done with ``region`` on ``stream`` (an event), for the round
        that reuses the region (two on) to wait for; not when no round reuses it."""
        if rounds.overlap and r + 2 < rounds.count:
            self._drv.event_record(self._events[kind][region], stream)

    def _await_reuse(self, rounds: _Rounds, r: int, kind: str, region: int,
                     waiting: int) -> None:
        """Before round ``r`` reuses ``region``: ``waiting`` waits for round ``r - 2``'s
        last use of it (its :meth:`_mark`). Only there: cudaStreamWaitEvent holds every
        later operation of the stream, so a wait right after round ``r - 2`` would
        also hold round ``r - 1``, which uses the other region (no overlap)."""
        if rounds.overlap and r >= 2:
            self._drv.stream_wait_event(waiting, self._events[kind][region])

    def store(self, ids: np.ndarray, slot_addrs: Sequence[int],
              chunk_indices: Sequence[int], chunk_tokens: int, stream: int) -> None:
        """Blocks -> slots: slot ``slot_addrs[i]`` gets chunk ``chunk_indices[i]`` of
        the key (its blocks ``ids[ci * per : (ci + 1) * per]``). Returns once it is
        complete (the host waited for it)."""
        per = chunk_tokens // self._g.block_size
        n = len(slot_addrs)
        blocks = np.concatenate([ids[ci * per:(ci + 1) * per] for ci in chunk_indices])
        with self._transfer(stream), self._drv.torch_stream(stream, self._device):
            # The buffers are allocated for ``stream`` (torch may hand back a block an
            # engine tensor freed there with its kernels still queued: safe for work
            # queued there later); the first DMA follows the first gather's hand-over.
            rounds, width, per, index, _ = self._prepare(chunk_tokens, n, blocks, stream)
            copy = self._copy_stream if rounds.overlap else stream
            for r, first, k, region in rounds(n):
                self._await_reuse(rounds, r, "copied", region, stream)  # round r-2's DMAs
                staged = self._staged(rounds, region, k, per)
                self._gather(index[first * per:(first + k) * per], staged)
                self._hand_over("staged", region, stream, copy)  # DMA what was gathered
                self._dma(self._region_ptr(rounds, region, width), width, k,
                          slot_addrs[first:first + k], copy, to_slots=True)
                self._mark(rounds, r, "copied", region, copy)

    def retrieve(self, ids: np.ndarray, slot_addrs: Sequence[int], chunk_tokens: int,
                 skip_blocks: int, stream: int) -> None:
        """Slots -> blocks: slot ``i`` holds chunk ``i`` of the key; the key's first
        ``skip_blocks`` blocks are left untouched. Block ids must be distinct
        (:meth:`can_scatter`). Returns once it is complete (the host waited for it)."""
        per = chunk_tokens // self._g.block_size
        skipped_objects = min(skip_blocks // per, len(slot_addrs))
        n = len(slot_addrs) - skipped_objects
        if n == 0:
            return
        slots = slot_addrs[skipped_objects:]
        base_block = skipped_objects * per  # the first block of the first object moved
        with self._transfer(stream), self._drv.torch_stream(stream, self._device):
            rounds, width, per, index, fresh = self._prepare(
                chunk_tokens, n, ids[skip_blocks:len(slot_addrs) * per], stream)
            copy = self._copy_stream if rounds.overlap else stream
            if fresh:
                # Staging just allocated for ``stream`` may be a block whose last user's
                # kernels are still queued there: the copy stream's DMAs into it wait
                # for them. (A buffer from an earlier transfer needs no wait: that
                # transfer ended with the host waiting for its stream.)
                self._hand_over("staged", 0, stream, copy)
            for r, first, k, region in rounds(n):
                self._await_reuse(rounds, r, "staged", region, copy)  # round r-2's scatter
                self._dma(self._region_ptr(rounds, region, width), width, k,
                          slots[first:first + k], copy, to_slots=False)
                self._hand_over("copied", region, copy, stream)  # scatter what landed
                start = base_block + first * per  # the round's first block
                skip = max(0, skip_blocks - start)  # blocks of it left alone
                staged = self._staged(rounds, region, k, per)[:, :, skip:]
                self._scatter(index[start + skip - skip_blocks:
                                    start + k * per - skip_blocks], staged)
                self._mark(rounds, r, "staged", region, stream)

    def _gather(self, index: Any, staged: Any) -> None:
        torch = self._torch
        for view, axis, layer in self._parts:
            torch.index_select(view, axis, index,
                               out=staged if layer is None else staged[:, layer])

    def _scatter(self, index: Any, staged: Any) -> None:
        for view, axis, layer in self._parts:
            view.index_copy_(axis, index, staged if layer is None else staged[:, layer])

    @staticmethod
    def can_scatter(ids: np.ndarray) -> bool:
        """A scatter writes every block once: block ids repeated within one RETRIEVE
        (the null block 0 of padded tables) keep the ordered copy plan, whose last
        write wins."""
        return len(np.unique(ids)) == len(ids)
