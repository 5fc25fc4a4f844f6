#!/usr/bin/env python3
"""GraphSAGE (fanout 25,10) on bundled Cora with node features served through DGL's DataLoader by an ibpcache
FeatureCache, side by side with DGL's standard feature path (same seeds, same batches). Prints compression ratio,
cache capacity and hit rate, bytes moved vs raw, epoch time, accuracy and whether the losses equal DGL's bit for
bit. Needs ``pip install -e ".[dgl]"``; uses the GPU when torch sees one. What ``python -m ibpcache`` did before
the main job became library-only.

Config: ``configs/train_sage.yaml`` with the ``dataset``/``cache``/``model`` groups; overrides as usual::

    python examples/train_sage.py
    python examples/train_sage.py dataset=pubmed cache.budget=0.05 epochs=5 cache=all_modes device=cpu
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# cuBLAS reads this when it starts: deterministic GEMMs, so every fetch mode gives identical losses.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples.gnn lives in the repository, not in the installed package
    sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402

from examples.gnn.pipeline import format_report, run  # noqa: E402

__all__ = ["main"]


@hydra.main(config_path=str(ROOT / "configs"), config_name="train_sage", version_base=None)
def main(cfg: Any) -> None:
    records = run(cfg)
    if not all(r.get("identical_losses") for r in records):
        sys.exit(1)


if __name__ == "__main__":
    main()
