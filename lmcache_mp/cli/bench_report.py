"""What ``lmcache-mp bench`` shows: a progress bar while it runs, a table of medians and
ratios at the end, the raw per-round numbers as JSON, and a PNG chart (matplotlib,
the optional ``bench`` extra, imported only to draw it)."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from typing import Any

__all__ = ["Progress", "summarize", "table", "machine", "chart"]

# (name, measure, numerator, denominator, target or None, better): the headline ratios.
RATIOS: list[tuple[str, str, str, str, float | None, str]] = [
    ("NOOP latency ours / bare DEALER", "noop_us", "ours", "bare", None, "lower"),
    ("NOOP latency ours / LMCache", "noop_us", "ours", "lmcache", None, "lower"),
    ("pipelined NOOPs ours / LMCache", "pipelined_krps", "ours", "lmcache", None, "higher"),
    ("LOOKUP 4096 ours / LMCache", "lookup_us", "ours", "lmcache", None, "lower"),
    ("STORE client CPU ours / LMCache", "request_cpu_us.store", "ours", "lmcache", 0.5,
     "lower"),
    ("STORE client CPU ours(numpy ids) / LMCache", "request_cpu_us.store", "ours_numpy",
     "lmcache", 0.5, "lower"),
    ("RETRIEVE client CPU ours / LMCache", "request_cpu_us.retrieve", "ours", "lmcache", 0.5,
     "lower"),
    ("RETRIEVE client CPU ours(numpy ids) / LMCache", "request_cpu_us.retrieve", "ours_numpy",
     "lmcache", 0.5, "lower"),
    ("engine NHD STORE ours / memcpy", "gbps.engine.NHD.store", "ours", "memcpy", 0.8, "higher"),
    ("engine NHD RETRIEVE ours / memcpy", "gbps.engine.NHD.retrieve", "ours", "memcpy", 0.8,
     "higher"),
    ("engine HND STORE ours / memcpy", "gbps.engine.HND.store", "ours", "memcpy", 0.6, "higher"),
    ("engine HND RETRIEVE ours / memcpy", "gbps.engine.HND.retrieve", "ours", "memcpy", 0.6,
     "higher"),
    ("engine HND STORE ours / LMCache", "gbps.engine.HND.store", "ours", "lmcache", None,
     "higher"),
    ("engine HND RETRIEVE ours / LMCache", "gbps.engine.HND.retrieve", "ours", "lmcache", None,
     "higher"),
    ("server-copy STORE ours / LMCache", "gbps.lmcache.HND.store", "ours", "lmcache", None,
     "higher"),
    ("server-copy RETRIEVE ours / LMCache", "gbps.lmcache.HND.retrieve", "ours", "lmcache", None,
     "higher"),
]

UNITS = {"noop_us": "us", "pipelined_krps": "k req/s", "lookup_us": "us",
         "request_cpu_us": "us CPU", "gbps": "GB/s", "import_ms": "ms"}


class Progress:
    """A one-line bar on a terminal; on a log (CI), one line per tenth."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled, self.tty = enabled, sys.stderr.isatty()
        self.last = -1

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        frac = done / max(total, 1)
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r[{bar:<30}] {done}/{total} {what[:60]:<60}")
            if done == total:
                sys.stderr.write("\n")
        elif int(frac * 10) != self.last:
            self.last = int(frac * 10)
            sys.stderr.write(f"bench: {frac:4.0%} {what}\n")
        sys.stderr.flush()


