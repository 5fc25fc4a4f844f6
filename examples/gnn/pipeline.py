"""GraphSAGE training on DGL-sampled blocks, timed stage by stage; shared by ``examples/train_sage.py`` and
``scripts/train_gnn.py`` (example code, not installed; needs ``pip install -e ".[dgl]"``).

Why the model is plain PyTorch rather than ``dgl.nn.SAGEConv``: DGL from PyPI has no CUDA kernels, so a DGL
block cannot run message passing on the GPU. Each block is turned into (src, dst) index tensors and aggregated
with ``index_add_``; on CUDA the training loop turns on ``torch.use_deterministic_algorithms`` so that, with the
same seeds and batch order, every feature path gives bit-identical losses (the codec is lossless, so any
difference would be a bug).

The loop overlaps the three stages the way DGL's own prefetching does: DGL ``DataLoader`` worker processes
sample, a background thread pulls their batches and fetches features (on a side CUDA stream), and the main
thread trains. Per epoch it records sampling, feature fetching, training and the time the trainer sat idle
waiting for the next batch; the paper reports the mean of epochs 2..N.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ibpcache.errors import IbpcacheError
from ibpcache.loaders.dgl import FetchMode, attach, import_dgl, make_storage

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


@dataclass
class Block:
    """A sampled DGL block as index tensors on the training device (dst nodes are the first ``n_dst`` srcs)."""

    src: torch.Tensor
    dst: torch.Tensor
    n_src: int
    n_dst: int
    inv_deg: torch.Tensor  # float32 [n_dst, 1]; 0 where a node has no sampled neighbour

    @classmethod
    def from_dgl(cls, block: Any, device: torch.device) -> "Block":
        src, dst = block.edges()
        n_dst = int(block.num_dst_nodes())
        deg = torch.bincount(dst, minlength=n_dst).to(torch.float32)
        inv = torch.where(deg > 0, 1.0 / deg.clamp(min=1), torch.zeros_like(deg)).unsqueeze(1)
        move = {"device": device, "non_blocking": True}
        return cls(src.to(torch.int64).to(**move), dst.to(torch.int64).to(**move), int(block.num_src_nodes()),
                   n_dst, inv.to(**move))

    def record_stream(self, stream: Any) -> None:
        for t in (self.src, self.dst, self.inv_deg):
            t.record_stream(stream)


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
        out = h.new_zeros(block.n_dst, h.shape[1])
        out.index_add_(0, block.dst, h.index_select(0, block.src))
        return out * block.inv_deg

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

    def _drop(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return h
        if self._gen is None or self._gen.device != h.device:
            self._gen = torch.Generator(device=h.device).manual_seed(self._seed)
        keep = torch.rand(h.shape, generator=self._gen, device=h.device) >= self.dropout
        return h * keep / (1.0 - self.dropout)

    def forward(self, blocks: Sequence[Block], x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], -1).float()
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if i != len(self.layers) - 1:
                h = self._drop(torch.relu(h))
        return h


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy via log_softmax + gather (deterministic on CUDA, unlike nll_loss there)."""
    logp = torch.log_softmax(logits, dim=1)
    return -logp.gather(1, labels.view(-1, 1)).mean()


# --------------------------------------------------------------------------------------------------------------
# Training loop


@dataclass
class TrainConfig:
    """Everything that decides a run; identical configs give identical batches, masks and losses."""

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


