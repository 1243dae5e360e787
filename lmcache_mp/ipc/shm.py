"""POSIX shared-memory segments: ones we create (KV caches) and ones we map (the
server's L1 pool in engine-driven mode).

Linux exposes a POSIX segment ``/name`` as the file ``/dev/shm/name``; opening that file
is ``shm_open`` without ctypes. Segments are created mode 0600, like LMCache's own:
client and server must run as the same user. Their pages are allocated up front
(``posix_fallocate``), so a full ``/dev/shm`` is an error at creation, never a SIGBUS
at first touch.

A process killed with SIGKILL never unlinks its segments. Their names carry the
creator's pid and pid namespace, so :func:`sweep_dead_segments` (run whenever a cache is
allocated, and by ``lmcache-mp clean``) can remove those whose creator is gone.

A *sweep scope* (``LMCACHE_MP_SHM_SCOPE``, a short lowercase word; default none) puts a
process's segments in a namespace of their own: ``lmcache_mp_<scope>.<pid>_...``. A
sweep removes only the segments of its own scope, so processes of different scopes
never sweep each other's, like processes of different pid namespaces. Tests that leave
dead processes' segments on purpose (and assert on them) run in a scope of their own;
operators may use one per tenant.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
from dataclasses import dataclass

from ..errors import InvalidArgument, LMCacheMPError

__all__ = ["SHM_DIR", "NAME_PREFIX", "SCOPE_ENV", "ShmSegment", "map_existing", "shm_path",
           "shm_free_bytes", "sweep_dead_segments", "sweep_scope", "Swept", "PageMapper"]

log = logging.getLogger("lmcache_mp")

SHM_DIR = "/dev/shm"
# Every segment this package creates starts with this prefix, so tests and CI can
# check that none is left behind.
NAME_PREFIX = "lmcache_mp_"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_counter = itertools.count()
#: The environment variable naming this process's sweep scope (see the module's text).
SCOPE_ENV = "LMCACHE_MP_SHM_SCOPE"
_SCOPE_RE = re.compile(r"^[a-z][a-z0-9]{0,31}$")


def sweep_scope() -> str:
    """This process's sweep scope ("" for none), read from ``LMCACHE_MP_SHM_SCOPE`` at
    each call (a test may set it for its children and itself)."""
    scope = os.environ.get(SCOPE_ENV, "")
    if scope and not _SCOPE_RE.match(scope):
        raise InvalidArgument(f"{SCOPE_ENV}={scope!r}: a sweep scope is 1-32 lowercase ASCII "
                              f"letters and digits, starting with a letter")
    return scope


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
        if not tag.isalnum() or not tag.isascii():
            raise InvalidArgument(f"a segment tag must be ASCII letters and digits, got {tag!r}")
        # pid + counter make names unique per process; the random part guards against
        # a stale segment left by a crashed process that had the same pid. The pid
        # namespace says which processes' pids these are (see sweep_dead_segments).
        scope = sweep_scope()
        name = (f"{NAME_PREFIX}{scope + '.' if scope else ''}{os.getpid()}_{_pid_namespace()}_"
                f"{next(_counter)}_{tag}_{os.urandom(4).hex()}")
        path = shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise LMCacheMPError(f"cannot create the shared-memory segment {path}: {exc}") from None
        try:
            _reserve(fd, nbytes, path)
            buffer = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as exc:
            os.close(fd)
            os.unlink(path)
            if isinstance(exc, OSError):
                raise LMCacheMPError(
                    f"cannot map a {nbytes}-byte shared-memory segment: {exc}") from None
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


#: madvise(MADV_POPULATE_WRITE), Linux 5.14+ (Python 3.11's mmap has no name for it).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class PageMapper:
    """Maps pages of a mapping into this process in bulk, ahead of a copy.

    A page of a shared mapping costs a page fault on its first touch in each process
    that maps it (~4 us each here: a MiB of a server's L1 pool, 256 faults, cost three
    times its memcpy). One ``madvise(MADV_POPULATE_WRITE)`` per 2 MiB granule, the
    first time a copy reaches it, maps the same pages for a quarter of that; later
    copies into the granule find them mapped. Only what a copy is about to touch is
    mapped (a server with a lazily allocated pool keeps it lazy). Kernels before 5.14
    refuse the advice: then this does nothing and the faults are taken as before.
    """

    GRANULE = 2 << 20

    def __init__(self, mapping: mmap.mmap, size: int) -> None:
        self._mapping = mapping
        self._size = size
        self._mapped = bytearray(-(-size // self.GRANULE))
        self._supported = True

    @property
    def supported(self) -> bool:
        """False once the kernel refused the advice (then copies fault as before)."""
        return self._supported

    def prepare(self, offset: int, length: int) -> None:
        """Map the granules of ``[offset, offset + length)`` not mapped yet."""
        if not self._supported or length <= 0:
            return
        g = self.GRANULE
        for i in range(offset // g, min(len(self._mapped), -(-(offset + length) // g))):
            if self._mapped[i]:
                continue
            start = i * g
            try:
                self._mapping.madvise(_MADV_POPULATE_WRITE, start, min(g, self._size - start))
            except ValueError:
                return  # unmapped meanwhile: the copy reports that itself
            except OSError as err:
                # EINVAL: a kernel without the advice; anything else (ENOMEM, EFAULT):
                # the copy's own faults say it better. Either way, stop trying.
                log.debug("lmcache_mp: pages of the pool not mapped ahead (%s)", err)
                self._supported = False
                return
            self._mapped[i] = 1


# ------------------------------------------------------------ allocation
def shm_free_bytes() -> int:
    """Bytes an unprivileged process may still allocate in ``/dev/shm``."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _reserve(fd: int, nbytes: int, path: str) -> None:
    """Size the segment and allocate its pages now. A tmpfs file only sized with
    ftruncate is sparse: on a full /dev/shm the first write to a missing page kills the
    process with SIGBUS, long after allocation "succeeded"."""
    os.ftruncate(fd, nbytes)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise InvalidArgument(
                f"not enough shared memory for a {nbytes / 2**20:.1f} MiB segment "
                f"({path}): {SHM_DIR} has {shm_free_bytes() / 2**20:.1f} MiB free; use fewer "
                f"blocks or layers, or enlarge {SHM_DIR} (docker: --shm-size)") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        # A file system without fallocate: the caller's free-space check stands.


