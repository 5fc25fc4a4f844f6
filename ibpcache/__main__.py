"""``python -m ibpcache``: the main job (Hydra app; ``--help`` lists the config groups).

Trains GraphSAGE on the bundled Cora (default) with node features served through DGL's DataLoader by an
ibpcache FeatureCache, next to DGL's standard feature path with the same seeds and batches, and prints a short
table: compression ratio, cache capacity and hit rate, bytes moved over PCIe vs raw, epoch time, accuracy,
and whether the losses match DGL's bit for bit. Uses the GPU when torch sees one; needs no download.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "run", "format_report"]


def _fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def format_report(records: list[dict[str, Any]]) -> str:
    """The table the main job prints (one line per fetch mode)."""
    head = ["mode", "ratio", "cache rows (raw)", "hit rate", "moved vs raw", "epoch ms", "vs DGL", "acc",
            "same losses"]
    rows = []
    for r in records:
        cap = r.get("capacity_rows")
        cap_s = f"{cap} ({r.get('capacity_rows_raw')})" if cap is not None else "-"
        moved = f"{_fmt_bytes(r.get('bytes_moved'))} / {_fmt_bytes(r.get('raw_bytes'))}"
        if r.get("bytes_moved_vs_raw") is not None and r.get("raw_bytes"):
            moved += f" ({100 * r['bytes_moved_vs_raw']:.1f}%)"
        rows.append([r["label"], _fmt(r.get("ratio"), ".2f") + "x", cap_s, _fmt(r.get("hit_rate"), ".1%"), moved,
                     _fmt(r.get("epoch_ms"), ".1f"), _fmt(r.get("speedup_vs_dgl"), ".2f") + "x",
                     _fmt(r.get("accuracy"), ".3f"), "yes" if r.get("identical_losses") else "NO"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def run(cfg: Any) -> list[dict[str, Any]]:
    """Run the experiment a composed config describes and print the report; returns the records."""
    import torch
    from tqdm.auto import tqdm

    from ibpcache import gnn

    device = gnn.resolve_device(str(cfg.device))
    ds = gnn.dataset_from_config(cfg.dataset)
    train_cfg = gnn.train_config(cfg.model, cfg.dataset, epochs=cfg.epochs, seed=cfg.seed)
    modes = list(cfg.cache.modes)
    info = ds.describe()
    print(f"ibpcache main job: GraphSAGE fanout {list(train_cfg.fanouts)} on {info['name']} "
          f"({info['nodes']:,} nodes, {info['edges']:,} edges, {_fmt_bytes(info['feature_bytes'])} of features, "
          f"{info['row_bytes']} B rows) | device {device} | cache budget {cfg.cache.budget} | "
          f"{train_cfg.epochs} epochs, batch {train_cfg.batch_size}", flush=True)
    bar = tqdm(total=len(modes) * train_cfg.epochs, unit="epoch", disable=not cfg.progress, file=sys.stderr)

    def progress(label: str) -> Any:
        bar.set_description(label)
        return bar.update

    try:
        records = gnn.compare_modes(ds, modes, train_cfg, device=device, budget=cfg.cache.budget,
                                    policy=str(cfg.cache.policy), progress=progress)
    finally:
        bar.close()
    print(format_report(records))
    print(f"epoch ms = mean of epochs 2..{train_cfg.epochs}; moved = bytes read from host memory for the "
          f"feature rows (cache misses, compressed where the host store is); acc = test accuracy"
          + ("" if torch.cuda.is_available() else "; no GPU: the cache ran on the CPU"))
    return records


def _hydra_main() -> None:
    import hydra

    # An absolute path works for `python -m ibpcache` and for the `ibpcache` console script alike (a module
    # path would need conf/ to be a Python package).
    @hydra.main(config_path=str(Path(__file__).resolve().parent / "conf"), config_name="config",
                version_base=None)
    def _app(cfg: Any) -> None:
        run(cfg)

    _app()


def main() -> None:
    """Console entry point (``ibpcache`` script and ``python -m ibpcache``)."""
    # cuBLAS reads this when it starts: deterministic GEMMs, so every fetch mode gives identical losses.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    _hydra_main()


if __name__ == "__main__":
    main()
