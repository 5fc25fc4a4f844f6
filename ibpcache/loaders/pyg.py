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

__all__ = ["IBPFeatureStore", "TorchNeighborSampler", "import_pyg", "row_ids"]


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
        """Uniform neighbour sampling without replacement over a CSC graph, in torch ops only."""

        def __init__(self, edge_index: torch.Tensor, num_nodes: int, num_neighbors: "list[int]",
                     seed: int = 0) -> None:
            edge_index = torch.as_tensor(edge_index)
            if edge_index.dtype == torch.bool or edge_index.is_floating_point() or edge_index.is_complex():
                raise InvalidIdsError(f"TorchNeighborSampler: edge_index must hold integer node ids, got dtype "
                                      f"{edge_index.dtype}")
            edge_index = edge_index.to(torch.int64).cpu()
            if edge_index.dim() != 2 or edge_index.shape[0] != 2:
                raise InvalidArgumentError(f"TorchNeighborSampler: edge_index: expected shape [2, E], got "
                                           f"{tuple(edge_index.shape)}")
            if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
                raise InvalidIdsError(f"TorchNeighborSampler: edge_index holds node ids outside [0, {num_nodes})")
            if (not num_neighbors or not all(_is_int(k) for k in num_neighbors)
                    or any(int(k) < -1 for k in num_neighbors)):
                raise InvalidArgumentError(f"TorchNeighborSampler: num_neighbors: expected a list of int counts "
                                           f"(-1 means all), got {num_neighbors}")
            src, dst = edge_index
            order = torch.argsort(dst, stable=True)
            self.row = src[order]  # in-neighbours, grouped by destination (CSC)
            self.eid = order
            self.colptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
            self.colptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0)
            self.num_nodes = int(num_nodes)
            self.num_neighbors = [int(k) for k in num_neighbors]
            self.generator = torch.Generator().manual_seed(seed)

        def _hop(self, frontier: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """(neighbour global id, destination position in frontier, edge id) of <= k in-edges per node."""
            start, end = self.colptr[frontier], self.colptr[frontier + 1]
            deg = end - start
            total = int(deg.sum())
            seg = torch.repeat_interleave(torch.arange(frontier.numel()), deg, output_size=total)
            excl = torch.cumsum(deg, 0) - deg
            pos = torch.repeat_interleave(start - excl, deg, output_size=total) + torch.arange(total)
            if k >= 0:
                keys = torch.rand(total, generator=self.generator)
                by_key = torch.argsort(keys)
                by_seg = by_key[torch.argsort(seg[by_key], stable=True)]  # random order within each node
                rank = torch.arange(total) - torch.repeat_interleave(excl, deg, output_size=total)
                keep = by_seg[rank < k]
                keep = keep.sort().values
                seg, pos = seg[keep], pos[keep]
            return self.row[pos], seg, self.eid[pos]

        def sample_from_nodes(self, index: Any, **kwargs: Any) -> Any:
            seeds = index.node.to(torch.int64).cpu()
            nodes = seeds
            if torch.unique(seeds).numel() != seeds.numel():
                raise InvalidArgumentError("TorchNeighborSampler: seed nodes of one batch must be distinct")
            local_of = torch.full((self.num_nodes,), -1, dtype=torch.int64)
            local_of[nodes] = torch.arange(nodes.numel())
            frontier_local = torch.arange(nodes.numel())
            rows, cols, edges = [], [], []
            n_nodes, n_edges = [int(nodes.numel())], []
            for k in self.num_neighbors:
                nbr, seg, eid = self._hop(nodes[frontier_local], k)
                new = _first_occurrence(nbr[local_of[nbr] < 0])
                local_of[new] = torch.arange(nodes.numel(), nodes.numel() + new.numel())
                nodes = torch.cat([nodes, new])
                rows.append(local_of[nbr])
                cols.append(frontier_local[seg])
                edges.append(eid)
                n_nodes.append(int(new.numel()))
                n_edges.append(int(nbr.numel()))
                frontier_local = local_of[new]
            return SamplerOutput(node=nodes, row=torch.cat(rows), col=torch.cat(cols), edge=torch.cat(edges),
                                 batch=None, num_sampled_nodes=n_nodes, num_sampled_edges=n_edges,
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


def _first_occurrence(ids: torch.Tensor) -> torch.Tensor:
    """Distinct values of ``ids`` in order of first appearance (PyG puts seeds first, then new nodes)."""
    if ids.numel() == 0:
        return ids
    uniq, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((uniq.numel(),), ids.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(ids.numel()), reduce="amin")
    return uniq[torch.argsort(first)]


def IBPFeatureStore(device: "str | torch.device" = "cpu", **cache_kwargs: Any) -> Any:  # noqa: N802 - a class
    """A ``torch_geometric.data.FeatureStore`` backed by FeatureCache (``cache_kwargs`` go to each cache; the default
    ``budget_bytes`` is 0.05, a fraction of each attribute's raw bytes; ``put_tensor(..., compress=False)`` keeps
    an attribute raw in host memory with no cache slab)."""
    return _classes()[0](device, **cache_kwargs)


def TorchNeighborSampler(edge_index: torch.Tensor, num_nodes: int, num_neighbors: "list[int]",  # noqa: N802
                         seed: int = 0) -> Any:
    """A PyG ``BaseSampler``: ``num_neighbors[h]`` uniform in-neighbours per node at hop h (-1 = all)."""
    return _classes()[1](edge_index, num_nodes, num_neighbors, seed)
