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

Every task's runner first checks all of its settings (``validate_<task>``), before loading data or fitting a codec;
a bad one raises :class:`~ibpcache.errors.ConfigError` naming it as typed (``task.batch_size=0: must be a positive
integer``), and the job prints that line and exits with status 2, without a traceback.

Configs: ``configs/`` at the repository root when running from a checkout (the files a user edits); an installed
wheel has no ``configs/`` and uses the same defaults registered in Hydra's ConfigStore. ``--config-dir DIR``
adds DIR to the search path (it overrides the packaged defaults; in a checkout ``configs/`` wins on equal
names), ``--config-path /abs/DIR`` replaces ``configs/`` altogether.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from ibpcache.errors import CapacityError, ConfigError, InvalidArgumentError, InvalidTypeError

__all__ = ["main", "run", "TASKS", "DemoTask", "ServeTask", "GcTask", "MainConfig", "register_packaged_configs",
           "checkout_config_dir", "sample_batches", "format_demo_report", "validate_demo", "validate_serve",
           "validate_gc"]

CONFIG_NAME = "ibpcache"


# ------------------------------------------------------------------------------------------------------------
# Packaged defaults (mirrored by configs/; tests/test_main.py checks that both compose to the same config)


@dataclass
class DemoTask:
    """``task=demo``: serve a GNN-like id stream on bundled Cora through one FeatureCache per policy."""

    name: str = "demo"
    # cache size: a float in (0, 1] is a fraction of the raw feature bytes, an int a byte count (typed Any so that
    # an int given on the command line stays an int, as it does with configs/)
    budget: Any = 0.01
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
# Settings checks: each task's runner calls its validate_<task> first, so a bad setting costs no data load or fit


