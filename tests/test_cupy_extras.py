"""CuPy is an extra per CUDA major ([cuda12] / [cuda13]); a missing or mismatched CuPy fails with the install line."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_cupy_is_not_a_base_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("cupy")]
    extras = project["optional-dependencies"]
    assert [d for d in extras["cuda12"] if d.startswith("cupy-cuda12x")]
    assert [d for d in extras["cuda13"] if d.startswith("cupy-cuda13x")]
    assert [d for d in extras["test"] if d.startswith("matplotlib")]  # tests smoke-run benchmarks that plot


@pytest.mark.parametrize("torch_cuda, extra", [("12.4", "ibpcache[cuda12]"), ("13.0", "ibpcache[cuda13]")])
def test_missing_cupy_names_the_extra(monkeypatch: pytest.MonkeyPatch, torch_cuda: str, extra: str) -> None:
    import torch

    from ibpcache.errors import KernelBuildError
    from ibpcache.kernels import _build

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    _build.import_cupy.cache_clear()
    try:
        with pytest.raises(KernelBuildError, match="not installed.*pip install \"" + re.escape(extra)):
            _build.import_cupy()
    finally:
        _build.import_cupy.cache_clear()


def test_cupy_for_another_cuda_major_is_refused() -> None:
    from ibpcache.errors import KernelBuildError
    from ibpcache.kernels._build import check_cupy_cuda_major

    with pytest.raises(KernelBuildError, match=r"CuPy is built for CUDA 13 but torch for CUDA 12.6.*"
                                               r"cupy-cuda13x && pip install \"ibpcache\[cuda12\]\""):
        check_cupy_cuda_major("12.6", 13)
    check_cupy_cuda_major("13.0", 13)  # same major: fine
    check_cupy_cuda_major(None, 13)  # CPU build of torch: the kernels are never launched
