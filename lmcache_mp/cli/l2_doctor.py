"""``lmcache-mp doctor``'s checks of KV shared across nodes (LMCache's second tier).

Nodes share KV only through their servers' L2 adapters, and what goes wrong there is
silent to an engine: a down tier, or nodes that disagree on the chunk size, hash
algorithm, key format or KV layout, all look like a 0 % hit rate. The MP protocol has
no status request, so the doctor uses what it can see:

* **Two servers' answers** (:func:`compare_nodes`, ``--peer URL``): their chunk sizes
  and wire families, then a probe: one chunk of random tokens stored through this node
  (a tiny CPU cache registered here, like the SHM round trip) and looked up through the
  peer until it shows there (its delay reported) or ``--l2-wait`` passes. A miss with
  equal chunk sizes means the tier is not shared, down, or the servers hash
  differently (``--hash-algorithm``) or key differently (another release's format).
  The probe's model name is the doctor's own: engines that disagree on the model
  name (or the KV layout) cannot be seen from here (docs/multinode.md).
* **The servers' status replies** (:func:`status_checks`, ``--status URL``, repeatable):
  where a server runs with LMCache's HTTP front (``python -m
  lmcache.v1.multiprocess.http_server``), its ``GET /status``: health, chunk size, hash
  algorithm and L2 adapters, compared across the nodes given (a hash algorithm that
  differs is seen only here). An adapter's ``is_healthy`` says its threads run, not
  that its backend answers: 0.5.7rc2's ``resp`` reports healthy with no Valkey at all.
* **The server's log** (:func:`scan_server_log`, ``--server-log FILE``): the lines
  LMCache 0.5.6 / 0.5.7rc2 write when an L2 write fails (``Store task N to adapter I
  failed``), when the valkey adapter's commands fail or time out, and when an L2
  object has another size than the reader's layout (``Incomplete read``: the nodes'
  KV shapes differ). An adapter whose failures go on to the log's end is reported
  down: LMCache's ``resp`` adapter never reconnects after its Valkey restarts, and
  says so only there.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ..errors import LMCacheMPError

__all__ = ["AdapterLog", "LogReport", "scan_server_log", "log_checks", "compare_nodes",
           "status_checks"]

Check = tuple[str, str, bool]

#: How much of a log's end is read (a long-running server's log grows without bound).
TAIL_BYTES = 8 << 20
#: Failures this close to the log's last line count as still failing.
RECENT_S = 60.0

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")
_STORE_FAILED = re.compile(r"Store task \d+ to adapter (\d+) failed")
_VALKEY_FAILED = re.compile(r"Valkey (\w+) failed")
_SIZE_MISMATCH = re.compile(r"Incomplete read for \S+: expected (\d+), got (\d+)")


@dataclass
class AdapterLog:
    """What one L2 adapter's lines say (index as in ``--l2-adapter`` order)."""

    store_failures: int = 0
    first_failure: datetime | None = None
    last_failure: datetime | None = None


@dataclass
class LogReport:
    path: str
    adapters: dict[str, AdapterLog] = field(default_factory=dict)
    #: The valkey adapter's failed commands by name (SET, EXISTS, GET...).
    valkey_failures: dict[str, int] = field(default_factory=dict)
    #: (expected, got) byte sizes of L2 objects another layout wrote.
    size_mismatches: dict[tuple[int, int], int] = field(default_factory=dict)
    last_line: datetime | None = None

    def down(self) -> list[str]:
        """The adapters failing up to the log's last line (within :data:`RECENT_S`)."""
        if self.last_line is None:
            return []
        return [name for name, a in self.adapters.items()
                if a.last_failure is not None
                and (self.last_line - a.last_failure).total_seconds() <= RECENT_S]


def _stamp(line: str) -> datetime | None:
    m = _STAMP.search(line)
    if m is None:
        return None
    return datetime.strptime(f"{m.group(1)}.{m.group(2)}", "%Y-%m-%d %H:%M:%S.%f")


