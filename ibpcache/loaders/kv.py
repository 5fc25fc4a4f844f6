"""KV-cache offload under transformers: the public face of the adapter (importing it needs no transformers).

``model.generate(ids, past_key_values=IBPOffloadedCache(model.config, mode="dense" | "sparse", model=...))`` keeps
every layer's K/V losslessly compressed in host memory. The adapter is three modules:

* this one: the names users import. :class:`IBPOffloadedCache` / :class:`IBPOffloadedLayer` subclass transformers'
  ``Cache`` classes, so they are built on first use (``_kv_hf``); the engine's names are re-exported.
* ``_kv_hf``: the transformers ``Cache`` (the layer contract: update, crop, beam reorder, batch selection) and
  sparse mode's forward hooks; it only translates calls into the engine's.
* ``_kv_model``: what the adapter knows of a Llama-family decoder (query projection with RoPE, decoder layers,
  attention masks).

The engine lives in :mod:`ibpcache.cache`: ``kv_manager`` (:class:`KVOffloadManager`, :class:`KVStepGraph`: slots,
codec choice, prefetch, transfer paths), ``append_store`` (the packed row store), ``cpu_gather_store``
(InfiniGen's baseline store), ``kv_select`` (partial-key selection) and ``kv_graph`` (speculation graphs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cache.kv_manager import DENSE_FETCHES, TRANSFERS, KVOffloadManager, KVStepGraph

if TYPE_CHECKING:
    from ._kv_hf import IBPOffloadedCache, IBPOffloadedLayer

__all__ = ["KVOffloadManager", "KVStepGraph", "IBPOffloadedCache", "IBPOffloadedLayer", "TRANSFERS", "DENSE_FETCHES"]


def __getattr__(name: str) -> Any:
    """The transformers classes are built on first use so that this module imports without transformers."""
    if name in ("IBPOffloadedCache", "IBPOffloadedLayer"):
        from . import _kv_hf

        return getattr(_kv_hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
