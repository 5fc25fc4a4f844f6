"""Drop-in DGL feature store: DGL's own ``DataLoader`` fetches node and edge features through ibpcache.

How DGL 2.1 moves features (read from its installed source): a sampler marks the features it wants with
``LazyFeature`` placeholders; the ``DataLoader`` then calls
``graph.get_node_storage(key, ntype).fetch(indices, device, pin_memory)`` (``get_edge_storage`` for edges), and
``get_node_storage`` simply returns the column object that ``g.ndata[key]`` lives in (``dgl.frame.Column``, a
``dgl.storages.FeatureStorage``). So :func:`attach` swaps that column for one whose ``fetch`` goes to a
:class:`~ibpcache.cache.feature_cache.FeatureCache` (GPU slab + compressed pinned host store, one fused decode).
The user's loop stays exactly as it was::

    g = ibpcache.loaders.dgl.attach(g, {"feat": g.ndata["feat"]}, budget=0.01)     # or {"feat": my_cache}
    sampler = dgl.dataloading.NeighborSampler([25, 10], prefetch_node_feats=["feat"], prefetch_labels=["label"])
    for input_nodes, output_nodes, blocks in dgl.dataloading.DataLoader(g, train_nids, sampler, ...):
        x = blocks[0].srcdata["feat"]          # == original_feat[input_nodes], bit for bit

DGL from PyPI (2.1.0) has no CUDA: a ``DataLoader`` with ``device="cuda"`` fails when it moves the sampled
blocks. Keep the ``DataLoader`` on the CPU (sampling is on the CPU anyway); the attached features still arrive
on the GPU, because a storage delivers rows on *its* device (the cache's), whatever device DGL asks for. With a
CUDA build of DGL, ``device="cuda"`` works unchanged.

Heterographs: one storage per node type (``attach(g, {"feat": {"paper": t1, "author": t2}})`` or ``ntype=``),
which is how DGL itself keys storages. Edge features: :func:`attach_edges` (DGL prefetches them the same way,
with ``prefetch_edge_feats``). Attached columns are read-only: assign a plain tensor to ``g.ndata[key]`` to
replace one. Reading ``g.ndata[key]`` in full decompresses every row (correct, but the ``DataLoader`` path never
does it).

The DGL classes are built on first use (:func:`import_dgl`), so importing this module needs no DGL.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import itertools
import os
import sys
import threading
import time
import types
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ibpcache._validation import check_rows
from ibpcache.errors import IbpcacheError, InvalidArgumentError, InvalidTypeError

from .pipeline import PipelinedLoader, record_stream

if TYPE_CHECKING:  # pragma: no cover
    from ibpcache.cache.feature_cache import FeatureCache

__all__ = [
    "import_dgl",
    "FetchMode",
    "IBPFeatureStorage",
    "make_storage",
    "attach",
    "attach_edges",
    "degree_hotness",
    "default_device",
    "FeatureFetch",
    "pipelined",
    "record_dgl_batch",
]

_DGL_MISSING = 'DGL is needed for ibpcache.loaders.dgl: pip install "ibpcache[dgl]"'


# --------------------------------------------------------------------------------------------------------------
# Importing DGL


def _graphbolt_library_missing() -> bool:
    """True when DGL's graphbolt has no native library for this torch version (then ``import dgl`` fails).

    DGL 2.1.0 wheels ship ``libgraphbolt_pytorch_<torch version>.so`` only for torch <= 2.2; for any newer torch
    its ``dgl.graphbolt`` package raises at import, and ``import dgl`` imports it unconditionally.
    """
    spec = importlib.util.find_spec("dgl")
    if spec is None or not spec.submodule_search_locations:
        return False
    version = torch.__version__.split("+")[0]
    for root in spec.submodule_search_locations:
        if (Path(root) / "graphbolt" / f"libgraphbolt_pytorch_{version}.so").exists():
            return False
    return True


@functools.cache
def import_dgl() -> types.ModuleType:
    """Import DGL on any torch version; the one place that knows about the graphbolt shim.

    When graphbolt's native library is missing for this torch (every torch >= 2.3 with DGL 2.1.0 from PyPI),
    an empty ``dgl.graphbolt`` module is registered first: nothing here uses GraphBolt, and the rest of DGL
    (graphs, ``NeighborSampler``, ``DataLoader``) works. ``DGLBACKEND`` defaults to pytorch so DGL does not print
    its backend notice.
    """
    os.environ.setdefault("DGLBACKEND", "pytorch")
    if "dgl" not in sys.modules and "dgl.graphbolt" not in sys.modules and _graphbolt_library_missing():
        sys.modules["dgl.graphbolt"] = types.ModuleType("dgl.graphbolt")
    try:
        import dgl
    except ImportError as exc:
        raise ImportError(f"{_DGL_MISSING} (import failed: {exc})") from exc
    return dgl


@functools.cache
def _dgl_has_cuda() -> bool:
    """Whether this DGL build runs on CUDA (PyPI's 2.1.0 does not: moving a graph to the GPU raises)."""
    if not torch.cuda.is_available():
        return False
    dgl = import_dgl()
    try:
        dgl.graph(([0], [0])).to("cuda")
    except Exception:  # noqa: BLE001 - DGLError "Device API cuda is not enabled" and the like
        return False
    return True


def default_device() -> torch.device:
    """Where features should land: the GPU when one is usable, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------------------------------------------
# Fetch modes: the six paths the GNN benchmark compares


class FetchMode(str, enum.Enum):
    """How features reach the model. The first two are DGL's own paths; the rest go through a FeatureCache.

    * ``dgl`` (1): features are a plain CPU tensor; DGL's ``TensorStorage`` slices them on the CPU into pageable
      memory and copies the slice to the device (what a PyPI-DGL user does today).
    * ``dgl_pinned`` (2): the same with the features in pinned memory and DGL's ``pin_prefetcher`` staging
      (slice into a pinned buffer, asynchronous copy). Without CUDA it is the same as ``dgl``.
    * ``raw`` (3): ibpcache without compression: raw GPU cache + raw pinned host rows read zero-copy by the GPU.
    * ``ibp_m`` (4): raw cache, compressed host store (compresses the PCIe traffic): the paper's IBP(M).
    * ``ibp_c`` (5): compressed cache, raw host store (more rows fit the cache): IBP(C).
    * ``ibp_cm`` (6): both: IBP(C/M).
    """

    DGL = "dgl"
    DGL_PINNED = "dgl_pinned"
    RAW = "raw"
    IBP_M = "ibp_m"
    IBP_C = "ibp_c"
    IBP_CM = "ibp_cm"

    @classmethod
    def from_str(cls, value: "str | FetchMode") -> "FetchMode":
        """Parse a mode name; an unknown name raises ValueError listing the valid ones."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise InvalidArgumentError(f"unknown fetch mode {value!r}; expected one of: {names}") from None

    @property
    def label(self) -> str:
        """The name used in tables and plots (numbered as in the issue / paper)."""
        return _LABELS[self]

    @property
    def uses_cache(self) -> bool:
        return self not in (FetchMode.DGL, FetchMode.DGL_PINNED)

    @property
    def compress_cache(self) -> bool:
        return self in (FetchMode.IBP_C, FetchMode.IBP_CM)

    @property
    def compress_host(self) -> bool:
        return self in (FetchMode.IBP_M, FetchMode.IBP_CM)


_LABELS = {
    FetchMode.DGL: "(1) DGL",
    FetchMode.DGL_PINNED: "(2) DGL pinned",
    FetchMode.RAW: "(3) ibpcache raw",
    FetchMode.IBP_M: "(4) IBP(M)",
    FetchMode.IBP_C: "(5) IBP(C)",
    FetchMode.IBP_CM: "(6) IBP(C/M)",
}


# --------------------------------------------------------------------------------------------------------------
# Backends: where a storage's rows come from (no DGL types here)


class _TensorBackend:
    """DGL's standard path, delegated to DGL's own ``TensorStorage`` so the baseline is DGL's code, not ours."""

    def __init__(self, rows: torch.Tensor, pinned: bool) -> None:
        self.pinned = pinned and torch.cuda.is_available()
        self.rows = rows.pin_memory() if self.pinned and not rows.is_pinned() else rows
        self._dgl_storage = import_dgl().storages.TensorStorage(self.rows)

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def fetch(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        # pin_memory=True is DGL's pin_prefetcher: index_select into a pinned buffer, non_blocking copy.
        if ids.is_cuda and not (self.pinned and _dgl_has_cuda()):
            # ids from a GPU sampler: DGL gathers pinned rows by UVA only in its CUDA builds (PyPI's has none) and
            # refuses GPU ids for pageable rows, so its CPU gather runs on ids read back (what its users do)
            ids = ids.cpu()
        return self._dgl_storage.fetch(ids, device, pin_memory=self.pinned)

    def stats(self) -> dict[str, Any]:
        return {"pinned": self.pinned}


class _CacheBackend:
    """A FeatureCache (any mode); it validates ids and decodes hits and misses in one go."""

    def __init__(self, cache: "FeatureCache") -> None:
        self.cache = cache

    @property
    def device(self) -> torch.device:
        dev = getattr(self.cache, "device", None)
        return torch.device(dev) if dev is not None else torch.device("cpu")

    def fetch(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = self.cache.fetch(ids)
        return out if out.device == device else out.to(device, non_blocking=True)

    def stats(self) -> dict[str, Any]:
        return dict(self.cache.stats())


def _row_geometry(source: Any) -> tuple[int, tuple[int, ...], torch.dtype]:
    """(n_rows, row_shape, dtype) of a tensor, or of a FeatureCache (``n_rows``, ``row_shape``, ``dtype``)."""
    dtype = getattr(source, "dtype", None)
    if hasattr(source, "n_rows") and hasattr(source, "row_shape"):
        shape: Any = (source.n_rows, *source.row_shape)
    else:
        shape = getattr(source, "shape", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(f"cannot tell the row shape and dtype of {type(source).__name__} "
                               "(needs n_rows/row_shape or shape, and dtype)")
    shape = tuple(int(s) for s in shape)
    if len(shape) < 1:
        raise InvalidArgumentError(f"feature source must have shape [N, ...], got {shape}")
    return shape[0], shape[1:], dtype


# --------------------------------------------------------------------------------------------------------------
# The storage (the DGL-facing object), built on first use so this module imports without DGL

_READ_CHUNK_BYTES = 64 << 20

#: key -> storage, so sub-columns that crossed a process boundary (DataLoader workers) find their storage again.
_REGISTRY: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


class _StorageImpl:
    """Body of :class:`IBPFeatureStorage` (mixed with DGL's ``FeatureStorage`` by :func:`_dgl_classes`)."""

    def __init__(self, backend: Any, *, n_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                 mode: FetchMode, device: torch.device | None = None, name: str = "") -> None:
        self.backend = backend
        self.mode = mode
        self.name = name
        self.n_rows = n_rows
        self.row_shape = row_shape
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else backend.device
        self.row_bytes = int(torch.Size(row_shape).numel()) * torch.empty((), dtype=dtype).element_size()
        # 0-byte stand-in with the right shape and dtype: DGL's Column needs a "storage" tensor for its scheme
        # and length. One per storage, so DGL's `col.storage is subcol.storage` checks see the same object.
        self.placeholder = torch.zeros((), dtype=dtype).expand(n_rows, *row_shape)
        self.key = uuid.uuid4().hex
        _REGISTRY[self.key] = self
        self._lock = threading.Lock()
        self.reset_stats()

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n_rows, *self.row_shape)

    def requires_ddp(self) -> bool:
        return False

    def fetch(self, indices: torch.Tensor, device: "str | torch.device | None" = None,
              pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        """Rows ``indices`` (any order, duplicates fine), bit-identical to ``features[indices]``.

        They land on this storage's device (the cache's, or the ``device`` given to :func:`attach`), not
        necessarily on ``device``: with CPU-only DGL the DataLoader must stay on the CPU while the model is on
        the GPU. ``pin_memory`` and extra DGL arguments are accepted for signature compatibility; the cache
        manages its own pinned memory.
        """
        del device, pin_memory, kwargs
        if isinstance(indices, Mapping):
            raise InvalidTypeError("IBPFeatureStorage holds one node/edge type; attach one storage per type "
                                   "(attach(g, {key: {ntype: rows}}))")
        if not isinstance(indices, torch.Tensor):
            raise InvalidTypeError(f"indices: expected an int64 torch.Tensor, got {type(indices).__name__}")
        start = time.perf_counter()
        out = self.backend.fetch(indices, self.device)
        elapsed = time.perf_counter() - start
        with self._lock:
            self._calls += 1
            self._rows += int(indices.shape[0])
            self._host_seconds += elapsed
        return out

    def read_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        """Rows ``ids`` (all rows when None) in host memory: what a column's ``.data`` materialises.

        Like DGL's own columns of a CPU tensor, ``.data`` lives on the CPU; only ``fetch`` delivers to the
        device. Reads go through the cache in pieces of at most ``_READ_CHUNK_BYTES`` so reading a whole
        table never needs it to fit in GPU memory.
        """
        if ids is None:
            ids = torch.arange(self.n_rows, dtype=torch.int64)
        ids = ids.to("cpu")
        out = torch.empty((int(ids.shape[0]), *self.row_shape), dtype=self.dtype)
        step = max(1, _READ_CHUNK_BYTES // max(self.row_bytes, 1))
        for start in range(0, int(ids.shape[0]), step):
            out[start:start + step] = self.fetch(ids[start:start + step]).to("cpu")
        return out

    def stats(self) -> dict[str, Any]:
        """The cache's counters (hits, host_bytes_read, ratio, capacity...) plus this storage's own: fetch_mode,
        calls, rows, raw_bytes (what an uncompressed, uncached path moves) and host seconds inside fetch."""
        out: dict[str, Any] = dict(self.backend.stats())
        with self._lock:
            out.update({
                "fetch_mode": self.mode.value,
                "calls": self._calls,
                "rows": self._rows,
                "raw_bytes": self._rows * self.row_bytes,
                "fetch_host_seconds": self._host_seconds,
            })
        return out

    def reset_stats(self) -> None:
        with self._lock:
            self._calls = 0
            self._rows = 0
            self._host_seconds = 0.0
        reset = getattr(getattr(self.backend, "cache", None), "reset_stats", None)
        if callable(reset):
            reset()

    @property
    def host_seconds(self) -> float:
        """Host time spent inside fetch so far (used to split sampling from fetching in timings)."""
        with self._lock:
            return self._host_seconds

    def __repr__(self) -> str:
        return (f"IBPFeatureStorage(name={self.name!r}, mode={self.mode.value}, n_rows={self.n_rows}, "
                f"row_shape={self.row_shape}, dtype={self.dtype}, device={self.device})")

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # Never serialise the cache (GPU memory, pinned buffers): another process gets a handle that works
        # where the storage exists (a forked DataLoader worker), and says so clearly elsewhere.
        return (_storage_from_key, (self.key,))


def _storage_from_key(key: str) -> Any:
    storage = _REGISTRY.get(key)
    if storage is None:
        raise IbpcacheError("this ibpcache feature storage is not available in this process "
                            "(storages are not serialised; use fork-started DataLoader workers)")
    return storage


class _ColumnImpl:
    """Body of the DGL ``Column`` subclass that :func:`attach` puts into the graph's frames.

    DGL's frames keep columns, clone them for subgraphs and slice them lazily (``subcolumn``); every one of
    those paths must keep pointing at the storage instead of the 0-byte placeholder, so they are overridden.
    """

    def __init__(self, ibp: Any, index: Any = None, device: Any = None, deferred_dtype: Any = None) -> None:
        super().__init__(ibp.placeholder, None, index, device, deferred_dtype)  # type: ignore[call-arg]
        self.ibp = ibp
        self._rows: torch.Tensor | None = None

    # -- reading --------------------------------------------------------------------------------------------
    def _flat_index(self) -> torch.Tensor | None:
        index = self.index
        if index is not None and not isinstance(index, torch.Tensor):
            index = self.index = index.flatten()  # DGL's _LazyIndex chain
        return index

    def _convert(self, rows: torch.Tensor) -> torch.Tensor:
        if self.device is not None:
            rows = rows.to(self.device[0], **self.device[1])
        if self.deferred_dtype is not None:
            rows = rows.to(self.deferred_dtype)
        return rows

    @property
    def data(self) -> torch.Tensor:
        """Materialised rows in host memory (decoded through the cache), moved/converted as DGL asked.

        Sub-columns keep theirs; the full column does not, because that would be a raw copy of the table."""
        if self._rows is not None:
            return self._rows
        index = self._flat_index()
        rows = self._convert(self.ibp.read_rows(index))
        if index is not None:
            self._rows = rows
        return rows

    @data.setter
    def data(self, value: Any) -> None:
        raise IbpcacheError("features attached with ibpcache are read-only; assign a tensor to "
                            "g.ndata[key] / g.edata[key] to replace the column")

    def fetch(self, indices: torch.Tensor, device: Any = None, pin_memory: bool = False,
              **kwargs: Any) -> torch.Tensor:
        index = self._flat_index()
        if index is not None:
            indices = index[indices.to(index.device)]
        out = self.ibp.fetch(indices, device, pin_memory, **kwargs)
        return out.to(self.deferred_dtype) if self.deferred_dtype is not None else out

    # -- DGL's column protocol ------------------------------------------------------------------------------
    def _like(self, index: Any) -> Any:
        return type(self)(self.ibp, index, self.device, self.deferred_dtype)

    def subcolumn(self, rowids: torch.Tensor) -> Any:
        if self.index is None:
            return self._like(rowids)
        lazy = self.index if not isinstance(self.index, torch.Tensor) else _dgl_classes().LazyIndex(self.index)
        return self._like(lazy.slice(rowids))

    def clone(self) -> Any:
        col = self._like(self.index)
        col._rows = self._rows
        return col

    def astype(self, new_dtype: torch.dtype) -> Any:
        col = self.clone()
        if col.dtype != new_dtype:
            col.deferred_dtype = new_dtype
            col._rows = None
        return col

    def update(self, rowids: Any, feats: Any) -> None:
        self.data = None  # raises: read-only

    def extend(self, feats: Any, feat_scheme: Any = None) -> None:
        self.data = None  # raises: read-only

    def pin_memory_(self) -> None:
        """No-op: the cache owns its memory (its host store is pinned already where CUDA exists)."""

    def unpin_memory_(self) -> None:
        """No-op, see :meth:`pin_memory_`."""

    def record_stream(self, stream: Any) -> None:
        """No-op: fetched rows are fresh tensors; DGL records streams on those itself."""

    def __repr__(self) -> str:
        n = len(self) if self.storage is not None or self.index is not None else "?"
        return f"IBPColumn(rows={n}, storage={self.ibp!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["ibp"] = self.ibp.key
        state["_rows"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        key = state["ibp"]
        self.__dict__ = state
        self.ibp = _REGISTRY.get(key)


@functools.cache
def _dgl_classes() -> types.SimpleNamespace:
    """Create the classes that subclass DGL types (imports DGL once)."""
    dgl = import_dgl()
    from dgl.frame import Column, _LazyIndex

    storage_cls = type("IBPFeatureStorage", (_StorageImpl, dgl.storages.FeatureStorage), {
        "__module__": __name__, "__doc__": _STORAGE_DOC})
    column_cls = type("IBPColumn", (_ColumnImpl, Column), {"__module__": __name__, "__doc__": _ColumnImpl.__doc__})
    return types.SimpleNamespace(Storage=storage_cls, Column=column_cls, LazyIndex=_LazyIndex)


_STORAGE_DOC = """A ``dgl.storages.FeatureStorage`` whose ``fetch`` reads rows through ibpcache.

Build one with :func:`make_storage` (from a tensor, in any :class:`FetchMode`) or pass a FeatureCache to
:func:`attach`. ``fetch(indices, device, pin_memory=False)`` returns rows on the storage's device;
``stats()`` reports calls, rows, raw-byte equivalent and host time, plus the cache's own counters.
"""


def __getattr__(name: str) -> Any:
    """``IBPFeatureStorage`` / ``IBPColumn`` subclass DGL types, so they exist only once DGL is imported."""
    if name == "IBPFeatureStorage":
        return _dgl_classes().Storage
    if name == "IBPColumn":
        return _dgl_classes().Column
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------------------------
# Building storages


def _new_storage(backend: Any, n_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, mode: FetchMode,
                 device: "str | torch.device | None", name: str) -> Any:
    return _dgl_classes().Storage(backend, n_rows=n_rows, row_shape=row_shape, dtype=dtype, mode=mode,
                                  device=torch.device(device) if device is not None else None, name=name)


def make_storage(
    rows: torch.Tensor,
    mode: "str | FetchMode" = FetchMode.IBP_CM,
    *,
    device: "str | torch.device | None" = None,
    budget: float | int = 0.01,
    hotness: torch.Tensor | None = None,
    policy: str = "static",
    codec: Any = "auto",
    name: str = "",
    fetch_blocks_per_sm: "int | None" = None,
    validate: str = "eager",
) -> Any:
    """Wrap feature rows in an :class:`IBPFeatureStorage` for one of the six :class:`FetchMode` paths.

    ``rows``: contiguous CPU tensor [N, ...] (any dtype). ``device``: where fetched rows land (default: the GPU
    if there is one). ``budget``: GPU cache size, bytes (int) or a fraction of the raw feature bytes (float in
    (0, 1]); the paper uses 1%. ``hotness``: per-row score for the static cache (e.g. :func:`degree_hotness`).
    ``codec``: ``"auto"`` fits one on the rows, or pass a fitted ``Codec`` to share it between modes.
    ``fetch_blocks_per_sm``: the cache's lookup grid bound (:class:`FeatureCache`), leaving multiprocessors to a
    training step that runs beside a pipelined fetch. ``validate``: the cache's id check (:class:`FeatureCache`):
    ``"eager"`` raises in the fetch at a host sync; ``"lazy"`` lets the lookup kernel check ids and raises at a
    later fetch or ``stats()``, so a fetch never waits for the GPU (a pipelined loader's fetch thread then runs
    ahead of the device instead of waiting for each batch's sampling and the fetch before it). DGL modes ignore
    budget, hotness, policy, codec, ``fetch_blocks_per_sm`` and ``validate``.
    """
    mode = FetchMode.from_str(mode)
    rows = check_rows(rows, "rows")
    if rows.device.type != "cpu":
        raise InvalidArgumentError(f"rows: expected a CPU tensor (features live in host memory), got {rows.device}")
    dev = torch.device(device) if device is not None else default_device()
    n_rows, row_shape, dtype = _row_geometry(rows)
    if hotness is not None and int(hotness.shape[0]) != n_rows:
        raise InvalidArgumentError(f"hotness: expected {n_rows} scores (one per row), got {int(hotness.shape[0])}")
    if not mode.uses_cache:
        backend: Any = _TensorBackend(rows, pinned=mode is FetchMode.DGL_PINNED)
        return _new_storage(backend, n_rows, row_shape, dtype, mode, dev, name)
    from ibpcache.cache.feature_cache import FeatureCache

    compress = mode.compress_cache or mode.compress_host
    cache = FeatureCache(rows, budget_bytes=budget, hotness=hotness, policy=policy, device=dev,
                         codec=codec if compress else None, compress_cache=mode.compress_cache,
                         compress_host=mode.compress_host, fetch_blocks_per_sm=fetch_blocks_per_sm,
                         validate=validate)
    return _new_storage(_CacheBackend(cache), n_rows, row_shape, dtype, mode, dev, name)


def _storage_from_value(value: Any, n_rows: int, what: str, *, mode: FetchMode, device: Any, budget: Any,
                        hotness: Callable[[], torch.Tensor | None], policy: str, codec: Any) -> Any:
    """Turn what the user passed to attach (tensor, FeatureCache or storage) into a storage of ``n_rows``."""
    classes = _dgl_classes()
    if isinstance(value, classes.Storage):
        storage = value
    elif isinstance(value, torch.Tensor):
        if value.dim() < 1 or int(value.shape[0]) != n_rows:
            raise InvalidArgumentError(f"{what}: the graph has {n_rows} rows for it but the tensor has shape "
                                       f"{tuple(value.shape)}")
        score = hotness() if mode.uses_cache and policy == "static" else None
        storage = make_storage(value, mode, device=device, budget=budget, hotness=score, policy=policy,
                               codec=codec, name=what)
    elif callable(getattr(value, "fetch", None)):
        rows, row_shape, dtype = _row_geometry(value)
        storage = _new_storage(_CacheBackend(value), rows, row_shape, dtype, FetchMode.IBP_CM, device, what)
    else:
        raise InvalidTypeError(f"{what}: expected a torch.Tensor, a FeatureCache or an IBPFeatureStorage, "
                               f"got {type(value).__name__}")
    if storage.n_rows != n_rows:
        raise InvalidArgumentError(f"{what}: the graph has {n_rows} rows for it but the features have {storage.n_rows}")
    return storage


# --------------------------------------------------------------------------------------------------------------
# Attaching to a graph


def degree_hotness(g: Any, ntype: str | None = None, edge_dir: str = "in") -> torch.Tensor:
    """How often neighbour sampling reads each node's features: the static cache's admission score.

    With ``edge_dir="in"`` (DGL's default) a seed pulls the *sources* of its in-edges, so node ``u`` is read in
    proportion to its out-degree (summed over the edge types it is the source of); ``edge_dir="out"`` uses
    in-degrees. One is added for being a seed itself. Returns float32 [num_nodes(ntype)].
    """
    if edge_dir not in ("in", "out"):
        raise InvalidArgumentError(f"edge_dir must be 'in' or 'out', got {edge_dir!r}")
    ntype = _resolve_type(g.ntypes, ntype, "ntype")
    score = torch.ones(g.num_nodes(ntype), dtype=torch.float32)
    for etype in g.canonical_etypes:
        src_t, _, dst_t = etype
        if edge_dir == "in" and src_t == ntype:
            score += g.out_degrees(etype=etype).to(torch.float32)
        elif edge_dir == "out" and dst_t == ntype:
            score += g.in_degrees(etype=etype).to(torch.float32)
    return score


def _resolve_type(types_: list[Any], given: Any, what: str) -> Any:
    if given is None:
        if len(types_) != 1:
            raise InvalidArgumentError(f"the graph has several {what}s {list(types_)}; pass {what}= or a dict per "
                                       f"{what}")
        return types_[0]
    return given


def attach(
    g: Any,
    feats: Mapping[str, Any],
    ntype: str | None = None,
    *,
    mode: "str | FetchMode" = FetchMode.IBP_CM,
    device: "str | torch.device | None" = None,
    budget: float | int = 0.01,
    hotness: "str | torch.Tensor | None" = "degree",
    policy: str = "static",
    codec: Any = "auto",
) -> Any:
    """Serve node features of ``g`` through ibpcache; returns ``g`` (changed in place).

    ``feats`` maps a feature name to a tensor [num_nodes, ...] (a cache is built in ``mode``), a ready
    ``FeatureCache``, an :class:`IBPFeatureStorage`, or, for heterographs, a dict node type -> one of those.
    ``hotness="degree"`` admits the most-sampled nodes into the static GPU cache (:func:`degree_hotness`); a
    tensor gives the scores directly; None leaves admission to the cache. ``budget`` is bytes (int) or a
    fraction of the feature bytes (float). See the module docstring for the DataLoader loop.
    """
    mode = FetchMode.from_str(mode)
    for key, value in _items(feats, "feats"):
        per_type = value if isinstance(value, Mapping) else {ntype: value}
        for nt, v in per_type.items():
            nt = _resolve_type(g.ntypes, nt, "ntype")
            if nt not in g.ntypes:
                raise InvalidArgumentError(f"unknown node type {nt!r}; the graph has {list(g.ntypes)}")
            storage = _storage_from_value(
                v, g.num_nodes(nt), f"node feature {key!r} ({nt})", mode=mode, device=device, budget=budget,
                hotness=functools.partial(_hotness_for, g, nt, hotness), policy=policy, codec=codec)
            g._node_frames[g.get_ntype_id(nt)].update_column(key, _dgl_classes().Column(storage))
    return g


def attach_edges(
    g: Any,
    feats: Mapping[str, Any],
    etype: Any = None,
    *,
    mode: "str | FetchMode" = FetchMode.IBP_CM,
    device: "str | torch.device | None" = None,
    budget: float | int = 0.01,
    hotness: torch.Tensor | None = None,
    policy: str = "static",
    codec: Any = "auto",
) -> Any:
    """Like :func:`attach` for edge features (``prefetch_edge_feats``); ``etype`` or a dict per edge type.

    There is no degree rule for edges, so ``hotness`` is a tensor of per-edge scores or None.
    """
    mode = FetchMode.from_str(mode)
    for key, value in _items(feats, "feats"):
        per_type = value if isinstance(value, Mapping) else {etype: value}
        for et, v in per_type.items():
            et = g.to_canonical_etype(_resolve_type(g.canonical_etypes, et, "etype"))
            storage = _storage_from_value(
                v, g.num_edges(et), f"edge feature {key!r} ({et})", mode=mode, device=device, budget=budget,
                hotness=lambda h=hotness: h, policy=policy, codec=codec)
            g._edge_frames[g.get_etype_id(et)].update_column(key, _dgl_classes().Column(storage))
    return g


def _items(feats: Any, what: str) -> list[tuple[str, Any]]:
    if not isinstance(feats, Mapping) or not feats:
        raise InvalidTypeError(f"{what}: expected a non-empty dict feature name -> rows, got {type(feats).__name__}")
    return list(feats.items())


def _hotness_for(g: Any, ntype: Any, hotness: "str | torch.Tensor | None") -> torch.Tensor | None:
    if hotness is None or isinstance(hotness, torch.Tensor):
        return hotness
    if hotness == "degree":
        return degree_hotness(g, ntype)
    raise InvalidArgumentError(f"hotness must be 'degree', a tensor of scores or None, got {hotness!r}")


# --------------------------------------------------------------------------------------------------------------
# Pipelined loading: sampling, feature fetch and the training step overlapped


class FeatureFetch:
    """Fetch the node features (and labels) of one DGL ``DataLoader`` batch and put them where DGL's own
    prefetching would: ``blocks[0].srcdata[key]`` for ``input_nodes``, ``blocks[-1].dstdata[key]`` for labels of
    ``output_nodes``. Rows come from the graph's storage for ``key`` (an attached ibpcache storage or DGL's own
    ``TensorStorage``, pinned staging when ``device`` is a GPU), on the current stream.

    Why a separate stage rather than the sampler's ``prefetch_node_feats``: DGL resolves those inside the
    ``DataLoader``'s iterator, i.e. in whatever thread samples; as its own stage the fetch of batch i+1 runs beside
    the sampling of batch i+2 (:func:`pipelined`). ``then(batch)`` runs right after, in the same stage (e.g. to move
    block indices to the device).
    """

    def __init__(self, g: Any, node_feats: Sequence[str] = ("feat",), labels: Sequence[str] = (), *,
                 device: "str | torch.device | None" = None, then: "Callable[[Any], Any] | None" = None) -> None:
        for what, keys in (("node_feats", node_feats), ("labels", labels)):
            if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
                raise InvalidArgumentError(f"FeatureFetch: {what} must be a list of feature names, got {keys!r}")
        self.g = g
        self.node_feats = list(node_feats)
        self.labels = list(labels)
        self.device = torch.device(device) if device is not None else default_device()
        self.then = then

    def __call__(self, batch: Any) -> Any:
        if not isinstance(batch, (tuple, list)) or len(batch) != 3:
            raise InvalidArgumentError("FeatureFetch: expected a node-classification batch (input_nodes, output_nodes, "
                                       f"blocks), got {type(batch).__name__}")
        input_nodes, output_nodes, blocks = batch
        for key in self.node_feats:
            self._put(blocks[0], True, key, input_nodes)
        for key in self.labels:
            self._put(blocks[-1], False, key, output_nodes)
        return self.then(batch) if self.then is not None else batch

    def _put(self, block: Any, src: bool, key: str, ids: Any) -> None:
        types_ = block.srctypes if src else block.dsttypes
        per_type = ids if isinstance(ids, Mapping) else {_resolve_type(types_, None, "ntype"): ids}
        pin = self.device.type == "cuda"
        for nt, idx in per_type.items():
            value = self.g.get_node_storage(key, nt).fetch(idx, self.device, pin_memory=pin)
            tid = block.get_ntype_id_from_src(nt) if src else block.get_ntype_id_from_dst(nt)
            # the frame itself, as DGL's prefetcher assigns: a block on the CPU may hold rows on the GPU
            block._node_frames[tid][key] = value


def _record_dgl(obj: Any, stream: Any) -> bool:
    """record_stream hook for DGL graphs: a graph on the CPU may hold CUDA feature columns, and DGL's own
    ``DGLGraph.record_stream`` refuses any graph not on the GPU."""
    dgl = import_dgl()
    if not isinstance(obj, dgl.DGLGraph):
        return False
    if obj.device.type == "cuda":
        obj.record_stream(stream)
        return True
    for frame in itertools.chain(obj._node_frames, obj._edge_frames):
        for col in frame._columns.values():
            t = getattr(col, "storage", None)
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(stream)
    return True


def record_dgl_batch(batch: Any, stream: Any) -> None:
    """``record_stream`` on every CUDA tensor of a DGL batch (graphs, their frames, tensors, containers)."""
    record_stream(batch, stream, _record_dgl)


def pipelined(loader: Any, node_feats: Sequence[str] = ("feat",), labels: Sequence[str] = (), *,
              device: "str | torch.device | None" = None, then: "Callable[[Any], Any] | None" = None,
              prefetch: int = 2, sample_ahead: int = 2, fetch_thread: bool = True) -> PipelinedLoader:
    """A DGL ``DataLoader`` with sampling, feature fetch and training overlapped; yields what it yields::

        loader = dgl.dataloading.DataLoader(g, nids, NeighborSampler([25, 10]), device="cpu", num_workers=4, ...)
        for input_nodes, output_nodes, blocks in ibpcache.loaders.dgl.pipelined(loader, ["feat"], ["label"]):
            x = blocks[0].srcdata["feat"]          # on the GPU, == features[input_nodes] bit for bit

    The loader samples (in its worker processes, or in the sampler thread), :class:`FeatureFetch` fetches batch
    i+1 on a side stream while the caller trains on batch i (:class:`~ibpcache.loaders.pipeline.PipelinedLoader`).
    Same batches in the same order as iterating ``loader`` and fetching inline. Features listed here must not also
    be in the sampler's ``prefetch_node_feats`` / ``prefetch_labels`` (DGL would fetch them a second time, in the
    sampling stage).

    Reproducible sampling needs DGL's worker processes (``num_workers >= 1``, seeded in ``worker_init_fn``): the
    loader's ``iter()`` runs in the caller's thread, so its workers are forked from the same thread as in an
    unpipelined loop and draw the same samples. Without workers DGL samples in the sampler thread, with that
    thread's own random engine (and, multithreaded, not reproducibly even in the caller's thread).
    """
    import_dgl()
    sampler = getattr(loader, "graph_sampler", None)
    if sampler is None or not hasattr(loader, "graph"):
        raise InvalidArgumentError(f"pipelined: expected a dgl.dataloading.DataLoader, got {type(loader).__name__}")
    prefetched = set(_names(getattr(sampler, "prefetch_node_feats", None))) | set(
        _names(getattr(sampler, "prefetch_labels", None)))
    twice = sorted(prefetched & (set(node_feats) | set(labels)))
    if twice:
        raise InvalidArgumentError(f"pipelined: {twice} are prefetched by the sampler too; list them in one place "
                                   "(here, so they are fetched in the fetch stage)")
    fetch = FeatureFetch(loader.graph, node_feats, labels, device=device, then=then)
    return PipelinedLoader(loader, fetch, device=fetch.device, prefetch=prefetch, sample_ahead=sample_ahead,
                           fetch_thread=fetch_thread, record=record_dgl_batch)


def _names(spec: Any) -> list[str]:
    """Feature names in a sampler's prefetch spec (a list of names, or a dict node type -> names)."""
    if spec is None:
        return []
    if isinstance(spec, Mapping):
        return [n for names in spec.values() for n in names]
    return list(spec)
