"""POSIX shared-memory segments: ones we create (KV caches) and ones we map (the
server's L1 pool in engine-driven mode).

Linux exposes a POSIX segment ``/name`` as the file ``/dev/shm/name``; opening that file
is ``shm_open`` without ctypes. Segments are created mode 0600, like LMCache's own:
client and server must run as the same user.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import secrets

from ..errors import InvalidArgument, LMCacheMPError

__all__ = ["SHM_DIR", "NAME_PREFIX", "ShmSegment", "map_existing", "shm_path"]

SHM_DIR = "/dev/shm"
# Every segment this package creates starts with this prefix, so tests and CI can
# check that none is left behind.
NAME_PREFIX = "lmcache_mp_"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_counter = itertools.count()


def shm_path(name: str) -> str:
    """``/dev/shm/<name>`` for a POSIX name with or without its leading slash."""
    bare = name[1:] if name.startswith("/") else name
    if not _NAME_RE.match(bare) or bare in (".", ".."):
        raise InvalidArgument(f"not a valid POSIX shared-memory name: {name!r}")
    return os.path.join(SHM_DIR, bare)


def _check_platform() -> None:
    if not os.path.isdir(SHM_DIR):
        raise LMCacheMPError(
            f"{SHM_DIR} is missing: POSIX shared memory is needed for CPU KV caches "
            f"(Linux only for now)"
        )


class ShmSegment:
    """A segment this process created; ``unlink()`` removes the name, ``close()`` also
    unmaps. The memory stays valid for live views after unlink."""

    __slots__ = ("name", "nbytes", "buffer", "_unlinked")

    def __init__(self, name: str, nbytes: int, buffer: mmap.mmap) -> None:
        self.name = name  # without the leading slash
        self.nbytes = nbytes
        self.buffer = buffer
        self._unlinked = False

    @classmethod
    def create(cls, nbytes: int, tag: str = "kv") -> ShmSegment:
        _check_platform()
        if nbytes <= 0:
            raise InvalidArgument(f"a shared-memory segment needs a positive size, got {nbytes}")
        # pid + counter make names unique per process; the random part guards against
        # a stale segment left by a crashed process that had the same pid.
        name = f"{NAME_PREFIX}{os.getpid()}_{next(_counter)}_{tag}_{secrets.token_hex(4)}"
        path = shm_path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            buffer = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(name, nbytes, buffer)

    @property
    def posix_name(self) -> str:
        return "/" + self.name

    @property
    def unlinked(self) -> bool:
        return self._unlinked

    def unlink(self) -> None:
        """Remove the name (idempotent): nobody can open it any more."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(shm_path(self.name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink, then unmap unless numpy/torch views of the memory are still alive
        (then the mapping goes away with the last view)."""
        self.unlink()
        try:
            self.buffer.close()
        except BufferError:
            pass


def map_existing(name: str, nbytes: int) -> mmap.mmap:
    """Map ``nbytes`` of an existing segment read/write (the server's L1 pool)."""
    _check_platform()
    path = shm_path(name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise LMCacheMPError(
            f"the server's shared-memory pool {name!r} does not exist here: client and "
            f"server must share a host (and /dev/shm)"
        ) from None
    except PermissionError:
        raise LMCacheMPError(
            f"no permission to open the server's shared-memory pool {name!r} (mode 0600): "
            f"run the client as the server's user"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise LMCacheMPError(
                f"the server's pool {name!r} has {size} bytes but the server announced "
                f"{nbytes}: is another server using the same name?"
            )
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
