"""``lmcache-mp doctor``: can this machine share KV caches with an LMCache MP server?

Reports the CUDA driver and runtime, each device with the UUID string the server
matches on, whether CUDA IPC memory and event handles can be made here (by making,
exporting and releasing a small allocation and an event), the GPU's memory model and
free memory, ``/dev/shm`` (CPU caches and the server's L1 pool live there) and, given a
URL, whether a server answers, with which protocol, which CUDA wrapper forms it opens,
whether it shares ``/dev/shm`` and the IPC namespace with this process (a tiny SHM
registration round trip), which transfer modes will therefore work, and the mode and
L1 size to use (:mod:`lmcache_mp.cli.host_facts`). Without CUDA it says so and reports the
rest; it never raises.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import LMCacheMPError
from .host_facts import Box, gpu_facts, host_facts, recommend, server_sharing

if TYPE_CHECKING:
    from ..ipc.cuda import CudaDriver
    from ..protocol.wrappers import WrapperFormats

__all__ = ["Check", "run_doctor", "format_report", "main_doctor"]

# (check, result, ok)
Check = tuple[str, str, bool]

_PROBE_BYTES = 2 << 20


def _version(v: int) -> str:
    """CUDA's integer version (e.g. 13000) as "13.0"."""
    return f"{v // 1000}.{(v % 1000) // 10}" if v > 0 else "none"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _cuda_checks(driver: CudaDriver | None, box: Box) -> list[Check]:
    from ..ipc.cuda import CudaUnavailable, get_driver

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
    box.cuda = True
    try:
        rows.extend(gpu_facts(drv, 0, box))
    except LMCacheMPError as exc:
        rows.append(("GPU 0 memory", f"cannot read it: {exc}", False))
    ipc = _ipc_probe(drv, 0)
    box.ipc_memory = ipc[0][2]
    rows.extend(ipc)
    return rows


def _ipc_probe(drv: CudaDriver, device: int) -> list[Check]:
    """Make, export and release a small allocation and an interprocess event."""
    from ..ipc.cuda import export_allocation, on_device

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


def _server_checks(url: str, timeout: float) -> list[Check]:
    try:
        from ..client import Client

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


def run_doctor(url: str | None, timeout: float, *, driver: CudaDriver | None = None,
               engine_fraction: float = 0.9, box: Box | None = None,
               peer: str | None = None, server_logs: Sequence[str] = (),
               l2_wait: float = 10.0, allow_remote: bool = False,
               status_urls: Sequence[str] = ()) -> list[Check]:
    """Every check as (check, result, ok). ``driver`` replaces cuda-python (tests);
    ``engine_fraction`` is the engine's share of GPU memory (vLLM's
    ``--gpu-memory-utilization``) for the L1 advice; ``box`` receives the facts;
    ``peer`` (another node's server), ``server_logs`` and ``status_urls`` (LMCache's
    HTTP fronts) add the second tier's checks (:mod:`lmcache_mp.cli.l2_doctor`)."""
    from .. import __version__

    box = box if box is not None else Box()
    rows: list[Check] = [
        ("lmcache_mp", __version__, True),
        ("python", f"{platform.python_version()} ({sys.executable}, "
                   f"{platform.machine()})", True),
    ]
    try:
        rows.extend(_cuda_checks(driver, box))
    except Exception as exc:  # the doctor must report, not crash
        rows.append(("CUDA", f"check failed unexpectedly: {exc!r}", False))
    rows.extend(host_facts(box))
    if url is None:
        rows.append(("server", "not checked (pass --url tcp://HOST:PORT)", True))
    else:
        server = _server_checks(url, timeout)
        rows.extend(server)
        if server[0][2]:
            try:
                rows.extend(server_sharing(url, timeout, box))
            except Exception as exc:  # the doctor must report, not crash
                rows.append(("SHM round trip", f"check failed unexpectedly: {exc!r}", False))
    rows.extend(recommend(box, engine_fraction))
    rows.extend(_l2_checks(url, peer, server_logs, timeout, l2_wait, allow_remote,
                           status_urls))
    return rows


#: The rows whose failure makes ``main_doctor`` exit 1 (a server asked about is down or
#: does not share its L2).
SERVER_ROWS = ("server", "peer", "chunk size", "L2 probe")


def _l2_checks(url: str | None, peer: str | None, server_logs: Sequence[str],
               timeout: float, l2_wait: float, allow_remote: bool,
               status_urls: Sequence[str] = ()) -> list[Check]:
    from .l2_doctor import compare_nodes, log_checks, status_checks

    rows: list[Check] = []
    try:
        if peer is not None:
            if url is None:
                rows.append(("peer", "not checked: --peer needs this node's server URL too",
                             False))
            else:
                rows.extend(compare_nodes(url, peer, timeout, l2_wait,
                                          allow_remote=allow_remote))
        rows.extend(status_checks(status_urls, timeout))
        rows.extend(log_checks(server_logs))
    except Exception as exc:  # the doctor must report, not crash
        rows.append(("L2", f"check failed unexpectedly: {exc!r}", False))
    return rows


def format_report(rows: list[Check]) -> str:
    width = max((len(name) for name, _, _ in rows), default=0)
    return "\n".join(f"[{'ok' if ok else '--'}] {name:<{width}}  {result}"
                     for name, result, ok in rows)


def main_doctor(url: str | None, timeout: float, engine_fraction: float = 0.9, *,
                peer: str | None = None, server_logs: Sequence[str] = (),
                l2_wait: float = 10.0, allow_remote: bool = False,
                status_urls: Sequence[str] = ()) -> int:
    """Print the report; 1 if a requested server check failed (the server, the peer,
    the L2 probe, an L2 adapter its log shows down), else 0 (a machine without CUDA is
    a valid client host for CPU caches)."""
    rows = run_doctor(url, timeout, engine_fraction=engine_fraction, peer=peer,
                      server_logs=server_logs, l2_wait=l2_wait, allow_remote=allow_remote,
                      status_urls=status_urls)
    print(format_report(rows))
    failed = any(not ok and (name in SERVER_ROWS or name.startswith(("L2 adapter", "nodes'")))
                 for name, _, ok in rows)
    return 1 if failed else 0
