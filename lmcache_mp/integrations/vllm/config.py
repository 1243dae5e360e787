"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Key names are LMCache's (``lmcache.mp.*``) wherever the meaning is the same, so a
deployment switches from LMCache's connector by changing the module path only. Keys
LMCache has and this connector does not act on are accepted and ignored (listed in
:data:`IGNORED_KEYS`); an unknown ``lmcache.mp.`` key is refused, so a typo is not
silently a default. No vLLM import here: the unit tests run without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidArgument
from ...keys import SALT_FORBIDDEN_CHARS, SALT_MAX_LEN

__all__ = ["ConnectorConfig", "RankPlacement", "placement", "salt_usable", "IGNORED_KEYS"]

log = logging.getLogger("lmcache_mp")

PREFIX = "lmcache.mp."
#: LMCache's keys that change nothing here (its own features: lazy offload, VMM, ...).
IGNORED_KEYS = frozenset({
    "nonblocking_lookup_status", "isolated_ipc", "use_vmm_api", "hash_algorithm",
    "transfer_intermediate_tensors", "lazy_offload", "autostart", "autostart_args",
})
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
    #: Seconds between the scheduler's health probes of each server.
    health_interval: float = 2.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        raw = {k[len(PREFIX):]: v for k, v in (extra or {}).items()
               if isinstance(k, str) and k.startswith(PREFIX)}
        known = {"server_urls", "host", "port", "mq_timeout", "heartbeat_interval",
                 "mp_transfer_mode", "save_decode_cache", "transfer_timeout",
                 "lookup_timeout", "health_interval"}
        unknown = set(raw) - known - IGNORED_KEYS
        if unknown:
            raise InvalidArgument(
                f"unknown kv_connector_extra_config keys {sorted(PREFIX + k for k in unknown)}; "
                f"known: {sorted(PREFIX + k for k in known)}")
        for k in set(raw) & IGNORED_KEYS:
            log.info("lmcache_mp connector: %s%s is LMCache's own and has no effect here",
                     PREFIX, k)
        urls = _urls(raw)
        mode = str(raw.get("mp_transfer_mode", "auto"))
        if mode not in _MODES:
            raise InvalidArgument(f"{PREFIX}mp_transfer_mode must be one of {sorted(_MODES)}, "
                                  f"got {mode!r}")
        return cls(
            server_urls=urls,
            mq_timeout=_seconds(raw, "mq_timeout", cls.mq_timeout),
            heartbeat_interval=_seconds(raw, "heartbeat_interval", cls.heartbeat_interval),
            mode=_MODES[mode],
            save_decode_cache=_bool(raw.get("save_decode_cache", False)),
            transfer_timeout=_seconds(raw, "transfer_timeout", cls.transfer_timeout),
            lookup_timeout=_seconds(raw, "lookup_timeout", cls.lookup_timeout),
            health_interval=_seconds(raw, "health_interval", cls.health_interval),
        )


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


def _seconds(raw: Mapping[str, Any], name: str, default: float) -> float:
    try:
        value = float(raw.get(name, default))
    except (TypeError, ValueError):
        raise InvalidArgument(f"{PREFIX}{name} must be a number of seconds, "
                              f"got {raw.get(name)!r}") from None
    if not value > 0:
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
