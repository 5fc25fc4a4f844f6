"""The host store: raw, in-place and packed layouts give the decoder the right offsets, lengths and flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ibpcache.cache.host_store import HostStore

CPU = torch.device("cpu")


def test_raw_store_needs_no_tables(cora_x) -> None:
    hs = HostStore(cora_x[:100], codec=None, compress=False, device=CPU)
    assert hs.packed is None and hs.ratio == 1.0 and hs.device_table_nbytes == 0
    offs, lens, comp = hs.cpu_descriptors(np.array([0, 7, 99]))
    assert offs.tolist() == [0, 7 * 5732, 99 * 5732] and lens.tolist() == [5732] * 3 and comp.tolist() == [0] * 3
    args = hs.host_args()
    assert args.offsets is None and args.lengths is None and args.flags is None and args.stride == 5732
    assert torch.equal(hs.raw_rows(torch.tensor([3, 1])), cora_x[[3, 1]].view(torch.uint8))


@pytest.mark.parametrize("layout", ["inplace", "packed"])
def test_compressed_store_tables(cora_x, cora_codec, layout) -> None:
    rows = cora_x[:100]
    hs = HostStore(rows, codec=cora_codec, compress=True, device=CPU, layout=layout)
    packed = hs.packed
    assert packed is not None and hs.ratio > 10 and hs.stored_nbytes == packed.nbytes
    ids = np.array([5, 0, 99, 5])
    offs, lens, comp = hs.cpu_descriptors(ids)
    assert offs.tolist() == packed.offsets[ids].tolist()
    assert lens.tolist() == packed.lengths[ids].tolist()
    assert comp.tolist() == (packed.lengths[ids] < 5732).to(torch.uint8).tolist()
    assert (hs.host_args().offsets is None) == (layout == "inplace")
    assert torch.equal(hs.raw_rows(torch.tensor(ids)), rows[ids].view(torch.uint8))


def test_compressed_rows_input_and_codec_mismatch(cora_x, cora_codec, minilm_codec) -> None:
    packed = cora_codec.compress(cora_x[:50], layout="packed")
    hs = HostStore(packed, codec=None, compress=True, device=CPU)
    assert hs.packed is packed and hs.codec is cora_codec
    raw = HostStore(packed, codec=cora_codec, compress=False, device=CPU)
    assert raw.packed is None and torch.equal(raw.data, cora_x[:50].reshape(-1).view(torch.uint8))
    with pytest.raises(ValueError, match="codec differs"):
        HostStore(packed, codec=minilm_codec, compress=True, device=CPU)
    with pytest.raises(ValueError, match="needs a codec"):
        HostStore(cora_x[:5], codec=None, compress=True, device=CPU)
