"""vLLM's per-layer KV tensors as a lmcache_mp cache, without copying them.

vLLM allocates one tensor per attention layer, logically ``[2, num_blocks,
block_size, heads, head_dim]`` (NHD, whatever the physical order: a permuted layout is
a strided view), possibly views into one shared allocation. ``CpuKVCache.wrap`` reads
them in place (any strides) for the engine-driven mode, in which this client copies
between them and the server's shared-memory pool; the LMCache-driven mode cannot use
them (the server maps only shared-memory segments or CUDA allocations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import InvalidArgument
from ...ipc.base import KVLayout
from ...ipc.cpu_cache import CpuKVCache

__all__ = ["wrap_layers"]


def wrap_layers(tensors: Sequence[Any], block_size: int) -> CpuKVCache:
    """Wrap vLLM's per-layer torch tensors (CPU, 5-D, one geometry) in place: NHD when
    the third axis is the block size, else HND."""
    if not tensors:
        raise InvalidArgument("no KV cache layers to register")
    first = tensors[0]
    if first.device.type != "cpu":
        raise InvalidArgument(
            f"KV tensors on {first.device} are not supported by the lmcache_mp vLLM "
            f"connector yet: CPU KV caches only (see docs/vllm.md)")
    if first.dim() != 5 or first.shape[0] != 2:
        raise InvalidArgument(
            f"expected per-layer KV tensors [2, num_blocks, ...] (5-D), got "
            f"{tuple(first.shape)}: MLA and other attention layouts are not supported yet")
    layout: KVLayout = "NHD" if first.shape[2] == block_size else "HND"
    return CpuKVCache.wrap(list(tensors), layout=layout, block_size=block_size)
