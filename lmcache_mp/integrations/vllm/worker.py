"""The worker side: one registration per rank, RETRIEVE / STORE as ordered, results.

Transfers are submitted without waiting (retrieves in ``start_load_kv``, stores after
the forward pass) and collected in :meth:`WorkerSide.get_finished`, which only polls.
A request the scheduler holds (``StepOps.held``: vLLM keeps its blocks for its stores)
is reported "finished sending" once its stores on this rank are done, and no other
request is; every RETRIEVE, done or failed, is reported "finished receiving" (vLLM
waits for that report, also for an aborted request); a failed or dropped RETRIEVE
reports the blocks it was to write through :meth:`load_errors` so vLLM recomputes them
(never those of ``skip_first_n_tokens``: vLLM's own computed blocks, which running
requests may share: ``TransferOp.written_block_ids``). While the client's heartbeat says the
server is down nothing is sent (loads fail at once, stores are skipped), so a dead
server never holds the forward pass; the registration re-registers itself when the
server is back (lmcache_mp's recovery).

CUDA KV caches: ordering on torch's current stream. vLLM calls ``start_load_kv`` and
``wait_for_save`` on the thread that queues the forward pass, and the transfers go
out with ``stream=None``, which lmcache_mp resolves to torch's current stream there
(as LMCache's own connector records its event on the current stream). A STORE,
submitted in ``wait_for_save``, sends an event recorded after the forward pass's
kernels: the server's copy waits for the blocks' writes. A RETRIEVE's reply is
collected in ``get_finished`` (vLLM loads asynchronously: the request is not scheduled
before that), which makes the same stream wait for the server's copy before any later
forward pass is queued on it; a finished STORE does the same before vLLM may reuse its
blocks. Engine-driven CUDA transfers copy on that stream and synchronise it before
returning.

Engine-driven CPU caches: the transfers run on two background threads of the worker
(``lmcache-mp-vllm-loads``, ``lmcache-mp-vllm-stores``), not on vLLM's forward thread:
a load never queues behind stores (a warm request's first token waits for its load,
nobody waits for a store). Each waits for a server round trip (PREPARE_*) and copies
between vLLM's blocks and the server's pool; on the forward thread that delayed every
step that stored (the first token of a cold prompt among them). The blocks stay put
meanwhile: a RETRIEVE's request is not scheduled before it is reported done, a STORE
reads the KV of computed tokens, which vLLM does not rewrite while the request runs,
keeps for a finished request until its stores are reported done, and reuses a
preempted request's blocks only once :meth:`flush_stores` waited for that request's
stores. CUDA caches keep the calling thread (their order is the current stream's).
With ``lmcache.mp.sync_load`` a warm request is scheduled in the step its RETRIEVE is
ordered in: ``start_load_kv`` waits for that RETRIEVE before the forward pass reads the
blocks, and settles it there (``_end_sync_loads``).

A step that schedules no tokens (``StepOps.idle``: every request waits, a warm one for
its load) runs no forward pass: there ``get_finished`` waits for the loads in flight,
at most :data:`IDLE_LOAD_WAIT_S`, and reports them in that step, so vLLM schedules a
warm request in the next step instead of one or two empty steps later (each a round
trip between vLLM's engine core and this worker, which also compete with the copy and
the server for the CPU); while it waits, the forward thread does not spin in vLLM's
queue, so the load thread's copy has the core. Nothing else runs in such a step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, cast

import numpy as np

from ...errors import InvalidArgument, LMCacheMPError, ProtocolMismatch
from ...ipc.cpu_cache import CpuKVCache
from ...keys import CacheKey
from .config import ConnectorConfig, RankPlacement
from .ops import StepOps, TransferOp
from .stats import Counters

__all__ = ["WorkerSide"]

log = logging.getLogger("lmcache_mp")

#: How long ``get_finished`` of a step without a forward pass waits for the loads in
#: flight (their COMMITs' replies; a load still running then is reported by a later
#: step, as in other steps): bounded, since a new request waits for this step's end.
IDLE_LOAD_WAIT_S = 0.1
#: How much longer than ``transfer_timeout`` ``start_load_kv`` waits for a synchronous
#: load (its reply's own deadline is ``transfer_timeout``; this only covers a late
#: resolution): past it the load counts as failed.
SYNC_LOAD_GRACE_S = 5.0


class _Background:
    """A transfer submitted on the worker's transfer thread: done once the thread has
    submitted it (or failed to) and its reply is in; ``result`` as the reply's."""

    __slots__ = ("_submitted",)

    def __init__(self, submitted: Future[Any]) -> None:
        self._submitted = submitted

    def done(self) -> bool:
        if not self._submitted.done():
            return False
        return self._submitted.exception() is not None or self._submitted.result().done()

    def result(self) -> Any:
        return self._submitted.result().result()

    def wait(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for :meth:`done`, without raising."""
        deadline = time.monotonic() + seconds
        try:
            reply = self._submitted.result(timeout=max(0.0, seconds))
        except FutureTimeout:
            return False
        except BaseException:  # noqa: BLE001  (raised again by result())
            return True
        return bool(reply.wait(max(0.0, deadline - time.monotonic())))


class _Done:
    """A transfer with nothing to move: done, successful."""

    def done(self) -> bool:
        return True

    def result(self) -> bool:
        return True

    def wait(self, seconds: float) -> bool:
        return True


_NOTHING_TO_MOVE = _Done()


class WorkerSide:
    """``client``: a lmcache_mp ``Client`` for this rank's server (or a fake);
    ``register``: makes the registration once the KV caches are known."""

    def __init__(self, cfg: ConnectorConfig, client: Any, place: RankPlacement,
                 model_name: str) -> None:
        self.cfg = cfg
        self.client = client
        self.place = place
        self.model_name = model_name
        self.reg: Any = None
        #: Makes the registration: ``register(instance_id)`` (None: a new one).
        self._register: Callable[[int | None], Any] | None = None
        #: The instance id of the registration sleep mode dropped (restored with it).
        self._instance_id: int | None = None
        self._registering: threading.Thread | None = None
        self._stop_registering = threading.Event()
        self.block_size = 0
        #: The CUDA stream of transfers: None is torch's current stream at each call.
        self.stream: Any = None
        #: Per request: (future or None if not sent, block ids, tokens, submitted at,
        #: blocks reported failed whatever the outcome: ``TransferOp.unloaded_block_ids``).
        self._loads: dict[str, list[tuple[Any, tuple[int, ...], int, float,
                                          tuple[int, ...]]]] = {}
        #: Per request: (future, tokens, submitted at, (start, end)).
        self._stores: dict[str, list[tuple[Any, int, float, tuple[int, int]]]] = {}
        self._held: set[str] = set()  # to report "finished sending" once stored
        self._errors: set[int] = set()
        #: STOREs that failed or were not sent since the scheduler last took them
        #: (vLLM's request id, start, end): their KV events are withdrawn.
        self._failed_stores: set[tuple[str, int, int]] = set()
        #: Requests whose synchronous load ended since the scheduler last took them.
        self._sync_loaded: set[str] = set()
        #: Requests whose synchronous load failed: vLLM's forward pass computed over the
        #: failed blocks, so none of their STOREs is made (until vLLM finishes them).
        self._no_stores: set[str] = set()
        #: Counters for tests and logs.
        self.stats = {"retrieved": 0, "stored": 0, "load_errors": 0, "store_errors": 0,
                      "skipped_stores": 0, "early_loads": 0}
        #: What vLLM's stats loggers get (``get_kv_connector_stats``), per interval.
        self.metrics = Counters()
        #: Engine-driven CPU transfers run on these (see the module's docstring).
        self._load_thread: ThreadPoolExecutor | None = None
        self._store_thread: ThreadPoolExecutor | None = None
        #: Per wire id (session): the request's packed token ids, as the scheduler sent
        #: them once (``StepOps.tokens``), and the key checked from them on first use.
        self._tokens: dict[str, bytes] = {}
        self._keys: dict[str, CacheKey] = {}
        self._learned: StepOps | None = None
        #: The step whose RETRIEVEs were sent (``handle_preemptions`` or ``start_load_kv``).
        self._loads_started: StepOps | None = None

    # ----------------------------------------------------------- registering
    def set_registration(self, register: Callable[[int | None], Any],
                         block_size: int) -> None:
        """Register now (vLLM's start-up) if the server answers; otherwise retry on a
        thread of its own every ``health_interval`` (never on vLLM's forward thread: a
        registration may wait its whole deadline), and miss meanwhile. A registration
        that cannot work whatever the server's state (the cache and the transfer mode
        do not go together, the server lacks what the mode needs) raises here: vLLM
        does not start with a connector that would never move anything."""
        self._register = register
        self.block_size = block_size
        self._start_registering()

    def _start_registering(self) -> None:
        if not self._try_register():
            self._stop_registering.clear()
            self._registering = threading.Thread(target=self._retry_registration,
                                                 daemon=True, name="lmcache-mp-vllm-register")
            self._registering.start()

    def _try_register(self) -> bool:
        """One registration attempt (its errors logged); a refusal raises."""
        assert self._register is not None
        try:
            reg = self._register(self._instance_id)
        except (InvalidArgument, ProtocolMismatch):
            raise  # no retry makes it work: the message says what to set
        except LMCacheMPError as err:
            log.warning("lmcache_mp connector: cannot register the KV cache with %s yet "
                        "(%s); retrying", self.place.url, err)
            return False
        if reg.mode == "engine" and _is_cpu(reg) and self._load_thread is None:
            self._load_thread = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="lmcache-mp-vllm-loads")
            self._store_thread = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="lmcache-mp-vllm-stores")
            for thread in (self._load_thread, self._store_thread):
                thread.submit(_nothing)  # its thread starts now, not in a transfer's hook
        log.info("lmcache_mp connector: rank %d registered with %s (%s mode, instance %d)",
                 self.place.kv_worker_id, self.place.url, reg.mode, reg.instance_id)
        self._instance_id = reg.instance_id
        self.reg = reg  # last: the forward thread uses it as soon as it is set
        return True

    def _retry_registration(self) -> None:
        while not self._stop_registering.wait(self.cfg.health_interval):
            # Nothing is attempted while the heartbeat says the server is down.
            if not self.client.healthy:
                continue
            try:
                if self._try_register():
                    return
            except LMCacheMPError as err:  # a refusal, found once the server answered
                log.error("lmcache_mp connector: the KV cache cannot be registered with "
                          "%s: %s; the connector moves nothing", self.place.url, err)
                return

    def _stop_retrying(self, deadline: float) -> None:
        self._stop_registering.set()
        registering, self._registering = self._registering, None
        if registering is not None:  # bounded by the registration's own deadline
            registering.join(timeout=max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------ sleep mode
    def unregister(self) -> None:
        """vLLM is about to release the KV cache's memory (sleep, or a weight update
        that borrows it): wait for what still reads or writes it, then unregister (the
        server forgets the cache; its entries stay). Loads meanwhile fail (vLLM
        recomputes), stores are skipped. Idempotent."""
        deadline = time.monotonic() + self.cfg.transfer_timeout
        self._stop_retrying(deadline)
        self.flush_stores()
        for loads in self._loads.values():
            for future, *_ in loads:
                if future is not None and time.monotonic() < deadline:
                    try:
                        future.result()
                    except LMCacheMPError:
                        pass  # reported by get_finished as a failed load
        reg, self.reg = self.reg, None
        if reg is not None:
            try:
                reg.unregister(timeout=min(self.cfg.mq_timeout, 10.0))
            except LMCacheMPError as err:
                log.warning("lmcache_mp connector: unregister before sleep: %s", err)
            # Wake-up wraps the new memory in a new cache: this one's device resources
            # (the gather path's staging buffer, up to LMCACHE_MP_STAGING_MB) go now.
            close = getattr(getattr(reg, "cache", None), "close", None)
            if close is not None:
                close()
            log.info("lmcache_mp connector: rank %d unregistered instance %d (vLLM "
                     "releases its KV cache's memory)", self.place.kv_worker_id,
                     reg.instance_id)

    def restore(self) -> None:
        """vLLM mapped fresh memory behind the KV cache (wake-up): register it again,
        under the same instance id (the server's entries of this model stay usable;
        what vLLM's blocks held is gone). As at start: retried in the background while
        the server does not answer. Idempotent."""
        if self.reg is None and (self._registering is None
                                 or not self._registering.is_alive()):
            self._start_registering()

    def _usable(self) -> bool:
        return self.reg is not None and bool(self.client.healthy)

    def _unusable_reason(self) -> str:
        if self.reg is None:
            return f"the KV cache is not registered with {self.place.url} (yet)"
        return f"the server at {self.place.url} is not answering heartbeats"

    def _learn(self, step: StepOps) -> None:
        """The step's token ids and forgotten sessions (once per step)."""
        if step is self._learned:
            return
        self._learned = step
        for sid in step.forget:
            self._tokens.pop(sid, None)
            self._keys.pop(sid, None)
        for sid, packed in step.tokens.items():
            self._tokens[sid] = packed
            self._keys.pop(sid, None)

    def _key(self, op: TransferOp) -> CacheKey:
        """The op's key: cut from the request's key, built (and its token ids checked,
        read in bulk, no int per token) once per request."""
        sid = op.wire_id
        base = self._keys.get(sid)
        if base is None or base.cache_salt != op.cache_salt:
            packed = self._tokens.get(sid)
            if packed is None:
                raise InvalidArgument(
                    f"{op.direction} of {op.request_id}: the scheduler's metadata never "
                    f"carried its token ids (a connector bug: please report it)")
            base = CacheKey(model_name=self.model_name, world_size=self.place.kv_world_size,
                            worker_id=self.place.kv_worker_id,
                            token_ids=np.frombuffer(packed, dtype=">u4"), start=0,
                            end=len(packed) // 4, request_id=sid, cache_salt=op.cache_salt)
            self._keys[sid] = base
        return base.with_range(op.start, op.end)

    # -------------------------------------------------------------- transfers
    def start_loads(self, step: StepOps, *, early: bool = False) -> None:
        """The step's RETRIEVEs (and which finished requests to report once stored),
        sent once per step; then (``start_load_kv``) its synchronous loads waited for.

        ``early``: called from ``handle_preemptions``, before vLLM prepares the step's
        inputs (0.32 and 0.33's model runner; 0.34's calls the hooks back to back). The
        loads of a step with a synchronous load start there when the cache is a CPU
        cache: the copy then overlaps that preparation (~1.3 ms for a new 8k-token
        request at 0.32) instead of following it. Safe: the blocks are the loading
        requests' own, which vLLM reads in no earlier step, and ``handle_preemptions``
        has ended the preempted requests' stores first. vLLM itself starts a step's
        loads before its forward pass only when one is synchronous, the others after
        it (off the forward's path): so do these. A CUDA cache's loads stay at
        ``start_load_kv``: their order is the current stream's there, and moving it is
        untested without a device."""
        self._learn(step)
        if step is not self._loads_started and (not early or (
                _is_cpu(self.reg) and any(op.sync for op in step.ops))):
            self._loads_started = step
            if step.held:
                self._held.update(step.held)
            if step.ops:  # most steps: nothing to load
                self.stats["early_loads"] += int(early)
                with self._one_event():
                    for op in step.retrieves():
                        self._start_load(op)
        if early or not step.ops:
            return
        sync = {op.request_id for op in step.retrieves() if op.sync}
        if sync:
            self._end_sync_loads(sync)

    def _end_sync_loads(self, request_ids: set[str]) -> None:
        """The step's synchronous loads (``lmcache.mp.sync_load``), waited for here,
        before the forward pass computes over their blocks, and settled: their failed
        blocks go to vLLM with this step's output (``get_block_ids_with_load_errors``).
        A request with a block this load did not write (failed, or one no whole chunk
        covers: ``TransferOp.unloaded_block_ids``) makes no STORE from now on: this
        step's forward pass computes its later tokens over that block."""
        deadline = time.monotonic() + self.cfg.transfer_timeout + SYNC_LOAD_GRACE_S
        for rid in sorted(request_ids):
            loads = self._loads.pop(rid, [])
            for future, *_ in loads:
                if future is not None:
                    future.wait(max(0.0, deadline - time.monotonic()))
            if not self._settle_loads(rid, loads) or any(unloaded for *_, unloaded in loads):
                self._no_stores.add(rid)
            self._sync_loaded.add(rid)

    def _start_load(self, op: TransferOp) -> None:
        future: Any = None
        if op.end <= op.start:
            future = _NOTHING_TO_MOVE  # vLLM granted no whole chunk: unloaded blocks only
        elif not self._usable():
            log.warning("lmcache_mp connector: RETRIEVE %s not sent: %s; vLLM "
                        "recomputes", op.request_id, self._unusable_reason())
        else:
            try:
                future = self._submit(
                    self._load_thread, self.reg.retrieve_async, self._key(op), list(op.block_ids),
                    skip_first_n_tokens=op.skip_first_n_tokens,
                    timeout=self.cfg.transfer_timeout, stream=self.stream)
            except LMCacheMPError as err:
                log.warning("lmcache_mp connector: RETRIEVE %s not sent: %s",
                            op.request_id, err)
        tokens = op.end - op.start - op.skip_first_n_tokens
        self._loads.setdefault(op.request_id, []).append(
            (future, op.written_block_ids, tokens, time.monotonic(), op.unloaded_block_ids))

    def start_stores(self, step: StepOps) -> None:
        self._learn(step)
        if not self.place.writer:
            return  # MLA: another TP rank stores the same bytes (LMCache's rule)
        if not step.ops:
            return
        with self._one_event():
            for op in step.stores():
                self._start_store(op)

    def _start_store(self, op: TransferOp) -> None:
        if op.request_id in self._no_stores:
            # Its synchronous load failed: this step's forward pass computed its later
            # tokens over the failed blocks (vLLM rewinds it and computes them again).
            self.stats["skipped_stores"] += 1
            self.metrics.add("skipped_stores")
            self._failed_stores.add((op.request_id, op.start, op.end))
            return
        if not self._usable():
            self.stats["skipped_stores"] += 1
            self.metrics.add("skipped_stores")
            self.metrics.add("store_failures")
            self._failed_stores.add((op.request_id, op.start, op.end))
            return
        try:
            future = self._submit(self._store_thread, self.reg.store_async, self._key(op),
                                  list(op.block_ids), timeout=self.cfg.transfer_timeout,
                                  stream=self.stream)
        except LMCacheMPError as err:
            log.warning("lmcache_mp connector: STORE %s not sent: %s", op.request_id, err)
            self.stats["store_errors"] += 1
            self.metrics.add("store_failures")
            self._failed_stores.add((op.request_id, op.start, op.end))
            return
        self._stores.setdefault(op.request_id, []).append(
            (future, op.end - op.start, time.monotonic(), (op.start, op.end)))

    def _one_event(self) -> contextlib.AbstractContextManager[None]:
        """LMCache-driven CUDA transfers of one batch (a step's RETRIEVEs, or its
        STOREs) send one interprocess event between them (``CudaKVCache.one_event``),
        as LMCache's connector does, instead of creating and exporting one each."""
        reg = self.reg
        one_event = getattr(getattr(reg, "cache", None), "one_event", None)
        if reg is None or one_event is None or getattr(reg, "mode", None) != "lmcache":
            return contextlib.nullcontext()
        return cast("contextlib.AbstractContextManager[None]", one_event())

    @staticmethod
    def _submit(thread: ThreadPoolExecutor | None, transfer: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        """``transfer(*args, **kwargs)`` (a ``*_async`` call) on ``thread`` if there is
        one (its errors then surface from ``result()``), else here."""
        if thread is None:
            return transfer(*args, **kwargs)
        return _Background(thread.submit(transfer, *args, **kwargs))

    def flush_stores(self, request_ids: Iterable[str] | None = None) -> None:
        """Wait for the pending stores of ``request_ids`` (preempted: their blocks are
        about to be reused), or of every request."""
        for rid in list(self._stores) if request_ids is None else request_ids:
            for store in self._stores.pop(rid, ()):
                self._store_done(rid, store)

    def _store_done(self, rid: str, store: tuple[Any, int, float, tuple[int, int]]) -> None:
        future, tokens, submitted, (start, end) = store
        try:
            ok = future.result()
        except LMCacheMPError as err:
            ok = False
            log.warning("lmcache_mp connector: STORE of %s failed: %s", rid, err)
        self.stats["stored" if ok else "store_errors"] += 1
        if ok:
            self.metrics.add("stores")
            self.metrics.add("stored_tokens", tokens)
            self.metrics.observe("store_seconds", time.monotonic() - submitted)
        else:
            self.metrics.add("store_failures")
            self._failed_stores.add((rid, start, end))

    # ---------------------------------------------------------------- results
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(held requests whose stores are done, requests whose loads are done). Only
        polls, except in a step without a forward pass (``StepOps.idle``: it waits for
        the loads in flight, at most ``IDLE_LOAD_WAIT_S``; module docstring).
        ``finished_req_ids`` (vLLM's) is not needed: the scheduler says which finished
        requests wait for their stores."""
        if self._no_stores:
            self._no_stores -= finished_req_ids
        if not (self._stores or self._held or self._loads):
            return set(), set()  # most steps: nothing in flight
        if self._learned is not None and self._learned.idle:
            self._wait_for_loads(time.monotonic() + IDLE_LOAD_WAIT_S)
        for rid in list(self._stores):
            left = []
            for store in self._stores[rid]:
                if store[0].done():
                    self._store_done(rid, store)
                else:
                    left.append(store)
            if left:
                self._stores[rid] = left
            else:
                del self._stores[rid]
        sending = {rid for rid in self._held if rid not in self._stores}
        self._held -= sending
        recving = set()
        for rid in list(self._loads):
            loads = self._loads[rid]
            if any(f is not None and not f.done() for f, *_ in loads):
                continue
            self._settle_loads(rid, loads)
            del self._loads[rid]
            recving.add(rid)
        return sending, recving

    def _settle_loads(self, rid: str, loads: list[tuple[Any, tuple[int, ...], int, float,
                                                        tuple[int, ...]]]) -> bool:
        """Count a request's finished loads; their failed blocks (and the blocks no
        chunk covered) go to vLLM. True if every one succeeded."""
        ok_all = True
        for future, blocks, tokens, submitted, unloaded in loads:
            self._errors.update(unloaded)
            if future is not None and not future.done():
                log.error("lmcache_mp connector: RETRIEVE of %s did not end within its "
                          "deadline; vLLM recomputes", rid)
                ok = False
            else:
                ok = self._load_ok(rid, future)
            if not ok:
                ok_all = False
                self._errors.update(blocks)
                self.stats["load_errors"] += 1
                self.metrics.add("load_failures")
            else:
                self.stats["retrieved"] += 1
                self.metrics.add("loads")
                self.metrics.add("loaded_tokens", tokens)
                self.metrics.observe("load_seconds", time.monotonic() - submitted)
        return ok_all

    def _wait_for_loads(self, deadline: float) -> None:
        """Wait (until ``deadline``) for every load in flight: a step that runs no
        forward pass (module docstring)."""
        for loads in self._loads.values():
            for future, *_ in loads:
                left = deadline - time.monotonic()
                if future is not None and (left <= 0 or not future.wait(left)):
                    return

    def _load_ok(self, rid: str, future: Any) -> bool:
        if future is None:
            return False
        try:
            ok = bool(future.result())
        except LMCacheMPError as err:
            log.warning("lmcache_mp connector: RETRIEVE of %s failed: %s; vLLM recomputes",
                        rid, err)
            return False
        if not ok:
            log.warning("lmcache_mp connector: RETRIEVE of %s found a chunk missing; vLLM "
                        "recomputes", rid)
        return ok

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def sync_loads_ended(self) -> set[str]:
        """Requests whose synchronous load ended since the last call (for the
        scheduler: their RETRIEVE is done)."""
        ended, self._sync_loaded = self._sync_loaded, set()
        return ended

    def failed_stores(self) -> set[tuple[str, int, int]]:
        """STOREs that failed or were not sent since the last call (for the scheduler:
        vLLM's request id, start, end)."""
        failed, self._failed_stores = self._failed_stores, set()
        return failed

    # ----------------------------------------------------------------- closing
    def shutdown(self) -> None:
        deadline = time.monotonic() + self.cfg.transfer_timeout
        self._stop_retrying(deadline)
        for rid in list(self._stores):
            for store in self._stores.pop(rid):
                if time.monotonic() < deadline:
                    self._store_done(rid, store)
        for thread in (self._load_thread, self._store_thread):
            if thread is not None:
                thread.shutdown(wait=True)  # each transfer is bounded by its deadline
        self._load_thread = self._store_thread = None
        if self.reg is not None:
            try:
                self.reg.unregister(timeout=min(self.cfg.mq_timeout, 10.0))
            except LMCacheMPError as err:
                log.warning("lmcache_mp connector: unregister: %s", err)
            self.reg = None
        self.client.close()


def _nothing() -> None:
    """A task that starts an executor's thread."""


def _is_cpu(reg: Any) -> bool:
    return isinstance(getattr(reg, "cache", None), CpuKVCache)
