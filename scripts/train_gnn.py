#!/usr/bin/env python3
"""GNN training benchmark: GraphSAGE (fanout 25,10) with six feature paths side by side, in one run.

For every data set (real Cora and PubMed; Cora-SU, PubMed-SU and MiniLM-SU power-law graphs with real rows)
it trains with the same seeds and batch order through (1) DGL's standard path, (2) DGL with pinned features,
(3) ibpcache without compression, (4) IBP(M), (5) IBP(C), (6) IBP(C/M), GPU cache budget 1% of the feature
bytes. Per mode: mean epoch time over epochs 2..N with its breakdown (sampling, feature fetch, train step,
trainer idle wait), accuracy, hit rate, bytes moved, speedups over (1) and (3), and whether losses and test
predictions equal mode (1)'s bit for bit (the codec is lossless, so they must). The first batches of every
mode are also checked against the original rows. Writes ``train_gnn.json`` + ``train_gnn.png`` to ``--out``.

Configuration is Hydra's (``configs/bench_gnn.yaml`` and the dataset/cache/model groups); anything
after the options is an override::

    python scripts/train_gnn.py --out results
    python scripts/train_gnn.py --quick                      # small graphs, 3 epochs (smoke test)
    python scripts/train_gnn.py dataset.n_nodes=2000000 epochs=5 'datasets=[cora_su,minilm_su]'
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

# cuBLAS reads this when it starts: deterministic GEMM workspaces, so every mode gives identical losses.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples.gnn lives in the repository, not in the installed package
    sys.path.insert(0, str(ROOT))

from examples.gnn import pipeline as gnn  # noqa: E402
from ibpcache.testing import add_out_argument, format_table, write_results  # noqa: E402

QUICK = ["dataset.n_nodes=100000", "dataset.n_train=2048", "dataset.n_test=1024", "epochs=3"]
CONF_DIR = ROOT / "configs"
#: issue 4's targets (epoch time of IBP(C/M) vs (1) DGL and vs (3) ibpcache raw); checked, never assumed.
TARGETS = {"cora_su": (10.0, 3.0), "pubmed_su": (5.0, 2.0), "minilm_su": (None, 1.0)}
TABLE_COLUMNS = ["label", "epoch_ms", "sample_ms", "fetch_ms", "train_ms", "wait_ms", "speedup_vs_dgl",
                 "speedup_vs_raw", "hit_rate", "ratio", "bytes_moved_vs_raw", "accuracy", "identical_losses"]


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="bench_gnn", overrides=overrides)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run_dataset(name: str, overrides: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cfg = _compose([f"dataset={name}", *overrides])
    device = gnn.resolve_device(str(cfg.device))
    t0 = time.perf_counter()
    ds = gnn.dataset_from_config(cfg.dataset)
    load_s = time.perf_counter() - t0
    train_cfg = gnn.train_config(cfg.model, cfg.dataset, epochs=cfg.epochs, seed=cfg.seed)
    info = {**ds.describe(), "load_s": load_s, "device": str(device), "batch_size": train_cfg.batch_size,
            "epochs": train_cfg.epochs, "budget": cfg.cache.budget, "modes": list(cfg.cache.modes)}
    print(f"\n== {name}: {info['nodes']:,} nodes, {info['edges']:,} edges, {info['feature_bytes'] / 1e9:.3f} GB "
          f"of features ({info['row_bytes']} B rows), {info['train_nodes']:,} training seeds in batches of "
          f"{train_cfg.batch_size}, {train_cfg.epochs} epochs, budget {cfg.cache.budget}, device {device} "
          f"(loaded in {load_s:.1f} s)", flush=True)
    modes = list(cfg.cache.modes)
    bar = tqdm(total=len(modes) * train_cfg.epochs, unit="epoch", disable=not cfg.progress, file=sys.stderr)

    def progress(label: str) -> Any:
        bar.set_description(f"{name} {label}")
        return bar.update

    t1 = time.perf_counter()
    try:
        records = gnn.compare_modes(ds, modes, train_cfg, device=device, budget=cfg.cache.budget,
                                    policy=str(cfg.cache.policy), progress=progress)
    finally:
        bar.close()
    info["run_s"] = time.perf_counter() - t1
    print(format_table([{k: r.get(k) for k in TABLE_COLUMNS} for r in records], TABLE_COLUMNS), flush=True)
    del ds
    _free_memory()
    return records, info


def _targets(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 4's epoch-time targets, evaluated on the measured numbers (None where a mode did not run)."""
    out: dict[str, Any] = {}
    for name, (vs_dgl, vs_raw) in TARGETS.items():
        cm = next((r for r in records if r["dataset"] == name and r["mode"] == "ibp_cm"), None)
        if cm is None:
            continue
        entry: dict[str, Any] = {}
        if vs_dgl is not None and cm.get("speedup_vs_dgl") is not None:
            entry["vs_dgl"] = {"target": vs_dgl, "measured": cm["speedup_vs_dgl"],
                               "met": cm["speedup_vs_dgl"] >= vs_dgl}
        if cm.get("speedup_vs_raw") is not None:
            entry["vs_raw"] = {"target": vs_raw, "measured": cm["speedup_vs_raw"],
                               "met": cm["speedup_vs_raw"] >= vs_raw}
        out[name] = entry
    return out


def _plot(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["dataset"] for r in records))
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        recs = [r for r in records if r["dataset"] == name]
        labels = [r["label"].split(" ", 1)[0] for r in recs]
        train = [r["train_ms"] for r in recs]
        wait = [r["wait_ms"] for r in recs]
        ax.bar(labels, train, label="train step", color="#4c72b0")
        ax.bar(labels, wait, bottom=train, label="idle wait (sampling + fetch not hidden)", color="#dd8452")
        for i, r in enumerate(recs):
            if r.get("speedup_vs_dgl") is not None:
                ax.text(i, r["epoch_ms"], f"{r['speedup_vs_dgl']:.1f}x", ha="center", va="bottom", fontsize=8)
        ax.set_title(name)
        ax.set_ylabel("epoch time (ms), mean of epochs 2..N")
        ax.set_xlabel("(1) DGL (2) pinned (3) raw (4) IBP(M) (5) IBP(C) (6) IBP(C/M)", fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("GraphSAGE epoch time per feature path (speedup over DGL on top)")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(parser)
    parser.add_argument("--quick", action="store_true", help="small graphs and 3 epochs: " + " ".join(QUICK))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. dataset.n_nodes=2000000 epochs=5")
    args = parser.parse_args(argv)
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    datasets = list(_compose(overrides).datasets)
    print(f"train_gnn: data sets {datasets}; overrides {overrides or 'none'}; results -> {args.out}", flush=True)

    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    infos: dict[str, Any] = {}
    for name in datasets:
        recs, infos[name] = _run_dataset(name, overrides)
        records += recs
    targets = _targets(records)
    identical = all(r["identical_losses"] and r["identical_predictions"] for r in records)
    meta = {"datasets": infos, "targets": targets, "overrides": overrides, "all_modes_identical": identical,
            "total_s": time.perf_counter() - start}
    paths = write_results(args.out, "train_gnn", records, _plot, meta=meta)

    print(f"\nTargets (IBP(C/M) epoch-time speedup): {targets}")
    print(f"Losses and predictions identical across modes: {identical}; total {meta['total_s']:.0f} s; "
          f"wrote {', '.join(str(p) for p in paths.values())}")
    if not identical:
        print("ERROR: a feature path changed the model's losses or predictions (must be bit-identical)",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
