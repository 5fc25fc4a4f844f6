"""Row codecs of the packed KV store: per layer and K/V, the codec that stores a sample of its rows smallest, and,
for stores read by scattered selections (sparse mode), raw rows where decoding them costs more than it saves.

IBP, exponent coding (bf16/fp16) or raw, counted on real rows (the prompt's) rather than assumed: the KV manager
fits its codecs here at prefill (:func:`choose_row_codecs`).

Why a second decision for sparse reads: a dense read copies whole chunks (fewer bytes, fewer copies) and decodes
from device memory, so compression always pays there. A sparse read pulls a few hundred rows per head from all over
host memory, one row per page and translation; there the bytes a codec saves may buy less than its decode costs
(issue 23: 61.7 ms per token compressed against 54.5 raw in the plain loop). So the choice is measured
(``append_store.measure_scattered``: the store's own fetch kernel, raw against coded rows, on this GPU; the planner
imports no store) and applied per layer and side by its stored ratio (:func:`prefer_raw_for_scattered`);
``stats()["codecs"]`` says what was chosen and why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ..codec import Codec
from ..errors import InvalidArgumentError, RowDtypeError

__all__ = ["ROW_METHODS", "RowCodecChoice", "choose_row_codecs", "ScatteredCost", "SCATTERED_MARGIN",
           "prefer_raw_for_scattered", "apply_scattered_cost"]

ROW_METHODS = ("auto", "ibp", "exponent", "raw")
"""What :func:`choose_row_codecs` accepts: one method for every tensor, or ``auto`` to pick per tensor."""


@dataclass(frozen=True)
class RowCodecChoice:
    """The codec chosen for one tensor's rows and the stored bytes of the sample under each candidate."""

    codec: Any  # Codec | ExponentCodec
    method: str  # "ibp", "exponent" or "raw"
    sizes: dict  # method -> stored bytes of the sample (candidates that were measured)
    ibp_chunk_bytes: Optional[int] = None  # chunk size the IBP fit chose (reused by later fits), if one ran
    scattered: Optional[dict] = None  # sparse reads: the fetch costs compared (see apply_scattered_cost)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "sizes": dict(self.sizes)}
        if self.scattered is not None:
            out["scattered"] = dict(self.scattered)
        return out


def choose_row_codecs(samples: "list[torch.Tensor]", method: str = "auto", threshold: "float | str" = "auto",
                      chunk_bytes: "int | str | list" = "auto") -> "list[RowCodecChoice]":
    """One codec per sample ([N, ...] rows, all on one device): ``method`` for all, or with ``"auto"`` whichever of
    IBP, exponent coding (bf16/fp16 only) and raw stores that sample in the fewest bytes (ties: the earlier of raw,
    IBP, exponent, so a codec must strictly save bytes to be chosen).

    The IBP codecs are fitted together (:meth:`Codec.fit_many`: two host syncs in all on a GPU). Exponent codes are
    counted on the host (a prompt-time copy of the samples). ``threshold``/``chunk_bytes`` go to the IBP fit
    (``chunk_bytes`` may be a list, one per sample)."""
    from ..exponent import FORMATS, ExponentCodec

    if method not in ROW_METHODS:
        raise InvalidArgumentError(f"method must be one of {ROW_METHODS}, got {method!r}")
    if not samples:
        return []
    dtype = samples[0].dtype
    if method == "exponent" and dtype not in FORMATS:
        raise RowDtypeError(f"method='exponent' codes bfloat16/float16 rows; these rows are {dtype} (use 'ibp', 'raw' "
                            "or 'auto')")
    if method == "raw":
        return [RowCodecChoice(Codec.raw(x.dtype, tuple(x.shape[1:])), "raw", {}) for x in samples]
    if method == "exponent":
        return [RowCodecChoice(ExponentCodec.fit(x), "exponent", {}) for x in samples]
    ibp = Codec.fit_many(samples, threshold=threshold, chunk_bytes=chunk_bytes)
    if method == "ibp":
        return [RowCodecChoice(c, "ibp", {}, c.chunk_bytes) for c in ibp]
    out = []
    for x, ibp_codec in zip(samples, ibp):
        sizes = {"raw": int(x.shape[0]) * ibp_codec.row_bytes,
                 "ibp": int(ibp_codec.stored_lengths(x).sum(dtype=torch.int64))}
        codecs: dict[str, Any] = {"raw": Codec.raw(x.dtype, tuple(x.shape[1:])), "ibp": ibp_codec}
        if x.dtype in FORMATS:
            exp = ExponentCodec.fit(x)
            sizes["exponent"] = int(exp.stored_lengths(x).sum(dtype=torch.int64))
            codecs["exponent"] = exp
        best = min(sizes, key=lambda k: (sizes[k], ("raw", "ibp", "exponent").index(k)))
        out.append(RowCodecChoice(codecs[best], best, sizes, ibp_codec.chunk_bytes))
    return out


