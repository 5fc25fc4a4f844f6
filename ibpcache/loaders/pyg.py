"""PyTorch Geometric: a ``FeatureStore`` whose node features come from ibpcache, plus a pure-torch sampler.

``IBPFeatureStore`` is a :class:`torch_geometric.data.FeatureStore`; each (group, attribute) is backed by a
:class:`~ibpcache.cache.FeatureCache` (built from a tensor, a ``CompressedRows`` -- e.g. one attached from the
node's shared store -- or given ready). PyG's loaders take it as the feature half of ``data=(feature_store,
graph_store)``; every mini-batch's rows then come from ``FeatureCache.fetch`` (bit-exact).

PyG's own ``NeighborSampler`` needs pyg-lib or torch-sparse compiled ops (torch_geometric 2.8 raises
ImportError without them, and neither is on our images), so :class:`TorchNeighborSampler` is a small
``BaseSampler`` in plain torch (uniform, without replacement, homogeneous graphs) to drive ``NodeLoader``::

    store = IBPFeatureStore(device="cpu")
    store.put_tensor(data.x, attr_name="x", index=None)          # or a CompressedRows / FeatureCache
    store.put_tensor(data.y, attr_name="y", index=None, compress=False)
    sampler = TorchNeighborSampler(data.edge_index, data.num_nodes, [10, 5], seed=0)
    loader = NodeLoader((store, data), sampler, input_nodes=train_idx, batch_size=128, shuffle=True)

``get_tensor``'s ``index`` reads as torch indexing of the rows does, and anything torch would read differently is
refused (:class:`~ibpcache.errors.InvalidIdsError`, an ``IndexError`` as torch raises), never reinterpreted:

* ``None`` / ``slice`` (positive step) / ``range`` / ``int``: as ``x[index]`` (an int gives one row, no row dimension);
* a 1-D bool tensor (or list of bools) of one entry per row: the rows where it is True;
* an integer tensor, list or NumPy array of any shape: ``x[index]`` (result shape ``index.shape + row_shape``); ids in
  ``[-N, N)``, a negative id counting from the end as in torch; int8/16/32/64 and uint16/32 are widened exactly;
* refused: float and complex indices (torch truncates nothing either: it raises), ``uint8`` (torch reads it as a
  deprecated mask), ``uint64`` (no exact int64 widening), bool scalars, tuples (several dimensions in torch), bool
  masks of another length.

``group_name`` may be left out of ``get_tensor`` / ``get_tensor_size`` when only one group holds the attribute, and
``index`` of ``get_tensor`` (all rows), as PyG's in-memory ``Data`` allows.

torch_geometric is imported lazily (on first use of these classes).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, InvalidIdsError, InvalidTypeError, UnsupportedError
from .pipeline import PipelinedLoader, record_stream
from .sampling import NeighborSampler, batch_key, seeds_key

__all__ = ["IBPFeatureStore", "TorchNeighborSampler", "import_pyg", "row_ids", "pipelined"]


def import_pyg() -> Any:
    """``torch_geometric`` or an ImportError that says what this module needs it for."""
    try:
        import torch_geometric  # noqa: F401
        from torch_geometric.data import FeatureStore  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"ibpcache.loaders.pyg needs torch_geometric (pip install torch_geometric): {exc}") \
            from exc
    return torch_geometric


@functools.lru_cache(maxsize=1)
def _classes() -> tuple[type, type]:
    """Build the PyG subclasses on first use (so importing this module does not import PyG)."""
    import_pyg()
    from torch_geometric.data import FeatureStore, TensorAttr
    from torch_geometric.sampler import BaseSampler, SamplerOutput

    from ..cache import FeatureCache
    from ..compressed import CompressedRows

    unset = TensorAttr().group_name  # PyG's marker of a field the caller left out

    class IBPFeatureStore(FeatureStore):
        """Node features served by FeatureCache objects, one per (group_name, attr_name)."""

        def __init__(self, device: "str | torch.device" = "cpu", **cache_kwargs: Any) -> None:
            super().__init__(tensor_attr_cls=TensorAttr)
            self.device = torch.device(device)
            self.cache_kwargs = dict(cache_kwargs)
            self.caches: dict[tuple[Any, str], FeatureCache] = {}

        def _put_tensor(self, tensor: Any, attr: Any) -> bool:
            if attr.index is not None and not (isinstance(attr.index, slice) and attr.index == slice(None)):
                raise InvalidArgumentError("IBPFeatureStore stores whole attributes: put_tensor(..., index=None); "
                                           "the rows are immutable once compressed")
            if isinstance(tensor, FeatureCache):
                cache = tensor
            elif isinstance(tensor, (torch.Tensor, CompressedRows)):
                kw = dict(self.cache_kwargs)
                kw.setdefault("device", self.device)
                kw.setdefault("budget_bytes", 0.05)
                cache = FeatureCache(tensor, **kw)
            else:
                raise InvalidTypeError(f"IBPFeatureStore.put_tensor: expected a tensor, CompressedRows or "
                                       f"FeatureCache, got {type(tensor).__name__}")
            self.caches[(attr.group_name, attr.attr_name)] = cache
            return True

        def put_tensor(self, tensor: Any, *args: Any, compress: bool = True, **kwargs: Any) -> bool:
            """As PyG's (``group_name`` defaults to None: homogeneous), plus ``compress=False`` to keep an
            attribute raw (labels, masks)."""
            if not args:
                kwargs.setdefault("group_name", None)
            if not compress and isinstance(tensor, torch.Tensor):
                kw = dict(self.cache_kwargs, compress_cache=False, compress_host=False)
                kw.setdefault("device", self.device)
                kw["budget_bytes"] = None  # no slab: a raw attribute is read from host memory
                tensor = FeatureCache(tensor, **kw)
            return super().put_tensor(tensor, *args, **kwargs)

        def get_tensor(self, *args: Any, convert_type: bool = False, **kwargs: Any) -> Any:
            """As PyG's, with ``group_name`` found when one group holds the attribute and ``index`` defaulting to
            all rows (as PyG's in-memory ``Data``); ``index`` reads as torch indexing does (module docstring)."""
            attr = self._complete(self._tensor_attr_cls.cast(*args, **kwargs))
            if attr.attr_name is unset:
                raise InvalidArgumentError("IBPFeatureStore.get_tensor: attr_name is required")
            # not FeatureStore.get_tensor: its completeness check compares the index with `!=`, which a NumPy
            # index (an IndexType PyG documents) cannot answer
            tensor = self._get_tensor(attr)
            return self._to_type(attr, tensor) if convert_type else tensor

        def _complete(self, attr: Any) -> Any:
            """Fill a left-out ``group_name`` (the one group holding ``attr_name``) and ``index`` (all rows)."""
            if attr.group_name is unset and attr.attr_name is not unset:
                groups = [g for g, a in self.caches if a == attr.attr_name]
                if len(groups) > 1:
                    raise InvalidArgumentError(f"IBPFeatureStore: attribute {attr.attr_name!r} is held by groups "
                                               f"{groups}; pass group_name")
                attr.group_name = groups[0] if groups else None
            if attr.index is unset:
                attr.index = None
            return attr

        def _cache(self, attr: Any) -> "FeatureCache | None":
            return self.caches.get((attr.group_name, attr.attr_name))

        def _get_tensor(self, attr: Any) -> "torch.Tensor | None":
            cache = self._cache(attr)
            if cache is None:
                return None
            ids, lead = row_ids(attr.index, cache.n_rows, self.device)
            return cache.fetch(ids).reshape(*lead, *cache.row_shape)

        def _remove_tensor(self, attr: Any) -> bool:
            return self.caches.pop((attr.group_name, attr.attr_name), None) is not None

        def _get_tensor_size(self, attr: Any) -> "tuple[int, ...] | None":
            cache = self._cache(self._complete(attr))
            return None if cache is None else (cache.n_rows, *cache.row_shape)

        def get_all_tensor_attrs(self) -> list:
            return [TensorAttr(group_name=g, attr_name=a) for g, a in self.caches]

        def stats(self) -> dict[str, dict]:
            """FeatureCache statistics per attribute (hit rates, bytes moved)."""
            return {f"{g}/{a}" if g is not None else a: c.stats() for (g, a), c in self.caches.items()}

        def __repr__(self) -> str:
            attrs = [f"{g}/{a}" if g is not None else a for g, a in self.caches]
            return f"IBPFeatureStore(device={self.device}, attrs={attrs})"

    class TorchNeighborSampler(BaseSampler):
        """Uniform neighbour sampling without replacement (PyG hops: each hop samples the nodes the previous one
        added), on the CPU or the GPU, in torch ops only; the sampling itself is
        :class:`~ibpcache.loaders.sampling.NeighborSampler`'s."""

        def __init__(self, edge_index: torch.Tensor, num_nodes: int, num_neighbors: "list[int]",
                     seed: int = 0, device: "str | torch.device" = "cpu") -> None:
            edge_index = torch.as_tensor(edge_index)
            if edge_index.dtype == torch.bool or edge_index.is_floating_point() or edge_index.is_complex():
                raise InvalidIdsError(f"TorchNeighborSampler: edge_index must hold integer node ids, got dtype "
                                      f"{edge_index.dtype}")
            if edge_index.dim() != 2 or edge_index.shape[0] != 2:
                raise InvalidArgumentError(f"TorchNeighborSampler: edge_index: expected shape [2, E], got "
                                           f"{tuple(edge_index.shape)}")
            if (not num_neighbors or not all(_is_int(k) for k in num_neighbors)
                    or any(int(k) < -1 for k in num_neighbors)):
                raise InvalidArgumentError(f"TorchNeighborSampler: num_neighbors: expected a list of int counts "
                                           f"(-1 means all), got {num_neighbors}")
            try:
                self.sampler = NeighborSampler(edge_index[0], edge_index[1], int(num_nodes),
                                               [int(k) for k in num_neighbors], device=device, frontier=True)
            except InvalidIdsError as exc:
                raise InvalidIdsError(f"TorchNeighborSampler: {exc}".replace("NeighborSampler: ", "")) from None
            self.num_nodes = int(num_nodes)
            self.num_neighbors = [int(k) for k in num_neighbors]
            self.seed = int(seed)
            self.epoch = 0

        @property
        def device(self) -> torch.device:
            return self.sampler.device

        def set_epoch(self, epoch: int) -> None:
            """Part of every batch's key (as ``DistributedSampler.set_epoch``): without it, a batch of the same seeds
            gets the same sample in every epoch (a shuffled loader rarely repeats one)."""
            self.epoch = int(epoch)

        def sample_from_nodes(self, index: Any, **kwargs: Any) -> Any:
            seeds = index.node.to(torch.int64)
            key = batch_key(self.seed, self.epoch, seeds_key(seeds))
            out = self.sampler.sample(seeds, key)
            hops = out.hops
            return SamplerOutput(node=out.nodes, row=torch.cat([h.src for h in hops]),
                                 col=torch.cat([h.dst for h in hops]), edge=torch.cat([h.eid for h in hops]),
                                 batch=None, num_sampled_nodes=[out.num_seeds] + [h.n_src - h.n_dst for h in hops],
                                 num_sampled_edges=[int(h.src.numel()) for h in hops],
                                 metadata=(index.input_id, None))

        def sample_from_edges(self, index: Any, neg_sampling: Any = None) -> Any:
            raise UnsupportedError("TorchNeighborSampler samples from nodes only (use NodeLoader, not LinkLoader)")

        @property
        def edge_permutation(self) -> None:
            return None

    return IBPFeatureStore, TorchNeighborSampler


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


_WIDENED = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32}
"""Index dtypes whose every value is an int64 value: widened exactly."""


