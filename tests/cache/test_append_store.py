"""The engine's packed KV append store (ibpcache/cache/append_store.py, kernels/kv_packed.cu).

Real data: SmolLM2-135M KV of the chat prompt (30 layers, 3 KV heads, 314 tokens, head_dim 64) from the shared
folder, as bf16 and fp16. Lossless means bit-exact: rows are compared as bytes. The CPU store is the golden
reference of the GPU one: same appends, same positions, same lengths, same stored bytes (``snapshot``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
METHOD_PAIRS = [("exponent", "exponent"), ("ibp", "exponent"), ("exponent", "ibp"), ("ibp", "ibp"), ("raw", "exponent")]


@pytest.fixture(scope="module")
def chat_kv(shared_data_dir: Any) -> Any:
    """``chat_kv(dtype, layers)`` -> real (K, V) [len(layers), 3, 314, 64]: layers as the batch dimension."""
    from ibpcache.datasets import load_kv

    cache: dict = {}

    def get(dtype: str, layers: tuple = (3, 17)) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dtype, layers)
        if key not in cache:
            k = load_kv("chat", "k", dtype, shared_data_dir, flat=False)
            v = load_kv("chat", "v", dtype, shared_data_dir, flat=False)
            cache[key] = (k[list(layers)].contiguous(), v[list(layers)].contiguous())
        return cache[key]

    return get


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> token-major rows [T * B * H, D] (the slot order)."""
    return x.permute(2, 0, 1, 3).reshape(-1, x.shape[3])


def _codec(method: str, x: torch.Tensor) -> Any:
    from ibpcache.codec import Codec

    rows = _rows(x).contiguous()
    if method == "raw":
        return Codec.raw(x.dtype, (x.shape[3],))
    return Codec.fit(rows, method=method)


def _slack(store: Any) -> int:
    """Host bytes a store may hold beyond its stored bytes: the free part of its last chunk and every chunk's margin
    (a row may run past its chunk's end; decoders read 16 bytes past a row)."""
    snap = store.snapshot(0)
    return snap["chunk_bytes"] + snap["chunks"] * (store.row_bytes + 32)


