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

__all__ = ["wrap_layers", "mla_only", "check_one_group", "registration_mode",
           "refusal"]

#: The config key of the transfer mode, and its values' names there.
MODE_KEY = "lmcache.mp.mp_transfer_mode"
MODE_NAMES = {"auto": "auto", "engine": "engine_driven", "lmcache": "lmcache_driven"}


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


def registration_mode(mode: str, device: str, declared: bool) -> str:
    """The lmcache_mp mode the connector registers vLLM's cache with, for the
    configured ``mode`` (``auto`` / ``engine`` / ``lmcache``), the cache's ``device``
    (``cpu`` / ``cuda``) and whether vLLM asked the connector how it reaches the cache
    (``declared``: vLLM 0.34's ``kv_cache_access``, see compat.py).

    ``auto`` on a CUDA cache under vLLM 0.34 is engine-driven: the connector declared
    ``IN_PROCESS`` (this process copies), so vLLM keeps its extensible cache, whose VMM
    memory CUDA IPC cannot share anyway, and engine-driven copies are the fast path
    (one gather per layer, faster than the 0.5.6 / 0.5.7rc2 servers' own copy:
    docs/vllm.md). Under 0.32 / 0.33 ``auto`` is lmcache_mp's (server-copy where CUDA
    IPC can share the memory, else engine-driven; engine-driven for CPU caches)."""
    if mode == "auto" and device == "cuda" and declared:
        return "engine"
    return mode


def refusal(configured: str, registered: str, device: str, declared: bool,
            err: Exception) -> str:
    """What to set, when registering vLLM's cache in the ``registered`` mode (chosen
    from the ``configured`` one) cannot work: the server lacks the engine-driven mode,
    or it cannot map this memory."""
    key = f"{MODE_KEY}={MODE_NAMES.get(configured, configured)}"
    if registered == "engine" or (registered == "auto" and device == "cpu"):
        why = (f"{key}: vLLM 0.34 was told the connector copies its KV cache in process "
               f"(kv_cache_access IN_PROCESS), so it keeps its extensible KV cache"
               if declared and device == "cuda" else
               f"{key}: vLLM's CPU KV cache is not memory the server can map"
               if device == "cpu" else key)
        alternative = (f", or set {MODE_KEY}=lmcache_driven (the server maps the cache "
                       f"through CUDA IPC{'; vLLM then allocates an ordinary KV cache' if declared else ''})"
                       if device == "cuda" else "")
        return (f"the lmcache_mp connector cannot register vLLM's KV cache ({why}): "
                f"engine-driven transfers need the server's shared-memory pool; start the "
                f"server with --supported-transfer-mode auto --shm-name NAME (from LMCache "
                f"0.5.4; on GPU hosts also --no-l1-use-lazy){alternative}. The server "
                f"said: {err}")
    return (f"the lmcache_mp connector cannot register vLLM's KV cache with {key}: the "
            f"server cannot map it ({err}); set {MODE_KEY}=auto or engine_driven")
