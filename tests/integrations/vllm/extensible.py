"""vLLM 0.34's extensible KV cache, re-created over host memory (no GPU, no CUDA VMM).

On CUDA, vLLM 0.34 allocates the KV cache as its *extensible* cache by default
(``vllm/v1/worker/extensible_kv_cache.py``): an address-space reservation
(``ExtensibleTensor``, CUDA VMM: ``cuMemAddressReserve`` / ``cuMemCreate`` /
``cuMemMap``) whose per-layer regions are padded to the VMM granule
(``pad_kv_cache_segments``), of which warm-up commits a prefix; once warm-up measured
the memory, ``extend_kv_cache`` commits the final block count, builds per-layer views
whose storages span one layer's committed blocks each (``committed_views``), creates
the worker's KV connector and registers those views with it. Sleep releases the
physical memory (``release_physical``) between ``unregister_kv_caches`` and
``restore_kv_caches``, and wake maps fresh zeroed pages at the same addresses
(``recommit``).

Everything here is vLLM's own code but the ``ExtensibleTensor``: :class:`HostExtensibleTensor`
keeps its interface over an anonymous private mapping (a reservation whose pages are
backed when touched), with the same segment offsets, the same committed prefixes, one
storage per segment view sized exactly to its committed bytes (as
``uint8_tensor_from_ptr`` makes them), CUDA's 2 MiB granule, and ``release_physical``
as ``madvise(MADV_DONTNEED)``: the same addresses, zeroed pages after. :func:`extend`
runs vLLM's ``extend_kv_cache`` on a stand-in for the model runner with only the
fields it reads; its ``ensure_kv_transfer_initialized`` creates the connector exactly
as vLLM's does (``KVConnectorFactory.create_connector(config=..., role=WORKER,
kv_cache_config=...)``) without ``_sync_engine_id_across_tp``, which broadcasts over a
TP group that does not exist when one process stands in for the ranks.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch

#: CUDA's VMM granule (vLLM floors every granule at 2 MiB: ``_MIN_GRANULARITY``).
GRANULE = 2 << 20


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class HostExtensibleTensor:
    """``vllm.utils.extensible_tensor.ExtensibleTensor`` over host memory (see the
    module's docstring): the methods and properties ``ExtensibleKVCache`` uses."""

    def __init__(self, max_num_bytes: int, device: Any = None, num_segments: int = 1,
                 segment_capacities: Sequence[int] | None = None,
                 export_handle_types: int = 0) -> None:
        if segment_capacities is None:
            segment_capacities = [max_num_bytes // num_segments] * num_segments
        assert sum(segment_capacities) == max_num_bytes
        self._caps = list(segment_capacities)
        self._offsets = [sum(self._caps[:i]) for i in range(len(self._caps))]
        self._committed = [0] * len(self._caps)
        self._max = max_num_bytes
        self._map = mmap.mmap(-1, max(max_num_bytes, 1),
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.granularity = GRANULE
        self.device = torch.device("cpu")
        self.export_handle_types = export_handle_types
        self.releases = 0

    @property
    def num_segments(self) -> int:
        return len(self._caps)

    @property
    def base_ptr(self) -> int:
        return int(self.full_view().data_ptr())

    def _view(self, start: int, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(memoryview(self._map)[start:start + nbytes],
                                dtype=torch.uint8)

    def full_view(self) -> torch.Tensor:
        return self._view(0, self._max)

    def segment_view(self, index: int) -> torch.Tensor:
        """The segment's committed prefix, its own storage of exactly that size."""
        return self._view(self._offsets[index], self._committed[index])

    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> None:
        assert len(sizes) == self.num_segments
        for i, (old, new) in enumerate(zip(self._committed, sizes, strict=True)):
            if new < old or new > self._caps[i]:
                raise ValueError(f"segment {i}: cannot resize {old} -> {new} bytes")
            if zero_new and new > old:
                self._view(self._offsets[i] + old, new - old).zero_()
            self._committed[i] = new

    def resize_per_segment_(self, bytes_per_segment: int, zero_new: bool = False) -> None:
        self.resize_segments_([bytes_per_segment] * self.num_segments, zero_new)

    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        return [True] * len(sizes)

    @property
    def physical_bytes(self) -> int:
        return sum(_round_up(c, GRANULE) for c in self._committed)

    def release_physical(self) -> None:
        """The pages go; the addresses stay (they read as zeros until committed)."""
        self._map.madvise(mmap.MADV_DONTNEED)
        self._committed = [0] * self.num_segments
        self.releases += 1

    def free(self) -> None:
        self._committed = [0] * self.num_segments


@contextlib.contextmanager
def host_memory() -> Iterator[Any]:
    """vLLM's ``extensible_kv_cache`` module with its ``ExtensibleTensor`` over host
    memory, for the ``with`` block."""
    from vllm.v1.worker import extensible_kv_cache as ekc

    real = ekc.ExtensibleTensor
    ekc.ExtensibleTensor = HostExtensibleTensor
    try:
        yield ekc
    finally:
        ekc.ExtensibleTensor = real


def allocate(kv_cache_config: Any, layout: Any, warmup_blocks: int) -> tuple[Any, Any]:
    """What ``GPUWorker.initialize_from_config`` and ``GPUModelRunner.initialize_kv_cache``
    do with ``extensible=True``: pad the layers' regions to the granule, reserve the
    capacity, commit the minimum through ``allocate_kv_cache``'s allocator hook; then
    warm-up commits ``warmup_blocks``. Returns (the padded config, the
    ``ExtensibleKVCache``)."""
    from vllm.v1.worker.utils import allocate_kv_cache

    with host_memory() as ekc:
        padded = ekc.pad_kv_cache_segments(kv_cache_config, layout, GRANULE,
                                           registers_memory=False)
        cache = ekc.ExtensibleKVCache(padded, torch.device("cpu"), layout)
        allocate_kv_cache(padded, torch.device("cpu"), layout, allocate=cache.allocate)
        cache.commit(warmup_blocks)
    return padded, cache


def extend(vllm_config: Any, padded: Any, cache: Any, num_blocks: int) -> Any:
    """vLLM's ``extend_kv_cache``: commits ``num_blocks``, creates the worker connector
    against the committed memory and registers the committed views with it (through
    ``get_kv_connector``: vLLM's V2 ``ActiveKVConnector``). Returns the stand-in runner:
    ``kv_caches_by_layer`` (the views), ``kv_connector`` (the ``ActiveKVConnector``),
    ``kv_cache_config`` (the final config the worker has)."""
    import copy

    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    def ensure_kv_transfer_initialized(config: Any, kv_cache_config: Any) -> None:
        if kv_transfer_state._KV_CONNECTOR_AGENT is None:
            kv_transfer_state._KV_CONNECTOR_AGENT = KVConnectorFactory.create_connector(
                config=config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config)

    runner = SimpleNamespace(
        extensible_kv_cache=cache, vllm_config=vllm_config,
        cache_config=vllm_config.cache_config, kv_cache_config=copy.deepcopy(padded),
        compilation_config=SimpleNamespace(static_forward_context={}),
        kernel_block_sizes=None, attn_groups=[], speculator=None, device=torch.device("cpu"),
        kv_caches_by_layer={name: None for t in padded.kv_cache_tensors for name in t.layers},
        kv_caches=[])
    with host_memory() as ekc:
        real = ekc.ensure_kv_transfer_initialized
        ekc.ensure_kv_transfer_initialized = ensure_kv_transfer_initialized
        try:
            ekc.extend_kv_cache(runner, padded, num_blocks)
        finally:
            ekc.ensure_kv_transfer_initialized = real
    return runner
