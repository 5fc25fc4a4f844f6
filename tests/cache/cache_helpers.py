"""Helpers shared by the cache tests (id streams and bit-exact comparison)."""

from __future__ import annotations

import torch

__all__ = ["zipf", "uniform", "id_batches", "assert_same_rows"]


def zipf(n_rows: int, n: int, seed: int) -> torch.Tensor:
    """Skewed ids (Zipf a=1.05, as in the benchmark), duplicates included."""
    from ibpcache.datasets import zipf_ids

    return zipf_ids(n_rows, n, a=1.05, seed=seed)


def uniform(n_rows: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_rows, (n,), generator=gen)


def id_batches(n_rows: int, seed: int = 0) -> list[torch.Tensor]:
    """A mix of batches: skewed, uniform, all ids reversed, one id repeated, a single id."""
    return [
        zipf(n_rows, 1500, seed),
        uniform(n_rows, 1000, seed + 1),
        torch.arange(n_rows - 1, -1, -1),
        torch.full((64,), n_rows // 2, dtype=torch.int64),
        zipf(n_rows, 1500, seed + 2),
        torch.tensor([n_rows - 1]),
    ]


def assert_same_rows(got: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> None:
    """Bit-exact equality with ``rows[ids]`` (dtype, shape and raw bytes)."""
    want = rows[ids.cpu()]
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    g = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    w = want.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(g, w), "fetched rows differ from rows[ids]"
