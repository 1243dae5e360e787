"""One connection to one server: the transport, the protocol profile it speaks, and the
encode -> submit -> decode step every call shares.

The profile is found by a probe (``protocol="auto"``) on first use and found again
after the socket reconnects, since a new connection may reach a restarted server of
another release. The chunk size is likewise asked once per connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from ..checks import positive_seconds, server_url
from ..errors import (
    InvalidArgument,
    ProtocolMismatch,
    RequestTimeout,
    ServerUnavailable,
    ServerUnresponsive,
)
from ..keys import CacheKey
from ..protocol import Profile, decode_reply, encode_request, get_profile
from ..protocol.detect import Detection, detect, unregister_unknown
from ..protocol.operations import Operation
from ..transport import PendingRequest, ReplyFuture, Transport

__all__ = ["Connection", "DEFAULT_TIMEOUT", "Payloads", "NO_PAYLOADS"]

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0

#: A request's payloads by name (the profile's operation gives the wire order; see
#: :func:`lmcache_mp.protocol.encode_request`).
Payloads = dict[str, Any]

#: The payloads of an operation that takes none (shared: never modified).
NO_PAYLOADS: Payloads = {}


class Connection:
    """The transport plus the profile; thread-safe. Not public: :class:`Client` and
    :class:`Registration` are built on it."""

    def __init__(self, url: str, timeout: float, protocol: str,
                 allow_remote: bool = False) -> None:
        if not isinstance(allow_remote, bool):
            raise InvalidArgument(f"allow_remote must be a bool, got {allow_remote!r}")
        self.url = server_url(url, allow_remote)
        self.timeout = positive_seconds("timeout", timeout)
        if not isinstance(protocol, str):
            raise InvalidArgument(f"protocol must be 'auto' or a release like '0.5.3', "
                                  f"got {protocol!r}")
        self.fixed_protocol = protocol != "auto"
        # An unknown release name is a ProtocolMismatch (a release this client does not
        # speak), raised here before anything is sent.
        self._profile: Profile | None = get_profile(protocol) if self.fixed_protocol else None
        #: The connections (transport epochs) the probed profile holds for.
        self._profile_epochs: tuple[int, ...] = ()
        self.detection: Detection | None = None
        self._detect_lock = threading.Lock()
        self._chunk: tuple[int, int] | None = None  # (epoch, chunk size)
        self.transport = Transport(self.url)
        if self._profile is not None:
            self.transport.set_probe_frames([self._profile.op("NOOP").type_frame])

    # ---------------------------------------------------------------- profile
    @property
    def profile(self) -> Profile:
        """The server's profile, probing it when not yet known on this connection."""
        return self.profile_for(None)

    def profile_for(self, seconds: float | None) -> Profile:
        """:attr:`profile`, probing within ``seconds`` (a call's time left) if needed."""
        p = self._profile
        if p is not None and (self.fixed_protocol or self.transport.epoch in self._profile_epochs):
            return p
        return self._detect(seconds)

    def _detect(self, seconds: float | None) -> Profile:
        # Another thread's probe must not make this call overstay its deadline: the
        # time spent waiting for it comes out of this call's own probe.
        started = time.monotonic()
        if not self._detect_lock.acquire(timeout=-1 if seconds is None else seconds):
            raise self._still_identifying(seconds)
        try:
            if seconds is None:
                return self._detect_locked(None)
            left = seconds - (time.monotonic() - started)
            if left <= 0 and self._current() is None:
                raise self._still_identifying(seconds)
            return self._detect_locked(left)
        finally:
            self._detect_lock.release()

    def adopt(self, family: str, source: str) -> bool:
        """Take the family another process found on this server (``source`` says who)
        as this connection's, instead of probing: on the current connection, or on the
        first one if none was made yet. A later reconnect probes again (it may reach a
        restarted server). Returns whether it was taken (not with a named protocol,
        one already identified, or between two connections)."""
        profile = get_profile(family)  # an unknown family: ProtocolMismatch, as named
        with self._detect_lock:
            if self.fixed_protocol or self._current() is not None:
                return False
            epoch = self.transport.refresh()
            if not self.transport.connected and epoch > 0:
                return False  # the next connection may reach another server process
            self._profile = profile
            # Before the first connection: for it (epoch 1 once its event is seen).
            self._profile_epochs = (epoch,) if self.transport.connected else (0, 1)
            self.detection = Detection(profile.name, "/".join(profile.releases),
                                       (f"told by {source}",))
            self.transport.set_probe_frames([profile.op("NOOP").type_frame])
            return True

    @property
    def identified(self) -> bool:
        """Whether the server's protocol is known on the current connection (a call
        made now would not wait for a protocol probe first)."""
        return self._current() is not None

    def _current(self) -> Profile | None:
        """The profile, if it was identified on the current connection."""
        p = self._profile
        if p is not None and (self.fixed_protocol or self.transport.epoch in self._profile_epochs):
            return p
        return None

    def _still_identifying(self, seconds: float | None) -> ServerUnavailable:
        # Nothing was sent: the (new) connection is still being identified.
        return ServerUnavailable(
            f"not sent: the protocol probe of the LMCache server at {self.url} (run by "
            f"another thread after a new connection) did not finish within {seconds:g} s")

    def _detect_locked(self, seconds: float | None) -> Profile:
        current = self._current()
        if current is not None:
            return current
        pending: dict[str, PendingRequest] = {}
        try:
            budget = min(self.timeout, 2.0, self.timeout if seconds is None else seconds)
            detection = detect(partial(self._probe_exchange, pending,
                                       time.monotonic() + budget), self.url, timeout=budget)
        except RequestTimeout as exc:
            fence = pending.get("fence")
            if fence is None or not fence.sent or any(
                    p.frames is not None for p in pending.values()):
                raise  # something answered: not a silent server
            # Nothing answered, not even the fence (answered on the server's
            # message thread): the same verdict as an unanswered NOOP probe's.
            self.transport.declare_unresponsive(unregister_unknown())
            raise ServerUnresponsive(str(exc)) from None
        finally:
            for p in pending.values():  # unanswered probes: drop late replies
                self.transport.cancel(p)
        self.detection = detection
        profile = self._profile = get_profile(detection.profile)
        self.transport.set_probe_frames([profile.op("NOOP").type_frame])
        self._profile_epochs = (max(p.sent_epoch for p in pending.values()),)
        return profile

    def _probe_exchange(
        self,
        pending: dict[str, PendingRequest],
        deadline: float,
        batch: Sequence[tuple[str, list[bytes]]],
        until: str,
        timeout: float,
    ) -> dict[str, list[bytes] | None]:
        """Send probe frames in order; wait for ``until``; collect whatever else is in.
        Every exchange of one detection waits within its one ``deadline``."""
        transport = self.transport
        timeout = max(min(timeout, deadline - time.monotonic()), 0.001)
        for name, frames in batch:
            pending[name] = transport.submit(frames, timeout, f"the protocol probe ({name})")
        target = pending.get(until)
        if target is not None:
            transport.wait_for(target, timeout)
            if isinstance(target.error, ServerUnavailable):
                raise target.error  # never reached the server: say so, not "no answer"
            if not target.done and not target.sent:
                transport.cancel(target)
                raise ServerUnavailable(transport.unreachable_reason(
                    f"the protocol probe ({until})", timeout))
        out: dict[str, list[bytes] | None] = {}
        for name, p in list(pending.items()):
            transport.poll(p)
            out[name] = p.frames if p.done and p.error is None else None
        return out

    # ----------------------------------------------------------------- calls
    def seconds(self, timeout: float | None) -> float:
        """A call's deadline in seconds: its own ``timeout`` or the default."""
        return self.timeout if timeout is None else positive_seconds("timeout", timeout)

    def submit(
        self, op_name: str, payloads: Payloads, seconds: float, epoch: int | None = None
    ) -> tuple[Operation, PendingRequest]:
        """Encode (validating every payload first) and send; nothing is sent on error.
        ``payloads`` by name: the server's profile puts them in its wire order. A protocol
        probe needed first (a new connection) comes out of ``seconds``."""
        profile = self._profile
        if profile is None or not (self.fixed_protocol
                                   or self.transport.epoch in self._profile_epochs):
            started = time.monotonic()
            profile = self._detect(seconds)
            seconds = max(seconds - (time.monotonic() - started), 0.001)
        op = profile.op(op_name)
        frames = encode_request(op, payloads)
        return op, self.transport.submit(frames, seconds, op_name, epoch)

    def request(
        self,
        op_name: str,
        payloads: Payloads,
        timeout: float | None,
        convert: Callable[[Any], Any] | None = None,
    ) -> ReplyFuture[Any]:
        """The non-blocking form: a future that decodes the reply (then applies
        ``convert``) when asked."""
        op, pending = self.submit(op_name, payloads, self.seconds(timeout))
        decode: Callable[[list[bytes]], Any] = partial(decode_reply, op)
        if convert is not None:
            decode = partial(_then, decode, convert)
        return ReplyFuture(self.transport, pending, decode)

    def call(self, op_name: str, payloads: Payloads, timeout: float | None) -> Any:
        """The blocking form, without a future on the hot path."""
        op, pending = self.submit(op_name, payloads, self.seconds(timeout))
        return decode_reply(op, self.transport.wait(pending))

    def lookup_async(
        self,
        key: CacheKey,
        tp_size: int,
        timeout: float | None,
        convert: Callable[[int], int] | None = None,
        mla: bool = False,
    ) -> ReplyFuture[int]:
        """LOOKUP (all ranks) then WAIT_PREFETCH_STATUS within one deadline: the number
        of leading chunks cached for every rank (then ``convert``-ed). ``result()`` sends
        the wait once the LOOKUP is acknowledged (the server may run a query sent
        earlier before the lookup itself)."""
        if not isinstance(key, CacheKey):
            raise InvalidArgument(f"expected a lmcache_mp.CacheKey, got {type(key).__name__}")
        budget = self.seconds(timeout)
        deadline = time.monotonic() + budget
        payloads = self.profile_for(budget).all_ranks_payloads(key, tp_size, mla)
        op, pending = self.submit("LOOKUP", payloads, max(deadline - time.monotonic(), 0.001))

        def finish(frames: list[bytes]) -> int:
            decode_reply(op, frames)
            remaining = max(deadline - time.monotonic(), 0.001)
            # Let the server wait for most of the remaining budget and keep a margin
            # for the reply itself; the call as a whole stays within the budget.
            hits = self.call("WAIT_PREFETCH_STATUS",
                             {"request_id": key.request_id, "timeout": remaining * 0.8},
                             remaining)
            if hits is None:
                raise RequestTimeout(
                    f"the lookup for request {key.request_id!r} did not finish within "
                    f"{budget:g} s (a slow L2 backend?); its hit chunks stay locked: collect "
                    f"the result later with query_prefetch_status() or release them with "
                    f"free_lookup_locks()")
            return int(hits) if convert is None else convert(int(hits))

        return ReplyFuture(self.transport, pending, finish)

    def chunk_size(self, timeout: float | None = None) -> int:
        """The server's chunk size in tokens (asked once per connection)."""
        cached = self._chunk
        epoch = self.transport.epoch
        if cached is not None and cached[0] == epoch:
            return cached[1]
        op, pending = self.submit("GET_CHUNK_SIZE", NO_PAYLOADS, self.seconds(timeout))
        value = decode_reply(op, self.transport.wait(pending))
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ProtocolMismatch(
                f"the server at {self.url} reported chunk size {value!r} (GET_CHUNK_SIZE), "
                f"which no LMCache server uses: check that it is an LMCache MP server and "
                f"that protocol= matches its release")
        self._chunk = (pending.sent_epoch, value)
        return value

    def close(self) -> None:
        self.transport.close()


def _then(decode: Callable[[list[bytes]], Any], convert: Callable[[Any], T],
          frames: list[bytes]) -> T:
    return convert(decode(frames))
