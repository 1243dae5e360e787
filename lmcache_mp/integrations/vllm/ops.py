"""What the scheduler tells the workers each step: plain, picklable transfer orders.

vLLM sends the connector metadata from the scheduler to every worker process (pickled
inside its ``SchedulerOutput``), so these are small dataclasses with no client state.
Token ids travel packed (``bytes``, big-endian uint32: LMCache 0.5.7's
``token_bytes``, packed once per request by the scheduler), and once per request, not
with every order: a step's ``tokens`` carries the ids of the requests whose first order
it is (or whose ids grew), the workers keep them until the step's ``forget`` names the
request (a tuple of Python ints costs ~12 us per 1k tokens to pickle and ~50 us to
unpickle on every worker; 16k packed tokens are 64 KiB of metadata a step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TransferOp", "StepOps"]


@dataclass(frozen=True)
class TransferOp:
    """One STORE or RETRIEVE of tokens ``[start, end)`` of a request (chunk-aligned),
    from / into ``block_ids`` (one per block of the range)."""

    direction: str  # "STORE" | "RETRIEVE"
    request_id: str
    start: int
    end: int
    block_ids: tuple[int, ...]
    cache_salt: str = ""
    skip_first_n_tokens: int = 0
    #: The request id on the wire (the server's session of this request instance);
    #: vLLM's ``request_id`` names the request to vLLM. Empty: the same.
    session_id: str = ""
    #: RETRIEVE: blocks vLLM counts as loaded that no whole chunk of the range covers
    #: (vLLM granted less than the hit, ending inside a chunk): reported failed with
    #: the load, so vLLM computes them instead of reading what they held.
    unloaded_block_ids: tuple[int, ...] = ()
    #: RETRIEVE: vLLM computes the request in this step (``lmcache.mp.sync_load``):
    #: ``start_load_kv`` waits for it, and its end is reported with the step's output
    #: (``WorkerReport``), never as "finished receiving" (vLLM only expects that of a
    #: request waiting for its load).
    sync: bool = False

    @property
    def wire_id(self) -> str:
        return self.session_id or self.request_id

    @property
    def written_block_ids(self) -> tuple[int, ...]:
        """The blocks a RETRIEVE writes: all but those of its first
        ``skip_first_n_tokens`` (vLLM's own prefix-cache blocks, whole blocks: the
        range starts at a chunk boundary, the skip ends at a block boundary). A failed
        load reports only these: the skipped ones are computed KV that other running
        requests may share, and vLLM would rewind (or, under the ``fail`` policy, fail)
        every request holding a block reported."""
        if not self.skip_first_n_tokens:
            return self.block_ids
        per_block = (self.end - self.start) // max(1, len(self.block_ids))
        return self.block_ids[self.skip_first_n_tokens // max(1, per_block):]


@dataclass
class StepOps:
    ops: list[TransferOp] = field(default_factory=list)
    #: Requests vLLM preempted this step: their blocks may be reused, so their pending
    #: stores must finish before the forward pass writes into them (others may go on).
    preempted: list[str] = field(default_factory=list)
    #: Finished requests whose blocks vLLM keeps until every worker reports them
    #: "finished sending" (``request_finished`` returned True): each worker reports
    #: them once its stores of them are done, and reports no other request so.
    held: list[str] = field(default_factory=list)
    #: Wire id (session) -> the request's token ids so far, big-endian uint32
    #: (``CacheKey.token_bytes``): sent with a request's first order, and again only
    #: when they grew (``save_decode_cache``); the workers keep them.
    tokens: dict[str, bytes] = field(default_factory=dict)
    #: Wire ids the workers may forget the tokens of (their requests are done).
    forget: list[str] = field(default_factory=list)
    #: The step schedules no tokens (vLLM runs no forward pass: every request is
    #: waiting, e.g. for its load): the workers wait for the loads in flight before
    #: reporting, so a warm request is scheduled in the next step instead of a poll or
    #: two later (worker.py ``IDLE_LOAD_WAIT_S``). Never set under data parallelism:
    #: an idle DP rank runs a dummy batch right after the step, whose collectives every
    #: other DP rank's forward pass waits for.
    idle: bool = False

    def retrieves(self) -> list[TransferOp]:
        return [op for op in self.ops if op.direction == "RETRIEVE"]

    def stores(self) -> list[TransferOp]:
        return [op for op in self.ops if op.direction == "STORE"]
