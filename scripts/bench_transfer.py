"""Transfer paths of the engine's host store: the planner's choice beside every forced path and the raw baselines.

Rows of real data sets are scaled up to ``--gb`` GB in pinned host memory ("SU": real rows resampled) and fetched by
a static ``FeatureCache`` (``--budget`` of the raw bytes, so nearly every id misses) in batches of ``--batch``
uniform random ids handed over ON THE CPU, as DGL's and PyG's samplers do. Methods, side by side in one process:

* ``torch_gather``  - no cache: ``index_select`` from the pinned table into pinned staging, one bulk copy (the code a
  user writes; the raw baseline for small rows);
* ``raw_zero_copy`` / ``raw_cpu_gather`` / ``raw_host_gather`` - our cache over raw host rows, each transfer path
  forced (``host_gather`` serves every id by torch's row gather + one copy: ``torch_gather`` inside the cache);
* ``ibp_zero_copy`` / ``ibp_cpu_gather`` - our cache over IBP-compressed host rows, each path forced;
* ``ibpcache`` - the defaults with the planners on: ``compress_host="auto"`` (compressed vs raw zero-copy, and
  the CPU's raw gather, timed on a sample) and ``transfer="auto"`` (zero-copy vs cpu-gather, plus host-gather for
  raw rows, timed on the store); ``chosen`` records what they picked.

Wall clock per fetch from the call to the rows being on the GPU (host work included, since the ids start on the
CPU), synchronised after each, medians over ``--iters`` after ``--warmup``; every method's output is verified
bit-exact against ``rows[ids]`` on its first and last batch. The target (issue 11): ``ibpcache`` never slower than
the best raw method. Writes ``bench_transfer.json`` (``points``: one per data set, ``methods`` -> GB/s) and a PNG.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from ibpcache import datasets  # noqa: E402
from ibpcache.cache.feature_cache import FeatureCache  # noqa: E402
from ibpcache.testing import add_out_argument, cpu_time, format_table, write_results  # noqa: E402

RAW = ["torch_gather", "raw_zero_copy", "raw_cpu_gather", "raw_host_gather"]
METHODS = RAW + ["ibp_zero_copy", "ibp_cpu_gather", "ibpcache"]


def _minilm_cut(width: int) -> Callable[[], torch.Tensor]:
    return lambda: datasets.load_rows("minilm")[:, :width].contiguous()


DATASETS: dict[str, Callable[[], torch.Tensor]] = {
    "minilm_32B": _minilm_cut(8),
    "kv_bf16_128B": lambda: datasets.load_rows("kv_chat_k_bf16"),
    "minilm_128B": _minilm_cut(32),
    "minilm_1536B": lambda: datasets.load_rows("minilm"),
    "cora_5732B": lambda: datasets.load_rows("cora"),
}


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p)
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--gb", type=float, default=2.0, help="scaled-up size of each table in GB")
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--budget", type=float, default=0.01, help="cache budget, fraction of the raw bytes")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke-test the script")
    p.add_argument("--quick", action="store_true", help="0.05 GB tables, few iterations")
    args = p.parse_args(argv)
    if args.quick:
        args.gb, args.iters, args.warmup, args.batch = min(args.gb, 0.05), 3, 1, min(args.batch, 4096)
    return args


def _cache(rows: torch.Tensor, method: str, args: argparse.Namespace) -> FeatureCache:
    ibp = method.startswith("ibp")
    transfer = "auto" if method == "ibpcache" else method.split("_", 1)[1]
    return FeatureCache(rows, args.budget, device=args.device, compress_cache=ibp,
                        compress_host="auto" if method == "ibpcache" else ibp, transfer=transfer)


def _fetcher(rows: torch.Tensor, method: str, args: argparse.Namespace) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                                                 dict[str, Any]]:
    """A fetch function for ``method`` plus what it chose (the planners' decisions for ``ibpcache``)."""
    if method == "torch_gather":
        staging: dict[int, torch.Tensor] = {}

        def gather(ids: torch.Tensor) -> torch.Tensor:
            buf = staging.get(ids.numel())
            if buf is None:
                buf = staging[ids.numel()] = torch.empty((ids.numel(), *rows.shape[1:]), dtype=rows.dtype,
                                                         pin_memory=args.device == "cuda")
            torch.index_select(rows, 0, ids, out=buf)
            return buf.to(args.device, non_blocking=True)

        return gather, {}
    fc = _cache(rows, method, args)
    st = fc.stats()
    return fc.fetch, {"host_layout": st["host_layout"], "transfer": st["transfer"], "mode": st["mode"]}


def _run_dataset(name: str, args: argparse.Namespace) -> dict[str, Any]:
    real = DATASETS[name]()
    cuda = args.device == "cuda"
    rows = datasets.scale_up(real, int(args.gb * 1e9), seed=0, pin_memory=cuda)
    n, row_bytes = rows.shape[0], rows[0].numel() * rows.element_size()
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, n, (args.batch,), generator=gen) for _ in range(args.warmup + args.iters)]
    point: dict[str, Any] = {"dataset": name, "row_bytes": row_bytes, "rows": n, "gb": args.gb, "batch": args.batch,
                             "budget": args.budget, "methods": {}}
    for method in tqdm(args.methods, desc=name, leave=False):
        fetch, chosen = _fetcher(rows, method, args)
        k = iter(range(10**9))

        def step() -> torch.Tensor:
            return fetch(batches[next(k) % len(batches)])

        verified = all(torch.equal(fetch(b).cpu().view(torch.uint8), rows[b].view(torch.uint8))
                       for b in (batches[0], batches[-1]))
        t = cpu_time(step, warmup=args.warmup, iters=args.iters, sync_cuda=cuda)
        gbps = args.batch * row_bytes / (t["median_ms"] * 1e6)
        point["methods"][method] = {"gbps": gbps, "ms": t["median_ms"], "p10": t["p10"], "p90": t["p90"],
                                    "verified": verified, **chosen}
        fetch = chosen = None  # type: ignore[assignment]  # the cache goes before the next one is built
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    raw_best = max((point["methods"][m]["gbps"], m) for m in RAW if m in point["methods"]) \
        if any(m in point["methods"] for m in RAW) else (None, None)
    point["best_raw"] = raw_best[1]
    if raw_best[0] and "ibpcache" in point["methods"]:
        point["ibpcache_vs_best_raw"] = point["methods"]["ibpcache"]["gbps"] / raw_best[0]
    del rows
    gc.collect()
    return point


