"""Experiment: why did the KV planner time raw scattered rows at 352.8 ns/row (Llama-8B shape, batch 4, 32k context,
sparse; docs/results/2026-11-26-h200-s28) when batch 16 at 8k had measured 26.9? Hypothesis: the measurement
(``append_store.measure_scattered``, CUDA events on the prefill worker's stream) ran while the model's prefill kept
the GPU busy on other streams, so whichever store it timed during a burst looked slow.

For rows_per_token 32 (batch 4 x 8 KV heads) and 128 (batch 16): ``measure_scattered`` on a 512 MiB store of real
SmolLM2 K rows (bf16, two rows side by side: head dim 128) under the exponent codec, three times with the GPU idle,
then three times while another stream runs back-to-back bf16 matmuls. Prints one JSON line per measurement.

    PYTHONPATH=$PWD python scripts/experiments/kv_scattered_probe.py
"""

from __future__ import annotations

import json
import threading

import torch

from ibpcache import Codec, datasets
from ibpcache.cache.append_store import measure_scattered


def busy(stop: threading.Event, dev: torch.device) -> None:
    """Back-to-back 8192^2 bf16 matmuls on a stream of their own until ``stop``."""
    s = torch.cuda.Stream(dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    with torch.cuda.stream(s):
        while not stop.is_set():
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            s.synchronize()


def main() -> None:
    dev = torch.device("cuda")
    k = datasets.load_kv("code", "k", "bf16")
    half = k.shape[0] // 2
    sample = torch.cat([k[:half], k[half: 2 * half]], 1).contiguous().to(dev)
    codec = Codec.fit(sample, method="exponent")
    for rpt in (32, 128):
        for load in ("idle", "busy"):
            stop = threading.Event()
            worker = threading.Thread(target=busy, args=(stop, dev)) if load == "busy" else None
            if worker is not None:
                worker.start()
            try:
                for rep in range(3):
                    c = measure_scattered(codec, sample, rpt, store_bytes=512 << 20)
                    print(json.dumps({"rows_per_token": rpt, "load": load, "rep": rep, "raw_ns": c.raw_s * 1e9,
                                      "coded_ns": c.coded_s * 1e9, "ratio": c.coded_ratio}), flush=True)
            finally:
                stop.set()
                if worker is not None:
                    worker.join()


if __name__ == "__main__":
    main()
