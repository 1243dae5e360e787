"""GPU KV caches the LMCache server maps through CUDA IPC (:class:`CudaKVCache`).

Wrapper forms (:attr:`CudaKVCache.wrapper_format`, put on the wire by the server's
profile, :mod:`lmcache_mp.protocol.wrappers`): ``"auto"`` (default: the form the
server's release opens with nothing beyond LMCache's own dependencies), ``"torch_ipc"``
(torch's storage-sharing tuple; the server needs only torch) or ``"raw"`` (the bare
memory handle; the server needs cupy, and 0.5.3 also cuda-bindings <= 13.3 and
layers at their allocation's base).

Ordering. Every STORE / RETRIEVE sends the handle of an interprocess event recorded on
the caller's stream (the server's copy waits for it) and gets back the handle of the
server's completion event. That event is a local of the server's handler, destroyed
once exported, and the driver recycles IPC event slots: so, as LMCache's own client
does (``DeviceMessagingFuture`` imports every reply's handle), each one is opened
afresh, waited on (``cudaStreamWaitEvent``: work queued on the stream afterwards sees
the copied blocks) and destroyed, never cached by its bytes.
``wait_host=True`` (or :meth:`CudaKVCache.synchronize`) also waits on the host.
Transfers begun together inside :meth:`CudaKVCache.one_event` (a vLLM step's STOREs,
or its RETRIEVEs) share one event of ours: created, recorded and exported once.

``stream=None`` is torch's current stream on the cache's device when torch has
initialised CUDA in this process, else the legacy default stream (see
:func:`~lmcache_mp.ipc.cuda.export.default_stream`). Pass the stream your engine
writes the KV cache on when it is neither.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from ...checks import one_of
from ...errors import InvalidArgument
from ..base import CudaLayerExport, KVGeometry, KVLayout, LayerExport, VmmLayerExport
from .driver import CudaDriver, get_driver
from .export import (
    DeviceAllocation,
    ExportedAllocation,
    TransferEvent,
    check_device_index,
    check_server_event,
    default_stream,
    export_or_local,
    on_device,
    stream_handle,
)
from .gather import GatherCopier, gather_unavailable
from .torch_layers import checked_geometry, torch_layer_layout, torch_views

__all__ = ["CudaKVCache", "WrapperFormat", "WRAPPER_FORMATS"]

log = logging.getLogger("lmcache_mp")

WrapperFormat = Literal["auto", "raw", "torch_ipc"]
WRAPPER_FORMATS: tuple[WrapperFormat, ...] = ("auto", "raw", "torch_ipc")


def _check_wrapper(wrapper: object) -> WrapperFormat:
    one_of("wrapper", wrapper, WRAPPER_FORMATS)
    return wrapper  # type: ignore[return-value]


class CudaKVCache:
    """Per-layer GPU KV tensors the LMCache server maps through CUDA IPC.

    Build one with :meth:`allocate` (memory of its own, always exportable),
    :meth:`from_torch` (caller-owned tensors) or :meth:`from_pointers`. Layers are HND
    ``[2, num_blocks, num_heads, block_size, head_dim]`` (the default) or NHD ``[2,
    num_blocks, block_size, num_heads, head_dim]`` (``layout="NHD"``, vLLM's default),
    or MLA ``[num_blocks, block_size, head_dim]``, dense. Every release's GPU server
    reads the layout hint this cache sends (:attr:`kv_layout`). Unregister before
    closing: the server keeps mapping the memory until then.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        device: int,
        exports: Sequence[ExportedAllocation],
        *,
        driver: CudaDriver,
        owners: Sequence[object] = (),
        torch_layers: Sequence[Any] | None = None,
        wrapper: WrapperFormat = "auto",
        wait_host: bool = False,
    ) -> None:
        """Use :meth:`allocate`, :meth:`from_torch` or :meth:`from_pointers`."""
        self.geometry = geometry
        self.device = device
        self.wrapper_format: WrapperFormat = _check_wrapper(wrapper)
        #: Also block the host in end_transfer until the server's copy is done.
        self.wait_host = bool(wait_host)
        self._driver = driver
        self._exports = list(exports)
        # What keeps the memory alive: our DeviceAllocations, or the caller's tensors.
        # One owner per layer (allocate), or a single keepalive object (from_*).
        self._owners: list[object] = list(owners)
        # from_torch: the caller's own tensors are the torch views.
        self._torch_layers: list[Any] | None = None if torch_layers is None else list(
            torch_layers)
        with on_device(driver, device):
            self.device_uuid = driver.device_info(device).uuid
        self._closed = False
        # Engine-driven copies' gather / scatter machinery (made on the first copy).
        self._copier_lock = threading.Lock()
        self._copier: GatherCopier | None = None
        self._copier_finalizer: weakref.finalize[Any, Any] | None = None
        self._copier_refused: str | None = None
        #: Per thread, inside :meth:`one_event`: the shared event per stream.
        self._batch = threading.local()

    # ------------------------------------------------------------ builders
    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        dtype: str = "bfloat16",
        mla: bool = False,
        layout: KVLayout = "HND",
        device: int = 0,
        wrapper: WrapperFormat = "auto",
        wait_host: bool = False,
        driver: CudaDriver | None = None,
    ) -> CudaKVCache:
        """Allocate ``num_layers`` zero-filled layers on ``device``, one ``cudaMalloc``
        each, so every layer is the base of its own allocation (every form can carry
        it)."""
        geometry = checked_geometry(num_layers, num_blocks, block_size, num_heads, head_dim,
                                    dtype, mla, layout)
        device = check_device_index(device)
        wrapper = _check_wrapper(wrapper)
        drv = driver if driver is not None else get_driver()
        allocations: list[DeviceAllocation] = []
        with on_device(drv, device):
            try:
                for _ in range(num_layers):
                    ptr = drv.malloc(geometry.layer_nbytes)
                    allocations.append(DeviceAllocation(drv, device, ptr,
                                                        geometry.layer_nbytes))
                    drv.memset(ptr, 0, geometry.layer_nbytes)
                # cudaMemset is asynchronous to the host; finish before handing out.
                drv.synchronize_device()
                exports = [export_or_local(drv, a.ptr, a.nbytes, False) for a in allocations]
            except BaseException:
                for a in allocations:
                    a.free()
                raise
        return cls(geometry, device, exports, driver=drv, owners=allocations,
                   wrapper=wrapper, wait_host=wait_host)

    @classmethod
    def from_pointers(
        cls,
        ptrs: Sequence[int],
        *,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        dtype: str = "bfloat16",
        mla: bool = False,
        layout: KVLayout = "HND",
        fused: bool = False,
        block_stride: int = 0,
        device: int = 0,
        keepalive: object = None,
        wrapper: WrapperFormat = "auto",
        wait_host: bool = False,
        driver: CudaDriver | None = None,
        torch_layers: Sequence[Any] | None = None,
    ) -> CudaKVCache:
        """Register memory the caller owns, one device pointer per layer (dense, in
        ``layout``, or MLA, as in the class docstring; ``fused``: one plane of
        ``[num_blocks, heads, block_size, head_dim]`` (HND) or ``[num_blocks,
        block_size, heads, head_dim]`` (NHD), blocks ``block_stride`` elements apart
        when not dense). ``keepalive`` is held until close;
        ``torch_layers``, if given, are returned by :attr:`torch_layers`. A pointer may
        sit inside a larger allocation (PyTorch's caching allocator): every form but
        LMCache 0.5.3's ``raw`` carries the offset, and that one refuses at REGISTER."""
        ptrs = list(ptrs)
        if not ptrs:
            raise InvalidArgument("ptrs must hold one device pointer per layer (got none)")
        geometry = checked_geometry(len(ptrs), num_blocks, block_size, num_heads, head_dim,
                                    dtype, mla, layout, fused, block_stride)
        device = check_device_index(device)
        wrapper = _check_wrapper(wrapper)
        drv = driver if driver is not None else get_driver()
        with on_device(drv, device):
            exports: list[ExportedAllocation] = []
            for i, ptr in enumerate(ptrs):
                try:
                    exp = export_or_local(drv, ptr, geometry.layer_nbytes, True, vmm=True)
                except InvalidArgument as exc:
                    for done in exports:  # close the fds exported so far
                        if done.vmm is not None:
                            done.vmm.close()
                    raise InvalidArgument(f"layer {i}: {exc}") from None
                if exp.vmm is not None and wrapper != "auto":
                    exp.vmm.close()
                    raise InvalidArgument(
                        f"layer {i} is CUDA VMM memory, which the {wrapper!r} form (a "
                        f"cudaIpcMemHandle_t) cannot carry: use wrapper='auto' (LMCache's "
                        f"cuda_vmm descriptor)")
                if exp.device != device:
                    raise InvalidArgument(
                        f"layer {i} is on device {exp.device}, not device {device}: pass "
                        f"device={exp.device}, or one cache per device")
                exports.append(exp)
        return cls(geometry, device, exports, driver=drv,
                   owners=[] if keepalive is None else [keepalive],
                   torch_layers=torch_layers, wrapper=wrapper, wait_host=wait_host)

    @classmethod
    def from_torch(
        cls,
        layers: Sequence[Any],
        *,
        layout: KVLayout = "HND",
        mla: bool = False,
        fused: bool = False,
        wrapper: WrapperFormat = "auto",
        wait_host: bool = False,
        driver: CudaDriver | None = None,
    ) -> CudaKVCache:
        """Register caller-owned CUDA torch tensors, one per layer (same shape, strides,
        dtype, device) shaped in ``layout`` (or MLA; or vLLM 0.32+'s fused K/V layers
        ``[num_blocks, heads, block_size, 2 * head_size]`` with ``fused``, whose
        blocks may be dense or blocks-first). The memory may be dense in the other
        order (a permuted view): the cache takes the layout the strides show
        (:attr:`kv_layout`). Views into one allocation are fine (:mod:`.torch_layers`).
        A blocks-first fused cache moves engine-driven only (:attr:`server_mappable`)."""
        layers = list(layers)
        found = torch_layer_layout(layers, mla, layout, fused)
        num_blocks, num_heads, block_size, head_dim = found.dims
        return cls.from_pointers(
            [int(t.data_ptr()) for t in layers], num_blocks=num_blocks,
            block_size=block_size, num_heads=num_heads, head_dim=head_dim, dtype=found.dtype,
            mla=mla, layout=found.layout, fused=fused and not mla,
            block_stride=found.block_stride, device=found.device, keepalive=layers,
            wrapper=wrapper, wait_host=wait_host, driver=driver, torch_layers=layers)

    # --------------------------------------------------------------- views
    @property
    def layer_ptrs(self) -> list[int]:
        """Each layer's device address."""
        return [e.ptr for e in self._exports]

    @property
    def exports(self) -> list[ExportedAllocation]:
        return list(self._exports)

    @property
    def torch_layers(self) -> list[Any]:
        """The layers as CUDA torch tensors over the same memory (needs torch with
        CUDA). Tensors handed out keep the memory alive after :meth:`close`."""
        self._check_open()
        if self._torch_layers is None:
            n, owners = len(self._exports), self._owners
            self._torch_layers = torch_views(
                self.geometry, self.device, self.layer_ptrs,
                owners if len(owners) == n else [self] * n)
        return self._torch_layers

    #: This cache can be registered with ``mode="engine"``: the client copies its blocks
    #: through the server's shared-memory pool (:mod:`.staging`).
    supports_engine_driven = True

    @property
    def ipc_exportable(self) -> bool:
        """Whether CUDA IPC can share every layer (needed by ``mode="lmcache"``). False
        for VMM or pool memory, or where CUDA IPC is unsupported (Tegra): such a cache
        is registered in engine-driven mode (``mode="auto"`` picks it)."""
        return all(e.handle or e.vmm is not None for e in self._exports)

    @property
    def server_mappable(self) -> bool:
        """Whether a released LMCache server can map every layer: a legacy handle, or a
        VMM fabric export. A POSIX-fd VMM export is exportable, but no release ships the
        fd hand-off it needs, so ``mode="auto"`` registers such a cache engine-driven;
        so is a blocks-first fused cache (see :meth:`export_layers`)."""
        return not self.geometry.block_stride and all(
            e.handle or (e.vmm is not None and e.vmm.kind == "fabric")
            for e in self._exports)

    @property
    def unlinked(self) -> bool:
        # CUDA handles stay valid until the memory is freed: a cache can be registered
        # again after an unregister.
        return False

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this CudaKVCache is closed; allocate a new one")

    # ------------------------------------------------ ExportableKVCache
    def export_layers(self) -> list[LayerExport]:
        self._check_open()
        if self.geometry.block_stride:
            # LMCache's servers read blocks-first fused views from 0.5.5 only, and its
            # raw / VMM wrappers rebuild only dense tensors before 0.5.7rc2: not sent.
            raise InvalidArgument(
                "this KV cache is in a blocks-first layout (vLLM's BLHNC / BLNHC: every "
                "layer's blocks interleaved in one page), which lmcache_mp registers "
                "engine-driven only: use mode='engine' (or 'auto'), or a layer-compact "
                "layout (VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC)")
        if not self.ipc_exportable:
            reasons = sorted({e.local_reason for e in self._exports if e.local_reason})
            raise InvalidArgument(
                "this cache's memory cannot be shared with the server (memory-pool memory, "
                "VMM memory without a shareable handle type, or a device without CUDA IPC "
                "such as Tegra), so the server cannot map it: register with mode='engine' "
                "(or 'auto'), which copies blocks through the server's shared-memory pool "
                "instead" + (f". Why: {'; '.join(reasons)}" if reasons else ""))
        g = self.geometry
        return [
            CudaLayerExport(ipc_handle=e.handle, nbytes=g.layer_nbytes, alloc_offset=e.offset,
                            dtype=g.dtype, shape=g.layer_shape, stride=g.layer_strides,
                            device_index=self.device, device_uuid=self.device_uuid,
                            form=self.wrapper_format)
            if e.vmm is None else
            VmmLayerExport(export_id=e.vmm.export_id, kind=e.vmm.kind,
                           fabric_blob=e.vmm.fabric_blob, alloc_size=e.vmm.alloc_size,
                           alloc_offset=e.vmm.alloc_offset, nbytes=g.layer_nbytes,
                           dtype=g.dtype, shape=g.layer_shape, stride=g.layer_strides,
                           device_index=self.device, device_uuid=self.device_uuid)
            for e in self._exports
        ]

    @property
    def kv_layout(self) -> KVLayout | None:
        # GPU servers default to NHD for 5-D layers but every release honours the hint
        # there (docs/vllm.md): always say which. MLA has no head axis.
        return None if self.geometry.mla else self.geometry.layout

    @property
    def driver(self) -> CudaDriver:
        """The driver every CUDA call of this cache goes through."""
        return self._driver

    def resolve_stream(self, stream: Any) -> int:
        """The ``cudaStream_t`` value a transfer given ``stream`` runs on: ``None`` as in
        the module docstring, else :func:`~lmcache_mp.ipc.cuda.export.stream_handle`."""
        return default_stream(self.device) if stream is None else stream_handle(stream)

    @contextlib.contextmanager
    def one_event(self) -> Iterator[None]:
        """Transfers begun inside this block on this thread send one interprocess
        event per stream, recorded on it by the first of them, instead of one each:
        begun one after another with nothing of the caller's queued between them (a
        vLLM step's STOREs after its forward pass, or its RETRIEVEs before it), they
        would all capture the same work anyway. The server's copies each wait for it;
        it is destroyed once every one of them has its reply (or is dropped), so a
        server never opens a handle already destroyed. As LMCache's own connector
        does: one event per step's batch."""
        outer = getattr(self._batch, "events", None)
        self._batch.events = {}
        try:
            yield
        finally:
            self._batch.events = outer

    def begin_transfer(self, stream: Any) -> tuple[bytes, Any]:
        """Record a fresh interprocess event on ``stream`` (inside :meth:`one_event`:
        the block's event for that stream, made by its first transfer): the server's
        copy waits for it. Returns its 64-byte handle and a token to keep until the
        reply."""
        self._check_open()
        drv = self._driver
        shared: dict[int, TransferEvent] | None = getattr(self._batch, "events", None)
        with on_device(drv, self.device):
            # Resolved here, on the device, and kept: the reply's wait must go on the
            # same stream even if the reply is handled on another thread.
            handle_of_stream = self.resolve_stream(stream)
            token = None if shared is None else shared.get(handle_of_stream)
            if token is None:
                token = TransferEvent(drv, self.device, drv.event_create_ipc(),
                                      handle_of_stream)
                try:
                    drv.event_record(token.event, handle_of_stream)
                    token.handle = drv.ipc_get_event_handle(token.event)
                except BaseException:
                    token.destroy()
                    raise
                if shared is None:
                    return token.handle, token
                shared[handle_of_stream] = token
        return token.handle, _EventShare(token)

    def end_transfer(self, server_event: bytes, stream: Any, token: Any) -> None:
        """Make the stream wait for the server's copy (its event handle, opened for this
        reply only), then destroy our event; with ``wait_host`` also block until the
        copy is done."""
        try:
            handle = check_server_event(server_event)
            drv = self._driver
            with on_device(drv, self.device):
                ours = token.event if isinstance(token, _EventShare) else token
                if stream is None and isinstance(ours, TransferEvent):
                    handle_of_stream = ours.stream
                else:
                    handle_of_stream = self.resolve_stream(stream)
                self._wait_server_event(handle, handle_of_stream)
                if self.wait_host:
                    drv.stream_synchronize(handle_of_stream)
        finally:
            if isinstance(token, TransferEvent):
                token.destroy()
            elif isinstance(token, _EventShare):
                token.release()

    def _wait_server_event(self, handle: bytes, stream: int) -> None:
        drv = self._driver
        event = drv.ipc_open_event_handle(handle)
        try:
            drv.stream_wait_event(stream, event)
        finally:
            # The wait is enqueued: CUDA keeps what it needs until the wait is done.
            drv.event_destroy(event)

    def synchronize_server_event(self, handle: bytes) -> None:
        """Block the host until the server's event ``handle`` (a STORE / RETRIEVE
        reply's) has completed; opened, waited on and destroyed like a reply's."""
        check_server_event(handle)
        drv = self._driver
        with on_device(drv, self.device):
            event = drv.ipc_open_event_handle(handle)
            try:
                drv.event_synchronize(event)
            finally:
                drv.event_destroy(event)

    def synchronize(self, stream: Any = None) -> None:
        """Block the host until ``stream`` (None: as for transfers) has done everything
        queued on it, including the waits on the server's copies."""
        with on_device(self._driver, self.device):
            self._driver.stream_synchronize(self.resolve_stream(stream))

    def gather_copier(self) -> GatherCopier | None:
        """The gather / scatter path of this cache's engine-driven copies
        (:mod:`.gather`: torch over the device memory, a staging buffer of its own),
        made on first use; None where it cannot run (no torch, ``LMCACHE_MP_GPU_COPY=
        plan``), said once in the log: the copy plan of :mod:`.staging` moves the
        blocks then."""
        with self._copier_lock:
            self._check_open()
            if self._copier is None and self._copier_refused is None:
                why = gather_unavailable(self._driver)
                if why is None:
                    try:
                        with on_device(self._driver, self.device):
                            self._copier = GatherCopier(
                                self._driver, self.device, self.geometry,  # type: ignore[arg-type]
                                self.layer_ptrs)
                    except Exception as exc:  # torch without CUDA, a driver refusal
                        why = f"{type(exc).__name__}: {exc}"
                    else:
                        # A cache dropped unclosed (a connector that wraps a new one at
                        # every wake-up) still gives its staging memory back.
                        self._copier_finalizer = weakref.finalize(self, self._copier.close)
                        self._copier_finalizer.atexit = False
                if why is not None:
                    self._copier_refused = why
                    log.info("lmcache_mp: engine-driven GPU copies of %r use the copy "
                             "plan (one DMA per head and run of blocks), not the "
                             "gather path: %s", self, why)
            return self._copier

    @property
    def copy_path(self) -> str:
        """How engine-driven copies move this cache's blocks: ``"gather (<how>)"``
        (gathers / scatters on the GPU, one DMA per chunk object; ``<how>``: one
        kernel per round for every layer or one per layer, and what the
        staging buffer holds, smaller than asked near the memory limit),
        ``"plan: <why>"`` (one DMA per head and run of blocks: no torch, no room for one
        chunk object of staging, ...), or ``"undecided"`` before the first copy."""
        copier = self._copier
        if copier is not None:
            return copier.copy_path
        if self._copier_refused is not None:
            return f"plan: {self._copier_refused}"
        return "undecided"

    # ------------------------------------------------------------ lifetime
    def unlink(self) -> None:
        """A no-op: CUDA memory stays exportable until it is freed by :meth:`close`."""
        return None

    def close(self) -> None:
        """Drop our references to the memory: memory from :meth:`allocate` is freed
        now, or when the last torch view of it goes. Idempotent."""
        with self._copier_lock:
            finalizer, self._copier_finalizer = self._copier_finalizer, None
            self._copier = None
            self._closed = True
        if finalizer is not None:
            finalizer()  # the copier's close(), once
        self._torch_layers = None
        self._owners = []
        for e in self._exports:  # VMM exports: their fds
            if e.vmm is not None:
                e.vmm.close()

    def __enter__(self) -> CudaKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        g = self.geometry
        state = "closed" if self.closed else "open"
        return (f"<CudaKVCache cuda:{self.device} {g.num_layers} x {g.layer_shape} {g.dtype}"
                f"{' MLA' if g.mla else ''} {self.wrapper_format} {state}>")


class _EventShare:
    """One transfer's hold on an event of :meth:`CudaKVCache.one_event`: the event
    (a :class:`TransferEvent`, destroyed by its finalizer) goes when its block has ended
    and every share was released (a reply) or dropped (a request that timed out)."""

    __slots__ = ("event",)

    def __init__(self, event: TransferEvent) -> None:
        self.event: TransferEvent | None = event

    def release(self) -> None:
        self.event = None
