#!/usr/bin/env python3
"""Score per module of the last `make mutate` run (mutmut 3 results under mutants/).

    .venv/bin/python tools/mutation_report.py [--survivors] [--json FILE] [--dir mutants]

Score = killed / (killed + survived): mutants that time out count as killed (the suite
noticed), mutants no offline test reaches ("no tests") are listed apart, since they
measure coverage rather than the tests' assertions.

Survivors are sorted into three kinds (``--survivors`` lists them):

* ``import-time``: mutants of code that runs once, at import or first use behind a
  cache, before mutmut forks its workers (the op tables of ``core_operations``, the
  ``__post_init__`` of Operation / Payload, the validator factory, the template
  reader). mutmut 3 switches mutants at call time inside the forked worker, so these
  can never be active, whatever the tests; they are reported apart and not scored.
  Their effect is pinned by the byte fixtures (every op id, payload and reply schema).
* ``message``: only the text of an error, warning or log message changed.
* ``review``: everything else: a missed behaviour, or an equivalent mutant.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections import Counter, defaultdict
from functools import cache
from pathlib import Path

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          37: "type check", -11: "segfault", -9: "segfault", None: "not checked"}
# lmcache_mp.x.y.x_func__mutmut_3 or lmcache_mp.x.y.xǁClassǁmethod__mutmut_3
_NAME = re.compile(r"^(?P<module>[\w.]+?)\.x(?:_|ǁ)(?P<func>.+)__mutmut_\d+$")


# Functions that only run before mutmut forks its workers (see the module docstring).
IMPORT_TIME = {
    "lmcache_mp.protocol.core_ops.x_core_operations",
    "lmcache_mp.protocol.operations.xǁOperationǁ__post_init__",
    "lmcache_mp.protocol.operations.xǁPayloadǁ__post_init__",
    "lmcache_mp.protocol.operations.x__make_validator",
    "lmcache_mp.protocol.pickles.templates.x__template_text",  # behind load_template's cache
}
# Calls whose string arguments are only message text.
MESSAGE_CALLS = {
    "InvalidArgument", "ProtocolMismatch", "RequestTimeout", "ServerUnavailable",
    "ConnectionChanged", "LMCacheMPError", "ValueError", "TypeError", "RuntimeError",
    "KeyError", "AssertionError", "_fail", "_template_error", "warning", "info", "debug",
    "error", "warn", "remaining", "_as_int", "_as_bytes", "_as_str", "_as_int_tuple",
    "_base_only",
}


@cache
def _functions(path: Path) -> dict[str, tuple[ast.AST, dict[ast.AST, ast.AST]]]:
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return {node.name: (node, parents) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def _in_message(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in MESSAGE_CALLS:
                return True
    return False


def kind(root: Path, module: str, name: str) -> str:
    if re.sub(r"__mutmut_\d+$", "", name) in IMPORT_TIME:
        return "import-time"
    path = root / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = root / module.replace(".", "/") / "__init__.py"
    funcs = _functions(path)
    short = name[len(module) + 1:]
    orig = re.sub(r"__mutmut_\d+$", "__mutmut_orig", short)
    if short not in funcs or orig not in funcs:
        return "review"
    (mut, parents), (base, _) = funcs[short], funcs[orig]

    points = _diff_points(base, mut)
    if points and all(_message_only(pt, mut, parents) for pt in points):
        return "message"
    return "review"


def _diff_points(a: ast.AST, b: ast.AST) -> list[ast.AST]:
    """The outermost nodes of ``b`` (the mutant) that differ from ``a`` (the original);
    the function names themselves differ by construction and are ignored."""
    if type(a) is not type(b):
        return [b]
    out: list[ast.AST] = []
    for field, va in ast.iter_fields(a):
        vb = getattr(b, field, None)
        if field == "name" and isinstance(a, ast.FunctionDef):
            continue
        if isinstance(va, ast.AST) and isinstance(vb, ast.AST):
            out += _diff_points(va, vb)
        elif isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
            for x, y in zip(va, vb, strict=True):
                if isinstance(x, ast.AST) and isinstance(y, ast.AST):
                    out += _diff_points(x, y)
                elif x != y:
                    return [b]
        elif va != vb:
            return [b]
    return out


def _message_only(point: ast.AST, func: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """The change lies inside message text: an exception / warning / log argument, or
    a local assigned only to be used in such text."""
    if _in_message(point, parents):
        return True
    node = point
    while node in parents and node is not func:
        node = parents[node]
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            var = node.targets[0].id
            uses = [n for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == var
                    and isinstance(n.ctx, ast.Load)]
            return bool(uses) and all(_in_message(u, parents) for u in uses)
    return False


def collect(root: Path) -> dict[str, list[tuple[str, str]]]:
    by_module: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for meta in sorted(root.rglob("*.meta")):
        data = json.loads(meta.read_text())
        for name, code in data.get("exit_code_by_key", {}).items():
            m = _NAME.match(name)
            module = m.group("module") if m else name.rsplit(".", 1)[0]
            by_module[module].append((name, STATUS.get(code, "suspicious")))
    return by_module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="mutants")
    ap.add_argument("--survivors", action="store_true", help="list each surviving mutant")
    ap.add_argument("--json", help="also write the table as JSON")
    ap.add_argument("--reap-shm", metavar="STAMP",
                    help="first remove the SHM segments of mutant workers that mutmut killed "
                         "(lmcache_mp_<pid>_* newer than STAMP whose process is gone)")
    args = ap.parse_args()
    if args.reap_shm:
        reap_shm(Path(args.reap_shm))
    root = Path(args.dir)
    by_module = collect(root)
    for module, entries in by_module.items():
        by_module[module] = [(n, kind(root, module, n) if st == "survived" else st)
                             for n, st in entries]
    rows = []
    total: Counter[str] = Counter()
    head = f"{'module':31} {'mutants':>7} {'killed':>6} {'t/out':>5} {'review':>6} " \
           f"{'message':>7} {'import':>6} {'no test':>7} {'other':>5} {'score':>6}"
    print(head)
    print("-" * len(head))
    for module in sorted(by_module):
        c = Counter(status for _, status in by_module[module])
        total.update(c)
        rows.append(_row(module, c, head))
    print("-" * len(head))
    _row("all", total, head)
    if args.survivors:
        for module in sorted(by_module):
            for name, status in by_module[module]:
                if status in ("review", "message", "import-time"):
                    print(f"survived ({status}): {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def reap_shm(stamp: Path, shm: Path = Path("/dev/shm")) -> None:
    """A worker killed on timeout never runs its finalizers, so the segments of its
    caches and scripted servers stay behind. Only names whose creating process (the pid
    in the name) has exited are removed: unlinking never disturbs a live mapping."""
    since = stamp.stat().st_mtime
    removed = 0
    for entry in shm.glob("lmcache_mp_*"):
        pid = entry.name.split("_")[2]
        try:
            if not pid.isdigit() or Path(f"/proc/{pid}").exists() or entry.stat().st_mtime < since:
                continue
            entry.unlink()
            removed += 1
        except FileNotFoundError:
            continue
    print(f"removed {removed} shared-memory segment(s) left by killed mutant workers")


def _row(module: str, c: Counter[str], head: str) -> dict[str, object]:
    """Print one table row; the score counts message-only survivors as survivors too."""
    detected = c["killed"] + c["timeout"]
    judged = detected + c["review"] + c["message"]
    other = sum(c.values()) - judged - c["import-time"] - c["no tests"]
    score = 100.0 * detected / judged if judged else None
    shown = "    -" if score is None else f"{score:5.1f}%"
    print(f"{module:31} {sum(c.values()):7} {c['killed']:6} {c['timeout']:5} {c['review']:6} "
          f"{c['message']:7} {c['import-time']:6} {c['no tests']:7} {other:5} {shown}")
    return {"module": module, **c, "score": None if score is None else round(score, 1)}


if __name__ == "__main__":
    main()
