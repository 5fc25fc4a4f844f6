"""Thin adapters for the frameworks users already run; each imports its framework only when used."""

from __future__ import annotations

from .dgl import FetchMode, attach, attach_edges, degree_hotness, import_dgl, make_storage
from .embedding_bag import CachedEmbeddingBag, EvictionStrategy, TableBatchedCachedEmbeddingBag
from .kv import KVOffloadManager
from .pipeline import PipelinedLoader
from .pyg import IBPFeatureStore, TorchNeighborSampler
from .sampling import NeighborSampler

__all__ = [
    "FetchMode",
    "attach",
    "attach_edges",
    "degree_hotness",
    "import_dgl",
    "make_storage",
    "CachedEmbeddingBag",
    "EvictionStrategy",
    "TableBatchedCachedEmbeddingBag",
    "KVOffloadManager",
    "IBPFeatureStore",
    "TorchNeighborSampler",
    "PipelinedLoader",
    "NeighborSampler",
    "IBPOffloadedCache",
    "IBPOffloadedLayer",
]


def __getattr__(name: str):
    """The transformers Cache classes import transformers, so they load on first use."""
    if name in ("IBPOffloadedCache", "IBPOffloadedLayer"):
        from . import kv

        return getattr(kv, name)
    raise AttributeError(f"module 'ibpcache.loaders' has no attribute {name!r}")
