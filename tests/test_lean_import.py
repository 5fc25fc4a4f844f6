"""Importing ibpcache must stay cheap and side-effect free: no CuPy, no CUDA context, no kernel or Numba compile,
no heavy framework. A loader that touched CUDA at import would break forked DataLoader workers and CPU-only CI.

Each check runs in a fresh interpreter so modules imported by other tests cannot hide (or fake) a violation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    targets = json.loads(sys.argv[1])
    if targets == ["*"]:  # every public module (private ones may hold lazily imported framework glue)
        import ibpcache
        targets = ["ibpcache"] + [
            m.name for m in pkgutil.walk_packages(ibpcache.__path__, "ibpcache.")
            if not any(part.startswith("_") for part in m.name.split("."))
        ]
    for name in targets:
        importlib.import_module(name)
    import torch
    heavy = ("cupy", "cupyx", "dgl", "transformers", "torch_geometric", "colossalai", "matplotlib", "nvidia.nvcomp",
             "hydra", "omegaconf")
    loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
    compiled = []
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("ibpcache"):
            continue
        for attr_name, attr in list(vars(mod).items()):
            if type(attr).__module__.startswith("numba") and getattr(attr, "signatures", None):
                compiled.append(f"{mod_name}.{attr_name}")
    print(json.dumps({
        "targets": targets,
        "heavy_modules": loaded,
        "cuda_initialized": torch.cuda.is_initialized(),
        "numba_compiled": compiled,
    }))
    """
)


def _probe(targets: list[str]) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(targets)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, f"importing {targets} failed:\n{res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "targets",
    [
        ["ibpcache"],
        ["ibpcache", "ibpcache.cache", "ibpcache.loaders"],
        ["ibpcache.datasets", "ibpcache.testing"],
        ["ibpcache.testing.timing"],
        ["ibpcache.kernels.bitpack", "ibpcache.kernels.tables", "ibpcache.kernels._build"],
        ["ibpcache.loaders.dgl", "ibpcache.loaders.kv", "ibpcache.loaders.embedding_bag"],
        ["*"],
    ],
    ids=["package", "cache+loaders", "datasets+testing", "timing", "kernels", "framework-adapters",
         "every-public-module"],
)
def test_import_is_lean(targets: list[str]) -> None:
    report = _probe(targets)
    assert report["heavy_modules"] == [], f"import pulled in {report['heavy_modules']}"
    assert report["cuda_initialized"] is False, "import initialised CUDA"
    assert report["numba_compiled"] == [], f"import compiled Numba functions {report['numba_compiled']}"