def summarize(samples: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Medians per measure and contender, and the headline ratios (with targets)."""
    med = {m: {who: statistics.median(v) for who, v in by.items()} for m, by in samples.items()}
    ratios = []
    for name, m, num, den, target, better in RATIOS:
        a, b = med.get(m, {}).get(num), med.get(m, {}).get(den)
        if a is None or b is None:
            continue
        r = a / b
        # Each round's own ratio (both sides taken back to back), then their median:
        # steadier than the ratio of medians when the machine's load changes mid-run.
        paired = statistics.median(x / y for x, y in zip(samples[m][num], samples[m][den],
                                                         strict=False))
        met = None if target is None else (r <= target if better == "lower" else r >= target)
        ratios.append({"name": name, "ratio": r, "paired": paired, "target": target,
                       "better": better, "met": met})
    return {"medians": med, "ratios": ratios}


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def table(result: dict[str, Any]) -> str:
    med = result["medians"]
    whos = [w for w in ("ours", "ours_numpy", "bare", "lmcache", "memcpy")
            if any(w in by for by in med.values())]
    lines = [f"{'measure':<28} {'unit':<8} " + " ".join(f"{w:>10}" for w in whos)]
    for m in sorted(med, key=_order):
        unit = UNITS.get(m.split(".")[0], "")
        cells = [f"{med[m][w]:>10.4g}" if w in med[m] else f"{'':>10}" for w in whos]
        lines.append(f"{m:<28} {unit:<8} " + " ".join(cells))
    lines.append("")
    lines.append("ratios: of the medians (and the median of each round's own ratio)")
    for r in result["ratios"]:
        mark = "" if r["met"] is None else ("  target " + ("<=" if r["better"] == "lower" else ">=")
                                            + f" {r['target']}: {'met' if r['met'] else 'MISSED'}")
        lines.append(f"{r['name']:<46} {r['ratio']:>6.2f}x (per round {r['paired']:.2f}x){mark}")
    return "\n".join(lines)


def _order(m: str) -> tuple[int, str]:
    first = ["noop_us", "pipelined_krps", "lookup_us", "request_cpu_us", "gbps", "import_ms"]
    head = m.split(".")[0]
    return (first.index(head) if head in first else 99, m)


def chart(result: dict[str, Any], png: str) -> None:
    """Four panels: latency, throughput, client CPU per request, transfer GB/s; bars are
    medians over rounds, whiskers the min and max."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the chart needs matplotlib: pip install 'lmcache-mp[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    colors = {"ours": "#1f77b4", "ours_numpy": "#6baed6", "bare": "#7f7f7f",
              "lmcache": "#ff7f0e", "memcpy": "#2ca02c"}
    panels = [("Latency (lower is better)", ["noop_us", "lookup_us"], "microseconds"),
              ("Throughput (higher is better)", ["pipelined_krps"], "thousand NOOPs / s"),
              ("Client CPU per request (lower is better)",
               ["request_cpu_us.store", "request_cpu_us.retrieve"], "CPU microseconds"),
              ("4096-token transfers (higher is better)",
               sorted((m for m in samples if m.startswith("gbps.")), key=_gbps_order), "GB/s")]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    for ax, (title, measures, ylabel) in zip(axes.flat, panels, strict=True):
        measures = [m for m in measures if m in samples]
        whos = [w for w in colors if any(w in samples[m] for m in measures)]
        width = 0.8 / max(len(whos), 1)
        for i, who in enumerate(whos):
            xs, ys, lo, hi = [], [], [], []
            for j, m in enumerate(measures):
                v = samples[m].get(who)
                if v:
                    mid = statistics.median(v)
                    xs.append(j + (i - (len(whos) - 1) / 2) * width)
                    ys.append(mid)
                    lo.append(mid - min(v))
                    hi.append(max(v) - mid)
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=who, color=colors[who])
        ax.set_xticks(range(len(measures)))
        ax.set_xticklabels([m.replace("gbps.", "").replace("request_cpu_us.", "")
                            .replace("lmcache.", "server-copy ") for m in measures],
                           rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if whos:
            ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    mach = result.get("machine", {})
    fig.suptitle(f"lmcache-mp bench, {result.get('server', '')}: {result['config']['rounds']} "
                 f"rounds, medians (whiskers: min-max); {mach.get('date', '')}, "
                 f"{mach.get('cores', '?')} cores, {mach.get('cpu', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def _gbps_order(m: str) -> tuple[int, str]:
    return (m.startswith("gbps.lmcache"), m)