# ------------------------------------------------------------ the sweep
_OURS = re.compile(r"^" + re.escape(NAME_PREFIX)
                   + r"(?:([a-z][a-z0-9]{0,31})\.)?(\d+)_(\d+)_\d+_[A-Za-z0-9]+_[0-9a-f]{8}$")
# Process start times come from /proc in clock ticks since boot, and the boot time in
# whole seconds: a process counts as started after a segment only by this margin.
_START_MARGIN_S = 2.0


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 if unknown: never swept)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class Swept:
    """What one sweep removed (and found, but kept because its creator lives on)."""

    removed: tuple[str, ...]
    kept_alive: int
    freed_bytes: int


def _boot_time() -> float | None:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _started_at(pid: int, btime: float | None) -> float | None:
    """When ``pid`` started (epoch seconds); None if no such live process (gone, or a
    zombie: a dead process not yet reaped, which will never touch memory again)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:  # no such process (or thread) in our pid namespace
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):
        return None
    if btime is None:
        return float("inf")  # alive, start unknown: never treated as recycled
    return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def sweep_dead_segments(*, dry_run: bool = False) -> Swept:
    """Remove (unless ``dry_run``) this package's segments whose creating process is gone.

    Only names this package makes (``lmcache_mp_[<scope>.]<pid>_<pidns>_...``), only
    those of this process's sweep scope (:func:`sweep_scope`), only those owned by this
    user, only from this process's pid namespace (another namespace's pids say nothing
    here: containers sharing /dev/shm), never this process's own. A segment
    whose pid is alive is kept unless that process started after the segment was
    created (the pid was reused). A server that mapped a removed segment keeps its
    mapping: removing the name only frees the memory once nobody maps it.
    """
    ns, scope = _pid_namespace(), sweep_scope()
    if not ns or not os.path.isdir(SHM_DIR):
        return Swept((), 0, 0)
    me, uid, btime = os.getpid(), os.getuid(), _boot_time()
    removed: list[str] = []
    kept = freed = 0
    starts: dict[int, float | None] = {}
    for name in os.listdir(SHM_DIR):
        m = _OURS.match(name)
        if m is None or (m.group(1) or "") != scope or int(m.group(3)) != ns:
            continue
        pid = int(m.group(2))
        if pid == me:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.stat(path)
        except OSError:
            continue  # removed meanwhile
        if st.st_uid != uid:
            continue
        if pid not in starts:
            starts[pid] = _started_at(pid, btime)
        started = starts[pid]
        # The segment existed by its earliest timestamp; a process that started
        # clearly later cannot have created it.
        if started is not None and started <= min(st.st_mtime, st.st_ctime) + _START_MARGIN_S:
            kept += 1
            continue
        if not dry_run:
            try:
                os.unlink(path)
            except OSError:
                continue
        removed.append(name)
        freed += st.st_blocks * 512
    if removed and not dry_run:
        log.warning("lmcache_mp: removed %d shared-memory segment(s) left by dead processes "
                    "(%.1f MiB): %s", len(removed), freed / 2**20, ", ".join(sorted(removed)))
    return Swept(tuple(sorted(removed)), kept, freed)
