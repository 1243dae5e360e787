"""What ``lmcache-mp doctor`` learns about the box, for co-located (same-host) serving:
the GPU's memory model, what is shared with the server, which transfer modes can
therefore work, and how big the server's L1 may be.

Why these facts. On a unified-memory box (GB10 / DGX Spark, Grace Hopper, Jetson) the
GPU, the engine, the server's L1 and ``/dev/shm`` all draw on one pool, and NVML does
not answer memory queries there, so free memory comes from ``cudaMemGetInfo``. CUDA
IPC works for ``cudaMalloc`` memory on GB10 but not for VMM memory (PyTorch
``expandable_segments``, vLLM's cumem allocator / sleep mode), nor at all on Jetson
(Tegra); engine-driven transfers need only a shared ``/dev/shm``. Each fact is a
:data:`~lmcache_mp.cli.doctor.Check` row; :class:`Box` keeps what the recommendation needs.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import LMCacheMPError, ProtocolMismatch

if TYPE_CHECKING:
    from ..ipc.cuda import CudaDriver

__all__ = ["Box", "gpu_facts", "host_facts", "server_sharing", "recommend", "server_pid"]

Check = tuple[str, str, bool]
GIB = 1 << 30
#: Left to the OS, the engine's and the server's own processes on a unified pool.
HEADROOM = 8 * GIB
_ATTRIBUTES = ("Integrated", "PageableMemoryAccess", "PageableMemoryAccessUsesHostPageTables",
               "HostRegisterSupported")


@dataclass
class Box:
    """The facts the recommendation is made from (None: not known)."""

    cuda: bool = False
    integrated: bool | None = None
    pageable_access: bool | None = None
    host_register: bool | None = None
    gpu_total: int | None = None
    gpu_free: int | None = None
    ipc_memory: bool | None = None  # cudaIpcGetMemHandle of a cudaMalloc works here
    shm_size: int | None = None
    shm_free: int | None = None
    host_available: int | None = None  # MemAvailable
    memlock: int | None = None  # RLIMIT_MEMLOCK soft limit, -1 unlimited
    server: bool = False  # a server was asked
    pool_shared: bool | None = None  # the server's L1 pool maps here
    pool_size: int | None = None
    server_maps_ours: bool | None = None  # the server mapped a CPU cache of ours
    same_ipc_ns: bool | None = None
    notes: list[str] = field(default_factory=list)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


# ------------------------------------------------------------------- GPU
def gpu_facts(drv: CudaDriver, device: int, box: Box) -> list[Check]:
    """Integrated or discrete, compute capability, pageable memory access, free memory
    (``cudaMemGetInfo``: NVML answers "Not Supported" on GB10)."""
    from ..ipc.cuda import on_device

    rows: list[Check] = []
    attr = getattr(drv, "device_attribute", None)
    values: dict[str, int | None] = {}
    if attr is not None:
        for name in _ATTRIBUTES:
            try:
                values[name] = attr(device, name)
            except LMCacheMPError:
                values[name] = None
    integrated, pageable = values.get("Integrated"), values.get("PageableMemoryAccess")
    box.integrated = None if integrated is None else bool(integrated)
    box.pageable_access = None if pageable is None else bool(pageable)
    reg = values.get("HostRegisterSupported")
    box.host_register = None if reg is None else bool(reg)
    info = drv.device_info(device)
    major, minor = info.compute_capability
    kind = ("unknown" if integrated is None else
            "integrated: GPU and CPU share one memory pool" if integrated else
            "discrete: GPU memory of its own")
    rows.append((f"GPU {device} memory", f"{kind}; compute capability {major}.{minor} "
                 f"(sm_{major}{minor})", True))
    via_tables = values.get("PageableMemoryAccessUsesHostPageTables")
    rows.append((f"GPU {device} pageable access",
                 "unknown (these bindings lack the attribute)" if pageable is None else
                 ("yes: the GPU reads pageable host memory"
                  + (" through the host page tables" if via_tables else "")) if pageable
                 else "no: host memory must be page-locked for the GPU to read it", True))
    mem = getattr(drv, "mem_get_info", None)
    if mem is not None:
        try:
            with on_device(drv, device):
                free, total = mem()
            box.gpu_free, box.gpu_total = free, total
            rows.append((f"GPU {device} free memory", f"{_gib(free)} of {_gib(total)} "
                         f"(cudaMemGetInfo{'; the whole unified pool' if integrated else ''})",
                         True))
        except LMCacheMPError as exc:
            rows.append((f"GPU {device} free memory", f"cudaMemGetInfo failed: {exc}", False))
    return rows


# ------------------------------------------------------------------ host
def host_facts(box: Box, shm_dir: str = "/dev/shm") -> list[Check]:
    """``/dev/shm`` size and free space, MemAvailable, and the page-lock limit."""
    import resource

    rows: list[Check] = []
    try:
        st = os.statvfs(shm_dir)
        box.shm_size, box.shm_free = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail
        rows.append((shm_dir, f"size {_gib(box.shm_size)}, free {_gib(box.shm_free)}",
                     box.shm_free > 0))
    except OSError as exc:
        rows.append((shm_dir, f"unavailable ({exc.strerror}): CPU KV caches and the "
                              f"server's L1 pool need POSIX shared memory", False))
    try:
        with open("/proc/meminfo") as f:
            m = re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M)
        if m:
            box.host_available = int(m.group(1)) * 1024
            rows.append(("host memory available", _gib(box.host_available), True))
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    box.memlock = -1 if soft == resource.RLIM_INFINITY else soft
    rows.append(("page-lock limit", "unlimited" if box.memlock < 0 else
                 f"{_gib(box.memlock)} (ulimit -l): GPU engine-driven copies from a larger "
                 f"L1 pool run pageable, slower", True))
    return rows


# ---------------------------------------------------------------- server
def server_pid(url: str) -> int | None:
    """The pid of the process listening on ``url`` when this process can see it (same
    host, pid and network namespace, and permission to read its fds), else None."""
    inodes: set[str] = set()
    try:
        if url.startswith("tcp://"):
            hostport = url[6:]
            host, _, port = hostport.rpartition(":")
            if not ipaddress.ip_address(host.strip("[]")).is_loopback:
                return None
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                with open(table) as f:
                    for line in f.readlines()[1:]:
                        cols = line.split()
                        if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == int(port):
                            inodes.add(cols[9])
        elif url.startswith("ipc://"):
            with open("/proc/net/unix") as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if len(cols) >= 8 and cols[7] == url[6:]:
                        inodes.add(cols[6])
    except (OSError, ValueError, IndexError):
        return None
    wanted = {f"socket:[{i}]" for i in inodes if i != "0"}
    if not wanted:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return int(pid)
        except OSError:
            continue
    return None


def _namespace(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def server_sharing(url: str, timeout: float, box: Box) -> list[Check]:
    """A tiny SHM registration round trip: a one-block CPU cache registered with
    ``mode="auto"`` maps the server's L1 pool here (engine-driven) or, without a pool,
    has the server map our segment (server-copy); then unregistered. Plus the IPC
    namespaces, when the server's process is visible from here."""
    from ..client import Client
    from ..ipc.cpu_cache import CpuKVCache

    box.server = True
    rows: list[Check] = []
    pid = server_pid(url)
    ours, theirs = _namespace("self", "ipc"), None if pid is None else _namespace(pid, "ipc")
    if ours and theirs:
        box.same_ipc_ns = ours == theirs
        rows.append(("IPC namespace", f"{'shared with' if box.same_ipc_ns else 'NOT shared with'}"
                     f" the server (pid {pid}: {theirs}; here {ours})", box.same_ipc_ns))
    else:
        rows.append(("IPC namespace", f"here {ours}; the server's process is not visible "
                     f"from here (another container or pid namespace?)", True))
    try:
        with Client(url, timeout=timeout) as client:
            chunk = client.chunk_size()
            kv = CpuKVCache.allocate(num_layers=1, num_blocks=1, block_size=chunk,
                                     num_heads=1, head_dim=8, dtype="float16")
            try:
                reg = client.register(kv, model_name="lmcache-mp-doctor", mode="auto",
                                      timeout=timeout)
                info = reg.pool_info
                mode = reg.mode
                reg.unregister(timeout=timeout)
            finally:
                kv.close()
    except ProtocolMismatch as exc:
        rows.append(("SHM round trip", f"failed: {exc}", False))
        return rows
    except LMCacheMPError as exc:
        if "does not exist here" in str(exc):
            box.pool_shared = False
            rows.append(("/dev/shm shared with the server", f"NO: {exc}", False))
        else:
            rows.append(("SHM round trip", f"failed: {type(exc).__name__}: {exc}", False))
        return rows
    if mode == "engine" and info is not None:
        box.pool_shared, box.pool_size = True, info.pool_size
        rows.append(("/dev/shm shared with the server",
                     f"yes: its L1 pool {info.shm_name!r} ({_gib(info.pool_size)}) maps here",
                     True))
    else:
        box.pool_shared, box.server_maps_ours = None, True
        rows.append(("/dev/shm shared with the server",
                     "yes: it mapped a CPU cache of this process; it offers no L1 pool in "
                     "shared memory (engine-driven mode needs --shm-name NAME, from 0.5.4; "
                     "on GPU hosts also --no-l1-use-lazy, and --supported-transfer-mode "
                     "auto)", True))
    return rows


