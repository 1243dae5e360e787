"""The layers hold: who may import whom, read from the source with ``ast``.

The graph has one node per module of ``lmcache_mp`` and one arrow per import in its
source: ``import x`` and ``from .x import y`` alike, relative imports resolved (``from
.x import y`` points at module ``x.y`` when that is a module, else at ``x``), at any
depth: imports inside functions and under ``if TYPE_CHECKING:`` count too, since a
module that needs another only to type-check still knows about it. Importing a
submodule also runs its parent package's ``__init__``; that implicit arrow is not
drawn (every module would then depend on ``lmcache_mp/__init__``, the public API).

The layers, bottom up: ``protocol/`` (sans-I/O: operations, wire forms, the hasher,
the wrapper pickles), ``ipc/`` (memory) and ``transport/`` (frames over ZMQ) side by
side; the session (``session/`` and ``client.py``) on all three; ``cli/`` and
``integrations/`` above it. The modules at the top level (``errors``, ``checks``,
``keys``, ``layer_exports``) serve every layer. The rules (issue 21):

* ``transport/`` imports nothing from ``protocol/``, ``ipc/``, the session or the
  layers above it (it sends frames and knows no operation or memory);
* ``ipc/`` never imports ``protocol/``, ``transport/``, the session or above;
* ``protocol/`` imports none of those either, nor ``zmq``, ``threading`` or ``socket``
  (it is sans-I/O);
* the session imports neither ``cli/`` nor ``integrations/``;
* no import circles among the modules, but the ones listed in :data:`KNOWN_CIRCLES`;
* no module imports another module's underscore names, and none finds a module of
  the package through ``sys.modules`` (an arrow the imports would not show); only
  :data:`SYS_MODULES_ALLOWED` look there, for other packages.

Each layer rule follows arrows transitively: a module the layer imports (``errors``,
``checks``, ``layer_exports``, ...) must keep the rule as well, and a failure names the
whole chain.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

from tests.support.tool_modules import load_tool

REPO = Path(__file__).resolve().parent.parent
# tools/house.py (not a package): its strongly-connected-components function.
house = load_tool("house", "lmcache_mp_house")
PKG = "lmcache_mp"

PROTOCOL, IPC, TRANSPORT = f"{PKG}.protocol", f"{PKG}.ipc", f"{PKG}.transport"
#: The session layer: the ``session/`` package, and the client built on it.
SESSION = (f"{PKG}.session", f"{PKG}.client")
# Above the session: the command line and the integrations (vLLM), packages.
CLI = f"{PKG}.cli"
INTEGRATIONS = f"{PKG}.integrations"
ABOVE_SESSION = (CLI, INTEGRATIONS)

#: The modules that may read ``sys.modules``, and why: never to find a module of ours.
SYS_MODULES_ALLOWED: dict[str, str] = {
    f"{PKG}.ipc.cuda.export": "default_stream asks whether torch is loaded without "
                              "importing it",
}

#: Import circles that remain, each with why and what removes it. The test fails when
#: one grows, changes or disappears (then delete it here).
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


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
TREES = {m: ast.parse(path.read_text(), str(path)) for m, path in MODULES.items()}


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
    inside: set[str] = set()
    outside: set[str] = set()
    for node in _imports(TREES[module]):
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


def violations(layer: Iterable[str], forbidden_packages: Iterable[str],
               forbidden_external: Iterable[str] = ()) -> list[str]:
    """What the modules of ``layer`` (packages or modules) reach that they must not
    (modules of ``forbidden_packages``, top-level packages ``forbidden_external``), one
    line per chain."""
    packages = list(forbidden_packages)

    def forbidden(module: str) -> bool:
        return in_any(module, packages)

    # The offending arrow -> the shortest chain from the layer that takes it.
    found: dict[tuple[str, str], list[str]] = {}
    for module in (m for package in layer for m in under(package)):
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
    assert f"{PKG}.session.engine_driven" in GRAPH[f"{PKG}.session.binding"][0]
    assert f"{PKG}.protocol.pickles.emitter" in GRAPH[f"{PKG}.protocol.wrappers"][0]  # in a function


def test_every_module_is_in_a_layer_or_serves_them_all() -> None:
    # A new top-level module is a decision: which layer it belongs to, or that every
    # layer may use it (then the layer rules check what it imports, transitively).
    shared = {f"{PKG}.{m}" for m in ("errors", "checks", "keys", "layer_exports",
                                     "hashing", "pickle_emitter")}  # the last two: shims
    layers = [PROTOCOL, IPC, TRANSPORT, *SESSION, *ABOVE_SESSION]
    stray = sorted(m for m in MODULES if m != PKG and m not in shared and not in_any(m, layers))
    assert not stray, f"modules in no layer: {stray}"


def test_transport_knows_no_protocol_memory_or_session() -> None:
    bad = violations([TRANSPORT], [PROTOCOL, IPC, *SESSION, *ABOVE_SESSION])
    assert not bad, "transport/ imports what it must not:" + _dump(bad)


def test_ipc_knows_no_protocol_transport_or_session() -> None:
    bad = violations([IPC], [PROTOCOL, TRANSPORT, *SESSION, *ABOVE_SESSION])
    assert not bad, "ipc/ imports what it must not:" + _dump(bad)


def test_protocol_is_sans_io_and_knows_no_memory_transport_or_session() -> None:
    bad = violations([PROTOCOL], [IPC, TRANSPORT, *SESSION, *ABOVE_SESSION],
                     forbidden_external=("zmq", "threading", "socket"))
    assert not bad, "protocol/ imports what it must not:" + _dump(bad)


def test_session_knows_nothing_above_it() -> None:
    bad = violations(SESSION, ABOVE_SESSION)
    assert not bad, "the session imports what it must not:" + _dump(bad)


def circles() -> list[frozenset[str]]:
    """The strongly connected components of more than one module (tools/house.py's
    Tarjan, over this test's graph)."""
    return [frozenset(c) for c in house.components({m: GRAPH[m][0] for m in GRAPH})
            if len(c) > 1]


def _arrows(circle: frozenset[str]) -> list[str]:
    return sorted(f"{a} imports {b}" for a in circle for b in GRAPH[a][0] & circle)


def test_no_import_circles_but_the_known_ones() -> None:
    found = circles()
    new = [c for c in found if c not in KNOWN_CIRCLES]
    assert not new, "import circles:" + _dump([a for c in new for a in [*_arrows(c), ""]])
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"these circles are gone: delete them from KNOWN_CIRCLES: {gone}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_names() -> None:
    """Each module owns its underscore names: ``from .x import _y`` (or ``import
    lmcache_mp.x._y``) across modules of the package is refused; make the name public,
    or move the code to the module that owns the state."""
    bad = []
    for module, tree in TREES.items():
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom):
                origin = _origin(module, node)
                if _in_package(origin) is None:
                    continue  # another package's names
                private = [a.name for a in node.names if _private(a.name)]
            else:
                private = [a.name for a in node.names if a.name.split(".")[0] == PKG
                           and any(_private(part) for part in a.name.split("."))]
                origin = ""
            if private:
                bad.append(f"{module} imports {private}{f' from {origin}' if origin else ''} "
                           f"(line {node.lineno})")
    assert not bad, "private names cross modules:" + _dump(bad)


