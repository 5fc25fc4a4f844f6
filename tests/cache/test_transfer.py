"""The engine's transfer paths (``host_store.Transfer``) and the transfer planner.

CPU: the planner's rule with injected timings, argument checks, and the host store's write-back + read on every
path a CPU store has. GPU: every path reads the same bytes (zero-copy, cpu-gather of stored bytes, host decode),
FeatureCache's cpu-gather fetch equals the zero-copy lookup (rows and counters) for every compress combination and
from several threads on their own streams, write-back then read through each path, and the planner's timed choice.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_helpers import zipf

from ibpcache.cache.host_store import FitOptions, HostStore, Transfer
from ibpcache.cache.plan_transfer import decide_transfer

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
COMBOS = [(False, False), (False, True), (True, False), (True, True)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


# ---- CPU ---------------------------------------------------------------------------------------


def test_decide_transfer_keeps_zero_copy_unless_clearly_slower() -> None:
    assert decide_transfer({"zero_copy": 1.0, "cpu_gather": 0.99}).transfer == "zero_copy"  # within the margin
    got = decide_transfer({"zero_copy": 1.0, "cpu_gather": 0.5})
    assert got.transfer == "cpu_gather" and "2.00x" in got.reason and got.timings_ms["zero_copy"] == 1.0
    assert decide_transfer({"zero_copy": 0.4, "cpu_gather": 0.5}).transfer == "zero_copy"
    assert decide_transfer({}).transfer == "zero_copy"  # nothing timed: the sync-free default


def test_transfer_names_are_checked() -> None:
    assert Transfer.coerce("host_gather") is Transfer.HOST_GATHER
    with pytest.raises(ValueError, match="fetch must be one of"):
        Transfer.coerce("dma", "fetch")
    with pytest.raises(ValueError, match="transfer must be one of"):
        HostStore(torch.zeros(4, 4), compress=False, device=CPU, transfer="dma")


def test_cpu_store_writes_back_and_reads_exactly(minilm_x: torch.Tensor) -> None:
    """One store, the embedding bags' write-back: re-encoded rows (some no longer compressible) read back exact,
    the caller's tensor untouched, lengths and the compressed share follow the writes."""
    table = minilm_x[:300].clone()
    keep = table.clone()
    store = HostStore(table, codec=FitOptions(), compress=True, device=CPU)
    before = store.compressed_fraction()
    new = table[:20] * 3.0
    new[0, 0] = float("nan")
    ids = torch.arange(0, 40, 2)
    store.write_rows(ids, new.view(torch.uint8))
    want = keep.clone()
    want[ids] = new
    assert torch.equal(_bits(store.dense()), _bits(want)) and torch.equal(_bits(table), _bits(keep))
    out = torch.empty((5, store.row_bytes), dtype=torch.uint8)
    store.read_into(torch.tensor([2, 0, 299, 2, 7]), out)
    assert torch.equal(out, _bits(want[[2, 0, 299, 2, 7]]).reshape(5, -1))
    assert store.compressed_fraction() <= before and store.stats()["rows_written_back"] == 20


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("layout", ["inplace", "packed"])
def test_every_transfer_reads_the_same_bytes(cora_x: torch.Tensor, cora_codec: Any, compress: bool,
                                             layout: str) -> None:
    store = HostStore(cora_x, codec=cora_codec, compress=compress, device=CUDA, layout=layout,
                      transfer="zero_copy")
    ids = zipf(cora_x.shape[0], 3000, seed=3)
    want = _bits(cora_x[ids]).reshape(ids.numel(), -1)
    for path in Transfer:
        store.transfer = path
        out = torch.full((ids.numel() + 5, store.row_bytes), 0xAB, dtype=torch.uint8, device=CUDA)
        rows = torch.randperm(ids.numel() + 5, device=CUDA)[: ids.numel()]
        store.read_into(ids.to(CUDA) if path is Transfer.ZERO_COPY else ids, out, rows)
        assert torch.equal(out[rows].cpu(), want), path
        assert bool((out[torch.ones(ids.numel() + 5, dtype=torch.bool, device=CUDA).index_fill_(0, rows, False)]
                     == 0xAB).all()), path  # nothing else written


