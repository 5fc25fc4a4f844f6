"""A DLRM training step under DDP where every rank serves its embedding tables from ONE shared compressed store.

Run (one process per GPU; issue 12 item 3)::

    torchrun --nproc_per_node=2 scripts/dlrm_ddp.py --out results/           # GPUs: NCCL
    torchrun --nproc_per_node=2 scripts/dlrm_ddp.py --device cpu --out /tmp  # CPU: gloo (what the test runs)

What happens:

1. Rank 0 plays the node's store host: it builds ``--tables`` embedding tables of real trained values (MiniLM rows
   cut to ``--dim`` floats, resampled to ``--rows-per-table`` rows each), IBP-compresses them once (in-place layout)
   and publishes them with ``CompressedRows.share`` (``--store NAME`` instead attaches a store that
   ``python -m ibpcache task=serve`` already hosts). No other rank ever holds the dense tables.
2. Every rank attaches the store (``CompressedRows.attach``: mapped with no copy, page-locked in place for the
   GPU) and builds a ``TableBatchedCachedEmbeddingBag`` over it (``_weight=rows``): the module serves the
   shared bytes, so N ranks use the store's host bytes once, not N times.
3. Each step, every rank takes its shard of the global batch (Zipf ids per table, dense features, labels; the same
   seeded data on every rank), looks the embeddings up (on CUDA one fused, sync-free launch), runs the dense part
   of a DLRM (bottom MLP, pairwise dot interaction, top MLP) wrapped in ``DistributedDataParallel`` and steps SGD;
   right after the lookup it prefetches its next shard's rows (FBGEMM TBE-style) into its GPU cache, on the cache's
   side stream, so they are read while the dense part of the step runs (TorchRec's pipeline).

``--node-cache``: the lookups are served by the node cache instead (``TableBatchedCachedEmbeddingBag.use_node_cache``
over a ``PartitionedFeatureCache`` of ``--cache-ratio`` of the rows per GPU, hotness = the run's id counts): the hottest
rows on every GPU, the warm tail dealt to the GPUs, peers' rows read over NVLink in the same lookup launch, pooled by
``F.embedding_bag``; on CPU ranks it falls back to independent caches (``node_cache`` in the JSON says which).

The embedding tables are frozen here: an attached shared store is read-only (training would rewrite the owner's
rows), so this is the pretrained-embeddings / dense-fine-tuning setting; trainable tables need a private store per
table owner (``TableBatchedCachedEmbeddingBag`` from the dense tensor).

Checks (``--check``, on by default): every rank's embedding output of every step equals ``F.embedding_bag`` over
the store's decoded table bit for bit; rank 0 then trains the same model single-process on the whole global batches
and reports the per-step loss difference and the max abs difference of the final parameters (DDP averages the
ranks' gradients, which changes the float summation order: close, not bit-exact). Writes ``dlrm_ddp.json``
(+ ``dlrm_ddp.png``, the loss curves) under ``--out`` on rank 0; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from ibpcache import Codec, CompressedRows, datasets  # noqa: E402
from ibpcache.cache.partitioned import PartitionedFeatureCache  # noqa: E402
from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag  # noqa: E402
from ibpcache.testing.timing import add_out_argument, write_results  # noqa: E402

__all__ = ["DenseDLRM", "StepData", "main"]


class DenseDLRM(nn.Module):
    """DLRM's dense part: bottom MLP on the dense features, pairwise dot products of [bottom output, one pooled
    embedding per table] (strict upper triangle), top MLP to one logit."""

    def __init__(self, n_dense: int, dim: int, tables: int, hidden: int = 64) -> None:
        super().__init__()
        self.tables, self.dim = tables, dim
        self.bottom = nn.Sequential(nn.Linear(n_dense, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.ReLU())
        feats = tables + 1
        iu = torch.triu_indices(feats, feats, 1)
        self.register_buffer("iu", iu, persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + iu.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``dense`` [B, n_dense], ``emb`` [B, T * D] (the embedding bag's output) -> logits [B]."""
        x = self.bottom(dense)
        feats = torch.cat([x.unsqueeze(1), emb.view(-1, self.tables, self.dim)], 1)  # [B, T + 1, D]
        z = torch.bmm(feats, feats.transpose(1, 2))
        inter = z[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([x, inter], 1)).squeeze(1)


