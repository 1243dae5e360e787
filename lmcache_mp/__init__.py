"""lmcache_mp: a small, fast, typed client for the LMCache multiprocess (MP) server.

It speaks the server's ZMQ + msgpack wire protocol itself and never imports
``lmcache``, torch or CUDA at import time.
"""

from __future__ import annotations

from .client import DEFAULT_TIMEOUT, Client
from .errors import (
    ClientClosed,
    InvalidArgument,
    LMCacheMPError,
    ProtocolMismatch,
    RequestTimeout,
    ServerUnavailable,
)
from .futures import ReplyFuture
from .ipc.cpu_cache import CpuKVCache
from .keys import CacheKey
from .protocol.types import BlockAllocationRecord, EngineGroupInfo

__version__ = "0.1.0"

__all__ = [
    "Client",
    "CacheKey",
    "CpuKVCache",
    "ReplyFuture",
    "BlockAllocationRecord",
    "EngineGroupInfo",
    "DEFAULT_TIMEOUT",
    "LMCacheMPError",
    "RequestTimeout",
    "ServerUnavailable",
    "ClientClosed",
    "ProtocolMismatch",
    "InvalidArgument",
]