@pytest.mark.gpu
@pytest.mark.parametrize("transfer", ["zero_copy", "cpu_gather", "host_gather"])
def test_gpu_write_back_then_read_on_every_path(minilm_x: torch.Tensor, transfer: str) -> None:
    """Rows are written back by a GPU encode whatever the read path; host-side paths then see the new bytes."""
    table = minilm_x[:500].clone()
    store = HostStore(table, codec=FitOptions(), compress=True, device=CUDA, transfer=transfer)
    new = (table[:64] * -2.5).contiguous()
    new[3, 7] = float("inf")
    ids = torch.arange(100, 164)
    store.write_rows(ids.to(CUDA), new.view(torch.uint8).to(CUDA))
    want = table.clone()
    want[ids] = new
    probe = torch.cat([ids, torch.tensor([0, 499, 100])])
    out = torch.empty((probe.numel(), store.row_bytes), dtype=torch.uint8, device=CUDA)
    store.read_into(probe.to(CUDA) if transfer == "zero_copy" else probe, out)
    assert torch.equal(out.cpu(), _bits(want[probe]).reshape(probe.numel(), -1))
    assert torch.equal(_bits(store.dense()), _bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("combo", COMBOS)
def test_feature_cache_cpu_gather_equals_zero_copy(cora_x: torch.Tensor, cora_codec: Any, cora_degrees: torch.Tensor,
                                                   combo: tuple[bool, bool]) -> None:
    """CPU ids through the cpu-gather fetch: the same rows and the same hit/miss/byte counters as the one-launch
    zero-copy lookup of the same ids, and no device sync on the way (sync debug mode)."""
    from ibpcache.cache.feature_cache import FeatureCache

    cc, ch = combo
    kw = dict(budget_bytes=0.05, hotness=cora_degrees, device="cuda", codec=cora_codec if (cc or ch) else None,
              compress_cache=cc, compress_host=ch)
    zc = FeatureCache(cora_x, transfer="zero_copy", **kw)
    cg = FeatureCache(cora_x, transfer="cpu_gather", **kw)
    assert cg.stats()["transfer"]["transfer"] == "cpu_gather"
    for seed in range(4):
        ids = zipf(cora_x.shape[0], 2500 + seed, seed=seed)
        a = zc.fetch(ids.to(CUDA))
        torch.cuda.set_sync_debug_mode("error")
        try:
            b = cg.fetch(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(_bits(b), _bits(cora_x[ids])) and torch.equal(_bits(a), _bits(b))
    sa, sb = zc.stats(), cg.stats()
    for key in ("requests", "hits", "misses", "host_bytes_read"):
        assert sa[key] == sb[key], key
    assert sb["fetch_paths"]["cpu_gather"] == 4 and sb["fetch_paths"]["zero_copy"] == 0
    with pytest.raises(Exception, match="out of range"):
        cg.fetch(torch.tensor([0, cora_x.shape[0]]))
    assert torch.equal(_bits(cg.fetch(torch.tensor([], dtype=torch.int64))), _bits(cora_x[:0]))


@pytest.mark.gpu
def test_feature_cache_cpu_gather_from_threads_on_streams(cora_x: torch.Tensor, cora_codec: Any) -> None:
    from cache_helpers import fetch_from_threads

    from ibpcache.cache.feature_cache import FeatureCache

    fc = FeatureCache(cora_x, 0.02, device="cuda", codec=cora_codec, transfer="cpu_gather")
    assert fetch_from_threads(fc, cora_x, n_fetches=25, batch=1500, streams=True, cpu_ids=True) == []
    assert fc.stats()["fetch_paths"]["cpu_gather"] == 100


@pytest.mark.gpu
def test_planner_times_both_paths_on_the_store(minilm_x: torch.Tensor) -> None:
    store = HostStore(minilm_x, codec=FitOptions(), compress=True, device=CUDA, transfer="auto")
    choice = store.stats()["transfer"]
    assert set(choice["timings_ms"]) == {"zero_copy", "cpu_gather"} and choice["transfer"] in choice["timings_ms"]
    assert store.transfer.value == choice["transfer"] and store.rows_read == 0  # calibration left no counts


@pytest.mark.gpu
@pytest.mark.parametrize("fetch", ["cpu_gather", "host_gather"])
def test_embedding_bag_trains_exactly_over_host_paths(minilm_x: torch.Tensor, fetch: str) -> None:
    """Training with cache fills through a host-side path and GPU write-back: weights equal nn.EmbeddingBag's."""
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    w = minilm_x[:1000, :64].contiguous()
    m = CachedEmbeddingBag(1000, 64, _weight=w, mode="sum", cache_ratio=0.05, device="cuda", fetch=fetch)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone().cuda(), freeze=False, mode="sum")
    opt, ropt = torch.optim.SGD(m.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        ids = torch.randint(0, 1000, (64, 3), generator=gen).cuda()
        for mod, o in ((m, opt), (ref, ropt)):
            o.zero_grad()
            mod(ids).square().sum().backward()
            o.step()
    m.flush()
    assert torch.equal(_bits(m.weight), _bits(ref.weight))
    assert m.stats()["fetch_path"] == fetch and m.stats()["write_backs"] > 0


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("layout", ["inplace", "packed"])
def test_stage_builds_descriptors_and_packs_stored_bytes(cora_x: torch.Tensor, cora_codec: Any, compress: bool,
                                                         layout: str) -> None:
    """The cpu-gather host half on a CPU store (its "device" buffer is host memory here): hits point at the cache
    mirror's addresses, every other row is staged as STORED bytes back to back, and decoding the descriptors gives
    the rows; the counters add up."""
    import numpy as np

    from ibpcache.cache.host_store import CacheMirror

    store = HostStore(cora_x, codec=cora_codec, compress=compress, device=CPU, layout=layout)
    ids = zipf(cora_x.shape[0], 700, seed=5).numpy()
    cached = np.array([ids[0], ids[3], 17], dtype=np.int64)  # a pretend cache of three rows
    pos = np.full(cora_x.shape[0], -1, np.int32)
    pos[cached] = np.arange(3, dtype=np.int32)
    slab_src = np.array([1 << 40, (1 << 40) + 9000, (1 << 40) + 20000], np.int64)
    slab_len = np.array([100, 5732, 64], np.int32)
    st = store.stage(ids, CacheMirror(pos, slab_src, slab_len))
    hit = pos[ids] >= 0
    src, lens, comp = st.src.numpy(), st.lengths.numpy(), st.compressed.numpy()
    assert (src[hit] == slab_src[pos[ids[hit]]]).all() and (lens[hit] == slab_len[pos[ids[hit]]]).all()
    _, want_len, _ = store.cpu_descriptors(ids[~hit])
    assert (lens[~hit] == want_len).all() and (comp == (lens < store.row_bytes)).all()
    staged = torch.from_numpy(np.ascontiguousarray(src[~hit]))
    assert bool((staged[1:] - staged[:-1] == torch.from_numpy(lens[~hit][:-1]).to(torch.int64)).all())  # packed
    raw = torch.empty((int((~hit).sum()), store.row_bytes), dtype=torch.uint8)
    whole = st.src.untyped_storage()  # staged rows live in the same buffer as the descriptors
    flat = torch.empty(0, dtype=torch.uint8).set_(whole, 0, (whole.nbytes(),))
    store.codec.decode_rows_at(flat.numpy(), src[~hit] - flat.data_ptr(), lens[~hit], raw.numpy(),
                               np.arange(raw.shape[0], dtype=np.int64), compressed=comp[~hit])
    assert torch.equal(raw, cora_x[torch.from_numpy(ids[~hit])].view(torch.uint8).reshape(raw.shape[0], -1))
    assert st.counters.tolist() == [700, int(hit.sum()), int(lens[~hit].sum()), int(lens[hit].sum())]


def test_layout_planner_keeps_raw_rows_when_the_cpu_gather_wins() -> None:
    from ibpcache.cache.plan_layout import LayoutChoice, prefer_host_gather

    compressed = LayoutChoice(True, "compressed misses 1.10x faster than raw", 1.15, 1.0, 1.1, 8192)
    got = prefer_host_gather(compressed, host_gather_ms=0.4, compressed_wall_ms=1.0)
    assert not got.compress and "2.50x" in got.reason and got.host_gather_ms == 0.4
    kept = prefer_host_gather(compressed, host_gather_ms=0.99, compressed_wall_ms=1.0)  # within the margin
    assert kept.compress and kept.compressed_wall_ms == 1.0
    raw = LayoutChoice(False, "compressed misses only 0.90x of raw", 1.15, 1.1, 1.0, 8192)
    assert not prefer_host_gather(raw, 5.0, 1.0).compress  # a raw choice stands
    assert prefer_host_gather(compressed, None, None).compress  # nothing timed (CPU)


@pytest.mark.gpu
def test_feature_cache_host_gather_serves_every_id_from_host(minilm_x: torch.Tensor) -> None:
    from ibpcache.cache.feature_cache import FeatureCache

    rows = minilm_x[:, :8].contiguous()  # 32-byte rows
    fc = FeatureCache(rows, 0.05, device="cuda", compress_cache=False, compress_host=False, transfer="host_gather")
    ids = zipf(rows.shape[0], 3000, seed=9)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fc.fetch(ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(_bits(got), _bits(rows[ids]))
    st = fc.stats()
    assert st["fetch_paths"]["host_gather"] == 1 and st["requests"] == 3000 and st["hits"] == 0
    auto = FeatureCache(rows, 0.05, device="cuda", compress_cache=False, compress_host=False)
    assert set(auto.stats()["transfer"]["timings_ms"]) == {"zero_copy", "cpu_gather", "host_gather"}
    assert torch.equal(_bits(auto.fetch(ids)), _bits(rows[ids]))


def test_writable_store_never_writes_into_the_callers_rows(minilm_x: torch.Tensor) -> None:
    """A raw store copies the caller's rows unless asked to share them (FeatureCache, which never writes)."""
    rows = minilm_x[:50].clone()
    keep = rows.clone()
    store = HostStore(rows, compress=False, device=CPU)
    store.write_rows(torch.tensor([1, 2]), torch.zeros((2, store.row_bytes), dtype=torch.uint8))
    assert torch.equal(rows, keep) and bool((store.dense()[1:3] == 0).all())
    shared = HostStore(rows, compress=False, device=CPU, share_rows=True)
    assert shared.data.data_ptr() == rows.data_ptr()
