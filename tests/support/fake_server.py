"""A scripted, in-process stand-in for an LMCache MP server (0.5.3 wire), for offline
tests of the whole client stack, as httpcore tests its client against a mock backend.

It keeps what a real server keeps for the client's purposes (registrations, lookup
jobs, sessions, an SHM pool for engine-driven slots), answers like 0.5.3 does (no reply
to what a real server would drop: transfers for unknown instances, ops without a
handler), records every request it decoded, and can restart (a new socket on the same
port, everything forgotten) or go silent. It never copies KV data: byte-exactness is
what the live tests prove.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from lmcache_mp.ipc.shm import ShmSegment
from lmcache_mp.protocol import get_profile
from lmcache_mp.protocol.hashing import chunk_hashes

from ..conftest import free_port
from .polling import wait_until

_enc = msgspec.msgpack.encode


def _ext_hook(code: int, data: memoryview) -> Any:
    return ("wrapper", bytes(data))  # never unpickled: recorded as bytes


_dec = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def server_read_locks(family: str, key: dict[str, Any], tp_size: int) -> int | None:
    """Read locks a server of ``family`` takes per looked-up object (None: it drops the
    request). Written from LMCache's source, not from lmcache_mp: 0.5.3/0.5.4
    ``modules/lookup.py:compute_extra_count`` (MLA is recognised by tp > world size);
    0.5.5+ ``IPCCacheServerKey.require_num_kv_readers`` (the key's count, at least 1)."""
    if family == "0.5.3":
        world = key["world_size"]
        tp = tp_size if tp_size > 1 else world
        return 1 + (tp - 1 if tp > world else 0)
    readers = key.get("num_kv_readers", 0)
    return readers if readers >= 1 else None


@dataclass
class Seen:
    """One decoded request: its op name and payloads (plain msgpack values)."""

    op: str
    payloads: list[Any]


@dataclass
class FakeState:
    chunk_size: int = 256
    registered: dict[int, str] = field(default_factory=dict)  # instance -> "lmcache"/"engine"
    stored: set[tuple[str, bytes]] = field(default_factory=set)  # (salt, chunk hash)
    jobs: dict[str, int] = field(default_factory=dict)
    locks: dict[tuple[str, bytes], int] = field(default_factory=dict)
    sessions: set[str] = field(default_factory=set)


class FakeServer:
    """Serve ``profile`` ops on a ROUTER at ``url`` until :meth:`close`."""

    def __init__(self, *, profile: str = "0.5.3", engine_driven: bool = True,
                 pool_bytes: int = 1 << 20, port: int | None = None) -> None:
        self.profile = get_profile(profile)
        self.by_id = {op.id: op for op in self.profile.operations.values()}
        self.token_field = ("token_bytes" if "token_bytes" in self.profile.key_type.__struct_fields__
                            else "token_ids")
        self.port = port or free_port()
        self.engine_driven = engine_driven
        self.state = FakeState()
        self.seen: list[Seen] = []
        self.silent = threading.Event()  # set: decode and record, never reply
        self.drop: set[str] = set()  # ops never answered
        self.hooks: dict[str, Callable[[list[Any]], Any]] = {}  # op -> reply value
        self.pending_store: tuple[int, list[tuple[str, bytes]]] = (0, [])
        # op -> the type id its reply carries (a server of another protocol would echo
        # another request type); unset: the request's own.
        self.reply_type: dict[str, int] = {}
        self.pool = ShmSegment.create(pool_bytes, tag="fakepool") if engine_driven else None
        self._lock = threading.Lock()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._bind()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def ops(self) -> list[str]:
        with self._lock:
            return [s.op for s in self.seen]

    def requests(self, op: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.op == op]

    def wait_seen(self, op: str, count: int = 1, timeout: float = 5.0) -> list[str]:
        """The ops received, once ``op`` is among them ``count`` times: a request the
        client sent without waiting for its reply (a COMMIT_RETRIEVE) may still be on
        its way when the call returns."""
        if not wait_until(lambda: self.ops().count(op) >= count, timeout, interval=0.002):
            raise AssertionError(f"{op} not received {count} times within {timeout} s: "
                                 f"{self.ops()}")
        return self.ops()

    def _bind(self) -> zmq.Socket[bytes]:
        # A socket just closed releases its port asynchronously (in ZMQ's I/O
        # thread), so a restart retries the bind for a moment.
        deadline = time.monotonic() + 5.0
        while True:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(f"tcp://127.0.0.1:{self.port}")
                return sock
            except zmq.ZMQError:
                sock.close(0)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def restart(self) -> None:
        """Drop every connection and forget everything, as a restarted server would."""
        with self._lock:
            self._sock.close(0)
            self.state = FakeState(chunk_size=self.state.chunk_size)
            self._sock = self._bind()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()
        if self.pool is not None:
            self.pool.close()

    # ------------------------------------------------------------- serving
    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                sock = self._sock
                if not sock.poll(5):
                    continue
                msg = sock.recv_multipart()
                reply = self._handle(msg[1:])
                if reply is not None and not self.silent.is_set():
                    sock.send_multipart([msg[0], *reply])

    def _handle(self, body: list[bytes]) -> list[bytes] | None:
        uid, type_frame, frames = body[0], body[1], body[2:]
        op = self.by_id.get(msgspec.msgpack.decode(type_frame))
        if op is None:
            return None  # no handler: logged and dropped by a real server
        payloads = [_dec.decode(f) for f in frames]
        if len(payloads) != len(op.payloads) or any(
                isinstance(p, dict) and "request_id" in p and "start" in p
                and self.token_field not in p
                for p in payloads):
            # A real server drops a request with the wrong payload count, or a key
            # without its release's token field (0.5.7: token_bytes; before: token_ids).
            return None
        self.seen.append(Seen(op.name, payloads))
        if op.name in self.drop:
            return None
        if op.name in self.hooks:
            value = self.hooks[op.name](payloads)
        else:
            handler = getattr(self, f"_op_{op.name.lower()}", None)
            if handler is None:
                return None
            value = handler(*payloads)
        if value is _NO_REPLY:
            return None
        if op.name in self.reply_type:
            type_frame = _enc(self.reply_type[op.name])
        if value is None:
            return [uid, type_frame]
        return [uid, type_frame, _enc(value)]

    # ------------------------------------------------------------------ ops
    def _op_noop(self) -> str:
        return "OK"

    def _op_ping(self, instance_id: int | None) -> bool:
        return True

    def _op_get_chunk_size(self) -> int:
        return self.state.chunk_size

    def _op_get_experimental(self) -> list[str]:
        return []

    def _op_register_kv_cache(self, instance_id: int, *rest: Any) -> None:
        self.state.registered.setdefault(instance_id, "lmcache")

    def _op_unregister_kv_cache(self, instance_id: int) -> None:
        self.state.registered.pop(instance_id, None)

    def _op_register_kv_cache_engine_driven_context(self, payload: dict[str, Any]) -> Any:
        if not self.engine_driven:
            return _NO_REPLY
        self.state.registered.setdefault(payload["instance_id"], "engine")
        assert self.pool is not None
        return {"shm_name": self.pool.name, "pool_size": self.pool.nbytes}

    def _op_unregister_kv_cache_engine_driven_context(self, instance_id: int) -> None:
        self.state.registered.pop(instance_id, None)

    def _hashes(self, key: dict[str, Any], whole: bool = False) -> list[tuple[str, bytes]]:
        """The object keys of the key's range (``whole``: of all its tokens): the salt
        is part of an object's identity, as in LMCache's ObjectKey."""
        hashes = chunk_hashes(key[self.token_field], self.state.chunk_size,
                              start=0 if whole else key["start"],
                              end=None if whole else key["end"])
        return [(key["cache_salt"], h) for h in hashes]

    def _op_store(self, key: dict[str, Any], instance_id: int, *rest: Any) -> Any:
        if instance_id not in self.state.registered:
            return _NO_REPLY  # "Error in blocking handler": no reply
        self.state.stored.update(self._hashes(key))
        self.state.sessions.add(key["request_id"])
        return [b"stub_ipc_handle", True]

    def _op_retrieve(self, key: dict[str, Any], instance_id: int, *rest: Any) -> Any:
        if instance_id not in self.state.registered:
            return _NO_REPLY
        hashes = self._hashes(key)
        ok = all(self.state.locks.get(h, 0) > 0 for h in hashes)
        for h in hashes:
            if self.state.locks.get(h):
                self.state.locks[h] -= 1
        return [b"stub_ipc_handle", ok]

    def _op_lookup(self, key: dict[str, Any], tp_size: int) -> Any:
        readers = server_read_locks(self.profile.name, key, tp_size)
        if readers is None:
            return _NO_REPLY  # 0.5.5+: a key without num_kv_readers is dropped
        hits = 0
        for h in self._hashes(key, whole=True):
            if h not in self.state.stored:
                break
            self.state.locks[h] = self.state.locks.get(h, 0) + readers
            hits += 1
        self.state.jobs[key["request_id"]] = hits
        self.state.sessions.add(key["request_id"])
        return None

    def _op_wait_prefetch_status(self, request_id: str, timeout: float) -> int | None:
        return self.state.jobs.pop(request_id, 0)

    def _op_query_prefetch_status(self, request_id: str) -> int | None:
        return self.state.jobs.pop(request_id, 0)

    def _op_query_prefetch_lookup_hits(self, request_id: str) -> int:
        return self.state.jobs.get(request_id, 0)  # 0.5.3-0.5.5; does not consume

    def _op_free_lookup_locks(self, key: dict[str, Any], tp_size: int, *extra: Any) -> Any:
        readers = server_read_locks(self.profile.name, key, tp_size)
        if readers is None:
            return _NO_REPLY
        for h in self._hashes(key):
            if self.state.locks.get(h):
                self.state.locks[h] = max(0, self.state.locks[h] - readers)
        return None

    def _op_end_session(self, request_id: str) -> None:
        self.state.sessions.discard(request_id)

    def _op_clear(self, *force: Any) -> None:
        self.state.stored.clear()

    def _slot(self, index: int, g: dict[str, Any]) -> dict[str, Any]:
        shape = g["shape"]
        length = g["length"]
        return {"offset": index * length, "length": length, "shape": shape, "dtype": g["dtype"]}

    def _op_prepare_store(self, key: dict[str, Any], instance_id: int, *skipped: Any) -> Any:
        if instance_id not in self.state.registered:
            return _NO_REPLY
        hashes = self._hashes(key)
        todo = [i for i, h in enumerate(hashes) if h not in self.state.stored]
        self.state.sessions.add(key["request_id"])
        self.pending_store = (instance_id, [hashes[i] for i in todo])
        return {"context": {"slots": [self.slot_for(i) for i in range(len(todo))],
                            "chunk_indices": todo}}

    def _op_commit_store(self, key: dict[str, Any], instance_id: int, data: bytes) -> Any:
        if instance_id not in self.state.registered:
            return _NO_REPLY
        self.state.stored.update(self.pending_store[1])
        return True

    def _op_prepare_retrieve(self, key: dict[str, Any], instance_id: int) -> Any:
        if instance_id not in self.state.registered:
            return _NO_REPLY
        hashes = self._hashes(key)
        if not all(h in self.state.stored for h in hashes):
            return {"success": False, "data": b"", "context": {}}
        return {"success": True, "data": b"",
                "context": {"slots": [self.slot_for(i) for i in range(len(hashes))]}}

    def _op_commit_retrieve(self, key: dict[str, Any], instance_id: int) -> Any:
        if instance_id not in self.state.registered:
            return _NO_REPLY
        for h in self._hashes(key):  # one reader's locks
            if self.state.locks.get(h):
                self.state.locks[h] -= 1
        return True

    #: The chunk-object geometry the engine-driven slots describe; tests set it to
    #: match their cache: {"shape": [...], "dtype": ..., "length": bytes}.
    slot_geometry: dict[str, Any] = {}

    def slot_for(self, index: int) -> dict[str, Any]:
        return self._slot(index, self.slot_geometry)

    def pool_bytes(self) -> np.ndarray:
        """The pool as bytes (what the client copied into its slots)."""
        assert self.pool is not None
        return np.frombuffer(self.pool.buffer, dtype=np.uint8)


_NO_REPLY = object()


def slot_geometry(kv: Any, chunk_size: int = 256) -> dict[str, Any]:
    """What the fake server's pool slots hold for ``kv`` (a CpuKVCache): one chunk object."""
    g = kv.geometry
    shape = [2, g.num_layers, chunk_size, g.hidden_dim]
    return {"shape": shape, "dtype": g.dtype, "length": int(np.prod(shape)) * g.itemsize}
