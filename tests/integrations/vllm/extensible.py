"""vLLM 0.34's extensible KV cache, made by vLLM's own code over the fake CUDA driver.

On CUDA, vLLM 0.34 allocates the KV cache as its *extensible* cache by default
(``vllm/v1/worker/extensible_kv_cache.py``): an ``ExtensibleTensor``
(``vllm/utils/extensible_tensor.py``: a ``cuMemAddressReserve`` reservation whose
``_VirtualBuffer`` maps a new ``cuMemCreate`` chunk at every commit, for the granules
not mapped yet) whose per-layer regions are padded to the VMM granule
(``pad_kv_cache_segments``). ``initialize_kv_cache`` commits the minimum (the null
block), warm-up commits what its dummy batches address (``ensure_kv_cache_blocks``),
and ``extend_kv_cache`` commits the final block count, builds per-layer views whose
storages span one layer's committed blocks each (``committed_views``), creates the
worker's KV connector and registers those views with it. So a layer's view spans one
chunk per commit that reached it: vLLM's minimum, warm-up and extend steps. Sleep
releases the physical memory (``release_physical``: unmap, release) between
``unregister_kv_caches`` and ``restore_kv_caches``, and wake maps fresh chunks at the
same addresses (``recommit``).

Everything here is vLLM's own code, ``ExtensibleTensor`` and ``_VirtualBuffer``
included; only the driver underneath is not CUDA's: :class:`FakeVmmDriver` is vLLM's
``VmmDriver`` interface (``utils/vmm_driver.py``) over
``tests/support/fake_cuda.py``'s VMM model (reservations, chunks with the handle types
vLLM requests, ``cuMemGetAddressRange`` answering one chunk), whose reservations are
host memory at their own addresses. vLLM's views are made by its own
``uint8_tensor_from_ptr`` as DLPack CPU tensors (``dlpack_device_type`` kDLCPU) over
those bytes, so the fake forward pass writes the same bytes the connector moves; the
connector is handed them as CUDA tensors (:func:`as_cuda`: what it reads of a tensor,
at the same addresses, on ``cuda:<rank>``) and registers them through its CUDA path
over the same fake driver (installed as lmcache_mp's process driver).

:func:`extend` runs vLLM's ``extend_kv_cache`` on a stand-in for the model runner with
only the fields it reads; its ``ensure_kv_transfer_initialized`` creates the connector
exactly as vLLM's does (``KVConnectorFactory.create_connector(config=..., role=WORKER,
kv_cache_config=...)``) without ``_sync_engine_id_across_tp``, which broadcasts over a
TP group that does not exist when one process stands in for the ranks.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tools/ run it too
from tests.support.fake_cuda import GRANULE, FakeDriver, FakeTensor  # noqa: E402

#: DLPack's kDLCPU: vLLM's views of the fake device memory are CPU tensors over it.
_KDL_CPU = 1
#: vLLM's MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (utils/vmm_driver.py).
_POSIX_FD = 0x1


class FakeVmmDriver:
    """vLLM 0.34's ``VmmDriver`` (``utils/vmm_driver.py``) over the fake CUDA driver:
    the calls ``_VirtualBuffer``, ``granule_size`` and ``uint8_tensor_from_ptr`` make,
    each the fake's model of the CUDA call vLLM's ``CudaVmmDriver`` makes."""

    dlpack_device_type = _KDL_CPU

    def __init__(self, drv: FakeDriver) -> None:
        self.drv = drv

    def error_string(self, code: int) -> str:
        return f"fake CUDA error {code}"

    def unusable_runtime_reason(self, device_index: int) -> str | None:
        return None

    def ensure_context(self, device_index: int) -> None:
        self.drv.set_device(device_index)

    def granularity(self, device_index: int) -> int:
        return GRANULE

    def reserve(self, size: int) -> int:
        return self.drv.vmm_address_reserve(size)

    def free_reserved(self, ptr: int, size: int) -> None:
        self.drv.vmm_address_free(ptr, size)

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> Any:
        # vLLM's _make_alloc_prop: requestedHandleTypes = export_handle_types &
        # POSIX_FD (FABRIC instead only on hosts with an IMEX channel: not modelled).
        return self.drv.vmm_create(size, device_index, export_handle_types & _POSIX_FD)

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self.drv.vmm_map(ptr, size, handle)

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        self.drv.vmm_set_access(ptr, size, device_index)

    def unmap(self, ptr: int, size: int) -> None:
        self.drv.vmm_unmap(ptr, size)

    def release(self, handle: Any) -> None:
        self.drv.vmm_release(handle)


@functools.cache
def fake_cuda(devices: int = 8) -> FakeDriver:
    """This process's fake CUDA driver (one per engine process), installed under vLLM's
    extensible tensor (its ``get_vmm_driver``) and as lmcache_mp's process driver, so
    vLLM's allocation and the connector's registration see the same memory. vLLM's
    ``release_physical`` synchronises the device first (``torch.accelerator``, absent
    from a CPU torch): the fake's device synchronisation stands in."""
    import vllm.utils.extensible_tensor as et

    from lmcache_mp.ipc.cuda import driver

    drv = FakeDriver(devices=devices)
    vmm = FakeVmmDriver(drv)
    et.get_vmm_driver = lambda: vmm  # read by vLLM at every use: kept for the process
    driver._default_driver = drv
    torch.accelerator.synchronize = lambda device=None: drv.synchronize_device()
    return drv