def _read_all(store: Any, n_slots: int, dtype: torch.dtype, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for side in (0, 1):
        buf = np.zeros((n_slots, d * 2), dtype=np.uint8)
        store.read_rows(side, np.arange(n_slots), buf, None)
        out.append(torch.from_numpy(buf).view(dtype))
    return out[0], out[1]


def _fill(store: Any, k: torch.Tensor, v: torch.Tensor, prompt: int) -> int:
    """Prompt, then single-token appends, then one 3-token append; returns the slots written."""
    bh = k.shape[0] * k.shape[1]
    store.append(k[:, :, :prompt], v[:, :, :prompt], 0, 0)
    t = prompt
    while t < k.shape[2] - 3:
        store.append(k[:, :, t : t + 1], v[:, :, t : t + 1], t * bh, t)
        t += 1
    store.append(k[:, :, t:], v[:, :, t:], t * bh, t)
    return k.shape[2] * bh


# ---------------------------------------------------------------------------------------------------------------
# The placement rule and chunk sizes (shared by both backends)


def test_positions_chunk_sizes_and_staged_copies() -> None:
    from ibpcache.cache.append_store import (chunk_bytes_for, chunk_margin, chunks_needed, staged_copies,
                                             to_position, to_virtual)

    one = 1 << 40
    assert to_position(0, 12) == 0 and to_position(4095, 12) == 4095 and to_position(4096, 12) == one
    assert to_position(3 * 4096 + 7, 12) == 3 * one + 7
    v = np.arange(0, 1 << 20, 997, dtype=np.int64)
    assert np.array_equal(to_virtual(to_position(v, 12), 12), v)
    assert [chunks_needed(e, 12) for e in (0, 1, 4096, 4097, 8192)] == [0, 1, 1, 2, 2]
    assert chunk_margin(128) == 144 and chunk_margin(130) == 160
    # 16 KiB floor, 8 tokens' worst case, ~1/64 of the expected first append, 4 MiB ceiling, powers of two
    assert chunk_bytes_for(6, 128) == 16384
    assert chunk_bytes_for(128, 256) == 1 << 19  # 8 tokens of 128 rows x 2 sides x 256 B
    assert chunk_bytes_for(6, 128, expected_bytes=10 << 20) == 1 << 18
    assert chunk_bytes_for(128, 256, expected_bytes=537 << 20) == 4 << 20
    assert chunk_bytes_for(6, 128, min_bytes=300, max_bytes=1000) == 512
    # a staged append's copies: each chunk from max(its start, base) up to a row past its end, never before base
    copies = staged_copies(100, 9000, 12, 128)
    assert copies == [(0, 100, 0, 4124), (1, 0, 3996, 4224), (2, 0, 8092, 808)]
    assert staged_copies(4096, 4097, 12, 128) == [(1, 0, 0, 1)]
    for c, off, b_off, n in staged_copies(5000, 30000, 12, 200):
        assert off + n <= 4096 + 200 and b_off + n <= 25000 and (c << 12) + off == 5000 + b_off


# ---------------------------------------------------------------------------------------------------------------
# CPU store on real KV


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("k_method,v_method", METHOD_PAIRS)
def test_roundtrip_real_kv_packed(chat_kv: Any, dtype: str, k_method: str, v_method: str) -> None:
    from ibpcache.cache.append_store import AppendStore, to_virtual

    k, v = chat_kv(dtype)
    store = AppendStore(_codec(k_method, k[:, :, :200]), _codec(v_method, v[:, :, :200]), "cpu", rows_per_token=6,
                        slots=314 * 6)
    n = _fill(store, k, v, prompt=200)
    got_k, got_v = _read_all(store, n, k.dtype, 64)
    assert torch.equal(got_k.view(torch.int16), _rows(k).contiguous().view(torch.int16))
    assert torch.equal(got_v.view(torch.int16), _rows(v).contiguous().view(torch.int16))
    snap = store.snapshot(n)
    # rows are back to back, K0 V0 K1 V1 ..., in slot order: virtual offset = running sum of stored lengths
    virt = to_virtual(snap["pos"], store.chunk_shift)
    lens = snap["len"].astype(np.int64)
    inter = np.stack([lens[0], lens[1]], axis=1).reshape(-1)
    assert np.array_equal(np.stack([virt[0], virt[1]], axis=1).reshape(-1),
                          np.concatenate(([0], np.cumsum(inter)[:-1])))
    assert snap["chunks"] > 4, "the rows must span several chunks"
    assert snap["data"].size == store.stored_bytes(n) == int(snap["len"].sum())
    # host memory: the stored bytes, the last chunk's free part and the chunks' margins
    assert store.host_nbytes <= store.stored_bytes(n) + _slack(store)
    if "raw" not in (k_method, v_method) and dtype == "bf16":  # real bf16 KV: IBP ~1.2x, exponent ~1.45x
        want = 1.35 if (k_method, v_method) == ("exponent", "exponent") else 1.1
        assert store.host_nbytes < 2 * n * 128 / want, "bf16 KV rows must take less host memory than raw"


def test_reads_in_any_order_with_duplicates(chat_kv: Any) -> None:
    from ibpcache.cache.append_store import AppendStore

    k, v = chat_kv("bf16")
    store = AppendStore(_codec("exponent", k), _codec("ibp", v), "cpu", rows_per_token=6, min_chunk_bytes=4096,
                        max_chunk_bytes=16384)
    store.reserve(314 * 6)
    n = _fill(store, k, v, prompt=40)  # small chunks: rows run across many chunk ends
    assert store.snapshot(n)["chunks"] > 8
    gen = np.random.default_rng(0)
    slots = gen.integers(0, n, 777)
    out = np.zeros((800, 128), dtype=np.uint8)
    dest = gen.permutation(800)[:777]
    store.read_rows(1, slots, out, dest)
    ref = _rows(v).contiguous().view(torch.uint8).numpy()
    assert np.array_equal(out[dest], ref[slots])


def test_crop_rewinds_and_rewrites(chat_kv: Any) -> None:
    """Slots rewritten after a crop start at the first dropped K row: no bytes leak, later rows are correct."""
    from ibpcache.cache.append_store import AppendStore

    k, v = chat_kv("fp16")
    store = AppendStore(_codec("exponent", k), _codec("exponent", v), "cpu", rows_per_token=6, slots=314 * 6)
    store.append(k[:, :, :100], v[:, :, :100], 0, 0)
    for t in range(100, 110):
        store.append(k[:, :, t : t + 1], v[:, :, t : t + 1], t * 6, t)
    before = store.snapshot(103 * 6)
    cursor_at_103 = int(store.positions(104 * 6)[0, 103 * 6])
    # crop to 103 tokens, then append other data (V and K swapped) for tokens 103..111
    store.append(v[:, :, 103:112], k[:, :, 103:112], 103 * 6, 103)
    snap = store.snapshot(112 * 6)
    assert int(snap["pos"][0, 103 * 6]) == cursor_at_103
    assert np.array_equal(snap["pos"][:, : 103 * 6], before["pos"])
    got_k, got_v = _read_all(store, 112 * 6, torch.float16, 64)
    want_k = torch.cat((_rows(k[:, :, :103]), _rows(v[:, :, 103:112])))
    want_v = torch.cat((_rows(v[:, :, :103]), _rows(k[:, :, 103:112])))
    assert torch.equal(got_k.view(torch.int16), want_k.contiguous().view(torch.int16))
    assert torch.equal(got_v.view(torch.int16), want_v.contiguous().view(torch.int16))


def test_bad_input_raises_clear_errors(chat_kv: Any) -> None:
    from ibpcache.cache.append_store import AppendStore
    from ibpcache.codec import Codec
    from ibpcache.errors import CapacityError

    k, v = chat_kv("bf16")
    kc = _codec("exponent", k)
    with pytest.raises(TypeError, match="codec"):
        AppendStore("exponent", kc, "cpu", rows_per_token=6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="differ in size"):
        AppendStore(kc, Codec.raw(torch.bfloat16, (32,)), "cpu", rows_per_token=6)
    with pytest.raises(ValueError, match="rows_per_token"):
        AppendStore(kc, kc, "cpu", rows_per_token=0)
    store = AppendStore(kc, kc, "cpu", rows_per_token=6, slots=60)
    with pytest.raises(CapacityError, match="in order"):
        store.append(k[:, :, :2], v[:, :, :2], 6, 1)  # slot 0 never written
    with pytest.raises(CapacityError, match="past capacity"):
        store.append(k[:, :, :11], v[:, :, :11], 0, 0)
    with pytest.raises(ValueError, match="bfloat16"):
        store.append(k[:, :, :2].half(), v[:, :, :2].half(), 0, 0)
    with pytest.raises(ValueError, match="one shape"):
        store.append(k[:, :, :2], v[:, :, :3], 0, 0)
    with pytest.raises(RuntimeError, match="CUDA path"):
        store.fetch(None, 1, k, v)


# ---------------------------------------------------------------------------------------------------------------
# Property tests: any bit pattern (NaN payloads, -0.0, infinities, denormals), odd geometries, crops


def _special_u16(draw: Any, st: Any, n: int) -> np.ndarray:
    """n 16-bit patterns: uniform random bits with a drawn share of special values (NaN payloads, -0.0, +-inf,
    denormals, the largest finite, a common binade). Generated from a drawn seed: hypothesis shrinks the seed and
    the share, not megabytes of integers."""
    specials = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x7C00, 0x7E01, 0x03FF,
                         0x3F80, 0x7BFF], dtype=np.uint16)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    share = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    narrow = draw(st.booleans())  # values of a few binades, as real KV (compressible), or any bits
    vals = (rng.integers(0x3C00, 0x4400, n) if narrow else rng.integers(0, 1 << 16, n)).astype(np.uint16)
    mask = rng.random(n) < share
    vals[mask] = specials[rng.integers(0, specials.size, int(mask.sum()))]
    return vals


