"""``python -m ibpcache``: the main job, a Hydra app that needs only the base install (no DGL, no matplotlib).

Tasks are a Hydra config group, ``task``; ``python -m ibpcache --help`` lists them. The default, ``task=demo``,
is a feature-serving demo on the Cora graph bundled with the package:

1. fit the IBP codec on the 2708 x 1433 float32 feature rows and print the compression ratio;
2. build a :class:`~ibpcache.FeatureCache` per policy (``static`` admitting the highest-degree nodes, ``lru``,
   ``lfu``) with the same byte budget, on the GPU if torch sees one, else on the CPU;
3. draw a GNN-like id stream without any graph framework: random seed batches, each expanded by two hops of
   uniform neighbour sampling (fanouts 25, 10) on the bundled adjacency, the ids a GraphSAGE step would fetch;
4. fetch every batch through every cache, compare each result with ``x[ids]`` byte for byte, and print per
   policy the hit rate, bytes read from the host store vs reading the same rows raw, the rows the cache holds
   vs a raw cache of the same budget, and fetch throughput.

The job exits with status 1 if any fetched batch differs from the rows. New tasks register a function in
:data:`TASKS` and a config in ``configs/task/`` (plus its packaged default in :func:`register_packaged_configs`).

Configs: ``configs/`` at the repository root when running from a checkout (the files a user edits); an installed
wheel has no ``configs/`` and uses the same defaults registered in Hydra's ConfigStore. ``--config-dir DIR``
adds DIR to the search path (it overrides the packaged defaults; in a checkout ``configs/`` wins on equal
names), ``--config-path /abs/DIR`` replaces ``configs/`` altogether.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["main", "run", "TASKS", "DemoTask", "ServeTask", "GcTask", "MainConfig", "register_packaged_configs",
           "checkout_config_dir", "sample_batches", "format_demo_report"]

CONFIG_NAME = "ibpcache"


# ------------------------------------------------------------------------------------------------------------
# Packaged defaults (mirrored by configs/; tests/test_main.py checks that both compose to the same config)


@dataclass
class DemoTask:
    """``task=demo``: serve a GNN-like id stream on bundled Cora through one FeatureCache per policy."""

    name: str = "demo"
    budget: float = 0.01  # cache size: fraction of the raw feature bytes (float) or bytes (int)
    policies: list[str] = field(default_factory=lambda: ["static", "lru", "lfu"])
    batch_size: int = 256  # seed nodes per batch
    fanouts: list[int] = field(default_factory=lambda: [25, 10])
    epochs: int = 2  # passes over all nodes as seeds (lru/lfu warm up in the first)
    seed: int = 0


@dataclass
class ServeTask:
    """``task=serve``: publish saved store files in POSIX shared memory until SIGTERM/SIGINT (the store host).

    ``stores`` maps a shared-store name to a file written by ``CompressedRows.save`` (checksums are verified);
    clients ``CompressedRows.attach(name)``; ``ready_file`` (optional) receives a JSON description once every store
    is published; ``replace`` publishes a new generation over an existing store of that name.
    """

    name: str = "serve"
    stores: dict[str, str] = field(default_factory=dict)
    ready_file: Optional[str] = None
    replace: bool = True


@dataclass
class GcTask:
    """``task=gc``: remove this user's shared stores (``/dev/shm/ibpcache.*``) whose owner process is gone.

    A store outlives its owner when the owner dies without removing it (kill -9, an OOM kill, SIGTERM of a script);
    every ``share``/``attach``/``serve`` sweeps such segments too. Stores of live owners, of other users and of
    owners that cannot be judged (another pid namespace) are kept. ``dry_run`` only reports.
    """

    name: str = "gc"
    dry_run: bool = False


_HYDRA_SETTINGS: dict[str, Any] = {
    # outside the repository: a run leaves nothing behind in the working directory
    "run": {"dir": "${oc.env:TMPDIR,/tmp}/ibpcache-hydra/${now:%Y-%m-%d_%H-%M-%S-%f}"},
    "sweep": {"dir": "${oc.env:TMPDIR,/tmp}/ibpcache-hydra/multirun-${now:%Y-%m-%d_%H-%M-%S-%f}",
              "subdir": "${hydra.job.num}"},
    "output_subdir": None,
    "job": {"chdir": False},
    "help": {
        "app_name": "ibpcache",
        "header": "ibpcache: lossless Invariant Bit Packing feature cache. The default task (task=demo) fits the "
                  "codec on the bundled Cora features and serves a 2-hop GNN id stream through a FeatureCache per "
                  "policy (static, lru, lfu), checking every batch bit for bit. Needs only the base install; uses "
                  "the GPU if torch sees one.",
        "footer": "Examples:\n  python -m ibpcache\n  python -m ibpcache device=cpu task.budget=0.01\n"
                  "  python -m ibpcache 'task.policies=[lru]' task.epochs=1\n"
                  "Configs: configs/ of the checkout, else the packaged defaults; --config-dir DIR adds DIR.",
    },
}


@dataclass
class MainConfig:
    """The primary config: which task to run and on which device (``auto``: the GPU if torch sees one)."""

    defaults: list[Any] = field(default_factory=lambda: [
        {"task": "demo"}, "_self_", {"override hydra/job_logging": "stdout"}])
    device: str = "auto"


def register_packaged_configs() -> None:
    """Put the defaults above in Hydra's ConfigStore (used when no ``configs/`` folder sits beside the package)."""
    from hydra.core.config_store import ConfigStore

    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    # The hydra settings ride on a plain node: a typed dataclass field would replace Hydra's own schema for them.
    primary = OmegaConf.to_container(OmegaConf.structured(MainConfig))
    cs.store(name=CONFIG_NAME, node={**primary, "hydra": _HYDRA_SETTINGS})
    cs.store(group="task", name="demo", node=DemoTask)
    cs.store(group="task", name="serve", node=ServeTask)
    cs.store(group="task", name="gc", node=GcTask)


