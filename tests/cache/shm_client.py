"""A client process for the shared-store tests: attach a store by name and fetch rows from it.

``python shm_client.py NAME fetch SEED OUT``: attach, fetch 2000 random rows (seeded) through a CPU FeatureCache
and through ``gather``, save ids and both results to OUT (.npz), exit 0.
``python shm_client.py NAME loop SEED READY``: attach, touch READY, then fetch forever (the test kills it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch


def main(name: str, mode: str, seed: int, path: str) -> None:
    from ibpcache import CompressedRows, FeatureCache

    rows = CompressedRows.attach(name)
    cache = FeatureCache(rows, budget_bytes=0.05, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    if mode == "fetch":
        ids = torch.randint(0, rows.n_rows, (2000,), generator=gen)
        via_cache = cache.fetch(ids)
        via_gather = rows.gather(ids, device="cpu")
        np.savez(path, ids=ids.numpy(), cache=via_cache.view(torch.uint8).numpy(),
                 gather=via_gather.view(torch.uint8).numpy(), generation=rows.shared.generation)
        return
    Path(path).write_text("attached")
    while True:
        cache.fetch(torch.randint(0, rows.n_rows, (4096,), generator=gen))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