def scan_server_log(path: Path, tail_bytes: int = TAIL_BYTES) -> LogReport:
    """The L2 lines of an LMCache MP server's log (its last ``tail_bytes``)."""
    report = LogReport(str(path))
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - tail_bytes))
        text = f.read().decode(errors="replace")
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        when = _stamp(line)
        if when is not None:
            report.last_line = when
        if (m := _STORE_FAILED.search(line)) is not None:
            a = report.adapters.setdefault(f"adapter {m.group(1)}", AdapterLog())
            a.store_failures += 1
            if when is not None:
                a.first_failure = a.first_failure or when
                a.last_failure = when
        elif (m := _VALKEY_FAILED.search(line)) is not None:
            report.valkey_failures[m.group(1)] = report.valkey_failures.get(m.group(1), 0) + 1
        elif (m := _SIZE_MISMATCH.search(line)) is not None:
            sizes = (int(m.group(1)), int(m.group(2)))
            report.size_mismatches[sizes] = report.size_mismatches.get(sizes, 0) + 1
    return report


def log_checks(paths: Sequence[str]) -> list[Check]:
    """One row per log and per finding."""
    rows: list[Check] = []
    for p in paths:
        try:
            report = scan_server_log(Path(p))
        except OSError as exc:
            rows.append((f"server log {p}", f"cannot read it: {exc}", False))
            continue
        down = set(report.down())
        if not report.adapters and not report.valkey_failures and not report.size_mismatches:
            rows.append((f"server log {p}", "no L2 failure logged", True))
        for name, a in sorted(report.adapters.items()):
            when = f"{a.first_failure} .. {a.last_failure}" if a.first_failure else "no time"
            if name in down:
                rows.append((f"L2 {name}", f"DOWN: {a.store_failures} L2 writes failed "
                             f"({when}), the last within {RECENT_S:.0f} s of the log's end "
                             f"({report.last_line}); LMCache's resp adapter does not "
                             f"reconnect after its Valkey restarts: restart this server",
                             False))
            else:
                rows.append((f"L2 {name}", f"{a.store_failures} L2 writes failed ({when}), "
                             f"none in the last {RECENT_S:.0f} s of the log", True))
        if report.valkey_failures:
            what = ", ".join(f"{k} x{v}" for k, v in sorted(report.valkey_failures.items()))
            rows.append(("L2 valkey commands", f"failed: {what} (each lookup waits the "
                         f"adapter's request_timeout while Valkey does not answer)", False))
        for (want, got), n in sorted(report.size_mismatches.items()):
            rows.append(("L2 object sizes", f"{n} reads found objects of {got} bytes where "
                         f"this server's layout needs {want}: nodes with other KV shapes "
                         f"or dtypes write under the same keys (a miss, never read)", False))
    return rows


def status_checks(urls: Sequence[str], timeout: float) -> list[Check]:
    """Each HTTP front's ``GET /status``, then what differs between them."""
    rows: list[Check] = []
    seen: dict[str, dict[str, object]] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/status", timeout=timeout) as r:
                status = json.loads(r.read())
        except (OSError, ValueError) as exc:
            rows.append((f"status {url}", f"no status reply: {exc}", False))
            continue
        storage = status.get("storage_manager") or {}
        adapters = storage.get("l2_adapters") or []
        kinds = ", ".join(f"{a.get('type')}{'' if a.get('is_healthy') else ' (UNHEALTHY)'}"
                          for a in adapters) or "none"
        facts = {"chunk size": status.get("chunk_size"),
                 "hash algorithm": status.get("hash_algorithm"),
                 "L2 adapters": sorted(str(a.get("type")) for a in adapters)}
        seen[url] = facts
        healthy = bool(status.get("is_healthy")) and all(a.get("is_healthy") for a in adapters)
        rows.append((f"status {url}", f"{'healthy' if healthy else 'NOT healthy'}; chunk size "
                     f"{facts['chunk size']}, hash {facts['hash algorithm']}, L2 adapters: "
                     f"{kinds} (healthy means its threads run, not that its backend "
                     f"answers)", healthy))
    if len(seen) > 1:
        for what in ("chunk size", "hash algorithm", "L2 adapters"):
            values = {url: facts[what] for url, facts in seen.items()}
            if len({json.dumps(v) for v in values.values()}) > 1:
                rows.append((f"nodes' {what}", "DIFFERS: " + "; ".join(
                    f"{u}: {v}" for u, v in values.items()), False))
            else:
                rows.append((f"nodes' {what}", f"{next(iter(values.values()))} on every node",
                             True))
    return rows


