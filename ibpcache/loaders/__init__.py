"""Thin adapters for the frameworks users already run; each imports its framework only when used."""

from __future__ import annotations

from .dgl import FetchMode, attach, attach_edges, degree_hotness, import_dgl, make_storage
from .embedding_bag import CachedEmbeddingBag, EvictionStrategy, TableBatchedCachedEmbeddingBag

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
]
