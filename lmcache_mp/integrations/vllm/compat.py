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
* **Speculative decoding with its own KV layers** (EAGLE, MTP, a draft model): the
  drafter's layers are registered beside the model's; 0.34 says which methods have
  them (``SpeculativeConfig.uses_draft_kv_cache``): :func:`draft_kv_suffix`.
* **KV events and hit sources** (0.34: ``KVCacheEvent``'s fields, ``CacheHitSource``):
  :func:`kv_events`, :func:`host_hit_source`.

No vLLM import at module level (the unit tests run without vLLM).
"""

from __future__ import annotations

import array
import functools
from typing import Any

import numpy as np

__all__ = ["token_ids", "skips_external_kv", "resumed_req_ids", "asks_kv_cache_access",
           "kv_cache_access", "draft_kv_suffix", "kv_events", "host_hit_source"]


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


def draft_kv_suffix(vllm_config: Any) -> str:
    """What a drafter with KV layers of its own adds to the model name the servers see
    (``##draft-<method>-<draft model>``), "" without one. vLLM registers the drafter's
    layers with the model's (0.34 ``extensible_kv_cache.py`` ``extend_kv_cache``, the
    GPU model runner), so the stored objects hold both: only engines with the same
    drafter share them. 0.34 names the methods (``uses_draft_kv_cache``); before: EAGLE
    style (``use_eagle``) and ``draft_model``."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return ""
    uses = getattr(spec, "uses_draft_kv_cache", None)
    if callable(uses):
        has_layers = bool(uses())
    else:
        eagle = getattr(spec, "use_eagle", None)
        has_layers = bool(eagle()) if callable(eagle) else False
        has_layers = has_layers or getattr(spec, "method", None) == "draft_model"
    if not has_layers:
        return ""
    draft = getattr(getattr(spec, "draft_model_config", None), "model", None)
    return f"##draft-{spec.method}-{draft}"


def host_hit_source() -> Any:
    """vLLM 0.34's label for hits this connector loads (``CacheHitSource.HOST``: the
    server's host-memory pool), None before 0.34 (no labels)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource.HOST


def kv_events(records: list[tuple[str, Any, int, int]], block_size: int) -> list[Any]:
    """vLLM's KV events for ``records`` of the scheduler side (``("stored" |
    "removed", request, first block, end block)``): ``BlockStored`` / ``BlockRemoved``
    on medium ``CPU`` (the server's host memory) under vLLM's own block hashes of the
    request, with the token ids, parent hash, LoRA and extra keys (the cache salt)
    vLLM's own GPU events carry for the same blocks (``v1/core/block_pool.py``), and,
    where the release's events have them, the KV-cache group (0: the connector runs
    with one group) and the request's session, as vLLM fills them there, so a
    KV-aware router can match them. Blocks vLLM has not hashed (no prefix caching)
    are left out."""
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
    from vllm.v1.core import kv_cache_utils as kcu

    convert = getattr(kcu, "maybe_convert_block_hash", lambda h: h)
    extra = getattr(kcu, "generate_block_hash_extra_keys", None)
    to_event = getattr(kcu, "to_event_extra_keys", None)
    out: list[Any] = []
    for kind, request, first, end in records:
        hashes = list(getattr(request, "block_hashes", None) or ())[first:end]
        if not hashes:
            continue
        end = first + len(hashes)
        converted = [convert(h) for h in hashes]
        if kind == "removed":
            out.append(BlockRemoved(block_hashes=converted, medium=MEDIUM_CPU,
                                    **_known(BlockRemoved, group_idx=0)))
            continue
        keys = None
        if extra is not None and to_event is not None:
            per_block, mm = [], 0
            for b in range(first, end):
                key, mm = extra(request, b * block_size, (b + 1) * block_size, mm)
                per_block.append(key)
            keys = to_event(per_block)
        lora = getattr(request, "lora_request", None)
        tokens = list(request.all_token_ids[first * block_size:end * block_size])
        out.append(BlockStored(
            block_hashes=converted,
            parent_block_hash=convert(request.block_hashes[first - 1]) if first else None,
            token_ids=tokens, block_size=block_size,
            lora_id=lora.adapter_id if lora else None, medium=MEDIUM_CPU,
            lora_name=lora.name if lora else None, extra_keys=keys,
            **_known(BlockStored, group_idx=0,
                     session_id=getattr(request, "session_id", None))))
    return out


def _known(event_type: Any, **fields: Any) -> dict[str, Any]:
    """The ``fields`` this release's event type has (msgspec's ``__struct_fields__``)."""
    have = set(getattr(event_type, "__struct_fields__", ()))
    return {k: v for k, v in fields.items() if k in have}
