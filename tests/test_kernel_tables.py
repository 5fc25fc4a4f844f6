"""``Codec.kernel_tables``: the plain record the launchers take instead of a codec (kernels never import codec)."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def test_kernel_tables_match_the_codec_and_are_cached(cora) -> None:
    from ibpcache import Codec
    from ibpcache.kernels.tables import KernelTables

    codec = Codec.fit(cora.features[:300])
    tables = codec.kernel_tables("cpu")
    assert isinstance(tables, KernelTables)
    assert (tables.chunk_bytes, tables.n_chunks, tables.row_bytes) == (codec.chunk_bytes, codec.n_chunks,
                                                                         codec.row_bytes)
    assert np.array_equal(tables.mask.numpy().view(np.uint64), codec.mask)
    assert np.array_equal(tables.bitval.numpy().view(np.uint64), codec.bitval)
    assert codec.kernel_tables(torch.device("cpu")) is tables  # built once per device


def test_kernel_tables_reject_inconsistent_fields() -> None:
    from ibpcache.kernels.tables import KernelTables

    ok = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="mask"):
        KernelTables(mask=ok.to(torch.int32), bitval=ok, chunk_bytes=4, n_chunks=3, row_bytes=12)
    with pytest.raises(ValueError, match="chunk_bytes"):
        KernelTables(mask=ok, bitval=ok, chunk_bytes=3, n_chunks=3, row_bytes=9)
    with pytest.raises(ValueError, match="cannot hold"):
        KernelTables(mask=ok, bitval=ok, chunk_bytes=4, n_chunks=3, row_bytes=13)