def checkout_config_dir() -> Path | None:
    """``configs/`` of the repository this package was imported from (checkout or editable install), if any."""
    cand = Path(__file__).resolve().parent.parent / "configs"
    return cand if (cand / f"{CONFIG_NAME}.yaml").is_file() else None


# ------------------------------------------------------------------------------------------------------------
# The demo task


def _resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from ibpcache._validation import resolve_device

    return resolve_device(name)


def _csr(src: Any, dst: Any, n: int) -> tuple[Any, Any]:
    """(rowptr int64 [n+1], col int64 [E]) of a graph whose edges are sorted by source (as GraphData's are)."""
    import torch

    rowptr = torch.zeros(n + 1, dtype=torch.int64)
    rowptr[1:] = torch.cumsum(torch.bincount(src, minlength=n), 0)
    return rowptr, dst


def _sample_neighbors(rowptr: Any, col: Any, frontier: Any, fanout: int, gen: Any) -> Any:
    """Up to ``fanout`` distinct neighbours of each frontier node, uniformly (all of them when fewer).

    Every candidate edge gets a random key; sorting by (node, key) and keeping the first ``fanout`` of each node
    is uniform sampling without replacement, as DGL's ``sample_neighbors`` does, in a few vectorised torch ops.
    """
    import torch

    start = rowptr[frontier]
    deg = rowptr[frontier + 1] - start
    total = int(deg.sum())
    if total == 0:
        return frontier.new_empty(0)
    seg = torch.repeat_interleave(torch.arange(frontier.numel()), deg)
    first = torch.repeat_interleave(torch.cumsum(deg, 0) - deg, deg)
    pos = torch.arange(total) - first  # position of each candidate within its node's list
    edge = torch.repeat_interleave(start, deg) + pos
    order = torch.argsort(seg.to(torch.float64) + torch.rand(total, generator=gen, dtype=torch.float64) * 0.5)
    return col[edge[order][pos < fanout]]  # after the sort, pos is the rank within the node's shuffled list