@dataclass
class EpochTimes:
    """Seconds per stage in one epoch.

    ``sample``: time the fetch thread waited for sampled batches from DGL's worker processes (sampling not
    hidden by the workers); ``fetch``: feature fetch until the rows are on the device (host time in the
    storage + waiting for the side stream). Both run in the background, overlapped with training.
    ``train``: forward/backward/step until the loss is on the host; ``wait``: the trainer idle, waiting for
    the next batch (the part of sampling + fetching that training did not hide). ``epoch`` is about
    ``train + wait``.
    """

    epoch: float = 0.0
    sample: float = 0.0
    fetch: float = 0.0
    train: float = 0.0
    wait: float = 0.0
    batches: int = 0
    input_rows: int = 0


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

    def mean_epoch(self) -> EpochTimes:
        """Mean over epochs 2..N (the first pays warm-up), or epoch 1 if there is only one."""
        timed = self.epochs[1:] or self.epochs
        out = EpochTimes()
        for name in ("epoch", "sample", "fetch", "train", "wait"):
            setattr(out, name, sum(getattr(e, name) for e in timed) / len(timed))
        out.batches = round(sum(e.batches for e in timed) / len(timed))
        out.input_rows = round(sum(e.input_rows for e in timed) / len(timed))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "label": self.label, "accuracy": self.accuracy,
                "predictions_sha1": self.predictions_sha1, "setup_seconds": self.setup_seconds,
                "mean_epoch": asdict(self.mean_epoch()), "epochs": [asdict(e) for e in self.epochs],
                "losses": self.losses, "stats": self.stats}


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

    Installed once, process-wide: the warnings fire in the background thread, and ``catch_warnings`` is not
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
class _Batch:
    input_nodes: torch.Tensor
    blocks: list[Block]
    x: torch.Tensor
    y: torch.Tensor
    event: Any
    sample: float
    fetch: float


def _make_loader(g: Any, nids: torch.Tensor, cfg: TrainConfig, batch_size: int, shuffle: bool,
                 seed: int) -> Any:
    dgl = import_dgl()
    sampler = dgl.dataloading.NeighborSampler(list(cfg.fanouts), prefetch_node_feats=["feat"],
                                              prefetch_labels=["label"])
    extra: dict[str, Any] = {}
    if cfg.num_workers > 0:
        extra = {"persistent_workers": True, "worker_init_fn": _WorkerSeed(seed)}
    _quiet_loader_warnings()
    return dgl.dataloading.DataLoader(g, nids, sampler, device="cpu", batch_size=batch_size, shuffle=shuffle,
                                      drop_last=False, num_workers=cfg.num_workers, **extra)


def _producer(loader: Any, storage: Any, device: torch.device, stream: Any, out: "queue.Queue[Any]",
              stop: threading.Event) -> None:
    """Background stage: take sampled batches from DGL (workers), fetch features, stage block indices."""
    try:
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            it = iter(loader)
            while not stop.is_set():
                t0, h0 = time.perf_counter(), storage.host_seconds
                try:
                    input_nodes, _, blocks = next(it)
                except StopIteration:
                    break
                t1, fetch_host = time.perf_counter(), storage.host_seconds - h0
                x = blocks[0].srcdata["feat"]
                y = blocks[-1].dstdata["label"].to(device, non_blocking=True)
                staged = [Block.from_dgl(b, device) for b in blocks]
                event = None
                if stream is not None:
                    event = stream.record_event()
                    event.synchronize()  # only this thread waits: it times the fetch, the trainer keeps going
                t2 = time.perf_counter()
                out.put(_Batch(input_nodes, staged, x, y, event, sample=(t1 - t0) - fetch_host,
                               fetch=fetch_host + (t2 - t1)))
        out.put(None)
    except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which re-raises it
        out.put(exc)


def _batches(loader: Any, storage: Any, device: torch.device, prefetch: int) -> Iterator[_Batch]:
    """Yield staged batches while the next ones are sampled and fetched in the background."""
    stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
    q: "queue.Queue[Any]" = queue.Queue(maxsize=max(1, prefetch))
    stop = threading.Event()
    thread = threading.Thread(target=_producer, args=(loader, storage, device, stream, q, stop), daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            if item.event is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(item.event)
                item.x.record_stream(current)
                item.y.record_stream(current)
                for b in item.blocks:
                    b.record_stream(current)
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.1)
        thread.join()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _verify(batch: _Batch, rows: torch.Tensor) -> None:
    """The fetched features must equal the host rows of the batch's input nodes, byte for byte."""
    got = batch.x.detach().to("cpu").contiguous().view(torch.uint8)
    want = rows[batch.input_nodes].contiguous().view(torch.uint8)
    if not torch.equal(got, want):
        raise IbpcacheError("fetched features differ from the original rows (lossless path is broken)")


