"""``prefetch(next_input)`` on the cached embedding bags (FBGEMM TBE's prefetch): the next forward with those ids
finds every row cached, outputs stay bit-exact, training with prefetch equals ``torch.nn.EmbeddingBag``, bad
ids raise before the cache changes, and a prefetch between a forward and its backward is refused.

Real MiniLM rows (so the host store really is compressed). CPU in CI; the GPU variants run the fused inference
path, prefetch from a non-default stream, and training with 2 KB rows and a cache that grows and shrinks.
"""

from __future__ import annotations

import pytest
import torch

from ibpcache.errors import InvalidIdsError

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SIZES = [300, 200, 500]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _single(minilm: torch.Tensor, device: str, **kw):
    """1000 rows, a 300-row cache: every test batch fits (a batch with more distinct rows than the cache holds
    is served from a temporarily grown cache and cannot stay prefetched)."""
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    w = minilm[1000:2000, :64].clone()
    return w, CachedEmbeddingBag(w.shape[0], 64, _weight=w.clone(), mode="sum", cache_ratio=0.3, warmup_ratio=0.0,
                                 device=device, compress=True, **kw)


def _misses(m) -> int:
    st = m.stats()
    if "fused_lookups" in st:
        return int(st["fused_lookups"] - st["fused_hits"])
    return int(st["misses"])


@pytest.mark.parametrize("device", DEVICES)
def test_prefetched_rows_hit(minilm: torch.Tensor, device: str) -> None:
    w, m = _single(minilm, device)
    m.eval()
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, w.shape[0], (40, 2), generator=gen)
        m.prefetch(ids.to(device))
        before = _misses(m)
        with torch.no_grad():
            got = m(ids.to(device))
        assert _misses(m) == before, "a prefetched batch still missed"
        want = torch.nn.functional.embedding_bag(ids, w, mode="sum")
        assert torch.equal(_bits(got), _bits(want))
    assert m.stats()["prefetched_rows"] > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_offsets", [False, True])
def test_table_batched_prefetch(minilm: torch.Tensor, device: str, with_offsets: bool) -> None:
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    tables = minilm[:sum(SIZES), :32].clone()
    m = TableBatchedCachedEmbeddingBag(SIZES, 32, _weight=tables, mode="sum", cache_ratio=0.1, warmup_ratio=0.0,
                                       device=device, compress=True)
    m.eval()
    gen = torch.Generator().manual_seed(1)
    batch = 24
    local = torch.stack([torch.randint(0, n, (batch,), generator=gen) for n in SIZES], 1)  # [B, T]
    if with_offsets:  # table-major bags of one id, offsets with the total at the end
        inp, offs = local.t().reshape(-1), torch.arange(0, local.numel() + 1)
        m.include_last_offset = True
        args = (inp.to(device), offs.to(device))
    else:
        args = (local.to(device),)
    m.prefetch(*args)
    before = _misses(m)
    with torch.no_grad():
        got = m(*args)
    assert _misses(m) == before
    starts = torch.tensor([0] + SIZES[:-1]).cumsum(0)
    want = torch.nn.functional.embedding_bag((local + starts).reshape(-1, 1), tables, mode="sum").reshape(batch, -1)
    assert torch.equal(_bits(got), _bits(want))


def test_bad_ids_raise_before_the_cache_changes(minilm: torch.Tensor) -> None:
    w, m = _single(minilm, "cpu")
    cached = m.stats()["cached_rows"]
    with pytest.raises(InvalidIdsError, match="not in the valid range"):
        m.prefetch(torch.tensor([[1, 2], [3, w.shape[0]]]))
    assert m.stats()["cached_rows"] == cached and m.stats()["prefetched_rows"] == 0


def test_prefetch_between_forward_and_backward_is_refused(minilm: torch.Tensor) -> None:
    w, m = _single(minilm, "cpu")
    ids = torch.randint(0, w.shape[0], (8, 3))
    out = m(ids)
    with pytest.raises(RuntimeError, match="between a training forward and its backward"):
        m.prefetch(ids)
    out.sum().backward()
    with pytest.raises(RuntimeError, match="hold a gradient"):
        m.prefetch(ids)
    m.zero_grad()
    m.prefetch(ids)  # after backward and zero_grad: fine