def _plot(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = [r["dataset"] for r in records]
    methods = [m for m in METHODS if any(m in r["methods"] for r in records)]
    w = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        ax.bar([j + i * w for j in range(len(names))], [r["methods"].get(m, {}).get("gbps", 0) for r in records],
               w, label=m)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(names))], names)
    ax.set_ylabel("GB/s of rows delivered (ids on the CPU)")
    ax.set_title("host store transfer paths: planner (ibpcache) vs forced paths vs raw")
    ax.legend(fontsize=8)
    return fig


def main(argv: "list[str] | None" = None) -> int:
    args = parse_args(argv)
    points = [_run_dataset(name, args) for name in args.datasets]
    rows = []
    for p in points:
        for m, r in p["methods"].items():
            rows.append({"dataset": p["dataset"], "method": m, "gbps": round(r["gbps"], 2), "ms": round(r["ms"], 3),
                         "verified": r["verified"], "chosen": (r.get("transfer") or {}).get("transfer", "")
                         + ("/" + ("ibp" if r["host_layout"].get("compress") else "raw") if "host_layout" in r else "")})
    print(format_table(rows))
    for p in points:
        print(f"{p['dataset']}: ibpcache / best raw ({p['best_raw']}) = {p.get('ibpcache_vs_best_raw')}")
    write_results(args.out, "bench_transfer", rows, lambda _: _plot(points), meta=vars(args), extra={"points": points})
    return 0 if all(r["verified"] for p in points for r in p["methods"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
