"""Engine-driven transfers: this client copies KV between its paged cache and the
server's shared-memory L1 pool, between PREPARE_* and COMMIT_* requests.

The server answers PREPARE_STORE / PREPARE_RETRIEVE with *slots*: byte ranges of its
pool, each holding one chunk object. Every slot is checked against what was registered
(shape, dtype, length, bounds) before a byte is copied, since a wrong slot would make
this client write over another chunk. Pools are mapped once per client and name, and
unmapped when no registration uses them (a restarted 0.5.3 server names a new pool).
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ProtocolMismatch
from ..ipc.base import STORAGE_DTYPES, ExportableKVCache, KVGeometry
from ..ipc.cpu_cache import CpuKVCache
from ..ipc.shm import PageMapper, map_existing
from ..protocol.types import PoolSlot

if TYPE_CHECKING:  # numpy and the copy modules are imported on the first copy
    import numpy as np

    from ..ipc.copy_workers import CopyWorkers
    from ..ipc.paged_copy import Task

__all__ = ["Pool", "PoolMaps", "NO_POOL_HELP", "copy_into_slots", "copy_from_slots"]

NO_POOL_HELP = (
    "the server has no shared-memory L1 pool, so engine-driven transfers would need "
    "pickled torch tensors, which lmcache_mp does not send. Start the server with "
    "--shm-name NAME (needed from 0.5.4; on GPU hosts also --no-l1-use-lazy), or register "
    "with mode='lmcache'"
)


@dataclass(frozen=True)
class Pool:
    """The server's L1 pool as this client maps it, on one connection."""

    name: str
    size: int
    epoch: int
    view: np.ndarray = field(repr=False, compare=False)
    #: Maps the pool's pages here ahead of a CPU copy (shared by every user of the map).
    pages: PageMapper | None = field(default=None, repr=False, compare=False)
    #: Called with :attr:`view` before the mapping is closed (shared by every user of
    #: the map): a GPU copy that page-locked the pool adds the unlocking here.
    before_unmap: set[Callable[[np.ndarray], None]] = field(
        default_factory=set, repr=False, compare=False)
    #: The GPU copies' record of this mapping's page-locking (shared by every user of
    #: the map, gone with it: a new mapping at a reused address starts afresh).
    pinning: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: Called with every pool the client maps from now on (shared by the client's
    #: pools): the GPU copies page-lock a restarted server's new pool when it is mapped,
    #: on a thread of their own, not in the first copy that needs it.
    on_new_map: list[Callable[[Pool], None]] = field(
        default_factory=list, repr=False, compare=False)

    def prepare(self, slots: Sequence[PoolSlot]) -> None:
        """Map the pages of ``slots`` in bulk before a copy touches them."""
        if self.pages is not None:
            for slot in slots:
                self.pages.prepare(slot.offset, slot.length)


@dataclass
class _Mapping:
    """One mapping of a server pool, shared by every :class:`Pool` made from it."""

    mapping: mmap.mmap
    view: np.ndarray
    pages: PageMapper
    users: int = 0
    before_unmap: set[Callable[[np.ndarray], None]] = field(default_factory=set)
    pinning: dict[str, Any] = field(default_factory=dict)

    def pool(self, name: str, size: int, epoch: int,
             on_new_map: list[Callable[[Pool], None]]) -> Pool:
        return Pool(name, size, epoch, self.view, self.pages, self.before_unmap,
                    self.pinning, on_new_map)

    def unmap(self) -> None:
        for hook in list(self.before_unmap):
            hook(self.view)
        try:
            self.mapping.close()
        except BufferError:
            pass  # a copy still holds a view: the mapping goes with the last one


class PoolMaps:
    """The server pools this client has mapped, shared by its registrations.

    Keyed by name *and connection*: a server restarted with the same ``--shm-name``
    makes a new segment under that name, and the old mapping would still show the
    dead server's memory.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[str, int], _Mapping] = {}  # by (name, epoch)
        # Mappings replaced by a larger one of the same pool while still used: unmapped
        # (their hooks run) when their last user releases them.
        self._replaced: list[_Mapping] = []
        self._workers: CopyWorkers | None = None
        self._on_new_map: list[Callable[[Pool], None]] = []

    @property
    def workers(self) -> CopyWorkers:
        """The client's copy threads (started on the first engine-driven copy)."""
        with self._lock:
            if self._workers is None:
                from ..ipc.copy_workers import CopyWorkers

                self._workers = CopyWorkers()
            return self._workers

    def acquire(self, name: str, size: int, epoch: int) -> Pool:
        with self._lock:
            key = (name, epoch)
            entry = self._maps.get(key)
            fresh = entry is None or entry.view.size < size
            if fresh:
                import numpy as np

                if entry is not None:  # the pool grew: the old mapping goes with its users
                    self._replaced.append(entry)
                pool = map_existing(name, size)
                entry = self._maps[key] = _Mapping(pool, np.frombuffer(pool, dtype=np.uint8),
                                                   PageMapper(pool, size))
            assert entry is not None
            entry.users += 1
            mapped = entry.pool(name, size, epoch, self._on_new_map)
            hooks = list(self._on_new_map) if fresh else []
        for hook in hooks:  # e.g. start page-locking it, on a thread of its own
            hook(mapped)
        return mapped

    def release(self, pool: Pool | None) -> None:
        if pool is None:
            return
        key = (pool.name, pool.epoch)
        with self._lock:
            entry = self._maps.get(key)
            if entry is None or entry.view is not pool.view:
                entry = next((e for e in self._replaced if e.view is pool.view), None)
                if entry is None:
                    return
                entry.users -= 1
                if entry.users:
                    return
                self._replaced.remove(entry)
            else:
                entry.users -= 1
                if entry.users:
                    return
                del self._maps[key]
        entry.unmap()

    def close(self) -> None:
        with self._lock:
            entries = list(self._maps.values()) + self._replaced
            self._maps.clear()
            self._replaced = []
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()
        for entry in entries:
            entry.unmap()

    def __len__(self) -> int:
        return len(self._maps)


def bound_to(cache: ExportableKVCache, pool: Pool) -> Pool:
    """``pool``, just mapped for a registration of ``cache``: a GPU cache starts
    page-locking it now, on a thread of its own (``cudaHostRegister`` of a GiB-sized
    L1 takes 0.1-0.3 s per GiB), not in its first copy on the caller's thread, which
    may be vLLM's forward thread. A CPU cache's copy modules are imported now too,
    not by its first copy, which is on a request's path (0.3 ms here, a few ms where
    their bytecode is not cached)."""
    if not isinstance(cache, CpuKVCache):
        from ..ipc.cuda.staging import start_pinning

        start_pinning(cache, pool)
    else:
        from ..ipc import copy_workers, paged_copy  # noqa: F401
    return pool


def slot_view(pool: Pool, slot: PoolSlot, g: KVGeometry, chunk_size: int) -> np.ndarray:
    """The chunk object in ``slot``, checked against what was registered."""
    expect = ([g.num_layers, chunk_size, g.hidden_dim] if g.kv_planes == 1
              else [2, g.num_layers, chunk_size, g.hidden_dim])
    nbytes = math.prod(expect) * g.itemsize
    # One-plane objects (MLA, fused K/V) stored through REGISTER_KV_CACHE carry a
    # leading kv_size of 1: same bytes, one more dimension.
    shape_ok = slot.shape == expect or (g.kv_planes == 1 and slot.shape == [1, *expect])
    if not shape_ok or slot.dtype != g.dtype or slot.length != nbytes or slot.offset < 0 or (
        slot.offset + slot.length > pool.size
    ):
        raise ProtocolMismatch(
            f"the server offered slot {slot!r}, expected shape {expect} {g.dtype} "
            f"({nbytes} bytes) inside a {pool.size}-byte pool"
        )
    np_dtype = STORAGE_DTYPES[g.dtype][0]
    view: np.ndarray = pool.view[slot.offset : slot.offset + slot.length].view(np_dtype)
    return view.reshape(expect)


def copy_into_slots(
    cache: ExportableKVCache,
    ids: np.ndarray,
    slots: Sequence[PoolSlot],
    chunk_indices: Sequence[int],
    pool: Pool,
    chunk_size: int,
    workers: CopyWorkers | None = None,
    stream: Any = None,
) -> None:
    """PREPARE_STORE's slots are filled from the blocks of their chunk of the key. The
    whole context is checked before a byte is copied (ProtocolMismatch: none was)."""
    if len(slots) != len(chunk_indices):
        raise ProtocolMismatch(f"PREPARE_STORE returned {len(slots)} slots for "
                               f"{len(chunk_indices)} chunk indices")
    g = cache.geometry
    per_chunk = chunk_size // g.block_size
    num_chunks = len(ids) // per_chunk
    seen: set[int] = set()
    for ci in chunk_indices:
        # Each named chunk of the key once (the order is the server's to choose).
        if not 0 <= ci < num_chunks or ci in seen:
            raise ProtocolMismatch(f"PREPARE_STORE named chunks {list(chunk_indices)} of a "
                                   f"{num_chunks}-chunk key (expected distinct indices "
                                   f"in [0, {num_chunks}))")
        seen.add(ci)
    # Every slot is checked before the first copy: a context that is wrong anywhere
    # writes nothing.
    targets = [slot_view(pool, slot, g, chunk_size) for slot in slots]
    if not isinstance(cache, CpuKVCache):  # a GPU cache: CUDA copies on ``stream``
        from ..ipc.cuda.staging import device_copy_into_slots

        # The copies page-lock the pool (until it is unmapped: a before_unmap hook).
        device_copy_into_slots(cache, ids, targets, chunk_indices, pool, chunk_size, stream)
        return
    from ..ipc.paged_copy import gather_run_tasks, gather_tasks

    pool.prepare(slots)
    tasks: list[Task] = []
    for k, m, step in _runs(slots, chunk_indices, ids, per_chunk):
        ci = chunk_indices[k]
        if m == 1:
            tasks += gather_tasks(cache.layers, ids[ci * per_chunk : (ci + 1) * per_chunk],
                                  targets[k], g)
        else:
            tasks += gather_run_tasks(cache.layers, int(ids[ci * per_chunk]),
                                      _run_view(pool, slots[k], m, targets[k]), g, step)
    _run(tasks, workers)


def copy_from_slots(
    cache: ExportableKVCache,
    ids: np.ndarray,
    slots: Sequence[PoolSlot],
    pool: Pool,
    chunk_size: int,
    skip_first_n_tokens: int,
    workers: CopyWorkers | None = None,
    stream: Any = None,
) -> None:
    """PREPARE_RETRIEVE's slots (one per chunk of the key, in order) are copied into the
    blocks, leaving the first ``skip_first_n_tokens`` (whole blocks) untouched. Every slot
    is checked before a block is written (ProtocolMismatch: none was)."""
    g = cache.geometry
    per_chunk = chunk_size // g.block_size
    if len(slots) != len(ids) // per_chunk:
        raise ProtocolMismatch(f"PREPARE_RETRIEVE returned {len(slots)} slots for "
                               f"{len(ids) // per_chunk} chunks")
    sources = [slot_view(pool, slot, g, chunk_size) for slot in slots]
    skip_blocks = skip_first_n_tokens // g.block_size
    if not isinstance(cache, CpuKVCache):  # a GPU cache: CUDA copies on ``stream``
        from ..ipc.cuda.staging import device_copy_from_slots

        device_copy_from_slots(cache, ids, sources, pool, chunk_size, skip_blocks, stream)
        return
    from ..ipc.paged_copy import scatter_run_tasks, scatter_tasks

    pool.prepare(slots)
    tasks: list[Task] = []
    # Chunks wholly skipped are left alone; one partly skipped is copied on its own.
    first, partly = divmod(skip_blocks, per_chunk)
    if partly and first < len(sources):
        tasks += scatter_tasks(sources[first], cache.layers,
                               ids[first * per_chunk : (first + 1) * per_chunk], g,
                               skip_blocks=partly)
        first += 1
    for k, m, step in _runs(slots[first:], range(first, len(slots)), ids, per_chunk):
        ci = first + k
        if m == 1:
            tasks += scatter_tasks(sources[ci], cache.layers,
                                   ids[ci * per_chunk : (ci + 1) * per_chunk], g)
        else:
            tasks += scatter_run_tasks(_run_view(pool, slots[ci], m, sources[ci]),
                                       cache.layers, int(ids[ci * per_chunk]), g, step)
    _run(tasks, workers)


def _runs(slots: Sequence[PoolSlot], chunks: Sequence[int], ids: np.ndarray,
          per_chunk: int) -> list[tuple[int, int, int]]:
    """``slots`` (of chunks ``chunks`` of the key) as ``(position, count, step)`` groups
    to copy as one: slots lying one after another in the pool, for consecutive chunks
    whose blocks are one run of ids going by ``step`` (1 or -1; a group of one: copied
    on its own, whatever its blocks)."""
    import numpy as np

    # Which run of ids rising (falling) by one each block position belongs to.
    steps = np.diff(ids)
    up = np.cumsum(np.concatenate(([0], steps != 1)))
    down = np.cumsum(np.concatenate(([0], steps != -1)))
    groups: list[tuple[int, int, int]] = []
    k, n = 0, len(slots)
    while k < n:
        start, m, step = chunks[k] * per_chunk, 1, 1
        while k + m < n and chunks[k + m] == chunks[k] + m and (
                slots[k + m].offset == slots[k].offset + m * slots[k].length):
            last = start + (m + 1) * per_chunk - 1  # of the next chunk's blocks
            if up[last] == up[start]:
                step = 1
            elif down[last] == down[start]:
                step = -1
            else:
                break
            m += 1
        groups.append((k, m, step))
        k += m
    return groups


def _run_view(pool: Pool, slot: PoolSlot, m: int, first: np.ndarray) -> np.ndarray:
    """The ``m`` chunk objects from ``slot`` on (each checked by :func:`slot_view`;
    ``first``: the first one's view), as one array ``[m, *chunk object shape]``."""
    view: np.ndarray = pool.view[slot.offset : slot.offset + m * slot.length].view(first.dtype)
    return view.reshape((m, *first.shape))


def _run(tasks: list[Task], workers: CopyWorkers | None) -> None:
    from ..ipc.paged_copy import run_task

    if workers is None:
        for t in tasks:
            run_task(t)
    else:
        workers.run(tasks, run_task)
