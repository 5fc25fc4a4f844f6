"""Non-contiguous feature tensors (a column slice, a transpose) are accepted where stores are built: copied once
with ``.contiguous()`` and stored bit-exactly. ``out=`` tensors must stay contiguous (no hidden copy-back)."""

from __future__ import annotations

import pytest
import torch


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(t.shape[0], -1).view(torch.uint8)


@pytest.fixture(scope="module", params=["sliced", "transposed"])
def strided(request: pytest.FixtureRequest, cora) -> torch.Tensor:
    """Real Cora rows seen through a view that is not contiguous."""
    x = cora.features[:600]
    view = x[:, 100:900] if request.param == "sliced" else x[:, :400].t()  # [600, 800] or [400, 600]
    assert not view.is_contiguous()
    return view


def test_codec_fit_and_compress_accept_strided_rows(strided: torch.Tensor) -> None:
    from ibpcache import Codec

    codec = Codec.fit(strided)
    assert codec.row_shape == tuple(strided.shape[1:])
    assert codec.same_tables(Codec.fit(strided.contiguous()))
    sampled = Codec.fit(strided, sample=0.5)
    assert sampled.same_tables(Codec.fit(strided.contiguous(), sample=0.5))  # same rows sampled
    for layout in ("inplace", "packed"):
        packed = codec.compress(strided, layout=layout)
        assert torch.equal(_u8(packed.decompress()), _u8(strided))
    assert torch.equal(codec.stored_lengths(strided), codec.stored_lengths(strided.contiguous()))


@pytest.mark.parametrize("policy", ["static", "lru"])
def test_feature_cache_and_host_store_accept_strided_rows(strided: torch.Tensor, policy: str) -> None:
    from ibpcache import FeatureCache

    fc = FeatureCache(strided, budget_bytes=0.1, policy=policy, device="cpu", codec="auto")
    ids = torch.randint(0, strided.shape[0], (3000,), generator=torch.Generator().manual_seed(1))
    for batch in ids.split(500):
        assert torch.equal(_u8(fc.fetch(batch)), _u8(strided)[batch])
    strided_ids = ids[::3]  # ids may be non-contiguous too
    assert not strided_ids.is_contiguous()
    assert torch.equal(_u8(fc.fetch(strided_ids)), _u8(strided)[strided_ids])


def test_host_store_accepts_strided_rows(strided: torch.Tensor) -> None:
    from ibpcache import Codec
    from ibpcache.cache.host_store import HostStore

    store = HostStore(strided, codec=Codec.fit(strided), compress=True, device=torch.device("cpu"))
    ids = torch.arange(strided.shape[0])
    assert torch.equal(store.raw_rows(ids).reshape(len(ids), -1), _u8(strided))


def test_compressed_rows_accept_strided_data(strided: torch.Tensor) -> None:
    from ibpcache import Codec, CompressedRows

    codec = Codec.fit(strided)
    packed = codec.compress(strided, layout="packed")
    spread = torch.zeros(packed.data.numel() * 2, dtype=torch.uint8)
    spread[::2] = packed.data
    again = CompressedRows(codec, spread[::2], packed.lengths, layout="packed")
    assert again.data.is_contiguous()
    assert torch.equal(_u8(again.decompress()), _u8(strided))


def test_strided_out_is_refused_with_the_reason(cora) -> None:
    from ibpcache import Codec

    x = cora.features[:64]
    packed = Codec.fit(x).compress(x)
    out = torch.empty(x.shape[1], 8).t()
    with pytest.raises(ValueError, match="contiguous.*hidden full copy"):
        packed.gather(torch.arange(8), device="cpu", out=out)
