"""``lmcache-mp doctor``: can this machine share KV caches with an LMCache MP server?

Reports the CUDA driver and runtime, each device with the UUID string the server
matches on, whether CUDA IPC memory and event handles can be made here (by making,
exporting and releasing a small allocation and an event), ``/dev/shm`` (CPU caches and
the server's L1 pool live there) and, given a URL, whether a server answers, with which
protocol, and which CUDA wrapper forms it opens (and which one ``wrapper="auto"``
picks). Without CUDA it says so and reports the rest; it never raises.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import TYPE_CHECKING

from .errors import LMCacheMPError

if TYPE_CHECKING:
    from .ipc.cuda import CudaDriver
    from .protocol.wrappers import WrapperFormats

__all__ = ["Check", "run_doctor", "format_report", "main_doctor"]

# (check, result, ok)
Check = tuple[str, str, bool]

_PROBE_BYTES = 2 << 20


def _version(v: int) -> str:
    """CUDA's integer version (e.g. 13000) as "13.0"."""
    return f"{v // 1000}.{(v % 1000) // 10}" if v > 0 else "none"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _cuda_checks(driver: CudaDriver | None) -> list[Check]:
    from .ipc.cuda import CudaUnavailable, get_driver

    rows: list[Check] = []
    try:
        drv = driver if driver is not None else get_driver()
    except CudaUnavailable as exc:
        return [("CUDA", f"absent ({exc})", False)]
    except Exception as exc:  # a broken cuda-python install
        return [("CUDA", f"absent (cuda-python failed to load: {exc!r})", False)]
    try:
        drv_ver = drv.driver_version()
        rt_ver = drv.runtime_version()
    except LMCacheMPError as exc:
        return [("CUDA", f"absent (cuda-python {drv.bindings_version()}: {exc})", False)]
    rows.append(("cuda-python", drv.bindings_version(), True))
    rows.append(("CUDA runtime", f"{_version(rt_ver)} ({rt_ver})", rt_ver > 0))
    if drv_ver <= 0:
        rows.append(("CUDA", "absent (cuda-python is installed but no NVIDIA driver was "
                             "found)", False))
        return rows
    # A driver older than the runtime still works within one major version (minor
    # version compatibility), so this is reported, not judged.
    rows.append(("CUDA driver", f"{_version(drv_ver)} ({drv_ver})", True))
    try:
        count = drv.device_count()
    except LMCacheMPError as exc:
        rows.append(("CUDA", f"absent (driver {_version(drv_ver)} but no usable device: "
                             f"{exc})", False))
        return rows
    if count == 0:
        rows.append(("CUDA", "absent (the driver sees no device; CUDA_VISIBLE_DEVICES?)",
                     False))
        return rows
    rows.append(("CUDA", f"{count} device(s)", True))
    for dev in range(count):
        try:
            info = drv.device_info(dev)
            major, minor = info.compute_capability
            rows.append((f"device {dev}", f"{info.name}, uuid {info.uuid}, sm_{major}{minor}, "
                                          f"{_gib(info.total_memory)}", True))
        except LMCacheMPError as exc:
            rows.append((f"device {dev}", f"cannot read its properties: {exc}", False))
    rows.extend(_ipc_probe(drv, 0))
    return rows


def _ipc_probe(drv: CudaDriver, device: int) -> list[Check]:
    """Make, export and release a small allocation and an interprocess event."""
    from .ipc.cuda import export_allocation, on_device

    rows: list[Check] = []
    try:
        with on_device(drv, device):
            ptr = drv.malloc(_PROBE_BYTES)
            try:
                exp = export_allocation(ptr, _PROBE_BYTES, driver=drv)
                rows.append((f"IPC memory handle (device {device})",
                             f"ok ({len(exp.handle)}-byte cudaIpcMemHandle_t of a "
                             f"{_PROBE_BYTES >> 20} MiB cudaMalloc)", True))
            finally:
                drv.free(ptr)
    except LMCacheMPError as exc:
        rows.append((f"IPC memory handle (device {device})", f"failed: {exc}", False))
    try:
        with on_device(drv, device):
            event = drv.event_create_ipc()
            try:
                drv.event_record(event, 0)
                handle = drv.ipc_get_event_handle(event)
                drv.event_synchronize(event)
                rows.append((f"IPC event handle (device {device})",
                             f"ok ({len(handle)}-byte cudaIpcEventHandle_t)", True))
            finally:
                drv.event_destroy(event)
    except LMCacheMPError as exc:
        rows.append((f"IPC event handle (device {device})", f"failed: {exc}", False))
    return rows


def _shm_check(path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return (path, f"unavailable ({exc.strerror}): CPU KV caches and the server's L1 "
                      f"pool need POSIX shared memory", False)
    size, free = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail
    return (path, f"size {_gib(size)}, free {_gib(free)}", free > 0)


def _server_checks(url: str, timeout: float) -> list[Check]:
    try:
        from .client import Client

        with Client(url, timeout=timeout) as client:
            noop = client.noop()
            chunk = client.chunk_size()
            protocol = client.server_protocol
            profile = client.profile
        releases = ", ".join(profile.releases)
    except LMCacheMPError as exc:
        return [("server", f"{url} did not answer: {exc}", False)]
    except Exception as exc:  # e.g. a malformed URL the transport rejects
        return [("server", f"{url}: {exc!r}", False)]
    return [("server", f"{url} answers (NOOP {noop!r}, chunk size {chunk}, protocol "
                       f"{protocol}: LMCache {releases})", True),
            ("CUDA wrapper forms", _wrapper_forms(profile.wrappers), True)]


def _wrapper_forms(wrappers: WrapperFormats) -> str:
    """Which CUDA wrapper forms the server opens, the ``"auto"`` one first."""
    parts = []
    for form in wrappers.cuda:
        note = wrappers.cuda_notes.get(form, "")
        default = "wrapper='auto' picks this; " if form == wrappers.default_cuda_form else ""
        parts.append(f"{form} ({default}{note})" if default or note else form)
    return "the server opens " + "; ".join(parts)


def run_doctor(url: str | None, timeout: float, *,
               driver: CudaDriver | None = None) -> list[Check]:
    """Every check as (check, result, ok). ``driver`` replaces cuda-python (tests)."""
    from . import __version__

    rows: list[Check] = [
        ("lmcache_mp", __version__, True),
        ("python", f"{platform.python_version()} ({sys.executable})", True),
    ]
    try:
        rows.extend(_cuda_checks(driver))
    except Exception as exc:  # the doctor must report, not crash
        rows.append(("CUDA", f"check failed unexpectedly: {exc!r}", False))
    rows.append(_shm_check())
    if url is None:
        rows.append(("server", "not checked (pass --url tcp://HOST:PORT)", True))
    else:
        rows.extend(_server_checks(url, timeout))
    return rows


def format_report(rows: list[Check]) -> str:
    width = max((len(name) for name, _, _ in rows), default=0)
    return "\n".join(f"[{'ok' if ok else '--'}] {name:<{width}}  {result}"
                     for name, result, ok in rows)


def main_doctor(url: str | None, timeout: float) -> int:
    """Print the report; 1 if a requested server check failed, else 0 (a machine
    without CUDA is a valid client host for CPU caches)."""
    rows = run_doctor(url, timeout)
    print(format_report(rows))
    failed_server = url is not None and any(name == "server" and not ok
                                            for name, _, ok in rows)
    return 1 if failed_server else 0
