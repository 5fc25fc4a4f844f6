"""GraphSAGE training on sampled blocks, timed stage by stage; shared by ``examples/train_sage.py`` and
``scripts/train_gnn.py`` (example code, not installed; needs ``pip install -e ".[dgl]"``).

Why the model is plain PyTorch rather than ``dgl.nn.SAGEConv``: DGL from PyPI has no CUDA kernels, so a DGL
block cannot run message passing on the GPU. Each block is turned into (src, dst) index tensors and aggregated
with ``index_add_``; on CUDA the training loop turns on ``torch.use_deterministic_algorithms`` so that, with the
same seeds and batch order, every feature path gives bit-identical losses (the codec is lossless, so any
difference would be a bug).

Batches come from DGL's ``NeighborSampler`` (CPU, in ``DataLoader`` worker processes) or from ibpcache's
plain-torch ``NeighborSampler`` (on the GPU when the graph fits; the same samples on any device). A run is
pipelined -- ``ibpcache.loaders.pipeline.PipelinedLoader`` samples batch i+2, fetches the features of batch i+1 on
a side stream and hands batch i to the training step, all at once -- or not (sample, fetch, train in turn). Each
epoch records its wall time; each stage's own time comes from a separate pass after training (stages timed inside
an overlapped loop would need syncs that serialize it), and a profiled repeat of that pass gives what each stage
costs the GPU and the host, so a pipelined epoch is compared with what its stages share, not only with the slowest
stage alone (:func:`_bound`). The paper reports the mean of epochs 2..N.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import itertools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from ibpcache.errors import ConfigError, IbpcacheError
from ibpcache.loaders.dgl import FetchMode, attach, import_dgl, make_storage
from ibpcache.loaders.pipeline import GcPauses, PipelinedLoader, StageClock, StepsInFlight, frozen_gc
from ibpcache.loaders.sm_split import split_sms
from ibpcache.loaders.sampling import Hop, NeighborSampler, batch_key, choose_sampler_device

__all__ = [
    "run",
    "format_report",
    "GnnDataset",
    "load_gnn_dataset",
    "build_graph",
    "GraphSAGE",
    "TrainConfig",
    "EpochTimes",
    "RunResult",
    "run_mode",
    "run_variants",
    "build_torch_sampler",
    "GraphedStep",
    "make_step",
    "padded_size",
    "variant_label",
    "SAMPLERS",
    "deterministic_cuda",
    "compare_modes",
    "fit_codec",
    "stats_summary",
    "train_config",
    "dataset_from_config",
    "resolve_device",
    "SU_SOURCES",
]

#: scaled-up ("SU") data sets: name -> where their real rows come from.
SU_SOURCES = {"cora_su": "cora", "pubmed_su": "pubmed", "minilm_su": "minilm"}
_MINILM_CLASSES = 8
_FIT_ROWS = 1 << 18


# --------------------------------------------------------------------------------------------------------------
# Data sets


@dataclass
class GnnDataset:
    """A node-classification task as plain tensors; ``features`` stay on the host (the feature store's job)."""

    name: str
    features: "torch.Tensor | None"  # [N, ...] CPU; None when built with materialize=False (see node_rows)
    labels: torch.Tensor  # int64 [N]
    src: torch.Tensor  # int64 [E]
    dst: torch.Tensor  # int64 [E]
    num_classes: int
    train_nids: torch.Tensor  # int64
    test_nids: torch.Tensor  # int64
    note: str = ""
    #: where node features come from: node i has row ``source_rows[pick[i]]`` (``pick`` None: ``source_rows[i]``).
    #: An SU graph resamples a few thousand real rows, so this describes all N rows in a few MB.
    source_rows: "torch.Tensor | None" = None
    pick: "torch.Tensor | None" = None

    @property
    def num_nodes(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.src.numel())

    @property
    def row_bytes(self) -> int:
        ref = self.features if self.features is not None else self.source_rows
        return int(ref[0].numel()) * ref.element_size()

    @property
    def row_shape(self) -> tuple[int, ...]:
        ref = self.features if self.features is not None else self.source_rows
        return tuple(ref.shape[1:])

    def node_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Feature rows of nodes ``ids``, on ids' device, without the [N, ...] table: what fetched rows must equal."""
        if self.source_rows is None:
            return self.features.to(ids.device)[ids]
        src = self.source_rows.to(ids.device)
        return src[ids] if self.pick is None else src[self.pick.to(ids.device)[ids]]

    def materialize(self) -> torch.Tensor:
        """The full [N, ...] feature table (what a store is built from)."""
        if self.features is not None:
            return self.features
        if self.pick is None:
            return self.source_rows
        out = torch.empty((self.num_nodes, *self.source_rows.shape[1:]), dtype=self.source_rows.dtype)
        return torch.index_select(self.source_rows, 0, self.pick, out=out)

    @property
    def feature_bytes(self) -> int:
        return self.num_nodes * self.row_bytes

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "nodes": self.num_nodes, "edges": self.num_edges,
                "row_bytes": self.row_bytes, "feature_bytes": self.feature_bytes,
                "train_nodes": int(self.train_nids.numel()), "test_nodes": int(self.test_nids.numel()),
                "classes": self.num_classes, "note": self.note}


def _real_rows_and_labels(source: str) -> tuple[torch.Tensor, torch.Tensor, int, str]:
    """Real feature rows (and their labels) that an SU graph draws its node features from."""
    from ibpcache import datasets

    if source == "cora":
        d = datasets.load_cora()
        return d.features, d.labels, d.num_classes, "Cora rows (real labels)"
    if source == "pubmed":
        d = datasets.load_pubmed()
        real = d.feature_is_real if d.feature_is_real is not None else torch.ones(d.num_nodes, dtype=torch.bool)
        return d.features[real], d.labels[real], d.num_classes, "the 1060 real PubMed rows (real labels)"
    if source == "minilm":
        rows = datasets.load_minilm()
        # The table has no labels; a fixed random linear map of each (real) row gives learnable ones, so the
        # accuracy column still shows that training works. It says nothing about any real task.
        w = torch.randn(rows.shape[1], _MINILM_CLASSES, generator=torch.Generator().manual_seed(1234))
        labels = (rows @ w).argmax(1)
        return rows, labels, _MINILM_CLASSES, "MiniLM rows (labels: argmax of a fixed random projection)"
    raise ValueError(f"unknown row source {source!r}; expected one of {sorted(set(SU_SOURCES.values()))}")


