"""The layers hold: who may import whom, read from the source with ``ast``.

The graph has one node per module of ``lmcache_mp`` and one arrow per import in its
source: ``import x`` and ``from .x import y`` alike, relative imports resolved (``from
.x import y`` points at module ``x.y`` when that is a module, else at ``x``), at any
depth: imports inside functions and under ``if TYPE_CHECKING:`` count too, since a
module that needs another only to type-check still knows about it. Importing a
submodule also runs its parent package's ``__init__``; that implicit arrow is not
drawn (every module would then depend on ``lmcache_mp/__init__``, the public API).

The rules (issue 21):

* ``transport/`` imports nothing from ``protocol/``, ``ipc/``, the session modules or
  the layers above them (it sends frames and knows no operation or memory);
* ``ipc/`` never imports ``protocol/``, ``transport/``, the session modules or above;
* ``protocol/`` imports none of those either, nor ``zmq``, ``threading`` or ``socket``
  (it is sans-I/O);
* no import circles among the modules, but the ones listed in :data:`KNOWN_CIRCLES`.

Each layer rule follows arrows transitively: a module the layer imports (``errors``,
``checks``, ``layer_exports``, ...) must keep the rule as well, and a failure names the
whole chain.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = "lmcache_mp"

#: The session layer: the ``session/`` package, and the client built on it.
SESSION_PACKAGES = (f"{PKG}.session", f"{PKG}.client")
# Above the session: the command line and the integrations (vLLM), packages.
CLI = f"{PKG}.cli"
INTEGRATIONS = f"{PKG}.integrations"

#: Import circles that remain, each with why and what removes it. The test fails when
#: one grows, changes or disappears (then delete it here).
KNOWN_CIRCLES: dict[frozenset[str], str] = {
    frozenset({f"{PKG}.session.registration", f"{PKG}.session.request",
               f"{PKG}.session.transfers"}):
        "type-checking back-references: transfers.py is Registration's body in another "
        "file; issue 21 splits the session by who owns the state",
}


# -------------------------------------------------------------------- the graph
def modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the package."""
    found = {}
    for path in sorted((REPO / PKG).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()
SESSION = frozenset(m for m in MODULES
                    if any(m == p or m.startswith(p + ".") for p in SESSION_PACKAGES))
ABOVE = frozenset(m for m in MODULES if m == CLI or m.startswith(CLI + "."))


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _in_package(name: str) -> str | None:
    """The module ``name`` lands in: itself, or its longest prefix that is a module of
    the package (``import lmcache_mp.ipc.base.x`` -> ``lmcache_mp.ipc.base``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _origin(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` reads from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(modules of the package, top-level names of other packages) that ``module``
    imports."""
    path = MODULES[module]
    inside: set[str] = set()
    outside: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            origin = _origin(module, node)
            # ``from pkg import sub`` imports the submodule ``sub`` when there is one.
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in MODULES
                       else origin for alias in node.names]
        for target in targets:
            own = _in_package(target) if target.split(".")[0] == PKG else None
            if own is not None:
                if own != module:
                    inside.add(own)
            elif target.split(".")[0] != PKG:
                outside.add(target.split(".")[0])
    return inside, outside


GRAPH = {m: imports_of(m) for m in MODULES}


def chains(start: str) -> Iterator[list[str]]:
    """Every module reachable from ``start``, with the import chain that reaches it
    (breadth first: the shortest chain)."""
    seen = {start}
    queue = [[start]]
    while queue:
        chain = queue.pop(0)
        yield chain
        for nxt in sorted(GRAPH[chain[-1]][0]):
            if nxt not in seen:
                seen.add(nxt)
                queue.append([*chain, nxt])


def under(package: str) -> list[str]:
    return [m for m in MODULES if m == package or m.startswith(package + ".")]


