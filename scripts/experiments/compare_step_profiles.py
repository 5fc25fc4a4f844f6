"""Experiment: two codes' training steps side by side, from ``train_step_profile.py`` runs on one machine.

Takes runs of the base code and of the new code (ideally interleaved, base / new / new / base, so a machine's drift
hits both) and, per (optimizer, bag, batch) point, reports each run's back-to-back ms per step, the mean ratio
base / new, each phase's host ms (means over the runs of a code), kernels and stream syncs per step. Writes
``<name>.json`` and ``<name>.png`` under --out.

    python scripts/experiments/compare_step_profiles.py --base b1.json b2.json --new n1.json n2.json --out /tmp/cmp
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from ibpcache.testing import write_results


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", nargs="+", required=True, help="train_step_profile.json of the base code")
    p.add_argument("--new", nargs="+", required=True, help="train_step_profile.json of the new code")
    p.add_argument("--labels", nargs=2, default=("base", "new"))
    p.add_argument("--out", default="compare_step_profiles_out")
    p.add_argument("--name", default="compare_step_profiles")
    return p.parse_args(argv)


def _key(p: dict) -> tuple:
    return p["optimizer"], p["bag"], p["batch"]


def _syncs(p: dict) -> float:
    ops = p.get("sync_ops_per_step", {})
    return float(ops.get("cudaStreamSynchronize", 0.0))


def _side(runs: list[list[dict]], key: tuple) -> dict[str, Any]:
    pts = [next(p for p in run if _key(p) == key) for run in runs]
    phases = {ph: statistics.mean(p["back_to_back_host_ms_by_phase"][ph] for p in pts)
              for ph in pts[0]["back_to_back_host_ms_by_phase"]}
    return {"back_to_back_ms": [p["back_to_back_ms"] for p in pts], "host_ms_by_phase": phases,
            "kernels_per_step": statistics.mean(p["kernels_per_step"] for p in pts),
            "stream_syncs_per_step": statistics.mean(_syncs(p) for p in pts), "hit_rate": pts[0]["hit_rate"]}


def compare(base: list[list[dict]], new: list[list[dict]], labels: tuple[str, str]) -> list[dict[str, Any]]:
    """One record per point: both sides and the ratio of their mean back-to-back step times (> 1: new is faster)."""
    out = []
    for p in base[0]:
        key = _key(p)
        a, b = _side(base, key), _side(new, key)
        ratio = statistics.mean(a["back_to_back_ms"]) / statistics.mean(b["back_to_back_ms"])
        out.append({"optimizer": key[0], "bag": key[1], "batch": key[2], labels[0]: a, labels[1]: b,
                    "speedup": ratio})
    return out


def plot(records: list[dict], labels: tuple[str, str]) -> Any:
    import matplotlib.pyplot as plt

    names = [f"{r['optimizer']}\nbag {r['bag']}\n{r['batch']}" for r in records]
    x = range(len(records))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(records)), 4))
    for i, (lab, off) in enumerate(zip(labels, (-0.2, 0.2))):
        for run in range(len(records[0][lab]["back_to_back_ms"])):
            ax.scatter([j + off for j in x], [r[lab]["back_to_back_ms"][run] for r in records], s=14,
                       color=f"C{i}", label=lab if run == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, fontsize=7)
    ax.set_ylabel("ms per training step, back to back")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv: "list[str] | None" = None) -> dict[str, Path]:
    args = parse_args(argv)
    load = lambda paths: [json.loads(Path(f).read_text())["points"] for f in paths]  # noqa: E731
    labels = tuple(args.labels)
    records = compare(load(args.base), load(args.new), labels)
    meta = {"base": [str(f) for f in args.base], "new": [str(f) for f in args.new], "labels": list(labels)}
    paths = write_results(args.out, args.name, records, lambda recs: plot(recs, labels), meta=meta,
                          extra={"points": records})
    for r in records:
        print(f"{r['optimizer']:8s} bag {r['bag']:2d} batch {r['batch']:5d}: {labels[0]} / {labels[1]} "
              f"{r['speedup']:.2f}x, prefetch host {r[labels[0]]['host_ms_by_phase']['prefetch']:.2f} -> "
              f"{r[labels[1]]['host_ms_by_phase']['prefetch']:.2f} ms, forward "
              f"{r[labels[0]]['host_ms_by_phase']['forward']:.2f} -> {r[labels[1]]['host_ms_by_phase']['forward']:.2f}"
              f" ms, syncs {r[labels[0]]['stream_syncs_per_step']:.1f} -> {r[labels[1]]['stream_syncs_per_step']:.1f}")
    print(f"wrote {paths}")
    return paths


if __name__ == "__main__":
    main()