def load_gnn_dataset(name: str, *, n_nodes: int = 1_000_000, avg_degree: float = 50.0, n_train: int = 10_240,
                     n_test: int = 4096, seed: int = 0, materialize: bool = True) -> GnnDataset:
    """Load ``cora`` / ``pubmed`` (real graphs, GCN split) or build ``cora_su`` / ``pubmed_su`` / ``minilm_su``.

    SU graphs are the paper's scale-up: a seeded power-law graph (``n_nodes``, about ``avg_degree`` edges per
    node) whose nodes get real feature rows assigned uniformly at random (with their labels); ``n_train`` /
    ``n_test`` random disjoint nodes are the training seeds and test nodes. The size options do not apply to
    the real graphs. ``materialize=False`` leaves ``features`` None and keeps only ``source_rows`` + ``pick`` (a
    process that attaches a shared store needs no copy of the table; ``materialize()`` builds it where needed).
    """
    from ibpcache import datasets

    if name in ("cora", "pubmed"):
        d = datasets.load_cora() if name == "cora" else datasets.load_pubmed()
        note = "real graph, GCN split" + ("" if name == "cora" else "; rows of nodes without features resampled")
        return GnnDataset(name, d.features, d.labels, d.src, d.dst, d.num_classes,
                          d.train_mask.nonzero().flatten(), d.test_mask.nonzero().flatten(), note,
                          source_rows=d.features)
    if name not in SU_SOURCES:
        raise ValueError(f"unknown data set {name!r}; expected cora, pubmed or one of {sorted(SU_SOURCES)}")
    if n_train + n_test > n_nodes:
        raise ValueError(f"n_train + n_test ({n_train + n_test}) exceeds n_nodes ({n_nodes})")
    rows, row_labels, n_classes, what = _real_rows_and_labels(SU_SOURCES[name])
    src, dst = datasets.power_law_graph(n_nodes, avg_degree, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pick = torch.randint(rows.shape[0], (n_nodes,), generator=gen)
    order = torch.randperm(n_nodes, generator=gen)
    note = f"power-law graph (seed {seed}, ~{avg_degree:g} edges/node), features: {what}"
    ds = GnnDataset(name, None, row_labels[pick], src, dst, n_classes, order[:n_train].clone(),
                    order[n_train:n_train + n_test].clone(), note, source_rows=rows, pick=pick)
    if materialize:
        ds.features = ds.materialize()
    return ds


def build_graph(ds: GnnDataset) -> Any:
    """The DGL graph with labels (features are attached per fetch mode); CSC built once, before workers fork."""
    dgl = import_dgl()
    g = dgl.graph((ds.src, ds.dst), num_nodes=ds.num_nodes)
    g.ndata["label"] = ds.labels
    g.create_formats_()
    return g


# --------------------------------------------------------------------------------------------------------------
# Model


def _segments(key: torch.Tensor, other: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``other`` in the (stable) order of ``key`` (values in ``[0, n)``), and the offsets of each key's run in it
    ([n + 1], int64). No host read (a bincount on CUDA reads the largest key back), so the sampling stage runs
    ahead."""
    key_sorted, order = torch.sort(key, stable=True)
    ptr = torch.searchsorted(key_sorted, torch.arange(n + 1, dtype=key.dtype, device=key.device))
    return other[order], ptr


@dataclass
class Block:
    """A sampled DGL block as index tensors on the training device (dst nodes are the first ``n_dst`` srcs), with
    its edges also grouped by destination and by source: the mean aggregation's segment sums (:class:`_SegmentSum`)
    read those, sorted once in the sampling stage rather than on the training thread."""

    src: torch.Tensor
    dst: torch.Tensor
    n_src: int
    n_dst: int
    inv_deg: torch.Tensor  # float32 [n_dst, 1]; 0 where a node has no sampled neighbour
    src_by_dst: torch.Tensor  # each edge's source, edges grouped by destination
    dst_ptr: torch.Tensor  # [n_dst + 1] offsets of each destination's edges in src_by_dst
    dst_by_src: torch.Tensor  # each edge's destination, edges grouped by source
    src_ptr: torch.Tensor  # [n_src + 1] offsets of each source's edges in dst_by_src

    @classmethod
    def _build(cls, src: torch.Tensor, dst: torch.Tensor, n_src: int, n_dst: int, device: torch.device,
               groups: "tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None" = None) -> "Block":
        """``groups``: (src_by_dst, dst_ptr, dst_by_src, src_ptr) when the sampler made them; else sorted here."""
        if groups is None:
            groups = (*_segments(dst, src, n_dst), *_segments(src, dst, n_src))
        src_by_dst, dst_ptr, dst_by_src, src_ptr = groups
        deg = (dst_ptr[1:] - dst_ptr[:-1]).to(torch.float32)  # in-degrees, from the grouping's offsets
        # 1 / deg, and 0 for a node without sampled neighbours (1 / 0 = inf): two kernels where a select took five;
        # the sampling stage's host time is its launches
        inv = torch.reciprocal(deg).nan_to_num_(posinf=0.0).unsqueeze(1)
        parts = (src, dst, inv, src_by_dst, dst_ptr, dst_by_src, src_ptr)
        if any(t.device != device for t in parts):
            parts = tuple(t.to(device, non_blocking=True) for t in parts)
        src, dst, inv, src_by_dst, dst_ptr, dst_by_src, src_ptr = parts
        return cls(src, dst, n_src, n_dst, inv, src_by_dst, dst_ptr, dst_by_src, src_ptr)

    @classmethod
    def from_dgl(cls, block: Any, device: torch.device) -> "Block":
        src, dst = (t.to(torch.int64) for t in block.edges())
        return cls._build(src, dst, int(block.num_src_nodes()), int(block.num_dst_nodes()), device)

    @classmethod
    def from_hop(cls, hop: Hop, device: torch.device) -> "Block":
        """A hop of ibpcache's sampler (positions in the sample's node list: dst nodes come first, as in DGL), with
        the edge groups the sampler made for the whole call (``groups=True``: one sort per hop and call, not two
        per block) or else sorted here; without a host read either way (see :func:`_segments`), since this runs in
        the sampling stage, ahead of training."""
        groups = None
        if hop.dst_ptr is not None and hop.dst_by_src is not None and hop.src_ptr is not None:
            groups = (hop.src, hop.dst_ptr, hop.dst_by_src, hop.src_ptr)
        return cls._build(hop.src, hop.dst, hop.n_src, hop.n_dst, device, groups)

    def record_stream(self, stream: Any) -> None:
        for t in (self.src, self.dst, self.inv_deg, self.src_by_dst, self.dst_ptr, self.dst_by_src, self.src_ptr):
            if t.is_cuda:
                t.record_stream(stream)


class _SegmentSum(torch.autograd.Function):
    """Per destination, the sum of its in-edges' source rows: a segment sum over the edges grouped by destination,
    and for the gradient the same over the edges grouped by source. Deterministic without ``index_add_`` /
    ``index_put_``, which deterministic CUDA torch runs as a sort plus bounds checks (about 13 more ops a call:
    profiled in docs/results/2026-11-27-h200-s39); each destination's (and source's) terms are added in edge order,
    as the stable grouping keeps it. The offsets may end before the edges do (a padded block's filler edges, see
    :class:`_PaddedBlock`): those terms are never read."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, block: Block) -> torch.Tensor:  # type: ignore[override]
        ctx.block = block
        return torch.segment_reduce(h.index_select(0, block.src_by_dst), "sum", offsets=block.dst_ptr, axis=0,
                                    unsafe=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        b = ctx.block
        return torch.segment_reduce(grad.contiguous().index_select(0, b.dst_by_src), "sum", offsets=b.src_ptr,
                                    axis=0, unsafe=True), None


class SAGEConv(nn.Module):
    """GraphSAGE layer with the mean aggregator: ``W_self h_v + W_neigh mean_{u in N(v)} h_u``.

    When the layer narrows the width, neighbours are projected before they are averaged (fewer bytes to
    gather), as DGL's SAGEConv does.
    """

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc_self = nn.Linear(in_dim, out_dim)
        self.fc_neigh = nn.Linear(in_dim, out_dim, bias=False)
        self.project_first = in_dim > out_dim

    @staticmethod
    def _mean(block: Block, h: torch.Tensor) -> torch.Tensor:
        return _SegmentSum.apply(h, block) * block.inv_deg

    def forward(self, block: Block, h_src: torch.Tensor) -> torch.Tensor:
        h_dst = h_src[: block.n_dst]
        if self.project_first:
            neigh = self._mean(block, self.fc_neigh(h_src))
        else:
            neigh = self.fc_neigh(self._mean(block, h_src))
        return self.fc_self(h_dst) + neigh


class GraphSAGE(nn.Module):
    """``len(fanouts)``-layer GraphSAGE with ReLU and dropout between layers.

    Dropout draws its masks from the model's own generator, so the masks depend on nothing but the seed, never
    on how many random numbers the feature path or the sampler consumed.
    """

    def __init__(self, in_dim: int, hidden: int, n_classes: int, n_layers: int = 2, dropout: float = 0.5) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * (n_layers - 1) + [n_classes]
        self.layers = nn.ModuleList(SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = dropout
        self._gen: torch.Generator | None = None
        self._seed = 0

    def seed_dropout(self, seed: int) -> None:
        self._seed = seed
        self._gen = None

    def noise(self, shape: Sequence[int], device: torch.device, out: "torch.Tensor | None" = None) -> torch.Tensor:
        """Uniform draws for a dropout mask, from the model's own generator (into ``out`` if given)."""
        if self._gen is None or self._gen.device != torch.device(device):
            self._gen = torch.Generator(device=device).manual_seed(self._seed)
        return torch.rand(tuple(shape), generator=self._gen, device=device, out=out)

    def drops(self) -> bool:
        return self.training and self.dropout != 0

    def _drop(self, h: torch.Tensor, noise: "torch.Tensor | None") -> torch.Tensor:
        if not self.drops():
            return h
        keep = (noise if noise is not None else self.noise(h.shape, h.device)) >= self.dropout
        return h * keep / (1.0 - self.dropout)

    def forward(self, blocks: Sequence[Block], x: torch.Tensor,
                noise: "Sequence[torch.Tensor] | None" = None) -> torch.Tensor:
        """``noise``: the dropout draws of each hidden layer, drawn beforehand (a CUDA graph replays fixed
        buffers); by default drawn here."""
        h = x.reshape(x.shape[0], -1).float()
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if i != len(self.layers) - 1:
                h = self._drop(torch.relu(h), noise[i] if noise is not None else None)
        return h


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, count: "torch.Tensor | None" = None) -> torch.Tensor:
    """Mean cross-entropy via log_softmax and a mask of each row's class (deterministic on CUDA, unlike nll_loss
    there). A row's masked sum is its one log-probability plus zeros, so the value equals a ``gather``'s; the mask's
    gradient is elementwise, where ``gather``'s is a scatter that deterministic CUDA torch runs as a sorted
    ``index_put_``. ``count``: the mean over that many rows (a device scalar) instead of all; rows labelled -1
    (padding) add nothing to the loss and get a zero gradient."""
    logp = torch.log_softmax(logits, dim=1)
    mask = labels.view(-1, 1) == torch.arange(logp.shape[1], device=logp.device)
    picked = torch.where(mask, logp, 0.0)
    return -(picked.sum(1).mean() if count is None else picked.sum() / count)


# --------------------------------------------------------------------------------------------------------------
# Training loop


#: the samplers a run can use: DGL's NeighborSampler (CPU, in DataLoader worker processes) or ibpcache's
#: NeighborSampler (plain torch; on the GPU when the graph fits there, see choose_sampler_device)
SAMPLERS = ("dgl", "torch")


@dataclass
class TrainConfig:
    """Everything that decides a run; identical configs give identical batches, masks and losses.

    ``sampler`` decides the batches (``dgl`` and ``torch`` draw different ones); ``pipelined``, ``sampler_device``,
    ``sample_chunk``, ``prefetch`` and ``sample_ahead`` only decide how fast they arrive.
    """

    fanouts: tuple[int, ...] = (25, 10)
    batch_size: int = 512
    epochs: int = 10
    hidden: int = 256
    dropout: float = 0.5
    lr: float = 0.003
    num_workers: int = 1
    prefetch: int = 2
    seed: int = 0
    deterministic: bool = True
    eval_batch_size: int = 1024
    tf32: bool = True  # TF32 matmuls on CUDA (deterministic too)
    verify_batches: int = 0  # first-epoch batches whose features are checked against the rows, bit for bit
    sampler: str = "dgl"  # one of SAMPLERS
    sampler_device: str = "auto"  # torch sampler: auto (the GPU when the graph fits) | cpu | cuda
    sample_chunk: int = 10  # torch sampler: batches sampled per call (a call's ~445 host ops are paid once per call)
    sampler_kernel: bool = True  # torch sampler on a GPU: each hop's draws in one kernel (NeighborSampler hop_kernel)
    pipelined: bool = True  # sampling, feature fetch and training overlapped (PipelinedLoader) or in turn
    sample_ahead: int = 2  # sampled batches waiting for the fetch stage
    stage_batches: int = -1  # batches of the separate stage-timing pass: -1 one epoch's, 0 no pass
    across_epochs: bool = True  # pipelined, torch sampler: one loader run over every epoch (see _run_one)
    step_graphs: bool = True  # CUDA: the training step's forward and backward as CUDA graphs (GraphedStep)
    optimizer_in_graph: bool = True  # step_graphs: Adam(capturable=True), its step replayed in the same graph
    gc_freeze: bool = False  # every mode's epochs: the objects alive at their start frozen (ibpcache frozen_gc)
    gil_switch_ms: "float | None" = None  # pipelined: Python's thread switch interval while iterating (None: 5 ms)
    fetch_blocks_per_sm: "int | None" = None  # cached modes: the fetch kernel's grid bound (FeatureCache; None: 16)
    fetch_sms: "int | None" = None  # pipelined, CUDA: sampler and fetch on this many SMs, the step on the rest
    fetch_validate: str = "lazy"  # cached modes: the cache's id check, lazy (in the lookup kernel) or eager (a sync)


@dataclass
class EpochTimes:
    """Seconds of one epoch.

    ``epoch``: wall time of the training loop (sampling, fetching and training, overlapped when pipelined);
    ``wait``: host time the trainer waited for its next batch. ``sample`` / ``fetch`` / ``train``: each stage ALONE
    for an epoch's batches, from a separate pass after training (sampling an epoch with the sampler's own workers;
    then in windows of a few batches the fetches, then the training steps, synced around each window's fetches
    and steps, not per batch: a stage alone runs ahead of the GPU as in training). Timing stages inside the
    pipelined loop would need syncs that serialize it, so the stage times of a mode come from that pass and are the
    same in its pipelined and unpipelined records; a pipelined epoch near ``max(sample, fetch, train)`` means the
    overlap works, one near their sum that it does not. That holds for stages on separate resources (DGL's sampler in
    CPU worker processes); stages that share the GPU (the torch sampler on it, the fetch, the step) cannot beat the
    sum of their GPU time either, which the records report beside it (``gpu_busy_ms``, :func:`_bound`).
    ``graph_captures`` / ``graph_replays``: training steps captured / replayed as CUDA graphs this epoch (a new
    padded shape, or a grown feature buffer, is captured anew); a capture costs far more than a replay, so these say
    whether a slow epoch was still capturing. ``gc_full`` / ``gc_young`` / ``gc_seconds``: the cyclic collector's
    full and younger collections in the epoch and their summed wall time; a collection stops every thread, so they
    say whether a slow epoch was paused by the collector. ``sample_busy`` / ``sample_blocked`` / ``fetch_starved`` /
    ``fetch_busy`` / ``fetch_blocked``: pipelined runs, the stage threads' time in the epoch
    (:class:`~ibpcache.loaders.pipeline.StageClock`; with ``across_epochs`` the sampler's run-ahead into the next
    epoch counts where it happens); with ``wait`` (the trainer starved) they say which stage held the epoch back.
    """

    epoch: float = 0.0
    sample: float = 0.0
    fetch: float = 0.0
    train: float = 0.0
    wait: float = 0.0
    batches: int = 0
    input_rows: int = 0
    graph_captures: int = 0
    graph_replays: int = 0
    gc_full: int = 0
    gc_young: int = 0
    gc_seconds: float = 0.0
    sample_busy: float = 0.0
    sample_blocked: float = 0.0
    fetch_starved: float = 0.0
    fetch_busy: float = 0.0
    fetch_blocked: float = 0.0


@dataclass
class RunResult:
    mode: str
    label: str
    epochs: list[EpochTimes] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    accuracy: float = float("nan")
    predictions_sha1: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    setup_seconds: float = 0.0
    sampler: str = "dgl"
    sampler_device: str = "cpu"
    pipelined: bool = True
    across_epochs: bool = False  # one loader run over every epoch (the next epoch's first batches made ahead)
    stages: dict[str, float] = field(default_factory=dict)  # sample / fetch / train seconds per epoch (stage pass)

    def mean_epoch(self) -> EpochTimes:
        """Mean over epochs 2..N (the first pays warm-up), or epoch 1 if there is only one; the stage times of the
        separate pass."""
        timed = self.epochs[1:] or self.epochs
        out = EpochTimes()
        for name in ("epoch", "wait", *_CLOCK_FIELDS):
            setattr(out, name, sum(getattr(e, name) for e in timed) / len(timed))
        for name in ("sample", "fetch", "train"):
            setattr(out, name, float(self.stages.get(name, math.nan)))
        out.batches = round(sum(e.batches for e in timed) / len(timed))
        out.input_rows = round(sum(e.input_rows for e in timed) / len(timed))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "label": self.label, "accuracy": self.accuracy,
                "predictions_sha1": self.predictions_sha1, "setup_seconds": self.setup_seconds,
                "sampler": self.sampler, "sampler_device": self.sampler_device, "pipelined": self.pipelined,
                "across_epochs": self.across_epochs,
                "stages": self.stages, "mean_epoch": asdict(self.mean_epoch()),
                "epochs": [asdict(e) for e in self.epochs], "losses": self.losses, "stats": self.stats}