class StepData:
    """The whole run's global batches, identical on every rank (seeded): Zipf ids per table (a stream of
    ``steps * batch * bag`` ids each), Gaussian dense features, labels from a fixed linear teacher."""

    def __init__(self, steps: int, batch: int, bag: int, tables: int, rows_per_table: int, n_dense: int,
                 zipf: float, seed: int) -> None:
        n = steps * batch * bag
        self.ids = torch.stack([datasets.zipf_ids(rows_per_table, n, a=zipf, seed=seed + 1 + t)
                                for t in range(tables)])  # [T, steps * batch * bag], table-local
        gen = torch.Generator().manual_seed(seed)
        self.dense = torch.randn(steps, batch, n_dense, generator=gen)
        teacher = torch.randn(n_dense, generator=gen)
        self.labels = (self.dense @ teacher > 0).float()
        self.batch, self.bag, self.tables = batch, bag, tables

    def local_ids(self, step: int, lo: int, hi: int) -> torch.Tensor:
        """Table-local ids of samples [lo, hi) of ``step``: [T, (hi - lo) * bag] (table t's bags in row t)."""
        base = step * self.batch * self.bag
        return self.ids[:, base + lo * self.bag: base + hi * self.bag]


def module_inputs(local: torch.Tensor, bag: int, device: torch.device) -> tuple[torch.Tensor, Any]:
    """The table-batched module's input for ids [T, B * bag]: a [B, T] matrix (bag 1) or 1-D table-major ids with
    one offset per bag."""
    if bag == 1:
        return local.t().contiguous().to(device), None
    return local.reshape(-1).to(device), torch.arange(0, local.numel(), bag, device=device)