def compare_nodes(url: str, peer: str, timeout: float, wait: float = 10.0, *,
                  allow_remote: bool = False) -> list[Check]:
    """Chunk sizes and families of both servers, then the L2 probe (this node -> peer)."""
    from ..client import Client

    rows: list[Check] = []
    try:
        with Client(url, timeout=timeout) as here, \
                Client(peer, timeout=timeout, allow_remote=allow_remote) as there:
            sizes = (here.chunk_size(), there.chunk_size())
            families = (here.server_protocol, there.server_protocol)
            rows.append(("peer", f"{peer} answers (protocol {families[1]}; here "
                                 f"{families[0]})", True))
            if sizes[0] != sizes[1]:
                rows.append(("chunk size", f"DIFFERS: {sizes[0]} here, {sizes[1]} on the "
                             f"peer: no chunk can be shared (--chunk-size)", False))
                return rows
            rows.append(("chunk size", f"{sizes[0]} on both", True))
            rows.append(_probe(here, there, sizes[0], wait, timeout))
    except LMCacheMPError as exc:
        rows.append(("peer", f"{peer}: {type(exc).__name__}: {exc}", False))
    return rows


def _probe(here: object, there: object, chunk: int, wait: float, timeout: float) -> Check:
    import numpy as np

    from ..client import Client
    from ..ipc.cpu_cache import CpuKVCache

    assert isinstance(here, Client) and isinstance(there, Client)
    model = "lmcache-mp-doctor-l2"
    tokens = np.random.default_rng().integers(1, 2**31, chunk, dtype=np.uint32)
    kv = CpuKVCache.allocate(num_layers=1, num_blocks=2, block_size=chunk, num_heads=1,
                             head_dim=8, dtype="float16")
    # The peer loads an L2 object into its L1 only for a layout registered with it: the
    # probe registers there too (so both servers must share this host's /dev/shm).
    peer_kv = CpuKVCache.allocate(num_layers=1, num_blocks=2, block_size=chunk, num_heads=1,
                                  head_dim=8, dtype="float16")
    try:
        try:
            peer_reg = there.register(peer_kv, model_name=model, mode="auto", timeout=timeout)
        except LMCacheMPError as exc:
            return ("L2 probe", f"not run: the peer cannot register a cache of this host "
                    f"({type(exc).__name__}: {exc}); run the doctor where both servers "
                    f"share /dev/shm", False)
        with here.register(kv, model_name=model, mode="auto", timeout=timeout) as reg, \
                peer_reg:
            with reg.request(tokens) as req:
                if not req.store([1], timeout=timeout):
                    return ("L2 probe", "this server refused the probe's STORE", False)
            return _find(there, model, tokens, chunk, wait, timeout)
    finally:
        kv.close()
        peer_kv.close()


def _find(there: object, model: str, tokens: object, chunk: int, wait: float,
          timeout: float) -> Check:
    """Look the probe up on the peer (a session each try) until it is found or
    ``wait`` has passed; the lookup's read locks freed, its session ended."""
    from ..client import Client
    from ..keys import CacheKey

    assert isinstance(there, Client)
    stored = time.monotonic()
    while True:
        session = f"lmcache-mp-doctor-{uuid.uuid4().hex[:8]}"
        key = CacheKey(model_name=model, world_size=1, worker_id=None, token_ids=tokens,
                       start=0, end=chunk, request_id=session)
        found = there.lookup(key, timeout=timeout)
        if found:
            there.free_lookup_locks(key, timeout=timeout)
        there.end_session(session, timeout=timeout)
        took = time.monotonic() - stored
        if found:
            return ("L2 probe", f"the peer found a chunk stored here {took * 1e3:.0f} ms "
                    f"later: the nodes share their L2", True)
        if took > wait:
            return ("L2 probe", f"the peer did NOT find a chunk stored here within "
                    f"{wait:g} s: the L2 tier is not shared (another path, host or "
                    f"key_prefix), down on one node (see --server-log), or the servers "
                    f"hash or key differently (--hash-algorithm; releases before 0.5.6 "
                    f"did not share)", False)
        time.sleep(0.05)
