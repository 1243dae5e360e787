"""Caller-owned CUDA torch layers as a :class:`~lmcache_mp.ipc.cuda.CudaKVCache`: what
``from_torch`` reads from them (checked), and torch views over a cache's memory.

An engine hands its KV layers in its *logical* axis order (vLLM: NHD ``[2, num_blocks,
block_size, heads, head_dim]`` whatever the attention backend), but the memory may be
in the other order: vLLM allocates an HND backend's layer in HND and hands out a
permuted, non-contiguous view. The server maps memory, not views, so what counts is
the *physical* order, read here from the strides: a layer must be dense in NHD or in
HND order (else it is refused, saying which strides were seen), and the cache is
registered with that layout. Layers may be views into one shared allocation (each at
its own offset: every wrapper form but LMCache 0.5.3's ``raw`` carries it).

vLLM 0.32+'s fused K/V layers (``fused=True``: 4-D ``[num_blocks, heads, block_size,
2 * head_size]`` views of one allocation, see ``integrations/vllm/kv_caches.py``) may
be in any of vLLM's layouts: each block's interior dense in HND (``[heads,
block_size, C]``) or NHD (``[block_size, heads, C]``) order, and the blocks either
dense (a layer-compact layout) or a fixed stride apart (blocks-first layouts, where
every layer's block shares one page).

Never imports torch: the tensors are read through ``shape``, ``stride()``, ``dtype``,
``device`` and ``data_ptr()`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ...checks import one_of, positive_int
from ...errors import InvalidArgument
from ..base import STORAGE_DTYPES, KVGeometry, KVLayout

__all__ = ["TorchLayers", "torch_layer_layout", "dense", "torch_views", "checked_geometry"]


class TorchLayers(NamedTuple):
    """What ``from_torch`` registers: the dtype name, ``(num_blocks, num_heads,
    block_size, head_dim)``, the device index, the physical layout of the memory and
    (fused layers) the elements between blocks when they are not dense (0)."""

    dtype: str
    dims: tuple[int, int, int, int]
    device: int
    layout: KVLayout
    block_stride: int = 0


def dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether ``strides`` (in elements) are the row-major strides of ``shape`` (an
    axis of size 1 may have any stride, as torch's ``is_contiguous`` allows)."""
    acc = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != acc:
            return False
        acc *= size
    return True


def _strides(t: Any, ndim: int) -> tuple[int, ...]:
    stride = getattr(t, "stride", None)
    if stride is None:
        raise InvalidArgument(f"expected a torch tensor with stride(), got {type(t).__name__}")
    strides = tuple(int(s) for s in stride())
    if len(strides) != ndim:
        raise InvalidArgument(f"a {ndim}-D tensor reported {len(strides)} strides")
    return strides


def _physical(i: int, shape: tuple[int, ...], strides: tuple[int, ...],
              layout: KVLayout) -> KVLayout:
    """The order a 5-D layer of logical ``layout`` is dense in (its own first), or
    refuse it."""
    other: KVLayout = "HND" if layout == "NHD" else "NHD"
    if dense(shape, strides):
        return layout
    swap = (0, 1, 3, 2, 4)  # the heads and block-token axes trade places
    if dense([shape[a] for a in swap], [strides[a] for a in swap]):
        return other
    names = ("2", "num_blocks", "block_size", "num_heads", "head_dim") if layout == "NHD" \
        else ("2", "num_blocks", "num_heads", "block_size", "head_dim")
    raise InvalidArgument(
        f"layer {i}: shape {shape} ({layout}: [{', '.join(names)}]) with strides {strides} "
        f"(elements) is dense in neither NHD nor HND order, so the server cannot map it "
        f"as a paged cache (a blocks-first or cross-layer layout?): pass each layer as "
        f"its own dense [2, num_blocks, ...] memory, or .contiguous() copies")


def _fused(shape: tuple[int, ...], strides: tuple[int, ...], layout: KVLayout
           ) -> tuple[tuple[int, int, int, int], KVLayout, int]:
    """(num_blocks, heads, block_size, C), the physical order of each block's interior
    and the block stride (0: dense) of a fused layer of logical ``layout``."""
    if len(shape) != 4:
        raise InvalidArgument(f"fused K/V layers are 4-D [num_blocks, heads, block_size, "
                              f"2 * head_size], got {shape}")
    if layout == "HND":
        nb, heads, bs, c = shape
        sb, sh, sn, sc = strides
    else:
        nb, bs, heads, c = shape
        sb, sn, sh, sc = strides
    page = heads * bs * c
    interior: KVLayout | None
    if sc != 1 or c < 1:
        interior = None
    elif (heads == 1 or sh == bs * c) and (bs == 1 or sn == c):
        interior = "HND"
    elif (heads == 1 or sh == c) and (bs == 1 or sn == heads * c):
        interior = "NHD"
    else:
        interior = None
    if interior is None or (nb > 1 and sb < page):
        raise InvalidArgument(
            f"fused K/V layer shape {shape} ({layout}) with strides {strides} (elements): "
            f"each block must be dense in HND or NHD order and blocks must not overlap, "
            f"as in every layout vLLM allocates")
    return (nb, heads, bs, c), interior, (0 if nb == 1 or sb == page else sb)