@pytest.mark.parametrize("device", DEVICES)
def test_training_with_prefetch_matches_torch(minilm: torch.Tensor, device: str) -> None:
    """SGD with prefetch of the next batch after each step: the trained table equals nn.EmbeddingBag's."""
    w, m = _single(minilm, device, sparse=False)
    ref = torch.nn.EmbeddingBag(w.shape[0], 64, _weight=w.clone().to(device), mode="sum")
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    # GPU: no repeated id within a batch (CUDA's embedding_bag backward accumulates duplicates with atomics)
    batches = [torch.randperm(w.shape[0], generator=gen)[:60].view(20, 3) for _ in range(8)]
    m.prefetch(batches[0].to(device))
    for i, ids in enumerate(batches):
        before = _misses(m)
        for mod, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad()
            out = mod(ids.to(device))
            out.pow(2).sum().backward()
            o.step()
        assert _misses(m) == before
        if i + 1 < len(batches):
            opt.zero_grad()
            m.prefetch(batches[i + 1].to(device))
    m.flush()
    assert torch.equal(_bits(m.weight), _bits(ref.weight))


def _unslotted(m, ids: torch.Tensor) -> int:
    """Distinct rows of ``ids`` whose stored (compressed) length exceeds the fused cache's slot: no slot holds them,
    so they are read from the host at every lookup, prefetched or not."""
    mgr = m.cache_weight_mgr
    slot_bytes = mgr.fused_lookup(m.stage_bytes, m.compress_cache).slot_bytes
    return int((mgr.store.stored_lengths()[ids.reshape(-1).unique().cpu()] > slot_bytes).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_between_batches_overlapping_dense_work_stays_exact(minilm: torch.Tensor, device: str) -> None:
    """Prefetch batch i+1 while batch i's dense work is queued: every output exact, every prefetched row that fits a
    slot hits (a prefetch admits what it is asked, whatever the frequency sketch says, once the cache is full too),
    from a caller on a non-default stream. CPU: the fused path through the admission kernels' twin."""
    w, m = _single(minilm, device)
    m.eval()
    m.fused_inference = True
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, w.shape[0], (64, 2), generator=gen) for _ in range(12)]
    dense = torch.randn(256 if device == "cpu" else 2048, 256 if device == "cpu" else 2048, device=device)
    outs, expected_misses, misses = [], [], []
    stream = torch.cuda.Stream() if device == "cuda" else None
    with torch.cuda.stream(stream), torch.no_grad():
        m.prefetch(batches[0].to(device, non_blocking=True))
        for i, ids in enumerate(batches):
            before = _misses(m)
            out = m(ids.to(device, non_blocking=True))
            if i + 1 < len(batches):
                m.prefetch(batches[i + 1].to(device, non_blocking=True))
            for _ in range(4):
                dense = torch.tanh(dense @ dense) * 0.01  # batch i's dense compute
            outs.append(out.clone())
            misses.append(_misses(m) - before)
            expected_misses.append(_unslotted(m, ids))
    if stream is not None:
        stream.synchronize()
    assert m.stats()["fused_lookups"] > 0  # the fused path ran
    assert misses == expected_misses
    assert sum(misses) < 0.01 * sum(b.numel() for b in batches)
    for ids, got in zip(batches, outs):
        want = torch.nn.functional.embedding_bag(ids.to(device), w.to(device), mode="sum")
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_and_forward_from_several_threads_and_streams(minilm: torch.Tensor, device: str) -> None:
    """Four threads share one module, each on its own CUDA stream (CPU: threads only), each prefetching its next
    batch and then looking it up, interleaved at random by the scheduler: every output is exact (the manager's
    StreamOrder serializes the admissions and orders the streams), whatever another thread evicted in between."""
    import threading

    w, m = _single(minilm, device)
    m.eval()
    w_dev = w.to(device)
    batches = {t: [torch.randint(0, w.shape[0], (48, 3), generator=torch.Generator().manual_seed(10 * t + i))
                   for i in range(8)] for t in range(4)}
    outs: dict[int, list[torch.Tensor]] = {t: [] for t in range(4)}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            stream = torch.cuda.Stream() if device == "cuda" else None
            with (torch.cuda.stream(stream) if stream is not None else _null()), torch.no_grad():
                for ids in batches[t]:
                    ids_dev = ids.to(device)
                    m.prefetch(ids_dev)
                    outs[t].append(m(ids_dev).clone())
            if stream is not None:
                stream.synchronize()
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for t in range(4):
        for ids, got in zip(batches[t], outs[t]):
            want = torch.nn.functional.embedding_bag(ids.to(device), w_dev, mode="sum")
            assert torch.equal(_bits(got), _bits(want))
    assert m.stats()["prefetched_rows"] > 0


