"""Choosing mask/bitval: one bit-count pass, then every (threshold, chunk size) scored in one more pass.

A bit position is *invariant at threshold T* when at least ``T * N`` of the N fitted rows agree on its
value (paper section 4.1). Thresholds are nested: a bit masked at a high T is masked at every lower T.
So each bit gets a *level* — how many of the ascending candidate thresholds mask it — and one pass over
the rows per chunk size scores all thresholds at once (see ``fit_sizes_cpu``). The candidate with the
fewest stored bytes wins; ties go to the larger chunk (faster decode), then the higher threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import InvalidArgumentError, InvalidTypeError
from .format import CHUNK_SIZES, RowGeometry

__all__ = ["DEFAULT_THRESHOLDS", "FitResult", "bit_levels", "chunk_tables", "fit_rows_many", "sample_rows"]

DEFAULT_THRESHOLDS: tuple[float, ...] = tuple(round(0.70 + 0.01 * k, 2) for k in range(26))
"""T/N candidates 0.70, 0.71, ..., 0.95 (the paper sweeps 0.7..1.0 and finds ~0.8 best)."""


@dataclass(frozen=True)
class FitResult:
    """What the fit chose, and the score table it chose from (for reports and tests)."""

    chunk_bytes: int
    threshold: float
    mask: np.ndarray  # uint64 [n_chunks]
    bitval: np.ndarray  # uint64 [n_chunks]
    fitted_rows: int
    scores: dict  # {(chunk_bytes, threshold): total stored bytes over the fitted rows}


def _percent_grid(thresholds: tuple[float, ...]) -> np.ndarray:
    grid = np.array(sorted({int(round(t * 100)) for t in thresholds}), dtype=np.int64)
    if grid.size == 0 or grid[0] <= 50 or grid[-1] > 100:
        raise InvalidArgumentError(f"thresholds must lie in (0.5, 1.0], got {thresholds}")
    return grid


def bit_levels(counts: np.ndarray, n_rows: int, grid_percent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per bit: level (how many grid thresholds mask it) and majority value (0/1), as uint8 arrays.

    Integer math only (``100 * agree >= t * N``), so the CPU and GPU fits pick identical masks.
    """
    ones = counts.astype(np.int64)
    agree = np.maximum(ones, n_rows - ones)
    level = (100 * agree[:, None] >= grid_percent[None, :] * n_rows).sum(axis=1).astype(np.uint8)
    majority = (2 * ones > n_rows).astype(np.uint8)
    return level, majority


def chunk_tables(level: np.ndarray, majority: np.ndarray, geom: RowGeometry, k_count: int):
    """Per chunk: majority word ``inv`` (uint64), and ``pc[k, j]`` = bits of chunk j masked at threshold k.

    ``level``/``majority`` cover ``row_bytes * 8`` bits; the padding bits of the last partial chunk are
    given the top level and value 0, so they are always dropped.
    """
    nbits = geom.padded_bytes * 8
    lv = np.full(nbits, k_count, dtype=np.uint8)
    mj = np.zeros(nbits, dtype=np.uint8)
    lv[: level.size] = level
    mj[: majority.size] = majority
    cb = geom.chunk_bits
    lv2 = lv.reshape(geom.n_chunks, cb)
    weights = (np.uint64(1) << np.arange(cb, dtype=np.uint64)).astype(np.uint64)
    inv = (mj.reshape(geom.n_chunks, cb).astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)
    pc = (lv2[None, :, :] > np.arange(k_count, dtype=np.uint8)[:, None, None]).sum(axis=2).astype(np.int32)
    return lv, inv.astype(np.uint64), pc


def mask_at(level_padded: np.ndarray, majority: np.ndarray, geom: RowGeometry, k: int):
    """mask/bitval (uint64 per chunk) at grid index k."""
    cb = geom.chunk_bits
    weights = (np.uint64(1) << np.arange(cb, dtype=np.uint64)).astype(np.uint64)
    masked = (level_padded > k).reshape(geom.n_chunks, cb).astype(np.uint64)
    mj = np.zeros(level_padded.size, dtype=np.uint64)
    mj[: majority.size] = majority
    mask = (masked * weights).sum(axis=1, dtype=np.uint64)
    bitval = (masked * mj.reshape(geom.n_chunks, cb) * weights).sum(axis=1, dtype=np.uint64)
    return mask.astype(np.uint64), bitval.astype(np.uint64)


def sample_rows(n_rows: int, sample: "float | int | None", seed: int = 0) -> "np.ndarray | None":
    """Sorted row indices to fit on: all (None), a fraction in (0, 1], or a row count."""
    if sample is None:
        return None
    if isinstance(sample, bool) or not isinstance(sample, (int, float)):
        raise InvalidTypeError(f"sample must be None, a fraction in (0, 1] or a row count, got {sample!r}")
    if isinstance(sample, float):
        if not 0.0 < sample <= 1.0:
            raise InvalidArgumentError(f"sample fraction must be in (0, 1], got {sample}")
        count = max(1, int(round(sample * n_rows)))
    else:
        if sample < 1:
            raise InvalidArgumentError(f"sample row count must be >= 1, got {sample}")
        count = min(int(sample), n_rows)
    if count >= n_rows:
        return None
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_rows, size=count, replace=False))


def fit_rows_many(
    rows_list: "list[torch.Tensor]",
    *,
    thresholds: "tuple[float, ...]",
    chunk_sizes: "list[tuple[int, ...]]",
    backend: "object",
) -> list[FitResult]:
    """Fit one codec per entry of ``rows_list`` ([N, row_bytes] uint8, CPU or CUDA; ``chunk_sizes[i]``: the sizes
    tried for entry i) with ``backend``'s ``bitcount_lazy``, ``fit_sizes_lazy`` and ``collect``.

    All bit counts are launched before any is read, then all size passes: on the GPU that is two host syncs
    for any number of codecs (the KV manager fits two per decoder layer at the end of a prefill).
    """
    for sizes in chunk_sizes:
        for c in sizes:
            if c not in CHUNK_SIZES:
                raise InvalidArgumentError(f"chunk_bytes must be one of {CHUNK_SIZES}, got {c}")
    grid = _percent_grid(thresholds)
    k_count = len(grid)
    counts = backend.collect([backend.bitcount_lazy(rows) for rows in rows_list])
    jobs = []  # (entry, chunk size, level table, totals handle)
    majorities = []
    for i, (rows, cnt) in enumerate(zip(rows_list, counts)):
        level, majority = bit_levels(cnt, rows.shape[0], grid)
        majorities.append(majority)
        for c in chunk_sizes[i]:
            lv, inv, pc = chunk_tables(level, majority, RowGeometry(rows.shape[1], c), k_count)
            jobs.append((i, c, lv, backend.fit_sizes_lazy(rows, lv, inv, pc, c)))
    totals_all = backend.collect([job[3] for job in jobs])
    best: dict = {}
    scores: dict = {i: {} for i in range(len(rows_list))}
    for (i, c, lv, _), totals in zip(jobs, totals_all):
        for k in range(k_count):
            total = int(totals[k])
            scores[i][(c, grid[k] / 100.0)] = total
            key = (total, -c, -k)
            if i not in best or key < best[i][0]:
                best[i] = (key, c, k, lv)
    out = []
    for i, rows in enumerate(rows_list):
        _, c, k, lv = best[i]
        mask, bitval = mask_at(lv, majorities[i], RowGeometry(rows.shape[1], c), k)
        out.append(FitResult(c, grid[k] / 100.0, mask, bitval, rows.shape[0], scores[i]))
    return out
