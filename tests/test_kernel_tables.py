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
    assert not tables.raw  # Cora's rows have invariant bits


def test_kernel_tables_of_raw_rows_say_so(minilm) -> None:
    """A raw codec's tables (and an IBP codec with no invariant bit) are marked raw: plain fetches then take the
    ROWS kernel with several rows per warp, which reads raw rows fastest."""
    from ibpcache import Codec, RawCodec

    assert RawCodec(torch.float32, (128,)).kernel_tables("cpu").raw
    noise = torch.randint(-2**31, 2**31 - 1, (64, 32), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    ibp = Codec.fit(noise.view(torch.float32), method="ibp")
    assert ibp.kernel_tables("cpu").raw == (not np.any(ibp.mask))
    assert not Codec.fit(minilm[:500, :128].contiguous(), method="ibp").kernel_tables("cpu").raw


def test_kernel_tables_reject_inconsistent_fields() -> None:
    from ibpcache.kernels.tables import KernelTables

    ok = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="mask"):
        KernelTables(mask=ok.to(torch.int32), bitval=ok, chunk_bytes=4, n_chunks=3, row_bytes=12)
    with pytest.raises(ValueError, match="chunk_bytes"):
        KernelTables(mask=ok, bitval=ok, chunk_bytes=3, n_chunks=3, row_bytes=9)
    with pytest.raises(ValueError, match="cannot hold"):
        KernelTables(mask=ok, bitval=ok, chunk_bytes=4, n_chunks=3, row_bytes=13)