# ------------------------------------------------------- recommendation
def recommend(box: Box, engine_fraction: float) -> list[Check]:
    """Which transfer modes will work, and the mode and L1 size to use."""
    rows: list[Check] = []
    engine_ok = box.pool_shared is True
    ipc_ok = bool(box.cuda and box.ipc_memory) and box.same_ipc_ns is not False
    modes = []
    if engine_ok:
        modes.append("engine-driven (CPU caches" + ("; GPU caches of any allocator, CUDA "
                                                   "copies)" if box.cuda else ")"))
    if box.cuda:
        if ipc_ok:
            modes.append("LMCache-driven for GPU caches from cudaMalloc (CUDA IPC; not VMM "
                         "memory such as expandable_segments or vLLM's cumem / sleep mode)")
    if box.server_maps_ours or box.pool_shared:
        modes.append("LMCache-driven for CPU caches")
    if box.server:
        rows.append(("transfer modes", "; ".join(modes) if modes else
                     "none verified: share /dev/shm and the IPC namespace with the server "
                     "(same host; containers: --ipc=host, or --ipc=container:SERVER)",
                     bool(modes)))
    if not box.cuda:
        advice = ("CPU caches: mode='auto' (engine-driven when the server has a pool)")
    elif box.ipc_memory is False:
        advice = ("mode='engine' for GPU caches: CUDA IPC is not available on this device "
                  "(Tegra?), so the server cannot map them; start the server with "
                  "--supported-transfer-mode auto --shm-name NAME --no-l1-use-lazy")
    else:
        advice = ("mode='auto' for GPU caches: CUDA IPC (the server copies) for cudaMalloc "
                  "memory, engine-driven for VMM memory; the engine-driven path needs the "
                  "server started with --supported-transfer-mode auto --shm-name NAME "
                  "--no-l1-use-lazy")
    rows.append(("recommended mode", advice, True))
    rows.append(("recommended L1 size", _l1_advice(box, engine_fraction), True))
    return rows