def sample_batches(graph: Any, batch_size: int, fanouts: list[int], epochs: int, seed: int) -> Iterator[Any]:
    """Ids a 2-hop GraphSAGE step fetches: each seed batch plus its sampled neighbourhood, unique and sorted."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rowptr, col = _csr(graph.src, graph.dst, graph.num_nodes)
    for _ in range(epochs):
        for seeds in torch.randperm(graph.num_nodes, generator=gen).split(batch_size):
            nodes, frontier = seeds, seeds
            for fanout in fanouts:
                frontier = torch.unique(_sample_neighbors(rowptr, col, frontier, fanout, gen))
                nodes = torch.cat([nodes, frontier])
            yield torch.unique(nodes)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_demo_report(records: list[dict[str, Any]]) -> str:
    """The per-policy table the demo prints."""
    head = ["policy", "hit rate", "host bytes read / raw", "cache rows (raw cache)", "fetch rows/s", "fetch GB/s",
            "exact"]
    rows = []
    for r in records:
        rows.append([
            r["policy"], f"{r['hit_rate']:.1%}",
            f"{_fmt_bytes(r['host_bytes_read'])} / {_fmt_bytes(r['raw_bytes'])} "
            f"({100 * r['host_bytes_read'] / max(r['raw_bytes'], 1):.1f}%)",
            f"{r['capacity_rows']} ({r['capacity_rows_raw']}, {r['capacity_rows'] / max(r['capacity_rows_raw'], 1):.1f}x)",
            f"{r['rows_per_s']:,.0f}", f"{r['gbps']:.2f}", "yes" if r["exact"] else f"NO ({r['bad_batches']} batches)",
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _serve(cache: Any, x_u8: Any, batches: list[Any], sync: Callable[[], None]) -> tuple[float, int]:
    """Fetch every batch (timed, synchronised) and check it against the rows; (seconds, batches that differ)."""
    import torch

    seconds, bad = 0.0, 0
    for ids in batches:
        t0 = time.perf_counter()
        out = cache.fetch(ids)
        sync()
        seconds += time.perf_counter() - t0
        got = out.cpu().reshape(ids.numel(), -1).view(torch.uint8)
        bad += int(not torch.equal(got, x_u8[ids]))
    return seconds, bad


def run_demo(cfg: Any) -> int:
    """The default task (see the module docstring); returns the exit status: 0 when every fetch was exact."""
    import torch

    from ibpcache import Codec, FeatureCache
    from ibpcache.datasets import load_cora

    task = cfg.task
    device = _resolve_device(str(cfg.device))
    graph = load_cora()
    x = graph.features
    n, row_bytes = x.shape[0], x[0].numel() * x.element_size()
    x_u8 = x.reshape(n, -1).view(torch.uint8)
    print(f"ibpcache demo: serving Cora features ({n:,} nodes x {x.shape[1]} float32, {_fmt_bytes(x.nbytes)}, "
          f"{row_bytes} B rows) on {device}", flush=True)

    t0 = time.perf_counter()
    codec = Codec.fit(x)
    packed = codec.compress(x, layout="inplace", pin=False)
    exact_codec = torch.equal(packed.decompress().reshape(n, -1).view(torch.uint8), x_u8)
    print(f"codec: {codec.chunk_bytes}-byte chunks, compression ratio {packed.ratio:.2f}x "
          f"({_fmt_bytes(x.nbytes)} -> {_fmt_bytes(packed.nbytes)}), round trip "
          f"{'bit-exact' if exact_codec else 'NOT EXACT'}, {time.perf_counter() - t0:.1f} s", flush=True)

    batches = list(sample_batches(graph, int(task.batch_size), [int(f) for f in task.fanouts], int(task.epochs),
                                  int(task.seed)))
    requested = sum(int(b.numel()) for b in batches)
    print(f"id stream: {len(batches)} batches of {task.batch_size} seed nodes + 2-hop neighbours "
          f"(fanouts {list(task.fanouts)}), {requested:,} ids ({requested / len(batches):,.0f} per batch), "
          f"{task.epochs} epochs; cache budget {task.budget} of the raw feature bytes", flush=True)

    degree = torch.bincount(graph.src, minlength=n)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    records = []
    for policy in task.policies:
        cache = FeatureCache(x, budget_bytes=task.budget, hotness=degree if policy == "static" else None,
                             policy=str(policy), device=device, codec=codec)
        cache.fetch(batches[0])  # warm-up: the first fetch compiles kernels (CUDA) or JITs decoders (Numba)
        sync()
        cache.reset_stats()
        seconds, bad = _serve(cache, x_u8, batches, sync)
        st = cache.stats()
        records.append({
            "policy": str(policy), "hit_rate": st["hit_rate"], "host_bytes_read": st["host_bytes_read"],
            "raw_bytes": st["raw_bytes_equivalent"], "capacity_rows": st["capacity_rows"],
            "capacity_rows_raw": st["capacity_rows_raw"], "rows_per_s": requested / seconds,
            "gbps": requested * row_bytes / seconds / 1e9, "exact": bad == 0, "bad_batches": bad,
        })
    print(format_demo_report(records))
    print("host bytes read / raw: bytes the cache read from its compressed host store for the misses vs the raw "
          "bytes of every requested row (an uncached raw fetch); cache rows: rows the compressed cache holds vs a "
          "raw cache of the same budget; exact: every fetched batch equals x[ids] byte for byte")
    ok = exact_codec and all(r["exact"] for r in records)
    if not ok:
        print("ibpcache demo: FAILED - some fetched rows differ from the originals", file=sys.stderr)
    return 0 if ok else 1


def run_serve(cfg: Any) -> int:
    """``task=serve``: the store host (``ibpcache.cache.service``); returns when stopped by SIGTERM/SIGINT."""
    from ibpcache.cache.service import serve_config

    if not cfg.task.stores:
        raise ValueError("task=serve needs at least one store: task.stores.NAME=/path/to/file.ibp")
    serve_config(cfg.task)
    return 0


def run_gc(cfg: Any) -> int:
    """``task=gc``: sweep shared stores whose owner died (``ibpcache._shm.sweep``); prints what went and stayed."""
    from ibpcache._shm import SHM_DIR, sweep

    dry_run = bool(cfg.task.dry_run)
    report = sweep(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for file_name, why in sorted(report.removed.items()):
        print(f"{verb} {SHM_DIR / file_name}: {why}")
    for file_name, why in sorted(report.kept.items()):
        print(f"kept {SHM_DIR / file_name}: {why}")
    print(f"ibpcache gc: {verb} {len(report.removed)} segment(s), kept {len(report.kept)} in {SHM_DIR}")
    return 0


TASKS: dict[str, Callable[[Any], int]] = {"demo": run_demo, "serve": run_serve, "gc": run_gc}
"""Task name (``task.name`` in the config) -> function taking the composed config, returning an exit status."""


def run(cfg: Any) -> int:
    """Run the task a composed config names; returns its exit status."""
    name = str(cfg.task.name)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name](cfg)


def main() -> None:
    """Console entry point (``ibpcache`` script and ``python -m ibpcache``)."""
    import hydra

    conf_dir = checkout_config_dir()
    if conf_dir is None:
        register_packaged_configs()
    status: list[int] = []

    # An absolute path works for `python -m ibpcache` and for the console script alike.
    @hydra.main(config_path=None if conf_dir is None else str(conf_dir), config_name=CONFIG_NAME,
                version_base=None)
    def _app(cfg: Any) -> None:
        status.append(run(cfg))

    _app()
    sys.exit(status[0] if status else 0)


if __name__ == "__main__":
    main()