def _null():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.gpu
def test_training_prefetch_with_2kb_rows_and_a_shrinking_cache(minilm: torch.Tensor) -> None:
    """Sparse SGD on 2 KB rows with oversized batches (the cache grows, then shrinks inside the next prefetch,
    resizing the sparse gradient): exact against nn.EmbeddingBag, and no illegal memory access."""
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    w = torch.cat([minilm[:3000], minilm[3000:6000, :128]], 1).contiguous()  # 3000 rows x 512 floats = 2 KB
    m = CachedEmbeddingBag(3000, 512, _weight=w.clone(), mode="sum", sparse=True, cache_ratio=0.01, device="cuda",
                           compress=True)
    ref = torch.nn.EmbeddingBag(3000, 512, _weight=w.clone().cuda(), mode="sum", sparse=True)
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(9)
    batches = [torch.randperm(3000, generator=gen)[:400].view(100, 4) for _ in range(6)]  # 400 rows > 30 cached
    m.prefetch(batches[0].cuda())
    for i, ids in enumerate(batches):
        for mod, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad()
            mod(ids.cuda()).sum().backward()
            o.step()
        if i + 1 < len(batches):
            opt.zero_grad()
            m.prefetch(batches[i + 1].cuda())
    m.flush()
    torch.cuda.synchronize()
    assert torch.equal(_bits(m.weight), _bits(ref.weight))


# ------------------------------------------------------------------------------------------------
# a prefetched training batch: its forward reuses the prefetch's slots (no unique, no host read)
# ------------------------------------------------------------------------------------------------


def _tb(minilm: torch.Tensor, device: str, tables: int, **kw):
    """``tables`` tables of 200 real rows, half of each cached: every test batch fits."""
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    w = minilm[:200 * tables, :64].clone()
    return w, TableBatchedCachedEmbeddingBag([200] * tables, 64, _weight=w.clone(), mode="sum", sparse=True,
                                             cache_ratio=0.5, warmup_ratio=0.0, device=device, compress=True, **kw)