def _l1_advice(box: Box, fraction: float) -> str:
    if box.integrated and box.gpu_total:
        # One pool: the engine takes its --gpu-memory-utilization share of it, and the L1
        # (which lives in /dev/shm) comes out of the same memory.
        engine = fraction * box.gpu_total
        room = box.gpu_total - engine - HEADROOM
        limit = room if box.shm_free is None else min(room, box.shm_free)
        if limit <= GIB:
            return (f"unified memory of {_gib(box.gpu_total)}: an engine using {fraction:.0%} "
                    f"of it leaves no room for an L1 (keep {_gib(HEADROOM)} for the OS); lower "
                    f"the engine's --gpu-memory-utilization, e.g. to 0.5")
        return (f"--l1-size-gb {int(limit // GIB)} at most: unified memory of "
                f"{_gib(box.gpu_total)} minus the engine's {fraction:.0%} ({_gib(engine)}; "
                f"its --gpu-memory-utilization) minus {_gib(HEADROOM)} for the OS and the "
                f"processes{'' if box.shm_free is None else f', within /dev/shm free {_gib(box.shm_free)}'}"
                f". Start the server first and with --no-l1-use-lazy, so the pool is "
                f"committed before the engine sizes its KV cache")
    avail = box.host_available
    if avail is None:
        return "size L1 (--l1-size-gb) to fit host memory and /dev/shm"
    limit = avail - HEADROOM if box.shm_free is None else min(avail - HEADROOM, box.shm_free)
    return (f"--l1-size-gb {max(int(limit // GIB), 0)} at most: host memory available "
            f"{_gib(avail)} minus {_gib(HEADROOM)} headroom"
            f"{'' if box.shm_free is None else f', within /dev/shm free {_gib(box.shm_free)}'}")
