"""A plain, loop-per-token reference of the paged <-> chunk-object copies.

Written from the layout LMCache documents, not from lmcache_mp.ipc.paged_copy: a chunk
object is ``[2, num_layers, tokens, num_heads * head_dim]`` (MLA: ``[num_layers, tokens,
head_dim]``), token ``t`` of it living in block ``ids[t // block_size]`` at slot
``t % block_size``; a paged HND layer is ``[2, num_blocks, num_heads, block_size,
head_dim]`` (MLA: ``[num_blocks, block_size, head_dim]``). Slow on purpose: every
element is placed by its own index arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lmcache_mp.ipc.base import KVGeometry


def chunk_shape(g: KVGeometry, tokens: int) -> tuple[int, ...]:
    if g.mla:
        return (g.num_layers, tokens, g.head_dim)
    return (2, g.num_layers, tokens, g.num_heads * g.head_dim)


def reference_gather(layers: Sequence[np.ndarray], ids: Sequence[int], g: KVGeometry,
                     dtype: np.dtype) -> np.ndarray:
    bs = g.block_size
    out = np.zeros(chunk_shape(g, len(ids) * bs), dtype=dtype)
    for li, layer in enumerate(layers):
        for t in range(len(ids) * bs):
            block, slot = int(ids[t // bs]), t % bs
            if g.mla:
                out[li, t, :] = layer[block, slot, :]
            else:
                for kv in range(2):
                    for h in range(g.num_heads):
                        out[kv, li, t, h * g.head_dim:(h + 1) * g.head_dim] = \
                            layer[kv, block, h, slot, :]
    return out


def reference_scatter(obj: np.ndarray, layers: Sequence[np.ndarray], ids: Sequence[int],
                      g: KVGeometry, skip_blocks: int = 0) -> None:
    """Write the chunk object into blocks ``ids[skip_blocks:]``; a block id repeated in
    ``ids`` ends up holding the last of its tokens' values, as sequential writes do."""
    bs = g.block_size
    for li, layer in enumerate(layers):
        for t in range(skip_blocks * bs, len(ids) * bs):
            block, slot = int(ids[t // bs]), t % bs
            if g.mla:
                layer[block, slot, :] = obj[li, t, :]
            else:
                for kv in range(2):
                    for h in range(g.num_heads):
                        layer[kv, block, h, slot, :] = \
                            obj[kv, li, t, h * g.head_dim:(h + 1) * g.head_dim]
