"""Host memory and start-up time of N client processes sharing one store vs each building its own.

Builds an "SU" store from real rows (resampled up to --raw-gb GB), saves it, and for N in --clients:
  shared  a store host (``python -m ibpcache.cache.service``) publishes the file in /dev/shm; N clients
          ``CompressedRows.attach`` it and build a FeatureCache on it;
  own     N clients each resample the raw rows, fit + compress their own store (the old way), drop the raw
          rows and build a FeatureCache on it.
Every client then reads every row once (so every page of its store is resident: the worst case for memory),
checks a fixed sample of rows against a digest of the source rows, reports its timings and waits; the parent
reads Rss and Pss from /proc/<pid>/smaps_rollup of every client (and of the host) while they all hold their
stores, then lets them exit. Pss splits each shared page between the processes mapping it, so sum(Pss) is
the node's real footprint; sum(Rss) counts shared pages once per process.
Writes bench_service.json / .png under --out. CPU here; on a GPU machine pass --device cuda (fit+compress on
the GPU, attached stores page-locked in place with cudaHostRegister, pinned copies in the "own" mode).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ibpcache import Codec, CompressedRows, FeatureCache, datasets
from ibpcache.testing.timing import add_out_argument, format_table, write_results

_SAMPLE = 4096


def _su_rows(name: str, raw_gb: float) -> torch.Tensor:
    return datasets.scale_up(datasets.load_rows(name), int(raw_gb * (1 << 30)), seed=0)


def _sample_ids(n_rows: int) -> torch.Tensor:
    return torch.randint(0, n_rows, (_SAMPLE,), generator=torch.Generator().manual_seed(1234))


def _digest(rows: torch.Tensor) -> str:
    return hashlib.sha256(rows.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _fit_compress(rows: torch.Tensor, device: str, layout: str) -> tuple[CompressedRows, float]:
    t0 = time.perf_counter()
    x = rows.to(device) if device != "cpu" else rows
    codec = Codec.fit(x)
    packed = codec.compress(x, layout=layout, pin=device != "cpu", device=device)
    if device != "cpu":
        torch.cuda.synchronize()
    return packed, time.perf_counter() - t0


def _memory(pid: int) -> dict[str, int]:
    """Rss / Pss / Pss_Shmem / Pss_Anon of a process, bytes (from smaps_rollup, kB there)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss", "Pss_Anon", "Pss_Shmem", "Pss_File"):
            out[key.lower()] = int(rest.split()[0]) * 1024
    return out


# -- client process -----------------------------------------------------------------------------------------

def client(args: argparse.Namespace) -> None:
    """One training process: get a store (attach or build), read every row, report, wait for the parent."""
    rep: dict[str, Any] = {"pid": os.getpid()}
    t0 = time.perf_counter()
    if args.client == "shared":
        packed = CompressedRows.attach(args.name)
        rep["attach_s"] = time.perf_counter() - t0
    else:
        rows = _su_rows(args.dataset, args.raw_gb)
        rep["resample_s"] = time.perf_counter() - t0
        packed, rep["fit_compress_s"] = _fit_compress(rows, args.device, args.layout)
        del rows
        gc.collect()  # fit/compress leave the input in a reference cycle: without this the raw rows stay resident
    t1 = time.perf_counter()
    cache = FeatureCache(packed, budget_bytes=args.budget, device=args.device)
    rep["cache_build_s"] = time.perf_counter() - t1
    step = 8192
    t2 = time.perf_counter()
    for start in range(0, packed.n_rows, step):  # touch every row once
        cache.fetch(torch.arange(start, min(start + step, packed.n_rows), device=args.device))
    if args.device != "cpu":
        torch.cuda.synchronize()
    rep["scan_s"] = time.perf_counter() - t2
    rep["scan_gbps"] = packed.raw_nbytes / rep["scan_s"] / 1e9
    rep["digest"] = _digest(cache.fetch(_sample_ids(packed.n_rows).to(args.device)).cpu())
    rep["store_bytes"] = packed.host_nbytes
    print(json.dumps(rep), flush=True)
    sys.stdin.read()  # the parent measures memory now, then closes our stdin


# -- parent -------------------------------------------------------------------------------------------------

def _spawn(args: argparse.Namespace, mode: str, name: str, n: int,
           host_pid: "int | None") -> tuple[list[dict[str, Any]], "dict[str, int] | None"]:
    """Start n clients, wait for their reports, read every process's memory while all are alive."""
    cmd = [sys.executable, __file__, "--client", mode, "--name", name, "--dataset", args.dataset,
           "--raw-gb", str(args.raw_gb), "--device", args.device, "--layout", args.layout,
           "--budget", str(args.budget)]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    reports = []
    try:
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"client {p.pid} ({mode}) exited with {p.wait()} before reporting")
            reports.append(json.loads(line))
        for rep in reports:
            rep["mem"] = _memory(rep["pid"])
        host_mem = _memory(host_pid) if host_pid is not None else None  # with the clients still attached
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            p.wait(timeout=120)
    return reports, host_mem