def _property_case(draw: Any, st: Any) -> dict:
    b = draw(st.integers(1, 3))
    h = draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 3, 8, 64]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    methods = (draw(st.sampled_from(["raw", "ibp", "exponent"])), draw(st.sampled_from(["raw", "ibp", "exponent"])))
    steps = draw(st.lists(st.integers(1, 5), min_size=1, max_size=12))
    total = sum(steps) + 4
    data = [_special_u16(draw, st, b * h * total * d) for _ in range(2)]
    crop = draw(st.one_of(st.none(), st.integers(0, sum(steps) - 1)))
    return dict(b=b, h=h, d=d, dtype=dtype, methods=methods, steps=steps, data=data, crop=crop, total=total)


def _run_property_case(case: dict, device: str) -> tuple[Any, int, torch.Tensor, torch.Tensor]:
    """Apply the case's appends (and crop + rewrite) to a store; returns it with the reference rows."""
    from ibpcache.cache.append_store import AppendStore

    b, h, d, dtype = case["b"], case["h"], case["d"], case["dtype"]
    k, v = (torch.from_numpy(x.view(np.int16)).view(dtype).view(b, h, case["total"], d) for x in case["data"])
    store = AppendStore(_codec(case["methods"][0], k), _codec(case["methods"][1], v), device, rows_per_token=b * h,
                        min_chunk_bytes=256, max_chunk_bytes=1024, slots=b * h)
    kd, vd = k.to(device), v.to(device)
    t = 0
    ref_k, ref_v = [], []
    for i, n in enumerate(case["steps"]):
        store.reserve((t + n) * b * h)
        store.append(kd[:, :, t : t + n], vd[:, :, t : t + n], t * b * h, t)
        ref_k.append(k[:, :, t : t + n])
        ref_v.append(v[:, :, t : t + n])
        t += n
    if case["crop"] is not None:  # keep `crop` tokens, then write 4 tokens of the other tensor
        c = case["crop"]
        keep_k, keep_v = torch.cat(ref_k, 2)[:, :, :c], torch.cat(ref_v, 2)[:, :, :c]
        new_k, new_v = v[:, :, -4:], k[:, :, -4:]
        store.reserve((c + 4) * b * h)
        store.append(new_k.to(device), new_v.to(device), c * b * h, c)
        ref_k, ref_v = [keep_k, new_k], [keep_v, new_v]
        t = c + 4
    return store, t * b * h, torch.cat(ref_k, 2), torch.cat(ref_v, 2)


def test_property_any_bits_roundtrip() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(st.data())
    def check(data: Any) -> None:
        case = _property_case(data.draw, st)
        store, n, ref_k, ref_v = _run_property_case(case, "cpu")
        got_k, got_v = _read_all(store, n, case["dtype"], case["d"])
        assert torch.equal(got_k.view(torch.int16), _rows(ref_k).contiguous().view(torch.int16))
        assert torch.equal(got_v.view(torch.int16), _rows(ref_v).contiguous().view(torch.int16))
        snap = store.snapshot(n)
        end = (snap["pos"] & ((1 << 40) - 1)) + snap["len"]  # a row ends at most row_bytes past its chunk
        assert int(end.max(initial=0)) <= snap["chunk_bytes"] + store.row_bytes
        assert int((snap["pos"] >> 40).max(initial=0)) < snap["chunks"]

    check()


# ---------------------------------------------------------------------------------------------------------------
# The planner's codec choice and the manager on top


def test_planner_chooses_per_tensor_on_real_kv(chat_kv: Any) -> None:
    from ibpcache.cache.plan_codecs import choose_row_codecs
    from ibpcache.exponent import ExponentCodec

    k, v = chat_kv("bf16", (0, 29))
    kf, _ = chat_kv("fp16", (0, 29))
    samples = [_rows(k[:1]).contiguous(), _rows(v[:1]).contiguous(), _rows(k[1:]).contiguous()]
    choices = choose_row_codecs(samples, "auto")
    for c, x in zip(choices, samples):
        assert c.sizes[c.method] == min(c.sizes.values()) and set(c.sizes) == {"raw", "ibp", "exponent"}
        assert c.method == "exponent" and isinstance(c.codec, ExponentCodec)  # bf16 KV: exponent 1.4x+, IBP ~1.2x
        assert c.sizes["raw"] / c.sizes["exponent"] > 1.3
    fp32 = choose_row_codecs([_rows(k[:1]).float().contiguous()], "auto")[0]
    assert "exponent" not in fp32.sizes and fp32.method in ("ibp", "raw")
    assert [c.method for c in choose_row_codecs(samples[:2], "ibp")] == ["ibp", "ibp"]
    assert choose_row_codecs([_rows(kf[:1]).contiguous()], "raw")[0].method == "raw"
    with pytest.raises(TypeError, match="bfloat16/float16"):
        choose_row_codecs([samples[0].float()], "exponent")
    with pytest.raises(ValueError, match="method"):
        choose_row_codecs(samples, "zstd")


