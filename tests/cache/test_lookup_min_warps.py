"""lookup.cu's IBP_MIN_WARPS: the IBP and raw kinds' lookup kernels built to fit more resident warps (the variant
``scripts/experiments/exp_lookup_profile.py --variants r24`` times) read the same rows and pool the same bags as the
defaults, from host memory and from the GPU cache. GPU only: the variant changes launch bounds, not the CPU path."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [24, 32])
def test_gpu_min_warps_variant_reads_and_pools_the_same_bytes(cora: Any, minilm: torch.Tensor, warps: int) -> None:
    from ibpcache import FeatureCache
    from ibpcache.kernels._build import extra_kernel_options
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    gen = torch.Generator().manual_seed(warps)
    for rows, compress in ((cora.features[:2000].contiguous(), True), (minilm[:2000, :128].contiguous(), False)):
        ids = torch.randint(0, 2000, (4000,), generator=gen)
        bags = ids.view(-1, 4).cuda()
        with extra_kernel_options(f"-DIBP_MIN_WARPS={warps}"):
            fc = FeatureCache(rows, 0.05, device="cuda", compress_host=compress, compress_cache=compress)
            fetched = [fc.fetch(ids.cuda()).cpu() for _ in range(2)]  # host misses first, then cache hits too
            bag = CachedEmbeddingBag(2000, rows.shape[1], _weight=rows.clone(), mode="sum", cache_ratio=0.05,
                                     device="cuda", compress=compress)
            bag.eval()
            with torch.no_grad():
                pooled = [bag(bags).cpu() for _ in range(2)]
        for got in fetched:
            assert torch.equal(got.view(torch.uint8), rows[ids].view(torch.uint8))
        ref = torch.nn.functional.embedding_bag(bags, rows.cuda(), mode="sum").cpu()
        for got in pooled:
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
        fc.check_errors()
        bag.check_errors()
