"""A paged KV cache in POSIX shared memory that the LMCache server can map.

One segment per layer tensor (offset 0, ``nbytes = numel * itemsize``), exposed as
numpy arrays and, when torch is installed, as torch tensors over the same memory.

Layout: HND ``[2, num_blocks, num_heads, block_size, head_dim]`` by default, or NHD
``[2, num_blocks, block_size, num_heads, head_dim]`` (vLLM's default, and the cheaper
one to copy: each block is one contiguous run of a chunk). Registration states it
explicitly; CPU servers up to 0.5.4 read 5-D layers as HND whatever the hint says, so
an NHD cache is refused there for LMCache-driven transfers (engine-driven transfers
are copied by this client and work with either). MLA caches have one plane,
``[num_blocks, block_size, head_dim]``.

:meth:`CpuKVCache.wrap` takes an engine's own host arrays instead (no copy, no SHM):
engine-driven mode only, since the server cannot map memory it was not given a name
for.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..checks import is_int, one_of, positive_int
from ..errors import InvalidArgument
from .base import STORAGE_DTYPES, KVGeometry, KVLayout, LayerExport, ShmLayerExport
from .shm import SHM_DIR, ShmSegment, shm_free_bytes, sweep_dead_segments

if TYPE_CHECKING:  # numpy is imported on first use: import lmcache_mp stays light
    import numpy as np

__all__ = ["CpuKVCache", "KVGeometry", "STORAGE_DTYPES", "MAX_LAYERS"]

#: Each layer is one segment, one file descriptor while created and one mapping
#: (Linux allows 65530 per process by default).
MAX_LAYERS = 1024


def _release(segments: Sequence[ShmSegment]) -> None:
    for seg in segments:
        seg.close()


class CpuKVCache:
    """Per-layer KV tensors in POSIX shared memory. Close it (or use ``with``); names
    are also unlinked at interpreter exit or when the cache is garbage-collected."""

    def __init__(self, geometry: KVGeometry, segments: list[ShmSegment],
                 layers: list[np.ndarray] | None = None,
                 torch_layers: list[Any] | None = None) -> None:
        """Use :meth:`allocate` (SHM of its own) or :meth:`wrap` (caller's arrays)."""
        self.geometry = geometry
        self._segments = segments
        #: True for :meth:`wrap`: memory the server cannot map (engine-driven only).
        self.wrapped = layers is not None
        if layers is None:
            import numpy as np

            np_dtype = STORAGE_DTYPES[geometry.dtype][0]
            count = math.prod(geometry.layer_shape)
            layers = [np.frombuffer(seg.buffer, dtype=np_dtype, count=count).reshape(
                geometry.layer_shape) for seg in segments]
        self.layers: list[np.ndarray] = layers
        self._torch_layers: list[Any] | None = torch_layers
        self._finalizer = weakref.finalize(self, _release, list(segments))

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
    ) -> CpuKVCache:
        """Allocate ``num_layers`` zero-filled layer tensors in shared memory, all pages
        up front (a cache larger than ``/dev/shm`` has free is refused here, instead of
        crashing with SIGBUS when first written). Segments left in ``/dev/shm`` by
        processes that died without closing their caches are removed first."""
        if not isinstance(dtype, str) or dtype not in STORAGE_DTYPES:
            raise InvalidArgument(
                f"dtype {dtype!r} is not supported; use one of {', '.join(STORAGE_DTYPES)}"
            )
        if not isinstance(mla, bool):
            raise InvalidArgument(f"mla must be a bool, got {mla!r}")
        one_of("layout", layout, ("HND", "NHD"))
        if is_int(num_layers) and num_layers > MAX_LAYERS:
            raise InvalidArgument(
                f"num_layers={num_layers}: at most {MAX_LAYERS} (one segment and mapping per "
                f"layer; no model has more than a few hundred layers)")
        geometry = KVGeometry(
            positive_int("num_layers", num_layers),
            positive_int("num_blocks", num_blocks),
            positive_int("block_size", block_size),
            positive_int("num_heads", num_heads),
            positive_int("head_dim", head_dim),
            dtype,
            bool(mla),
            layout,
        )
        if mla and num_heads != 1:
            raise InvalidArgument("an MLA cache has one latent head: pass num_heads=1")
        sweep_dead_segments()
        # Python ints: numpy's int64 products would wrap around for absurd shapes.
        layer_bytes = math.prod(geometry.layer_shape) * geometry.itemsize
        free = shm_free_bytes()
        if layer_bytes * num_layers > free:
            raise InvalidArgument(
                f"a {num_layers}-layer cache of {layer_bytes / 2**30:.3g} GiB per layer "
                f"needs {layer_bytes * num_layers / 2**30:.3g} GiB of shared memory, but "
                f"{SHM_DIR} has {free / 2**30:.3g} GiB free: use fewer blocks, or enlarge "
                f"{SHM_DIR} (docker: --shm-size)")
        segments: list[ShmSegment] = []
        try:
            for i in range(num_layers):
                segments.append(ShmSegment.create(geometry.layer_nbytes, tag=f"L{i}"))
        except BaseException:
            _release(segments)
            raise
        return cls(geometry, segments)

    @classmethod
    def wrap(
        cls,
        layers: Sequence[Any],
        *,
        layout: KVLayout = "HND",
        block_size: int | None = None,
        dtype: str | None = None,
        fused: bool = False,
    ) -> CpuKVCache:
        """A cache over the caller's own host memory, without copying it: one array per
        layer, numpy arrays or CPU torch tensors, shaped ``[2, num_blocks, num_heads,
        block_size, head_dim]`` (``layout="HND"``) or ``[2, num_blocks, block_size,
        num_heads, head_dim]`` (``"NHD"``), or 3-D MLA layers ``[num_blocks,
        block_size, head_dim]``; with ``fused``, vLLM 0.32+'s 4-D fused K/V layers
        ``[num_blocks, num_heads, block_size, 2 * head_size]`` (``"HND"``, vLLM's
        logical order) or ``[num_blocks, block_size, num_heads, 2 * head_size]``
        (``"NHD"``), one plane whose rows are copied as they are (see
        :class:`~lmcache_mp.ipc.base.KVGeometry`). Any strides work (views into one
        allocation, permuted views, blocks-first views); contiguous layers copy
        fastest. ``block_size`` is checked against the
        shapes when given (it catches a wrong ``layout``); ``dtype`` is read from torch
        tensors, and needed for numpy arrays whose dtype is not a torch name (e.g.
        ``dtype="bfloat16"`` for uint16 bits).

        Engine-driven mode only (``register(mode="engine")``; ``"auto"`` picks it): in
        LMCache-driven mode the server maps the cache itself, which needs
        :meth:`allocate`'s shared memory. Closing drops the references; the memory
        stays the caller's."""
        from .host_arrays import host_layers

        geometry, views, tensors = host_layers(layers, layout, block_size, dtype, fused)
        return cls(geometry, [], views, tensors)

    # ------------------------------------------------------------------ views
    @property
    def torch_layers(self) -> list[Any]:
        """The layers as torch tensors over the same memory (needs torch)."""
        if self._torch_layers is None:
            try:
                import torch
            except ImportError:
                raise InvalidArgument(
                    "torch is not installed: use .layers (numpy), or install torch"
                ) from None
            tdtype = getattr(torch, self.geometry.dtype)
            if self.wrapped:
                # Wrapped numpy layers keep their strides: reinterpret the storage
                # ints (torch reads every numpy int type) as the typed dtype.
                self._torch_layers = [
                    torch.from_numpy(a.view(f"i{a.itemsize}")).view(tdtype)
                    for a in self.layers]
            else:
                self._torch_layers = [
                    torch.frombuffer(seg.buffer, dtype=tdtype).view(self.geometry.layer_shape)
                    for seg in self._segments
                ]
        return self._torch_layers

    @property
    def segment_names(self) -> list[str]:
        """POSIX names (with the leading slash) the server will shm_open."""
        return [seg.posix_name for seg in self._segments]

    @property
    def unlinked(self) -> bool:
        return any(seg.unlinked for seg in self._segments)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # ------------------------------------------------- ExportableKVCache
    def export_layers(self) -> list[LayerExport]:
        if self.wrapped:
            raise InvalidArgument(
                "a cache from CpuKVCache.wrap() is caller memory the server cannot map: "
                "register it with mode='engine' (the server needs --shm-name for its pool), "
                "or allocate a shared-memory cache with CpuKVCache.allocate() for "
                "mode='lmcache'")
        g = self.geometry
        return [ShmLayerExport(name, g.layer_nbytes, g.dtype, g.layer_shape, g.layer_strides)
                for name in self.segment_names]

    @property
    def kv_layout(self) -> KVLayout | None:
        # Said explicitly at registration: CPU servers up to 0.5.4 assume HND anyway
        # (an NHD cache is refused there), later ones honour the hint. MLA layers have
        # no head axis to order.
        return None if self.geometry.mla else self.geometry.layout

    def begin_transfer(self, stream: Any) -> tuple[bytes, Any]:
        # A CPU server ignores the event handle and copies synchronously.
        return b"", None

    def end_transfer(self, server_event: bytes, stream: Any, token: Any) -> None:
        return None

    def block_bytes(self, layer: int, block: int) -> bytes:
        """All bytes of one block of one layer (K and V), for checks and tests."""
        arr = self.layers[layer]
        return (arr[block] if self.geometry.kv_planes == 1 else arr[:, block]).tobytes()

    # -------------------------------------------------------------- lifetime
    def unlink(self) -> None:
        """Remove the segment names (the memory stays mapped here). Done on unregister:
        the server keeps its own mapping, and no other process can open them."""
        for seg in self._segments:
            seg.unlink()

    def close(self) -> None:
        """Unlink and unmap. Views handed out earlier keep their memory alive."""
        self.layers = []
        self._torch_layers = None
        self._finalizer()

    def __enter__(self) -> CpuKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        g = self.geometry
        state = "closed" if self.closed else "open"
        kind = " MLA" if g.mla else f" {g.layout}" + (" fused" if g.fused else "")
        return (f"<CpuKVCache{' (wrapped)' if self.wrapped else ''} {g.num_layers} x "
                f"{g.layer_shape} {g.dtype}{kind} {state}>")
