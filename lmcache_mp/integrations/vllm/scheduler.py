"""The scheduler side: lookups, lock bookkeeping and the per-step transfer orders.

It follows LMCache's connector (``LMCacheMPConnector``, 0.5.6): a request's
chunk-aligned prefix is looked up on every server, waiting for the answers at most
``lookup_wait`` per scheduler step (5 ms; vLLM is told "not yet" until every answer is
in, and a local server's usually is within the step); the hit is the minimum over servers (extra locks are
freed); chunks vLLM's own prefix cache already holds have their locks freed, and the
RETRIEVE skips them; newly computed whole prompt chunks (and decode chunks with
``save_decode_cache``) are stored; a preempted request looks up again (unless its
load failed); a finished request ends its server session; vLLM's cache reset tags
every key made after it (:meth:`SchedulerSide.reset`); a LoRA request's keys carry its
adapter. While a server does not answer its health probe,
lookups report 0 and nothing is sent to it, so the engine never waits on a dead server.

What vLLM is promised, and kept:

* ``request_finished`` returns True (vLLM keeps the blocks) only for a request that
  had STOREs ordered; the workers report exactly those requests "finished sending",
  once their stores are done (the step's ``held``). A request aborted while its load
  is pending returns False: vLLM keeps its blocks until the load is reported finished
  (an aborted request whose RETRIEVE was not ordered yet still gets it, so the
  report comes and the lookup's read locks are consumed).
* Read locks: a lookup whose answer timed out is asked again in the background until
  the server says how many chunks it locked, which are then freed; a request's
  END_SESSION goes out only after its FREE_LOOKUP_LOCKS were answered and its load
  reported (the server may handle requests out of order, and a session ended first
  loses the record of what to free).
* Server sessions: every request instance has its own session id on the wire
  (vLLM's request id plus a suffix unique to this scheduler and tracker), because
  every LMCache release (0.5.3 to 0.5.7rc2) keys a session by request id alone and
  caches its chunk hashes: a request id the server has seen before (vLLM with
  ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``, another engine, a session left by an
  engine that died) would otherwise make its STOREs and RETRIEVEs use the *old*
  prompt's hashes (a RETRIEVE that finds nothing after a hit; a STORE under another
  prompt's key). A preempted request keeps its session. END_SESSION waits for the
  workers' "finished sending" report of a held request: a STORE the server handles
  after END_SESSION would create the session again, to linger for 600 s.
* ``kv_role``: a ``kv_consumer`` never stores, a ``kv_producer`` never looks up.

vLLM objects are read by attribute only (``request_id``, ``all_token_ids``,
``num_prompt_tokens``, ``cache_salt``, ``status``, ...), so this runs in unit tests
without vLLM.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidArgument, LMCacheMPError, RequestTimeout
from ...keys import SALT_MAX_LEN, CacheKey
from .compat import resumed_req_ids, skips_external_kv, token_ids
from .config import ConnectorConfig, salt_usable
from .ops import StepOps, TransferOp
from .stats import Counters

__all__ = ["SchedulerSide", "State", "SETTLE_S", "LOOKUP_REFRESH_FRACTION"]

log = logging.getLogger("lmcache_mp")

#: How long a lookup whose answer timed out is asked again for the locks it took
#: (the servers drop unreleased read locks after 300 s anyway).
SETTLE_S = 60.0
#: A lookup answered longer ago than this fraction of the servers' read-lock
#: lifetime (``lmcache.mp.read_lock_ttl``) is made again before vLLM allocates for its
#: hit: the rest covers vLLM's allocation, the RETRIEVE and a busy server.
LOOKUP_REFRESH_FRACTION = 0.5


class State(enum.Enum):
    LOOKUP = "lookup"        # lookup sent (or not yet possible); vLLM has not allocated
    LOADING = "loading"      # blocks allocated for a hit; RETRIEVE goes out next step
    READY = "ready"          # computing / storing
    BYPASS = "bypass"        # never touches the cache (bad salt, embeds, failed load)


@dataclass
class _Lookup:
    submit: Any                       # ReplyFuture of LOOKUP's acknowledgement
    query: Any = None                 # ReplyFuture of QUERY_PREFETCH_STATUS
    chunks: int | None = None         # the answer; 0 after an error
    #: The answer timed out, but the server may hold read locks for it: asked again
    #: (until this monotonic time) and freed once it says how many.
    settle_until: float = 0.0


@dataclass
class Tracker:
    request_id: str
    #: The request's tokens [0, n) as one checked key (session id, no worker id, cache
    #: salt): built once, ranges cut from it without checking the tokens again. None
    #: for a bypassing request.
    key: CacheKey | None
    num_prompt_tokens: int
    salt: str
    #: The request id on the wire: the server's session for this request instance.
    session_id: str = ""
    #: vLLM's Request (this is the scheduler's process): its token list grows as it
    #: decodes, which the stores of ``save_decode_cache`` need.
    request: Any = None
    state: State = State.LOOKUP
    lookups: dict[str, _Lookup] = field(default_factory=dict)
    lookup_end: int = 0               # the chunk-aligned prefix looked up
    lookup_sent: float = 0.0          # when (monotonic) the lookups went out
    asked: float = 0.0                # when vLLM first asked for its hit (the L2 wait)
    hit: int | None = None            # tokens cached on every server (None: not known)
    vllm_hit: int = 0
    #: The tokens vLLM had computed when it asked for the hit (``vllm_hit`` is that,
    #: rounded down to a block) and the external tokens offered it: vLLM 0.34 may
    #: grant fewer (``update_state_after_alloc``).
    local: int = 0
    offered: int = 0
    #: Where the RETRIEVE ends: the hit, or the last whole chunk vLLM granted.
    load_end: int = 0
    #: Blocks vLLM counts as loaded that no whole chunk covers (``TransferOp``).
    unloaded_blocks: tuple[int, ...] = ()
    stored: int = 0                   # tokens [0, stored) need no STORE
    scheduled: int = 0
    #: Tokens vLLM had computed when it first scheduled the request (its
    #: ``num_computed_tokens`` then: a local hit may end inside a block, which vLLM
    #: shows the connector rounded down); None until then.
    base: int | None = None
    block_ids: list[int] = field(default_factory=list)
    stores_ordered: bool = False      # a STORE went to the workers
    load_ordered: bool = False        # a RETRIEVE went out, not yet reported done
    frees: list[Any] = field(default_factory=list)  # this request's FREE replies
    #: Finished with STOREs in flight: END_SESSION waits for "finished sending".
    sending: bool = False
    #: The key whose token ids the workers were sent (``StepOps.tokens``).
    sent_key: CacheKey | None = None
    #: vLLM discards external hits for this request (prompt logprobs, ...): it is
    #: never looked up, its chunks are still stored.
    no_reads: bool = False
    #: The blocks the ordered RETRIEVE writes (``TransferOp.written_block_ids``): a
    #: failed load reports these, and only these, to vLLM.
    load_blocks: frozenset[int] = frozenset()
    #: A load of this request failed: it is not looked up again (a preempted request
    #: would otherwise look up, load and fail again, forever, while the server
    #: answers lookups but the load cannot work); it computes, and stores, what it needs.
    load_failed: bool = False
    #: Its RETRIEVE was synchronous (``lmcache.mp.sync_load``): vLLM computed the
    #: request in that step, so once that load failed the request orders no more STOREs
    #: (its blocks after the failed ones hold KV computed over them until vLLM computes
    #: them again, and what it has computed is not tracked across vLLM's rewind).
    sync_load: bool = False
    #: Keyed before a cache reset (:meth:`SchedulerSide.reset`) while holding blocks, or
    #: told a hit vLLM may have allocated for already: it finishes on what it holds (a
    #: load under the key it was looked up with), and orders no more STOREs (its KV is
    #: the old weights'); asked for its hit again (vLLM had not allocated), it is
    #: looked up afresh.
    frozen: bool = False

    @property
    def num_tokens(self) -> int:
        return 0 if self.key is None else self.key.num_token_ids


class SchedulerSide:
    """``clients`` maps each server URL to a lmcache_mp ``Client`` (or a fake);
    ``kv_world_size`` is the KV world size each server sees; ``kv_role`` vLLM's
    (``kv_both``, ``kv_producer``: stores only, ``kv_consumer``: loads only);
    ``idle_waits``: whether a step without a forward pass lets the workers wait for the
    loads in flight (``StepOps.idle``: not under data parallelism)."""

    def __init__(self, cfg: ConnectorConfig, clients: dict[str, Any], *, model_name: str,
                 kv_world_size: int, block_size: int, lookup_tp_size: int = 1,
                 mla: bool = False, start_health: bool = True,
                 kv_role: str = "kv_both", initial_check: bool = True,
                 events: bool = False, idle_waits: bool = True) -> None:
        self.cfg = cfg
        self.clients = clients
        self.model_name = model_name
        self.kv_world_size = kv_world_size
        self.block_size = block_size
        # LOOKUP's tp_size (read locks per chunk), as LMCache sends it: TP size per server.
        self.lookup_tp_size = lookup_tp_size
        #: A pure-MLA cache: every TP rank on a server reads each chunk (read locks).
        self.mla = mla
        self.loads = kv_role != "kv_producer"
        self.stores = kv_role != "kv_consumer"
        self.idle_waits = idle_waits
        self.trackers: dict[str, Tracker] = {}
        self._chunk_size: int | None = None
        self.healthy = {url: False for url in clients}
        self._background: list[Any] = []  # fire-and-forget futures, reaped each step
        #: Until when (monotonic) this step's lookups may wait for answers (0: not set).
        self._wait_until = 0.0
        #: The same for ``may_load`` (vLLM asks it as it queues requests, between
        #: steps): one budget per step interval, apart from the step's own.
        self._admit_until = 0.0
        #: Finished requests the workers must report "finished sending" (next step).
        self._held: list[str] = []
        #: Sessions whose token ids the workers may drop (next step).
        self._forget: list[str] = []
        #: Finished requests not yet done with the server: a RETRIEVE to order, a load
        #: to be reported, lookups to settle, frees to be answered; then END_SESSION.
        self._finishing: list[Tracker] = []
        #: What vLLM's stats loggers get (``get_kv_connector_stats``), per interval.
        self.metrics = Counters()
        # Session ids: vLLM's request id + this scheduler's nonce + a per-tracker count.
        self._session_nonce = uuid.uuid4().hex[:8]
        self._session_count = itertools.count()
        #: KV events for vLLM (``take_events``; only with vLLM's KV events on):
        #: ("stored" | "removed", vLLM's request, first block, end block).
        self.events = events
        self._events: list[tuple[str, Any, int, int]] = []
        #: vLLM's cache resets so far (:meth:`reset`), and the tag every key made since
        #: the last one carries in its cache salt (random: a count would collide with
        #: another engine's on the same server), so nothing stored before is loaded.
        self.generation = 0
        self._reset_tag = ""
        self._stop = threading.Event()
        self._health_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: Whether a health check ran; without ``initial_check`` the first runs when
        #: first needed (the connector lets vLLM hand the workers' protocol families
        #: over first, so that this process sends no probe of its own).
        self._checked = False
        if initial_check:
            self.check_health()
        if start_health:
            self._thread = threading.Thread(target=self._health_loop, daemon=True,
                                            name="lmcache-mp-vllm-health")
            self._thread.start()

    # ------------------------------------------------------------------ health
    def check_health(self, timeout: float | None = None) -> None:
        """Probe every server once (NOOP, within ``timeout``: default the health
        interval); learn the chunk size from the first that answers. Runs on the health
        thread, so a dead server costs the engine nothing."""
        with self._health_lock:
            for url, client in self.clients.items():
                try:
                    client.noop(timeout=timeout or self.cfg.health_interval)
                    if self._chunk_size is None:
                        self._chunk_size = int(client.chunk_size(timeout=self.cfg.mq_timeout))
                    ok = True
                except LMCacheMPError as err:
                    ok = False
                    if self.healthy.get(url, True):
                        log.warning("lmcache_mp connector: server %s is not answering (%s); "
                                    "lookups report no hit until it does", url, err)
                if ok and not self.healthy[url]:
                    log.info("lmcache_mp connector: server %s answers", url)
                self.healthy[url] = ok
            self._checked = True  # a failed first check is not rerun on every read

    def _health_loop(self) -> None:
        while not self._stop.wait(self.cfg.health_interval):
            self.check_health()

    @property
    def chunk_size(self) -> int | None:
        """The servers' chunk size, None until one answered. Without ``initial_check``
        the first read runs the first health check (see ``__init__``)."""
        if not self._checked:
            self.check_health()
        return self._chunk_size

    def all_healthy(self) -> bool:
        return self.chunk_size is not None and all(self.healthy.values())

    def shutdown(self) -> None:
        """Stop the health probes; release what every request still holds on the
        servers, queued ones included (an eager lookup's read locks, its session), and
        end their sessions (within ``lookup_timeout``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.health_interval + 5)
        live, self.trackers = list(self.trackers.values()), {}
        for t in live:
            self._end(t)
        deadline = time.monotonic() + self.cfg.lookup_timeout
        while self._finishing and time.monotonic() < deadline:
            for t in self._finishing:
                # No more steps (the workers are done or gone): a RETRIEVE still to
                # order never goes out, so the locks it would have released are freed.
                if t.state is State.LOADING:
                    self._abandon_load(t)
                t.load_ordered, t.sending = False, False
            self._advance_finishing()
            if self._finishing:
                time.sleep(0.01)

    def _abandon_load(self, t: Tracker) -> None:
        """A LOADING request whose RETRIEVE will not be ordered: free the read locks
        it would have released."""
        chunk = self._chunk_size or 1
        t.state = State.READY
        for url in self.clients:
            self._free(url, t, t.vllm_hit // chunk * chunk, t.load_end)

    # -------------------------------------------------------------- trackers
    def _base_key(self, tokens: Any, session_id: str, salt: str) -> CacheKey:
        ids = token_ids(tokens)  # vLLM's ConstantList of a list or a TokenBuffer: compat
        return CacheKey(model_name=self.model_name, world_size=self.kv_world_size,
                        worker_id=None, token_ids=ids, start=0, end=len(ids),
                        request_id=session_id, cache_salt=salt)

    def _tracker(self, request: Any) -> Tracker:
        t = self.trackers.get(request.request_id)
        session_id = None
        if t is not None and t.state is not State.LOOKUP and _preempted(request):
            # Preempted: vLLM freed its blocks and schedules it again from its own
            # prefix cache; look it up again (what it stored is on the server), as
            # LMCache's own connector 0.5.6 does (vLLM 0.34's in-tree copy of it
            # answers 0 for a preempted request instead). Its server session goes on
            # (same session id); one whose load failed is not loaded again.
            log.debug("lmcache_mp connector: request %s was preempted; looking it up "
                      "again", request.request_id)
            load_failed, session_id, old, t = t.load_failed, t.session_id, t, None
            if old.state is not State.BYPASS and old.salt != self.wire_salt(request):
                # Keyed afresh since (a cache reset): the server's session keeps the
                # chunk hashes of the old key, so the old session ends, a new one starts.
                self._end(dataclasses.replace(old, state=State.READY, load_ordered=False,
                                              sending=False))
                session_id = None
        else:
            load_failed = False
        if t is None:
            if session_id is None:
                session_id = self._new_session(request.request_id)
            reason = _bypass_reason(request, getattr(request, "cache_salt", None) or "")
            salt = self.wire_salt(request)
            key = None
            if reason is None:
                try:
                    key = self._base_key(request.all_token_ids, session_id, salt)
                except InvalidArgument as err:  # token ids outside uint32
                    reason = f"its token ids are not LMCache's ({err})"
            t = Tracker(request.request_id, key, int(request.num_prompt_tokens), salt,
                        session_id, request, no_reads=skips_external_kv(request) or load_failed,
                        load_failed=load_failed)
            if reason:
                log.debug("lmcache_mp connector: request %s bypasses the cache: %s",
                          request.request_id, reason)
                t.state = State.BYPASS
            self.trackers[t.request_id] = t
        return t

    def _new_session(self, request_id: str) -> str:
        return f"{request_id}~{self._session_nonce}{next(self._session_count):x}"

    def wire_salt(self, request: Any) -> str:
        """The cache salt a request's keys carry: its own, its LoRA adapter's identity
        (:func:`_lora_tag`) and, after a cache reset, the reset's tag (within LMCache's
        128 characters: a long salt is hashed)."""
        salt = getattr(request, "cache_salt", None) or ""
        tags = _lora_tag(request) + self._reset_tag
        if not tags:
            return salt
        if len(salt) + len(tags) > SALT_MAX_LEN:
            salt = "h" + hashlib.sha256(salt.encode()).hexdigest()[:40]
        return salt + tags

    # ------------------------------------------------------- vLLM 0.34's queries
    def has_pending_block_frees(self) -> bool:
        """Whether finished requests' blocks are held only for stores in flight."""
        return bool(self._held) or any(t.sending for t in self._finishing)

    def may_load(self, request: Any) -> bool:
        """Whether ``request`` will load from the servers: only a known hit says yes (a
        false yes holds vLLM's other asynchronous loads back). vLLM asks under
        ``--max-num-inflight-kv-loads`` only, as it queues the request, right after
        ``on_new_request`` sent its lookup: the answer is waited for within
        ``lookup_wait`` (one budget for the requests queued between two steps; a local
        server answers within it); a request not looked up yet says no."""
        t = self.trackers.get(request.request_id)
        if (not self.loads or skips_external_kv(request) or t is None
                or t.state is State.BYPASS or t.no_reads):
            return False
        if t.hit is None and t.state is State.LOOKUP and t.lookups:
            if not self._admit_until:
                self._admit_until = time.monotonic() + self.cfg.lookup_wait
            self._advance_lookup(t, self._admit_until)
        return (t.hit or 0) > 0

    def take_events(self) -> list[tuple[str, Any, int, int]]:
        events, self._events = self._events, []
        return events

    # ----------------------------------------------------------------- reset
    def reset(self) -> bool:
        """vLLM's ``reset_cache``: ``LLM.sleep`` (its ``reset_connector`` is True by
        default), a pause that clears caches, a weight update. From now on this
        engine's keys carry a new random tag in their cache salt, so it never looks up
        anything stored before, the old weights' KV and stores still in flight
        included, nor what any other engine stores (a count of resets would collide
        with another engine's); another engine loads the old entries only with the same
        salt and no reset (an engine on the old weights; engines started with new
        weights share theirs through ``lmcache.mp.weights_version``). Nothing is
        deleted unless ``lmcache.mp.clear_on_reset``, whose CLEAR drops every model's
        unlocked entries on every server. Live requests: one still to be looked up
        starts afresh (its lookup's locks freed, its session ended); one holding blocks
        (vLLM did not preempt it) finishes on what it holds, a load already looked up
        included (under the key it was looked up with: its locks are that key's), and
        stores nothing more (its KV is the old weights'); a preempted one is keyed
        afresh when scheduled again. True (a CLEAR that fails is logged: the tag alone
        keeps old KV out)."""
        self.generation += 1
        self._reset_tag = f"#r-{uuid.uuid4().hex[:12]}"
        for t in list(self.trackers.values()):
            if t.state is State.BYPASS or t.key is None:
                continue
            if t.state is State.LOOKUP and not t.offered:
                del self.trackers[t.request_id]
                self._end(t)
            else:
                # vLLM 0.34 may have allocated for an offered hit already and call
                # update_state_after_alloc a step later (deferred async loads): that
                # load must still be ordered, or vLLM waits for it forever.
                t.frozen = True
        if self.cfg.clear_on_reset:
            self._clear_servers()
        log.info("lmcache_mp connector: cache reset (%d, salt tag %s): nothing stored "
                 "before is looked up by this engine%s", self.generation, self._reset_tag,
                 "; CLEAR sent to every server" if self.cfg.clear_on_reset else "")
        return True

    def _clear_servers(self) -> None:
        """A non-forced CLEAR to every server (servers up to 0.5.5 always force),
        waited for at most ``mq_timeout``; failures are logged."""
        futures = {url: _try(functools.partial(client.clear_async, force=False,
                                               timeout=self.cfg.mq_timeout))
                   for url, client in self.clients.items() if self.healthy.get(url)}
        for url, future in futures.items():
            try:
                if future is not None:
                    future.result()
            except LMCacheMPError as err:
                log.warning("lmcache_mp connector: CLEAR of %s on reset failed: %s", url, err)

    def _key(self, t: Tracker, start: int, end: int) -> CacheKey:
        assert t.key is not None  # only a bypassing request has none, and sends nothing
        return t.key.with_range(start, end)

    # ------------------------------------------------------------- lookups
    def on_new_request(self, request: Any) -> None:
        """vLLM learned of the request (``Scheduler.add_request``: vLLM 0.32 and 0.33
        right after queueing it, 0.34 just before): with ``eager_prefetch``, send its
        lookups now, without waiting for the answers, so that the servers' loads from
        their second tier overlap the time it waits in the queue; its first scheduling
        then finds the answer in. LMCache's connector skips a resumable (streaming
        input) request, whose tokens are still to come: so does this one."""
        if not self.cfg.eager_prefetch or getattr(request, "resumable", False):
            return
        t = self._tracker(request)
        if t.state is State.LOOKUP and not t.lookups and t.hit is None:
            self._advance_lookup(t, 0.0)  # send, do not wait

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self._tracker(request)
        if t.state is State.BYPASS:
            return 0, False
        if t.state is not State.LOOKUP:
            if request.num_computed_tokens == 0:
                # Scheduled again from scratch after a failed load (vLLM freed the
                # blocks): recompute without the cache, as LMCache's connector does;
                # what it computes is stored again (the server keeps one copy).
                if (t.hit or 0) > 0 and not t.load_failed:
                    log.warning("lmcache_mp connector: request %s is recomputed without "
                                "the cache (its KV load failed)", t.request_id)
                t.state, t.hit, t.stored, t.scheduled, t.base = State.READY, 0, 0, 0, None
                t.block_ids.clear()
                t.vllm_hit = num_computed_tokens - num_computed_tokens % self.block_size
            return 0, False
        if t.frozen or (t.lookups and time.monotonic() - t.lookup_sent > (
                self.cfg.read_lock_ttl * LOOKUP_REFRESH_FRACTION)):
            t = self._look_up_again(request, t)
        if t.hit is None:
            t.asked = t.asked or time.monotonic()
            if not self._wait_until:
                # One budget per scheduler step, shared by its requests' lookups.
                self._wait_until = time.monotonic() + self.cfg.lookup_wait
            self._advance_lookup(t, self._wait_until)
            if t.hit is None:
                return None, True
        hit = t.hit
        t.local = num_computed_tokens
        t.vllm_hit = num_computed_tokens - num_computed_tokens % self.block_size
        t.stored = hit
        if hit == 0:
            return 0, False
        need = max(0, hit - num_computed_tokens)
        if hit == t.num_tokens:
            need = max(0, need - 1)  # vLLM must compute at least the last token
        t.offered = need
        # Asynchronous (True): vLLM waits for the load's "finished receiving" report
        # and schedules the request in a later step; synchronous: now, the workers
        # loading before the forward pass (lmcache.mp.sync_load).
        return need, need > 0 and not self.cfg.sync_load

    def _look_up_again(self, request: Any, t: Tracker) -> Tracker:
        """A lookup made before a cache reset (``Tracker.frozen``), or answered long
        ago (the request queued, or was looked up eagerly, over half the servers'
        read-lock lifetime before vLLM got to it: its chunks' locks may have expired
        and the chunks been evicted, and its RETRIEVE would fail). Its locks are freed
        and its session ended, and it is looked up afresh under a new session (the
        server keeps one lookup per session)."""
        log.debug("lmcache_mp connector: the lookup of %s is %.0f s old (read locks "
                  "last %g s) or before a reset: looking it up again", t.request_id,
                  time.monotonic() - t.lookup_sent, self.cfg.read_lock_ttl)
        del self.trackers[t.request_id]
        self._end(t)
        return self._tracker(request)

    def _advance_lookup(self, t: Tracker, wait_until: float) -> None:
        """Send the lookups, or collect their answers, waiting for them at most until
        ``wait_until`` (monotonic; the step's ``lookup_wait`` budget)."""
        chunk = self.chunk_size
        if not t.lookups:
            end = 0 if chunk is None else t.num_tokens // chunk * chunk
            if end == 0 or not self.loads or t.no_reads or not self.all_healthy():
                t.hit = 0
                return
            t.lookup_end, t.lookup_sent = end, time.monotonic()
            key = self._key(t, 0, end)
            for url, client in self.clients.items():
                t.lookups[url] = _Lookup(_try(functools.partial(
                    client.submit_lookup_async, key, self.lookup_tp_size,
                    timeout=self.cfg.lookup_timeout, mla=self.mla)))
        while True:
            waiting = None
            for url, lk in t.lookups.items():
                if lk.chunks is None:
                    self._poll(url, t, lk)
                    self._expire(url, t, lk)
                if lk.chunks is None:
                    waiting = waiting or lk.query or lk.submit
            if waiting is None:
                break
            # A local server answers in about a millisecond: waiting that long here
            # saves the request the scheduler steps of "not yet" (bounded per step).
            left = wait_until - time.monotonic()
            if left <= 0 or not waiting.wait(left):
                return
        assert chunk is not None
        counts = {url: lk.chunks or 0 for url, lk in t.lookups.items()}
        least = min(counts.values())
        for url, n in counts.items():  # locks beyond the common prefix are not retrieved
            if n > least:
                self._free(url, t, least * chunk, n * chunk)
            t.lookups[url].chunks = least
        t.hit = least * chunk
        self.metrics.add("lookups")
        self.metrics.add("lookup_tokens", t.lookup_end)
        self.metrics.add("hit_tokens", t.hit)
        self.metrics.observe("lookup_seconds", time.monotonic() - t.lookup_sent)

    def _poll(self, url: str, t: Tracker, lk: _Lookup) -> None:
        """Advance one lookup without blocking: its answer in ``lk.chunks`` once known
        (0 after an error; after a timeout the answer is also awaited in the
        background: :meth:`_settle`)."""
        client = self.clients[url]
        try:
            if lk.query is None:
                if lk.submit is None or not lk.submit.done():
                    if lk.submit is None:
                        lk.chunks = 0
                    return
                lk.submit.result()
                lk.query = client.query_prefetch_status_async(
                    t.session_id, timeout=self.cfg.lookup_timeout)
            if not lk.query.done():
                return
            chunks = lk.query.result()
            if chunks is None:  # still running on the server: ask again next time
                lk.query = client.query_prefetch_status_async(
                    t.session_id, timeout=self.cfg.lookup_timeout)
                return
            lk.chunks = int(chunks)
        except RequestTimeout as err:
            # The server may have taken (and may still take) read locks for it.
            log.warning("lmcache_mp connector: lookup of %s on %s timed out (%s); no hit, "
                        "its locks are freed when the server answers", t.request_id, url,
                        err)
            lk.chunks, lk.query, lk.settle_until = 0, None, time.monotonic() + SETTLE_S
        except LMCacheMPError as err:
            log.warning("lmcache_mp connector: lookup of %s on %s failed (%s); no hit",
                        t.request_id, url, err)
            lk.chunks = 0

    def _expire(self, url: str, t: Tracker, lk: _Lookup) -> None:
        """The L2-aware wait: a lookup still unanswered ``l2_load_timeout`` after vLLM
        first asked for the request's hit (the server still loading it from its second
        tier, or stalled there; queue time before does not count) is given up: the
        request goes on as a miss, and the read locks the lookup takes are freed once
        the server says how many (:meth:`_settle`)."""
        if lk.chunks is not None or not t.asked or \
                time.monotonic() - t.asked <= self.cfg.l2_load_timeout:
            return
        log.warning("lmcache_mp connector: lookup of %s on %s not answered within "
                    "lmcache.mp.l2_load_timeout=%gs; no hit, its locks are freed when the "
                    "server answers", t.request_id, url, self.cfg.l2_load_timeout)
        self.metrics.add("lookups_given_up")
        lk.chunks, lk.query, lk.settle_until = 0, None, time.monotonic() + SETTLE_S

    def _settle(self, url: str, t: Tracker, lk: _Lookup) -> None:
        """A timed-out lookup: ask the server again how many chunks it locked, and free
        them once it says (gives up at ``settle_until``: the server's TTL remains)."""
        if not self.healthy.get(url) or time.monotonic() > lk.settle_until:
            lk.settle_until = 0.0  # a server gone or restarted holds no locks of it
            return
        client = self.clients[url]
        try:
            if lk.query is None:
                if lk.submit is None:
                    lk.settle_until = 0.0  # its LOOKUP never went out: nothing locked
                    return
                if not lk.submit.done():
                    return  # asked once the server took the LOOKUP
                lk.query = client.query_prefetch_status_async(
                    t.session_id, timeout=self.cfg.lookup_timeout)
            if not lk.query.done():
                return
            chunks = lk.query.result()
        except LMCacheMPError:
            lk.query = None  # asked again next step
            return
        lk.query = None
        if chunks is None:
            return  # still running: ask again
        lk.settle_until = 0.0
        self._free(url, t, 0, int(chunks) * (self.chunk_size or 1))

    def _free(self, url: str, t: Tracker, start: int, end: int) -> None:
        if end <= start or not self.healthy.get(url):
            return
        key = self._key(t, start, end)
        client = self.clients[url]
        future = _try(lambda: client.free_lookup_locks_async(
            key, self.lookup_tp_size, timeout=self.cfg.lookup_timeout, mla=self.mla))
        if future is not None:
            t.frees.append(future)

    def _send(self, submit: Callable[[], Any]) -> None:
        future = _try(submit)
        if future is not None:
            self._background.append(future)

    # ------------------------------------------------------------ allocation
    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        t = self.trackers.get(request.request_id)
        if t is None:
            return
        if len(block_ids) > len(t.block_ids):
            t.block_ids.extend(block_ids[len(t.block_ids):])
        if t.state is not State.LOOKUP:
            return
        hit = t.hit or 0
        chunk = self.chunk_size or 1
        loading = num_external_tokens > 0 and hit > t.vllm_hit
        t.state = State.LOADING if loading else State.READY
        if not loading:
            for url in self.clients:
                self._free(url, t, 0, hit)
            return
        # vLLM's own prefix cache covers [0, vllm_hit): those chunks' locks are not
        # needed (a partly covered chunk is retrieved, which releases its lock).
        start = t.vllm_hit // chunk * chunk
        t.load_end = hit
        if num_external_tokens < t.offered:
            # vLLM granted fewer tokens than offered (0.34 may trim a hit) and
            # allocated blocks for those only: the RETRIEVE covers the whole chunks
            # within the grant; granted tokens past them no chunk can cover (LMCache
            # moves whole chunks), so their blocks are reported failed with the load.
            granted = t.local + num_external_tokens
            t.load_end = max(start, granted // chunk * chunk)
            bs = self.block_size
            t.unloaded_blocks = tuple(t.block_ids[max(t.load_end, t.vllm_hit) // bs:
                                                  -(-granted // bs)])
            log.debug("lmcache_mp connector: vLLM granted %s %d of the %d tokens "
                      "offered: loading up to %d", t.request_id, num_external_tokens,
                      t.offered, t.load_end)
        for url in self.clients:
            self._free(url, t, 0, start)
            self._free(url, t, t.load_end, hit)

    # ------------------------------------------------------------------ steps
    def build_step(self, scheduler_output: Any) -> StepOps:
        self._background = [f for f in self._background if not f.done()]
        self._wait_until = self._admit_until = 0.0  # the next step's may wait again
        step = StepOps(preempted=sorted(getattr(scheduler_output, "preempted_req_ids",
                                                None) or ()),
                       idle=self.idle_waits and getattr(
                           scheduler_output, "total_num_scheduled_tokens", 1) == 0)
        step.held, self._held = self._held, []
        step.forget, self._forget = self._forget, []
        for t in [*self.trackers.values(), *self._finishing]:
            if t.state is State.LOADING:
                self._order(step, t, self._retrieve_op(t))
        for new in scheduler_output.scheduled_new_reqs:
            first = self.trackers.get(new.req_id)
            if first is not None and first.base is None:
                first.base = getattr(new, "num_computed_tokens", None)
            self._scheduled(step, new.req_id, scheduler_output, None)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)  # vLLM 0.32 / 0.33 (0.34: in scheduled_new_reqs)
        for i, rid in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            extra = list(new_blocks[0]) if new_blocks else None
            tracker = self.trackers.get(rid)
            if rid in resumed and tracker is not None and extra is not None:
                tracker.block_ids = extra  # a resumed request's list is whole, not a delta
                extra = None
            self._scheduled(step, rid, scheduler_output, extra)
        for t in self.trackers.values():
            for url, lk in t.lookups.items():
                if lk.settle_until:
                    self._settle(url, t, lk)
        self._advance_finishing()
        return step

    def _order(self, step: StepOps, t: Tracker, op: TransferOp) -> None:
        """Add ``op`` to the step, with the request's token ids if the workers do not
        have these yet."""
        step.ops.append(op)
        if t.sent_key is not t.key:
            assert t.key is not None
            step.tokens[t.session_id] = t.key.token_bytes
            t.sent_key = t.key

    def _retrieve_op(self, t: Tracker) -> TransferOp:
        t.state, t.load_ordered = State.READY, True
        chunk = self.chunk_size
        assert chunk is not None and t.hit is not None
        start = t.vllm_hit // chunk * chunk
        end = max(start, t.load_end)
        t.sync_load = self.cfg.sync_load
        op = TransferOp("RETRIEVE", t.request_id, start, end, self._blocks(t, start, end),
                        t.salt, min(end, t.vllm_hit) - start, t.session_id,
                        unloaded_block_ids=t.unloaded_blocks, sync=t.sync_load)
        # What vLLM is told failed if the load fails (the unloaded blocks are
        # reported too, but are no failure of the cache).
        t.load_blocks = frozenset(op.written_block_ids)
        return op

    def _scheduled(self, step: StepOps, rid: str, out: Any, new_blocks: list[int] | None
                   ) -> None:
        t = self.trackers.get(rid)
        if t is None:
            return
        if new_blocks:
            t.block_ids.extend(new_blocks)
        t.scheduled += int(out.num_scheduled_tokens.get(rid, 0))
        op = self._store_op(t)
        if op is not None:
            self._order(step, t, op)
            t.stores_ordered = True

    def _store_op(self, t: Tracker) -> TransferOp | None:
        chunk = self.chunk_size
        if t.state is State.BYPASS or not self.stores or chunk is None or t.frozen or (
                t.sync_load and t.load_failed):
            return None
        if not self.cfg.save_decode_cache and t.stored + chunk > t.num_prompt_tokens:
            return None  # every whole prompt chunk ordered: a decode step's usual answer
        if not self.all_healthy():
            return None
        assert t.key is not None
        if self.cfg.save_decode_cache and t.request is not None:
            tokens = t.request.all_token_ids
            if len(tokens) // chunk > t.num_tokens // chunk:
                # A whole chunk decoded since: the key covers it too (checked again,
                # once per chunk, not per decode step).
                t.key = self._base_key(tokens, t.session_id, t.salt)
            limit = t.num_tokens
        else:
            limit = t.num_prompt_tokens
        # What vLLM has computed by the end of this step: from its own count when it
        # first scheduled the request (a local hit ending mid-block stores its last
        # chunk as soon as it is computed), else from the hits.
        computed = t.scheduled + (max(t.vllm_hit, t.hit or 0) if t.base is None else t.base)
        ready = min(limit, t.num_tokens, len(t.block_ids) * self.block_size, computed)
        n = (ready - t.stored) // chunk
        if n < 1:
            return None
        start, t.stored = t.stored, t.stored + n * chunk
        if self.events and t.request is not None:
            self._events.append(("stored", t.request, start // self.block_size,
                                 t.stored // self.block_size))
        return TransferOp("STORE", t.request_id, start, t.stored,
                          self._blocks(t, start, t.stored), t.salt,
                          session_id=t.session_id)

    def _blocks(self, t: Tracker, start: int, end: int) -> tuple[int, ...]:
        return tuple(t.block_ids[start // self.block_size: end // self.block_size])

    # -------------------------------------------------------------- finishing
    def update_connector_output(self, finished_recving: Iterable[str] | None,
                                finished_sending: Iterable[str] | None = None,
                                invalid_block_ids: Iterable[int] | None = None,
                                failed_stores: Iterable[tuple[str, int, int]] | None = None,
                                sync_loaded: Iterable[str] | None = None) -> None:
        """The workers' reports of a step (all ranks): loads that are done, held
        requests whose stores are done, the blocks of failed loads (a request whose
        load failed is never loaded again: ``Tracker.load_failed``), and STOREs that
        failed or were skipped on some rank (vLLM's request id, start, end: their
        ``BlockStored`` events are withdrawn), and synchronous loads that ended (their
        failed blocks, if any, are in the same report)."""
        done = set(finished_recving or ()) | set(sync_loaded or ())
        sent = set(finished_sending or ())
        invalid = set(invalid_block_ids or ())
        failed = set(failed_stores or ())
        if failed and self.events:
            requests = {t.request_id: t.request for t in [*self._finishing,
                                                          *self.trackers.values()]}
            for rid, start, end in sorted(failed):
                if requests.get(rid) is not None:
                    self._events.append(("removed", requests[rid], start // self.block_size,
                                         end // self.block_size))
        if done or sent or invalid:
            for t in [*self.trackers.values(), *self._finishing]:
                # Only a request whose load is in flight: a block it loaded into
                # before (and has since lost to a preemption) may be another's now.
                if invalid and t.load_ordered and not t.load_failed \
                        and t.load_blocks & invalid:
                    # Once per request (a rank's report may come a step before the
                    # others'): the workers logged why the load failed.
                    t.load_failed = True
                    # The chunks it was to load are computed by vLLM now: stored
                    # again by this request (the server may have lost them).
                    t.stored = min(t.stored, t.vllm_hit // (self._chunk_size or 1)
                                   * (self._chunk_size or 1))
                    if self.events and t.request is not None:  # what it could not load
                        self._events.append(("removed", t.request,
                                             t.vllm_hit // self.block_size,
                                             t.load_end // self.block_size))
                    log.warning("lmcache_mp connector: request %s is recomputed without "
                                "the cache: its KV load failed (the workers say why); it is "
                                "not loaded from the cache again", t.request_id)
                if t.request_id in done:
                    t.load_ordered, t.load_blocks = False, frozenset()
                if t.request_id in sent:
                    t.sending = False
            self._advance_finishing()

    def request_finished(self, request: Any) -> bool:
        """Forget the request; end its server sessions once nothing of it is in flight.
        True: vLLM keeps its blocks until the workers report its stores done (they
        are told which requests those are in the next step's ``held``)."""
        t = self.trackers.pop(request.request_id, None)
        if t is None:
            return False
        # A request waiting for its asynchronous load is held by vLLM until "finished
        # receiving"; one loaded synchronously runs, and its STOREs need the hold.
        hold = (t.stores_ordered and (t.sync_load or not t.load_ordered)
                and t.state is not State.LOADING)
        if hold:
            self._held.append(t.request_id)
            t.sending = True
        self._end(t)
        return hold

    def _end(self, t: Tracker) -> None:
        """Release what the request holds on the servers, and end its sessions when
        that is done (:meth:`_advance_finishing`)."""
        if t.state is State.LOOKUP and t.lookups:
            # Finished (aborted) before its blocks were allocated: release the locks
            # its lookup took. One not answered yet (the server may still be loading
            # from its second tier) is asked how many first, as a timed-out one is: a
            # FREE of chunks it did not lock would release other requests' locks
            # (0.5.3), and one sent while its prefetch runs frees nothing (0.5.6+).
            for url, lk in t.lookups.items():
                if lk.settle_until:
                    continue  # freed when the server answers
                if lk.chunks is None:
                    lk.settle_until = time.monotonic() + SETTLE_S
                else:
                    self._free(url, t, 0, lk.chunks * (self.chunk_size or 1))
        if t.state is not State.BYPASS:
            # A LOADING tracker's RETRIEVE is still ordered (next step): vLLM waits
            # for its report, and the RETRIEVE consumes the lookup's read locks.
            self._finishing.append(t)
            self._advance_finishing()

    def _advance_finishing(self) -> None:
        """END_SESSION for every finished request that has nothing left in flight."""
        left = []
        for t in self._finishing:
            for url, lk in t.lookups.items():
                if lk.settle_until:
                    self._settle(url, t, lk)
            t.frees = [f for f in t.frees if not f.done()]
            if (t.state is State.LOADING or t.load_ordered or t.frees or t.sending
                    or any(lk.settle_until for lk in t.lookups.values())):
                left.append(t)
                continue
            for url, client in self.clients.items():
                if self.healthy.get(url):
                    self._send(functools.partial(client.end_session_async, t.session_id,
                                                 timeout=self.cfg.lookup_timeout))
            if t.sent_key is not None:
                self._forget.append(t.session_id)
        self._finishing = left


def _preempted(request: Any) -> bool:
    status = getattr(request, "status", None)
    return getattr(status, "name", None) == "PREEMPTED"


def _try(submit: Callable[[], Any]) -> Any:
    try:
        return submit()
    except LMCacheMPError as err:
        log.warning("lmcache_mp connector: %s", err)
        return None


def _lora_tag(request: Any) -> str:
    """What a LoRA request adds to its cache salt: a digest of the adapter's name and
    path, what vLLM puts in its own block hashes (0.32-0.34 ``kv_cache_utils``
    ``_gen_lora_extra_hash_keys``): the KV an adapter computes differs from the base
    model's and from another adapter's, for the same tokens. "" without an adapter."""
    lora = getattr(request, "lora_request", None)
    if not lora:
        return ""
    name = getattr(lora, "lora_name", None) or getattr(lora, "name", "")
    path = getattr(lora, "lora_path", None) or getattr(lora, "path", "")
    digest = hashlib.sha256(f"{name}\0{path}".encode()).hexdigest()[:16]
    return f"#lora-{digest}"


def _bypass_reason(request: Any, salt: str) -> str | None:
    if not salt_usable(salt):
        return "a cache salt LMCache would reject (over 128 characters, or @ / \\ NUL)"
    if getattr(request, "prompt_embeds", None) is not None:
        return "a prompt-embeds request (its placeholder token ids collide)"
    if getattr(request, "mm_features", None):
        return "a multimodal request (placeholder hashing is not supported yet)"
    return None