def row_ids(index: Any, n_rows: int, device: "str | torch.device" = "cpu") -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(ids, lead)``: the rows ``x[index]`` reads, as int64 ids in ``[0, n_rows)``, and the leading shape of the
    result (``()`` for one int: a single row without a row dimension). Refuses what torch would read otherwise.

    Generated ids (None, slices, ranges, ints) are made on ``device``; a given tensor stays on its own device (its
    range check is one min/max reduction there).
    """
    if index is None:
        return torch.arange(n_rows, device=device), (n_rows,)
    if isinstance(index, slice):
        if index.step is not None and (not _is_int(index.step) or index.step <= 0):
            raise InvalidIdsError(f"index: slice step must be a positive int (as in torch), got {index.step!r}")
        ids = torch.arange(n_rows, device=device)[index]
        return ids, (ids.numel(),)
    if isinstance(index, (bool, np.bool_)):
        raise InvalidIdsError(f"index: a bool ({index!r}) is not a row index (torch would add a dimension); pass a "
                              "bool tensor with one entry per row to select rows")
    if _is_int(index):
        if not -n_rows <= int(index) < n_rows:
            raise InvalidIdsError(f"index: id {int(index)} is out of range for {n_rows} rows (ids in [-{n_rows}, "
                                  f"{n_rows}), negative ones counting from the end as in torch)")
        return torch.tensor([int(index) % n_rows], device=device), ()
    if isinstance(index, tuple):
        raise InvalidIdsError("index: a tuple indexes several dimensions in torch; pass a list or a tensor of row ids")
    if isinstance(index, (list, range, np.ndarray)):
        index = _sequence_tensor(index)
    if not isinstance(index, torch.Tensor):
        raise InvalidIdsError(f"index: expected None, an int, a slice, a range, a list, a NumPy array or a tensor, "
                              f"got {type(index).__name__}")
    if index.dtype == torch.bool:
        return _mask_ids(index, n_rows)
    return _int_ids(index, n_rows)


def _sequence_tensor(index: "list | range | np.ndarray") -> torch.Tensor:
    """A list / range / array as torch would index with it (an empty list selects no row)."""
    if isinstance(index, list) and not index:
        return torch.empty(0, dtype=torch.int64)
    try:
        return torch.as_tensor(index)
    except (TypeError, ValueError, RuntimeError) as exc:  # ragged lists, object arrays
        raise InvalidIdsError(f"index: cannot read {type(index).__name__} as row ids: {exc}") from None


def _mask_ids(mask: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    if mask.dim() != 1 or mask.numel() != n_rows:
        raise InvalidIdsError(f"index: a bool mask selects rows and must have shape [{n_rows}] (one entry per row), "
                              f"got shape {tuple(mask.shape)}")
    ids = torch.nonzero(mask).reshape(-1)
    return ids, (ids.numel(),)


def _int_ids(index: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    if index.dtype not in _WIDENED:
        why = {torch.uint8: " (torch reads uint8 indices as a deprecated bool mask; pass a bool mask or int64 ids)",
               torch.uint64: " (no exact widening to int64; pass int64 ids)"}.get(index.dtype, "")
        raise InvalidIdsError(f"index: row ids must be an integer tensor (int8/16/32/64, uint16/32) or a bool mask, "
                              f"got dtype {index.dtype}{why}")
    lead = tuple(index.shape)
    ids = index.reshape(-1).to(torch.int64)
    if ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < -n_rows or hi >= n_rows:
            bad = lo if lo < -n_rows else hi
            raise InvalidIdsError(f"index: id {bad} is out of range for {n_rows} rows (ids in [-{n_rows}, {n_rows}), "
                                  "negative ones counting from the end as in torch)")
        if lo < 0:
            ids = torch.where(ids < 0, ids + n_rows, ids)
    return ids.contiguous(), lead


def IBPFeatureStore(device: "str | torch.device" = "cpu", **cache_kwargs: Any) -> Any:  # noqa: N802 - a class
    """A ``torch_geometric.data.FeatureStore`` backed by FeatureCache (``cache_kwargs`` go to each cache; the default
    ``budget_bytes`` is 0.05, a fraction of each attribute's raw bytes; ``put_tensor(..., compress=False)`` keeps
    an attribute raw in host memory with no cache slab)."""
    return _classes()[0](device, **cache_kwargs)


def TorchNeighborSampler(edge_index: torch.Tensor, num_nodes: int, num_neighbors: "list[int]",  # noqa: N802
                         seed: int = 0, device: "str | torch.device" = "cpu") -> Any:
    """A PyG ``BaseSampler``: ``num_neighbors[h]`` uniform in-neighbours per node at hop h (-1 = all), sampled on
    ``device`` (the graph is kept there; "cuda" when it fits, see
    :func:`~ibpcache.loaders.sampling.choose_sampler_device`). A batch's sample depends only on ``seed``, the
    sampler's epoch (:meth:`set_epoch`) and the batch's seed nodes in order: the same on the CPU and the GPU, in a
    worker or a thread, in any batch order."""
    return _classes()[1](edge_index, num_nodes, num_neighbors, seed, device)


# ------------------------------------------------------------------------------------------------------------
# Pipelined loading


def _record_pyg(obj: Any, stream: Any) -> bool:
    """record_stream hook for PyG ``Data`` / ``HeteroData``: their own ``record_stream`` also visits CPU tensors,
    which torch refuses."""
    from torch_geometric.data.data import BaseData

    if not isinstance(obj, BaseData):
        return False
    record_stream(obj.to_dict(), stream)
    return True


def record_pyg_batch(batch: Any, stream: Any) -> None:
    """``record_stream`` on every CUDA tensor of a PyG batch (``Data``, ``HeteroData``, sampler outputs)."""
    record_stream(batch, stream, _record_pyg)


def pipelined(loader: Any, *, device: "str | torch.device | None" = None, prefetch: int = 2, sample_ahead: int = 2,
              fetch_thread: bool = True) -> PipelinedLoader:
    """A PyG ``NodeLoader`` (``NeighborLoader``...) with sampling, feature fetch and training overlapped; yields the
    same ``Data`` batches in the same order::

        store = IBPFeatureStore(device="cuda"); store.put_tensor(x, attr_name="x", index=None)
        sampler = TorchNeighborSampler(edge_index, n, [10, 5], device="cuda")
        loader = NodeLoader((store, graph), sampler, input_nodes=train_idx, batch_size=512, shuffle=True)
        for batch in ibpcache.loaders.pyg.pipelined(loader, device="cuda"):
            out = model(batch.x, batch.edge_index)

    PyG's loader does its work in two steps: ``collate_fn`` samples (in worker processes if it has any) and
    ``filter_fn`` fetches the features from the feature store and builds the batch. Here the first runs in the
    sampler thread, the second in the fetch stage on a side stream
    (:class:`~ibpcache.loaders.pipeline.PipelinedLoader`). A loader that filters in its workers
    (``filter_per_worker=True``) is only read ahead. ``device``: the training device (default: the feature
    store's).
    """
    import_pyg()
    if not callable(getattr(loader, "filter_fn", None)) or not hasattr(loader, "filter_per_worker"):
        raise InvalidArgumentError(f"pyg.pipelined: expected a torch_geometric NodeLoader, got {type(loader).__name__}")
    data = getattr(loader, "data", None)
    if device is None:
        store = data[0] if isinstance(data, tuple) else None
        device = getattr(store, "device", None) or "cpu"
    return PipelinedLoader(_Sampled(loader), None if loader.filter_per_worker else loader.filter_fn,
                           device=device, prefetch=prefetch, sample_ahead=sample_ahead, fetch_thread=fetch_thread,
                           record=record_pyg_batch)


class _Sampled:
    """The sampling half of a PyG loader: the ``DataLoader`` iterator PyG's own iterator wraps (``collate_fn``
    only), without the ``filter_fn`` that PyG applies to each batch in the caller's process."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        it = iter(self.loader)  # PyG's DataLoaderIterator (filter in the caller) or torch's (filter per worker)
        return it if self.loader.filter_per_worker else it.iterator
