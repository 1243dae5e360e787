"""vLLM's per-layer KV tensors as a lmcache_mp cache, without copying them.

vLLM allocates one tensor per attention layer, logically ``[2, num_blocks,
block_size, heads, head_dim]`` (NHD, whatever the physical order: an HND attention
backend gets a permuted, strided view), possibly views into one shared allocation.
An MLA model (DeepSeek-style, ``model_config.use_mla``) has one latent plane per
layer, ``[num_blocks, block_size, head_size]`` (``kv_lora_rank + qk_rope_head_dim``),
registered as an MLA cache (``use_mla``: one object plane on the server).

* CPU tensors: ``CpuKVCache.wrap`` reads them in place (any strides) for the
  engine-driven mode, in which this client copies between them and the server's
  shared-memory pool; the LMCache-driven mode cannot use them (the server maps only
  shared-memory segments or CUDA allocations), so it is refused.
* CUDA tensors: ``CudaKVCache.from_torch`` exports each layer's allocation with its
  offset (CUDA IPC) and registers the physical layout the strides show (NHD or HND;
  every release's GPU server honours the layout hint). ``mode="auto"`` then registers
  it LMCache-driven (the server copies device to device) when CUDA IPC can share the
  memory, else engine-driven (CUDA copies through the server's pool: VMM / cumem
  allocators, memory pools, Tegra).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import InvalidArgument
from ...ipc.base import ExportableKVCache, KVLayout
from ...ipc.cpu_cache import CpuKVCache

__all__ = ["wrap_layers", "mla_only"]


def mla_only(model_config: Any) -> bool:
    """LMCache's ``mla_only`` (integration/vllm/utils.py): ``model_config.use_mla`` is
    True and the model is not hybrid. Such a cache is replicated over the TP ranks
    (stored once, read by all). MLA mixed with other attention kinds is refused."""
    use_mla = getattr(model_config, "use_mla", False)
    if not (isinstance(use_mla, bool) and use_mla):
        return False
    if getattr(model_config, "is_hybrid", False):
        raise InvalidArgument(
            "MLA in a hybrid model (MLA with mamba / linear-attention layers) is not "
            "supported by the lmcache_mp connector")
    return True


def wrap_layers(tensors: Sequence[Any], block_size: int, mode: str = "auto",
                driver: Any = None, mla: bool = False) -> ExportableKVCache:
    """Wrap vLLM's per-layer torch tensors (CPU or CUDA, one geometry) in place: 5-D
    shaped NHD when the third axis is the block size, else HND; with ``mla``, 3-D
    ``[num_blocks, block_size, head_size]``. ``mode`` is the lmcache_mp mode the
    connector will register with; ``driver``: a CUDA driver for tests (None:
    cuda-python's)."""
    if not tensors:
        raise InvalidArgument("no KV cache layers to register")
    first = tensors[0]
    device = getattr(first.device, "type", None)
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(
            f"KV tensors on {first.device} are not supported by the lmcache_mp vLLM "
            f"connector: CPU or CUDA KV caches only (see docs/vllm.md)")
    if mla:
        if first.dim() != 3 or first.shape[1] != block_size:
            raise InvalidArgument(
                f"an MLA model's per-layer KV tensors should be [num_blocks, "
                f"{block_size}, head_size] (3-D), got {tuple(first.shape)}: this MLA "
                f"attention backend's layout is not supported by the lmcache_mp connector")
    elif first.dim() == 3:
        raise InvalidArgument(
            f"per-layer KV tensors {tuple(first.shape)} are 3-D (an MLA layout) but the "
            f"model config does not say use_mla: not supported by the lmcache_mp connector")
    elif first.dim() == 5 and first.shape[1] == 2 and first.shape[0] != 2:
        raise InvalidArgument(
            f"per-layer KV tensors {tuple(first.shape)} are blocks-first [num_blocks, 2, "
            f"...] (FlashInfer and similar attention backends), which the lmcache_mp "
            f"connector does not register yet: select a K/V-first attention backend "
            f"in vLLM, such as FLASH_ATTN")
    elif first.dim() != 5 or first.shape[0] != 2:
        raise InvalidArgument(
            f"expected per-layer KV tensors [2, num_blocks, ...] (5-D), got "
            f"{tuple(first.shape)}: this attention layout is not supported yet")
    # An MLA layer has no head axis: the layout is only a formality there.
    layout: KVLayout = "NHD" if mla or first.shape[2] == block_size else "HND"
    if device == "cuda":
        from ...ipc.cuda import CudaKVCache  # imports cuda-python only for a driver

        return CudaKVCache.from_torch(list(tensors), layout=layout, mla=mla,
                                      driver=driver)
    if mode == "lmcache":
        raise InvalidArgument(
            "lmcache.mp.mp_transfer_mode 'lmcache_driven' needs memory the server can "
            "map, and vLLM's CPU KV tensors are not shared memory: use 'auto' or "
            "'engine_driven' (and start the server with --supported-transfer-mode auto "
            "--shm-name NAME from LMCache 0.5.4)")
    return CpuKVCache.wrap(list(tensors), layout=layout, block_size=block_size)