@contextlib.contextmanager
def deterministic_cuda(enabled: bool, tf32: bool = False) -> Iterator[None]:
    """Deterministic CUDA kernels (e.g. index_add_) and the TF32 choice for one run, restored afterwards.

    ``CUBLAS_WORKSPACE_CONFIG`` must be set before cuBLAS starts; scripts set it at start-up. TF32 matmuls
    stay deterministic; they only make the training step shorter, so feature fetching shows more.
    """
    if not torch.cuda.is_available():
        yield
        return
    import torch.utils.deterministic as det

    old_mode = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    old_fill = det.fill_uninitialized_memory
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        det.fill_uninitialized_memory = False  # only costs time; outputs are always written before use
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_mode, warn_only=old_warn)
        det.fill_uninitialized_memory = old_fill
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


@functools.cache
def _quiet_loader_warnings() -> None:
    """DGL suggests CPU affinity and torch counts workers against cores on every epoch; neither is news.

    Installed once, process-wide: the warnings fire in the sampler thread, and ``catch_warnings`` is not
    thread-safe.
    """
    warnings.filterwarnings("ignore", message=".*CPU affinity opt is not enabled.*")
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")


class _WorkerSeed:
    """worker_init_fn: seeds DGL's sampler in each worker process (picklable, unlike a lambda)."""

    def __init__(self, base: int) -> None:
        self.base = base

    def __call__(self, worker_id: int) -> None:
        import_dgl().seed(self.base + worker_id)


@dataclass
class _Sampled:
    """What the sampling stage hands over: input node ids (CPU or the sampler's device), blocks and labels on the
    training device."""

    input_nodes: torch.Tensor
    blocks: list[Block]
    y: torch.Tensor


@dataclass
class _Batch:
    """A batch ready to train on: the sampled batch plus its features on the training device."""

    input_nodes: torch.Tensor
    blocks: list[Block]
    x: torch.Tensor
    y: torch.Tensor


def _make_loader(g: Any, nids: torch.Tensor, cfg: TrainConfig, batch_size: int, shuffle: bool,
                 seed: int) -> Any:
    """DGL's DataLoader with labels prefetched by DGL; features are the fetch stage's."""
    dgl = import_dgl()
    sampler = dgl.dataloading.NeighborSampler(list(cfg.fanouts), prefetch_labels=["label"])
    extra: dict[str, Any] = {}
    if cfg.num_workers > 0:
        extra = {"persistent_workers": True, "worker_init_fn": _WorkerSeed(seed)}
    _quiet_loader_warnings()
    return dgl.dataloading.DataLoader(g, nids, sampler, device="cpu", batch_size=batch_size, shuffle=shuffle,
                                      drop_last=False, num_workers=cfg.num_workers, **extra)


class _DGLBatches:
    """DGL's sampler: its DataLoader (worker processes sample), each batch's blocks and labels moved to the device
    in the sampling stage."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader = loader
        self.device = device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[_Sampled]:
        return self._convert(iter(self.loader))  # iter() here: in the caller's thread (see PipelinedLoader)

    def _convert(self, batches: Iterator[Any]) -> Iterator[_Sampled]:
        for input_nodes, _, blocks in batches:
            y = blocks[-1].dstdata["label"].to(self.device, non_blocking=True)
            yield _Sampled(input_nodes, [Block.from_dgl(b, self.device) for b in blocks], y)


class _TorchBatches:
    """ibpcache's sampler: a seeded shuffle per epoch, ``chunk`` batches sampled per call on the sampler's device;
    a batch's sample depends only on (seed, phase, epoch, batch index), never on the device or the chunk size."""

    def __init__(self, sampler: NeighborSampler, nids: torch.Tensor, labels: torch.Tensor, batch_size: int,
                 shuffle: bool, key: tuple[int, ...], chunk: int, device: torch.device) -> None:
        self.sampler, self.nids, self.labels = sampler, nids, labels
        self.batch_size, self.shuffle, self.key = batch_size, shuffle, key
        self.chunk, self.device = max(1, chunk), device
        self.epoch = 0

    def __len__(self) -> int:
        return math.ceil(self.nids.numel() / self.batch_size)

    def __iter__(self) -> Iterator[_Sampled]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        n = self.nids.numel()
        order = (torch.randperm(n, generator=torch.Generator().manual_seed(batch_key(*self.key, epoch)))
                 if self.shuffle else torch.arange(n))
        order = order.to(self.nids.device)  # one copy per epoch, not one blocking copy of indices per batch
        seeds = [self.nids[order[i:i + self.batch_size]] for i in range(0, n, self.batch_size)]
        for first in range(0, len(seeds), self.chunk):
            group = seeds[first:first + self.chunk]
            keys = [batch_key(*self.key, epoch, first + j) for j in range(len(group))]
            for s in self.sampler.sample(group, keys):
                blocks = [Block.from_hop(h, self.device) for h in reversed(s.hops)]
                yield _Sampled(s.nodes, blocks, self.labels[s.nodes[:s.num_seeds]].to(self.device, non_blocking=True))