def _tb_batch(gen: torch.Generator, tables: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """32 bags of 2 distinct ids per table (table-major), distinct across the batch."""
    ids = torch.cat([torch.randperm(200, generator=gen)[:64] for _ in range(tables)])
    return ids.to(device), torch.arange(0, ids.numel(), 2).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_prefetched_training_forward_reuses_the_prefetch(minilm: torch.Tensor, device: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward of the tensors a training prefetch saw takes their slots from it (prepare_unique is not called:
    no unique, no host read); tensors written in place since, or other tensors, are looked up again. Trained table
    bit-identical to nn.EmbeddingBag's throughout."""
    w, m = _tb(minilm, device, 3)
    ref = torch.nn.EmbeddingBag(w.shape[0], 64, _weight=w.clone().to(device), mode="sum", sparse=True)
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    mgr = m.cache_weight_mgr
    lookups: list[bool] = []
    prepare = mgr.prepare_unique

    def counting(*args, **kwargs):
        lookups.append(kwargs.get("count", True))
        return prepare(*args, **kwargs)

    monkeypatch.setattr(mgr, "prepare_unique", counting)
    gen = torch.Generator().manual_seed(8)
    batches = [_tb_batch(gen, 3, device) for _ in range(6)]
    for i, (ids, offs) in enumerate(batches):
        if i < 4:
            m.prefetch(ids, offs)
        if i == 3:
            ids.add_(0)  # written in place after the prefetch: its version moved, so it is looked up again
        lookups.clear()
        glob = ids + torch.arange(3, device=device).repeat_interleave(64) * 200
        for model, inp, o in ((m, ids, opt), (ref, glob, ref_opt)):
            model(inp, offs).pow(2).sum().backward()
            o.step()
            o.zero_grad()
        assert lookups == ([] if i < 3 else [True]), f"batch {i}"
    m.flush()
    assert torch.equal(_bits(m.weight), _bits(ref.weight))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_training_step_ops_do_not_grow_with_tables(minilm: torch.Tensor, optimizer: str) -> None:
    """A prefetched training step runs about as many torch ops for 20 tables as for 4: no per-table Python loop on its
    path (one op per table would add 16; a few ops differ where torch picks another kernel for larger tensors). SGD:
    forward, backward and step; Adagrad: the forward (its reduction over each id's rank; on the CPU the backward
    coalesces table by table, see RowGather)."""
    from torch.profiler import ProfilerActivity, profile

    def ops(tables: int) -> int:
        counts = []
        for m, opt, ids, offs in _prefetched_steps(minilm, optimizer, tables, "offsets", seed=5):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = m(ids, offs)
                if optimizer == "sgd":
                    out.sum().backward()
                    opt.step()
            if optimizer == "adagrad":
                out.sum().backward()
                opt.step()
            opt.zero_grad()
            counts.append(sum(1 for ev in prof.events() if ev.name.startswith("aten::")))
        return min(counts)

    few, many = ops(4), ops(20)
    assert many - few <= 8, (few, many)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["offsets", "2d"])
def test_prefetched_training_step_never_syncs(minilm: torch.Tensor, layout: str) -> None:
    """26 tables, sparse SGD: once a batch is prefetched (all its rows cached), its forward, backward and optimizer
    step never wait for the GPU (torch's sync debug mode raises on any synchronizing call)."""
    _, m = _tb(minilm, "cuda", 26)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(6)
    for step in range(4):
        ids, offs = _tb_batch(gen, 26, "cuda")
        if layout == "2d":
            ids, offs = ids.view(26, 64)[:, :32].t().contiguous(), None  # [B, T]
        m.prefetch(ids, offs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            m(ids, offs).pow(2).sum().backward()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        opt.zero_grad()
    assert m.stats()["misses"] == 0


def _audited_steps(minilm: torch.Tensor, optimizer: str, layout: str, tables: int = 26) -> list:
    """The sync audits (``ibpcache.testing.sync_audit``) of three prefetched training steps on the CPU, each of the
    forward, backward and optimizer step that :func:`test_prefetched_training_step_never_syncs` runs on the GPU."""
    from ibpcache.testing.sync_audit import sync_audit

    audits = []
    for m, opt, ids, offs in _prefetched_steps(minilm, optimizer, tables, layout, seed=6):
        # (under the audit's dispatch mode autograd keeps a sparse gradient's coalesced flag, which it drops
        # otherwise: the optimizer's own coalesce of an unflagged gradient is pinned by the test below)
        with sync_audit() as audit:
            m(ids, offs).pow(2).sum().backward()
            opt.step()
        opt.zero_grad()
        audits.append(audit)
    assert m.stats()["misses"] == 0
    return audits


def _prefetched_steps(minilm: torch.Tensor, optimizer: str, tables: int, layout: str, seed: int, steps: int = 3):
    """``steps`` CPU batches of a fresh ``tables``-table module, each prefetched before it is yielded with the module
    and its optimizer (Adagrad attached to the module, as its row state needs): the setting of the op-count and
    sync-audit tests."""
    _, m = _tb(minilm, "cpu", tables)
    opt = (torch.optim.Adagrad if optimizer == "adagrad" else torch.optim.SGD)(m.parameters(), lr=0.05)
    if optimizer == "adagrad":
        m.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids, offs = _tb_batch(gen, tables, "cpu")
        if layout == "2d":
            ids, offs = ids.view(tables, 64)[:, :32].t().contiguous(), None  # [B, T]
        m.prefetch(ids, offs)
        yield m, opt, ids, offs


@pytest.mark.parametrize("layout", ["offsets", "2d"])
def test_prefetched_sgd_step_has_no_sync_prone_op(minilm: torch.Tensor, layout: str) -> None:
    """The CPU twin of test_prefetched_training_step_never_syncs: a prefetched sparse-SGD step runs no op that would
    make the host wait for a CUDA device (host reads of tensor values, data-dependent output sizes, boolean masks,
    coalesce, tensors built from Python data: a pageable host-to-device copy on CUDA), whichever layout."""
    for audit in _audited_steps(minilm, "sgd", layout):
        assert not audit.found, "sync-prone ops in a prefetched SGD step:\n" + audit.table()


_BAG = "ibpcache/loaders/embedding_bag.py"
# torch's Adagrad reads its step counter with .item(): a CPU tensor (not capturable), so no CUDA sync
_ADAGRAD_STEP = ("_local_scalar_dense", "torch/optim/optimizer.py")


@pytest.mark.parametrize("tables, expected", [
    # CPU-only branch: _ranked reads each table's range in uniq (tolist) and RowGather coalesces table by table
    # (_coalesce_segments: a boolean mask and a coalesce per table), because the CPU's sort is unstable; on CUDA
    # (segments=None) neither runs
    (26, {("tolist", _BAG), ("index[bool mask]", _BAG), ("_coalesce", _BAG), _ADAGRAD_STEP}),
    # one table takes the branch CUDA takes for any number: RowGather.backward's one grad.coalesce(), a sync on CUDA
    # (torch reads the coalesced length on the host); kept: replacing it must reproduce coalesce's summation order
    # bit for bit, which needs a GPU to verify
    (1, {("_coalesce", _BAG), _ADAGRAD_STEP}),
])
def test_prefetched_adagrad_step_syncs_only_where_known(minilm: torch.Tensor, tables: int, expected: set) -> None:
    """A prefetched sparse-Adagrad step runs exactly the known sync-prone ops (see the cases), no new one."""
    for audit in _audited_steps(minilm, "adagrad", "offsets", tables):
        assert audit.sites() == expected, audit.table()


@pytest.mark.parametrize("backwards", [1, 2])
def test_adagrad_gets_its_gradient_flagged_coalesced_once(minilm: torch.Tensor, backwards: int) -> None:
    """Autograd drops the coalesced flag of the gradient RowGather builds, so torch's Adagrad would coalesce it again
    (a sort, and a host sync on CUDA); the attached optimizer's hook flags it again, only when it is that gradient:
    not after two backward passes accumulated theirs. Only the step is audited: under the audit's dispatch mode
    autograd keeps the flag. Trained tables stay bit-identical to ``nn.EmbeddingBag`` with
    Adagrad (ids with duplicates, so each coalesce sums)."""
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag
    from ibpcache.testing.sync_audit import sync_audit

    w = minilm[:400, :64].clone()  # one table: the CPU coalesces as CUDA does (several: per table, test above)
    m = TableBatchedCachedEmbeddingBag([400], 64, _weight=w.clone(), mode="sum", sparse=True, cache_ratio=0.5,
                                       warmup_ratio=0.0, device="cpu")
    ref = torch.nn.EmbeddingBag(400, 64, mode="sum", sparse=True, _weight=w.clone())
    opt, ref_opt = torch.optim.Adagrad(m.parameters(), lr=0.05), torch.optim.Adagrad(ref.parameters(), lr=0.05)
    m.attach_optimizer(opt)
    seen: list[bool] = []
    opt.register_step_pre_hook(lambda *_: seen.append(m.cached_weight.grad.is_coalesced()))  # runs after ours
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):
        ids = torch.randint(0, 150, (128,), generator=gen)  # duplicates; 150 distinct at most: the batch fits
        offs = torch.arange(0, 128, 4)
        m.prefetch(ids, offs)
        for _ in range(backwards):
            m(ids, offs).pow(2).sum().backward()
            ref(ids, offs).pow(2).sum().backward()
        with sync_audit() as audit:
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        coalesces = sum(n for (op, _), n in audit.found.items() if op == "_coalesce")
        assert coalesces == (0 if backwards == 1 else 1), audit.table()
    assert seen == [backwards == 1] * 4
    assert torch.equal(m.weight.view(torch.int32), ref.weight.detach().view(torch.int32))


@pytest.mark.gpu
def test_gpu_adagrad_step_does_not_coalesce_again(minilm: torch.Tensor) -> None:
    """On CUDA, where a coalesce is a host sync: the prefetched Adagrad step's optimizer runs no ``_coalesce`` (the
    gradient arrives flagged), and the trained table equals ``nn.EmbeddingBag`` with Adagrad bit for bit."""
    from torch.profiler import ProfilerActivity, profile

    w, m = _tb(minilm, "cuda", 1)
    ref = torch.nn.EmbeddingBag(200, 64, mode="sum", sparse=True, _weight=w.clone().cuda())
    opt, ref_opt = torch.optim.Adagrad(m.parameters(), lr=0.05), torch.optim.Adagrad(ref.parameters(), lr=0.05)
    m.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(0, 90, (64,), generator=gen).cuda()  # duplicates; at most 90 distinct: the batch fits
        offs = torch.arange(0, 64, 2, device="cuda")
        m.prefetch(ids, offs)
        m(ids, offs).pow(2).sum().backward()
        ref(ids, offs).pow(2).sum().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert not [ev.name for ev in prof.events() if ev.name == "aten::_coalesce"]
    assert torch.equal(m.weight.cpu().view(torch.int32), ref.weight.detach().cpu().view(torch.int32))


def _evicting_prefetches(minilm: torch.Tensor, optimizer: str, seed: int, **kw) -> tuple:
    """Six prefetched training steps of a 3-table module whose cache holds one batch (each prefetch evicts, with
    write-back), beside ``nn.EmbeddingBag`` with the same optimizer (Adagrad attached to the module). Returns the
    module and the sync audit of each prefetch, after checking that the trained tables are bit-identical."""
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag
    from ibpcache.testing.sync_audit import sync_audit

    w = minilm[:600, :64].clone()  # 3 tables of 200 rows; 210 cache rows: each batch (192 ids) fits, the next evicts
    m = TableBatchedCachedEmbeddingBag([200] * 3, 64, _weight=w.clone(), mode="sum", sparse=True, cache_ratio=0.35,
                                       warmup_ratio=0.0, device="cpu", **kw)
    ref = torch.nn.EmbeddingBag(600, 64, mode="sum", sparse=True, _weight=w.clone())
    make = torch.optim.Adagrad if optimizer == "adagrad" else torch.optim.SGD
    opt, ref_opt = make(m.parameters(), lr=0.05), make(ref.parameters(), lr=0.05)
    if optimizer == "adagrad":
        m.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(seed)
    audits = []
    for _ in range(6):
        ids, offs = _tb_batch(gen, 3, "cpu")
        with sync_audit() as audit:
            m.prefetch(ids, offs)
        audits.append(audit)
        m(ids, offs).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        glob = ids + torch.arange(3).repeat_interleave(64) * 200
        ref(glob, offs).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert m.stats()["evictions"] > 0 and m.stats()["prefetched_rows"] > 0
    assert torch.equal(m.weight, ref.weight.detach())
    return m, audits


def test_evicted_rows_optimizer_state_moves_without_a_sync(minilm: torch.Tensor) -> None:
    """A training prefetch that evicts rows with attached Adagrad state saves that state and restores the returning
    rows' state with no sync-prone op in the row optimizer (on CUDA: zero-copy writes and reads of its pinned host
    store, no pageable copy, no host-side index); the trained table stays bit-identical to nn.EmbeddingBag's."""
    m, audits = _evicting_prefetches(minilm, "adagrad", seed=11, compress=True)
    state = m.cache_weight_mgr.optim.host["sum"]
    assert state.rows_written > 0 and state.rows_read > 0
    for audit in audits:
        assert not {site for site in audit.sites() if "row_optimizer" in site[1]}, audit.table()


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_training_prefetch_reads_the_device_once(minilm: torch.Tensor, optimizer: str) -> None:
    """A training prefetch that admits and evicts rows (write-back, Adagrad's state saved and restored) reads device
    values once: the one ``tolist`` of its count, probes and checks in the row cache (on CUDA torch.unique and nonzero
    would each wait for the device again). The trained table stays bit-identical to nn.EmbeddingBag's."""
    _, audits = _evicting_prefetches(minilm, optimizer, seed=12)
    # host_store.py's cpu / numpy reads are its CPU branch (rows written and read on the host); on CUDA the same calls
    # encode and decode on the device. The first prefetch may also copy the sketch's constants to the device, once
    # per process (admit.py's _mul_table): from the second on, only the one read
    cpu_only = {("cpu", "ibpcache/cache/host_store.py"), ("numpy", "ibpcache/cache/host_store.py")}
    sites = [audit.sites() for audit in audits]
    assert all(s - cpu_only == {("tolist", "ibpcache/cache/row_cache.py")} for s in sites[1:]), sites
