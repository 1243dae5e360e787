"""vLLM's KV caches as a lmcache_mp cache, in place (no copy).

What vLLM 0.32 / 0.33 hand a connector (``vllm/v1/worker/utils.py``
``allocate_kv_cache``, ``vllm/v1/kv_cache_interface.py`` ``create_kv_cache_views``):
ONE backing allocation, viewed per layer as a 4-D tensor ``[num_blocks, num_kv_heads,
block_size, C]`` in the *logical* axis order, whatever the physical order (the
resolved ``KVCacheLayout``: ``LBHNC``, ``LBNHC``, blocks-first ``BLHNC`` / ``BLNHC``
with the layers interleaved inside each block, ...), which only the strides show.
``C = 2 * head_size`` holds a token's K and V as the attention backend packs them
(FlashAttention: ``[K | V]`` per row; vLLM's CPU backend: each block's K rows, then
its V rows); an MLA layer has one head and ``C`` = the latent width.

The server's objects are what LMCache's own connector stores for these layers (every
release from 0.5.3: its detector reads any rank-4 layer as fused K/V,
``NL_X_NB_NH_BS_CS`` / ``NL_X_NB_BS_NH_CS``, one plane, and its copy moves the ``C``
axis verbatim): ``[layers, chunk, heads * C]``, token-major, each (token, head) row as
vLLM holds it. So entries are shared with LMCache's connector both ways, between
engines of any physical layout, and never depend on how the backend packs K and V
(engines whose backends pack differently, a CPU and a GPU engine, do not share
entries: as with LMCache's connector). MLA layers are registered as MLA (``[layers,
chunk, latent]``, the same bytes).

* CPU tensors: ``CpuKVCache.wrap(..., fused=True)`` reads them in place for the
  engine-driven mode (the server cannot map vLLM's memory: LMCache-driven is refused).
* CUDA tensors: ``CudaKVCache.from_torch(..., fused=True)``.

Anything else vLLM may hand over (hybrid KV-cache groups, kernel blocks smaller than
the scheduler's block, other ranks) is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import InvalidArgument
from ...ipc.base import ExportableKVCache
from ...ipc.cpu_cache import CpuKVCache

__all__ = ["wrap_layers", "mla_only", "check_one_group"]


def check_one_group(kv_cache_config: Any) -> None:
    """Refuse several KV-cache groups (a hybrid model the connector cannot key)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) > 1:
        raise InvalidArgument(
            f"vLLM made {len(groups)} KV-cache groups (a hybrid model: sliding-window, "
            f"mamba or several attention kinds): the lmcache_mp connector supports one "
            f"group of full-attention or MLA layers")


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


def wrap_layers(tensors: Sequence[Any], block_size: int, mode: str = "auto", *,
                mla: bool = False, driver: Any = None) -> ExportableKVCache:
    """Wrap vLLM's per-layer 4-D torch tensors (CPU or CUDA, one geometry) in place
    (module docstring). ``mode`` is the lmcache_mp mode the connector will register
    with; ``driver``: a CUDA driver for tests (None: cuda-python's)."""
    if not tensors:
        raise InvalidArgument("no KV cache layers to register")
    first = tensors[0]
    device = getattr(first.device, "type", None)
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(
            f"KV tensors on {first.device} are not supported by the lmcache_mp vLLM "
            f"connector: CPU or CUDA KV caches only (see docs/vllm.md)")
    shape = tuple(int(d) for d in first.shape)
    if len(shape) != 4:
        raise InvalidArgument(
            f"expected vLLM 0.32 / 0.33's per-layer KV views [num_blocks, num_kv_heads, "
            f"block_size, 2 * head_size] (4-D), got {shape}: this vLLM release or "
            f"attention backend is not supported by the lmcache_mp connector")
    heads, bs = shape[1], shape[2]
    if bs != block_size:
        raise InvalidArgument(
            f"vLLM's KV views have blocks of {bs} tokens but its scheduler uses "
            f"{block_size}: the attention kernel splits each block (kernel block size "
            f"{bs}), which the lmcache_mp connector does not map; start vLLM with "
            f"--block-size {bs}")
    if mla and heads != 1:
        raise InvalidArgument(
            f"an MLA model's KV views should have one head, got {shape}: this MLA "
            f"attention backend's layout is not supported by the lmcache_mp connector")
    if device == "cuda":
        from ...ipc.cuda import CudaKVCache  # imports cuda-python only for a driver

        # vLLM's logical axis order is [blocks, heads, block_size, C]: "HND".
        return CudaKVCache.from_torch(list(tensors), layout="HND", mla=mla,
                                      fused=not mla, driver=driver)
    if mode == "lmcache":
        raise InvalidArgument(
            "lmcache.mp.mp_transfer_mode 'lmcache_driven' needs memory the server can "
            "map, and vLLM's CPU KV tensors are not shared memory: use 'auto' or "
            "'engine_driven' (and start the server with --supported-transfer-mode auto "
            "--shm-name NAME from LMCache 0.5.4)")
    if mla:  # [num_blocks, block_size, latent] views: the same bytes as one fused head
        return CpuKVCache.wrap([t[:, 0] for t in tensors], layout="NHD",
                               block_size=block_size)
    return CpuKVCache.wrap(list(tensors), layout="HND", block_size=block_size, fused=True)
