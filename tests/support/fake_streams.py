"""How the fake CUDA driver (fake_cuda.FakeDriver) orders device work: streams, events
and the host, by CUDA's rules, so that code which orders its work wrongly fails a test.

The rules modelled, from NVIDIA's CUDA Runtime API reference
(https://docs.nvidia.com/cuda/cuda-runtime-api/):

* Work queued on one stream runs in issue order; work on two streams has no order
  unless an event makes one (group__CUDART__STREAM: "operations in different streams
  may run concurrently").
* ``cudaEventRecord`` "captures in event the contents of stream at the time of this
  call"; ``cudaStreamWaitEvent`` "makes all future work submitted to stream wait for
  all work captured in event" (group__CUDART__EVENT, group__CUDART__STREAM).
* ``cudaStreamSynchronize`` "blocks until stream has completed all operations";
  ``cudaEventSynchronize`` waits for the work an event captured;
  ``cudaDeviceSynchronize`` for everything. Nothing else makes device work complete
  for the host: an asynchronous copy may still run after the call that queued it
  returned.
* The legacy default stream (handle 0) "synchronizes with all other streams in the
  same CUcontext except for non-blocking streams": an action on it first waits for
  every blocking stream, and every blocking stream then waits for it
  (stream-sync-behavior.html). PyTorch creates its streams with
  ``cudaStreamNonBlocking`` (c10/cuda/CUDAStream.cpp, ``kDefaultFlags``), and so does
  the gather path for its copy stream: no stream here is blocking unless a test puts
  it in :attr:`StreamModel.blocking`.

The model. Every operation records the host address ranges it reads and writes (the
fake's device memory is host memory) and a vector clock: per stream, the last
operation of that stream it is ordered after. A driver copy runs as late as CUDA lets
it: when the host synchronises with it, or when an operation ordered after it must run
(torch operations run at once on CPU tensors, after everything they are ordered
after). So a host that rewrites memory a queued copy has still to read sees the copy
read the new bytes, as a GPU would. An operation that writes memory another stream's
unfinished work reads or writes (or reads memory it writes) without being ordered
after that work is a race: recorded in :attr:`StreamModel.races` and raised at once
(AssertionError), as is a host access (:meth:`StreamModel.host_access`) of memory
that unfinished work touches. The ranges of torch operations are their tensors'
extents (from the first to the last element), coarser than the bytes a kernel really
touches: the model can see a race CUDA would not, never the reverse.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

LEGACY_STREAM = 0

Range = tuple[int, int]  # [start, end) host addresses


@dataclass
class Op:
    name: str
    stream: int
    seq: int
    after: dict[int, int]  # stream -> last seq of it this op is ordered after
    reads: list[Range]
    writes: list[Range]
    run: Callable[[], None] | None  # None once it ran


def _join(into: dict[int, int], other: dict[int, int]) -> None:
    for s, q in other.items():
        if q > into.get(s, 0):
            into[s] = q


def _overlap(a: Sequence[Range], b: Sequence[Range]) -> bool:
    if not a or not b:
        return False
    if (max(hi for _, hi in a) <= min(lo for lo, _ in b)
            or max(hi for _, hi in b) <= min(lo for lo, _ in a)):
        return False  # the spans are apart: the common case, cheap
    return any(lo1 < hi2 and lo2 < hi1 for lo1, hi1 in a for lo2, hi2 in b)


def merged(ranges: Sequence[Range]) -> list[Range]:
    """Adjacent or overlapping ranges as one (fewer pairs to compare)."""
    out: list[Range] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class StreamModel:
    """Streams, events and host waits for one fake driver (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._clock: dict[int, dict[int, int]] = {}
        self._done: dict[int, int] = {}  # stream -> last seq complete for the host
        self.pending: list[Op] = []  # not yet complete for the host, in issue order
        self.races: list[str] = []
        #: Streams created without cudaStreamNonBlocking (they order with stream 0).
        self.blocking: set[int] = set()
        #: Every operation issued: (name, stream), for tests that count launches.
        self.issued: list[tuple[str, int]] = []
        #: Every operation issued, with its stream position and what it is ordered
        #: after (:meth:`ordered_after`), for tests that read the order off the clocks.
        self.history: list[Op] = []

    # ------------------------------------------------------------ clocks
    def _stream_clock(self, stream: int) -> dict[int, int]:
        return self._clock.setdefault(stream, {stream: 0})

    def _issue_clock(self, stream: int) -> dict[int, int]:
        """What the next operation on ``stream`` is ordered after."""
        clock = self._stream_clock(stream)
        if stream == LEGACY_STREAM:
            for b in self.blocking:
                _join(clock, self._stream_clock(b))
        elif stream in self.blocking:
            _join(clock, self._stream_clock(LEGACY_STREAM))
        return clock

    def _ordered_before(self, op: Op, after: dict[int, int]) -> bool:
        return after.get(op.stream, 0) >= op.seq or self._done.get(op.stream, 0) >= op.seq

    def _race(self, what: str, other: Op) -> None:
        msg = (f"race: {what} touches memory that {other.name} (queued on stream "
               f"{other.stream:#x}) has not finished with, and nothing orders them (no "
               f"event wait, no synchronisation)")
        self.races.append(msg)
        raise AssertionError(msg)

    # ------------------------------------------------------------ work
    def enqueue(self, name: str, stream: int, reads: Sequence[Range], writes: Sequence[Range],
                run: Callable[[], None] | None = None,
                now: Callable[[], Any] | None = None) -> Any:
        """Queue an operation on ``stream``: ``run`` later (a driver copy), or ``now``
        (a torch operation: what it is ordered after runs first)."""
        reads, writes = merged(reads), merged(writes)
        with self.lock:
            clock = self._issue_clock(stream)
            after = dict(clock)
            for p in self.pending:
                if p.stream == stream or self._ordered_before(p, after):
                    continue
                if _overlap(writes, p.reads + p.writes) or _overlap(reads, p.writes):
                    self._race(f"{name} on stream {stream:#x}", p)
            seq = clock[stream] + 1
            clock[stream] = seq
            if stream == LEGACY_STREAM:
                for b in self.blocking:
                    _join(self._stream_clock(b), {LEGACY_STREAM: seq})
            op = Op(name, stream, seq, after, reads, writes, run)
            self.issued.append((name, stream))
            self.history.append(op)
            result = None
            if now is not None:
                self._run_through(after)
                result = now()
                op.run = None
            self.pending.append(op)
            return result

    def _run_through(self, after: dict[int, int]) -> None:
        """Run every queued copy ``after`` covers, in issue order (which respects every
        order the streams and events made)."""
        for op in self.pending:
            if op.run is not None and after.get(op.stream, 0) >= op.seq:
                run, op.run = op.run, None
                run()

    def _complete(self, upto: dict[int, int]) -> None:
        self._run_through(upto)
        _join(self._done, upto)
        self.pending = [p for p in self.pending if self._done.get(p.stream, 0) < p.seq]

    # ------------------------------------------------------------ host waits
    def synchronize_stream(self, stream: int) -> None:
        with self.lock:
            self._complete(dict(self._stream_clock(stream)))

    def synchronize_all(self) -> None:
        with self.lock:
            upto: dict[int, int] = {}
            for clock in self._clock.values():
                _join(upto, clock)
            self._complete(upto)

    # ------------------------------------------------------------ events
    def record(self, stream: int) -> dict[int, int]:
        """What an event recorded on ``stream`` now captures."""
        with self.lock:
            return dict(self._issue_clock(stream))

    def wait(self, stream: int, captured: dict[int, int]) -> None:
        with self.lock:
            _join(self._issue_clock(stream), captured)

    def synchronize_captured(self, captured: dict[int, int]) -> None:
        with self.lock:
            self._complete(dict(captured))

    # ------------------------------------------------------------ checks
    @staticmethod
    def ordered_after(later: Op, earlier: Op) -> bool:
        """Whether ``later`` cannot start before ``earlier`` completed (same stream,
        issued after it, or after it through events / the legacy stream)."""
        if later.stream == earlier.stream:
            return later.seq > earlier.seq
        return later.after.get(earlier.stream, 0) >= earlier.seq

    def check_reuse(self, what: str, ranges: Sequence[Range], stream: int) -> None:
        """Memory given back to torch's caching allocator, which hands it out again
        at once for work on ``stream`` (the stream it was allocated on; no event): any
        unfinished work of another stream on it, not ordered before what ``stream``
        holds now, is a race (c10's use-after-free that record_stream prevents)."""
        ranges = merged(ranges)
        with self.lock:
            clock = self._issue_clock(stream)
            for p in self.pending:
                if p.stream != stream and not self._ordered_before(p, clock) \
                        and _overlap(ranges, p.reads + p.writes):
                    self._race(what, p)

    def host_access(self, what: str, ranges: Sequence[Range], write: bool) -> None:
        """The host reads (or writes) ``ranges`` now: any unfinished device work that
        writes them (or reads them, for a write) is a race."""
        ranges = merged(ranges)
        with self.lock:
            for p in self.pending:
                if _overlap(ranges, p.writes) or (write and _overlap(ranges, p.reads)):
                    self._race(f"the host's {what}", p)

    def unfinished(self) -> list[Op]:
        with self.lock:
            return list(self.pending)

    def queued(self) -> list[tuple[int, Callable[[], None]]]:
        """Driver copies queued and not run yet: (stream, run)."""
        with self.lock:
            return [(p.stream, p.run) for p in self.pending if p.run is not None]


# ------------------------------------------------------------------ torch ops
def tensor_range(t: Any) -> Range | None:
    """The host addresses a CPU tensor's elements span (first to last)."""
    if t.numel() == 0:
        return None
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)
    start = t.data_ptr()
    return start, start + (extent + 1) * t.element_size()


@contextmanager
def torch_on_stream(model: StreamModel, stream: int) -> Iterator[None]:
    """Torch operations of this thread, inside the block, are queued on ``stream``: each
    one's tensors checked against other streams' unfinished work, then run at once."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OnStream(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func.is_view:  # no memory is touched
                return func(*args, **kwargs)
            reads: list[Range] = []
            writes: list[Range] = []
            schema = func._schema
            named = dict(zip((a.name for a in schema.arguments), args, strict=False))
            named.update(kwargs)
            for a in schema.arguments:
                value = named.get(a.name)
                values = value if isinstance(value, (list, tuple)) else [value]
                for v in values:
                    if isinstance(v, torch.Tensor):
                        r = tensor_range(v)
                        if r is not None:
                            alias = a.alias_info
                            (writes if alias is not None and alias.is_write else reads).append(r)
            return model.enqueue(f"torch {func}", stream, reads, writes,
                                 now=lambda: func(*args, **kwargs))

    with OnStream():
        yield
