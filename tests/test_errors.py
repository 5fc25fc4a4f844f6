"""The error family: every class is an ``IbpcacheError`` and the built-in a caller would catch; the package raises
no bare built-in for bad input (checked on the source with ``ast``); budgets and fractions are unambiguous."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ibpcache
from ibpcache import errors
from ibpcache._validation import check_budget, check_fraction, resolve_budget

PACKAGE = Path(ibpcache.__file__).resolve().parent

BARE = {"ValueError", "TypeError", "RuntimeError", "IndexError", "KeyError", "NotImplementedError"}
"""Built-ins that bad input must not raise bare: each has a home in ``ibpcache.errors``."""

JIT_DECORATORS = {"njit", "jit"}
"""Numba decorators (``@numba.njit``, ``@nb.njit(...)``, ``@jit``): compiled code can raise only built-in exceptions,
so a jitted function may raise them bare; its Python caller turns a failure into the family member."""

BUILTIN_OF = {
    "FormatError": ValueError, "CapacityError": ValueError, "InvalidArgumentError": ValueError,
    "ConfigError": ValueError, "InvalidTypeError": TypeError, "InvalidIdsError": IndexError,
    "StateError": RuntimeError, "UnsupportedError": NotImplementedError, "DeviceError": RuntimeError,
    "KernelBuildError": RuntimeError, "InternalError": RuntimeError,
}


def _is_jitted(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for deco in fn.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name in JIT_DECORATORS:
            return True
    return False


def _raises_outside_jit(node: ast.AST) -> list[ast.Raise]:
    """Every ``raise`` under ``node``, not descending into Numba-jitted functions."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_jitted(child):
            continue
        if isinstance(child, ast.Raise):
            found.append(child)
        found.extend(_raises_outside_jit(child))
    return found


def bare_raises(path: Path, root: Path = PACKAGE) -> list[str]:
    """``file:line: raise X`` for every ``raise X(...)`` / ``raise X`` of a bare built-in in ``BARE``, outside
    functions decorated with Numba's ``njit``/``jit`` (see ``JIT_DECORATORS``)."""
    found = []
    for node in _raises_outside_jit(ast.parse(path.read_text(), filename=str(path))):
        if node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(target, ast.Name) and target.id in BARE:
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno}: raise {target.id}"))
    return [hit for _, hit in sorted(found)]


def test_the_guard_sees_bare_raises(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    if x:\n        raise ValueError('x')\n    raise KeyError\n\n\n"
                   "class C:\n    def g(self):\n        raise NotImplementedError('g')\n")
    assert bare_raises(bad, tmp_path) == ["bad.py:3: raise ValueError", "bad.py:4: raise KeyError",
                                          "bad.py:9: raise NotImplementedError"]
    ok = tmp_path / "ok.py"
    ok.write_text("from .errors import InvalidArgumentError\n\n\ndef f():\n    raise InvalidArgumentError('x')\n"
                  "\n\ndef g():\n    try:\n        f()\n    except ValueError:\n        raise\n")
    assert bare_raises(ok, tmp_path) == []


def test_the_guard_skips_only_jitted_functions(tmp_path: Path) -> None:
    """Numba-compiled code raises built-ins (it cannot raise ours); a plain function beside it, or one with another
    decorator, is still checked."""
    probe = tmp_path / "probe.py"
    probe.write_text("import numba\nimport numba as nb\nfrom numba import njit\nimport functools\n\n\n"
                     "@numba.njit(cache=True)\ndef a(x):\n    raise ValueError('a')\n\n\n"
                     "@nb.njit\ndef b(x):\n    raise IndexError('b')\n\n\n"
                     "@njit(parallel=True)\ndef c(x):\n    raise RuntimeError('c')\n\n\n"
                     "@functools.cache\ndef d(x):\n    raise TypeError('d')\n\n\n"
                     "def e(x):\n    raise RuntimeError('e')\n")
    assert bare_raises(probe, tmp_path) == ["probe.py:24: raise TypeError", "probe.py:28: raise RuntimeError"]


def test_package_raises_no_bare_builtins() -> None:
    """Every ``raise`` of ``ibpcache/`` (``testing/`` and ``__main__`` included) names a family class, except inside
    Numba-jitted functions (``njit``/``jit``), which can only raise built-ins; no protocol needs a bare one today."""
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in bare_raises(path)]
    assert found == [], "\n".join(found)


# ------------------------------------------------------------------------------------------------------------
# the family


def _family() -> list[type]:
    return [getattr(errors, name) for name in errors.__all__]


def test_every_exported_class_is_an_ibpcache_error_and_a_builtin() -> None:
    for cls in _family():
        assert issubclass(cls, errors.IbpcacheError), cls
        assert cls.__doc__ and len(cls.__doc__.split()) >= 6, f"{cls.__name__} needs a docstring saying when"
        if cls is not errors.IbpcacheError:
            builtins = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException,
                                                                                             object)]
            assert builtins, f"{cls.__name__} must also subclass the built-in a caller would catch"
        assert getattr(ibpcache, cls.__name__) is cls  # re-exported by the package


@pytest.mark.parametrize("name, builtin", sorted(BUILTIN_OF.items()))
def test_catchable_as_the_family_and_the_builtin(name: str, builtin: type) -> None:
    cls = getattr(errors, name)
    for catch in (errors.IbpcacheError, builtin):
        with pytest.raises(catch, match="the message"):
            raise cls("the message")


def test_config_error_is_an_invalid_argument() -> None:
    assert issubclass(errors.ConfigError, errors.InvalidArgumentError)


def test_every_module_defined_error_is_exported() -> None:
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.IbpcacheError)}
    assert defined == set(errors.__all__)


