"""The results document (JSON, rewritten atomically after every change) and its
table: one column per side, one row per measure."""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path
from typing import Any


def copy_path_cell(path: str) -> str:
    """``gather (one gather per round for every layer; staging 8 chunk objects, 256
    MiB)`` -> ``gather 1/round, 8 obj``; ``plan: why`` -> ``plan``."""
    if not path.startswith("gather"):
        return path.split(":")[0]
    kernels = "1/round" if "every layer" in path else "1/layer"
    held = path.split("staging ", 1)[1].split(" chunk")[0] if "staging " in path else "?"
    return f"gather {kernels}, {held.replace('holds ', '')} obj"


def table(results: list[dict[str, Any]], sizes: list[int]) -> str:
    def cell(r: dict[str, Any], key: str, size: int | None = None) -> str:
        if r.get("skipped"):
            return "skipped"
        v = r.get(key) if size is None else r.get(key, {}).get(size)
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    def verdict(r: dict[str, Any]) -> str:
        if r.get("skipped"):
            return "skipped"
        if r["ok"]:
            return "yes"
        return "HUNG" if r.get("hung") else "CUT" if r.get("interrupted") else "NO"

    rows = [["", *(r["side"] for r in results)]]
    rows.append(["round trip ok", *(verdict(r) for r in results)])
    rows.append(["register ms", *(cell(r, "register_ms") for r in results)])
    rows.append(["mode / copy path", *(
        "-" if r.get("skipped") else
        f"{r.get('mode', '?')}" + (f" / {copy_path_cell(r['copy_path'])}"
                                   if r.get("mode") == "engine" and r.get("copy_path") else "")
        for r in results)])
    if any("pool_pinned" in r for r in results):
        rows.append(["pool page-locked", *(cell(r, "pool_pinned") for r in results)])
    for size in sizes:
        rows.append([f"store GB/s {size} tok", *(cell(r, "store_gbps", size) for r in results)])
        rows.append([f"retrieve GB/s {size} tok",
                     *(cell(r, "retrieve_gbps", size) for r in results)])
        if any(r.get("store_copy_gbps") for r in results):
            # The engine-driven copy phase alone (between PREPARE and COMMIT).
            rows.append([f"store copy-only GB/s {size} tok",
                         *(cell(r, "store_copy_gbps", size) for r in results)])
            rows.append([f"retrieve copy-only GB/s {size} tok",
                         *(cell(r, "retrieve_copy_gbps", size) for r in results)])
        if any(r.get("memcpy_d2h_gbps") for r in results):
            # The engine-driven side's reference: plain copies of the same bytes, to
            # torch's pinned buffer and to a registered shared mapping (the pool's kind).
            for key, label in (("d2h", "D2H pinned"), ("h2d", "H2D pinned"),
                               ("shm_d2h", "D2H registered SHM"),
                               ("shm_h2d", "H2D registered SHM")):
                rows.append([f"{label} GB/s {size} tok",
                             *(cell(r, f"memcpy_{key}_gbps", size) for r in results)])
            rows.append([f"store / pinned copy {size} tok",
                         *(cell(r, "store_over_pinned", size) for r in results)])
            rows.append([f"retrieve / pinned copy {size} tok",
                         *(cell(r, "retrieve_over_pinned", size) for r in results)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


class Report:
    """The results document, rewritten (atomically) after every change."""

    def __init__(self, args: argparse.Namespace, env: dict[str, Any]) -> None:
        self.args, self.env = args, env
        self.results: list[dict[str, Any]] = []
        self.running: str | None = None
        self.state = "running"
        # Re-entrant: the SIGTERM handler writes from the main thread, maybe mid-write.
        self.lock = threading.RLock()

    def doc(self) -> dict[str, Any]:
        title = ("CPU DRY RUN (no CUDA involved)" if self.args.cpu_dry_run
                 else self.env.get("gpu", "GPU"))
        head = (f"LMCache {self.args.release}, {title}: {self.args.layers} layers x "
                f"{self.args.heads} heads x {self.args.head_dim} dim, bf16, block "
                f"{self.args.block_size}, "
                f"{'scattered' if self.args.scattered else 'consecutive'} block ids, best "
                f"of {self.args.reps}")
        rows = [{k: v for k, v in r.items() if k != "traceback"} for r in self.results]
        return {"release": self.args.release, "state": self.state, "running": self.running,
                "env": self.env, "args": vars(self.args), "results": self.results,
                "title": head, "table": table(rows, self.args.sizes) if rows else ""}

    def write(self) -> None:
        if not self.args.out:
            return
        with self.lock:
            path = Path(self.args.out)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.doc(), indent=1, default=str))
            os.replace(tmp, path)
