#!/usr/bin/env python3
"""GraphSAGE with DDP over the GPUs of one node: one shared compressed store, the partitioned GPU cache.

    torchrun --nproc_per_node=2 scripts/train_gnn_ddp.py --out DIR [Hydra overrides]   # DDP modes + the reference
    python scripts/train_gnn_ddp.py --world 2 --out DIR [overrides]                    # the reference alone (1 process)
    torchrun --nproc_per_node=2 scripts/train_gnn_ddp.py --quick --device cpu --out DIR # CPU smoke run (gloo)

Rank 0 builds the node feature table once (Cora-SU by default: a seeded power-law graph whose nodes carry real Cora
rows), compresses it and publishes it in POSIX shared memory; every rank attaches it (no copy; ``--attach NAME``
uses a store that ``python -m ibpcache task=serve`` already holds, made with ``--save-store FILE``). Modes, run one
after the other in the same processes, same seeds:

  partitioned  DDP; ``PartitionedFeatureCache``, the node cache: the hottest rows on every GPU, the warm tail dealt
               to the GPUs (node capacity up to W x one GPU's); a row cached on a peer is read by the one lookup
               launch straight from the peer's slab (CUDA IPC, NVLink), no collective and no host sync per fetch;
               without peer access (CPU, gloo) independent caches, as ``stats()["fallback_reason"]`` says
  per_gpu      DDP; a ``FeatureCache`` per GPU over the same store, same budget (every GPU caches the same hot rows:
               what a DDP job does without the partitioned cache)
  reference    ONE process on one GPU (rank 0's; the other ranks wait) with a ``FeatureCache`` of one GPU's budget,
               running the same global batches: the W ranks' micro-batches one after the other, each gradient
               scaled by 1/W and summed in rank order (what DDP's all-reduce computes), one optimizer step per
               global batch. It is the 1-GPU epoch time the DDP epochs are compared with, and the loss reference.

Pipelined (``model.pipelined``, default on; ``model.pipelined=false`` for the loop in turn): every process samples
its micro-batches ahead in a thread on the GPU (``model.sample_chunk`` per call, capped at half a rank's epoch and
raised to the smallest divisor of its micro-batches per epoch, :func:`rank_chunk`; ``--chunk-as-given`` keeps it),
fetches the next one's features on a side stream and trains on the current one, with
``ibpcache.loaders.pipeline.PipelinedLoader``. No mode's fetch is a collective, so every mode may fetch from the
loader's thread. The loader runs once over every epoch, so the next epoch's first micro-batches are sampled and
fetched while this epoch's last steps train (``--epoch-by-epoch``: a new loader run per epoch, each starting with an
empty pipeline). ``--interleave`` runs one epoch of each mode in turn
(per-epoch loaders, so no mode's loader runs ahead while another trains) instead of the modes one after the other:
on a host whose speed drifts between runs, every mode then meets the same moments. ``--profile-epoch N`` records
every thread's host time, kernel launches and top ops in epoch N of each mode and rank (``host_profile`` in the
records): where a host-bound epoch goes (the trainer, the autograd thread, the sampler, the fetch thread).

What matches what. Batches, neighbour samples and dropout masks depend only on (seed, epoch, step, rank): samples
are hashed from that key (ibpcache's ``NeighborSampler``: the same on any device and in any chunk of micro-batches)
and dropout masks come from per-rank generators, so each micro-batch is the same in DDP and in the reference, and
pipelined or not.
Features are bit-exact in every mode (checked: the first ``model.verify_batches`` batches of epoch 1 against the
source rows, byte for byte). With deterministic kernels (``model.deterministic``) the forward and backward of a
micro-batch are then bit-identical, DDP's gradient is ``g_0/W + g_1/W`` (the reducer multiplies by 1/W, NCCL sums
two values: commutative, exact), the reference computes the same sum, so for W = 2 losses and test predictions are
expected to be bit-identical (``identical_losses_vs_reference``). For W > 2 NCCL's ring sums in another order than
rank order, so losses agree to rounding only (``max_abs_loss_diff`` says how far). With ``model.step_graphs``
(default) every micro-batch is padded and trained by the example's ``GraphedStep`` (forward and backward replayed
from CUDA graphs on a GPU, the same padded step eagerly on the CPU) in the ranks and in the reference alike, and the
ranks run without the DDP wrapper: each rank's flat gradient is scaled by 1/W and all-reduced in one call
(:func:`mean_all_reduce`), the same sum. ``model.step_graphs=false``: eager unpadded steps under DDP. Not expected
to match: a single-GPU run with one batch of W x B seeds (one sample of the union, mean over all seeds: other rounding).
Timings: epoch time = mean of epochs 2..N (slowest rank); per stage (sample on the GPU in plain torch, fetch, train
step) the summed spans of CUDA events on each stage's own stream (no sync in the loop; pipelined, the spans overlap
and their sum exceeds the epoch); plus a probe of fetch throughput of batches that are all peer hits vs all host
misses vs all local hits (CUDA events, medians). Rank 0 writes ``train_gnn_ddp.json`` and ``.png`` to ``--out``.
The train stage is split on the device into ``forward``, ``backward`` (until the last parameter's gradient is
accumulated: the compute), ``allreduce`` (from there until ``backward()`` returns: DDP's gradient all-reduce,
including the wait for the slower rank) and ``optimizer``; on the host, ``train_host`` is the training thread's own
time issuing a step, ``wait_batch`` its time blocked on the loader for the next micro-batch and ``fetch_host`` the
fetch stage's host time per call. Each of these per rank too (``<stage>_ms_per_rank``). A train stage slower in one
mode than another is then compute (forward/backward: kernels slowed by overlapping work), rank skew or link traffic
(allreduce), or a host-bound step (train_host close to train). Every cache here validates ids lazily on CUDA (no host
sync per fetch), so the modes' fetch threads behave alike. ``--modes`` runs the modes in the order given (e.g.
``per_gpu,partitioned,reference`` to see an order effect), ``--ddp-plain`` wraps the model in DDP with torch's
defaults instead of ``DDP_OPTIONS`` (gradients as bucket views, static graph) and ``--node-replicate`` sizes the node
cache's head (1.0: the node cache's code path with no peer rows, a control for peer traffic).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Iterator

# cuBLAS reads this when it starts: deterministic GEMM workspaces (same rule as scripts/train_gnn.py).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples.gnn and scripts.* live in the repository, not in the installed package
    sys.path.insert(0, str(ROOT))

from examples.gnn import pipeline as gnn  # noqa: E402
from ibpcache import CompressedRows, FeatureCache  # noqa: E402
from ibpcache.cache.partitioned import HOST, LOCAL, PEER, PartitionedFeatureCache  # noqa: E402
from ibpcache.loaders.pipeline import PipelinedLoader, StepsInFlight, frozen_gc  # noqa: E402
from ibpcache.loaders.sampling import NeighborSampler, batch_key  # noqa: E402
from ibpcache.testing import add_out_argument, format_table, write_results  # noqa: E402
from ibpcache.testing.stages import all_threads_profile, thread_summary  # noqa: E402

CONF_DIR = ROOT / "configs"
QUICK = ["dataset.n_nodes=20000", "dataset.avg_degree=10", "dataset.n_train=1024", "dataset.n_test=512",
         "dataset.batch_size=128", "epochs=3", "model.hidden=32", "model.eval_batch_size=256"]
MODES = ("partitioned", "per_gpu", "reference")
#: issue 12's targets: 2-GPU DDP epoch >= 1.8x faster than 1 GPU; node cache capacity = 2x one GPU's.
TARGET_SPEEDUP, TARGET_CAPACITY = 1.8, 2.0


# ----------------------------------------------------------------------------------------------------------------
# Process group


@dataclass
class Ranks:
    """Who this process is: ``world`` (virtual) ranks; ``distributed`` False for the single-process reference."""

    rank: int
    world: int
    distributed: bool
    device: torch.device
    host_group: Any = None  # gloo group for Python objects and for waiting while rank 0 runs the reference
    cache_group: Any = None  # the partitioned cache's own group (its collectives never interleave with DDP's)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.host_group)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (everyone gets the list)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.host_group)
        return out


def init_ranks(world: int, device: str) -> Ranks:
    """torchrun -> one process per GPU (NCCL; gloo with ``--device cpu``); plain python -> one process."""
    if "RANK" not in os.environ:
        dev = torch.device("cuda", 0) if device != "cpu" and torch.cuda.is_available() else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return Ranks(0, world, False, dev)
    cpu = device == "cpu" or not torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cpu") if cpu else torch.device("cuda", local)
    if not cpu:
        torch.cuda.set_device(dev)
    # long timeout: the other ranks wait while rank 0 runs the reference alone. device_id binds the NCCL groups to
    # this rank's GPU (their barriers use it instead of guessing one from the global rank) and creates their
    # communicators now, not inside the first collective of whichever thread reaches one first.
    dist.init_process_group("gloo" if cpu else "nccl", timeout=timedelta(minutes=30),
                            device_id=None if cpu else dev)
    r = Ranks(dist.get_rank(), dist.get_world_size(), True, dev)
    r.host_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
    r.cache_group = dist.new_group(backend="gloo" if cpu else "nccl", timeout=timedelta(minutes=30))
    return r


# ----------------------------------------------------------------------------------------------------------------
# Graph and sampling (plain torch, on the training device)


class BlockSampler:
    """DGL-style blocks (``fanouts`` in DGL's layer order, input layer first) from ibpcache's plain-torch
    ``NeighborSampler`` on ``device``: up to ``fanouts[l]`` distinct uniform in-neighbours per destination node; a
    block's source nodes are its destination nodes first, then the new neighbours (ascending). A sample depends only
    on its seeds and key (seed, epoch, step, rank), so every process, device and chunk of micro-batches draws the
    same blocks."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, n_nodes: int, fanouts: "tuple[int, ...]",
                 device: torch.device, hop_kernel: bool = True) -> None:
        self.core = NeighborSampler(src, dst, n_nodes, list(reversed(fanouts)), device=device, edge_ids=False,
                                    groups=True, hop_kernel=hop_kernel)
        self.fanouts = tuple(int(f) for f in fanouts)
        self.device = device

    @property
    def in_degree(self) -> torch.Tensor:
        return self.core.in_degree

    def sample(self, seeds: torch.Tensor, key: int) -> tuple[torch.Tensor, list[gnn.Block]]:
        """(input node ids, blocks input layer first) for distinct ``seeds``."""
        return self.sample_many([seeds], [key])[0]

    def sample_many(self, seeds: "list[torch.Tensor]", keys: "list[int]"
                    ) -> list[tuple[torch.Tensor, list[gnn.Block]]]:
        """Several micro-batches in one call (each exactly as if sampled alone)."""
        return [(s.nodes, [gnn.Block.from_hop(h, self.device) for h in reversed(s.hops)])
                for s in self.core.sample(seeds, keys)]