def _shown(value: Any) -> str:
    """A setting's value as a user would type it (``[25, 10]``, ``null``, ``abc``)."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
    except ImportError:
        pass
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else repr(value)


def _bad(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{key}={_shown(value)}: {why}")


@contextlib.contextmanager
def _as_config_error() -> Iterator[None]:
    """Library argument checks (which already name the setting they were given) surface as ConfigError."""
    try:
        yield
    except (InvalidArgumentError, InvalidTypeError, CapacityError) as exc:
        raise ConfigError(str(exc)) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_setting(task: Any, key: str, low: int, high: "int | None" = None, why: str = "must be a positive integer"
                 ) -> int:
    """``task.key`` as an int in ``[low, high)``; ``why`` says what is expected."""
    value = task.get(key)
    if not _is_int(value) or value < low or (high is not None and value >= high):
        raise _bad(f"task.{key}", value, why)
    return value


def _list_setting(task: Any, key: str) -> list:
    value = task.get(key)
    try:
        from omegaconf import ListConfig

        if isinstance(value, ListConfig):
            return list(value)
    except ImportError:
        pass
    if isinstance(value, (list, tuple)):
        return list(value)
    raise _bad(f"task.{key}", value, "must be a list, e.g. [a, b]")


def _known_keys(task: Any, schema: type) -> None:
    """No setting the task does not read (a misspelt ``+task.batchsize=...`` would be ignored silently)."""
    known = {f.name for f in fields(schema)}
    for key in task:
        if key not in known:
            raise _bad(f"task.{key}", task.get(key), f"unknown setting of task={task.get('name')}; known: "
                                                       f"{sorted(known)}")


def _validate_device(cfg: Any) -> None:
    """``device``: auto, cpu, cuda or cuda:N of a GPU torch sees."""
    import torch

    name = cfg.get("device")
    if not isinstance(name, str):
        raise _bad("device", name, "must be auto, cpu or cuda")
    if name == "auto":
        return
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise _bad("device", name, "must be auto, cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise _bad("device", name, "must be auto, cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise _bad("device", name, "torch sees no CUDA GPU (use device=cpu or device=auto)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise _bad("device", name, f"torch sees {torch.cuda.device_count()} CUDA GPU(s)")


def validate_demo(cfg: Any) -> None:
    """Check every ``task=demo`` setting (and ``device``); raises ConfigError naming the first bad one."""
    from ibpcache._validation import check_budget
    from ibpcache.cache.policy import PolicyKind

    task = cfg.task
    _known_keys(task, DemoTask)
    _validate_device(cfg)
    with _as_config_error():
        check_budget(task.get("budget"), "task.budget")
    policies = _list_setting(task, "policies")
    names = [m.value for m in PolicyKind]
    if not policies:
        raise _bad("task.policies", policies, f"must name at least one policy of {names}")
    for p in policies:
        if not isinstance(p, str) or p.lower() not in names:
            raise _bad("task.policies", policies, f"{_shown(p)} is not a policy; known: {names}")
    _int_setting(task, "batch_size", 1)
    fanouts = _list_setting(task, "fanouts")
    if not all(_is_int(f) and f >= 1 for f in fanouts):
        raise _bad("task.fanouts", fanouts, "must be a list of positive integers (neighbours sampled per hop)")
    _int_setting(task, "epochs", 1)
    _int_setting(task, "seed", 0, 2**64, "must be an integer in [0, 2**64)")


def _check_demo_budget(budget: Any, x: Any, min_row_bytes: int) -> None:
    """``task.budget`` against the rows: it must hold a stored row of ``min_row_bytes`` (1 before the codec fit:
    budgets that hold nothing at all; the compressed rows' smallest length after it)."""
    from ibpcache._validation import resolve_budget
    from ibpcache.cache.slab import SLAB_ALIGN

    with _as_config_error():
        resolve_budget(budget, x.nbytes, min_row_bytes, "task.budget", SLAB_ALIGN)


def _budget_text(budget: Any) -> str:
    return f"{budget} of the raw feature bytes" if isinstance(budget, float) else f"{budget} bytes"


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
    validate_demo(cfg)
    import torch

    from ibpcache import Codec, FeatureCache
    from ibpcache.datasets import load_cora

    task = cfg.task
    device = _resolve_device(str(cfg.device))
    graph = load_cora()
    x = graph.features
    _check_demo_budget(task.budget, x, 1)  # before the fit: budgets that hold nothing at all
    n, row_bytes = x.shape[0], x[0].numel() * x.element_size()
    x_u8 = x.reshape(n, -1).view(torch.uint8)
    print(f"ibpcache demo: serving Cora features ({n:,} nodes x {x.shape[1]} float32, {_fmt_bytes(x.nbytes)}, "
          f"{row_bytes} B rows) on {device}", flush=True)

    t0 = time.perf_counter()
    codec = Codec.fit(x)
    packed = codec.compress(x, layout="inplace", pin=False)
    _check_demo_budget(task.budget, x, int(packed.lengths.min()))  # exact: the smallest compressed row
    exact_codec = torch.equal(packed.decompress().reshape(n, -1).view(torch.uint8), x_u8)
    print(f"codec: {codec.chunk_bytes}-byte chunks, compression ratio {packed.ratio:.2f}x "
          f"({_fmt_bytes(x.nbytes)} -> {_fmt_bytes(packed.nbytes)}), round trip "
          f"{'bit-exact' if exact_codec else 'NOT EXACT'}, {time.perf_counter() - t0:.1f} s", flush=True)

    batches = list(sample_batches(graph, int(task.batch_size), [int(f) for f in task.fanouts], int(task.epochs),
                                  int(task.seed)))
    requested = sum(int(b.numel()) for b in batches)
    print(f"id stream: {len(batches)} batches of {task.batch_size} seed nodes + 2-hop neighbours "
          f"(fanouts {list(task.fanouts)}), {requested:,} ids ({requested / len(batches):,.0f} per batch), "
          f"{task.epochs} epochs; cache budget {_budget_text(task.budget)}", flush=True)

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


def validate_serve(cfg: Any) -> None:
    """Check every ``task=serve`` setting before publishing anything; raises ConfigError naming the first bad one."""
    from ibpcache import _shm

    task = cfg.task
    _known_keys(task, ServeTask)
    stores = task.get("stores")
    if not stores or not hasattr(stores, "items"):
        raise _bad("task.stores", stores, "task=serve needs at least one store: task.stores.NAME=/path/to/file.ibp")
    for name, path in stores.items():
        try:
            _shm._check_name(str(name))
        except ValueError as exc:  # the shared-store name rule lives in _shm
            raise _bad(f"task.stores.{name}", path, str(exc)) from None
        if not isinstance(path, str) or not Path(path).is_file():
            raise _bad(f"task.stores.{name}", path, "no such file (a store written by CompressedRows.save)")
    ready = task.get("ready_file")
    if ready is not None and (not isinstance(ready, str) or not ready or not Path(ready).parent.is_dir()):
        raise _bad("task.ready_file", ready, "must be null or a file path in an existing folder")
    if not isinstance(task.get("replace"), bool):
        raise _bad("task.replace", task.get("replace"), "must be true or false")


def run_serve(cfg: Any) -> int:
    """``task=serve``: the store host (``ibpcache.cache.service``); returns when stopped by SIGTERM/SIGINT."""
    validate_serve(cfg)
    from ibpcache.cache.service import serve_config

    serve_config(cfg.task)
    return 0


def validate_gc(cfg: Any) -> None:
    """Check the ``task=gc`` settings before sweeping anything; raises ConfigError naming the bad one."""
    _known_keys(cfg.task, GcTask)
    if not isinstance(cfg.task.get("dry_run"), bool):
        raise _bad("task.dry_run", cfg.task.get("dry_run"), "must be true or false")


def run_gc(cfg: Any) -> int:
    """``task=gc``: sweep shared stores whose owner died (``ibpcache._shm.sweep``); prints what went and stayed."""
    validate_gc(cfg)
    from ibpcache._shm import SHM_DIR, sweep

    dry_run = cfg.task.dry_run
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
    name = cfg.task.get("name")
    if not isinstance(name, str) or name not in TASKS:
        raise _bad("task.name", name, f"unknown task; known: {sorted(TASKS)}")
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
        try:
            status.append(run(cfg))
        except ConfigError as exc:  # a setting, named in the message: no traceback to read through
            print(f"ibpcache: {exc}", file=sys.stderr)
            status.append(2)

    _app()
    sys.exit(status[0] if status else 0)


if __name__ == "__main__":
    main()
