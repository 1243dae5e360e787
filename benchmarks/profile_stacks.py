"""Where a connector's CPU goes, from py-spy's samples of every process of an engine.

The vLLM benchmarks (``--py-spy PATH``) run each engine under ``py-spy record
--format raw --full-filenames --subprocesses --nonblocking``: one line per distinct
stack, ``process PID:"cmd";frame;...;frame COUNT``, a frame ``function (file:line)``.
A sample is the connector's when a frame of it is on the stack: a file under
``lmcache_mp/`` or ``lmcache/`` (this benchmark's own wrappers, benchmarks/hooktime,
are not: their frames are left out), except samples of the engine's start and end
(imports, the connector's construction and registration, shutdown: ``_NOT_STEPS``),
which are not per-step work. Each such sample is counted once under its
*entry* (the outermost connector frame: the vLLM hook, or the function a background
thread runs) and once under its *leaf* (the innermost frame of the whole stack: where
the CPU was, numpy's copy or zmq's send included); both shares are of the connector's
samples. ``summarize`` reads one file; ``markdown`` puts contenders side by side.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_OURS = ("/lmcache_mp/", "/lmcache/")
_SKIP = ("/hooktime/",)
#: Samples of the engine's start and end, not of its steps: imports, the connector's
#: construction, registration, metrics set-up, shutdown.
_NOT_STEPS = ("<module>", "_call_with_frames_removed", "register_kv_caches", "__init__",
              "build_prom_metrics", "shutdown", "unregister", "set_registration",
              "get_handshake_metadata", "set_xfer_handshake_metadata", "_try_register")


def _frame(text: str) -> tuple[str, str]:
    m = _FRAME.match(text)
    if m is None:
        return text, ""
    return m.group("func"), m.group("file")


def _short(func: str, path: str) -> str:
    """``package/module.py:function`` from a frame (the last two path parts)."""
    parts = path.split("/")
    return f"{'/'.join(parts[-2:])}:{func}" if path else func


def summarize(path: Path, rate: float, steps: int, top: int = 12) -> dict[str, Any]:
    """The connector's samples in one py-spy raw file: CPU seconds (samples / rate),
    per scheduler step, and the top entries and leaves."""
    total = connector = 0
    entries: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_frame(f) for f in stack.split(";")[1:]]  # [0]: the process
        frames = [f for f in frames if not any(s in f[1] for s in _SKIP)]
        mine = [i for i, (_, file) in enumerate(frames) if any(o in file for o in _OURS)]
        if not mine or any(func in _NOT_STEPS for func, _ in frames):
            continue
        connector += n
        entries[_short(*frames[mine[0]])] += n
        leaves[_short(*frames[-1])] += n

    def share(c: Counter[str]) -> list[tuple[str, int, float]]:
        return [(k, v, v / connector) for k, v in c.most_common(top)] if connector else []

    return {"samples": total, "connector_samples": connector, "rate": rate,
            "connector_cpu_s": connector / rate, "steps": steps,
            "cpu_us_per_step": connector / rate / steps * 1e6 if steps else None,
            "entries": share(entries), "leaves": share(leaves)}


def markdown(profiles: dict[str, dict[str, Any]], title: str) -> list[str]:
    """Per contender: CPU per step by py-spy, then its top entries and leaves."""
    names = [n for n, p in profiles.items() if p]
    if not names:
        return []
    lines = ["", f"### {title}: py-spy ({profiles[names[0]]['rate']:.0f} Hz, every "
             "process of the engine)", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, fmt in (("connector samples", "connector_samples", "{}"),
                            ("connector CPU (s)", "connector_cpu_s", "{:.2f}"),
                            ("scheduler steps", "steps", "{}"),
                            ("connector CPU per step (us)", "cpu_us_per_step", "{:.0f}")):
        lines.append(f"| {label} | " + " | ".join(
            "-" if profiles[n].get(key) is None else fmt.format(profiles[n][key])
            for n in names) + " |")
    for n in names:
        p = profiles[n]
        for what, label in (("entries", "entry (hook or thread)"),
                            ("leaves", "leaf (where the CPU was)")):
            lines += ["", f"{n}, by {label}: "
                      + "; ".join(f"`{k}` {share:.0%}" for k, _, share in p[what])]
    return lines