def reference_embeddings(table: torch.Tensor, local: torch.Tensor, rows_per_table: int, bag: int) -> torch.Tensor:
    """``F.embedding_bag`` (sum) over the decoded table, shaped like the module's output [B, T * D]."""
    t, n = local.shape
    glob = (local.to(table.device) + torch.arange(t, device=table.device).unsqueeze(1) * rows_per_table).reshape(-1)
    out = F.embedding_bag(glob, table, torch.arange(0, glob.numel(), bag, device=table.device), mode="sum")
    return out.view(t, n // bag, -1).transpose(0, 1).reshape(n // bag, -1)


def build_store(args: argparse.Namespace, device: torch.device) -> CompressedRows:
    """Rank 0's job as the store host: real rows, compressed once (fitted and encoded on its GPU when it has one),
    in-place layout (what the embedding bags read)."""
    real = datasets.load_minilm()[:, :args.dim].contiguous()
    table = datasets.resample_rows(real, args.tables * args.rows_per_table, seed=args.seed)
    codec = Codec.fit(table.to(device) if device.type == "cuda" else table)
    return codec.compress(table, layout="inplace", pin=False, device=device)


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device, str]:
    """Process group from torchrun's environment; one GPU per local rank (gloo when GPUs are fewer than ranks)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("dlrm_ddp: --device cuda needs CUDA (use --device cpu for gloo on the CPU)")
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        backend = args.backend or ("nccl" if torch.cuda.device_count() >= local_world else "gloo")
    else:
        device = torch.device("cpu")
        backend = args.backend or "gloo"
    if "MASTER_ADDR" not in os.environ:  # a plain single-process run
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    return rank, world, device, backend


class StepTimer:
    """Times a step and its lookup phase without a sync inside the step: CUDA events recorded at the start, after
    the lookup and at the end, read once the end has completed (perf_counter on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(self, a: Any, b: Any) -> float:
        """ms between two marks (call after the later one: it waits for it on the GPU)."""
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def _hit_rate(st: dict[str, Any]) -> "float | None":
    """Rank 0's cache hit rate over the run: the fused inference path's counters on CUDA, else the manager's."""
    if st.get("fused_lookups"):
        return float(st["fused_hits"]) / float(st["fused_lookups"])
    total = float(st.get("hits", 0)) + float(st.get("misses", 0))
    return float(st["hits"]) / total if total else None


def train_single(args: argparse.Namespace, data: StepData, table: torch.Tensor, device: torch.device
                 ) -> tuple[list[float], DenseDLRM]:
    """The single-process run the DDP run must match: same init, whole global batches, same SGD."""
    torch.manual_seed(args.seed)
    model = DenseDLRM(args.dense, args.dim, args.tables).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        emb = reference_embeddings(table, data.local_ids(step, 0, args.batch), args.rows_per_table, args.bag)
        loss = F.binary_cross_entropy_with_logits(model(data.dense[step].to(device), emb),
                                                  data.labels[step].to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model


def plot(records: list[dict[str, Any]]):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss_ddp"] for r in records], "o-", label="DDP (embeddings from the shared store)")
    if records and records[0].get("loss_single") is not None:
        ax.plot(steps, [r["loss_single"] for r in records], "x--", label="single process, decoded table")
    ax.set_xlabel("step")
    ax.set_ylabel("BCE loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(p)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--backend", default=None, help="nccl / gloo (default: nccl with one GPU per rank, else gloo)")
    p.add_argument("--store", default=None, help="attach this shared store (hosted by `python -m ibpcache "
                                                 "task=serve`) instead of rank 0 sharing one")
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows-per-table", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=32, help="floats per embedding row (32 = 128-byte rows)")
    p.add_argument("--dense", type=int, default=13, help="dense features per sample (Criteo has 13)")
    p.add_argument("--batch", type=int, default=4096, help="global batch (split evenly over the ranks)")
    p.add_argument("--bag", type=int, default=1, help="ids per table per sample (summed)")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--cache-ratio", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefetch", action="store_true", help="do not prefetch the next shard's rows after a lookup")
    p.add_argument("--node-cache", action="store_true",
                   help="serve lookups from the node cache (PartitionedFeatureCache: hottest rows on every GPU, the "
                        "warm tail dealt to the GPUs, peers' rows read over NVLink), --cache-ratio of the rows per "
                        "GPU, hotness = the run's id counts")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the exactness checks (they decode the whole table on every rank)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest parameter difference from the single-process run that passes the check")
    p.add_argument("--port", type=int, default=29531, help="rendezvous port when not started by torchrun")
    p.add_argument("--name", default="dlrm_ddp")
    return p.parse_args(argv)


def main(argv: "list[str] | None" = None) -> int:
    args = parse_args(argv)
    rank, world, device, backend = setup(args)
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must split evenly over {world} ranks")
    segment = None
    name = args.store or f"dlrm-ddp-{os.environ.get('MASTER_PORT', args.port)}"
    try:
        t0 = time.perf_counter()
        if args.store is None and rank == 0:
            segment = build_store(args, device).share(name)
        build_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        rows = CompressedRows.attach(name)
        attach_s = time.perf_counter() - t0
        if args.store is not None:  # the hosted store defines the tables: equal-sized tables of its rows
            args.dim = int(rows.shape[1])
            args.rows_per_table = rows.n_rows // args.tables
        sizes = [args.rows_per_table] * args.tables
        if sum(sizes) != rows.n_rows:
            raise SystemExit(f"the store holds {rows.n_rows} rows, not {args.tables} tables x {args.rows_per_table}")
        emb = TableBatchedCachedEmbeddingBag(sizes, args.dim, _weight=rows, mode="sum", cache_ratio=args.cache_ratio,
                                             warmup_ratio=0.0, device=device)
        emb.requires_grad_(False)  # frozen: the shared store is read-only
        emb.eval()
        no_copy = rows.shared.contains(emb.cache_weight_mgr.store.data.data_ptr())  # the segment itself, no copy

        data = StepData(args.steps, args.batch, args.bag, args.tables, args.rows_per_table, args.dense, args.zipf,
                        args.seed)
        node = None
        if args.node_cache:  # every rank's hotness: the whole run's ids (the static top-k oracle), the same everywhere
            glob = data.ids + torch.arange(args.tables).unsqueeze(1) * args.rows_per_table
            hot = torch.bincount(glob.reshape(-1), minlength=rows.n_rows).to(torch.float64)
            node = PartitionedFeatureCache(rows, hot, budget_bytes=args.cache_ratio, device=device)
            emb.use_node_cache(node)
        shard = args.batch // world
        lo, hi = rank * shard, (rank + 1) * shard
        decoded = rows.decompress(device).view(rows.n_rows, -1) \
            if args.check else None

        torch.manual_seed(args.seed)
        model = DenseDLRM(args.dense, args.dim, args.tables).to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

        inputs = [module_inputs(data.local_ids(s, lo, hi), args.bag, device) for s in range(args.steps)]
        prefetch = not args.no_prefetch
        if prefetch:
            emb.prefetch(*inputs[0])
        losses, step_ms, lookup_ms, mismatched = [], [], [], 0
        timer = StepTimer(device)
        for step in range(args.steps):
            dense = data.dense[step, lo:hi].to(device)
            labels = data.labels[step, lo:hi].to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # time each step alone
            t_start = timer.mark()
            with torch.no_grad():
                out = emb(*inputs[step])  # the fused, sync-free lookup on CUDA
            if prefetch and step + 1 < args.steps:  # TorchRec's pipeline: the next shard's rows are read on the
                emb.prefetch(*inputs[step + 1])  # cache's side stream while this step's dense part runs
            t_lookup = timer.mark()
            loss = F.binary_cross_entropy_with_logits(ddp(dense, out), labels)
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the dense gradients here
            opt.step()
            t_end = timer.mark()
            step_ms.append(timer.elapsed(t_start, t_end))
            lookup_ms.append(timer.elapsed(t_start, t_lookup))
            if decoded is not None:
                want = reference_embeddings(decoded, data.local_ids(step, lo, hi), args.rows_per_table, args.bag)
                mismatched += int(not torch.equal(out.contiguous().view(torch.uint8), want.view(torch.uint8)))
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # equal shards: the mean of the ranks' means is the global batch's mean
            losses.append(float(mean_loss) / world)
        emb.check_errors()
        if node is not None:
            node.check_errors()

        summary = torch.tensor([mismatched, int(no_copy)], dtype=torch.int64, device=device)
        dist.all_reduce(summary)
        st = emb.stats()
        result: dict[str, Any] = {
            "world": world, "backend": backend, "device": str(device), "store": name,
            "store_hosted": args.store is not None,
            "store_bytes": rows.nbytes, "raw_bytes": rows.raw_nbytes, "store_ratio": rows.ratio,
            "build_and_share_s": build_s if rank == 0 and args.store is None else None, "attach_s": attach_s,
            "ranks_serving_without_copy": int(summary[1]), "steps_with_wrong_embeddings": int(summary[0]),
            "median_step_ms": statistics.median(step_ms), "median_lookup_ms": statistics.median(lookup_ms),
            "samples_per_s": args.batch / (statistics.median(step_ms) * 1e-3),
            "hit_rate": _hit_rate(st), "prefetched_rows": st.get("prefetched_rows"),
            "host_layout": "adopted shared store (compressed, read-only)",
        }
        if node is not None:
            nst = st["node"]
            result["hit_rate"] = nst["hit_rate"]
            result["node_cache"] = {k: nst[k] for k in ("hit_rate", "local_hits", "peer_hits", "host_misses",
                                                        "replicated_rows", "owned_rows", "node_cached_rows",
                                                        "peer_access", "fallback_reason", "replicate",
                                                        "costs_rule", "source_costs_us_per_row", "setup_check")}
        single: "list[float] | None" = None
        ok = result["steps_with_wrong_embeddings"] == 0 and result["ranks_serving_without_copy"] == world
        if rank == 0 and decoded is not None:
            single, ref_model = train_single(args, data, decoded, device)
            diffs = [float((a.detach() - b.detach()).abs().max()) for a, b in
                     zip(model.parameters(), ref_model.parameters())]
            result.update(single_process_max_param_diff=max(diffs),
                          single_process_max_loss_diff=max(abs(a - b) for a, b in zip(losses, single)),
                          params_bit_exact=all(d == 0.0 for d in diffs))
            ok = ok and result["single_process_max_param_diff"] < args.tolerance
        if rank == 0:
            records = [{"step": i, "loss_ddp": losses[i], "loss_single": None if single is None else single[i],
                        "step_ms": step_ms[i], "lookup_ms": lookup_ms[i]} for i in range(args.steps)]
            meta = {k: v for k, v in vars(args).items() if k != "out"}
            meta.update(result, checks_passed=ok)
            paths = write_results(args.out, args.name, records, plot, meta=meta)
            print(f"dlrm_ddp: {world} ranks ({backend}, {device.type}), {args.tables} tables x {args.rows_per_table} "
                  f"rows x {args.dim * 4} B, store {rows.nbytes / 1e6:.1f} MB ({rows.ratio:.3f}x), attach "
                  f"{attach_s * 1e3:.1f} ms; step {result['median_step_ms']:.2f} ms median "
                  f"(lookup {result['median_lookup_ms']:.2f} ms), {result['samples_per_s']:.0f} samples/s; "
                  f"wrong-embedding steps {result['steps_with_wrong_embeddings']}, ranks without copy "
                  f"{result['ranks_serving_without_copy']}/{world}; vs single process: max param diff "
                  f"{result.get('single_process_max_param_diff')}, max loss diff "
                  f"{result.get('single_process_max_loss_diff')}; wrote {paths}", flush=True)
        flag = torch.tensor([int(ok)], device=device)
        dist.broadcast(flag, 0)
        if node is not None:
            node.close()  # every rank unmaps its peers' slabs before any rank frees its own
        dist.barrier()
        return 0 if int(flag) else 1
    finally:
        if segment is not None:
            segment.unlink()
            segment.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
