"""What the client needs from a KV cache it registers, whatever memory backs it.

:class:`~lmcache_mp.ipc.cpu_cache.CpuKVCache` (POSIX SHM) and the CUDA cache
(:mod:`lmcache_mp.ipc.cuda`, imported only when used) both implement this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..protocol.operations import Profile
    from ..protocol.types import LayoutHints, WrapperBlob
    from .cpu_cache import KVGeometry

__all__ = ["ExportableKVCache"]


@runtime_checkable
class ExportableKVCache(Protocol):
    """A paged KV cache the server can map (one IPC wrapper per layer tensor)."""

    geometry: KVGeometry

    @property
    def closed(self) -> bool: ...

    @property
    def unlinked(self) -> bool:
        """True once the cache can no longer be registered (e.g. SHM names removed)."""
        ...

    def ipc_wrappers(self, profile: Profile) -> list[WrapperBlob]:
        """One serialised wrapper per layer, in the profile's wrapper format."""
        ...

    def layout_hints(self) -> LayoutHints:
        """The REGISTER_KV_CACHE layout hint describing this cache's layers."""
        ...

    def begin_transfer(self, stream: Any) -> tuple[bytes, Any]:
        """Before a STORE / RETRIEVE: the event handle to send (b"" on CPU) and a token
        to keep alive until the reply (e.g. the CUDA event object)."""
        ...

    def end_transfer(self, server_event: bytes, stream: Any, token: Any) -> None:
        """After the reply: order the caller's ``stream`` after the server's copy (CUDA:
        wait on the server's event handle); a no-op on CPU, where copies are synchronous."""
        ...

    def unlink(self) -> None:
        """Called on unregister: stop other processes from mapping the memory anew."""
        ...
