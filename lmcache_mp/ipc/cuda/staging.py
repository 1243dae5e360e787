"""Engine-driven transfers for GPU caches: this client copies between its CUDA KV
blocks and the server's shared-memory L1 pool with CUDA copies, so nothing CUDA
crosses the process boundary (no memory handle, no event handle).

That is what works where CUDA IPC does not: memory from CUDA's virtual memory
management (PyTorch ``expandable_segments``, vLLM's cumem allocator), Jetson-class
(Tegra) devices, and containers that share only ``/dev/shm`` with the server.

How one transfer runs (called from :mod:`lmcache_mp.session.engine_driven` between PREPARE_*
and COMMIT_*, after every slot was checked):

* the pool mapping is page-locked (``cudaHostRegister``, portable), so copies to and
  from it are DMA: a small pool before the first copy goes on, a large one (a
  server's L1: GiBs) on a thread of its own, the copies meanwhile pageable, never on
  the caller's thread; a restarted server's pool from when the client maps it. A pool
  that cannot be pinned (``RLIMIT_MEMLOCK``) is copied pageable, slower but correct.
  The pinning is undone before the pool is unmapped. Like the rest of the memory
  layer this never imports :mod:`lmcache_mp.protocol`.
* how the blocks move: by default the gather path (:mod:`.gather`: gathers or
  scatters on the GPU through a staging buffer, one DMA per chunk object) when torch
  can view the cache's memory; else, and for a RETRIEVE naming a block twice or when
  not one chunk object of staging can be allocated, the copy plan below.
  ``LMCACHE_MP_GPU_COPY=plan`` forces the plan (to compare; tests).
* the copy plan (:func:`store_plan` / :func:`retrieve_plan`): a chunk object is
  token-major (``[2, layers, tokens, heads * head_dim]``) and an HND block head-major,
  so one ``cudaMemcpy3DAsync`` per (K/V, layer, head, run of consecutive block ids), or
  a ``cudaMemcpy2DAsync`` per block of the run if the driver refuses 3-D copies; an NHD
  block ``[block_size, heads * head_dim]`` is one contiguous run of the chunk, and so
  are blocks with one head or MLA: one 1-D copy per (K/V, layer, run of consecutive
  block ids). vLLM's fused K/V layers are one plane planned the same way (their
  objects are ``[layers, tokens, heads * C]``); blocks-first ones have their blocks a
  page apart, so a run of blocks is never one copy there.
* the copies go on the caller's stream, after the work already queued there (the
  engine's writes of the blocks; the gather path's DMAs on a copy stream of its own,
  ordered by events), and the host waits for them before returning, or raising:
  for STORE because COMMIT_STORE publishes the slots, for RETRIEVE because
  COMMIT_RETRIEVE releases the read locks that keep the server from reusing them. Work
  the caller queues afterwards on that stream sees the retrieved blocks.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...errors import InvalidArgument
from ..base import ExportableKVCache, KVGeometry
from ..paged_copy import block_runs
from .cache import CudaKVCache
from .driver import CudaDriver, CudaError
from .export import on_device
from .gather import GatherCopier, StagingUnavailable

__all__ = ["CopyDriver", "CopyPlan", "PoolLike", "PoolPin", "PIN_WAIT_BYTES", "store_plan",
           "retrieve_plan", "run_plan", "device_copy_into_slots", "device_copy_from_slots",
           "pinned_pools", "unpin", "TransferFailed"]

log = logging.getLogger("lmcache_mp")


class CopyDriver(CudaDriver, Protocol):
    """The CUDA calls of engine-driven copies (CudaBindingsDriver has them; a driver
    without ``memcpy_3d_async`` gets 2-D copies only)."""

    def host_register(self, ptr: int, nbytes: int) -> None: ...
    def host_unregister(self, ptr: int) -> None: ...
    def memcpy_2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                        height: int, stream: int) -> None: ...


# ------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class CopyPlan:
    """Copy ``i`` moves ``depth[i]`` slices of ``height`` rows of ``width[i]`` bytes from
    ``src[i]`` to ``dst[i]``: rows ``spitch`` / ``dpitch`` apart (0: contiguous), slices
    ``slice_pitch`` apart on both sides (a run of consecutive blocks). In this order."""

    dst: np.ndarray
    src: np.ndarray
    width: np.ndarray
    depth: np.ndarray
    height: int
    dpitch: int
    spitch: int
    slice_pitch: int = 0

    def __len__(self) -> int:
        return len(self.dst)

    @property
    def nbytes(self) -> int:
        return int((self.width * self.depth).sum()) * self.height


def _block_major(g: KVGeometry, layer_ptrs: Sequence[int], ids: np.ndarray,
                 chunk_tokens: int) -> tuple[np.ndarray, np.ndarray, int, int, int, int]:
    """For every (K/V, layer) x block position x head, in that order: the block's device
    address and the offset in the chunk object (arrays shaped ``[kv * layers, blocks,
    heads]``; MLA: ``[layers, blocks, 1]``), then width, height, the pitch on the block
    side and the pitch on the chunk side."""
    it = g.itemsize
    ids = np.asarray(ids, dtype=np.int64)
    pos = np.arange(len(ids), dtype=np.int64)
    layers = np.asarray(layer_ptrs, dtype=np.int64)
    nl = len(layers)
    if not g.mla and not g.fused and g.layout == "NHD":
        # layer [2, num_blocks, block_size, heads * head_dim]: a block is one row of
        # block_size * heads * head_dim, as is its run of the chunk's tokens
        row = g.block_size * g.hidden_dim * it
        kv = np.arange(2, dtype=np.int64)[:, None, None]
        lay = np.arange(nl, dtype=np.int64)[None, :, None]
        dev = layers[None, :, None] + (kv * g.num_blocks + ids[None, None, :]) * row
        obj = ((kv * nl + lay) * chunk_tokens + pos[None, None, :] * g.block_size) \
            * g.hidden_dim * it
        shape = (2 * nl, len(ids), 1)
        return dev.reshape(shape), obj.reshape(shape), row, 1, row, row
    if g.mla or (g.fused and (g.layout == "NHD" or g.num_heads == 1)):
        # layer [blocks, block_size, head_dim] -> object [layers, tokens, head_dim]
        # (fused NHD: a block [block_size, heads, C] -> [layers, tokens, heads * C])
        row = g.block_size * g.hidden_dim * it
        dev = layers[:, None] + ids[None, :] * g.block_step * it
        obj = (np.arange(nl, dtype=np.int64)[:, None] * chunk_tokens
               + pos[None, :] * g.block_size) * g.hidden_dim * it
        return dev[:, :, None], obj[:, :, None], row, 1, row, row
    h, bs, d = g.num_heads, g.block_size, g.head_dim
    if g.fused:
        # layer [blocks, heads, block_size, C] (HND interior), one plane
        lay1 = np.arange(nl, dtype=np.int64)[:, None, None]
        heads1 = np.arange(h, dtype=np.int64)[None, None, :]
        dev = (layers[:, None, None] + ids[None, :, None] * g.block_step * it
               + heads1 * bs * d * it)
        obj = ((lay1 * chunk_tokens + pos[None, :, None] * bs) * h * d * it
               + heads1 * d * it)
        return dev, obj, d * it, bs, d * it, h * d * it
    kv = np.arange(2, dtype=np.int64)[:, None, None, None]
    lay = np.arange(nl, dtype=np.int64)[None, :, None, None]
    heads = np.arange(h, dtype=np.int64)[None, None, None, :]
    # layer [2, num_blocks, heads, block_size, head_dim] (HND)
    dev = (layers[None, :, None, None]
           + ((kv * g.num_blocks + ids[None, None, :, None]) * h + heads) * bs * d * it)
    # object [2, layers, tokens, heads * head_dim]: a head's rows are h * d apart
    obj = (((kv * nl + lay) * chunk_tokens + pos[None, None, :, None] * bs) * h * d * it
           + heads * d * it)
    shape = (2 * nl, len(ids), h)
    return dev.reshape(shape), obj.reshape(shape), d * it, bs, d * it, h * d * it


def _build(g: KVGeometry, layer_ptrs: Sequence[int],
           chunks: Sequence[tuple[np.ndarray, int, int]], chunk_tokens: int,
           to_slots: bool) -> CopyPlan:
    """The plan for ``chunks`` of ``(block ids, blocks to skip, slot address)``.

    Several heads (HND): one copy per (K/V, layer, head, run of consecutive block ids):
    a block's rows of one head are ``head_dim`` apart on the block side and ``heads *
    head_dim`` apart in the chunk, so a block takes a 2-D copy, and the next block of a
    run is one block (``heads * block_size * head_dim``) further on both sides, so a run
    is a 3-D copy. NHD, one head or MLA: a block is contiguous on both sides, merged
    into 1-D copies as long as the block ids run on."""
    deep = not g.mla and g.layout == "HND" and g.num_heads > 1
    devs, objs, depths = [], [], []
    width = height = bpitch = cpitch = 0
    for ids, skip, addr in chunks:
        dev, obj, width, height, bpitch, cpitch = _block_major(g, layer_ptrs, ids, chunk_tokens)
        if deep and g.block_stride:
            # blocks a page apart on the device side only: one 2-D copy per block
            dev, obj = dev[:, skip:, :], obj[:, skip:, :]
            depths.append(np.ones(dev.size, np.int64))
        elif deep:
            runs = block_runs(np.asarray(ids[skip:], dtype=np.int64))
            at = np.array([skip + p for p, _, _ in runs], dtype=np.int64)
            n = np.array([n for _, _, n in runs], dtype=np.int64)
            dev, obj = dev[:, at, :], obj[:, at, :]
            depths.append(np.broadcast_to(n[None, :, None], dev.shape).reshape(-1))
        else:
            dev, obj = dev[:, skip:, :], obj[:, skip:, :]
            depths.append(np.ones(dev.size, np.int64))
        devs.append(dev.reshape(-1))
        objs.append(obj.reshape(-1) + int(addr))
    dev_all = np.concatenate(devs) if devs else np.zeros(0, np.int64)
    obj_all = np.concatenate(objs) if objs else np.zeros(0, np.int64)
    depth = np.concatenate(depths) if depths else np.zeros(0, np.int64)
    widths = np.full(len(dev_all), width, np.int64)
    slice_pitch = g.num_heads * g.block_size * g.head_dim * g.itemsize if deep else 0
    plan = (CopyPlan(obj_all, dev_all, widths, depth, height, cpitch, bpitch, slice_pitch)
            if to_slots else
            CopyPlan(dev_all, obj_all, widths, depth, height, bpitch, cpitch, slice_pitch))
    return plan if deep else _merged(plan)


def _merged(plan: CopyPlan) -> CopyPlan:
    """Rows contiguous on both sides (one head, MLA) become one 1-D copy, and 1-D copies
    that continue each other on both sides become one."""
    if len(plan) == 0:
        return plan
    assert plan.height == 1 or plan.width[0] == plan.spitch == plan.dpitch
    width = plan.width * plan.height
    dst, src = plan.dst, plan.src
    joins = (dst[1:] == dst[:-1] + width[:-1]) & (src[1:] == src[:-1] + width[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    widths = np.add.reduceat(width, starts)
    return CopyPlan(dst[starts], src[starts], widths, np.ones(len(starts), np.int64), 1, 0, 0)


def store_plan(g: KVGeometry, layer_ptrs: Sequence[int], ids: np.ndarray,
               slot_addrs: Sequence[int], chunk_indices: Sequence[int],
               chunk_tokens: int) -> CopyPlan:
    """Blocks -> slots: slot ``slot_addrs[i]`` gets chunk ``chunk_indices[i]`` of the
    key, whose blocks are ``ids[ci * per_chunk : (ci + 1) * per_chunk]``."""
    per = chunk_tokens // g.block_size
    chunks = [(ids[ci * per:(ci + 1) * per], 0, int(addr))
              for addr, ci in zip(slot_addrs, chunk_indices, strict=True)]
    return _build(g, layer_ptrs, chunks, chunk_tokens, to_slots=True)


def retrieve_plan(g: KVGeometry, layer_ptrs: Sequence[int], ids: np.ndarray,
                  slot_addrs: Sequence[int], chunk_tokens: int,
                  skip_blocks: int) -> CopyPlan:
    """Slots -> blocks: slot ``i`` holds chunk ``i`` of the key; the first
    ``skip_blocks`` blocks of the key are left untouched."""
    per = chunk_tokens // g.block_size
    chunks = [(ids[ci * per:(ci + 1) * per], min(per, max(0, skip_blocks - ci * per)),
               int(addr)) for ci, addr in enumerate(slot_addrs)]
    return _build(g, layer_ptrs, chunks, chunk_tokens, to_slots=False)


# Set once a driver refused a 3-D copy: runs are then sent as 2-D copies, block by block.
_no_3d: list[str] = []


def run_plan(drv: CopyDriver, plan: CopyPlan, stream: int) -> None:
    """Enqueue every copy of ``plan`` on ``stream``, in order."""
    height, dp, sp, zp = plan.height, plan.dpitch, plan.spitch, plan.slice_pitch
    copy2d = drv.memcpy_2d_async
    copy3d = None if _no_3d else getattr(drv, "memcpy_3d_async", None)
    for dst, src, width, depth in zip(plan.dst.tolist(), plan.src.tolist(),
                                      plan.width.tolist(), plan.depth.tolist(), strict=True):
        if depth > 1 and copy3d is not None:
            try:
                copy3d(dst, dp, zp // dp, src, sp, zp // sp, width, height, depth, stream)
                continue
            except CudaError as exc:
                # Raised before anything was queued: send this run and the rest as 2-D.
                log.warning("lmcache_mp: cudaMemcpy3DAsync refused (%s); engine-driven "
                            "copies use one 2-D copy per block from now on", exc)
                _no_3d.append(str(exc))
                copy3d = None
        for z in range(depth):
            copy2d(dst + z * zp, dp or width, src + z * zp, sp or width, width, height, stream)


# ---------------------------------------------------- page-locking the pool
class PoolLike(Protocol):
    """What the copies need of the session's pool (lmcache_mp.session.engine_driven
    .Pool, which this layer does not import): its bytes, the page-locking record of its
    mapping, the hooks run before it is unmapped, and the hooks its client runs on
    every pool it maps from then on."""

    @property
    def view(self) -> np.ndarray: ...
    @property
    def pinning(self) -> dict[str, Any]: ...
    @property
    def before_unmap(self) -> set[Callable[[np.ndarray], None]]: ...
    @property
    def on_new_map(self) -> list[Callable[[Any], None]]: ...


#: A pool up to this size is page-locked before the copy that first needs it goes on
#: (a few ms); a larger one (a server's L1 is GiBs: roughly 0.1-0.3 s per GiB) on a
#: thread of its own, the copies meanwhile pageable (slower, never wrong), never on
#: the caller's (vLLM's forward) thread.
PIN_WAIT_BYTES = 64 << 20

#: Seconds the interpreter's exit waits for page-lockings still running (see
#: :func:`_finish_pinning_at_exit`).
PIN_EXIT_WAIT_S = 30.0

_pin_lock = threading.Lock()
# pool address -> its page-locking, for pinned_pools() / unpin(view): the record that
# counts is the mapping's own (Pool.pinning), so an address reused by a new mapping
# never inherits an old mapping's state.
_pinned: dict[int, PoolPin] = {}
_pinning: set[threading.Thread] = set()  # page-locking threads not finished
_pinning_lock = threading.Lock()  # for _pinning (PoolPin is made under _pin_lock)


def _finish_pinning_at_exit() -> None:
    """At the interpreter's exit (atexit: before CUDA's own teardown, which runs when
    the process exits after Python finalised), wait up to :data:`PIN_EXIT_WAIT_S` for
    the page-locking threads still inside ``cudaHostRegister``. They are daemons (a
    process that ends while a large pool is being pinned must not hang), and a
    daemon still in a CUDA call while the runtime destroys its context is undefined
    behaviour (a crash at exit, at best)."""
    with _pinning_lock:
        threads = list(_pinning)
    deadline = time.monotonic() + PIN_EXIT_WAIT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    left = [t for t in threads if t.is_alive()]
    if left:
        log.warning("lmcache_mp: %d page-locking thread(s) still inside cudaHostRegister "
                    "after %.0f s at exit", len(left), PIN_EXIT_WAIT_S)


atexit.register(_finish_pinning_at_exit)


class PoolPin:
    """The page-locking of one pool mapping (``cudaHostRegister``, portable: for every
    context), done on a thread of its own, undone before the mapping goes."""

    def __init__(self, drv: CopyDriver, device: int, view: np.ndarray) -> None:
        self.address, self.nbytes = int(view.ctypes.data), int(view.nbytes)
        self._drv, self._device = drv, device
        self.pinned = False
        self.done = threading.Event()
        self._undone = False
        # A daemon, waited for at exit (_finish_pinning_at_exit), bounded.
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="lmcache-mp-pin-pool")
        with _pinning_lock:
            _pinning.add(self._thread)
        try:
            self._thread.start()
        except BaseException:
            with _pinning_lock:
                _pinning.discard(self._thread)
            raise

    def _run(self) -> None:
        try:
            with on_device(self._drv, self._device):
                self._drv.host_register(self.address, self.nbytes)
            self.pinned = True
        except CudaError as exc:
            log.warning("lmcache_mp: cannot page-lock the server's %d-byte L1 pool (%s); "
                        "%s", self.nbytes, exc, _pin_advice(exc.code))
        finally:
            self.done.set()
            with _pinning_lock:
                _pinning.discard(threading.current_thread())

    def undo(self, _view: object = None) -> None:
        """Unregister (after the registration finished); once. A before_unmap hook."""
        self._thread.join()
        with _pin_lock:
            if self._undone:
                return
            self._undone = True
            if _pinned.get(self.address) is self:
                del _pinned[self.address]
        if self.pinned:
            try:
                with on_device(self._drv, self._device):
                    self._drv.host_unregister(self.address)
            except CudaError as exc:
                log.warning("lmcache_mp: cudaHostUnregister of the L1 pool failed: %s", exc)


#: cudaHostRegister's refusals whose cause the warning can name (CUDA runtime codes).
_OUT_OF_LOCKABLE_MEMORY = 2  # cudaErrorMemoryAllocation
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def _pin_advice(code: int | None) -> str:
    """What a refused page-locking means for the copies and what to do, by CUDA's
    error code (the warning's end)."""
    if code == _ALREADY_REGISTERED:
        # Not ours to undo either: whoever registered it unregisters it.
        return ("other code in this process page-locked memory at this address and did "
                "not unregister it; lmcache_mp leaves that registration alone")
    # Pageable copies still work (staged by the driver): slower, not wrong.
    slower = "engine-driven GPU copies will be pageable and slower"
    if code == _OUT_OF_LOCKABLE_MEMORY:
        return f"{slower}. Raise RLIMIT_MEMLOCK (ulimit -l) to fix this"
    return slower


class _PinNewMaps:
    """A client's hook: every pool it maps from now on (a restarted server's new
    segment) starts being page-locked when it is mapped, before any copy needs it."""

    def __init__(self, drv: CopyDriver, device: int) -> None:
        self.drv, self.device = drv, device

    def __call__(self, pool: PoolLike) -> None:
        _pin(self.drv, self.device, pool)


def _pin(drv: CopyDriver, device: int, pool: PoolLike) -> PoolPin:
    """The pool mapping's page-locking, started now if it was not."""
    with _pin_lock:
        pin = pool.pinning.get("cuda")
        if pin is None:
            pin = pool.pinning["cuda"] = PoolPin(drv, device, pool.view)
            _pinned[pin.address] = pin
            pool.before_unmap.add(pin.undo)
        if not any(isinstance(h, _PinNewMaps) for h in pool.on_new_map):
            pool.on_new_map.append(_PinNewMaps(drv, device))
    return pin


def start_pinning(cache: ExportableKVCache, pool: PoolLike) -> None:
    """When a registration maps the pool (not in the first copy, on the caller's
    thread, which may be vLLM's forward thread): page-lock it on a thread of its own."""
    if isinstance(cache, CudaKVCache) and not cache.closed:
        drv: Any = cache.driver
        _pin(drv, cache.device, pool)


def _ensure_pinned(drv: CopyDriver, device: int, pool: PoolLike) -> None:
    """Before a copy: the pool is page-locked, or being page-locked on its own thread
    (a large pool: this copy goes pageable), or could not be (pageable for good)."""
    pin = _pin(drv, device, pool)
    if not pin.done.is_set() and pin.nbytes <= PIN_WAIT_BYTES:
        pin.done.wait()


def unpin(view: np.ndarray) -> None:
    """Undo the page-locking of the pool mapping at ``view`` (the pool's unmapping
    does this itself; for pools a caller maps)."""
    with _pin_lock:
        pin = _pinned.get(int(view.ctypes.data))
    if pin is not None:
        pin.undo()


def pinned_pools() -> dict[int, int | None]:
    """Pool address -> pinned bytes (None: copied pageable), for every pool whose
    page-locking has finished. For tests and the doctor."""
    with _pin_lock:
        return {a: p.nbytes if p.pinned else None for a, p in _pinned.items()
                if p.done.is_set()}


# ------------------------------------------------- the engine-driven seam
_staging_warned: list[str] = []  # the first StagingUnavailable, said once


def _warn_staging(exc: StagingUnavailable) -> None:
    if not _staging_warned:
        _staging_warned.append(str(exc))
        log.warning("lmcache_mp: engine-driven GPU copies fall back to the copy plan "
                    "(slower): %s", exc)


def _cache_parts(cache: ExportableKVCache, stream: Any) -> tuple[CudaKVCache, CopyDriver, int]:
    if not isinstance(cache, CudaKVCache):
        raise InvalidArgument(f"engine-driven CUDA copies need a CudaKVCache, got "
                              f"{type(cache).__name__}")
    if cache.closed:
        raise InvalidArgument("this CudaKVCache is closed; allocate a new one")
    drv: Any = cache.driver
    return cache, drv, cache.resolve_stream(stream)


class TransferFailed(CudaError):
    """An engine-driven copy failed once work of it may have been queued (a CUDA call,
    a torch kernel, the host's wait). Raised only after the host waited for what was
    queued, so the COMMIT that follows finds no copy of ours still running; what the
    copy left behind is said in the message (STORE: slots the COMMIT_STORE publishes
    partly written; RETRIEVE: blocks partly written)."""


_AFTERMATH = {
    "STORE": "the server's reserved slots may be partly written, and the COMMIT_STORE "
             "that releases them publishes them as they are (LMCache's protocol has no "
             "abort): a later LOOKUP may hit this key's chunks with wrong bytes until they "
             "are evicted; clear() the server's cache if that matters",
    "RETRIEVE": "the blocks of this transfer may be partly written: treat them as not "
                "loaded (compute them again)",
}


def _copy(cache: ExportableKVCache, stream: Any, pool: PoolLike, direction: str,
          gather: Callable[[GatherCopier, int], bool],
          plan: Callable[[CudaKVCache], CopyPlan]) -> None:
    """One engine-driven transfer: the pool pinned, the blocks moved by the gather path
    (``gather`` returns False where it cannot: the plan then; it waits for its own
    work) or the copy plan, and the stream synchronised before returning or raising:
    the COMMIT that follows (COMMIT_STORE publishes the slots, COMMIT_RETRIEVE lets
    the server reuse them) must find no copy of ours still running, on an error path
    too (a copy that raised after others were queued). A failure there is raised as
    :class:`TransferFailed` (an :class:`~lmcache_mp.errors.LMCacheMPError`, torch's
    errors included, so callers that handle this library's errors see the transfer
    fail rather than crash)."""
    cuda, drv, handle = _cache_parts(cache, stream)
    copier = cuda.gather_copier()
    with on_device(drv, cuda.device):
        _ensure_pinned(drv, cuda.device, pool)
        try:
            try:
                try:
                    moved = copier is not None and gather(copier, handle)
                except StagingUnavailable as exc:  # raised before anything was queued
                    _warn_staging(exc)
                    moved = False
                if not moved:
                    run_plan(drv, plan(cuda), handle)
            finally:
                drv.stream_synchronize(handle)
        except (CudaError, RuntimeError) as exc:  # torch's errors are RuntimeErrors
            raise TransferFailed(f"engine-driven {direction} copy failed ({exc}); "
                                 f"{_AFTERMATH[direction]}",
                                 call=getattr(exc, "call", type(exc).__name__),
                                 code=getattr(exc, "code", None)) from exc


def device_copy_into_slots(cache: ExportableKVCache, ids: np.ndarray, targets: Sequence[np.ndarray],
                           chunk_indices: Sequence[int], pool: PoolLike,
                           chunk_tokens: int, stream: Any) -> None:
    """STORE: copy the blocks of chunks ``chunk_indices`` into the checked slot views
    ``targets`` (pool memory), and wait for the copies before returning."""
    addrs = [int(t.ctypes.data) for t in targets]

    def gather(copier: GatherCopier, handle: int) -> bool:
        copier.store(ids, addrs, chunk_indices, chunk_tokens, handle)
        return True

    _copy(cache, stream, pool, "STORE", gather, lambda cuda: store_plan(
        cuda.geometry, cuda.layer_ptrs, ids, addrs, chunk_indices, chunk_tokens))


def device_copy_from_slots(cache: ExportableKVCache, ids: np.ndarray, sources: Sequence[np.ndarray],
                           pool: PoolLike, chunk_tokens: int, skip_blocks: int,
                           stream: Any) -> None:
    """RETRIEVE: copy the checked slot views ``sources`` into the blocks, leaving the
    first ``skip_blocks`` alone, and wait for the copies before returning."""
    addrs = [int(s.ctypes.data) for s in sources]

    def gather(copier: GatherCopier, handle: int) -> bool:
        if not copier.can_scatter(ids[skip_blocks:]):
            return False
        copier.retrieve(ids, addrs, chunk_tokens, skip_blocks, handle)
        return True

    _copy(cache, stream, pool, "RETRIEVE", gather, lambda cuda: retrieve_plan(
        cuda.geometry, cuda.layer_ptrs, ids, addrs, chunk_tokens, skip_blocks))