class _Fetch:
    """The feature-fetch stage: the rows of a batch's input nodes from the attached storage (cache or DGL's)."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage

    def __call__(self, s: _Sampled) -> _Batch:
        return _Batch(s.input_nodes, s.blocks, self.storage.fetch(s.input_nodes), s.y)


class _InTurn:
    """The unpipelined loop: sample, fetch, hand over, one after the other in the caller's thread."""

    def __init__(self, batches: Any, fetch: _Fetch) -> None:
        self.batches, self.fetch = batches, fetch

    def __iter__(self) -> Iterator[_Batch]:
        for s in self.batches:
            yield self.fetch(s)


class AllEpochs:
    """``epochs`` epochs of a re-iterable batch source as ONE stream (the source iterated once per epoch, in turn),
    so a pipelined loader over it samples and fetches the next epoch's first batches while this epoch trains. Only
    for sources whose batches depend on (seed, epoch, batch) alone, never on the thread that starts an epoch."""

    def __init__(self, batches: Any, epochs: int) -> None:
        self.batches, self.epochs = batches, epochs

    def __len__(self) -> int:
        return len(self.batches) * self.epochs

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.epochs):
            yield from self.batches


def epoch_slices(stream: Iterable[Any], per_epoch: int, epochs: int) -> Iterator[Iterator[Any]]:
    """Each epoch's ``per_epoch`` batches, in turn, from ONE pass over ``stream`` (e.g. a pipelined loader over
    :class:`AllEpochs`); after the last epoch the stream must be exhausted (it is then closed, threads and all)."""
    it = iter(stream)
    for _ in range(epochs):
        yield itertools.islice(it, per_epoch)
    if next(it, None) is not None:
        raise IbpcacheError("the batch stream held more batches than its epochs")


def _epochs(batches: Any, fetch: _Fetch, cfg: TrainConfig, device: torch.device) -> Any:
    """Re-iterable batches of a run: pipelined (library's PipelinedLoader) or in turn."""
    if cfg.pipelined:
        return PipelinedLoader(batches, fetch, device=device, prefetch=cfg.prefetch, sample_ahead=cfg.sample_ahead,
                               switch_interval=switch_interval(cfg), fetch_sms=_fetch_sms(cfg, device))
    return _InTurn(batches, fetch)


def _fetch_sms(cfg: TrainConfig, device: torch.device) -> "int | None":
    """``PipelinedLoader``'s ``fetch_sms``: the config's on a GPU, None on the CPU (nothing to split)."""
    return cfg.fetch_sms if device.type == "cuda" else None


def _capture_stream(cfg: TrainConfig, device: torch.device) -> Any:
    """Where a pipelined run with ``fetch_sms`` captures its step graphs: on the step's SMs, where they replay."""
    sms = _fetch_sms(cfg, device) if cfg.pipelined else None
    return split_sms(device, sms).capture_stream if sms is not None else None


def switch_interval(cfg: TrainConfig) -> "float | None":
    """``PipelinedLoader``'s ``switch_interval`` (seconds) from ``gil_switch_ms``."""
    return None if cfg.gil_switch_ms is None else cfg.gil_switch_ms / 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _verify(batch: _Batch, ds: GnnDataset) -> None:
    """The fetched features must equal the host rows of the batch's input nodes, byte for byte."""
    got = batch.x.detach().to("cpu").contiguous().view(torch.uint8)
    want = ds.node_rows(batch.input_nodes.to("cpu")).contiguous().view(torch.uint8)
    if not torch.equal(got, want):
        raise IbpcacheError("fetched features differ from the original rows (lossless path is broken)")


