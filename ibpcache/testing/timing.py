"""Timing and result-writing helpers shared by the benchmark scripts.

One place for the rules every benchmark follows: warm up first, time GPU work with CUDA events on the current
stream (host timers would measure launch latency), report medians with p10/p90, and write JSON + PNG under one
output folder (``--out``, default ``$OUT`` or ``results/``). Nothing here touches CUDA or imports matplotlib
until called.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DeviceError, InvalidArgumentError, InvalidTypeError

__all__ = [
    "summarize",
    "cuda_time",
    "cpu_time",
    "default_out_dir",
    "add_out_argument",
    "environment_info",
    "write_results",
    "format_table",
]

#: Buffers used to evict L2 between timed iterations, one per device (allocated on first use).
_L2_FLUSH_BUFFERS: dict[int, torch.Tensor] = {}


def summarize(times_ms: Sequence[float]) -> dict[str, Any]:
    """Median / p10 / p90 / min / mean of per-iteration times in milliseconds, plus the raw list (``all``)."""
    if len(times_ms) == 0:
        raise InvalidArgumentError("summarize needs at least one timing")
    arr = np.asarray(times_ms, dtype=np.float64)
    p10, med, p90 = np.percentile(arr, [10, 50, 90])
    return {
        "median_ms": float(med),
        "p10": float(p10),
        "p90": float(p90),
        "min_ms": float(arr.min()),
        "mean_ms": float(arr.mean()),
        "iters": int(arr.size),
        "all": [float(t) for t in arr],
    }


def _check_iters(warmup: int, iters: int) -> None:
    if warmup < 0 or iters < 1:
        raise InvalidArgumentError(f"need warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")


def _flush_l2() -> None:
    """Overwrite twice the L2 size so the next iteration starts cold (the cache cannot keep it warm)."""
    dev = torch.cuda.current_device()
    buf = _L2_FLUSH_BUFFERS.get(dev)
    if buf is None:
        l2_bytes = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or (64 << 20)
        buf = _L2_FLUSH_BUFFERS[dev] = torch.empty(2 * l2_bytes, dtype=torch.uint8, device=f"cuda:{dev}")
    buf.zero_()


def cuda_time(fn: Callable[[], Any], warmup: int = 5, iters: int = 20, *, flush_l2: bool = False) -> dict[str, Any]:
    """Time ``fn`` with CUDA events recorded on the current stream around each call; see :func:`summarize`.

    ``fn`` must enqueue its work on the current stream (or synchronise other streams itself). With
    ``flush_l2=True`` an L2-sized write runs between iterations, outside the timed region, so repeated reads of
    the same small input do not hit a warm cache.
    """
    _check_iters(warmup, iters)
    if not torch.cuda.is_available():
        raise DeviceError("cuda_time needs a CUDA device; use cpu_time on the host")
    for _ in range(warmup):
        fn()
    stream = torch.cuda.current_stream()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        if flush_l2:
            _flush_l2()
        start.record(stream)
        fn()
        end.record(stream)
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends)])


def cpu_time(
    fn: Callable[[], Any], warmup: int = 5, iters: int = 20, *, sync_cuda: bool = False
) -> dict[str, Any]:
    """Wall-clock twin of :func:`cuda_time` (``time.perf_counter``); same result keys.

    ``sync_cuda=True`` synchronises the device after every call, for host-driven work that launches kernels.
    """
    _check_iters(warmup, iters)
    sync = torch.cuda.synchronize if sync_cuda else (lambda: None)
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return summarize(times)


def default_out_dir() -> Path:
    """Where results go when no ``--out`` is given: ``$OUT`` if set (the GPU machine returns it), else ``results``."""
    return Path(os.environ.get("OUT") or "results")


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """Add the ``--out`` option every benchmark shares."""
    parser.add_argument(
        "--out", type=Path, default=default_out_dir(), help="output folder for JSON/PNG (default: $OUT or results/)"
    )


def _git_commit() -> str | None:
    """The commit the results come from: ``$IBPCACHE_GIT_COMMIT`` when set (a copy of the working tree on another
    machine may carry a stale ``.git``, so the sender names the commit), else ``git rev-parse`` here."""
    named = os.environ.get("IBPCACHE_GIT_COMMIT", "").strip()
    if named:
        return named
    try:
        res = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None


def environment_info() -> dict[str, Any]:
    """Versions and device, stored with every result so numbers can be traced to a machine."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "host": platform.node(),
        "git_commit": _git_commit(),
        "cuda_available": torch.cuda.is_available(),
    }
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda
        )
    cupy = sys.modules.get("cupy")  # reported only if the benchmark already uses it
    if cupy is not None:
        info["cupy"] = getattr(cupy, "__version__", None)
    return info


def _to_json(obj: Any) -> Any:
    """JSON fallback for the values benchmarks produce (NumPy/torch scalars and arrays, paths)."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, Path | torch.dtype | torch.device):
        return str(obj)
    raise InvalidTypeError(f"cannot write {type(obj).__name__} to JSON")


def _clean_floats(obj: Any) -> Any:
    """NaN/inf are not JSON; store them as None so every reader can parse the file."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean_floats(v) for v in obj]
    return obj


def write_results(
    out_dir: str | os.PathLike[str] | None,
    name: str,
    records: list[dict[str, Any]],
    plot_fn: Callable[[list[dict[str, Any]]], Any] | None = None,
    *,
    meta: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write ``<out_dir>/<name>.json`` (records + environment + ``meta``) and, given ``plot_fn``, ``<name>.png``.

    ``plot_fn(records)`` draws with matplotlib and returns the Figure (or None to use the current figure); it runs
    under the non-interactive Agg backend unless pyplot was already set up. ``extra`` adds top-level keys (a schema an
    issue names, e.g. ``points``). Returns the paths written.
    """
    if not name or "/" in name or name.startswith("."):
        raise InvalidArgumentError(f"result name must be a plain file stem, got {name!r}")
    folder = Path(out_dir) if out_dir is not None else default_out_dir()
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "name": name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "env": environment_info(),
        "meta": meta or {},
        **(extra or {}),
        "records": records,
    }
    text = json.dumps(payload, indent=1, default=_to_json)
    text = json.dumps(_clean_floats(json.loads(text)), indent=1, allow_nan=False)
    json_path = folder / f"{name}.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(text + "\n")
    tmp.replace(json_path)  # readers never see a half-written file
    paths = {"json": json_path}
    if plot_fn is not None:
        paths["png"] = _save_plot(folder / f"{name}.png", plot_fn, records)
    return paths


def _save_plot(path: Path, plot_fn: Callable[[list[dict[str, Any]]], Any], records: list[dict[str, Any]]) -> Path:
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_fn(records) or plt.gcf()
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def format_table(records: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A compact fixed-width text table of ``records`` (floats with 4 significant digits) for terminal logs."""
    if not records:
        return "(no records)"
    cols = list(columns) if columns is not None else list(dict.fromkeys(k for r in records for k in r))

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    rows = [[cell(r.get(c)) for c in cols] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
