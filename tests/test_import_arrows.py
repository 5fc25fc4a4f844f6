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


@pytest.mark.parametrize("path", sorted((PKG / "cache").glob("plan_*.py")), ids=lambda p: p.name)
def test_planners_import_no_store(path: Path) -> None:
    """The planners decide for the stores and caches (which import them); a planner importing a store back would
    make a cycle (the host store imports the layout and transfer planners at module level)."""
    engine = {mod for _, mod in _imports(path) if mod.startswith("ibpcache.cache.")}
    stores = sorted(mod for mod in engine if not mod.startswith("ibpcache.cache._plan_timing"))
    assert not stores, f"{path.name} imports {stores}"


@pytest.mark.parametrize("name", ["embedding_bag.py", "pyg.py", "dgl.py"])
def test_adapters_use_the_engine_not_the_kernels(name: str) -> None:
    """An adapter translates its framework's API to the engine (``ibpcache.cache``); kernels and their launch
    arguments are the engine's business."""
    below = sorted({mod for _, mod in _imports(PKG / "loaders" / name)
                    if mod.startswith(("ibpcache.kernels", "ibpcache.format"))})
    assert not below, f"loaders/{name} imports {below} (use what ibpcache.cache offers)"