def _pin_cpu_threads(device: torch.device, threads: int) -> None:
    """CPU training: the same intra-op thread count at every step. Numba's OpenMP layer (the CPU cache's decoder)
    resets the count of the thread that calls it, which is the trainer's own when unpipelined and the fetch
    thread's when pipelined, and Adam rounds differently when a tensor is split over another number of threads."""
    if device.type == "cpu" and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _step(model: GraphSAGE, opt: torch.optim.Optimizer, batch: _Batch) -> torch.Tensor:
    """One training step; the loss stays on the device (reading it would sync every step)."""
    loss = cross_entropy(model(batch.blocks, batch.x), batch.y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def padded_size(n: int) -> int:
    """The padded size of ``n`` rows or edges: ``n + 1`` rounded up to a sixteenth of its power of two (at most
    about 6% more), so a padded block always has a spare destination and source for its filler edges, and a few
    graphs cover an epoch's batches. A batch's own sizes decide its shape, so a DDP rank and the one-process
    reference pad a batch alike (cuBLAS may round a row differently in a matrix of another height)."""
    q = 1 << max(0, (n + 1).bit_length() - 5)
    return -(-(n + 1) // q) * q


class _PaddedBlock:
    """A block's edge groups in fixed buffers of padded sizes. Padding destinations and sources own empty
    segments, and the filler edges past the real ones lie outside every segment: the segment sums never read them
    (they only fill the gather to its fixed size, from the last, padding, row). So no real row's sum, mean or
    gradient changes, padding destinations sum to zero with a mean weight of 0, and padding rows get a zero
    gradient (their loss rows are masked). Why not one padding segment holding the filler edges: torch's segment
    sum adds a segment's terms one after another, so a segment of thousands of filler edges would be a serial tail
    in every padded step."""

    def __init__(self, n_src: int, n_dst: int, n_edges: int, device: torch.device) -> None:
        i64 = {"dtype": torch.int64, "device": device}
        self.src_by_dst = torch.full((n_edges,), n_src - 1, **i64)
        self.dst_by_src = torch.full((n_edges,), n_dst - 1, **i64)
        self.dst_ptr = torch.zeros((n_dst + 1,), **i64)
        self.src_ptr = torch.zeros((n_src + 1,), **i64)
        self.inv_deg = torch.zeros(n_dst, 1, dtype=torch.float32, device=device)
        none = torch.empty(0, **i64)  # the model reads the groups, not the edge list
        self.block = Block(none, none, n_src, n_dst, self.inv_deg, self.src_by_dst, self.dst_ptr, self.dst_by_src,
                           self.src_ptr)

    def fill(self, b: Block) -> None:
        """Copy ``b`` in; the padding entries are set again since ``b``'s sizes differ from the last batch's."""
        e = int(b.src_by_dst.numel())
        self.src_by_dst[:e].copy_(b.src_by_dst)
        self.src_by_dst[e:].fill_(self.block.n_src - 1)
        self.dst_by_src[:e].copy_(b.dst_by_src)
        self.dst_by_src[e:].fill_(self.block.n_dst - 1)
        self.dst_ptr[:b.n_dst + 1].copy_(b.dst_ptr)
        self.dst_ptr[b.n_dst + 1:].fill_(e)  # empty segments: the filler edges belong to none
        self.src_ptr[:b.n_src + 1].copy_(b.src_ptr)
        self.src_ptr[b.n_src + 1:].fill_(e)
        self.inv_deg[:b.n_dst].copy_(b.inv_deg)
        self.inv_deg[b.n_dst:].zero_()


class _PaddedBatch:
    """A training batch in fixed buffers of one padded shape: features (zeros past the real rows), blocks, labels
    (-1 past the real seeds), the count of real seeds and the dropout draws."""

    def __init__(self, key: tuple, x_arena: torch.Tensor, hidden: int, device: torch.device) -> None:
        (rows, *_), blocks, seeds = key
        self.x = x_arena[:rows]
        self.blocks = [_PaddedBlock(*shape, device) for shape in blocks]
        self.labels = torch.full((seeds,), -1, dtype=torch.int64, device=device)
        self.count = torch.zeros((), dtype=torch.float32, device=device)
        self.noise = [torch.empty(shape[1], hidden, dtype=torch.float32, device=device) for shape in blocks[:-1]]

    @staticmethod
    def key_of(batch: _Batch) -> tuple:
        rows = padded_size(int(batch.x.shape[0]))
        blocks = tuple((padded_size(b.n_src), padded_size(b.n_dst), padded_size(int(b.src_by_dst.numel())))
                       for b in batch.blocks)
        return ((rows, *batch.x.shape[1:]), blocks, padded_size(int(batch.y.numel())))

    def fill(self, batch: _Batch, model: GraphSAGE) -> None:
        n = int(batch.x.shape[0])
        self.x[:n].copy_(batch.x)
        self.x[n:].zero_()
        for pb, b in zip(self.blocks, batch.blocks):
            pb.fill(b)
        k = int(batch.y.numel())
        self.labels[:k].copy_(batch.y)
        self.labels[k:].fill_(-1)
        self.count.fill_(k)
        if model.drops():
            for buf in self.noise:
                model.noise(buf.shape, buf.device, out=buf)

    def loss(self, model: GraphSAGE) -> torch.Tensor:
        logits = model([pb.block for pb in self.blocks], self.x, self.noise if model.drops() else None)
        return cross_entropy(logits, self.labels, self.count)


class GraphedStep:
    """The training step with its forward and backward replayed from CUDA graphs (ibpcache's
    :class:`~ibpcache.cache.step_graphs.StepGraphs`, one graph per padded batch shape); the optimizer steps eagerly
    after the replay.

    Why: the eager step is 64 kernel launches and about 280 aten calls, 3-5 ms of host time a batch, and it bounds
    the pipelined epoch (the stages' host work shares one interpreter; docs/results/2026-11-27-h200-s39 and s40).
    A replay is one launch; filling the fixed buffers is about 25 small copies.

    How: a batch is padded to sizes its own sizes decide (:func:`padded_size`, :class:`_PaddedBlock`), so a few
    shapes cover an epoch. A shape's first batch steps eagerly on its buffers, its second is captured, then
    replayed (the engine's rule; a failed capture leaves every step eager, ``stats()`` says why). Gradients are
    views of one flat buffer (zeroed in place before each step), so every graph accumulates into the same memory and
    a data-parallel run reduces them with one call (``reduce``); the shapes share
    one feature buffer, grown (and every graph dropped) when a batch needs more rows. Dropout draws come from the
    model's generator, drawn eagerly into the batch's buffers before the step. Losses equal eager steps on the same
    padded batches (``graphs=False``, any device), not the unpadded step's: padded matmuls may round differently.
    """

    def __init__(self, model: GraphSAGE, opt: torch.optim.Optimizer, device: torch.device, *,
                 graphs: bool = True, max_graphs: int = 64,
                 reduce: "Callable[[torch.Tensor], None] | None" = None, capture_stream: Any = None) -> None:
        """``reduce``: called with the flat gradient buffer (every parameter's ``.grad`` is a view of it) between
        the replayed backward and the optimizer step, e.g. a data-parallel all-reduce in place.

        An optimizer built with ``capturable=True`` (every param group) steps inside the graph too when no
        ``reduce`` sits between backward and step: a replay is then the whole step, and the optimizer's host work
        (about 0.3 ms a step for Adam) leaves the interpreter the pipeline's stages share. ``capture_stream``: see
        :class:`~ibpcache.cache.step_graphs.StepGraphs`."""
        from ibpcache.cache.step_graphs import StepGraphs

        if graphs and device.type != "cuda":
            raise ConfigError(f"GraphedStep: CUDA graphs need a CUDA device, got {device}")
        self.model, self.opt, self.device, self.reduce = model, opt, device, reduce
        self.hidden = model.layers[0].fc_self.out_features
        self.graphs = StepGraphs(device, max_graphs=max_graphs, capture_stream=capture_stream)
        if not graphs:
            self.graphs.disable("graphs=False")
        self._x = torch.empty(0)
        self._padded: dict[tuple, _PaddedBatch] = {}
        self.grads = torch.empty(0)
        self.optimizer_in_graph = (graphs and reduce is None
                                   and all(g.get("capturable", False) for g in opt.param_groups))

    def _arena(self, key: tuple, x: torch.Tensor) -> torch.Tensor:
        """The feature buffer, grown by a quarter more than asked when too small (dropping every graph and padded
        batch: they read the old one)."""
        rows, *row_shape = key[0]
        a = self._x
        if (a.dtype != x.dtype or a.device != x.device or tuple(a.shape[1:]) != tuple(row_shape)
                or a.shape[0] < rows):
            self.graphs.clear()
            self._padded.clear()
            self._x = torch.zeros((rows + rows // 4, *row_shape), dtype=x.dtype, device=x.device)
        return self._x

    def _grads_ready(self) -> None:
        """Zeroed gradients that stay put: views of one flat buffer (``self.grads``, zeroed with one launch), so
        every graph accumulates into the same memory and a data-parallel reduce is one call."""
        params = list(self.model.parameters())
        if self.grads.numel() and all(p.grad is not None and p.grad.untyped_storage().data_ptr()
                                      == self.grads.untyped_storage().data_ptr() for p in params):
            self.grads.zero_()
            return
        self.graphs.clear()  # captured backwards accumulate into the old buffers
        self.grads = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=self.device)
        at = 0
        for p in params:
            p.grad = self.grads[at:at + p.numel()].view_as(p)
            at += p.numel()

    def _forward_backward(self, pb: _PaddedBatch, out: torch.Tensor) -> None:
        loss = pb.loss(self.model)
        loss.backward()
        out.copy_(loss.detach())

    def _whole_step(self, pb: _PaddedBatch, out: torch.Tensor) -> None:
        self._forward_backward(pb, out)
        if torch.cuda.is_current_stream_capturing():
            self.opt.step()
            return
        with warnings.catch_warnings():  # a shape's first (eager) step: torch warns that capturable steps uncaptured
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
            self.opt.step()

    def _replay(self, batch: _Batch, whole: bool) -> torch.Tensor:
        """Pad and fill ``batch``, zero the gradients, then run forward and backward (and with ``whole`` the
        optimizer step) from the shape's graph, or eagerly where there is none yet; the loss on the device."""
        key = _PaddedBatch.key_of(batch)
        x = self._arena(key, batch.x)
        pb = self._padded.get(key)
        if pb is None:
            pb = self._padded[key] = _PaddedBatch(key, x, self.hidden, self.device)
        pb.fill(batch, self.model)
        self._grads_ready()
        loss = torch.empty((), dtype=torch.float32, device=self.device)
        body = self._whole_step if whole else self._forward_backward
        if not self.graphs.run(key, (), loss, lambda _inputs, out: body(pb, out), keep=(pb,)):
            body(pb, loss)
        return loss

    def forward_backward(self, batch: _Batch) -> torch.Tensor:
        """The loss of ``batch`` (on the device) with its gradient in ``self.grads``, zeroed first; no optimizer
        step."""
        if self.optimizer_in_graph:
            raise ConfigError("GraphedStep: its optimizer steps inside the graph; call the step itself")
        return self._replay(batch, whole=False)

    def __call__(self, batch: _Batch) -> torch.Tensor:
        """One step on ``batch``: forward and backward, ``reduce`` of the gradients if given, the optimizer step;
        returns the loss on the device."""
        if self.optimizer_in_graph:
            return self._replay(batch, whole=True)
        loss = self._replay(batch, whole=False)
        if self.reduce is not None:
            self.reduce(self.grads)
        self.opt.step()
        return loss

    def stats(self) -> dict[str, Any]:
        return {**self.graphs.stats(), "padded_shapes": len(self._padded)}


def new_optimizer(model: GraphSAGE, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """Adam at ``cfg.lr``; capturable (so :class:`GraphedStep` replays its step in the step's graph) where
    ``cfg.optimizer_in_graph`` and the steps are graphed. Every mode of a run gets the same kind, so their losses
    stay identical (capturable Adam rounds its bias correction on the device, not in Python)."""
    capturable = cfg.optimizer_in_graph and cfg.step_graphs and device.type == "cuda"
    return torch.optim.Adam(model.parameters(), lr=cfg.lr, capturable=capturable)


def make_step(model: GraphSAGE, opt: torch.optim.Optimizer, cfg: TrainConfig, device: torch.device,
              capture_stream: Any = None) -> Callable[[_Batch], torch.Tensor]:
    """The training step a run uses: :class:`GraphedStep` (capturing on ``capture_stream`` if given) when
    ``cfg.step_graphs`` and training on CUDA, else the eager :func:`_step`."""
    if cfg.step_graphs and device.type == "cuda":
        return GraphedStep(model, opt, device, capture_stream=capture_stream)
    return functools.partial(_step, model, opt)


def _train_epoch(model: GraphSAGE, step: "Callable[[_Batch], torch.Tensor]", batches: Any, device: torch.device,
                 cfg: TrainConfig, threads: int, verify: GnnDataset | None = None,
                 stream: Any = None) -> tuple[EpochTimes, list[float]]:
    """One epoch, its steps on ``stream`` (default: the current one); the host reads nothing back until its end (a
    pipelined loader keeps running ahead) and runs at most two steps ahead of the GPU (StepsInFlight)."""
    times, losses = EpochTimes(), []
    model.train()
    _sync(device)
    start = time.perf_counter()
    with torch.cuda.stream(stream):  # None: a no-op
        in_flight = StepsInFlight(device, limit=2)
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            times.wait += time.perf_counter() - t0
            if batch is None:
                break
            if verify is not None and times.batches < cfg.verify_batches:
                _verify(batch, verify)
            _pin_cpu_threads(device, threads)
            losses.append(step(batch))
            in_flight.step_done()
            times.batches += 1
            times.input_rows += int(batch.x.shape[0])
        values = torch.stack(losses).tolist() if losses else []  # on the steps' stream: waits for the last
    _sync(device)
    times.epoch = time.perf_counter() - start
    return times, values


@torch.no_grad()
def _evaluate(model: GraphSAGE, batches: Any) -> tuple[float, str]:
    model.eval()
    preds, labels = [], []
    for batch in batches:
        preds.append(model(batch.blocks, batch.x).argmax(1))
        labels.append(batch.y)
    if not preds:
        return float("nan"), ""
    p, y = torch.cat(preds), torch.cat(labels)
    return float((p == y).float().mean()), hashlib.sha1(p.cpu().numpy().tobytes()).hexdigest()


def _stage_times(batches: Any, fetch: _Fetch, new_model: "Callable[[], tuple[GraphSAGE, Callable[[_Batch], Any]]]",
                 device: torch.device, cfg: TrainConfig, threads: int) -> dict[str, Any]:
    """Each stage alone, seconds per epoch: sampling an epoch's batches (with the sampler's own workers or chunks,
    as in training), then in windows of :data:`_STAGE_WINDOW` batches the window's fetches back to back, then its
    training steps (of a throwaway model; at most two ahead of the GPU, as in training), the device synced only
    around each window's fetches and steps. ``cfg.stage_batches`` > 0 times that many batches and scales to an
    epoch. Then the same stages once more under the profiler, for what they cost the resources they share
    (:func:`_stage_shares`).

    Why windows: a stage synced after every batch costs its host time plus its GPU time, while running alone it
    costs about the larger of the two, so per-batch syncs overstate the slowest stage and flatter
    ``epoch_vs_slowest_stage``; one window's fetched batches (not an epoch's) are held on the device at a time."""
    per_epoch = len(batches)
    limit = cfg.stage_batches if cfg.stage_batches > 0 else per_epoch
    _sync(device)
    t0 = time.perf_counter()
    items: list[_Sampled] = []
    for s in batches:
        items.append(s)
        if len(items) >= limit:
            break
    _sync(device)
    sample_s = time.perf_counter() - t0
    if not items:
        return {"sample": 0.0, "fetch": 0.0, "train": 0.0, "batches": 0}
    model, step = new_model()
    model.train()
    _pin_cpu_threads(device, threads)
    for s in items * 2 if isinstance(step, GraphedStep) else items[:1]:
        step(fetch(s))  # warm-up: optimizer state, allocator; graphs: every shape's eager step and capture
    fetch_s = train_s = 0.0
    for at in range(0, len(items), _STAGE_WINDOW):
        _sync(device)
        t0 = time.perf_counter()
        window = [fetch(s) for s in items[at:at + _STAGE_WINDOW]]
        _sync(device)
        t1 = time.perf_counter()
        _pin_cpu_threads(device, threads)
        in_flight = StepsInFlight(device, limit=2)
        for batch in window:
            step(batch)
            in_flight.step_done()
        _sync(device)
        fetch_s += t1 - t0
        train_s += time.perf_counter() - t1
        del window
    scale = per_epoch / len(items)
    walls = {"sample": sample_s * scale, "fetch": fetch_s * scale, "train": train_s * scale}
    return {**walls, "batches": len(items),
            **_stage_shares(batches, items, fetch, step, device, threads, walls)}


#: the pipelined loader's stage-thread times kept per epoch (EpochTimes, StageClock)
_CLOCK_FIELDS = tuple(f.name for f in fields(StageClock))

#: batches fetched, then trained, between device syncs in the timed stage pass (:func:`_stage_times`): enough that
#: the sync's bubble is a small part of a window, few enough that their features fit beside training
_STAGE_WINDOW = 8

#: batches of the profiled stage pass (two of the torch sampler's default chunks): enough for per-batch shares, few
#: enough that the profile's events take a second, not ten, to read
_PROFILED_BATCHES = 8


def _stage_shares(batches: Any, items: list[_Sampled], fetch: _Fetch, step: "Callable[[_Batch], Any]",
                  device: torch.device, threads: int, walls: dict[str, float]) -> dict[str, "float | None"]:
    """What each stage costs what the stages share, seconds per epoch, from one profiled pass over the first
    ``_PROFILED_BATCHES`` batches (:class:`~ibpcache.testing.stages.StageProfile`): ``<stage>_gpu`` (its kernels'
    busy time), ``<stage>_copy`` (its copies'), ``<stage>_host`` (its wall time alone minus its waits for the GPU).
    GPU numbers are None without CUDA; all are None if the profiler fails (a warning says why: the timed numbers
    stand without them).

    Why: when the stages share one GPU, a pipelined epoch cannot beat the sum of their GPU time, which may exceed
    the slowest stage alone; the host numbers say how much Python each stage needs, which the stages' threads
    share through one interpreter.
    """
    from ibpcache.testing.stages import StageProfile

    names = ("sample", "fetch", "train")
    empty: dict[str, "float | None"] = {f"{n}_{k}": None for n in names for k in ("gpu", "copy", "host")}
    items = items[:_PROFILED_BATCHES]
    prof = StageProfile(device)
    sampled = 0
    try:
        with prof:
            with prof.stage("sample"):
                for _ in batches:
                    sampled += 1
                    if sampled >= len(items):
                        break
            for s in items:
                with prof.stage("fetch"):
                    batch = fetch(s)
                _pin_cpu_threads(device, threads)
                with prof.stage("train"):
                    step(batch)
        busy = prof.result()
    except Exception as exc:  # noqa: BLE001 - a measurement aid; the run's own numbers do not depend on it
        warnings.warn(f"stage profile failed ({type(exc).__name__}: {exc}); GPU/host shares not reported",
                      stacklevel=2)
        return empty
    per_epoch = len(batches)
    out = dict(empty)
    for n in names:
        b = busy.get(n)
        if b is None:
            continue
        scale = per_epoch / max(sampled if n == "sample" else len(items), 1) / 1e3  # ms of the pass -> s/epoch
        if device.type == "cuda":
            out[f"{n}_gpu"], out[f"{n}_copy"] = b.kernel_ms * scale, b.copy_ms * scale
        out[f"{n}_host"] = b.host_ms(walls[n] / scale) * scale
    return out


def build_torch_sampler(ds: GnnDataset, cfg: TrainConfig, device: torch.device) -> NeighborSampler:
    """ibpcache's sampler for ``ds`` (DGL's fanout order reversed into hops): on the GPU when training there and
    the graph fits (``cfg.sampler_device``, see choose_sampler_device), else on the CPU."""
    want = cfg.sampler_device if device.type == "cuda" else "cpu"
    where = choose_sampler_device(ds.num_nodes, ds.num_edges, want, edge_ids=False)
    return NeighborSampler(ds.src, ds.dst, ds.num_nodes, list(reversed(cfg.fanouts)), device=where, edge_ids=False,
                           groups=True, hop_kernel=cfg.sampler_kernel)


def _batches(ds: GnnDataset, g: Any, cfg: TrainConfig, device: torch.device, sampler: "NeighborSampler | None",
             train: bool) -> Any:
    """The sampling stage of a run: training batches (shuffled) or test batches."""
    nids = ds.train_nids if train else ds.test_nids
    size = cfg.batch_size if train else cfg.eval_batch_size
    seed = cfg.seed * 7919 + (0 if train else 1)
    if cfg.sampler == "dgl":
        return _DGLBatches(_make_loader(g, nids, cfg, size, shuffle=train, seed=seed), device)
    assert sampler is not None
    return _TorchBatches(sampler, nids.to(sampler.device), ds.labels.to(sampler.device), size, train,
                         (cfg.seed, 0 if train else 1), cfg.sample_chunk, device)


def _check_config(cfg: TrainConfig) -> None:
    if cfg.sampler not in SAMPLERS:
        raise ConfigError(f"unknown sampler {cfg.sampler!r}; expected one of {list(SAMPLERS)}")
    if cfg.sample_chunk < 1:
        raise ConfigError(f"sample_chunk must be >= 1, got {cfg.sample_chunk}")


def _one_of(cfgs: Sequence[TrainConfig], field: str, default: Any) -> Any:
    """The value of a storage setting every config shares (one storage serves them all)."""
    values = {getattr(c, field) for c in cfgs}
    if len(values) > 1:
        raise ConfigError(f"run_variants: one storage serves every config, so they need one {field}, "
                          f"got {sorted(values, key=str)}")
    return values.pop() if values else default


def run_variants(ds: GnnDataset, g: Any, mode: "str | FetchMode", cfgs: Sequence[TrainConfig], *,
                 device: torch.device, budget: float | int = 0.01, policy: str = "static", codec: Any = "auto",
                 progress: "Callable[[TrainConfig], Callable[[int], None]] | None" = None,
                 torch_sampler: "NeighborSampler | None" = None) -> list[RunResult]:
    """Attach ``ds.features`` to ``g`` in ``mode`` once, then train once per config (sampler x pipelining).

    Seeds (model init, shuffling, sampling, dropout) are reset per run, so runs that differ only in the fetch
    mode or in pipelining see the same batches and must produce the same losses; the stage-timing pass runs once
    per sampler (after training and evaluation, on a throwaway model) and is shared by that sampler's runs.
    ``progress(cfg)`` returns the per-epoch callback of a run.
    """
    mode = FetchMode.from_str(mode)
    for cfg in cfgs:
        _check_config(cfg)
    t0 = time.perf_counter()
    storage = make_storage(ds.features, mode, device=device, budget=budget, policy=policy, codec=codec,
                           hotness=_degree_scores(g) if mode.uses_cache and policy == "static" else None,
                           name=ds.name, fetch_blocks_per_sm=_one_of(cfgs, "fetch_blocks_per_sm", None),
                           validate=_one_of(cfgs, "fetch_validate", "lazy"))
    attach(g, {"feat": storage})
    _sync(device)
    setup_s = time.perf_counter() - t0
    if torch_sampler is None and any(c.sampler == "torch" for c in cfgs):
        torch_sampler = build_torch_sampler(ds, cfgs[0], device)
    stage_cache: dict[str, dict[str, float]] = {}
    results = []
    for cfg in cfgs:
        results.append(_run_one(ds, g, storage, mode, cfg, device=device, sampler=torch_sampler,
                                stage_cache=stage_cache, progress=progress(cfg) if progress is not None else None))
        results[-1].setup_seconds = setup_s
    return results


def _run_one(ds: GnnDataset, g: Any, storage: Any, mode: FetchMode, cfg: TrainConfig, *, device: torch.device,
             sampler: "NeighborSampler | None", stage_cache: dict[str, dict[str, float]],
             progress: "Callable[[int], None] | None") -> RunResult:
    dgl = import_dgl()
    fetch = _Fetch(storage)
    where = str(sampler.device) if cfg.sampler == "torch" and sampler is not None else "cpu"
    # One loader run over every epoch where the batches allow it: the torch sampler's depend on (seed, epoch, batch)
    # alone. DGL's loader shuffles with NumPy's global generator, seeded per epoch in this thread, so it starts
    # each epoch here.
    across = cfg.pipelined and cfg.across_epochs and cfg.sampler == "torch"
    result = RunResult(mode.value, mode.label, sampler=cfg.sampler, sampler_device=where, pipelined=cfg.pipelined,
                       across_epochs=across)
    threads = torch.get_num_threads()
    in_dim = int(np.prod(ds.row_shape))

    def new_model(capture_stream: Any = None) -> tuple[GraphSAGE, Callable[[_Batch], torch.Tensor]]:
        model = GraphSAGE(in_dim, cfg.hidden, ds.num_classes, len(cfg.fanouts), cfg.dropout)
        model.seed_dropout(cfg.seed)
        model = model.to(device)
        return model, make_step(model, new_optimizer(model, cfg, device), cfg, device, capture_stream)

    with deterministic_cuda(cfg.deterministic and device.type == "cuda", tf32=cfg.tf32):
        torch.manual_seed(cfg.seed)
        dgl.seed(cfg.seed)
        model, step = new_model(_capture_stream(cfg, device))  # (the stage pass's models use the whole GPU)
        train_batches = _batches(ds, g, cfg, device, sampler, train=True)
        loop = _epochs(AllEpochs(train_batches, cfg.epochs) if across else train_batches, fetch, cfg, device)
        epochs = (epoch_slices(loop, len(train_batches), cfg.epochs) if across
                  else (loop for _ in range(cfg.epochs)))
        storage.reset_stats()
        with frozen_gc(cfg.gc_freeze):  # every mode alike, pipelined or not: GC pauses are not the cache's
            for epoch, batches in enumerate(epochs):
                np.random.seed((cfg.seed * 1000 + epoch) % 2**32)  # DGL shuffles with NumPy's global generator
                graphs = step.graphs if isinstance(step, GraphedStep) else None
                captured, replayed = (graphs.captures, graphs.replays) if graphs is not None else (0, 0)
                clock = loop.clock.snapshot() if isinstance(loop, PipelinedLoader) else None
                with GcPauses() as pauses:
                    times, losses = _train_epoch(model, step, batches, device, cfg, threads,
                                                 verify=ds if epoch == 0 else None,
                                                 stream=getattr(loop, "step_stream", None))
                times.gc_full, times.gc_young, times.gc_seconds = pauses.full, pauses.young, pauses.seconds
                if clock is not None:
                    spent = loop.clock.since(clock)
                    for name in _CLOCK_FIELDS:
                        setattr(times, name, getattr(spent, name))
                if graphs is not None:
                    times.graph_captures = graphs.captures - captured
                    times.graph_replays = graphs.replays - replayed
                result.epochs.append(times)
                result.losses.append(losses)
                if progress is not None:
                    progress(1)
        result.stats = storage.stats()
        test_batches = _batches(ds, g, cfg, device, sampler, train=False)
        result.accuracy, result.predictions_sha1 = _evaluate(model, _epochs(test_batches, fetch, cfg, device))
        if cfg.stage_batches != 0:
            if cfg.sampler not in stage_cache:
                np.random.seed((cfg.seed * 1000 + cfg.epochs) % 2**32)
                stage_cache[cfg.sampler] = _stage_times(train_batches, fetch, new_model, device, cfg, threads)
            result.stages = dict(stage_cache[cfg.sampler])
        del loop, epochs, train_batches, test_batches
    return result


def run_mode(ds: GnnDataset, g: Any, mode: "str | FetchMode", cfg: TrainConfig, *, device: torch.device,
             budget: float | int = 0.01, policy: str = "static", codec: Any = "auto",
             progress: Callable[[int], None] | None = None) -> RunResult:
    """Attach ``ds.features`` to ``g`` in ``mode``, train ``cfg.epochs`` epochs, evaluate on the test nodes.

    Seeds (model init, shuffling, sampling, dropout) are reset here, so two calls with the same arguments
    but different modes see the same batches and must produce the same losses. ``progress(1)`` is called
    after every epoch.
    """
    return run_variants(ds, g, mode, [cfg], device=device, budget=budget, policy=policy, codec=codec,
                        progress=(lambda _cfg: progress) if progress is not None else None)[0]


def _degree_scores(g: Any) -> torch.Tensor:
    from ibpcache.loaders.dgl import degree_hotness

    return degree_hotness(g)


def stats_summary(result: RunResult, ds: GnnDataset) -> dict[str, Any]:
    """The numbers a table shows: hit rate, bytes read from host vs raw, capacity, ratio.

    DGL's paths move every requested row raw over PCIe (``bytes_moved == raw_bytes``); the cache paths move
    only misses, compressed where the host store is.
    """
    s = result.stats
    raw = int(s.get("raw_bytes", 0))
    uses_cache = FetchMode(result.mode).uses_cache
    moved = float(s["host_bytes_read"]) if uses_cache else float(raw)
    out: dict[str, Any] = {
        "rows_fetched": int(s.get("rows", 0)),
        "raw_bytes": raw,
        "bytes_moved": moved,
        "bytes_moved_vs_raw": moved / raw if raw else math.nan,
        "hit_rate": s.get("hit_rate") if uses_cache else 0.0,
        "ratio": s.get("ratio", 1.0) if uses_cache else 1.0,
    }
    for key in ("capacity_rows", "capacity_rows_raw", "capacity_increase", "budget_bytes", "used_bytes"):
        if key in s:
            out[key] = s[key]
    return out


def variant_label(cfg: TrainConfig) -> str:
    """How a run's batches arrive, for tables and progress bars: sampler and pipelining."""
    return f"{cfg.sampler}{' pipelined' if cfg.pipelined else ''}"


def compare_modes(ds: GnnDataset, modes: Sequence["str | FetchMode"], cfg: TrainConfig, *, device: torch.device,
                  budget: float | int = 0.01, policy: str = "static",
                  progress: Callable[[str], Callable[[int], None]] | None = None,
                  variants: "Sequence[tuple[str, bool]] | None" = None) -> list[dict[str, Any]]:
    """Train once per mode and variant (``(sampler, pipelined)``; default: ``cfg``'s) on one graph with the same
    seeds; one record per run.

    One codec is fitted up front and shared by every compressing mode (the cache would fit the same one
    each time); one torch sampler serves every mode. Records carry the mean epoch (epochs 2..N), the stage times,
    accuracy, cache numbers, speedups (:func:`_records`) and whether losses and test predictions equal those of the
    first run with the same sampler, bit for bit. ``progress(label)`` returns the per-epoch callback for a run.
    """
    modes = [FetchMode.from_str(m) for m in modes]
    cfgs = [replace(cfg, sampler=s, pipelined=bool(p)) for s, p in (variants or [(cfg.sampler, cfg.pipelined)])]
    for c in cfgs:
        _check_config(c)
    g = build_graph(ds)
    codec: Any = "auto"
    fit_s = 0.0
    if any(m.compress_cache or m.compress_host for m in modes):
        t0 = time.perf_counter()
        codec = fit_codec(ds.features, device)
        fit_s = time.perf_counter() - t0
    sampler = build_torch_sampler(ds, cfgs[0], device) if any(c.sampler == "torch" for c in cfgs) else None
    results = []
    for m in modes:
        results += run_variants(ds, g, m, cfgs, device=device, budget=budget, policy=policy, codec=codec,
                                torch_sampler=sampler,
                                progress=(lambda c, m=m: progress(f"{m.label} {variant_label(c)}"))
                                if progress is not None else None)
        _release_memory()  # the previous mode's cache (GPU slab, pinned host store) goes before the next
    return _records(ds, results, fit_s)


def fit_codec(features: torch.Tensor, device: torch.device, max_rows: int = _FIT_ROWS, seed: int = 0) -> Any:
    """Fit one codec for a data set: on every row up to ``max_rows``, else on ``max_rows`` random rows.

    That is FeatureCache's own ``codec="auto"`` rule; the sample is copied to ``device`` first because the fit
    runs where its input lives, and the GPU fits a multi-GB sample in a fraction of the CPU's time.
    """
    from ibpcache.codec import Codec

    rows = features
    if rows.shape[0] > max_rows:
        pick = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed))[:max_rows]
        rows = rows[pick.sort().values]
    return Codec.fit(rows.to(device))


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _records(ds: GnnDataset, results: list[RunResult], fit_s: float) -> list[dict[str, Any]]:
    """One record per run. Speedups (epoch time of the baseline / this run's):

    * ``speedup_vs_dgl`` / ``speedup_vs_dgl_pinned`` / ``speedup_vs_raw``: over mode (1) / (2) / (3) with the same
      sampler and pipelining, so only the feature path differs;
    * ``speedup_vs_dgl_pinned_unpipelined``: over (2) as DGL users run it (DGL's sampler, no pipelining);
    * ``epoch_vs_slowest_stage``: epoch time / the slowest stage alone (1.0 = perfect overlap).

    ``identical_losses`` / ``identical_predictions`` compare with the first run of the same sampler (DGL's and
    ibpcache's samplers draw different batches).
    """
    epoch = {(r.mode, r.sampler, r.pipelined): r.mean_epoch().epoch for r in results}
    first: dict[str, RunResult] = {}
    for r in results:
        first.setdefault(r.sampler, r)

    def over(mode: FetchMode, sampler: str, pipelined: bool, mine: float) -> float | None:
        base = epoch.get((mode.value, sampler, pipelined))
        return base / mine if base is not None and mine > 0 else None

    records = []
    for r in results:
        mean = r.mean_epoch()
        slowest = max(mean.sample, mean.fetch, mean.train) if r.stages else math.nan
        ref = first[r.sampler]
        rec: dict[str, Any] = {
            "dataset": ds.name, "mode": r.mode, "label": r.label, "sampler": r.sampler,
            "sampler_device": r.sampler_device, "pipelined": r.pipelined,
            "epoch_ms": mean.epoch * 1e3, "sample_ms": mean.sample * 1e3, "fetch_ms": mean.fetch * 1e3,
            "train_ms": mean.train * 1e3, "wait_ms": mean.wait * 1e3,
            **({f"{n}_ms": getattr(mean, n) * 1e3 for n in _CLOCK_FIELDS} if r.pipelined else {}),
            "slowest_stage_ms": slowest * 1e3,
            "epoch_vs_slowest_stage": mean.epoch / slowest if slowest > 0 else None,
            **_bound(r, mean.epoch),
            "batches": mean.batches,
            "input_rows_per_batch": mean.input_rows / max(mean.batches, 1), "accuracy": r.accuracy,
            **stats_summary(r, ds),
            "speedup_vs_dgl": over(FetchMode.DGL, r.sampler, r.pipelined, mean.epoch),
            "speedup_vs_dgl_pinned": over(FetchMode.DGL_PINNED, r.sampler, r.pipelined, mean.epoch),
            "speedup_vs_dgl_pinned_unpipelined": over(FetchMode.DGL_PINNED, "dgl", False, mean.epoch),
            "speedup_vs_raw": over(FetchMode.RAW, r.sampler, r.pipelined, mean.epoch),
            "identical_losses": r.losses == ref.losses,
            "identical_predictions": r.predictions_sha1 == ref.predictions_sha1,
            "setup_s": r.setup_seconds, "codec_fit_s": fit_s if FetchMode(r.mode).compress_host
            or FetchMode(r.mode).compress_cache else 0.0,
            "run": r.to_dict(),
        }
        records.append(rec)
    return records


def _bound(r: RunResult, epoch_s: float) -> dict[str, Any]:
    """What an epoch of ``r`` cannot beat, from its stages' shares (:func:`_stage_shares`), in ms:

    * ``gpu_busy_ms``: the stages' kernel time summed; they share the GPU's SMs, so however they overlap the epoch is
      at least this (short kernels of two streams can share the SMs, so read it as "at least about");
    * ``copy_busy_ms``: their copy time summed (copy engines, beside the kernels);
    * ``bound_ms`` = the larger, ``bound_by`` which, ``epoch_vs_bound`` = epoch / bound (1.0: the GPU is never
      idle);
    * ``host_busy_ms``: their host time summed (each stage alone, minus its waits for the GPU). Not a bound: the
      stages' threads share one interpreter but torch releases it inside its ops; an epoch far above
      ``bound_ms`` and near this is host-bound.

    Also each stage's share: ``<stage>_gpu_ms``, ``<stage>_host_ms``. None where not measured (CPU runs, no
    stage pass, the profiler failed).
    """
    st = r.stages
    out: dict[str, Any] = {}
    for kind in ("gpu", "copy", "host"):
        parts = [st.get(f"{n}_{kind}") for n in ("sample", "fetch", "train")]
        if kind != "copy":
            out.update({f"{n}_{kind}_ms": v * 1e3 if v is not None else None
                        for n, v in zip(("sample", "fetch", "train"), parts)})
        out[f"{kind}_busy_ms"] = sum(parts) * 1e3 if parts and all(v is not None for v in parts) else None
    shared = {k: out[f"{k}_busy_ms"] for k in ("gpu", "copy") if out[f"{k}_busy_ms"]}
    by = max(shared, key=shared.get) if shared else None
    out["bound_ms"] = shared[by] if by else None
    out["bound_by"] = by
    out["epoch_vs_bound"] = epoch_s * 1e3 / out["bound_ms"] if by else None
    return out


def train_config(model: Any, dataset: Any, *, epochs: int, seed: int) -> TrainConfig:
    """A TrainConfig from the ``model`` and ``dataset`` config groups (plain mappings or OmegaConf nodes)."""
    base = TrainConfig()
    return TrainConfig(fanouts=tuple(int(f) for f in model["fanouts"]), batch_size=int(dataset["batch_size"]),
                       epochs=int(epochs), hidden=int(model["hidden"]), dropout=float(model["dropout"]),
                       lr=float(model["lr"]), num_workers=int(model["num_workers"]), prefetch=int(model["prefetch"]),
                       seed=int(seed), deterministic=bool(model["deterministic"]),
                       eval_batch_size=int(model["eval_batch_size"]),
                       verify_batches=int(model.get("verify_batches", 0)), tf32=bool(model.get("tf32", True)),
                       sampler=str(model.get("sampler", base.sampler)),
                       sampler_device=str(model.get("sampler_device", base.sampler_device)),
                       sample_chunk=int(model.get("sample_chunk", base.sample_chunk)),
                       sampler_kernel=bool(model.get("sampler_kernel", base.sampler_kernel)),
                       pipelined=bool(model.get("pipelined", base.pipelined)),
                       sample_ahead=int(model.get("sample_ahead", base.sample_ahead)),
                       stage_batches=int(model.get("stage_batches", base.stage_batches)),
                       across_epochs=bool(model.get("across_epochs", base.across_epochs)),
                       step_graphs=bool(model.get("step_graphs", base.step_graphs)),
                       optimizer_in_graph=bool(model.get("optimizer_in_graph", base.optimizer_in_graph)),
                       gc_freeze=bool(model.get("gc_freeze", base.gc_freeze)),
                       gil_switch_ms=_optional_float(model.get("gil_switch_ms", base.gil_switch_ms)),
                       fetch_blocks_per_sm=_optional_int(model.get("fetch_blocks_per_sm", base.fetch_blocks_per_sm)),
                       fetch_sms=_optional_int(model.get("fetch_sms", base.fetch_sms)),
                       fetch_validate=str(model.get("fetch_validate", base.fetch_validate)))


def _optional_float(value: Any) -> "float | None":
    return None if value is None else float(value)


def _optional_int(value: Any) -> "int | None":
    return None if value is None else int(value)


def dataset_from_config(dataset: Any) -> GnnDataset:
    """Load the data set a ``dataset`` config group describes (size keys apply to SU graphs only)."""
    kwargs = {k: dataset[k] for k in ("n_nodes", "avg_degree", "n_train", "n_test", "seed")
              if dataset.get(k) is not None}
    return load_gnn_dataset(str(dataset["name"]), **kwargs)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the GPU when torch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was requested but torch sees no GPU (use device=auto or cpu)")
    return dev


# ------------------------------------------------------------------------------------------------------------
# The side-by-side report of examples/train_sage.py (formerly the main job)


def _fmt_report_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_cell(v: Any, spec: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def format_report(records: list[dict[str, Any]]) -> str:
    """The table examples/train_sage.py prints (one line per fetch mode)."""
    head = ["mode", "ratio", "cache rows (raw)", "hit rate", "moved vs raw", "epoch ms", "vs DGL", "acc",
            "same losses"]
    rows = []
    for r in records:
        cap = r.get("capacity_rows")
        cap_s = f"{cap} ({r.get('capacity_rows_raw')})" if cap is not None else "-"
        moved = f"{_fmt_report_bytes(r.get('bytes_moved'))} / {_fmt_report_bytes(r.get('raw_bytes'))}"
        if r.get("bytes_moved_vs_raw") is not None and r.get("raw_bytes"):
            moved += f" ({100 * r['bytes_moved_vs_raw']:.1f}%)"
        rows.append([r["label"], _fmt_cell(r.get("ratio"), ".2f") + "x", cap_s, _fmt_cell(r.get("hit_rate"), ".1%"), moved,
                     _fmt_cell(r.get("epoch_ms"), ".1f"), _fmt_cell(r.get("speedup_vs_dgl"), ".2f") + "x",
                     _fmt_cell(r.get("accuracy"), ".3f"), "yes" if r.get("identical_losses") else "NO"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def run(cfg: Any) -> list[dict[str, Any]]:
    """Run the experiment a composed config describes and print the report; returns the records."""
    import sys

    from tqdm.auto import tqdm

    device = resolve_device(str(cfg.device))
    ds = dataset_from_config(cfg.dataset)
    train_cfg = train_config(cfg.model, cfg.dataset, epochs=cfg.epochs, seed=cfg.seed)
    modes = list(cfg.cache.modes)
    info = ds.describe()
    print(f"train_sage: GraphSAGE fanout {list(train_cfg.fanouts)} on {info['name']} "
          f"({info['nodes']:,} nodes, {info['edges']:,} edges, {_fmt_report_bytes(info['feature_bytes'])} of features, "
          f"{info['row_bytes']} B rows) | device {device} | cache budget {cfg.cache.budget} | "
          f"{train_cfg.epochs} epochs, batch {train_cfg.batch_size}", flush=True)
    bar = tqdm(total=len(modes) * train_cfg.epochs, unit="epoch", disable=not cfg.progress, file=sys.stderr)

    def progress(label: str) -> Any:
        bar.set_description(label)
        return bar.update

    try:
        records = compare_modes(ds, modes, train_cfg, device=device, budget=cfg.cache.budget,
                                    policy=str(cfg.cache.policy), progress=progress)
    finally:
        bar.close()
    print(format_report(records))
    print(f"epoch ms = mean of epochs 2..{train_cfg.epochs}; moved = bytes read from host memory for the "
          f"feature rows (cache misses, compressed where the host store is); acc = test accuracy"
          + ("" if torch.cuda.is_available() else "; no GPU: the cache ran on the CPU"))
    return records
