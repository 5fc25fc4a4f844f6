"""A client or owner process for the shared-store tests.

``python shm_client.py NAME fetch SEED OUT``: attach, fetch 2000 random rows (seeded) through a CPU FeatureCache
and through ``gather``, save ids and both results to OUT (.npz), exit 0.
``python shm_client.py NAME loop SEED READY``: attach, touch READY, then fetch forever (the test kills it).
``python shm_client.py NAME write SEED OUT``: attach, write into every attached tensor, save what this process then
sees to OUT (.npz), check the store is still live, exit 0.
``python shm_client.py NAME own SEED READY``: compress Cora, share it as NAME, touch READY, then sleep until killed.
``python shm_client.py NAME own-exit SEED READY``: the same, but exit normally at once without closing the handle.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch


def _own(name: str, ready: str, stay: bool) -> None:
    from ibpcache import Codec
    from ibpcache.datasets import load_cora

    rows = load_cora().features
    handle = Codec.fit(rows).compress(rows, layout="packed", pin=False).share(name)
    Path(ready).write_text(str(handle.path))
    while stay:
        time.sleep(1)


def _write(name: str, out: str) -> None:
    from ibpcache import CompressedRows

    rows = CompressedRows.attach(name)
    rows.data[0] = 1
    rows.data[-4096:].fill_(0xAB)
    rows.lengths[:3] = 5
    rows.offsets.zero_()
    np.savez(out, data_head=rows.data[:8].numpy(), data_tail=rows.data[-8:].numpy(), lengths=rows.lengths[:3].numpy(),
             private=rows.shared.private)
    rows.check_shared()  # the header page was not written: still the live generation


def main(name: str, mode: str, seed: int, path: str) -> None:
    if mode in ("own", "own-exit"):
        _own(name, path, stay=mode == "own")
        return
    if mode == "write":
        _write(name, path)
        return
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
