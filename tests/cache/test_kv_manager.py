"""The KV offload manager, the engine's KV cache (ibpcache/cache/kv_manager.py), without transformers.

Data is real: KV rows of SmolLM2-135M from the shared folder (``code_kv`` in tests/conftest.py). Lossless means
bit-exact: tensors are compared as raw bytes. The transformers adapter on top is tested in tests/loaders/test_kv.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(_bytes(a.cpu()), _bytes(b.cpu()))


def _manager(dtype: torch.dtype, device: str = "cpu", **kw: Any) -> Any:
    from ibpcache.cache.kv_manager import KVOffloadManager

    return KVOffloadManager(2, 3, 64, dtype, batch_size=2, device=device, **kw)


def _fill(mgr: Any, k: torch.Tensor, v: torch.Tensor, prompt: int, layer: int = 0) -> None:
    """Prompt, then single-token decode appends, then one 3-token append, up to all of k's tokens."""
    mgr.append(layer, k[:, :, :prompt], v[:, :, :prompt])
    t = prompt
    while t < k.shape[2] - 3:
        mgr.append(layer, k[:, :, t : t + 1], v[:, :, t : t + 1])
        t += 1
    mgr.append(layer, k[:, :, t:], v[:, :, t:])


# ---------------------------------------------------------------------------------------------------------------
# CPU path (Numba)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("compress", [True, False])
def test_roundtrip_after_many_appends(code_kv: Any, dtype: str, compress: bool) -> None:
    k, v = code_kv(dtype)
    k, v = k[:, :, :160], v[:, :, :160]
    mgr = _manager(DTYPES[dtype], compress=compress)
    _fill(mgr, k, v, prompt=64, layer=1)
    assert mgr.seq_length(1) == 160 and mgr.seq_length(0) == 0
    got_k, got_v = mgr.fetch_all(1)
    assert_same_bits(got_k, k)
    assert_same_bits(got_v, v)
    st = mgr.stats()
    assert st["raw_bytes"] == 2 * k.numel() * k.element_size()
    if compress:
        assert st["ratio"] > 1.0, "real KV rows must compress (codec fitted on the prompt)"
        assert st["stored_bytes"] < st["raw_bytes"]
    else:
        assert st["stored_bytes"] == st["raw_bytes"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fetch_random_indices_with_duplicates(code_kv: Any, dtype: str) -> None:
    k, v = code_kv(dtype)
    mgr = _manager(DTYPES[dtype])
    _fill(mgr, k[:, :, :200], v[:, :, :200], prompt=150)
    gen = torch.Generator().manual_seed(0)
    for n_sel in (1, 7, 64, 300):  # 300 > 200 stored tokens: duplicates guaranteed
        idx = torch.randint(0, 200, (2, 3, n_sel), generator=gen)
        got_k, got_v = mgr.fetch(0, idx)
        ref_k = k.gather(2, idx[..., None].expand(-1, -1, -1, 64))
        ref_v = v.gather(2, idx[..., None].expand(-1, -1, -1, 64))
        assert_same_bits(got_k, ref_k)
        assert_same_bits(got_v, ref_v)
    out = (torch.empty(2, 3, 5, 64, dtype=DTYPES[dtype]), torch.empty(2, 3, 5, 64, dtype=DTYPES[dtype]))
    idx = torch.tensor([199, 0, 199, 3, 3]).expand(2, 3, 5)
    ret = mgr.fetch(0, idx, out=out)
    assert ret[0] is out[0] and ret[1] is out[1]
    assert_same_bits(out[0], k.gather(2, idx[..., None].expand(-1, -1, -1, 64)))


def test_empty_selection_and_empty_layer(code_kv: Any) -> None:
    k, v = code_kv("fp16")
    mgr = _manager(torch.float16)
    empty = torch.empty(2, 3, 0, dtype=torch.int64)
    got_k, got_v = mgr.fetch(0, empty)  # nothing stored yet, nothing asked
    assert got_k.shape == (2, 3, 0, 64) and got_v.shape == (2, 3, 0, 64)
    mgr.append(0, k[:, :, :10], v[:, :, :10])
    assert mgr.fetch(0, empty)[0].shape == (2, 3, 0, 64)
    assert mgr.fetch_all(1)[0].shape == (2, 3, 0, 64)


def test_async_prefill_stores_what_sync_stores(code_kv: Any, monkeypatch: Any) -> None:
    """The prefill worker (prefill="async", here on the CPU path: a thread running the Numba encoders) stores the same
    codecs, positions and bytes as the caller's thread; the caller may overwrite its buffers once append returns,
    unless it donated them; a read, a decode append or a reorder of a layer waits for that layer's jobs."""
    from ibpcache.cache import kv_manager

    monkeypatch.setattr(kv_manager, "_ASYNC_MIN_BYTES", 64 << 10)  # a 99-token piece (152 KB) goes to the worker
    k, v = code_kv("bf16")
    sync = _manager(torch.bfloat16, chunk_bytes="auto_once")
    worker = _manager(torch.bfloat16, chunk_bytes="auto_once", prefill="async")
    assert (sync.prefill, worker.prefill) == ("sync", "async")
    for mgr in (sync, worker):
        kk, vv = k[:, :, :300].clone(), v[:, :, :300].clone()
        mgr.append(0, kk, vv)
        kk.zero_()  # the manager must not depend on the caller's buffers
        mgr.append(1, k[:, :, 100:300].clone(), v[:, :, 100:300].clone(), donate=True)
        assert mgr.seq_length(0) == 300 and mgr.seq_length(1) == 200  # counted at once, stored later
        mgr.append(0, k[:, :, 300:301], v[:, :, 300:301])  # a decode step waits for layer 0's job first
        mgr.append(1, k[:, :, 301:400], v[:, :, 301:400])  # a prefill piece: the worker's, the layer has a store
    assert worker._layers[1].job is not None or worker._layers[1].kv is not None
    for layer in (0, 1):
        for a, b in zip(sync.codecs(layer), worker.codecs(layer)):
            assert type(a) is type(b) and a.same_tables(b)
        sa, sb = sync._layers[layer].kv, worker._layers[layer].kv
        n = sa.high_water
        assert n == sb.high_water
        x, y = sa.snapshot(n), sb.snapshot(n)
        assert np.array_equal(x["pos"], y["pos"]) and np.array_equal(x["data"], y["data"])
    got = worker.fetch_all(0)
    assert_same_bits(got[0], k[:, :, :301])
    assert_same_bits(got[1], v[:, :, :301])
    got = worker.fetch_all(1)
    assert_same_bits(got[0], torch.cat((k[:, :, 100:300], k[:, :, 301:400]), 2))
    a, b = sync.stats(), worker.stats()
    assert a["stored_bytes"] == b["stored_bytes"] and a["decode_steps"] == b["decode_steps"] == 1
    assert b["fit_s"] > 0 and b["prefill"] == "async"
    worker.close()
    sync.close()


def test_async_prefill_chunked_crop_reorder_and_errors(code_kv: Any, monkeypatch: Any) -> None:
    """Prefill in pieces (each piece attends to the stored ones through take), then a crop and a beam reorder, with
    the worker: every read returns the rows in order; an error met by the worker is raised by the next operation
    on that layer, and the other layers keep working."""
    from ibpcache.cache import kv_manager

    monkeypatch.setattr(kv_manager, "_ASYNC_MIN_BYTES", 64 << 10)  # 100-token pieces (154 KB) go to the worker
    k, v = code_kv("fp16")
    mgr = _manager(torch.float16, prefill="async")
    ref = _manager(torch.float16)
    for m in (mgr, ref):
        for t0 in range(0, 300, 100):  # three prefill pieces of 100 tokens per layer
            for layer in (0, 1):
                if t0 == 0:
                    m.append(layer, k[:, :, :100], v[:, :, :100])
                    continue
                keys, values = m.take(layer, None, extra_tokens=100)
                assert_same_bits(keys[:, :, :t0], k[:, :, :t0])
                m.append(layer, k[:, :, t0 : t0 + 100], v[:, :, t0 : t0 + 100], into=(keys, values))
                assert_same_bits(values, v[:, :, : t0 + 100])
        m.crop(250)
        m.append(0, v[:, :, 300:400], k[:, :, 300:400])  # rewrites the cropped slots (a piece: the worker's)
        m.reorder(torch.tensor([1, 0]))
    want = torch.cat((k[:, :, :250], v[:, :, 300:400]), 2).flip(0)
    assert_same_bits(mgr.fetch_all(0)[0], want)
    assert_same_bits(ref.fetch_all(0)[0], want)
    assert mgr.stats()["stored_bytes"] == ref.stats()["stored_bytes"]
    # an error inside the worker: the layer's store is gone (simulated), the next operation on it raises it
    mgr._layers[1].kv = None
    mgr._layers[1].gather = None
    mgr._layers[1].choices = ()
    real = mgr._fit_layer
    mgr._fit_layer = lambda *a: (_ for _ in ()).throw(RuntimeError("fit failed"))  # type: ignore[method-assign]
    mgr.append(1, k[:, :, :100], v[:, :, :100])
    with pytest.raises(RuntimeError, match="fit failed"):
        mgr.fetch_all(1)
    mgr._fit_layer = real  # type: ignore[method-assign]
    assert_same_bits(mgr.fetch_all(0)[0], want)
    mgr.close()
    ref.close()


def test_prefill_argument_is_checked() -> None:
    from ibpcache.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="prefill"):
        _manager(torch.float16, prefill="later")


