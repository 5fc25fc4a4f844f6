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

torch_geometric is imported lazily (on first use of these classes).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["IBPFeatureStore", "TorchNeighborSampler", "import_pyg"]


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

    class _Store(FeatureStore):
        """Node features served by FeatureCache objects, one per (group_name, attr_name)."""

        def __init__(self, device: "str | torch.device" = "cpu", **cache_kwargs: Any) -> None:
            super().__init__(tensor_attr_cls=TensorAttr)
            self.device = torch.device(device)
            self.cache_kwargs = dict(cache_kwargs)
            self.caches: dict[tuple[Any, str], FeatureCache] = {}

        def _put_tensor(self, tensor: Any, attr: Any) -> bool:
            if attr.index is not None and not (isinstance(attr.index, slice) and attr.index == slice(None)):
                raise ValueError("IBPFeatureStore stores whole attributes: put_tensor(..., index=None); "
                                 "the rows are immutable once compressed")
            if isinstance(tensor, FeatureCache):
                cache = tensor
            elif isinstance(tensor, (torch.Tensor, CompressedRows)):
                kw = dict(self.cache_kwargs)
                kw.setdefault("device", self.device)
                kw.setdefault("budget_bytes", 0.05)
                cache = FeatureCache(tensor, **kw)
            else:
                raise TypeError(f"put_tensor: expected a tensor, CompressedRows or FeatureCache, got "
                                f"{type(tensor).__name__}")
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
                kw.setdefault("budget_bytes", 0)
                tensor = FeatureCache(tensor, **kw)
            return super().put_tensor(tensor, *args, **kwargs)

        def _cache(self, attr: Any) -> "FeatureCache | None":
            return self.caches.get((attr.group_name, attr.attr_name))

        def _get_tensor(self, attr: Any) -> "torch.Tensor | None":
            cache = self._cache(attr)
            if cache is None:
                return None
            index = attr.index
            if index is None or (isinstance(index, slice) and index == slice(None)):
                ids = torch.arange(cache.n_rows, device=self.device)
            elif isinstance(index, slice):
                ids = torch.arange(cache.n_rows, device=self.device)[index]
            elif isinstance(index, int):
                return cache.fetch(torch.tensor([index], device=self.device))[0]
            else:
                ids = torch.as_tensor(index).to(torch.int64)
            return cache.fetch(ids)

        def _remove_tensor(self, attr: Any) -> bool:
            return self.caches.pop((attr.group_name, attr.attr_name), None) is not None

        def _get_tensor_size(self, attr: Any) -> "tuple[int, ...] | None":
            cache = self._cache(attr)
            return None if cache is None else (cache.n_rows, *cache.row_shape)

        def get_all_tensor_attrs(self) -> list:
            return [TensorAttr(group_name=g, attr_name=a) for g, a in self.caches]

        def stats(self) -> dict[str, dict]:
            """FeatureCache statistics per attribute (hit rates, bytes moved)."""
            return {f"{g}/{a}" if g is not None else a: c.stats() for (g, a), c in self.caches.items()}

    class _Sampler(BaseSampler):
        """Uniform neighbour sampling without replacement over a CSC graph, in torch ops only."""

        def __init__(self, edge_index: torch.Tensor, num_nodes: int, num_neighbors: "list[int]",
                     seed: int = 0) -> None:
            edge_index = torch.as_tensor(edge_index).to(torch.int64).cpu()
            if edge_index.dim() != 2 or edge_index.shape[0] != 2:
                raise ValueError(f"edge_index: expected shape [2, E], got {tuple(edge_index.shape)}")
            if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
                raise ValueError(f"edge_index holds node ids outside [0, {num_nodes})")
            if not num_neighbors or any(int(k) < -1 for k in num_neighbors):
                raise ValueError(f"num_neighbors: expected a list of counts (>= -1 means all), got {num_neighbors}")
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
                raise ValueError("TorchNeighborSampler: seed nodes of one batch must be distinct")
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
            raise NotImplementedError("TorchNeighborSampler samples from nodes only (NodeLoader)")

        @property
        def edge_permutation(self) -> None:
            return None

    return _Store, _Sampler


def _first_occurrence(ids: torch.Tensor) -> torch.Tensor:
    """Distinct values of ``ids`` in order of first appearance (PyG puts seeds first, then new nodes)."""
    if ids.numel() == 0:
        return ids
    uniq, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((uniq.numel(),), ids.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(ids.numel()), reduce="amin")
    return uniq[torch.argsort(first)]


def IBPFeatureStore(device: "str | torch.device" = "cpu", **cache_kwargs: Any) -> Any:  # noqa: N802 - a class
    """A ``torch_geometric.data.FeatureStore`` backed by FeatureCache (``cache_kwargs`` go to each cache)."""
    return _classes()[0](device, **cache_kwargs)


def TorchNeighborSampler(edge_index: torch.Tensor, num_nodes: int, num_neighbors: "list[int]",  # noqa: N802
                         seed: int = 0) -> Any:
    """A PyG ``BaseSampler``: ``num_neighbors[h]`` uniform in-neighbours per node at hop h (-1 = all)."""
    return _classes()[1](edge_index, num_nodes, num_neighbors, seed)
