#!/usr/bin/env python3
"""The package's house, drawn from its own imports: rooms, floors, arrows, circles.

* a *room* is a module of ``lmcache_mp`` (a package's ``__init__`` counts when it has
  code beyond imports and a docstring);
* an *arrow* is "module A imports module B" (any import in A's source, at any depth,
  ``TYPE_CHECKING`` ones included; relative imports resolved; one arrow per pair);
* a *circle* is a set of rooms that import each other (a strongly connected component
  of more than one room);
* *floors*: with every circle taken as one room, a room's floor is one above the highest
  floor it imports (floor 1 imports nothing of the package); the count is the highest;
* an arrow *runs back up* when it points to a room on the same floor or above: only
  arrows inside circles can.

    python tools/house.py [--root DIR] [--json]      (DIR: a checkout, default this one)
    git worktree add /tmp/old <commit> && python tools/house.py --root /tmp/old
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

PKG = "lmcache_mp"


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((root / PKG).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def is_room(name: str, path: Path) -> bool:
    """Every module but a package ``__init__`` that only imports (re-exports)."""
    if path.name != "__init__.py":
        return True
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))
            and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
            and not (isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))]
    return bool(body)


def imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    def land(target: str) -> str | None:
        while target:
            if target in mods:
                return target
            target = target.rpartition(".")[0]
        return None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = land(alias.name)
                if hit:
                    out.add(hit)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith(PKG):
                continue
            for alias in node.names:
                hit = land(f"{mod}.{alias.name}") if f"{mod}.{alias.name}" in mods else land(mod)
                if hit:
                    out.add(hit)
    out.discard(name)
    return out


def components(succ: Mapping[str, Iterable[str]]) -> list[set[str]]:
    """The strongly connected components of a graph (Tarjan), every node in one; a
    component of more than one node is an import circle. tests/test_layers.py uses it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            found.append(component)

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return found


def house(root: Path) -> dict[str, object]:
    mods = modules(root)
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    # Re-exporting __init__ files are passages, not rooms: an arrow through one goes on
    # to what it imports.
    rooms = {m for m, p in mods.items() if is_room(m, p)}

    def through(m: str, seen: frozenset[str] = frozenset()) -> set[str]:
        if m in rooms:
            return {m}
        out: set[str] = set()
        for n in graph[m] - seen:
            out |= through(n, seen | {m})
        return out

    arrows = {(a, b) for a in rooms for t in graph[a] for b in through(t) if b != a}
    succ = {r: {b for a, b in arrows if a == r} for r in rooms}
    comps = components(succ)
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    floor: dict[int, int] = {}

    def floor_of(c: int) -> int:
        if c not in floor:
            below = {comp_of[b] for m in comps[c] for b in succ[m]} - {c}
            floor[c] = 1 + max((floor_of(d) for d in below), default=0)
        return floor[c]

    floors = {m: floor_of(comp_of[m]) for m in rooms}
    back_up = sorted((a, b) for a, b in arrows if floors[b] >= floors[a])
    circles = [sorted(c) for c in comps if len(c) > 1]
    return {"rooms": len(rooms), "floors": max(floors.values()), "arrows": len(arrows),
            "arrows_back_up": len(back_up), "circles": len(circles),
            "circle_rooms": circles, "back_up": back_up,
            "folders": sorted({m.rpartition(".")[0] for m in rooms if m.count(".") > 1})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    h = house(args.root)
    if args.json:
        print(json.dumps(h, indent=1))
        return 0
    print(f"{h['rooms']} rooms on {h['floors']} floors, {h['arrows']} arrows, "
          f"{h['arrows_back_up']} running back up, {h['circles']} circles")
    for c in h["circle_rooms"]:  # type: ignore[attr-defined]
        print("  circle:", " <-> ".join(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
