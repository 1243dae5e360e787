"""lmcache_mp: a small, fast, typed client for the LMCache multiprocess (MP) server.

It speaks the server's ZMQ + msgpack wire protocol itself and never imports
``lmcache``, torch or CUDA at import time.
"""

from __future__ import annotations

from .client import DEFAULT_TIMEOUT, Client
from .errors import (
    ClientClosed,
    ConnectionChanged,
    InvalidArgument,
    LMCacheMPError,
    ProtocolMismatch,
    RequestTimeout,
    ServerUnavailable,
    ServerUnresponsive,
)
from .ipc.cpu_cache import CpuKVCache
from .keys import CacheKey
from .protocol.types import BlockAllocationRecord, EngineGroupInfo
from .session.registration import Registration
from .session.request import Request
from .transport import ReplyFuture

__version__ = "0.2.0"

__all__ = [
    "Client",
    "Registration",
    "Request",
    "CacheKey",
    "CpuKVCache",
    "ReplyFuture",
    "BlockAllocationRecord",
    "EngineGroupInfo",
    "DEFAULT_TIMEOUT",
    "LMCacheMPError",
    "RequestTimeout",
    "ServerUnavailable",
    "ServerUnresponsive",
    "ConnectionChanged",
    "ClientClosed",
    "ProtocolMismatch",
    "InvalidArgument",
]
