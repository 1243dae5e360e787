"""Exporting KV-cache memory to the server: POSIX shared memory on CPU hosts
(:mod:`.shm`, :mod:`.cpu_cache`), the paged <-> chunk copies of the engine-driven
mode (:mod:`.paged_copy`), and CUDA IPC (imported only when used)."""

from __future__ import annotations

from .cpu_cache import CpuKVCache

__all__ = ["CpuKVCache"]