def torch_layer_layout(layers: list[Any], mla: bool, layout: KVLayout,
                       fused: bool = False) -> TorchLayers:
    """What :meth:`CudaKVCache.from_torch` needs from caller-owned CUDA tensors, checked:
    one per layer, same shape, strides, dtype and device; 5-D layers of logical
    ``layout`` dense in NHD or HND order (MLA ``[num_blocks, block_size, head_dim]``,
    or vLLM 0.32's ``[num_blocks, 1, block_size, head_dim]``: contiguous); ``fused``
    4-D layers as the module docstring says."""
    if not layers:
        raise InvalidArgument("layers must hold one CUDA tensor per layer (got none)")
    if layout not in ("HND", "NHD"):
        raise InvalidArgument(f"layout must be 'HND' or 'NHD', got {layout!r}")
    first = layers[0]
    shape = tuple(int(d) for d in getattr(first, "shape", ()))
    strides0 = _strides(first, len(shape))
    for i, t in enumerate(layers):
        device = getattr(t, "device", None)
        if getattr(device, "type", None) != "cuda":
            raise InvalidArgument(f"layer {i} is not a CUDA tensor (device {device})")
        if tuple(int(d) for d in t.shape) != shape or t.dtype != first.dtype \
                or t.device != first.device or _strides(t, len(shape)) != strides0:
            raise InvalidArgument(
                f"layer {i} differs from layer 0 in shape, strides, dtype or device: "
                f"{tuple(t.shape)} {_strides(t, len(shape))} {t.dtype} {t.device} vs "
                f"{shape} {strides0} {first.dtype} {first.device}")
    dtype = str(first.dtype).removeprefix("torch.")
    index = first.device.index
    device_index = 0 if index is None else int(index)
    if mla and len(shape) == 4 and shape[1] == 1:
        # vLLM 0.32+: one head, [num_blocks, 1, block_size, latent]: the same memory.
        shape, strides0 = shape[:1] + shape[2:], strides0[:1] + strides0[2:]
    if fused and not mla:
        dims, physical, block_stride = _fused(shape, strides0, layout)
        return TorchLayers(dtype, dims, device_index, physical, block_stride)
    if mla:
        if len(shape) != 3:
            raise InvalidArgument(
                f"MLA layers are [num_blocks, block_size, head_dim], got {shape}")
        if not dense(shape, strides0):
            raise InvalidArgument(
                f"layer 0 is not contiguous (strides {strides0}): the server maps it as a "
                f"dense block (pass .contiguous() copies, or allocate with "
                f"CudaKVCache.allocate)")
        num_blocks, block_size, head_dim = shape
        return TorchLayers(dtype, (num_blocks, 1, block_size, head_dim), device_index, "HND")
    if len(shape) != 5 or shape[0] != 2:
        hint = " (an MLA cache? pass mla=True)" if len(shape) == 3 else ""
        want = ("NHD [2, num_blocks, block_size, num_heads, head_dim]" if layout == "NHD"
                else "HND [2, num_blocks, num_heads, block_size, head_dim]")
        raise InvalidArgument(f"layers must be {want}, got {shape}{hint}")
    physical = _physical(0, shape, strides0, layout)
    if layout == "NHD":
        _, num_blocks, block_size, num_heads, head_dim = shape
    else:
        _, num_blocks, num_heads, block_size, head_dim = shape
    return TorchLayers(dtype, (num_blocks, num_heads, block_size, head_dim), device_index,
                       physical)


def checked_geometry(num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                     head_dim: int, dtype: str, mla: bool, layout: KVLayout,
                     fused: bool = False, block_stride: int = 0) -> KVGeometry:
    """A CUDA cache's geometry from its builders' arguments, checked."""
    one_of("layout", layout, ("HND", "NHD"))
    if dtype not in STORAGE_DTYPES:
        raise InvalidArgument(
            f"dtype {dtype!r} is not supported; use one of {', '.join(STORAGE_DTYPES)}")
    if mla and num_heads != 1:
        raise InvalidArgument("an MLA cache has one latent head: pass num_heads=1")
    if mla and fused:
        raise InvalidArgument("a cache is MLA or fused K/V, not both")
    if block_stride and (not fused or block_stride < block_size * num_heads * head_dim):
        raise InvalidArgument(
            f"block_stride={block_stride} is for fused layers whose blocks are further "
            f"apart than their own {block_size * num_heads * head_dim} elements")
    return KVGeometry(
        positive_int("num_layers", num_layers), positive_int("num_blocks", num_blocks),
        positive_int("block_size", block_size), positive_int("num_heads", num_heads),
        positive_int("head_dim", head_dim), dtype, bool(mla), "HND" if mla else layout,
        bool(fused), int(block_stride))


class CudaArrayView:
    """``__cuda_array_interface__`` over one allocation, for torch.as_tensor; the
    tensor keeps this object (and so the allocation) alive."""

    def __init__(self, owner: object, ptr: int, nbytes: int) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


def torch_views(g: KVGeometry, device: int, ptrs: Sequence[int],
                owners: Sequence[object]) -> list[Any]:
    """CUDA torch tensors of ``g.layer_shape`` over each layer's memory, each keeping
    its owner alive (needs torch with CUDA)."""
    try:
        import torch
    except ImportError:
        raise InvalidArgument(
            "torch is not installed: use .layer_ptrs, or install torch") from None
    tdtype = getattr(torch, g.dtype)
    dev = torch.device("cuda", device)
    return [torch.as_tensor(CudaArrayView(owner, ptr, g.layer_nbytes), device=dev)
            .view(tdtype).view(g.layer_shape) for ptr, owner in zip(ptrs, owners, strict=True)]