def as_cuda(views: dict[str, Any], device: int) -> dict[str, Any]:
    """vLLM's committed views as the GPU worker hands them to the connector: CUDA
    tensors on ``device`` with the same addresses, shapes, strides and dtype (what the
    connector reads of a tensor); the bytes are the fake driver's device memory."""
    return {name: FakeTensor(int(t.data_ptr()), tuple(t.shape), str(t.dtype), device=device,
                             strides=tuple(t.stride())) for name, t in views.items()}


def allocate(kv_cache_config: Any, layout: Any, warmup_blocks: int, *, device: int = 0,
             vllm_config: Any = None) -> tuple[Any, Any]:
    """What ``GPUWorker.initialize_from_config`` and ``GPUModelRunner.initialize_kv_cache``
    do with ``extensible=True``: pad the layers' regions to the granule, reserve the
    capacity on ``cuda:<device>`` with the handle types vLLM requests for the
    connector's ``kv_cache_access`` (``kv_cache_export_handle_types``), commit the
    minimum through ``allocate_kv_cache``'s allocator hook; then warm-up commits
    ``warmup_blocks`` (``ensure_kv_cache_blocks``). Returns (the padded config, the
    ``ExtensibleKVCache``)."""
    from vllm.v1.worker import extensible_kv_cache as ekc
    from vllm.v1.worker.utils import allocate_kv_cache

    fake_cuda()
    padded = ekc.pad_kv_cache_segments(kv_cache_config, layout, GRANULE,
                                       registers_memory=False)
    handle_types = 0 if vllm_config is None else ekc.kv_cache_export_handle_types(vllm_config)
    cache = ekc.ExtensibleKVCache(padded, torch.device("cuda", device), layout,
                                  export_handle_types=handle_types)
    allocate_kv_cache(padded, torch.device("cpu"), layout, allocate=cache.allocate)
    ekc.ensure_kv_cache_blocks(SimpleNamespace(extensible_kv_cache=cache), warmup_blocks)
    return padded, cache


def chunks_per_layer(views: dict[str, Any]) -> list[int]:
    """How many cuMemCreate chunks each layer's view spans, asked as the connector asks
    (``cuMemGetAddressRange`` chunk by chunk)."""
    drv = fake_cuda()
    out = []
    for t in views.values():
        at, end, n = int(t.data_ptr()), int(t.data_ptr()) + int(t.untyped_storage().nbytes()), 0
        while at < end:
            base, size = drv.address_range(at)
            at, n = base + size, n + 1
        out.append(n)
    return out


def extend(vllm_config: Any, padded: Any, cache: Any, num_blocks: int,
           device: int = 0) -> Any:
    """vLLM's ``extend_kv_cache``: commits ``num_blocks``, creates the worker connector
    against the committed memory and registers the committed views with it (through
    ``get_kv_connector``: vLLM's V2 ``ActiveKVConnector``), as CUDA tensors of
    ``cuda:<device>`` (:func:`as_cuda`). Returns the stand-in runner:
    ``kv_caches_by_layer`` (the views), ``kv_connector`` (the ``ActiveKVConnector``),
    ``kv_cache_config`` (the final config the worker has)."""
    import copy

    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.worker import extensible_kv_cache as ekc

    def ensure_kv_transfer_initialized(config: Any, kv_cache_config: Any) -> None:
        if kv_transfer_state._KV_CONNECTOR_AGENT is None:
            connector = KVConnectorFactory.create_connector(
                config=config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config)
            register = connector.register_kv_caches
            connector.register_kv_caches = lambda views: register(as_cuda(views, device))
            kv_transfer_state._KV_CONNECTOR_AGENT = connector

    runner = SimpleNamespace(
        extensible_kv_cache=cache, vllm_config=vllm_config,
        cache_config=vllm_config.cache_config, kv_cache_config=copy.deepcopy(padded),
        compilation_config=SimpleNamespace(static_forward_context={}),
        kernel_block_sizes=None, attn_groups=[], speculator=None, device=torch.device("cpu"),
        kv_caches_by_layer={name: None for t in padded.kv_cache_tensors for name in t.layers},
        kv_caches=[])
    real = ekc.ensure_kv_transfer_initialized
    ekc.ensure_kv_transfer_initialized = ensure_kv_transfer_initialized
    try:
        ekc.extend_kv_cache(runner, padded, num_blocks)
    finally:
        ekc.ensure_kv_transfer_initialized = real
    return runner