def _start_host(store_file: Path, name: str, workdir: Path) -> tuple[subprocess.Popen, dict]:
    ready = workdir / f"ready-{name}.json"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    host = subprocess.Popen([sys.executable, "-m", "ibpcache.cache.service", "--store", f"{name}={store_file}",
                             "--ready-file", str(ready)], env=env)
    while not ready.exists():
        if host.poll() is not None:
            raise RuntimeError(f"store host exited with {host.returncode}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())["stores"][name]
    info["host_start_s"] = time.perf_counter() - t0
    return host, info


def _plot(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, marker in (("shared", "o"), ("own", "s")):
        rs = [r for r in records if r["mode"] == mode]
        a.plot([r["clients"] for r in rs], [r["total_pss_bytes"] / 2**30 for r in rs], marker=marker,
               label=f"{mode}: sum Pss")
        a.plot([r["clients"] for r in rs], [r["total_rss_bytes"] / 2**30 for r in rs], marker=marker,
               linestyle=":", label=f"{mode}: sum Rss")
    a.set_xlabel("client processes")
    a.set_ylabel("host memory (GiB)")
    a.set_title("node host memory, store held by every client")
    a.legend(fontsize=8)
    rs = {r["mode"]: r for r in records if r["clients"] == 1}
    names = ["attach (shared)", "fit+compress (own)"]
    vals = [rs["shared"]["median_attach_s"], rs["own"]["median_fit_compress_s"]]
    b.bar(names, vals)
    b.set_yscale("log")
    b.set_ylabel("seconds (log)")
    b.set_title("getting a store in a new process")
    fig.tight_layout()
    return fig


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="cora", help="real rows to scale up (ibpcache.datasets.DATASETS)")
    ap.add_argument("--raw-gb", type=float, default=1.0, help="raw size of the scaled-up table, GB")
    ap.add_argument("--layout", default="packed", choices=["packed", "inplace"])
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget", type=float, default=0.01, help="cache budget per client (fraction of raw)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the saved store file goes (default: tmp)")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--name", default=None, help=argparse.SUPPRESS)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.client:
        client(args)
        return 0
    counts = [int(c) for c in args.clients.split(",")]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_service_"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = _su_rows(args.dataset, args.raw_gb)
    expected = _digest(rows[_sample_ids(rows.shape[0])])
    packed, t_fc = _fit_compress(rows, args.device, args.layout)
    meta = {"dataset": args.dataset, "n_rows": int(rows.shape[0]), "row_bytes": packed.row_bytes,
            "raw_bytes": packed.raw_nbytes, "store_bytes": packed.host_nbytes, "ratio": packed.ratio,
            "layout": args.layout, "device": args.device, "parent_fit_compress_s": t_fc}
    store_file = workdir / f"{args.dataset}_su.ibp"
    t0 = time.perf_counter()
    packed.save(store_file)
    meta["save_s"] = time.perf_counter() - t0
    del rows, packed
    gc.collect()
    name = f"bench-{os.getpid()}"
    records = []
    host, info = _start_host(store_file, name, workdir)
    meta["host"] = info
    try:
        for n in counts:
            for mode in ("shared", "own"):
                reps, hm = _spawn(args, mode, name, n, host.pid if mode == "shared" else None)
                if any(r["digest"] != expected for r in reps):
                    raise RuntimeError(f"{mode} clients returned rows that differ from the source rows")
                rec = {"mode": mode, "clients": n,
                       "total_pss_bytes": sum(r["mem"]["pss"] for r in reps),
                       "total_rss_bytes": sum(r["mem"]["rss"] for r in reps),
                       "clients_pss_shmem_bytes": sum(r["mem"].get("pss_shmem", 0) for r in reps),
                       "clients_pss_anon_bytes": sum(r["mem"].get("pss_anon", 0) for r in reps),
                       "clients_detail": reps}
                if mode == "shared":  # the host's mapping is part of the node's footprint
                    assert hm is not None
                    rec["host_mem"] = hm
                    rec["total_pss_bytes"] += hm["pss"]
                    rec["total_rss_bytes"] += hm["rss"]
                    rec["median_attach_s"] = sorted(r["attach_s"] for r in reps)[n // 2]
                else:
                    rec["median_fit_compress_s"] = sorted(r["fit_compress_s"] for r in reps)[n // 2]
                rec["median_scan_gbps"] = sorted(r["scan_gbps"] for r in reps)[n // 2]
                records.append(rec)
                print(f"{mode:6s} x{n}: sum Pss {rec['total_pss_bytes'] / 2**20:9.1f} MiB  "
                      f"sum Rss {rec['total_rss_bytes'] / 2**20:9.1f} MiB", flush=True)
    finally:
        host.terminate()
        host.wait(timeout=120)
        store_file.unlink(missing_ok=True)
    paths = write_results(args.out, "bench_service", records, _plot, meta=meta)
    table = [{"mode": r["mode"], "clients": r["clients"], "sum_pss_MiB": round(r["total_pss_bytes"] / 2**20, 1),
              "sum_rss_MiB": round(r["total_rss_bytes"] / 2**20, 1),
              "clients_anon_MiB": round(r["clients_pss_anon_bytes"] / 2**20, 1),
              "clients_shmem_MiB": round(r["clients_pss_shmem_bytes"] / 2**20, 1),
              "startup_s": round(r.get("median_attach_s", r.get("median_fit_compress_s", 0.0)), 4)}
             for r in records]
    print(format_table(table))
    print(f"store: {meta['store_bytes'] / 2**20:.1f} MiB ({args.layout}, ratio {meta['ratio']:.2f}) of "
          f"{meta['raw_bytes'] / 2**20:.1f} MiB raw; wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
