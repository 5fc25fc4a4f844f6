"""The layers import one way: kernels <- codec <- cache <- loaders, and the library never imports the repository's
scripts, examples or tests. Checked on the source with ``ast``, so imports inside functions and under
``if TYPE_CHECKING:`` count too (a lazy import is still an arrow)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ibpcache"

# layer of each top-level part of the package; a module may import its own layer or a lower one
_LAYER_OF = {
    "errors": 0, "kernels": 1,
    "_validation": 2, "format": 2, "fit": 2, "codec": 2, "compressed": 2, "datasets": 2, "_shm": 2, "exponent": 2,
    "cache": 3,
    "loaders": 4,
    "testing": 5, "__main__": 5, "__init__": 5,
}
_LAYER_NAMES = {0: "errors", 1: "kernels", 2: "codec", 3: "cache", 4: "loaders", 5: "top"}
_FOREIGN = ("scripts", "examples", "tests", "conftest")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, module: "str | None" = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, wherever it sits (``module``: its dotted name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = (module or _module_name(path)).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if node.module is None or node.level:  # `from . import x` may name submodules
                found += [(node.lineno, f"{mod}.{alias.name}") for alias in node.names]
            if node.module is not None:  # `from . import x` imports x, not its package's own names
                found.append((node.lineno, mod))
    return found


def _part(module: str) -> "str | None":
    parts = module.split(".")
    if parts[0] != "ibpcache":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _sources() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_part_has_a_layer() -> None:
    parts = {_part(_module_name(p)) for p in _sources()}
    assert parts <= set(_LAYER_OF), f"parts of ibpcache with no layer in this test: {parts - set(_LAYER_OF)}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PKG.parent)))
def test_imports_run_down_the_layers(path: Path) -> None:
    here = _part(_module_name(path))
    assert here is not None
    bad = []
    for line, mod in _imports(path):
        top = mod.split(".")[0]
        if top in _FOREIGN:
            bad.append(f"line {line}: imports {mod} (the library never imports scripts/examples/tests)")
            continue
        there = _part(mod)
        if there is None:
            continue
        if _LAYER_OF.get(there, 99) > _LAYER_OF[here]:
            bad.append(f"line {line}: {_LAYER_NAMES[_LAYER_OF[here]]} layer imports {mod} "
                       f"({_LAYER_NAMES.get(_LAYER_OF.get(there, 5), there)} layer)")
    assert not bad, f"{path.relative_to(PKG.parent)}:\n" + "\n".join(bad)


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """The parser must find imports inside functions and TYPE_CHECKING blocks, or the test above proves nothing."""
    src = tmp_path / "probe.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..codec import Codec\n"
                   "def f():\n    from ..cache import entry\n    import scripts.x\n")
    mods = [m for _, m in _imports(src, "ibpcache.kernels.probe")]
    assert "ibpcache.codec" in mods and "ibpcache.cache" in mods and "scripts.x" in mods


# ---------------------------------------------------------------------------------------------------------------
# No import cycles, and adapters use the engine, never the kernels

# Each entry: a cycle (its set of modules) that is known and accepted for now, with the reason it is still there.
_ALLOWED_CYCLES: list[set[str]] = []

# Loaders that still import ibpcache.kernels, with the reason.
_LOADERS_ALLOWED_KERNELS: set[str] = set()


def _known_modules() -> set[str]:
    return {_module_name(p) for p in _sources()}


def _resolve(name: str, known: set[str]) -> "str | None":
    """The module ``name`` refers to: itself, or the longest known module it starts with (``mod.Class`` -> mod)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in known:
            return cand
    return None


def _module_edges(path: Path, known: set[str], module: "str | None" = None) -> set[str]:
    """The ibpcache modules that ``path`` imports, wherever the import sits: ``from pkg import sub`` is an arrow to
    the submodule ``pkg.sub`` when that is a module, to ``pkg`` otherwise (a name defined in its ``__init__``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = (module or _module_name(path)).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {m for m in (_resolve(a.name, known) for a in node.names) if m}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else _resolve(base, known)
                if target:
                    out.add(target)
    return out


def _cycles(graph: "dict[str, set[str]]") -> list[set[str]]:
    """Every import cycle: the strongly connected components with more than one module, or a module importing
    itself (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.add(m)
                    if m == node:
                        break
                if len(comp) > 1 or node in graph.get(node, ()):
                    found.append(comp)
    return found


def _cycle_path(graph: "dict[str, set[str]]", comp: set[str]) -> list[str]:
    """One concrete cycle through the component, for the failure message: a -> b -> ... -> a."""
    start = min(comp)
    prev: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph.get(node, set()) & comp):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start] if node != start else [start, start]
            if nxt not in prev:
                prev[nxt] = node
                todo.append(nxt)
    return sorted(comp)