def in_any(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def violations(layer: str, forbidden_packages: Iterable[str],
               forbidden_external: Iterable[str] = ()) -> list[str]:
    """What ``layer``'s modules reach that they must not, one line per chain."""
    packages = list(forbidden_packages)

    def forbidden(module: str) -> bool:
        return module in SESSION or module in ABOVE or in_any(module, packages)

    # The offending arrow -> the shortest chain from the layer that takes it.
    found: dict[tuple[str, str], list[str]] = {}
    for module in under(layer):
        for chain in chains(module):
            if any(forbidden(m) for m in chain[1:-1]):
                continue  # reported where the chain first enters forbidden ground
            *before, last = chain
            if before and forbidden(last):
                arrows = [(before, last)]
            else:
                arrows = [(chain, ext) for ext in sorted(set(forbidden_external) & GRAPH[last][1])]
            for path, target in arrows:
                full = [*path, target]
                arrow = (path[-1], target)
                if arrow not in found or len(full) < len(found[arrow]):
                    found[arrow] = full
    return [f"{a} imports {b}" + (f" (via {' -> '.join(c[:-1])})" if len(c) > 2 else "")
            for (a, b), c in sorted(found.items())]


def _dump(lines: list[str]) -> str:
    return "\n  " + "\n  ".join(lines)


# -------------------------------------------------------------------- the rules
def test_the_graph_sees_the_package() -> None:
    # Guards the parser itself: arrows known to exist are found.
    assert f"{PKG}.transport.core" in GRAPH[f"{PKG}.transport"][0]
    assert f"{PKG}.transport.pending" in GRAPH[f"{PKG}.transport.core"][0]
    assert "zmq" in GRAPH[f"{PKG}.transport.core"][1]
    assert f"{PKG}.protocol.v0_5_3" in GRAPH[f"{PKG}.protocol"][0]  # from . import v0_5_3
    assert f"{PKG}.transport" in GRAPH[f"{PKG}.session.connection"][0]
    # under TYPE_CHECKING:
    assert f"{PKG}.session.registration" in GRAPH[f"{PKG}.session.transfers"][0]
    assert f"{PKG}.protocol.pickles.emitter" in GRAPH[f"{PKG}.protocol.wrappers"][0]  # in a function


def test_transport_knows_no_protocol_memory_or_session() -> None:
    bad = violations(f"{PKG}.transport", [f"{PKG}.protocol", f"{PKG}.ipc", INTEGRATIONS])
    assert not bad, "transport/ imports what it must not:" + _dump(bad)


def test_ipc_knows_no_protocol_transport_or_session() -> None:
    bad = violations(f"{PKG}.ipc", [f"{PKG}.protocol", f"{PKG}.transport", INTEGRATIONS])
    assert not bad, "ipc/ imports what it must not:" + _dump(bad)


def test_protocol_is_sans_io_and_knows_no_memory_transport_or_session() -> None:
    bad = violations(f"{PKG}.protocol", [f"{PKG}.ipc", f"{PKG}.transport", INTEGRATIONS],
                     forbidden_external=("zmq", "threading", "socket"))
    assert not bad, "protocol/ imports what it must not:" + _dump(bad)


def circles() -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v][0]):
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
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def _arrows(circle: frozenset[str]) -> list[str]:
    return sorted(f"{a} imports {b}" for a in circle for b in GRAPH[a][0] & circle)


def test_no_import_circles_but_the_known_ones() -> None:
    found = circles()
    new = [c for c in found if c not in KNOWN_CIRCLES]
    assert not new, "import circles:" + _dump([a for c in new for a in [*_arrows(c), ""]])
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"these circles are gone: delete them from KNOWN_CIRCLES: {gone}"


def test_transport_shares_no_private_names() -> None:
    """transport/'s modules each own their state: no underscore name is imported into
    or out of one of them, and none finds a module through ``sys.modules``."""
    transport = f"{PKG}.transport"
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            origin = _in_package(_origin(module, node)) or ""
            private = [a.name for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__")]
            if private and (in_any(module, [transport]) or in_any(origin, [transport])):
                bad.append(f"{module} imports {private} from {origin} (line {node.lineno})")
        if in_any(module, [transport]):
            bad += [f"{module} looks up sys.modules (line {n.lineno})" for n in ast.walk(tree)
                    if isinstance(n, ast.Attribute) and n.attr == "modules"
                    and isinstance(n.value, ast.Name) and n.value.id == "sys"]
    assert not bad, "private names cross transport/'s modules:" + _dump(bad)
