"""Row codecs of the packed KV store: per layer and K/V, the codec that stores a sample of its rows smallest.

IBP, exponent coding (bf16/fp16) or raw, counted on real rows (the prompt's) rather than assumed: the KV manager
fits its codecs here at prefill (:func:`choose_row_codecs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..codec import Codec
from ..errors import InvalidArgumentError, RowDtypeError

__all__ = ["ROW_METHODS", "RowCodecChoice", "choose_row_codecs"]

ROW_METHODS = ("auto", "ibp", "exponent", "raw")
"""What :func:`choose_row_codecs` accepts: one method for every tensor, or ``auto`` to pick per tensor."""


@dataclass(frozen=True)
class RowCodecChoice:
    """The codec chosen for one tensor's rows and the stored bytes of the sample under each candidate."""

    codec: Any  # Codec | ExponentCodec
    method: str  # "ibp", "exponent" or "raw"
    sizes: dict  # method -> stored bytes of the sample (candidates that were measured)
    ibp_chunk_bytes: Optional[int] = None  # chunk size the IBP fit chose (reused by later fits), if one ran

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "sizes": dict(self.sizes)}


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