def test_manager_all_layers_bf16_ratio_and_host_bytes(chat_kv: Any) -> None:
    """Issue 13's targets on the real SmolLM2 KV: bf16 ratio >= 1.4 and host memory <= raw / ratio + small slack."""
    from ibpcache.cache.kv_manager import KVOffloadManager

    k, v = chat_kv("bf16", tuple(range(30)))
    mgr = KVOffloadManager(30, 3, 64, torch.bfloat16, batch_size=1, device="cpu", reserve_tokens=314)
    for layer in range(30):
        mgr.append(layer, k[layer : layer + 1, :, :250], v[layer : layer + 1, :, :250])
    for t in range(250, 314):
        for layer in range(30):
            mgr.append(layer, k[layer : layer + 1, :, t : t + 1], v[layer : layer + 1, :, t : t + 1])
    st = mgr.stats()
    assert st["ratio"] >= 1.4, st["ratio"]
    # slack per layer: the last chunk's free part and the chunks' margins
    slack = sum(_slack(s.kv) for s in mgr._layers)
    assert st["host_bytes"] <= st["raw_bytes"] / st["ratio"] + slack
    assert slack < 0.15 * st["stored_bytes"]
    methods = {m["method"] for layer in st["codecs"] for m in layer}
    assert methods <= {"exponent", "ibp", "raw"} and "exponent" in methods
    for layer in (0, 13, 29):
        got_k, got_v = mgr.fetch_all(layer)
        assert torch.equal(got_k.view(torch.int16), k[layer : layer + 1].view(torch.int16))
        assert torch.equal(got_v.view(torch.int16), v[layer : layer + 1].view(torch.int16))


def test_manager_codec_argument(chat_kv: Any) -> None:
    from ibpcache.exponent import ExponentCodec
    from ibpcache.cache.kv_manager import KVOffloadManager

    k, v = chat_kv("fp16")
    with pytest.raises(ValueError, match="codec"):
        KVOffloadManager(1, 3, 64, torch.float16, device="cpu", codec="lz4")
    with pytest.raises(TypeError, match="exponent"):
        KVOffloadManager(1, 3, 64, torch.float32, device="cpu", codec="exponent")
    mgr = KVOffloadManager(1, 3, 64, torch.float16, batch_size=2, device="cpu", codec="exponent")
    mgr.append(0, k[:, :, :50], v[:, :, :50])
    assert all(isinstance(c, ExponentCodec) for c in mgr.codecs(0))
    assert mgr.stats()["codecs"][0][0]["method"] == "exponent"
    got = mgr.fetch(0, torch.tensor([[[49, 0, 7]] * 3] * 2))
    assert torch.equal(got[0], k[:, :, [49, 0, 7]])


# ---------------------------------------------------------------------------------------------------------------
# GPU: the same store on the device (kernels/kv_packed.cu); the CPU store is the golden reference


def _snapshots_equal(a: dict, b: dict) -> None:
    assert np.array_equal(a["len"], b["len"]), "stored lengths differ"
    assert np.array_equal(a["pos"], b["pos"]), "positions differ"
    assert np.array_equal(a["data"], b["data"]), "stored bytes differ"
    assert a["chunk_bytes"] == b["chunk_bytes"]
    assert 0 <= b["chunks"] - a["chunks"] <= 2  # the GPU (b) may hold a chunk or two more, added ahead


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("k_method,v_method", METHOD_PAIRS)
def test_gpu_store_equals_cpu_store(chat_kv: Any, dtype: str, k_method: str, v_method: str) -> None:
    """Same appends (from transposed views, as attention projections hand them over) -> identical store contents."""
    from ibpcache.cache.append_store import AppendStore

    k, v = chat_kv(dtype)
    kc, vc = _codec(k_method, k[:, :, :200]), _codec(v_method, v[:, :, :200])
    kt = k.transpose(1, 2).contiguous().transpose(1, 2).cuda()  # [B, H, T, D] views of [B, T, H, D] memory
    vt = v.transpose(1, 2).contiguous().transpose(1, 2).cuda()
    kw = dict(rows_per_token=6, min_chunk_bytes=16384, max_chunk_bytes=65536)
    cpu = AppendStore(kc, vc, "cpu", slots=6, **kw)
    gpu = AppendStore(kc, vc, "cuda", slots=6, **kw)
    for store, kk, vv in ((cpu, k, v), (gpu, kt, vt)):
        store.reserve(314 * 6)
        _fill(store, kk, vv, prompt=200)  # prompt: the synced path; decode steps: no sync
        store.append(kk[:, :, 250:260], vv[:, :, 250:260], 250 * 6, 250)  # crop to 250 tokens + rewrite (rewind)
    n = 260 * 6
    gpu.check()
    _snapshots_equal(cpu.snapshot(n), gpu.snapshot(n))
    assert gpu.host_nbytes <= cpu.host_nbytes + 2 * gpu._chunks.block
    cpu.release()
    gpu.release()