def _sys_modules_reads(tree: ast.AST) -> list[int]:
    lines = [n.lineno for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and n.attr == "modules"
             and isinstance(n.value, ast.Name) and n.value.id == "sys"]
    lines += [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              and n.module == "sys" and any(a.name == "modules" for a in n.names)]
    return sorted(lines)


def test_no_module_finds_modules_through_sys_modules() -> None:
    """A module that needs another imports it (lazily, inside a function, if it must):
    a ``sys.modules`` lookup is an arrow the graph cannot see."""
    found = {m: _sys_modules_reads(t) for m, t in TREES.items()}
    bad = [f"{m} reads sys.modules (lines {lines})" for m, lines in sorted(found.items())
           if lines and m not in SYS_MODULES_ALLOWED]
    assert not bad, "sys.modules lookups:" + _dump(bad)
    unused = sorted(m for m in SYS_MODULES_ALLOWED if not found.get(m))
    assert not unused, f"no longer read sys.modules: delete them from SYS_MODULES_ALLOWED: {unused}"


def test_private_attributes_are_written_by_their_class() -> None:
    """``obj._x = ...`` outside a class body is a function that belongs as a method of
    ``obj``'s class: the class that owns the state is the one that changes it."""
    bad = []
    for module, tree in TREES.items():
        in_class: set[ast.AST] = set()
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            in_class.update(ast.walk(cls))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for t in targets:
                if (isinstance(t, ast.Attribute) and _private(t.attr)
                        and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))
                        and node not in in_class):
                    bad.append(f"{module} writes {ast.unparse(t)} (line {node.lineno})")
    assert not bad, "private attributes written from outside their class:" + _dump(bad)
