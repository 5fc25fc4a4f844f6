"""InfiniGen-style partial-key selection (ibpcache/cache/kv_select.py, kernels/kv_select.cu), without a model.

Data is real: SmolLM2-135M keys from the shared folder (``code_kv`` in tests/conftest.py) as partial keys and
queries. The adapter's mask translation around it is tested in tests/loaders/test_kv.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def test_selection_all_tokens_when_unconstrained(code_kv: Any) -> None:
    from ibpcache.cache.kv_select import PartialKeySelector, SelectionConfig

    k, _ = code_kv("fp32")
    keys = k[:, :, :100]
    sel = PartialKeySelector(1, 9, 3, 64, SelectionConfig(alpha=float("inf"), max_num_kv=10_000))
    query = torch.randn(2, 9, 100, 64, generator=torch.Generator().manual_seed(1))
    sel.prefill(0, query, keys)
    assert sel.rank == 13  # 20% of 64 dims
    idx = sel.select(0, query[:, :, -1:])
    assert torch.equal(idx, torch.arange(100).expand(2, 3, 100))
    sel.append_keys(0, k[:, :, 100:101])
    assert sel.seq_length(0) == 101
    assert sel.select(0, query[:, :, -1:]).shape == (2, 3, 101)


def test_top_k_ascending_tie_rule() -> None:
    """Ties at the k-th score go to the lowest indices; NaN ranks highest; -0.0 equals 0.0; output ascending."""
    from ibpcache.cache.kv_select import top_k_ascending

    nan, inf = float("nan"), float("inf")
    s = torch.tensor([[1.0, nan, 3.0, -0.0, 0.0, 3.0, -inf, nan, 3.0]])
    assert top_k_ascending(s, 1).tolist() == [[1]]
    assert top_k_ascending(s, 3).tolist() == [[1, 2, 7]]
    assert top_k_ascending(s, 4).tolist() == [[1, 2, 5, 7]]
    assert top_k_ascending(s, 7).tolist() == [[0, 1, 2, 3, 5, 7, 8]]  # -0.0 (index 3) before 0.0 (index 4)
    assert top_k_ascending(s, 0).shape == (1, 0)


def test_selection_config_checks() -> None:
    from ibpcache.cache.kv_select import SelectionConfig

    with pytest.raises(ValueError, match="alpha"):
        SelectionConfig(alpha=0)
    with pytest.raises(ValueError, match="partial_ratio"):
        SelectionConfig(partial_ratio=1.5)
    with pytest.raises(ValueError, match="max_num_kv"):
        SelectionConfig(max_num_kv=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_gpu_partial_scores_kernel_matches_float64(code_kv: Any, dtype: str) -> None:
    """The scoring kernel over several token tiles: scores equal a float64 evaluation (padding scores -inf), and
    reading the token count from the device (a graph's way) gives the same scores in a wider buffer."""
    from ibpcache.kernels.kv_select import partial_scores

    keys = code_kv(dtype, 3)[0].cuda()  # real keys [2, 3, 400, 64] as the partial key source
    queries = code_kv(dtype, 5)[0][:, :, :3].cuda().reshape(2, 9, 1, 64)  # real vectors of another layer
    r, n, cap = 13, 2500, 3072  # 2500 tokens: three 1024-token tiles, the last one partial
    dims = torch.topk(keys.abs().float().mean(dim=(0, 2)), r, dim=-1).indices.sort(dim=-1).values  # [3, r]
    q_dims = dims.repeat_interleave(3, dim=0).contiguous()
    cols = keys.gather(-1, dims.view(1, 3, 1, r).expand(2, 3, 400, r)).repeat(1, 1, 7, 1)[:, :, :n]
    store = torch.zeros((2, 3, cap, r), dtype=keys.dtype, device="cuda")
    store[:, :, :n] = cols
    valid = torch.ones(2, n, dtype=torch.bool, device="cuda")
    valid[1, 2200:] = False  # padding of the second sequence
    scores = partial_scores(queries, q_dims, store, n, 0.125, valid)
    qp = queries[:, :, 0, :].double().gather(-1, q_dims[None].expand(2, -1, -1)).view(2, 3, 3, r) * 0.125
    ref = torch.einsum("bhgr,bhtr->bhgt", qp, store[:, :, :n].double()).amax(dim=2)
    ref = ref.masked_fill(~valid[:, None, :], float("-inf"))
    assert torch.equal(torch.isinf(scores), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert torch.allclose(scores.double()[fin], ref[fin], rtol=1e-5, atol=1e-4)
    wide = torch.full((2, 3, cap), 7.0, device="cuda")
    n_dev = torch.tensor([n], dtype=torch.int64, device="cuda")
    padded = torch.zeros(2, cap, dtype=torch.bool, device="cuda")
    padded[:, :n] = valid
    partial_scores(queries, q_dims, store, cap, 0.125, padded, n_dev=n_dev, out=wide)
    assert torch.equal(wide[:, :, :n], scores), "device token count: same bits"
    assert bool((wide[:, :, n:] == 7.0).all()), "nothing written past the device token count"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["real", "ties", "special", "short"])
def test_gpu_select_top_matches_cpu_reference(code_kv: Any, case: str) -> None:
    """The selection kernel returns exactly top_k_ascending's indices (ties to the lowest index, NaN highest,
    -0.0 == 0.0) and exact critical counts, for every k, also with the row length read on the device."""
    from ibpcache.kernels.kv_select import select_top
    from ibpcache.cache.kv_select import critical_counts, top_k_ascending

    keys = code_kv("fp32", 3)[0]  # [2, 3, 400, 64] real keys: their dot products with a real query are the scores
    q = code_kv("fp32", 5)[0][:, :, -1:]  # [2, 3, 1, 64]
    scores = (keys @ q.transpose(-1, -2)).squeeze(-1) / 8.0  # [2, 3, 400]
    if case == "ties":  # rounded to whole numbers: long runs of equal scores around every k
        scores = scores.round()
    elif case == "special":
        scores = scores.round()
        scores[0, 0, 5::37] = float("nan")
        scores[0, 1, ::3] = -0.0
        scores[0, 1, 1::3] = 0.0
        scores[1, 2, :] = float("-inf")
        scores[1, 0, 100:] = float("-inf")
    elif case == "short":
        scores = scores[:, :, :37]
    n = scores.shape[-1]
    gpu = scores.cuda()
    for k in sorted({k for k in (0, 1, 2, 7, 64, 399, n) if k <= n}):
        idx, counts = select_top(gpu, k, 4.0)
        assert torch.equal(idx.cpu(), top_k_ascending(scores, k)), f"k={k}"
        assert torch.equal(counts.cpu().long(), critical_counts(scores, 4.0))
    wide = torch.full((2, 3, n + 50), float("inf"), device="cuda")  # past the device count: never read
    wide[:, :, :n] = gpu
    n_dev = torch.tensor([n], dtype=torch.int64, device="cuda")
    k = min(7, n)
    idx, _ = select_top(wide, k, 4.0, n_dev=n_dev)
    assert torch.equal(idx.cpu(), top_k_ascending(scores, k))