@pytest.mark.gpu
@pytest.mark.parametrize("k_method,v_method", METHOD_PAIRS)
def test_gpu_fetch_exact_selected_reordered_and_into(chat_kv: Any, k_method: str, v_method: str) -> None:
    """Fetch of chosen tokens, of every token through a beam-reordered slot table, into wider buffers; the append's
    copy into attention buffers; byte counters equal the stored bytes moved."""
    from ibpcache.cache.append_store import AppendStore

    k, v = chat_kv("bf16")
    kd, vd = k.cuda(), v.cuda()
    store = AppendStore(_codec(k_method, k), _codec(v_method, v), "cuda", rows_per_token=6, slots=314 * 6)
    written = torch.zeros(1, dtype=torch.int64, device="cuda")
    store.append(kd[:, :, :250], vd[:, :, :250], 0, 0, written=written)
    for t in range(250, 313):
        store.append(kd[:, :, t : t + 1], vd[:, :, t : t + 1], t * 6, t, written=written)
    att = torch.full((2, 3, 5, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    att_k, att_v = att.clone(), att.clone()
    store.append(kd[:, :, 313:], vd[:, :, 313:], 313 * 6, 313, into=(att_k, att_v), att_pos0=4, written=written)
    assert torch.equal(att_k[:, :, 4:].view(torch.int16), kd[:, :, 313:].view(torch.int16))
    assert torch.equal(att_v[:, :, :4].view(torch.int16), att[:, :, :4].view(torch.int16))  # untouched
    assert int(written) == store.stored_bytes(314 * 6)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 314, (2, 3, 97), generator=gen)
    sentinel = torch.full((2, 3, 99, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    out_k, out_v = sentinel.clone(), sentinel.clone()
    read = torch.zeros(1, dtype=torch.int64, device="cuda")
    store.fetch(idx.cuda(), 97, out_k, out_v, read=read)
    want = lambda x: x.gather(2, idx[..., None].expand(-1, -1, -1, 64)).view(torch.int16)  # noqa: E731
    assert torch.equal(out_k[:, :, :97].cpu().view(torch.int16), want(k))
    assert torch.equal(out_v[:, :, :97].cpu().view(torch.int16), want(v))
    assert torch.equal(out_k[:, :, 97:].view(torch.int16), sentinel[:, :, 97:].view(torch.int16))
    # beams swapped: batch row 0 reads row 1's slots and vice versa (row0[t, b] = slot of (t, b, head 0))
    row0 = (torch.arange(314).view(-1, 1) * 6 + torch.tensor([3, 0])).cuda().contiguous()
    dense_k = torch.empty(2, 3, 315, 64, dtype=torch.bfloat16, device="cuda")
    dense_v = torch.empty_like(dense_k)
    read.zero_()
    store.fetch(None, 314, dense_k, dense_v, read=read, row0=row0)
    assert torch.equal(dense_k[:, :, :314].cpu().view(torch.int16), k.flip(0).view(torch.int16))
    assert torch.equal(dense_v[:, :, :314].cpu().view(torch.int16), v.flip(0).view(torch.int16))
    assert int(read) == store.stored_bytes(314 * 6)
    store.check()
    store.release()


@pytest.mark.gpu
@pytest.mark.parametrize("k_method,v_method", METHOD_PAIRS)
def test_gpu_staged_fetch_equals_zero_copy_fetch(chat_kv: Any, k_method: str, v_method: str) -> None:
    """A fetch from the bulk device copy of the chunks (stage_chunks) returns the zero-copy fetch's bytes: every token
    across many small chunks, through a beam-reordered slot table, after a crop rewrote slots, and with the copies on
    another stream; staging and decoding never sync the host; the copy moves about the stored bytes."""
    from ibpcache.cache.append_store import AppendStore

    k, v = chat_kv("bf16")
    kd, vd = k.cuda(), v.cuda()
    store = AppendStore(_codec(k_method, k), _codec(v_method, v), "cuda", rows_per_token=6, slots=314 * 6,
                        min_chunk_bytes=8192, max_chunk_bytes=16384)
    store.append(kd[:, :, :40], vd[:, :, :40], 0, 0)
    for t in range(40, 300):
        store.append(kd[:, :, t : t + 1], vd[:, :, t : t + 1], t * 6, t)
    store.append(vd[:, :, 290:314], kd[:, :, 290:314], 290 * 6, 290)  # a crop to 290, then other rows (V, K swapped)
    want_k = torch.cat((k[:, :, :290], v[:, :, 290:]), 2)
    want_v = torch.cat((v[:, :, :290], k[:, :, 290:]), 2)
    assert len(store._chunks) > 10, "the rows must span many chunks"
    row0 = (torch.arange(314).view(-1, 1) * 6 + torch.tensor([3, 0])).cuda().contiguous()
    side = torch.cuda.Stream()
    for reorder in (False, True):
        outs = []
        for how in ("zero_copy", "staged", "staged_other_stream"):
            out_k = torch.full((2, 3, 320, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
            out_v = out_k.clone()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                staged = None
                if how == "staged":
                    staged = store.stage_chunks()
                elif how == "staged_other_stream":
                    side.wait_stream(torch.cuda.current_stream())
                    staged = store.stage_chunks(side)
                store.fetch(None, 314, out_k, out_v, row0=row0 if reorder else None, staged=staged)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if staged is not None:
                assert store.stored_bytes(314 * 6) <= staged.nbytes <= store.host_nbytes
            outs.append((out_k.cpu(), out_v.cpu()))
        wk, wv = (want_k.flip(0), want_v.flip(0)) if reorder else (want_k, want_v)
        for got_k, got_v in outs:
            assert torch.equal(got_k[:, :, :314].view(torch.int16), wk.view(torch.int16))
            assert torch.equal(got_v[:, :, :314].view(torch.int16), wv.view(torch.int16))
            assert torch.isnan(got_k[:, :, 314:]).all()  # nothing written past the tokens
    store.check()
    store.release()


@pytest.mark.gpu
def test_gpu_property_cases_equal_cpu() -> None:
    """Hypothesis cases (NaN payloads, -0.0, denormals, odd B/H/D, crops) stored on the GPU equal the CPU store."""
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    @hypothesis.settings(max_examples=25, deadline=None)
    @hypothesis.given(st.data())
    def check(data: Any) -> None:
        case = _property_case(data.draw, st)
        cpu, n, ref_k, ref_v = _run_property_case(case, "cpu")
        gpu, n_gpu, _, _ = _run_property_case(case, "cuda")
        assert n == n_gpu
        gpu.check()
        _snapshots_equal(cpu.snapshot(n), gpu.snapshot(n))
        b, h, d = case["b"], case["h"], case["d"]
        t = n // (b * h)
        out_k = torch.empty(b, h, t, d, dtype=case["dtype"], device="cuda")
        out_v = torch.empty_like(out_k)
        gpu.fetch(None, t, out_k, out_v)
        assert torch.equal(out_k.cpu().view(torch.int16), ref_k.view(torch.int16))
        assert torch.equal(out_v.cpu().view(torch.int16), ref_v.view(torch.int16))
        gpu.release()

    check()


def _decode_reference(mgr: Any, k: torch.Tensor, v: torch.Tensor, t0: int, steps: int) -> list:
    """Eager decode steps on ``mgr``: each returns what attention gets (fetch all + the new token)."""
    outs = []
    for t in range(t0, t0 + steps):
        buf = mgr.fetch_all(0, extra_tokens=1)
        mgr.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1], into=buf)
        outs.append((buf[0].clone(), buf[1].clone()))
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["auto", "ibp", "exponent"])
def test_gpu_graph_captured_step_bit_exact(chat_kv: Any, codec: str) -> None:
    """A captured decode step replayed 60 times returns what the eager steps return, stores the same bytes (CPU
    store golden), and keeps working while the store adds chunks and slot capacity (small chunks, no reserve)."""
    from ibpcache.cache.kv_manager import KVOffloadManager

    k, v = chat_kv("bf16")
    kd, vd = k.cuda(), v.cuda()
    kw = dict(batch_size=2, codec=codec, host_chunk_bytes=16384)
    # the captured step reads zero-copy: the eager reference reads the same way, so the bytes moved compare too
    eager = KVOffloadManager(1, 3, 64, torch.bfloat16, device="cuda", dense_fetch="zero_copy", **kw)
    graphed = KVOffloadManager(1, 3, 64, torch.bfloat16, device="cuda", **kw)
    golden = KVOffloadManager(1, 3, 64, torch.bfloat16, device="cpu", **kw)
    for mgr, kk, vv in ((eager, kd, vd), (graphed, kd, vd), (golden, k, v)):
        mgr.append(0, kk[:, :, :200], vv[:, :, :200])
    want = _decode_reference(eager, kd, vd, 200, 60)
    _decode_reference(golden, k, v, 200, 60)
    step = graphed.capture_decode_step(0, max_tokens=300)
    for i, t in enumerate(range(200, 260)):
        step.keys_in.copy_(kd[:, :, t : t + 1])
        step.values_in.copy_(vd[:, :, t : t + 1])
        got_k, got_v = step.replay()
        assert got_k.shape == want[i][0].shape
        assert torch.equal(got_k.view(torch.int16), want[i][0].view(torch.int16)), f"keys differ at step {i}"
        assert torch.equal(got_v.view(torch.int16), want[i][1].view(torch.int16)), f"values differ at step {i}"
    assert graphed.seq_length(0) == 260
    ref = golden._layers[0].kv.snapshot(260 * 6)
    _snapshots_equal(ref, graphed._layers[0].kv.snapshot(260 * 6))
    a, b = graphed.stats(), eager.stats()
    assert a["stored_bytes"] == b["stored_bytes"] and a["pcie_read_bytes"] == b["pcie_read_bytes"]
    assert a["decode_steps"] == b["decode_steps"] == 60
    graphed.append(0, kd[:, :, 260:262], vd[:, :, 260:262])  # eager work after replays continues the same store
    assert torch.equal(graphed.fetch_all(0)[0].view(torch.int16), kd[:, :, :262].view(torch.int16))
    with pytest.raises(RuntimeError, match="capture again"):
        step.replay()
    for mgr in (eager, graphed, golden):
        mgr.close()


@pytest.mark.gpu
def test_gpu_decode_steps_never_sync(chat_kv: Any) -> None:
    """Under torch's sync debug mode 'error': eager decode steps (append with the attention copy, dense fetch,
    prefetch/take, a sparse take) and graph replays run without a single host sync, chunks being added included."""
    from ibpcache.cache.kv_manager import KVOffloadManager

    k, v = chat_kv("bf16")
    kd, vd = k.cuda(), v.cuda()
    mgr = KVOffloadManager(2, 3, 64, torch.bfloat16, batch_size=2, device="cuda", host_chunk_bytes=16384)
    for layer in (0, 1):
        mgr.append(layer, kd[:, :, :150], vd[:, :, :150])
    mgr.flush()
    idx = torch.randint(0, 150, (2, 3, 20), device="cuda")
    step = mgr.capture_decode_step(1, max_tokens=314)
    chunks_before = len(mgr._layers[0].kv._chunks)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in range(150, 250):
            mgr.prefetch(0, None, extra_tokens=1)
            buf = mgr.take(0, None, extra_tokens=1)
            mgr.append(0, kd[:, :, t : t + 1], vd[:, :, t : t + 1], into=buf)
            sel = mgr.take(0, idx, extra_tokens=1)
            step.keys_in.copy_(kd[:, :, t : t + 1])
            step.values_in.copy_(vd[:, :, t : t + 1])
            got = step.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(mgr._layers[0].kv._chunks) > chunks_before, "the steps must have added chunks"
    assert torch.equal(buf[0].view(torch.int16), kd[:, :, :250].view(torch.int16))
    assert torch.equal(got[1].view(torch.int16), vd[:, :, :250].view(torch.int16))
    assert torch.equal(sel[0][:, :, :20].view(torch.int16),
                       kd.gather(2, idx[..., None].expand(-1, -1, -1, 64)).view(torch.int16))
    mgr.stats()  # raises if a kernel set a status bit
    mgr.close()


def test_stage_layout_covers_every_stored_byte_aligned() -> None:
    """The bulk copy's plan: chunks below the bound's whole (chunk + margin, laid out as blocks are in host memory),
    the bound's up to where its rows can end (a row's length into its margin at most) plus the decoder's 16 spare
    bytes, none after; 16-byte aligned, never overlapping; copies of blocks adjacent in host memory merge."""
    from ibpcache.cache.append_store import _PAD, chunk_margin, copy_runs, stage_layout

    block = 4096 + chunk_margin(128)
    for n_chunks, bound, want in ((5, 3 * 4096 + 1000, [block] * 3 + [1000 + _PAD]),
                                  (5, 4 * 4096, [block] * 3 + [4096 + _PAD]),
                                  (5, 4 * 4096 + 1, [block] * 4 + [1 + _PAD]),
                                  (1, 7, [7 + _PAD]),
                                  (0, 0, [0]),
                                  (2, 9 * 4096 + 5, [block] * 2)):  # a bound past the chunks that exist
        sizes, offs = stage_layout(n_chunks, 12, 128, bound, block)
        assert sizes.tolist() == want, bound
        assert offs.tolist() == [c * block for c in range(len(want))] and block % 16 == 0
        assert all(sz <= block for sz in sizes)  # inside the chunk and its margin
    sizes, offs = stage_layout(5, 12, 128, 4 * 4096 + 1, block)
    ptrs = [1 << 30, (1 << 30) + block, (1 << 30) + 2 * block, 5 << 30, (5 << 30) + block]
    runs = copy_runs(ptrs, sizes, offs, block)
    assert runs == [(0, ptrs[0], 3 * block), (3 * block, ptrs[3], block + 1 + _PAD)]
    assert sum(n for _, _, n in runs) == int(sizes.sum())
    shuffled = [ptrs[1], ptrs[0], ptrs[2], ptrs[3], ptrs[4]]  # blocks out of order: no merge across them
    assert len(copy_runs(shuffled, sizes, offs, block)) == 4


def test_cursor_bound_keeps_chunks_ahead_of_a_lagging_device() -> None:
    """The CUDA path's host bookkeeping (note_append / the pinned mirror), run against a simulated device that places
    appends at its cursor and publishes the cursor late: every chunk a row lands in already exists, and the host
    holds no more chunks than the worst cases of the appends the mirror has not shown yet need."""
    from collections import deque

    from ibpcache.cache.append_store import AppendStore, chunks_needed
    from ibpcache.codec import Codec

    codec = Codec.raw(torch.bfloat16, (64,))
    rng = np.random.default_rng(0)
    for lag in (0, 1, 7, 40):
        store = AppendStore(codec, codec, "cpu", rows_per_token=6, min_chunk_bytes=4096, max_chunk_bytes=16384)
        assert store.chunk_bytes == 4096
        # the CUDA bookkeeping's fields, as _init_device makes them (the CPU store exact path is not used here)
        store._mirror_np = np.zeros(4, dtype=np.int64)
        store._issued, store._known_seq, store._known_cursor, store._bound = 0, 0, 0, 0
        store._history = deque()
        device_cursor, done, published = 0, 0, []
        for step in range(3000):
            worst = int(rng.integers(1, 4)) * 768  # 1..3 tokens of 6 rows x 128 B
            store.note_append(worst)
            total = int(rng.integers(worst // 2, worst + 1))  # what the rows really took
            device_cursor += total
            need = chunks_needed(device_cursor, 12)
            assert need <= len(store._chunks), f"append {step} reached chunk {need - 1}, which the host never added"
            done += 1
            published.append((done, device_cursor))
            if len(published) > lag:  # the mirror shows the state of `lag` appends ago
                seq, cur = published[-1 - lag]
                store._mirror_np[1], store._mirror_np[0] = seq, cur
            assert len(store._chunks) <= chunks_needed(device_cursor + (lag + 1) * 3 * 768, 12) + 1


# ---------------------------------------------------------------------------------------------------------------
# Sparse reads: raw rows where the measured scattered fetch of coded rows is slower (plan_codecs)


def test_scattered_cost_model_and_choice(chat_kv: Any) -> None:
    """The decision from measured costs (injected here): a coded row costs its stored bytes' transfer plus a decode
    cost and must beat raw rows by the margin; raw wins ties; a layer compressing less than the measured rows pays
    more per byte saved."""
    from ibpcache.cache.plan_codecs import (SCATTERED_MARGIN, ScatteredCost, apply_scattered_cost, choose_row_codecs,
                                            prefer_raw_for_scattered)

    assert 0 < SCATTERED_MARGIN < 0.5
    cost = ScatteredCost(raw_s=10e-9, coded_s=9e-9, coded_ratio=1.5, method="exponent")  # decode 2.33 ns, saves 3.33
    assert prefer_raw_for_scattered(cost, 1.5, margin=0.0) == (False, pytest.approx(9e-9))
    assert prefer_raw_for_scattered(cost, 1.5, margin=0.15)[0] is True  # 9 ns is not 15% below 10: raw
    assert prefer_raw_for_scattered(cost, 1.2, margin=0.0)[0] is True  # 2.33 + 8.33 > 10: raw
    assert prefer_raw_for_scattered(ScatteredCost(10e-9, 10e-9, 1.5, "exponent"), 1.5, margin=0.0)[0] is True  # tie
    fast = ScatteredCost(raw_s=10e-9, coded_s=6e-9, coded_ratio=2.0, method="exponent")  # decode 1 ns, saves 5
    assert prefer_raw_for_scattered(fast, 2.0) == (False, pytest.approx(6e-9))  # 40% faster clears the margin
    assert prefer_raw_for_scattered(fast, 2.0, margin=0.5)[0] is True
    k, _ = chat_kv("bf16", (0, 29))
    choice = choose_row_codecs([_rows(k[:1]).contiguous()], "auto")[0]
    assert choice.method == "exponent"
    kept = apply_scattered_cost(choice, ScatteredCost(10e-9, 7e-9, 1.5, "exponent"))  # 30% faster at this ratio
    assert kept.codec is choice.codec and kept.scattered["chosen"] == "exponent"
    assert kept.scattered["margin"] == SCATTERED_MARGIN
    assert apply_scattered_cost(choice, cost).scattered["chosen"] == "raw"  # 10% faster: within the margin
    assert kept.as_dict()["scattered"]["ratio"] == pytest.approx(choice.sizes["raw"] / choice.sizes["exponent"])
    slow = apply_scattered_cost(choice, ScatteredCost(10e-9, 12e-9, 1.5, "exponent"))
    assert slow.method == "raw" and slow.codec.method == "raw" and slow.scattered["chosen"] == "raw"
    assert slow.sizes == choice.sizes and slow.codec.row_bytes == choice.codec.row_bytes
    assert apply_scattered_cost(choice, None) is choice
    assert apply_scattered_cost(choice, ScatteredCost(1, 2, 1.5, "ibp")) is choice  # measured for another codec


def test_manager_scattered_reads_store_raw_where_decode_costs(chat_kv: Any, monkeypatch: Any) -> None:
    """A sparse-mode manager measures every coded method before the first prompt is stored, asks the measured cost
    per layer and side (faked here: the GPU measures it) and stores raw rows where coded rows fetch slower; reads
    stay exact; stats() reports the comparison."""
    from ibpcache.cache import kv_manager
    from ibpcache.cache.plan_codecs import ScatteredCost

    asked: list = []

    def fake_cost(codec: Any, sample: torch.Tensor, rows_per_token: int, store_bytes: int) -> ScatteredCost:
        asked.append((codec.method, tuple(sample.shape), rows_per_token, store_bytes))
        return ScatteredCost(10e-9, 12e-9, 1.45, codec.method)  # decoding costs more than it saves

    monkeypatch.setattr(kv_manager, "scattered_cost", fake_cost)
    monkeypatch.setattr(kv_manager.KVOffloadManager, "_zero_copy_gpu", lambda self: True)
    k, v = chat_kv("bf16")
    mgr = kv_manager.KVOffloadManager(1, 3, 64, torch.bfloat16, batch_size=2, device="cpu", scattered_reads=True)
    mgr.append(0, k[:, :, :300], v[:, :, :300])
    st = mgr.stats()
    assert st["sparse_reads"] is True and len(asked) == 4 and asked[0][2] == 6
    assert [a[0] for a in asked[:2]] == ["ibp", "exponent"]  # measured up front: every codec the fit may pick
    assert asked[0][1] == (2 * 3 * 300, 64)  # the prompt's first tokens (all of them: fewer rows than sample_rows)
    assert all(a[3] == max(2 * 2 * 3 * 300 * 64 * 2, 1 << 20) for a in asked)  # the prompt's size (>= 1 MiB)
    assert [c["method"] for c in st["codecs"][0]] == ["raw", "raw"] and st["ratio"] == 1.0
    assert all(c["scattered"]["chosen"] == "raw" and c["scattered"]["coded"] == "exponent" for c in st["codecs"][0])
    idx = torch.tensor([[[299, 0, 17]] * 3] * 2)
    assert torch.equal(mgr.fetch(0, idx)[1].view(torch.int16),
                       v.gather(2, idx[..., None].expand(-1, -1, -1, 64)).view(torch.int16))
    dense = kv_manager.KVOffloadManager(1, 3, 64, torch.bfloat16, batch_size=2, device="cpu")
    dense.append(0, k[:, :, :300], v[:, :, :300])
    assert dense.stats()["codecs"][0][0]["method"] == "exponent" and len(asked) == 4  # dense reads: not asked
    named = kv_manager.KVOffloadManager(1, 3, 64, torch.bfloat16, batch_size=2, device="cpu", scattered_reads=True,
                                        codec="exponent")
    named.append(0, k[:, :, :300], v[:, :, :300])
    codecs = named.stats()["codecs"][0]
    assert [c["method"] for c in codecs] == ["exponent"] * 2 and len(asked) == 4  # a named codec: used as named
    assert all("scattered" not in c for c in codecs)


@pytest.mark.gpu
def test_gpu_measured_scattered_cost_and_choice(chat_kv: Any) -> None:
    """On the GPU: the measurement times the store's fetch of selected rows (positive, per row), the coded store of
    real bf16 KV is smaller, and a sparse-mode manager's choice follows the measured model; reads stay exact."""
    from ibpcache.cache.append_store import measure_scattered
    from ibpcache.cache.kv_manager import KVOffloadManager

    k, v = chat_kv("bf16")
    rows = _rows(k).contiguous().cuda()
    cost = measure_scattered(_codec("exponent", k), rows, 6, store_bytes=8 << 20, tokens=100, repeats=3)
    assert cost.raw_s > 0 and cost.coded_s > 0 and cost.coded_ratio > 1.3 and cost.method == "exponent"
    mgr = KVOffloadManager(1, 3, 64, torch.bfloat16, batch_size=2, device="cuda", scattered_reads=True)
    mgr.append(0, k[:, :, :300].cuda(), v[:, :, :300].cuda())
    st = mgr.stats()
    for c in st["codecs"][0]:
        info = c["scattered"]
        assert info["chosen"] == c["method"] in ("raw", "exponent")
        raw_wins = info["coded_ns_per_row_predicted"] >= info["raw_ns_per_row"] * (1 - info["margin"])
        assert info["chosen"] == ("raw" if raw_wins else info["coded"])
    idx = torch.randint(0, 300, (2, 3, 50), device="cuda")
    got = mgr.fetch(0, idx)
    assert torch.equal(got[0].cpu().view(torch.int16),
                       k.gather(2, idx.cpu()[..., None].expand(-1, -1, -1, 64)).view(torch.int16))
    mgr.close()
