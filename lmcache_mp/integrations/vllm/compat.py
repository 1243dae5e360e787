"""What differs between the vLLM releases the connector runs on, in one place.

The connector is one class for vLLM 0.32, 0.33 and 0.34 (as ``protocol/`` is one
client for every LMCache release): everything that reads an object whose form changed
between them goes through this module, and nothing else in the connector asks which
vLLM it runs in. Read in each release's wheel (file:line in 0.34.0):

* **Token ids** (``request.all_token_ids``): 0.32 / 0.33 a ``ConstantList`` of a
  ``list``; 0.34 of a ``TokenBuffer`` (an ``array('i')`` subclass,
  ``v1/token_buffer.py:20``): :func:`token_ids`.
* **A preempted request scheduled again**: 0.32 / 0.33 in ``scheduled_cached_reqs``
  with its id in ``resumed_req_ids`` and its whole block table in ``new_block_ids``
  under the V1 model runner (in ``scheduled_new_reqs`` under V2); 0.34 always in
  ``scheduled_new_reqs``, with its whole block table and ``prefill_token_ids``
  (``resumed_req_ids`` is gone, ``sched/output.py:139``): :func:`resumed_req_ids`.
* **A request that may not read external KV** (prompt logprobs, a request that skips
  cached prefixes): the scheduler zeroes the connector's answer (0.34
  ``scheduler.py:1182``), from ``request.skip_reading_prefix_cache`` (0.32 / 0.33)
  or ``request.skip_reading_external_kv`` (0.34, ``request.py:359``; True for
  prompt-logprob requests too): :func:`skips_external_kv`.
* **How the workers reach vLLM's KV cache**: asked from 0.34 only
  (``KVConnectorBase_V1.kv_cache_access``, ``base.py:205``), and it decides whether
  vLLM allocates its extensible (CUDA VMM) cache: :func:`asks_kv_cache_access`,
  :func:`kv_cache_access`.
* **The worker hooks' driver**: the V1 model runner's mixin (0.32, 0.33) or the V2
  runner's ``ActiveKVConnector`` (0.33 optional, 0.34 only:
  ``v1/worker/gpu/kv_connector.py``, ``v1/worker/cpu/kv_connector.py``): the same
  hooks, ``start_load_kv(forward_context, **kwargs)`` before the forward pass for
  sync loads and after it for async ones (this connector's), ``get_finished`` through
  ``get_transfer_results``. Nothing to adapt.
* **Sleep / wake**: 0.33 and 0.34 call ``unregister_kv_caches`` before and
  ``restore_kv_caches`` after (0.34 also around weight updates that borrow the cache's
  memory); the connector's ``supports_sleep_mode`` says whether it follows them.

No vLLM import at module level (the unit tests run without vLLM).
"""

from __future__ import annotations

import array
import functools
from typing import Any

import numpy as np

__all__ = ["token_ids", "skips_external_kv", "resumed_req_ids", "asks_kv_cache_access",
           "kv_cache_access"]


def token_ids(tokens: Any) -> Any:
    """A request's token ids in the form :class:`~lmcache_mp.keys.CacheKey` reads
    cheapest, with no Python loop over the tokens: vLLM 0.34's ``TokenBuffer`` (an
    ``array('i')``, inside the ``ConstantList`` vLLM hands out) as an int32 numpy array
    made with one copy of its bytes (``tobytes``: no buffer export outlives this call,
    so vLLM can still grow the buffer); 0.32 / 0.33's lists as a list."""
    inner = getattr(tokens, "_x", tokens)  # vLLM's ConstantList keeps its list in _x
    if isinstance(inner, array.array) and inner.itemsize == 4 and inner.typecode in "iI":
        return np.frombuffer(inner.tobytes(), dtype=np.int32 if inner.typecode == "i"
                             else np.uint32)
    if isinstance(inner, (list, tuple)):
        return inner
    return list(tokens)


def skips_external_kv(request: Any) -> bool:
    """Whether vLLM discards the connector's hit for ``request`` (its scheduler then
    zeroes what ``get_num_new_matched_tokens`` answered): a request with prompt
    logprobs, or one that asked to skip cached prefixes. 0.34:
    ``skip_reading_external_kv``; 0.32 / 0.33: ``skip_reading_prefix_cache``. Such a
    request is never looked up (a LOOKUP's read locks would be held for nothing)."""
    skip = getattr(request, "skip_reading_external_kv", None)
    if skip is None:
        skip = getattr(request, "skip_reading_prefix_cache", False)
    return skip is True


def resumed_req_ids(cached_reqs: Any) -> set[str]:
    """The requests of ``scheduler_output.scheduled_cached_reqs`` that resume after a
    preemption, whose ``new_block_ids`` are their whole block table, not an addition:
    vLLM 0.33's ``resumed_req_ids``. vLLM 0.34 has no such field: a resumed request is
    in ``scheduled_new_reqs`` (as a new one; the connector looked it up again), so
    none of its cached requests resumes."""
    resumed = getattr(cached_reqs, "resumed_req_ids", None)
    return set(resumed) if resumed else set()


@functools.cache
def asks_kv_cache_access() -> bool:
    """Whether this vLLM asks connectors how they reach its KV cache (0.34+): it then
    allocates the cache as they declare, and the connector must do what it declared."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "kv_cache_access")


def kv_cache_access(mode: str) -> Any:
    """vLLM 0.34's ``KVCacheAccess`` for the connector's transfer ``mode`` (what it will
    really do with vLLM's memory): ``"lmcache"`` (the server maps the cache through
    CUDA IPC and copies) is ``LEGACY_IPC``, which makes vLLM allocate an ordinary
    cache (CUDA IPC cannot share its extensible cache's VMM memory); ``"engine"`` and
    ``"auto"`` (this process copies, through the server's shared-memory pool) are
    ``IN_PROCESS``: vLLM keeps its extensible cache."""
    from vllm.config.kv_transfer import KVCacheAccess

    return KVCacheAccess.LEGACY_IPC if mode == "lmcache" else KVCacheAccess.IN_PROCESS