def _import_graph() -> "dict[str, set[str]]":
    """module -> the ibpcache modules it imports (a package's ``__init__`` is the module named like the package)."""
    known = _known_modules()
    return {_module_name(p): _module_edges(p, known) - {_module_name(p)} for p in _sources()}


def test_no_import_cycles() -> None:
    """No module imports, directly or through others, one that imports it back (lazy and TYPE_CHECKING imports
    count: a cycle made lazy is still two modules that cannot be understood, tested or moved apart)."""
    graph = _import_graph()
    cycles = _cycles(graph)
    bad = [c for c in cycles if c not in _ALLOWED_CYCLES]
    assert not bad, "import cycles:\n" + "\n".join(" -> ".join(_cycle_path(graph, c)) for c in bad)


def test_allowed_cycles_still_exist() -> None:
    """An allow-list entry whose cycle is gone must be deleted, so the list only ever shrinks."""
    cycles = _cycles(_import_graph())
    stale = [c for c in _ALLOWED_CYCLES if c not in cycles]
    assert not stale, f"these allowed cycles no longer exist; remove them from _ALLOWED_CYCLES: {stale}"


def test_loaders_never_import_kernels() -> None:
    """Adapters translate a framework's API into the engine's (ibpcache.cache); kernels and their launch arguments
    (the byte layouts of ``ibpcache.format``) are the engine's business."""
    known = _known_modules()
    bad = []
    for path in _sources():
        rel = str(path.relative_to(PKG.parent))
        if _part(_module_name(path)) != "loaders" or rel in _LOADERS_ALLOWED_KERNELS:
            continue
        kernels = sorted(m for m in _module_edges(path, known) if _part(m) in ("kernels", "format"))
        if kernels:
            bad.append(f"{rel} imports {', '.join(kernels)}")
    assert not bad, "loaders must use the engine, not the kernels:\n" + "\n".join(bad)
    for rel in _LOADERS_ALLOWED_KERNELS:  # an allowance nobody needs any more goes
        edges = _module_edges(PKG.parent / rel, known)
        assert any(_part(m) == "kernels" for m in edges), f"{rel} no longer imports kernels: drop its allowance"


def test_the_cycle_and_kernel_checks_can_fail(tmp_path: Path) -> None:
    """The checks above see a two-module cycle, a longer one, a self-import, and a lazy import of the kernels."""
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"e"}, "e": {"f"}, "f": {"d"}, "g": {"g"}}
    assert sorted(sorted(c) for c in _cycles(graph)) == [["a", "b"], ["d", "e", "f"], ["g"]]
    assert _cycle_path(graph, {"d", "e", "f"}) == ["d", "e", "f", "d"]
    src = tmp_path / "probe.py"
    src.write_text("def f():\n    from ..kernels import layout\n    from ..cache.kv_manager import KVOffloadManager\n")
    edges = _module_edges(src, _known_modules(), "ibpcache.loaders.probe")
    assert edges == {"ibpcache.kernels.layout", "ibpcache.cache.kv_manager"}


@pytest.mark.parametrize("path", sorted((PKG / "cache").glob("plan_*.py")), ids=lambda p: p.name)
def test_planners_import_no_store(path: Path) -> None:
    """The planners decide for the stores and caches (which import them); a planner importing a store back would
    make a cycle (the host store imports the layout and transfer planners at module level)."""
    engine = {mod for _, mod in _imports(path) if mod.startswith("ibpcache.cache.")}
    stores = sorted(mod for mod in engine if not mod.startswith("ibpcache.cache._plan_timing"))
    assert not stores, f"{path.name} imports {stores}"