# ------------------------------------------------------------------------------------------------------------
# budgets: a float is a fraction, an int is bytes, and a budget must hold a row

TOTAL, ROW = 2708 * 5732, 5732  # Cora's float32 features


@pytest.mark.parametrize("bad", [0, -1, -(2**40), 0.0, -0.5, 1.0000001, 2.0, float("nan"), float("inf")])
def test_budget_values_outside_both_readings_raise(bad: object) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=f"budget_bytes={bad!r}"):
        check_budget(bad)


@pytest.mark.parametrize("bad", [True, False, "0.01", None, [0.1], 1 + 0j])
def test_budget_of_a_wrong_type_raises(bad: object) -> None:
    with pytest.raises(errors.InvalidTypeError, match="budget_bytes: expected a float fraction"):
        check_budget(bad)


def test_budget_keeps_numpy_scalars_and_their_kind() -> None:
    np = pytest.importorskip("numpy")
    assert check_budget(np.int64(4096)) == 4096 and isinstance(check_budget(np.int64(4096)), int)
    assert check_budget(np.float32(0.5)) == 0.5 and isinstance(check_budget(np.float32(0.5)), float)
    with pytest.raises(errors.InvalidTypeError):
        check_budget(np.bool_(True))
    with pytest.raises(errors.InvalidArgumentError, match=r"^budget_bytes=0: an int budget"):
        check_budget(np.int64(0))
    with pytest.raises(errors.CapacityError, match=r"^budget_bytes=3 \(an int budget"):
        resolve_budget(np.int32(3), TOTAL, ROW, align=16)


def test_one_is_a_byte_and_one_point_zero_the_whole_table() -> None:
    assert resolve_budget(1.0, TOTAL, ROW, align=16) == TOTAL
    with pytest.raises(errors.CapacityError, match=r"budget_bytes=1 \(an int budget is a byte count\): too small "
                                                   r"to cache one row; the smallest valid budget is 5744 bytes"):
        resolve_budget(1, TOTAL, ROW, align=16)


@given(st.integers(min_value=1, max_value=10**12))
def test_int_budgets_are_bytes_and_the_row_bound_is_exact(nbytes: int) -> None:
    if nbytes >= 5744:  # 5732-byte rows in 16-byte units
        assert resolve_budget(nbytes, TOTAL, ROW, align=16) == nbytes
    else:
        with pytest.raises(errors.CapacityError, match=f"budget_bytes={nbytes} "):
            resolve_budget(nbytes, TOTAL, ROW, align=16)


@given(st.integers(min_value=1, max_value=2**20), st.integers(min_value=1, max_value=10**6),
       st.sampled_from([1, 8, 16]))
def test_named_smallest_budget_and_fraction_are_valid(row: int, n_rows: int, align: int) -> None:
    """The error's suggested budgets (bytes and fraction) are accepted; one byte less is not."""
    total = row * n_rows
    with pytest.raises(errors.CapacityError) as info:
        resolve_budget(1e-300, total, row, align=align)
    msg = str(info.value)
    smallest = int(msg.split("smallest valid budget is ")[1].split(" ")[0])
    assert smallest == math.ceil(row / align) * align
    assert resolve_budget(smallest, total, row, align=align) == smallest
    if smallest > 1:
        with pytest.raises(errors.CapacityError):
            resolve_budget(smallest - 1, total, row, align=align)
    if "fraction >= " in msg:
        frac = float(msg.split("fraction >= ")[1].split(" ")[0])
        assert resolve_budget(frac, total, row, align=align) >= smallest
        assert frac <= 1.0
    else:
        assert smallest > total and "no fraction" in msg


@given(st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
def test_fraction_budgets_scale_the_table(frac: float) -> None:
    if int(frac * TOTAL) >= 5744:
        assert resolve_budget(frac, TOTAL, ROW, align=16) == int(frac * TOTAL)
    else:
        with pytest.raises(errors.CapacityError, match=r"too small to cache one row"):
            resolve_budget(frac, TOTAL, ROW, align=16)


@pytest.mark.parametrize("ok", [1, 1.0, 0.5, 1e-9])
def test_fraction_accepts_ratios(ok: float) -> None:
    assert check_fraction(ok, "cache_ratio") == float(ok)


@pytest.mark.parametrize("bad, err", [(0, errors.InvalidArgumentError), (0.0, errors.InvalidArgumentError),
                                      (1.5, errors.InvalidArgumentError), (float("nan"), errors.InvalidArgumentError),
                                      (True, errors.InvalidTypeError), ("0.5", errors.InvalidTypeError),
                                      (None, errors.InvalidTypeError)])
def test_fraction_refuses_the_rest(bad: object, err: type) -> None:
    with pytest.raises(err, match="cache_ratio"):
        check_fraction(bad, "cache_ratio")


@pytest.mark.parametrize("bad, err", [(True, errors.InvalidTypeError), ("0.5", errors.InvalidTypeError),
                                      (float("nan"), errors.InvalidArgumentError), (2, errors.InvalidArgumentError)])
def test_embedding_bag_cache_ratio_is_validated_before_any_work(bad: object, err: type) -> None:
    """``cache_ratio`` keeps Colossal-AI's meaning (a fraction of the rows, at least one row) and is checked first."""
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    with pytest.raises(err, match="cache_ratio"):
        CachedEmbeddingBag(100, 8, cache_ratio=bad, device="cpu")


def test_device_names_are_checked() -> None:
    from ibpcache._validation import resolve_device

    with pytest.raises(errors.InvalidArgumentError, match="'gpu'"):
        resolve_device("gpu")
    with pytest.raises(errors.InvalidArgumentError, match="'mps'"):
        resolve_device("mps")
