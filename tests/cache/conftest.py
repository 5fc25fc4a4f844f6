"""Fixtures of the cache tests: real rows (Cora, a MiniLM slice), codecs fitted once, access streams.

Fitting a codec costs about a second, so each data set's codec is fitted once per session and passed to every
cache; ``codec="auto"`` has its own test.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

MINILM_ROWS = 2048


@pytest.fixture(autouse=True)
def _release_shared_and_registered_memory() -> Iterator[None]:
    """After every cache test, pass or fail: close every shared-store handle it left (owners' segments are removed,
    attached stores' CUDA registrations dropped, so a failed test cannot leave page-locked mappings behind for
    later tests), then wait for the GPU, so an asynchronous CUDA error fails the test that caused it."""
    yield
    from ibpcache import _shm

    _shm.release()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@pytest.fixture(scope="session")
def cora_x(cora: Any) -> torch.Tensor:
    """Cora features, float32 [2708, 1433] (binary bag of words: ratio ~25x)."""
    return cora.features.contiguous()


@pytest.fixture(scope="session")
def cora_degrees(cora: Any) -> torch.Tensor:
    """Node degrees of Cora: the static policy's hotness score."""
    return torch.bincount(cora.src, minlength=cora.num_nodes).to(torch.float32)


@pytest.fixture(scope="session")
def cora_codec(cora_x: torch.Tensor) -> Any:
    from ibpcache import Codec

    return Codec.fit(cora_x)


@pytest.fixture(scope="session")
def minilm_x(minilm: torch.Tensor) -> torch.Tensor:
    """First rows of the MiniLM table, float32 [2048, 384] (dense trained floats: ratio ~1.13x)."""
    return minilm[:MINILM_ROWS].contiguous()


@pytest.fixture(scope="session")
def minilm_codec(minilm_x: torch.Tensor) -> Any:
    from ibpcache import Codec

    return Codec.fit(minilm_x)