def even_chunk(n: int, chunk: int) -> int:
    """The smallest divisor of ``n`` (a rank's micro-batches per epoch) that is at least ``chunk``, or ``n``.

    A sampler call costs about 680 kernel launches whatever its size plus about 37 per micro-batch (s31's profile:
    2,404 launches for a rank's 10 micro-batches in calls of 4, 4, 2; 4,130 for the reference's 20 in five calls of
    4), so a short last call costs nearly a full call's host time on every rank, every epoch: with 4 a rank made 3
    calls where 2.5 would halve the reference's 5. With a divisor every process makes exactly its share of calls."""
    chunk = max(1, chunk)
    if n <= chunk:
        return max(n, 1)
    return next(d for d in range(chunk, n + 1) if n % d == 0)


def rank_chunk(n: int, chunk: int) -> int:
    """Micro-batches per sampler call for a rank with ``n`` micro-batches per epoch: :func:`even_chunk` of ``chunk``
    capped at half an epoch, so that at least two calls feed an epoch and its first steps train while the rest is
    sampled (the single-GPU default of 10 per call is two calls of an epoch's 20 batches, measured on an H200 in
    docs/results/2026-11-27-h200-s39; a rank's 10 micro-batches keep s38's 5 per call)."""
    return even_chunk(n, min(max(1, chunk), max(1, n // 2)))


DDP_OPTIONS = {"gradient_as_bucket_view": True, "static_graph": True}
"""What a DDP user sets for a model whose graph never changes: gradients live in the all-reduce buckets (no copy of
each gradient into its bucket and back) and the reducer skips its per-iteration graph bookkeeping. Neither changes a
value: the bucket holds the same gradient, the all-reduce sums the same two numbers."""


def generator(device: torch.device, *key: int) -> torch.Generator:
    """A generator seeded by a tuple (seed, phase, epoch, step, rank): the same draws in every process."""
    digest = hashlib.sha256(np.asarray(key, dtype=np.int64).tobytes()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class RankedSAGE(gnn.GraphSAGE):
    """GraphSAGE whose dropout masks come from one generator per (virtual) rank, so the reference process draws
    each micro-batch's masks exactly as the DDP rank that trains it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gens: dict[int, torch.Generator] = {}

    def use_rank(self, rank: int, device: torch.device) -> None:
        if rank not in self._gens:
            self._gens[rank] = generator(device, self._seed, 3, rank)
        self._gen = self._gens[rank]


# ----------------------------------------------------------------------------------------------------------------
# One training run


@dataclass
class StageTimer:
    """Seconds per stage, from CUDA events read once per epoch (no sync in the loop), or perf_counter on CPU; host
    spans (``add_host``: seconds measured on the host, on any device) are summed as they are.

    Stages are added from several threads: the sampler thread keeps recording while the training thread reads an
    epoch's totals, so ``totals`` takes the spans added so far under a lock and waits on each of their events (a device
    synchronize does not cover an event recorded after it, and ``elapsed_time`` on one raises)."""

    device: torch.device
    marks: list[tuple[str, Any, Any]] = field(default_factory=list)
    host: list[tuple[str, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def mark(self) -> Any:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, stage: str, start: Any, end: Any) -> None:
        with self._lock:
            self.marks.append((stage, start, end))

    def add_host(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.host.append((stage, seconds))

    def totals(self) -> dict[str, float]:
        with self._lock:
            marks, self.marks = self.marks, []
            host, self.host = self.host, []
        out: dict[str, float] = {}
        for stage, a, b in marks:
            if self.device.type == "cuda":
                a.synchronize()
                b.synchronize()
                sec = a.elapsed_time(b) / 1e3
            else:
                sec = b - a
            out[stage] = out.get(stage, 0.0) + sec
        for stage, sec in host:
            out[stage] = out.get(stage, 0.0) + sec
        return out


STAGES = ("sample", "fetch", "train", "forward", "backward", "allreduce", "optimizer", "train_host", "wait_batch",
          "fetch_host")
"""Per-epoch stage times recorded per mode (module docstring)."""


class GradsReady:
    """A mark taken when each parameter's gradient has been accumulated (``register_post_accumulate_grad_hook``):
    after ``backward()`` the latest one is where the backward compute ended, before DDP's all-reduce of the last
    bucket finished. Recording a CUDA event changes no result."""

    def __init__(self, model: torch.nn.Module, timer: StageTimer) -> None:
        self.timer = timer
        self.last: Any = None
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in model.parameters()
                        if p.requires_grad]

    def _hook(self, _param: torch.Tensor) -> None:
        self.last = self.timer.mark()

    def take(self) -> Any:
        last, self.last = self.last, None
        return last

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def host_profile(job: "Job", run: "Run") -> Iterator[None]:
    """Epoch ``job.profile_epoch`` of ``run`` (counted from 0) under the profiler, every thread of this process
    recorded: ``run.profile`` gets :func:`~ibpcache.testing.stages.thread_summary`'s per-thread host time, launches
    and top ops, so a host-bound epoch shows which thread (trainer, sampler, fetch) spends it on what. The
    profiler slows the host: that epoch's times are not comparable (``summarize`` skips it)."""
    if job.profile_epoch is None or len(run.epochs) != job.profile_epoch:
        yield
        return
    prof = all_threads_profile(job.ranks.device.type == "cuda")
    with prof:
        yield
        _sync(job.ranks.device)
    run.profile = {"epoch": job.profile_epoch, **thread_summary(prof.events())}


def batches_timed(loop: Any, timer: StageTimer) -> "Iterator[MicroBatch]":
    """``loop``'s micro-batches; the time the training thread waits for each goes to ``wait_batch``."""
    it = iter(loop)
    while True:
        t0 = time.perf_counter()
        mb = next(it, None)
        if mb is None:
            return
        timer.add_host("wait_batch", time.perf_counter() - t0)
        yield mb


@dataclass
class Run:
    """What one mode measured on one rank."""

    mode: str
    rank: int
    epochs: list[dict[str, float]] = field(default_factory=list)
    losses: dict[int, list[float]] = field(default_factory=dict)  # (virtual) rank -> loss per step, all epochs
    predictions: dict[int, list[int]] = field(default_factory=dict)  # (virtual) rank -> test predictions
    correct: int = 0
    tested: int = 0
    cache: dict[str, Any] = field(default_factory=dict)
    probe: dict[str, Any] = field(default_factory=dict)
    setup_s: float = 0.0
    pipelined: bool = True
    across_epochs: bool = False
    verified: int = 0  # micro-batches whose features were checked against the source rows
    profile: dict[str, Any] = field(default_factory=dict)  # host_profile's summary of the profiled epoch


@dataclass
class Job:
    """What every mode shares: data set, sampler, store, config."""

    ds: gnn.GnnDataset
    rows: CompressedRows
    sampler: BlockSampler
    cfg: gnn.TrainConfig
    budget: float
    ranks: Ranks
    labels: torch.Tensor  # on the device
    node_replicate: "str | float" = "auto"  # the node cache's head: "auto" (measured costs) or a budget fraction
    across_epochs: bool = True  # pipelined: one loader run over every epoch (module docstring)
    profile_epoch: "int | None" = None  # this epoch of every mode runs under torch.profiler (host_profile)
    track_sources: bool = True  # the node cache counts local / peer / host reads per fetch (a few small ops)
    ddp_plain: bool = False  # DDP with torch's defaults instead of DDP_OPTIONS
    chunk_as_given: bool = False  # sample cfg.sample_chunk micro-batches per call even where it leaves a short call

    @property
    def world(self) -> int:
        return self.ranks.world

    def steps_per_epoch(self) -> int:
        return int(self.ds.train_nids.numel()) // (self.world * self.cfg.batch_size)

    def sample_chunk(self) -> int:
        """Micro-batches per sampler call: ``cfg.sample_chunk``, or the smallest divisor of a rank's micro-batches
        per epoch that is at least that, at most half an epoch (see :func:`rank_chunk`); the reference uses the same
        number."""
        return max(1, self.cfg.sample_chunk) if self.chunk_as_given else rank_chunk(self.steps_per_epoch(),
                                                                                       self.cfg.sample_chunk)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The seeded permutation of the training nodes that epoch ``epoch``'s global batches are cut from."""
        return torch.randperm(self.ds.train_nids.numel(), generator=generator(torch.device("cpu"), self.cfg.seed, 1,
                                                                              epoch))

    def seeds(self, epoch: int, step: int, rank: int, order: "torch.Tensor | None" = None) -> torch.Tensor:
        """Rank ``rank``'s slice of global batch ``step`` (W x B seeds of one seeded permutation per epoch)."""
        perm = self.epoch_order(epoch) if order is None else order
        b = self.cfg.batch_size
        lo = (step * self.world + rank) * b
        return self.ds.train_nids[perm[lo:lo + b]]

    def test_shard(self, rank: int) -> list[torch.Tensor]:
        """Rank ``rank``'s test batches; every rank gets the same number (some may be empty)."""
        shards = self.ds.test_nids.tensor_split(self.world)
        eb = self.cfg.eval_batch_size
        n = max(math.ceil(s.numel() / eb) for s in shards)
        return [shards[rank][i * eb:(i + 1) * eb] for i in range(n)]

    def check(self, mb: MicroBatch, run: "Run") -> None:
        """A run's first ``cfg.verify_batches`` micro-batches' features against the source rows, byte for byte."""
        if run.verified >= self.cfg.verify_batches:
            return
        want = self.ds.node_rows(mb.input_nodes)
        if not torch.equal(mb.x.view(torch.uint8), want.contiguous().view(torch.uint8)):
            raise AssertionError("fetched features differ from the source rows (the lossless path is broken)")
        run.verified += 1


@dataclass
class MicroBatch:
    """One (virtual) rank's share of a global batch: its seeds, sampled blocks and (once fetched) features."""

    step: int
    rank: int
    seeds: torch.Tensor  # on the device
    input_nodes: torch.Tensor
    blocks: list[gnn.Block]
    x: "torch.Tensor | None" = None


class MicroBatches:
    """The sampling stage: micro-batches of (virtual) ranks ``vranks`` for every step of one epoch per iteration
    (epoch 0, 1, ... in turn), in (step, rank) order, ``cfg.sample_chunk`` of them sampled per call. Spans go to
    ``timer`` as "sample" (CUDA events on the sampling stream when pipelined)."""

    def __init__(self, job: "Job", vranks: list[int], timer: StageTimer) -> None:
        self.job, self.vranks, self.timer = job, vranks, timer
        self.epoch = 0

    def __len__(self) -> int:
        return self.job.steps_per_epoch() * len(self.vranks)

    def __iter__(self) -> "Iterator[MicroBatch]":
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self._sample(epoch)

    def _sample(self, epoch: int) -> "Iterator[MicroBatch]":
        job, dev = self.job, self.job.ranks.device
        order = job.epoch_order(epoch)
        plan = [(step, v) for step in range(job.steps_per_epoch()) for v in self.vranks]
        chunk = job.sample_chunk()
        for first in range(0, len(plan), chunk):
            part = plan[first:first + chunk]
            seeds = [job.seeds(epoch, step, v, order).to(dev) for step, v in part]
            a = self.timer.mark()
            sampled = job.sampler.sample_many(seeds, [batch_key(job.cfg.seed, 2, epoch, step, v) for step, v in part])
            self.timer.add("sample", a, self.timer.mark())
            for (step, v), s, (nodes, blocks) in zip(part, seeds, sampled):
                yield MicroBatch(step, v, s, nodes, blocks)


class _InTurn:
    """The unpipelined loop: sample, fetch, train, one after the other."""

    def __init__(self, batches: MicroBatches, fetch: Callable[[MicroBatch], MicroBatch]) -> None:
        self.batches, self.fetch = batches, fetch

    def __iter__(self) -> "Iterator[MicroBatch]":
        for mb in self.batches:
            yield self.fetch(mb)


def _across_epochs(job: "Job") -> bool:
    return job.cfg.pipelined and job.across_epochs


def epochs_of(job: "Job", src: MicroBatches, loop: Any, timer: StageTimer) -> "Iterator[Iterator[MicroBatch]]":
    """Each epoch's micro-batches, in turn. Pipelined with ``job.across_epochs`` the loader runs once over every
    epoch (``make_loop``), so the next epoch's first micro-batches are sampled and fetched while this epoch's last
    steps train: without it each epoch starts with an empty pipeline and the trainer waits for the first batch's
    sampling and fetch. A micro-batch depends only on (seed, epoch, step, rank), so the batches and losses are the
    same."""
    if _across_epochs(job):
        yield from gnn.epoch_slices(batches_timed(loop, timer), len(src), job.cfg.epochs)
        return
    for _ in range(job.cfg.epochs):
        yield batches_timed(loop, timer)


def make_loop(job: "Job", vranks: list[int], cache_fetch: Callable[[torch.Tensor], torch.Tensor], timer: StageTimer,
              collective: bool) -> tuple[MicroBatches, Any]:
    """(the sampling stage, the loop a trainer iterates): pipelined with ibpcache's ``PipelinedLoader`` (sampling
    in a thread, the fetch on a side stream: in a thread, or, for a collective fetch, in the trainer's thread one
    micro-batch ahead so every rank issues its collectives in the same order) unless ``job.cfg.pipelined`` is off."""
    src = MicroBatches(job, vranks, timer)

    def fetch(mb: MicroBatch) -> MicroBatch:
        t0 = time.perf_counter()
        a = timer.mark()
        mb.x = cache_fetch(mb.input_nodes)
        timer.add("fetch", a, timer.mark())
        timer.add_host("fetch_host", time.perf_counter() - t0)
        return mb

    if not job.cfg.pipelined:
        return src, _InTurn(src, fetch)
    batches = gnn.AllEpochs(src, job.cfg.epochs) if _across_epochs(job) else src
    return src, PipelinedLoader(batches, fetch, device=job.ranks.device, prefetch=job.cfg.prefetch,
                                sample_ahead=job.cfg.sample_ahead, fetch_thread=not collective,
                                switch_interval=gnn.switch_interval(job.cfg))


def make_fetch(job: Job, mode: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
    """The feature path of ``mode`` over the shared store (static policy, hotness = in-degree, same budget/GPU)."""
    hot = job.sampler.in_degree.to(torch.float64).cpu()
    budget = int(job.budget * job.rows.n_rows * job.rows.row_bytes)
    if mode == "partitioned":
        cache = PartitionedFeatureCache(job.rows, hot, budget_bytes=budget, device=job.ranks.device,
                                        group=job.ranks.cache_group, replicate=job.node_replicate,
                                        track_sources=job.track_sources,
                                        fetch_blocks_per_sm=job.cfg.fetch_blocks_per_sm)
    else:  # lazy on CUDA as the node cache is: no host sync per fetch in any mode, so the fetch threads run alike
        lazy = {"validate": "lazy"} if job.ranks.device.type == "cuda" else {}
        cache = FeatureCache(job.rows, budget_bytes=budget, policy="static", hotness=hot, device=job.ranks.device,
                             fetch_blocks_per_sm=job.cfg.fetch_blocks_per_sm, **lazy)
    return cache.fetch, cache


def new_model(job: Job) -> RankedSAGE:
    torch.manual_seed(job.cfg.seed)
    model = RankedSAGE(int(np.prod(job.ds.row_shape)), job.cfg.hidden, job.ds.num_classes, len(job.cfg.fanouts),
                       job.cfg.dropout)
    model.seed_dropout(job.cfg.seed)
    return model.to(job.ranks.device)


def _add_step(timer: StageTimer, a: Any, f: Any, grads_ready: Any, b: Any, c: Any) -> None:
    """One step's marks: start, forward done, last gradient accumulated (None: no parameter got one), backward()
    returned, optimizer done."""
    ready = grads_ready if grads_ready is not None else b
    timer.add("train", a, c)
    timer.add("forward", a, f)
    timer.add("backward", f, ready)
    timer.add("allreduce", ready, b)
    timer.add("optimizer", b, c)


def padded_step(job: Job, model: RankedSAGE, opt: torch.optim.Optimizer,
                reduce: "Callable[[torch.Tensor], None] | None" = None) -> "gnn.GraphedStep | None":
    """With ``model.step_graphs`` the example's padded step (:class:`examples.gnn.pipeline.GraphedStep`): CUDA
    graphs on a GPU, the same padded step eagerly on the CPU, so a DDP rank and the reference pad each micro-batch
    alike and their losses stay comparable bit for bit. None: the unpadded eager step (the rank under DDP)."""
    if not job.cfg.step_graphs:
        return None
    dev = job.ranks.device
    return gnn.GraphedStep(model, opt, dev, graphs=dev.type == "cuda", reduce=reduce)


def mean_all_reduce(world: int, distributed: bool) -> Callable[[torch.Tensor], None]:
    """DDP's gradient average on one flat buffer, in place: each rank's gradient times 1/W, summed over the ranks
    (one all-reduce per step, after the replayed backward). The reference computes the same products and sums them
    in rank order; for W = 2 NCCL's sum of two is that sum exactly."""

    def reduce(flat: torch.Tensor) -> None:
        flat.mul_(1.0 / world)
        if distributed:
            dist.all_reduce(flat)

    return reduce


def _batch(job: Job, mb: MicroBatch) -> Any:
    """A micro-batch as the example's training batch (its seeds' labels)."""
    return gnn._Batch(mb.input_nodes, mb.blocks, mb.x, job.labels[mb.seeds])


EpochRuns = Generator[None, None, "Run"]
"""A mode's training: it yields after each epoch and returns its Run (see :func:`finish` and ``--interleave``)."""


def train_ddp(job: Job, mode: str) -> EpochRuns:
    """DDP: this rank trains its micro-batch of every global batch; DDP averages the gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, dev, cfg = job.ranks.rank, job.ranks.device, job.cfg
    t0 = time.perf_counter()
    fetch, cache = make_fetch(job, mode)
    run = Run(mode, r, setup_s=time.perf_counter() - t0, pipelined=cfg.pipelined,
              across_epochs=_across_epochs(job))
    model = new_model(job)
    model.use_rank(r, dev)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    reduce = mean_all_reduce(job.world, job.ranks.distributed)
    step = padded_step(job, model, opt, reduce)
    options = {} if job.ddp_plain else DDP_OPTIONS
    ddp = (DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, **options)
           if job.ranks.distributed and step is None else model)
    run.losses[r] = []
    timer = StageTimer(dev)
    src, loop = make_loop(job, [r], fetch, timer, collective=False)
    in_flight = StepsInFlight(dev, limit=2)
    grads = GradsReady(model, timer)
    _reset(cache)
    for batches in epochs_of(job, src, loop, timer):
        model.train()
        _sync(dev)
        start = time.perf_counter()
        losses = []
        with host_profile(job, run):
            for mb in batches:
                _pin_threads(dev)
                job.check(mb, run)
                t0 = time.perf_counter()
                a = timer.mark()
                if step is not None:  # "forward": the replayed forward and backward; "allreduce": the reduce
                    loss = step.forward_backward(_batch(job, mb))
                    f = ready = timer.mark()
                    reduce(step.grads)
                else:
                    loss = gnn.cross_entropy(ddp(mb.blocks, mb.x), job.labels[mb.seeds])
                    f = timer.mark()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    ready = grads.take()
                b = timer.mark()
                _pin_threads(dev)
                opt.step()
                c = timer.mark()
                _add_step(timer, a, f, ready, b, c)
                timer.add_host("train_host", time.perf_counter() - t0)
                losses.append(loss.detach())
                in_flight.step_done()
        run.losses[r] += torch.stack(losses).tolist() if losses else []
        _sync(dev)
        run.epochs.append({"epoch": time.perf_counter() - start, **timer.totals()})
        yield
    grads.remove()
    run.cache = _cache_stats(cache)
    _evaluate(job, model, fetch, [r], run)
    if mode == "partitioned":
        run.probe = probe(job, cache)
        cache.close()  # every rank unmaps its peers' slabs before any rank frees its own
    return run


def train_reference(job: Job) -> EpochRuns:
    """One process, one GPU: the W micro-batches of each global batch in turn, gradients combined as DDP does."""
    dev, cfg, w = job.ranks.device, job.cfg, job.world
    t0 = time.perf_counter()
    fetch, cache = make_fetch(job, "reference")
    run = Run("reference", job.ranks.rank, setup_s=time.perf_counter() - t0, pipelined=cfg.pipelined,
              across_epochs=_across_epochs(job))
    model = new_model(job)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    step = padded_step(job, model, opt)
    params = list(model.parameters())
    run.losses = {v: [] for v in range(w)}
    timer = StageTimer(dev)
    src, loop = make_loop(job, list(range(w)), fetch, timer, collective=False)
    in_flight = StepsInFlight(dev, limit=2 * w)
    grads = GradsReady(model, timer)
    _reset(cache)
    for batches in epochs_of(job, src, loop, timer):
        model.train()
        _sync(dev)
        start = time.perf_counter()
        losses: dict[int, list[torch.Tensor]] = {v: [] for v in range(w)}
        acc: list[torch.Tensor | None] = [None] * len(params)
        flat: "torch.Tensor | None" = None
        with host_profile(job, run):
            for mb in batches:  # the W micro-batches of each global batch in rank order
                _pin_threads(dev)
                job.check(mb, run)
                model.use_rank(mb.rank, dev)
                t0 = time.perf_counter()
                a = timer.mark()
                if step is not None:  # one flat gradient, as the ranks all-reduce it
                    loss = step.forward_backward(_batch(job, mb))
                    f = ready = timer.mark()
                    g = step.grads * (1.0 / w)
                    flat = g if flat is None else flat + g
                else:
                    loss = gnn.cross_entropy(model(mb.blocks, mb.x), job.labels[mb.seeds])
                    f = timer.mark()
                    for p in params:
                        p.grad = None
                    loss.backward()
                    ready = grads.take()
                    for i, p in enumerate(params):  # DDP: each rank's gradient times 1/W, summed in rank order
                        g = p.grad * (1.0 / w)
                        acc[i] = g if acc[i] is None else acc[i] + g
                b = timer.mark()
                if mb.rank == w - 1:
                    if step is not None:
                        step.grads.copy_(flat)
                        flat = None
                    else:
                        for p, g in zip(params, acc):
                            p.grad = g
                    _pin_threads(dev)
                    opt.step()
                    acc = [None] * len(params)
                _add_step(timer, a, f, ready, b, timer.mark())  # "allreduce": the 1/W sums here
                timer.add_host("train_host", time.perf_counter() - t0)
                losses[mb.rank].append(loss.detach())
                in_flight.step_done()
        for v in range(w):
            run.losses[v] += torch.stack(losses[v]).tolist() if losses[v] else []
        _sync(dev)
        run.epochs.append({"epoch": time.perf_counter() - start, **timer.totals()})
        yield
    grads.remove()
    run.cache = _cache_stats(cache)
    _evaluate(job, model, fetch, list(range(w)), run)
    return run


def finish(epochs: EpochRuns) -> Run:
    """Run a mode's remaining epochs; its Run."""
    while True:
        try:
            next(epochs)
        except StopIteration as done:
            return done.value


def run_modes(job: Job, modes: list[str], interleave: bool) -> dict[str, list[Run]]:
    """Every mode's Runs (all ranks'), the modes one after the other, or with ``interleave`` one epoch of each in
    turn (the reference on rank 0 while the other ranks wait). Interleaved, every mode meets the machine at the same
    moments, so a host that runs faster or slower for a while (on shared VMs, 118-206 ms for the same reference
    epoch from run to run) shifts every mode alike instead of deciding the ratio."""
    ranks = job.ranks

    def start(mode: str) -> "EpochRuns | None":
        if mode == "reference":
            return train_reference(job) if ranks.rank == 0 else None
        return train_ddp(job, mode)

    mine: dict[str, "Run | None"] = {}
    if interleave:
        gens = {mode: start(mode) for mode in modes}
        for _ in range(job.cfg.epochs + 1):  # the last round returns each mode's Run (evaluation, probe)
            for mode, gen in gens.items():
                if gen is not None and mode not in mine:
                    try:
                        next(gen)
                    except StopIteration as done:
                        mine[mode] = done.value
                if mode == "reference":
                    ranks.barrier()
    else:
        for mode in modes:
            gen = start(mode)
            mine[mode] = finish(gen) if gen is not None else None
            if mode == "reference":
                ranks.barrier()
            if ranks.rank == 0:
                print(f"  {mode}: done", flush=True)
            _free(ranks.device)
    runs: dict[str, list[Run]] = {}
    for mode in modes:
        gathered = ranks.gather([mine[mode]] if mine.get(mode) is not None else [])
        runs[mode] = [r for lst in gathered for r in lst]
    return runs


@torch.no_grad()
def _evaluate(job: Job, model: RankedSAGE, fetch: Callable[[torch.Tensor], torch.Tensor], vranks: list[int],
              run: Run) -> None:
    """Test predictions of (virtual) ranks ``vranks``' shards; empty batches still call fetch."""
    model.eval()
    dev = job.ranks.device
    for v in vranks:
        preds = []
        for i, seeds in enumerate(job.test_shard(v)):
            if seeds.numel() == 0:
                fetch(torch.empty(0, dtype=torch.int64, device=dev))
                continue
            input_nodes, blocks = job.sampler.sample(seeds.to(dev), batch_key(job.cfg.seed, 4, i, v))
            logits = model(blocks, fetch(input_nodes))
            p = logits.argmax(1)
            run.correct += int((p == job.labels[seeds.to(dev)]).sum())
            run.tested += int(seeds.numel())
            preds += p.tolist()
        run.predictions[v] = preds


def probe(job: Job, cache: PartitionedFeatureCache, batch: int = 0, reps: int = 12) -> dict[str, Any]:
    """Fetch throughput of batches that are all peer hits, all host misses, all local hits (medians, verified)."""
    from scripts.bench_partitioned import timed

    r, dev = job.ranks.rank, job.ranks.device
    batch = batch or min(100_000, job.rows.n_rows)
    holder = cache.holder
    gen = torch.Generator().manual_seed(5 + r)
    out: dict[str, Any] = {"batch": batch}
    for label, mask in (("peer_hits", holder == PEER), ("host_misses", holder == HOST),
                        ("local_hits", holder == LOCAL)):
        pool = torch.nonzero(mask).reshape(-1).cpu()
        ok = torch.tensor([int(pool.numel() > 0)], dtype=torch.int32)
        if job.ranks.distributed:  # every rank must run the same collectives: skip a kind if any rank lacks it
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=job.ranks.host_group)
        if not bool(ok):
            continue
        picks = [pool[torch.randint(0, pool.numel(), (batch,), generator=gen)].to(dev) for _ in range(reps)]
        out[label] = timed(cache.fetch, picks, 2, job.rows)
    return out


def _reset(cache: Any) -> None:
    cache.reset_stats()


def _cache_stats(cache: Any) -> dict[str, Any]:
    st = cache.stats()
    if isinstance(cache, PartitionedFeatureCache):
        keep = ("rows_cached_here", "requests", "local_hits", "peer_hits", "host_misses", "hit_rate",
                "replicated_rows", "owned_rows", "peer_access", "fallback_reason", "replicate", "placement_rule",
                "placement_costs", "costs_rule", "source_costs_us_per_row", "setup_check")
        return ({k: st[k] for k in keep} | {"rows_cached_on_node": st["node_cached_rows"],
                                            "host_bytes_read": st["local"]["host_bytes_read"]})
    return {"rows_cached_here": st["capacity_rows"], "rows_cached_on_node": st["capacity_rows"],
            "requests": st["requests"], "hit_rate": st["hit_rate"], "host_bytes_read": st["host_bytes_read"]}


def _pin_threads(dev: torch.device) -> None:
    """CPU runs: one intra-op thread. Numba's OpenMP layer (the CPU cache's decoder) resets the calling thread's
    OpenMP thread count, and Adam's elementwise kernels round differently when a tensor is split over 2 threads
    (vector FMA body vs scalar tail per chunk), so without this the DDP ranks' identical gradients could give
    different parameters."""
    if dev.type == "cpu" and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ----------------------------------------------------------------------------------------------------------------
# Set-up, comparison, output


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="bench_gnn", overrides=["dataset=cora_su", *overrides])


def build_store(ds: gnn.GnnDataset, device: torch.device, layout: str, name: str) -> Any:
    """The shared store: the full feature table, compressed (codec fitted on the device), published as ``name``."""
    features = ds.materialize()
    codec = gnn.fit_codec(features, device)
    packed = codec.compress(features, layout=layout, pin=False, device=device)
    del features
    return packed


def summarize(runs: dict[str, list[Run]], world: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One record per mode (epoch time of the slowest rank, hit rates summed over ranks) + the comparisons."""
    records = []
    ref = runs.get("reference", [None])[0]
    for mode, per_rank in runs.items():
        # epoch 0 warms up; a profiled epoch runs slower (host_profile)
        timed = [[e for i, e in enumerate(r.epochs) if i not in (0, r.profile.get("epoch"))] or r.epochs
                 for r in per_rank]
        epoch_s = [float(np.mean([e["epoch"] for e in t])) for t in timed]
        stage_ranks = {k: [float(np.mean([e.get(k, 0.0) for e in t])) for t in timed] for k in STAGES}
        stages = {k: float(np.mean(v)) for k, v in stage_ranks.items()}
        losses = {v: l for r in per_rank for v, l in r.losses.items()}
        preds = [p for v in sorted({v for r in per_rank for v in r.predictions})
                 for r in per_rank if v in r.predictions for p in r.predictions[v]]
        req = sum(r.cache.get("requests", 0) for r in per_rank)
        hits = sum(r.cache.get("hit_rate", 0.0) * r.cache.get("requests", 0) for r in per_rank)
        rec: dict[str, Any] = {
            "mode": mode, "processes": len(per_rank), "world": world, "pipelined": per_rank[0].pipelined,
            "across_epochs": per_rank[0].across_epochs,
            "epoch_ms": 1e3 * max(epoch_s),
            "epoch_ms_per_rank": [1e3 * s for s in epoch_s], **{f"{k}_ms": 1e3 * v for k, v in stages.items()},
            **{f"{k}_ms_per_rank": [1e3 * v for v in vals] for k, vals in stage_ranks.items()},
            "hit_rate": hits / req if req else None, "rows_cached_on_node": per_rank[0].cache["rows_cached_on_node"],
            "rows_cached_per_gpu": [r.cache["rows_cached_here"] for r in per_rank],
            "accuracy": sum(r.correct for r in per_rank) / max(sum(r.tested for r in per_rank), 1),
            "predictions_sha1": hashlib.sha1(np.asarray(preds, dtype=np.int64).tobytes()).hexdigest(),
            "setup_s": max(r.setup_s for r in per_rank), "losses": [losses[v] for v in sorted(losses)],
            "cache": [r.cache for r in per_rank],
        }
        if any(r.profile for r in per_rank):
            rec["host_profile"] = [r.profile for r in per_rank]
        if mode == "partitioned":
            for key in ("local_hits", "peer_hits", "host_misses"):
                counts = [r.cache[key] for r in per_rank]  # None: the node cache did not track sources
                rec[key] = None if None in counts else sum(counts)
            rec["peer_access"] = all(r.cache["peer_access"] for r in per_rank)
            rec["fallback_reason"] = next((r.cache["fallback_reason"] for r in per_rank if r.cache["fallback_reason"]),
                                          None)
            rec["probe"] = [r.probe for r in per_rank]
            for key in ("replicate", "placement_rule", "costs_rule", "source_costs_us_per_row", "setup_check"):
                rec[key] = per_rank[0].cache[key]
        if ref is not None and mode != "reference":
            ref_l = np.asarray([ref.losses[v] for v in sorted(ref.losses)])
            mine = np.asarray(rec["losses"])
            same_shape = ref_l.shape == mine.shape
            rec["identical_losses_vs_reference"] = bool(same_shape and np.array_equal(ref_l, mine))
            rec["max_abs_loss_diff"] = float(np.abs(ref_l - mine).max()) if same_shape and mine.size else None
        records.append(rec)
    by = {r["mode"]: r for r in records}
    summary: dict[str, Any] = {"world": world}
    if "reference" in by:
        refr = by["reference"]
        for mode in ("partitioned", "per_gpu"):
            if mode in by:
                sp = refr["epoch_ms"] / by[mode]["epoch_ms"]
                summary[f"speedup_{mode}_vs_1gpu"] = sp
                summary[f"scaling_efficiency_{mode}"] = sp / world
                summary[f"identical_predictions_{mode}"] = by[mode]["predictions_sha1"] == refr["predictions_sha1"]
                summary[f"identical_losses_{mode}"] = by[mode]["identical_losses_vs_reference"]
        summary["hit_rate_one_gpu"] = refr["hit_rate"]
    if "partitioned" in by:
        p = by["partitioned"]
        summary["hit_rate_partitioned"] = p["hit_rate"]
        one = max(p["rows_cached_per_gpu"])
        if "reference" in by:
            one = by["reference"]["rows_cached_on_node"]
        summary["node_capacity_vs_one_gpu"] = p["rows_cached_on_node"] / max(one, 1)
        head = max(c.get("replicated_rows", 0) for c in p["cache"]) if p["peer_access"] else one
        # the head is on every GPU, the rest of each GPU's rows is its own share of the tail
        summary["node_capacity_expected_vs_one_gpu"] = (head + world * (one - head)) / max(one, 1)
        summary["peer_access"], summary["fallback_reason"] = p["peer_access"], p["fallback_reason"]
        probes = [pr for pr in p["probe"] if pr]
        for kind in ("peer_hits", "host_misses", "local_hits"):
            vals = [pr[kind]["GBps"] for pr in probes if kind in pr]
            if vals:
                summary[f"GBps_{kind}"] = float(np.mean(vals))
    if "per_gpu" in by:
        summary["hit_rate_per_gpu_ddp"] = by["per_gpu"]["hit_rate"]
    sp = summary.get("speedup_partitioned_vs_1gpu")
    summary["targets"] = {"speedup_vs_1gpu": {"target": TARGET_SPEEDUP, "measured": sp,
                                              "met": sp is not None and sp >= TARGET_SPEEDUP},
                          "node_capacity": {"target": summary.get("node_capacity_expected_vs_one_gpu"),
                                            "measured": summary.get("node_capacity_vs_one_gpu"),
                                            "met": summary.get("node_capacity_vs_one_gpu", 0)
                                            >= 0.98 * summary.get("node_capacity_expected_vs_one_gpu", world)}}
    return records, summary


def plot(records: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    modes = [r["mode"] for r in records]
    bottom = np.zeros(len(records))
    for stage, color in (("sample_ms", "#55a868"), ("fetch_ms", "#dd8452"), ("train_ms", "#4c72b0")):
        vals = np.array([r[stage] for r in records])
        axes[0].bar(modes, vals, bottom=bottom, label=stage[:-3], color=color)
        bottom += vals
    axes[0].scatter(modes, [r["epoch_ms"] for r in records], color="k", zorder=3, label="epoch (wall)")
    axes[0].set_ylabel("ms per epoch (mean of epochs 2..N)")
    axes[0].legend(fontsize=8)
    axes[1].bar(modes, [r["hit_rate"] or 0 for r in records], color="#8172b2")
    axes[1].set_ylabel("GPU cache hit rate (node)")
    for r in records:
        for v, l in enumerate(r["losses"]):
            axes[2].plot(l, label=f"{r['mode']} rank {v}", lw=1, ls="--" if r["mode"] == "reference" else "-")
    axes[2].set_xlabel("step (all epochs)")
    axes[2].set_ylabel("training loss")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"GraphSAGE DDP on {records[0]['world']} ranks: partitioned vs per-GPU cache vs 1-GPU reference")
    fig.tight_layout()
    return fig


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(p)
    p.add_argument("--name", default="train_gnn_ddp")
    p.add_argument("--world", type=int, default=2, help="ranks the reference emulates without torchrun (--nproc 1)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="cpu: gloo ranks, CPU caches")
    p.add_argument("--layout", default="inplace", choices=["inplace", "packed"], help="shared store layout")
    p.add_argument("--attach", default=None, help="attach this store (task=serve) instead of building one")
    p.add_argument("--save-store", default=None, help="also save the store to this file (for task=serve) and exit")
    p.add_argument("--quick", action="store_true", help="tiny graph, 3 epochs: " + " ".join(QUICK))
    p.add_argument("--node-replicate", default="auto",
                   help="the node cache's head: 'auto' (sized from costs it measures) or a fraction of the budget "
                        "(1.0: no peer rows, the node cache's code path as a control)")
    p.add_argument("--epoch-by-epoch", action="store_true",
                   help="pipelined: a new loader run per epoch (each epoch starts with an empty pipeline) instead of "
                        "one run over every epoch")
    p.add_argument("--interleave", action="store_true",
                   help="one epoch of each mode in turn instead of the modes one after the other (implies "
                        "--epoch-by-epoch: no mode's loader runs ahead while another trains)")
    p.add_argument("--profile-epoch", type=int, default=None,
                   help="run this epoch (from 0) of every mode under torch.profiler, every thread recorded; records "
                        "gain host_profile (per thread: host ms, ops, launches, top ops); that epoch is not timed")
    p.add_argument("--no-track-sources", action="store_true",
                   help="the node cache does not count local / peer / host reads (its few ops per fetch left out)")
    p.add_argument("--ddp-plain", action="store_true",
                   help="DDP with torch's defaults instead of "
                        + ", ".join(f"{k}={v}" for k, v in DDP_OPTIONS.items()))
    p.add_argument("--chunk-as-given", action="store_true",
                   help="sample model.sample_chunk micro-batches per call even where a rank's epoch then ends with "
                        "a short call (default: the smallest divisor of a rank's micro-batches per epoch >= it)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of configs/bench_gnn.yaml, e.g. dataset.n_nodes=200000")
    args = p.parse_args(argv)
    # a rank that stops making progress (a collective no peer joins) shows where every thread is on `kill -USR1 pid`
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    cfg = _compose(overrides)
    ranks = init_ranks(args.world, args.device)
    modes = [m for m in args.modes.split(",") if m]
    if not ranks.distributed:
        modes = [m for m in modes if m == "reference"] or ["reference"]
    bad = sorted(set(modes) - set(MODES))
    if bad:
        raise SystemExit(f"unknown modes {bad}; expected some of {MODES}")
    if ranks.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(cfg.model.get("tf32", True))
        if bool(cfg.model.deterministic):
            torch.use_deterministic_algorithms(True, warn_only=True)
    train_cfg = gnn.train_config(cfg.model, cfg.dataset, epochs=cfg.epochs, seed=cfg.seed)

    t0 = time.perf_counter()
    ds = gnn.load_gnn_dataset(str(cfg.dataset.name), materialize=False,
                              **{k: cfg.dataset[k] for k in ("n_nodes", "avg_degree", "n_train", "n_test", "seed")
                                 if cfg.dataset.get(k) is not None})
    load_s = time.perf_counter() - t0
    seg, name = None, args.attach or f"train-gnn-ddp-{os.environ.get('MASTER_PORT', os.getpid())}"
    store_s = 0.0
    try:
        if args.attach is None and ranks.rank == 0:
            t1 = time.perf_counter()
            packed = build_store(ds, ranks.device, args.layout, name)
            if args.save_store:
                packed.save(args.save_store)
                print(f"saved the store to {args.save_store}; serve it with python -m ibpcache task=serve "
                      f"+task.stores.NAME={args.save_store}")
            seg = packed.share(name)
            del packed
            store_s = time.perf_counter() - t1
        ranks.barrier()
        if args.save_store:
            return 0
        t2 = time.perf_counter()
        rows = CompressedRows.attach(name)
        attach_s = time.perf_counter() - t2
        sampler = BlockSampler(ds.src, ds.dst, ds.num_nodes, train_cfg.fanouts, ranks.device,
                               hop_kernel=train_cfg.sampler_kernel)
        job = Job(ds, rows, sampler, train_cfg, float(cfg.cache.budget), ranks, ds.labels.to(ranks.device),
                  node_replicate=args.node_replicate if args.node_replicate == "auto" else float(args.node_replicate),
                  across_epochs=not (args.epoch_by_epoch or args.interleave), profile_epoch=args.profile_epoch,
                  track_sources=not args.no_track_sources, ddp_plain=args.ddp_plain,
                  chunk_as_given=args.chunk_as_given)
        if ranks.rank == 0:
            print(f"train_gnn_ddp: {ds.name} {ds.num_nodes:,} nodes, {ds.num_edges:,} edges, {ds.row_bytes} B rows, "
                  f"store ratio {rows.ratio:.2f}x ({args.layout}); {ranks.world} ranks on {ranks.device.type}, "
                  f"{job.steps_per_epoch()} global batches of {ranks.world} x {train_cfg.batch_size} per epoch, "
                  f"{train_cfg.epochs} epochs, cache budget {cfg.cache.budget} per GPU; modes {modes}; "
                  f"{job.sample_chunk()} micro-batches per sampler call; DDP "
                  f"{'defaults' if job.ddp_plain else DDP_OPTIONS}", flush=True)
        with frozen_gc(job.cfg.gc_freeze):  # every mode alike (model.gc_freeze)
            runs = run_modes(job, modes, args.interleave)
        if ranks.rank == 0:
            records, summary = summarize(runs, ranks.world)
            summary["interleaved"] = bool(args.interleave)
            cols = ["mode", "processes", "pipelined", "epoch_ms", "sample_ms", "fetch_ms", "train_ms", "forward_ms",
                    "backward_ms", "allreduce_ms", "optimizer_ms", "train_host_ms", "wait_batch_ms", "hit_rate",
                    "rows_cached_on_node", "accuracy", "identical_losses_vs_reference", "max_abs_loss_diff"]
            print(format_table(records, cols))
            print(summary)
            meta = {"overrides": overrides, "args": {k: str(v) for k, v in vars(args).items()},
                    "dataset": ds.describe() | {"row_bytes": ds.row_bytes}, "train": asdict(train_cfg),
                    "steps_per_epoch": job.steps_per_epoch(), "sample_chunk_used": job.sample_chunk(),
                    "ddp_options": None if train_cfg.step_graphs else {} if job.ddp_plain else DDP_OPTIONS,
                    "load_s": load_s, "store_build_s": store_s, "attach_s": attach_s, "store_ratio": rows.ratio,
                    "summary": summary}
            write_results(args.out, args.name, records, plot, meta=meta)
        ranks.barrier()
        return 0
    except BaseException:
        if ranks.distributed:
            # Now, not after cleanup: destroying the process group would wait for collectives the other ranks never
            # join (they wait in them too). Exiting lets torchrun stop every rank.
            traceback.print_exc()
            sys.stderr.flush()
            _unlink(seg)
            os._exit(1)
        raise
    finally:
        _unlink(seg)
        if ranks.distributed:
            dist.destroy_process_group()


def _unlink(seg: Any) -> None:
    if seg is not None:
        seg.unlink()
        seg.close()


def _free(dev: torch.device) -> None:
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