def _train_epoch(model: GraphSAGE, opt: torch.optim.Optimizer, loader: Any, storage: Any, device: torch.device,
                 cfg: TrainConfig, verify_rows: torch.Tensor | None = None) -> tuple[EpochTimes, list[float]]:
    times, losses = EpochTimes(), []
    model.train()
    _sync(device)
    start = time.perf_counter()
    t_wait = start
    for batch in _batches(loader, storage, device, cfg.prefetch):
        if verify_rows is not None and times.batches < cfg.verify_batches:
            _verify(batch, verify_rows)
        t_got = time.perf_counter()
        times.wait += t_got - t_wait
        loss = cross_entropy(model(batch.blocks, batch.x), batch.y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # syncs: "train" is the step's real duration
        t_wait = time.perf_counter()
        times.train += t_wait - t_got
        times.sample += batch.sample
        times.fetch += batch.fetch
        times.batches += 1
        times.input_rows += int(batch.x.shape[0])
    times.epoch = time.perf_counter() - start
    return times, losses


@torch.no_grad()
def _evaluate(model: GraphSAGE, loader: Any, storage: Any, device: torch.device,
              cfg: TrainConfig) -> tuple[float, str]:
    model.eval()
    preds, labels = [], []
    for batch in _batches(loader, storage, device, cfg.prefetch):
        preds.append(model(batch.blocks, batch.x).argmax(1))
        labels.append(batch.y)
    if not preds:
        return float("nan"), ""
    p, y = torch.cat(preds), torch.cat(labels)
    return float((p == y).float().mean()), hashlib.sha1(p.cpu().numpy().tobytes()).hexdigest()


def run_mode(ds: GnnDataset, g: Any, mode: "str | FetchMode", cfg: TrainConfig, *, device: torch.device,
             budget: float | int = 0.01, policy: str = "static", codec: Any = "auto",
             progress: Callable[[int], None] | None = None) -> RunResult:
    """Attach ``ds.features`` to ``g`` in ``mode``, train ``cfg.epochs`` epochs, evaluate on the test nodes.

    Seeds (model init, shuffling, sampling, dropout) are reset here, so two calls with the same arguments
    but different modes see the same batches and must produce the same losses. ``progress(1)`` is called
    after every epoch.
    """
    mode = FetchMode.from_str(mode)
    dgl = import_dgl()
    t0 = time.perf_counter()
    storage = make_storage(ds.features, mode, device=device, budget=budget, policy=policy, codec=codec,
                           hotness=_degree_scores(g) if mode.uses_cache and policy == "static" else None,
                           name=ds.name)
    attach(g, {"feat": storage})
    _sync(device)
    result = RunResult(mode.value, mode.label, setup_seconds=time.perf_counter() - t0)

    with deterministic_cuda(cfg.deterministic and device.type == "cuda", tf32=cfg.tf32):
        torch.manual_seed(cfg.seed)
        dgl.seed(cfg.seed)
        model = GraphSAGE(ds.features[0].numel(), cfg.hidden, ds.num_classes, len(cfg.fanouts), cfg.dropout)
        model.seed_dropout(cfg.seed)
        model = model.to(device)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        train_loader = _make_loader(g, ds.train_nids, cfg, cfg.batch_size, shuffle=True, seed=cfg.seed * 7919)
        storage.reset_stats()
        for epoch in range(cfg.epochs):
            np.random.seed((cfg.seed * 1000 + epoch) % 2**32)  # DGL shuffles with NumPy's global generator
            times, losses = _train_epoch(model, opt, train_loader, storage, device, cfg,
                                         verify_rows=ds.features if epoch == 0 else None)
            result.epochs.append(times)
            result.losses.append(losses)
            if progress is not None:
                progress(1)
        result.stats = storage.stats()
        test_loader = _make_loader(g, ds.test_nids, cfg, cfg.eval_batch_size, shuffle=False,
                                   seed=cfg.seed * 7919 + 1)
        result.accuracy, result.predictions_sha1 = _evaluate(model, test_loader, storage, device, cfg)
        del train_loader, test_loader
    return result


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


def compare_modes(ds: GnnDataset, modes: Sequence["str | FetchMode"], cfg: TrainConfig, *, device: torch.device,
                  budget: float | int = 0.01, policy: str = "static",
                  progress: Callable[[str], Callable[[int], None]] | None = None) -> list[dict[str, Any]]:
    """Train once per mode on one graph with the same seeds and batch order; one record per mode.

    One codec is fitted up front and shared by every compressing mode (the cache would fit the same one
    each time). Records carry the mean epoch breakdown (epochs 2..N), accuracy, cache numbers, speedups over
    modes (1) and (3) where those ran, and whether losses and test predictions equal the first mode's bit for
    bit. ``progress(label)`` returns the per-epoch callback for that mode.
    """
    modes = [FetchMode.from_str(m) for m in modes]
    g = build_graph(ds)
    codec: Any = "auto"
    fit_s = 0.0
    if any(m.compress_cache or m.compress_host for m in modes):
        t0 = time.perf_counter()
        codec = fit_codec(ds.features, device)
        fit_s = time.perf_counter() - t0
    results = []
    for m in modes:
        results.append(run_mode(ds, g, m, cfg, device=device, budget=budget, policy=policy, codec=codec,
                                progress=progress(m.label) if progress is not None else None))
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
    by_mode = {r.mode: r.mean_epoch().epoch for r in results}
    first = results[0]
    records = []
    for r in results:
        mean = r.mean_epoch()
        rec: dict[str, Any] = {
            "dataset": ds.name, "mode": r.mode, "label": r.label,
            "epoch_ms": mean.epoch * 1e3, "sample_ms": mean.sample * 1e3, "fetch_ms": mean.fetch * 1e3,
            "train_ms": mean.train * 1e3, "wait_ms": mean.wait * 1e3, "batches": mean.batches,
            "input_rows_per_batch": mean.input_rows / max(mean.batches, 1), "accuracy": r.accuracy,
            **stats_summary(r, ds),
            "speedup_vs_dgl": by_mode[FetchMode.DGL.value] / mean.epoch if FetchMode.DGL.value in by_mode else None,
            "speedup_vs_raw": by_mode[FetchMode.RAW.value] / mean.epoch if FetchMode.RAW.value in by_mode else None,
            "identical_losses": r.losses == first.losses,
            "identical_predictions": r.predictions_sha1 == first.predictions_sha1,
            "setup_s": r.setup_seconds, "codec_fit_s": fit_s if FetchMode(r.mode).compress_host
            or FetchMode(r.mode).compress_cache else 0.0,
            "run": r.to_dict(),
        }
        records.append(rec)
    return records


def train_config(model: Any, dataset: Any, *, epochs: int, seed: int) -> TrainConfig:
    """A TrainConfig from the ``model`` and ``dataset`` config groups (plain mappings or OmegaConf nodes)."""
    return TrainConfig(fanouts=tuple(int(f) for f in model["fanouts"]), batch_size=int(dataset["batch_size"]),
                       epochs=int(epochs), hidden=int(model["hidden"]), dropout=float(model["dropout"]),
                       lr=float(model["lr"]), num_workers=int(model["num_workers"]), prefetch=int(model["prefetch"]),
                       seed=int(seed), deterministic=bool(model["deterministic"]),
                       eval_batch_size=int(model["eval_batch_size"]),
                       verify_batches=int(model.get("verify_batches", 0)), tf32=bool(model.get("tf32", True)))


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