@dataclass(frozen=True)
class ScatteredCost:
    """A scattered fetch's measured time per row (the store's fetch kernel, selected tokens of every head): raw rows,
    and rows of one codec whose sample stored ``coded_ratio`` times fewer bytes."""

    raw_s: float
    coded_s: float
    coded_ratio: float
    method: str  # the codec measured: "exponent" or "ibp"


SCATTERED_MARGIN = 0.10
"""How much faster than raw rows an isolated fetch of coded rows must be for a sparse store to keep its codec.

Why a margin: the measurement times the fetch alone, a decode step runs it beside the model's kernels, where the
decode's extra work per row costs more. At the Llama-8B shape, 32k tokens, batch 4, the isolated fetch times
exponent rows 5-10% faster than raw on an idle H100 (``scripts/experiments/kv_scattered_probe.py``,
docs/results/2026-11-26-h100-s30), while decode steps with them ran 1.06x the raw store's on an H200
(docs/results/2026-11-26-h200-s28, its round not disturbed by other load): the isolated timing can overstate the
codec's edge by ~10%, and a sparse store's codec saves host memory, not time, unless it clears that."""


def prefer_raw_for_scattered(cost: ScatteredCost, ratio: float,
                             margin: float = SCATTERED_MARGIN) -> "tuple[bool, float]":
    """Whether raw rows are the better choice for coded rows of stored ``ratio`` (raw bytes / stored bytes): unless
    coded rows are predicted faster by ``margin`` (:data:`SCATTERED_MARGIN`), and the coded time predicted per row.

    Model: a raw row's time is its transfer (``raw_s`` for ``row_bytes``); a coded row's is the transfer of its
    stored bytes plus a decode cost, which the measurement gives: ``coded_s - raw_s / coded_ratio``. So a layer that
    compresses less than the calibration's rows pays more per byte saved. Ties go to raw (compression must not
    cost)."""
    decode = cost.coded_s - cost.raw_s / cost.coded_ratio
    predicted = decode + cost.raw_s / max(ratio, 1e-9)
    return predicted >= cost.raw_s * (1.0 - margin), predicted


def apply_scattered_cost(choice: RowCodecChoice, cost: "ScatteredCost | None") -> RowCodecChoice:
    """``choice`` for a store read by scattered selections: the same codec, or raw rows unless the measured cost says
    coded rows fetch faster by :data:`SCATTERED_MARGIN` (the comparison is kept in ``choice.scattered``)."""
    if cost is None or choice.method == "raw" or choice.method != cost.method:
        return choice
    ratio = choice.sizes.get("raw", 0) / max(1, choice.sizes.get(choice.method, 0)) if choice.sizes else \
        cost.coded_ratio
    raw, predicted = prefer_raw_for_scattered(cost, ratio)
    info = {"raw_ns_per_row": cost.raw_s * 1e9, "coded_ns_per_row_measured": cost.coded_s * 1e9,
            "measured_ratio": cost.coded_ratio, "ratio": ratio, "coded_ns_per_row_predicted": predicted * 1e9,
            "margin": SCATTERED_MARGIN, "coded": choice.method, "chosen": "raw" if raw else choice.method}
    if not raw:
        return replace(choice, scattered=info)
    codec = Codec.raw(choice.codec.dtype, tuple(choice.codec.row_shape))
    return replace(choice, codec=codec, method="raw", scattered=info)
