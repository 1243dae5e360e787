"""Moved to :mod:`lmcache_mp.protocol.pickles.emitter` (the wrapper pickles REGISTER
sends belong to the protocol layer; its parts are in :mod:`lmcache_mp.protocol.pickles`).
This module stays so that code importing ``lmcache_mp.pickle_emitter`` keeps working:
it re-exports the public names, the very same objects."""

from __future__ import annotations

from .protocol.pickles.emitter import (
    TEMPLATE_NAMES,
    TORCH_DTYPES,
    CudaStorageHandle,
    FieldSpec,
    Template,
    emit,
    emit_cpu_shm_wrapper,
    emit_cuda_ipc_wrapper,
    emit_raw_cuda_wrapper,
    load_template,
)

__all__ = [
    "TEMPLATE_NAMES",
    "TORCH_DTYPES",
    "FieldSpec",
    "Template",
    "CudaStorageHandle",
    "load_template",
    "emit",
    "emit_cpu_shm_wrapper",
    "emit_raw_cuda_wrapper",
    "emit_cuda_ipc_wrapper",
]
