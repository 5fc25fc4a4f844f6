"""Experiment: do exponent-coded sparse KV rows read slower than raw rows once reads spread like a decode step's?
(Asked when a 32k x 4 Llama-8B run decoded coded rows at 1.69x raw, docs/results/2026-11-26-h100-s31, against an idle
probe that timed them 13.5% faster. Answer, docs/results/2026-11-26-h200-s32: no, 0.90-0.93x raw at every spread and
selection; that run's gap was the machine's state drifting between runs: `bench_llm.py --paired` measures both in
turn.)

The probe differs from a decode step in two ways tested here, on the 32k x 4 geometry (32 rows per token: 4
sequences x 8 KV heads, 32768 tokens, 400 selected per (sequence, head), head dim 128, bf16 rows of real SmolLM2 K):

- selection: the probe draws each (sequence, head)'s tokens independently; a decode step's heads of one sequence
  often select the same tokens, whose rows sit next to each other in the token-major layout. ``independent``,
  ``shared`` (one draw per sequence, all its heads read it) and ``clustered`` (runs of 8 neighbouring tokens);
- spread: the probe reads one 512 MiB store; a decode step reads 32 layers' stores (11.5 GB coded). ``--layers``
  stores per codec, read in turn.

Prints one JSON line per (layers, selection): raw and coded ns per row (median of ``--repeats`` timed fetches,
CUDA events), and coded / raw.

    PYTHONPATH=$PWD python scripts/experiments/kv_scattered_spread.py --layers 1,8,32
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ibpcache import Codec, datasets
from ibpcache.cache.append_store import AppendStore

SEQS, HEADS, TOKENS, SELECTED = 4, 8, 32768, 400


def selection(kind: str, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """int64 [1, SEQS * HEADS, SELECTED] sorted token ids per (sequence, head) row, the probe's index layout."""
    rows = SEQS * HEADS
    if kind == "independent":
        pick = torch.rand((rows, TOKENS), device=dev, generator=gen).argsort(-1)[:, :SELECTED]
    elif kind == "shared":
        pick = torch.rand((SEQS, TOKENS), device=dev, generator=gen).argsort(-1)[:, :SELECTED]
        pick = pick.repeat_interleave(HEADS, 0)
    elif kind == "clustered":
        starts = torch.rand((rows, TOKENS // 8), device=dev, generator=gen).argsort(-1)[:, : SELECTED // 8] * 8
        pick = (starts.unsqueeze(-1) + torch.arange(8, device=dev)).reshape(rows, SELECTED)
    else:
        raise SystemExit(f"unknown selection {kind!r}")
    return pick.sort(-1).values.unsqueeze(0).contiguous()


def build(codec: Codec, x: torch.Tensor, dev: torch.device) -> AppendStore:
    store = AppendStore(codec, codec, dev, rows_per_token=SEQS * HEADS, slots=TOKENS * SEQS * HEADS,
                        expected_bytes=2 * x.numel() * x.element_size())
    store.append(x, x, 0, 0)
    return store


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="1,8,32", help="comma list of store counts per codec (32: a decode step's)")
    p.add_argument("--selections", default="independent,shared,clustered")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    dev = torch.device("cuda")
    k = datasets.load_kv("code", "k", "bf16")
    half = k.shape[0] // 2
    sample = torch.cat([k[:half], k[half: 2 * half]], 1).contiguous().to(dev)  # head dim 128
    reps = -(-(TOKENS * SEQS * HEADS) // sample.shape[0])
    x = sample.repeat(reps, 1)[: TOKENS * SEQS * HEADS].view(TOKENS, 1, SEQS * HEADS, -1).permute(1, 2, 0, 3)
    codecs = {"raw": Codec.raw(sample.dtype, tuple(sample.shape[1:])), "coded": Codec.fit(sample, method="exponent")}
    out = [torch.empty((1, SEQS * HEADS, SELECTED, x.shape[-1]), dtype=x.dtype, device=dev) for _ in range(2)]
    gen = torch.Generator(device=dev).manual_seed(0)
    for n_layers in (int(v) for v in args.layers.split(",")):
        stores = {name: [build(c, x, dev) for _ in range(n_layers)] for name, c in codecs.items()}
        try:
            for kind in args.selections.split(","):
                draws = [selection(kind, gen, dev) for _ in range(args.repeats + 2)]
                times: dict[str, list[float]] = {"raw": [], "coded": []}
                for r, idx in enumerate(draws):
                    order = ("raw", "coded") if r % 2 == 0 else ("coded", "raw")
                    for name in order:
                        store = stores[name][r % n_layers]
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        store.fetch(idx, SELECTED, out[0], out[1])
                        b.record()
                        b.synchronize()
                        if r >= 2:
                            times[name].append(a.elapsed_time(b) * 1e6)
                rows = 2 * SEQS * HEADS * SELECTED
                raw, coded = (statistics.median(times[n]) / rows for n in ("raw", "coded"))
                print(json.dumps({"layers": n_layers, "selection": kind, "raw_ns_per_row": round(raw, 3),
                                  "coded_ns_per_row": round(coded, 3), "coded_over_raw": round(coded / raw, 3),
                                  "raw_min": round(min(times["raw"]) / rows, 3),
                                  "coded_min": round(min(times["coded"]) / rows, 3)}), flush=True)
        finally:
            for group in stores.values():
                for store in group:
                    store.release(stream_only=True)


if __name__ == "__main__":
    main()