def test_kv_kernel_launchers_reject_bad_input() -> None:
    """The packed KV launchers check what they are handed before any launch: a clear ValueError, never a bad pointer."""
    from ibpcache.kernels.kv_packed import kvp_append, kvp_fetch
    from ibpcache.kernels.kv_select import partial_scores, select_top

    desc = torch.zeros(48, dtype=torch.int64)
    k = torch.zeros(2, 3, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="differ"):
        kvp_append(desc, k, k[:, :, :3], 0, 0)
    with pytest.raises(ValueError, match="CUDA"):
        kvp_append(desc, k, k, 0, 0)  # host tensors: the kernel would read host pointers as device ones
    out = torch.empty(2, 3, 5, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA"):
        kvp_fetch(desc, None, 4, out, out)
    with pytest.raises(ValueError, match="out_k/out_v"):
        kvp_fetch(desc, None, 6, out, out)  # 6 tokens do not fit 5 positions
    q = torch.zeros(2, 9, 1, 64, dtype=torch.float16)
    dims = torch.zeros(9, 13, dtype=torch.int64)
    with pytest.raises(ValueError, match="dtype"):
        partial_scores(q, dims, torch.zeros(2, 3, 16, 13, dtype=torch.bfloat16), 16, 0.125, None)
    with pytest.raises(ValueError, match="CUDA"):
        partial_scores(q, dims, torch.zeros(2, 3, 16, 13, dtype=torch.float16), 16, 0.125, None)
    with pytest.raises(ValueError, match="CUDA fp32"):
        select_top(torch.zeros(2, 3, 16), 4, 4.0)  # host scores


def test_take_leaves_room_for_current_tokens(code_kv: Any) -> None:
    k, v = code_kv("bf16")
    mgr = _manager(torch.bfloat16)
    _fill(mgr, k[:, :, :40], v[:, :, :40], prompt=30)
    mgr.prefetch(0, None, extra_tokens=1)  # a no-op on the CPU path; take must still be right
    keys, values = mgr.take(0, None, extra_tokens=1)
    assert keys.shape == (2, 3, 41, 64)
    assert_same_bits(keys[:, :, :40], k[:, :, :40])
    assert_same_bits(values[:, :, :40], v[:, :, :40])
    idx = torch.tensor([[[5, 1, 39]] * 3] * 2)
    keys, _ = mgr.take(0, idx, extra_tokens=2)
    assert keys.shape == (2, 3, 5, 64)
    assert_same_bits(keys[:, :, :3], k.gather(2, idx[..., None].expand(-1, -1, -1, 64)))


def test_bad_indices_raise(code_kv: Any) -> None:
    from ibpcache.errors import InvalidIdsError

    k, v = code_kv("fp16")
    mgr = _manager(torch.float16)
    mgr.append(0, k[:, :, :20], v[:, :, :20])
    with pytest.raises(InvalidIdsError, match="negative"):
        mgr.fetch(0, torch.full((2, 3, 4), -1))
    with pytest.raises(InvalidIdsError, match="out of range"):
        mgr.fetch(0, torch.full((2, 3, 4), 20))
    with pytest.raises(InvalidIdsError, match="out of range"):
        mgr.fetch(1, torch.zeros(2, 3, 1, dtype=torch.int64))  # layer 1 holds no tokens
    with pytest.raises(InvalidIdsError, match="dtype"):
        mgr.fetch(0, torch.zeros(2, 3, 4))
    with pytest.raises(InvalidIdsError, match="shape"):
        mgr.fetch(0, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="token_idx"):
        mgr.fetch(0, [[0]])
    with pytest.raises(IndexError, match="layer"):
        mgr.fetch(2, torch.zeros(2, 3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="out\\[0\\]"):
        mgr.fetch(0, torch.zeros(2, 3, 4, dtype=torch.int64), out=(torch.empty(2, 3, 3, 64), torch.empty(2, 3, 3, 64)))


def test_bad_appends_and_arguments_raise(code_kv: Any) -> None:
    from ibpcache.cache.kv_manager import KVOffloadManager

    k, v = code_kv("fp16")
    mgr = _manager(torch.float16)
    with pytest.raises(TypeError, match="dtype"):
        mgr.append(0, k.float(), v.float())
    with pytest.raises(ValueError, match="shape"):
        mgr.append(0, k[:1], v[:1])
    with pytest.raises(ValueError, match="differ"):
        mgr.append(0, k[:, :, :3], v[:, :, :4])
    with pytest.raises(ValueError, match="transfer"):
        KVOffloadManager(2, 3, 64, torch.float16, device="cpu", transfer="zero_copy")
    with pytest.raises(ValueError, match="transfer"):
        KVOffloadManager(2, 3, 64, torch.float16, device="cpu", transfer="nvlink")
    with pytest.raises(TypeError, match="dtype"):
        KVOffloadManager(2, 3, 64, torch.int8, device="cpu")
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVOffloadManager(2, 0, 64, torch.float16, device="cpu")


def test_host_and_stored_bytes_accounting(code_kv: Any) -> None:
    k, v = code_kv("bf16")
    mgr = _manager(torch.bfloat16, reserve_tokens=128)
    _fill(mgr, k[:, :, :100], v[:, :, :100], prompt=90)
    mgr.fetch_all(0)
    st = mgr.stats()
    assert st["tokens"] == 100 and st["decode_steps"] == 8  # 90 + 7 single appends + one 3-token append
    # packed layout: host memory follows the stored bytes (plus the last chunk's free part and every chunk's margin),
    # not the raw size
    kv = mgr._layers[0].kv
    slack = kv.chunk_bytes + len(kv._chunks) * (kv.row_bytes + 32)
    assert st["stored_bytes"] < st["host_bytes"] <= st["stored_bytes"] + slack
    assert st["host_bytes"] < st["raw_bytes"]
    assert st["pcie_read_bytes"] == st["stored_bytes"]  # one dense fetch moves exactly the stored bytes
    assert st["fit_s"] > 0 and len(st["fit_s_per_layer"]) == 2
    mgr.reset()
    assert mgr.seq_length(0) == 0 and mgr.stats()["stored_bytes"] == 0


def test_manager_rejects_unknown_dense_fetch() -> None:
    with pytest.raises(ValueError, match="dense_fetch"):
        _manager(torch.float16, "cpu", dense_fetch="dma")


# ---------------------------------------------------------------------------------------------------------------
# GPU: zero-copy (ours) and CPU-gather (InfiniGen's) transfer paths. The packed store's kernels
# (kernels/kv_packed.cu) through the manager. Golden reference: the CPU manager, whose store places and encodes the
# same rows with the codecs' CPU encoders; the GPU must store byte-identical rows.
# (Store-level GPU tests: tests/cache/test_append_store.py.)


GPU_PATHS = [("zero_copy", True), ("zero_copy", False), ("cpu_gather", False)]


@pytest.mark.gpu
@pytest.mark.parametrize("transfer,compress", GPU_PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gpu_fetch_prefetch_roundtrip(code_kv: Any, transfer: str, compress: bool, dtype: str) -> None:
    k, v = code_kv(dtype)
    kc, vc = k.cuda(), v.cuda()
    mgr = _manager(DTYPES[dtype], "cuda", transfer=transfer, compress=compress, host_chunk_bytes=1 << 16)
    _fill(mgr, kc, vc, prompt=300)  # 64 KiB chunks: appends cross chunk boundaries
    got_k, got_v = mgr.fetch_all(0)
    assert_same_bits(got_k, k)
    assert_same_bits(got_v, v)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 400, (2, 3, 500), generator=gen).cuda()
    ref_k = k.gather(2, idx.cpu()[..., None].expand(-1, -1, -1, 64))
    assert_same_bits(mgr.fetch(0, idx)[0], ref_k)
    mgr.prefetch(0, idx, extra_tokens=1)
    keys, _ = mgr.take(0, idx, extra_tokens=1)
    assert_same_bits(keys[:, :, :500], ref_k)
    mgr.prefetch(0, None, extra_tokens=1)
    keys, values = mgr.take(0, None, extra_tokens=1)
    assert_same_bits(keys[:, :, :400], k)
    assert_same_bits(values[:, :, :400], v)
    with pytest.raises(Exception, match="out of range"):
        mgr.fetch(0, torch.full((2, 3, 1), 400, device="cuda"))
    st = mgr.stats()
    if compress:
        assert st["ratio"] > 1.0 and st["gpu_bytes"] > 0
    mgr.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("codec", ["auto", "ibp"])
def test_gpu_store_bytes_equal_cpu_store(code_kv: Any, dtype: str, codec: str) -> None:
    """Appends from transposed views (what attention projections hand over) store the CPU encoder's exact bytes."""
    k, v = code_kv(dtype)
    # [B, H, T, D] views of [B, T, H, D] memory, like q/k/v projections after .transpose(1, 2)
    kt, vt = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    host = _manager(DTYPES[dtype], "cpu", codec=codec, host_chunk_bytes=1 << 15)
    gpu = _manager(DTYPES[dtype], "cuda", codec=codec, host_chunk_bytes=1 << 15)  # small chunks: many of them
    _fill(host, k, v, prompt=300)
    _fill(gpu, kt.cuda(), vt.cuda(), prompt=300)
    torch.cuda.synchronize()
    n_slots = 400 * 6
    a, b = host._layers[0].kv, gpu._layers[0].kv
    for x, y in zip(a.codecs, b.codecs):
        assert type(x) is type(y) and x.same_tables(y)
    sa, sb = a.snapshot(n_slots), b.snapshot(n_slots)
    assert np.array_equal(sa["len"], sb["len"]) and np.array_equal(sa["pos"], sb["pos"])
    assert np.array_equal(sa["data"], sb["data"])
    st = gpu.stats()
    assert st["pcie_write_bytes"] == st["stored_bytes"] and st["ratio"] > 1.0
    assert st["host_bytes"] < st["raw_bytes"]
    host.close()
    gpu.close()


@pytest.mark.gpu
@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("dense_fetch", ["bulk", "zero_copy"])
def test_gpu_manager_counts_bytes_it_moves(code_kv: Any, compress: bool, dense_fetch: str) -> None:
    """Zero-copy reads move exactly the stored bytes of the rows; a bulk dense read moves the chunks' live part
    (stored bytes plus chunk tails and padding, never more than the host holds); both read the same rows."""
    k, v = code_kv("fp16")
    mgr = _manager(torch.float16, "cuda", compress=compress, dense_fetch=dense_fetch, host_chunk_bytes=1 << 16)
    _fill(mgr, k.cuda(), v.cuda(), prompt=300)
    before = mgr.stats()
    keys, values = mgr.fetch_all(0)
    assert_same_bits(keys, k)
    assert_same_bits(values, v)
    mgr.prefetch(0, None, extra_tokens=1)
    keys, _ = mgr.take(0, None, extra_tokens=1)
    assert_same_bits(keys[:, :, :400], k)
    after = mgr.stats()
    moved = after["pcie_read_bytes"] - before["pcie_read_bytes"]
    stored = mgr._layers[0].kv.stored_bytes(400 * 6)
    if dense_fetch == "zero_copy":
        assert moved == 2 * stored
    else:
        assert 2 * stored <= moved <= 2 * mgr._layers[0].kv.host_nbytes
    assert after["pcie_write_bytes"] == after["stored_bytes"]
    assert after["dense_fetch"] == dense_fetch
    mgr.close()


@pytest.mark.gpu
def test_gpu_async_prefill_never_waits_and_stores_the_cpu_bytes(code_kv: Any) -> None:
    """The prefill worker on CUDA: appending every layer's prompt returns while the device is still busy with work
    queued before it (the caller never waits for the store), and what the worker stores (its stream, a staged encode
    and DMA copies into pooled chunks) is the CPU store's bytes; decode steps and reads after it are exact."""
    import time

    k, v = code_kv("bf16")
    kc, vc = k.cuda(), v.cuda()
    host = _manager(torch.bfloat16, "cpu", host_chunk_bytes=1 << 15)
    gpu = _manager(torch.bfloat16, "cuda", host_chunk_bytes=1 << 15)
    assert gpu.prefill == "async"
    gpu._worker.submit(lambda: None).result()  # the kernels it loads at construction are ready
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of device time on the caller's stream: the prompts' rows come after it
    busy = torch.cuda.Event()
    busy.record()
    t0 = time.perf_counter()
    for layer in (0, 1):
        gpu.append(layer, kc[:, :, :300], vc[:, :, :300])
    returned = time.perf_counter() - t0
    assert not busy.query() and returned < 0.5, f"append waited for the device ({returned:.2f} s)"
    for mgr, kk, vv in ((host, k, v), (gpu, kc, vc)):
        if mgr is host:
            for layer in (0, 1):
                mgr.append(layer, kk[:, :, :300], vv[:, :, :300])
        for t in range(300, 340):
            for layer in (0, 1):
                mgr.append(layer, kk[:, :, t : t + 1], vv[:, :, t : t + 1])
    torch.cuda.synchronize()
    for layer in (0, 1):
        a, b = host._layers[layer].kv.snapshot(340 * 6), gpu._layers[layer].kv.snapshot(340 * 6)
        assert np.array_equal(a["pos"], b["pos"]) and np.array_equal(a["data"], b["data"])
        assert_same_bits(gpu.fetch_all(layer)[0], k[:, :, :340])
    st = gpu.stats()
    assert st["prefill"] == "async" and st["host_pool"]["in_use_blocks"] > 0 and st["fit_s"] > 0
    host.close()
    gpu.close()


@pytest.mark.gpu
def test_gpu_pinned_blocks_are_reused_by_the_next_store(code_kv: Any) -> None:
    """A closed manager's chunks go back to the process's pool; the next manager of the same shape pins nothing."""
    import time

    from ibpcache.cache.host_pool import host_pool

    pool = host_pool()
    k, v = code_kv("fp16")
    kc, vc = k.cuda(), v.cuda()
    pinned = []
    for _ in range(2):
        mgr = _manager(torch.float16, "cuda", host_chunk_bytes=1 << 15)
        for layer in (0, 1):
            mgr.append(layer, kc, vc)
        mgr.flush()
        while pool.stats()["pending_blocks"]:  # the background pins asked for at the prompt
            time.sleep(0.01)
        pinned.append(pool.stats()["pinned_bytes"])
        assert_same_bits(mgr.fetch_all(1)[1], v)
        in_use = pool.stats()["in_use_blocks"]
        mgr.close()
        assert pool.stats()["in_use_blocks"] < in_use  # the chunks went back
    assert pinned[1] == pinned[0], "the second store pinned new memory instead of reusing the pool's blocks"
