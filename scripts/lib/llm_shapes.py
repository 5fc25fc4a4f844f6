"""``scripts/bench_llm.py --shape llama8b|qwen7b|tiny``: KV offload at real model shapes (issues 13 and 23).

A Llama-3.1-8B- or Qwen2.5-7B-shaped decoder is built from a transformers config with random weights, directly on
the device (no download, no CPU init; speed only). Two harnesses (``--harness fill,forward``, both in one process):

``fill`` (the default): the KV caches are not produced by a prefill: every layer's K and V are filled directly
with *real* KV rows of SmolLM2-135M (``llm/*.npz`` in the shared data, scaled up the paper's "SU" way: rows
resampled with replacement, two 64-value rows of the same source token and neighbouring source heads side by side
make one 128-value row; source layer = target layer scaled to SmolLM2's 30). Every method gets the same bytes (same
seeds, same device), appended through its own API (``Cache.update`` of DynamicCache, of the offloaded DynamicCache
and of :class:`IBPOffloadedCache`, whose prompt path appends to :class:`KVOffloadManager`); ``prefill_s`` is the
fill's time: storing the KV without the model.

``forward``: the plain loop a user writes: one prefill forward of seeded random token ids through the model with the
cache (``logits_to_keep=1``; the KV is the random model's own), its argmax is the first token, then greedy decode
steps; the caches are built with the library defaults (no ``reserve_tokens``). ``prefill_s`` is the time to the
first token on the host (TTFT); ``prefill_stored_s`` also waits until the cache holds every prompt row
(``IBPOffloadedCache.flush()`` + a device sync).

In both, decode steps of the real model forward are timed (one new token per sequence, greedy, ``position_ids`` =
the cached length + step).

Methods, one after another in the same process (each store freed, pinned memory returned, before the next):

  dynamic_gpu           ``DynamicCache()`` resident on the device (no offload; skipped where it does not fit)
  hf_offloaded          ``DynamicCache(offloading=True)``: whole layers copied to the GPU and back every step
  infinigen_cpu_gather  InfiniGen's transfer path: CPU gathers rows into pinned staging + one bulk copy
  ibpcache_raw          our manager, raw rows (dense: bulk DMA of the packed chunks; sparse: zero-copy gather)
  ibpcache              our manager, compressed rows (dense: bulk DMA of the packed chunks + GPU decode;
                        sparse: zero-copy gather + decode); ``--dense-fetch zero_copy`` reads dense zero-copy too.
                        Sparse: the planner stores a layer raw unless its coded rows fetch faster (codec "auto")
  ibpcache_exp          forced, not in the default list: ours with ``codec="exponent"`` (bf16/fp16), used as named
                        (sparse: no raw fallback), so the planner's choice can be checked against it

``--paired A,B`` (e.g. ``ibpcache,ibpcache_raw``): after a point's rounds, both caches are filled and decoded in
turn, one step of each, so the two are timed in the same host state (the plain loop's steps are host-bound: the
device runs ~20 of 36-75 ms per Llama-8B sparse step); per-step ratios go to ``point['paired']``.
``--profile-steps N``: in the last round, N more steps per method under an all-threads profile (not timed): host
vs device time per step, the kernels, each thread's launches (``decode_profile``).

Dense mode: every method, lossless, so next-token logits must equal the reference's bit for bit (dynamic_gpu where
it ran, else hf_offloaded, else infinigen_cpu_gather). Sparse mode (InfiniGen-style selection of
``IBPOffloadedCache(mode="sparse")``): infinigen_cpu_gather, ibpcache_raw and ibpcache, which must agree exactly.

Host memory is the hard limit (llama8b, batch 16, 32k tokens = 68.7 GB of KV): a method whose estimated host
memory exceeds ``--max-host-gb`` is skipped with the reason recorded, as is one that would not fit on the GPU,
and runs that would end after ``--deadline-s`` (so a command limit still leaves a complete JSON). Repeats go
round-robin over the methods (alternating direction, so methods sharing pinned block sizes run next to each other;
torch's cached pinned blocks are returned only when the next store would not fit beside them).
``context`` is the number of tokens in the cache after the last decode step: the fill is ``context - steps``, so
every store ends at exactly ``context`` tokens (power-of-two pinned blocks are never exceeded by a few tokens).

Writes ``bench_llm_<shape>.json`` (``points`` in the issue's schema, each with its ``harness``, and per method
``prefill_s``; plus ``records``, ``targets``) and ``.png`` after every run.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ibpcache.testing.timing import add_out_argument, format_table, write_results

# ---------------------------------------------------------------------------------------------------------------
# shapes and methods

SHAPES: dict[str, dict] = {
    "llama8b": dict(
        family="llama", label="Llama-3.1-8B-shaped (random bf16 weights)",
        config=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
        rope=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192),
        batches="16", contexts="8192,32768"),
    "qwen7b": dict(
        family="qwen2", label="Qwen2.5-7B-shaped (random bf16 weights)",
        config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                    bos_token_id=151643, eos_token_id=151645),
        rope=dict(rope_type="default", rope_theta=1000000.0),
        batches="16", contexts="8192,32768"),
    "tiny": dict(
        family="llama", label="tiny 2-layer Llama (random weights; CPU smoke test of the script)",
        config=dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
        rope=dict(rope_type="default", rope_theta=10000.0),
        batches="2", contexts="96"),
}

METHODS: dict[str, str] = {
    "ibpcache": "IBP manager, compressed rows: dense = DMA of packed chunks + GPU decode, sparse = zero-copy (ours)",
    "ibpcache_exp": "IBP manager, exponent-coded rows as named (forced: sparse reads keep them; ours)",
    "ibpcache_raw": "IBP manager, raw rows: dense = DMA of packed chunks, sparse = zero-copy (ours, no compression)",
    "infinigen_cpu_gather": "InfiniGen transfer path: CPU index_select into pinned staging + one bulk copy",
    "hf_offloaded": "transformers DynamicCache(offloading=True): whole layers to the GPU and back every step",
    "dynamic_gpu": "transformers DynamicCache() resident on the device (no offload): the dense reference",
}
ORDER = list(METHODS)  # round-robin order; rounds alternate direction
HARNESSES = ("fill", "forward")
FORCED = ("ibpcache_exp",)  # run only when asked for (--methods)
IBP_CACHES = {  # the methods built as IBPOffloadedCache: their constructor options (the CPU runs use transfer="host")
    "infinigen_cpu_gather": dict(transfer="cpu_gather", compress=False),
    "ibpcache_raw": dict(transfer="zero_copy", compress=False),
    "ibpcache": dict(transfer="zero_copy", compress=True),
    "ibpcache_exp": dict(transfer="zero_copy", compress=True, codec="exponent"),
}
SPARSE_METHODS = tuple(IBP_CACHES)  # sparse attention needs the selection hooks only IBPOffloadedCache has
CUDA_ONLY = ("hf_offloaded", "infinigen_cpu_gather")
PINNED_CLASS = {**{m: "chunks" if own["transfer"] == "zero_copy" else "layer" for m, own in IBP_CACHES.items()},
                "hf_offloaded": "layer", "dynamic_gpu": None}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GB = 1e9


def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def build_config(shape: str) -> Any:
    """The transformers config of ``shape`` (RoPE given the installed version's way)."""
    from transformers import LlamaConfig, Qwen2Config

    spec = SHAPES[shape]
    cls = LlamaConfig if spec["family"] == "llama" else Qwen2Config
    kw = dict(spec["config"])
    rope = dict(spec["rope"])
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:
        kw["rope_parameters"] = rope
    else:  # older transformers: rope_theta + rope_scaling
        kw["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            kw["rope_scaling"] = rope
    return cls(**kw)


def build_model(shape: str, dtype: torch.dtype, device: str, attn: str, seed: int) -> Any:
    """Random-init decoder of ``shape``, created on ``device`` directly (no CPU copy of the weights)."""
    from transformers import AutoModelForCausalLM

    cfg = build_config(shape)
    torch.manual_seed(seed)
    if device == "cuda":
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
        except TypeError:  # transformers that still call it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation=attn)
    return model.to(dtype).eval()


def geometry(cfg: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) as IBPOffloadedCache reads them."""
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(cfg.num_hidden_layers), kv, hd


def kv_layer_tensor_bytes(cfg: Any, batch: int, tokens: int, itemsize: int) -> int:
    """Bytes of one layer's K (or V): [batch, kv heads, tokens, head_dim]."""
    _, h, d = geometry(cfg)
    return batch * h * tokens * d * itemsize


def raw_kv_bytes(cfg: Any, batch: int, tokens: int, itemsize: int) -> int:
    return 2 * geometry(cfg)[0] * kv_layer_tensor_bytes(cfg, batch, tokens, itemsize)


def host_estimate(method: str, cfg: Any, batch: int, context: int, itemsize: int, reserved: bool = True) -> int:
    """Host bytes a method's store takes at ``context`` tokens (torch's pinned allocator rounds blocks to powers of
    two: the offloaded DynamicCache's per-layer tensors and the CPU-gather buffers are such blocks). ``reserved``:
    the caches were given ``reserve_tokens=context``; without, the CPU-gather store sized for the prompt grows by
    1.5x at the first decode step (old and new buffers at once)."""
    layers = geometry(cfg)[0]
    t = kv_layer_tensor_bytes(cfg, batch, context, itemsize)
    if method == "dynamic_gpu":
        return 0
    if method == "hf_offloaded":  # every layer's K and V + the next offload allocated before the old one returns
        return (2 * layers + 2) * _pow2ceil(t)
    if method == "infinigen_cpu_gather":  # one buffer per layer and tensor (+ the grown one without a reserve)
        return 2 * layers * (_pow2ceil(t) + (0 if reserved else _pow2ceil(t * 3 // 2)))
    chunk = 4 << 20  # ZeroCopyKV's host chunks (in-place layout: raw size even when compressed; conservative)
    return 2 * layers * -(-t // chunk) * chunk


# ---------------------------------------------------------------------------------------------------------------
# host memory


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def host_snapshot() -> dict[str, Any]:
    """Process RSS, system memory in use, and the pinned allocator's bytes (GB)."""
    snap: dict[str, Any] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    snap["rss_gb"] = int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    mi = _meminfo()
    if "MemTotal" in mi and "MemAvailable" in mi:
        snap["system_used_gb"] = (mi["MemTotal"] - mi["MemAvailable"]) / GB
        snap["available_gb"] = mi["MemAvailable"] / GB
    if torch.cuda.is_available():
        try:
            st = torch.cuda.host_memory_stats()
            # torch >= 2.9 (at least): allocated_bytes = blocks owned (active + cached), active_bytes = in use
            if "allocated_bytes.current" in st and "active_bytes.current" in st:
                snap["pinned_pool_gb"] = st["allocated_bytes.current"] / GB
                snap["pinned_active_gb"] = st["active_bytes.current"] / GB
            else:
                snap["pinned_stats"] = {k: v for k, v in st.items() if k.endswith(".current")}
        except Exception:  # noqa: BLE001 - older torch without host stats
            pass
    return snap


def release_pinned_pool() -> "str | None":
    """Return torch's cached pinned blocks to the system (the API moved between torch versions)."""
    for owner, name in ((getattr(torch, "accelerator", None), "empty_host_cache"), (torch._C, "_host_emptyCache"),
                        (torch._C, "_accelerator_emptyHostCache")):
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is not None:
            fn()
            return name
    return None


def reserve_tokens(args: argparse.Namespace, harness: str, context: int) -> int:
    """IBPOffloadedCache(reserve_tokens=...) of a run: ``--reserve auto`` gives the fill harness the whole context
    (as it always had) and the forward harness the library default 0 (a user's plain loop); ``context`` / ``none``
    force one for both, to tell the harnesses' other differences (prefill, KV contents) from this one."""
    if args.reserve == "context" or (args.reserve == "auto" and harness == "fill"):
        return context
    return 0


def release_ibpcache_pool() -> int:
    """Give the free blocks of ibpcache's pinned pool back to the system (blocks of live stores stay); bytes freed."""
    from ibpcache.cache.host_pool import host_pool

    return host_pool().trim()


def ibpcache_pool_stats() -> dict:
    """ibpcache's pinned pool (what ours pinned, what is free for the next store, time spent pinning)."""
    from ibpcache.cache.host_pool import host_pool

    return host_pool().stats()


def free_everything(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# the KV contents: real SmolLM2 rows, scaled up


class KvSource:
    """Real SmolLM2-135M K/V rows (head dim 64) resampled into a [B, H, T, D] layer of another model.

    Target layer l reads source layer round(l * 29 / (L - 1)); a target row of (batch b, head h, token t) is the
    concatenation of D/64 source rows of ONE random source token (drawn with replacement per (b, h, t)), from
    source heads h, h+1, ... (mod 3). Seeds depend only on (seed, layer, K/V), so every method gets the same bytes.
    """

    def __init__(self, name: str, dtype: str, device: str, num_layers: int, seed: int,
                 root: "str | None" = None) -> None:
        from ibpcache.datasets import load_kv, shared_data_dir

        self.name, self.device, self.seed = name, device, seed
        try:
            pools = [load_kv(name, which, dtype, root=root, flat=False) for which in ("k", "v")]  # [30, 3, T, 64]
        except FileNotFoundError as exc:
            raise SystemExit(f"real SmolLM2 KV rows not found ({exc}): pass --data-root DIR (the folder holding "
                             "llm/chat_gnn_fp32.npz) or set IBPCACHE_SHARED") from exc
        self.pools = [x.to(device) for x in pools]
        src_layers = self.pools[0].shape[0]
        self.layer_map = [round(l * (src_layers - 1) / max(1, num_layers - 1)) for l in range(num_layers)]
        try:
            self.path = str((root if root is not None else shared_data_dir()) / "llm")
        except (FileNotFoundError, TypeError):
            self.path = str(root)

    def describe(self) -> dict:
        src = self.pools[0]
        return {"source": f"SmolLM2-135M real KV, data set {self.name!r} ({self.path})",
                "source_shape": list(src.shape), "source_dtype": str(src.dtype),
                "method": "SU scale-up: per (b, h, t) one source token drawn with replacement; D/64 source rows of "
                          "that token (source heads h, h+1, .. mod 3) side by side; target layer l <- source layer "
                          "round(l * 29 / (L - 1)); deterministic per (seed, layer, K/V), identical for every method",
                "layer_map": self.layer_map}

    def make(self, layer: int, which: int, batch: int, heads: int, tokens: int, head_dim: int) -> torch.Tensor:
        pool = self.pools[which][self.layer_map[layer]]  # [Hs, Ts, d0]
        hs, ts, d0 = pool.shape
        flat = pool.reshape(hs * ts, d0)
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + 2 * layer + which)
        tok = torch.randint(ts, (batch, heads, tokens), generator=gen, device=self.device)
        parts = []
        for p in range(-(-head_dim // d0)):
            src_head = (torch.arange(heads, device=self.device) + p) % hs
            parts.append(flat[src_head.view(1, heads, 1) * ts + tok])
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out[..., :head_dim].contiguous()


# ---------------------------------------------------------------------------------------------------------------
# one run: build a method's cache, fill it, time decode steps, read its stats, free it


@dataclass
class RunOut:
    step_ms: list = field(default_factory=list)  # CUDA-event times of the timed steps (wall on CPU)
    wall_ms: list = field(default_factory=list)
    tokens: "torch.Tensor | None" = None  # [B, steps] every step, warm-up included
    logits: "list | None" = None  # per step [B, V] on the CPU (kept for verification)
    digest: float = 0.0
    fill_s: float = 0.0  # fill harness: the fill; forward: the prefill until every prompt row is stored
    prefill_s: float = 0.0  # fill harness: the fill; forward: the prefill forward until the first token is on the host
    fill_checksum: float = 0.0
    stats: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    pinned: str = ""
    run_s: float = 0.0
    pool: dict = field(default_factory=dict)  # ibpcache's pinned pool during the run: bytes pinned, pin seconds
    profile: "dict | None" = None  # profile_decode of the steps after the timed ones (--profile-steps)
    decode_unix: tuple = ()  # wall-clock start and end of the decode steps (to line runs up with system samples)


def ibp_kwargs(args: argparse.Namespace) -> dict:
    """Optional constructor options of the installed IBPOffloadedCache (read with a fallback: branch kvlib may add
    ``codec``)."""
    from ibpcache.loaders.kv import IBPOffloadedCache

    params = inspect.signature(IBPOffloadedCache.__init__).parameters
    kw = {}
    if args.codec and "codec" in params:
        kw["codec"] = args.codec
    return kw


def make_cache(method: str, mode: str, model: Any, args: argparse.Namespace, reserve: int) -> Any:
    """A method's cache; ``reserve``: IBPOffloadedCache(reserve_tokens=...) (the forward harness passes 0, the
    library default, as a user's plain loop would)."""
    from transformers import DynamicCache

    if method == "dynamic_gpu":
        return DynamicCache(config=model.config)
    if method == "hf_offloaded":
        return DynamicCache(config=model.config, offloading=True)
    from ibpcache.loaders.kv import IBPOffloadedCache

    own = IBP_CACHES[method]
    transfer, compress = own["transfer"], own["compress"]
    if args.device == "cpu":
        transfer = "host"  # the Numba host path stands in on machines without CUDA
    kw: dict = dict(compress=compress, transfer=transfer, reserve_tokens=reserve, sample_rows=args.sample_rows,
                    chunk_bytes=args.chunk_bytes if args.chunk_bytes.startswith("auto") else int(args.chunk_bytes),
                    count_bytes=args.count_bytes, dense_fetch=args.dense_fetch)
    if transfer == "zero_copy" and "prefill" in inspect.signature(IBPOffloadedCache.__init__).parameters:
        kw["prefill"] = args.prefill
    if compress:
        kw.update(ibp_kwargs(args))
    if "codec" in own:  # a forced method's codec, over --codec
        kw["codec"] = own["codec"]
    if mode == "sparse":
        kw.update(model=model, alpha=args.alpha, partial_ratio=args.partial_ratio, max_num_kv=args.max_num_kv)
        if args.no_graphs:
            kw["graphs"] = False
    return IBPOffloadedCache(model.config, mode=mode, **kw)


def _set_prefill_query(cache: Any, layer: int, q: torch.Tensor) -> None:
    """Sparse mode's prompt path reads the prompt's query states, which its decoder-layer hook stores during a real
    prefill. We fill without a prefill, so we hand it the queries the model itself projects (the one place this
    script touches a private attribute of IBPOffloadedCache)."""
    slot = getattr(cache, "_prefill_q", None)
    if not isinstance(slot, dict):
        raise RuntimeError("this IBPOffloadedCache has no _prefill_q: the direct fill cannot seed sparse mode")
    slot[layer] = q


def probe_queries(model: Any, batch: int, filled: int, n: int, device: str, seed: int) -> list:
    """Per layer, the query states [B, Hq, n, D] the model projects for the last ``n`` prompt positions from the
    embeddings of random tokens (sparse mode uses them to choose its partial key dimensions)."""
    from ibpcache.loaders._kv_model import project_query

    g = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(model.config.vocab_size, (batch, n), generator=g).to(device)
    pos = (torch.arange(n, device=device) + (filled - n)).view(1, -1).expand(batch, -1)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with torch.no_grad():
        hidden = model.get_input_embeddings()(ids)
        emb = decoder.rotary_emb(hidden, pos)
        return [project_query(layer, hidden, emb) for layer in decoder.layers]


def fill_cache(cache: Any, method: str, mode: str, model: Any, src: KvSource, batch: int, filled: int,
               args: argparse.Namespace) -> float:
    """Append ``filled`` tokens of every layer through the cache's own ``update``; returns a checksum of the bytes."""
    layers, heads, hd = geometry(model.config)
    queries = None
    if mode == "sparse":
        queries = probe_queries(model, batch, filled, min(args.probe_tokens, filled), args.device, args.seed)
    checksum = 0.0
    with torch.no_grad():
        for layer in range(layers):
            k = src.make(layer, 0, batch, heads, filled, hd)
            v = src.make(layer, 1, batch, heads, filled, hd)
            if layer in (0, layers - 1):
                checksum += float(k.sum(dtype=torch.float32)) + float(v.sum(dtype=torch.float32))
            if queries is not None:
                _set_prefill_query(cache, layer, queries[layer])
            if layer == layers - 1 and k.is_cuda:
                # Every earlier layer's copy to the host has landed before the last update starts layer 0's
                # prefetch (transformers <= 5.17's offloaded cache does not order its prefetch after them).
                torch.cuda.synchronize()
            cache.update(k, v, layer)
            del k, v
    return checksum


def prompt_ids(vocab: int, batch: int, n: int, seed: int, device: str) -> torch.Tensor:
    """[batch, n] seeded random token ids (the same for every method of a point)."""
    g = torch.Generator().manual_seed(seed * 7919 + n * 31 + batch)
    return torch.randint(vocab, (batch, n), generator=g).to(device)


def prefill_forward(model: Any, cache: Any, ids: torch.Tensor, device: str) -> "tuple[torch.Tensor, torch.Tensor, float, float]":
    """One prefill forward of ``ids`` through ``model`` with ``cache`` (``logits_to_keep=1``), greedy first token.

    Returns (first token [B, 1] on the device, its logits [B, V] on the CPU, seconds until the token is on the host,
    seconds until the cache also holds every prompt row: ``cache.flush()`` where the cache has it, then a device
    sync)."""
    fk = _forward_kwargs(model)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids, **{fk["cache_key"]: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
        tok = logits.argmax(dim=-1, keepdim=True)
        host = torch.cat((tok.view(-1).to(logits.dtype), logits.view(-1))).cpu()  # one copy: token and logits
    first_s = time.perf_counter() - t0
    if hasattr(cache, "flush"):
        cache.flush()
    if cuda:
        torch.cuda.synchronize()
    stored_s = time.perf_counter() - t0
    return tok, host[tok.numel():].view(logits.shape), first_s, stored_s


def _forward_kwargs(model: Any) -> dict:
    params = inspect.signature(model.forward).parameters
    return {"cache_key": "cache" if "cache" in params else "past_key_values",
            "cache_position": "cache_position" in params}


def _step_kwargs(fk: dict, cache: Any, b: int, position: int, device: str) -> dict:
    """Keyword arguments of one decode forward of ``b`` sequences at ``position``."""
    pos = torch.full((b, 1), position, dtype=torch.long, device=device)
    kw = {fk["cache_key"]: cache, "position_ids": pos, "use_cache": True, "logits_to_keep": 1}
    if fk["cache_position"]:
        kw["cache_position"] = pos[0]
    return kw


def _timed_step(model: Any, tok: torch.Tensor, kw: dict, cuda: bool) -> "tuple[torch.Tensor, float, float]":
    """One greedy decode forward, alone on the device (synced before and after): (its last logits [B, V], CUDA-event
    ms (wall ms without CUDA), wall ms)."""
    if cuda:
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        ev0.record()
    t0 = time.perf_counter()
    logits = model(input_ids=tok, **kw).logits[:, -1]
    if cuda:
        ev1.record()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    return logits, (ev0.elapsed_time(ev1) if cuda else wall), wall


def decode(model: Any, cache: Any, first: torch.Tensor, filled: int, steps: int, warmup: int, keep_logits: bool,
           device: str, profile_steps: int = 0) -> RunOut:
    """``steps`` greedy decode steps after ``filled`` cached tokens; the first ``warmup`` are not timed.
    ``profile_steps``: that many more steps after them, profiled (:func:`profile_decode`; not timed, not verified)."""
    fk = _forward_kwargs(model)
    cuda = device == "cuda"
    out = RunOut(logits=[] if keep_logits else None)
    tok = first
    toks, digest = [], 0.0
    started = time.time()
    with torch.no_grad():
        for s in range(steps):
            logits, ms, wall = _timed_step(model, tok, _step_kwargs(fk, cache, tok.shape[0], filled + s, device), cuda)
            tok = logits.argmax(dim=-1, keepdim=True)
            if s >= warmup:
                out.wall_ms.append(wall)
                out.step_ms.append(ms)
            toks.append(tok.cpu())
            lg = logits.cpu()
            digest += float(lg.double().sum())
            if keep_logits:
                out.logits.append(lg)
    out.tokens = torch.cat(toks, dim=1)
    out.digest = digest
    out.decode_unix = (started, time.time())
    if profile_steps > 0:
        out.profile = profile_decode(model, cache, tok, filled + steps, profile_steps, device)
    return out


def profile_decode(model: Any, cache: Any, tok: torch.Tensor, position: int, steps: int, device: str) -> dict:
    """Where ``steps`` decode steps' time goes: each step runs in a stage window of a profile that records every
    thread (a cache's workers compete with the model's launches for the host), so a step that is host-bound (the
    device idle between launches) reads apart from one the device bounds (kernels back to back), and the kernels
    that take the device's time are named.

    Per step (milliseconds, means): ``wall_ms`` (the window, a device sync at its end), ``kernel_ms``/``copy_ms``
    (union of kernels, of copies), ``host_wait_ms`` (the host in blocking CUDA calls); ``top_device_ms``: device
    time per step by kernel; ``threads``: :func:`ibpcache.testing.stages.thread_summary` (host time, launches per
    thread)."""
    from collections import Counter

    from ibpcache.testing.stages import WINDOW_PREFIX, StageProfile, thread_summary

    fk = _forward_kwargs(model)
    with torch.no_grad(), StageProfile(device, all_threads=True) as prof:
        for s in range(steps):
            with prof.stage("decode"):
                logits = model(input_ids=tok, **_step_kwargs(fk, cache, tok.shape[0], position + s, device))
                tok = logits.logits[:, -1].argmax(dim=-1, keepdim=True)
    busy = prof.result()["decode"]
    kernels: Counter = Counter()
    for name, on_device, start, end, _activity in prof.spans:
        if on_device and not name.startswith(WINDOW_PREFIX):
            kernels[name[:120]] += (end - start) / 1e3 / steps
    return {"steps": steps, "wall_ms": busy.wall_ms / steps, "kernel_ms": busy.kernel_ms / steps,
            "copy_ms": busy.copy_ms / steps, "host_wait_ms": busy.wait_ms / steps,
            "top_device_ms": [{"name": n, "ms_per_step": round(ms, 3)} for n, ms in kernels.most_common(12)],
            "threads": thread_summary(prof.finished.events(), top=10)}


def paired_decode(model: Any, caches: list, firsts: list, filled: int, steps: int, warmup: int,
                  device: str) -> "tuple[list, list]":
    """Greedy decode steps of several caches, one step of each in turn (the order reversed every step), each timed
    alone (a device sync before it; CUDA events around it). Why: the plain loop's steps are bound by the host's
    launch rate, which drifts by up to 2x over seconds on a shared machine (docs/results/2026-11-26-h200-s32), so
    two methods timed one after another compare host states, not caches; steps taken in turn see the same one.
    Returns (per cache the timed steps' ms, per cache its tokens [B, steps], wall-clock start and end)."""
    fk = _forward_kwargs(model)
    cuda = device == "cuda"
    toks = list(firsts)
    ms: list = [[] for _ in caches]
    seen: list = [[] for _ in caches]
    started = time.time()
    with torch.no_grad():
        for s in range(steps):
            for i in (range(len(caches)) if s % 2 == 0 else reversed(range(len(caches)))):
                kw = _step_kwargs(fk, caches[i], toks[i].shape[0], filled + s, device)
                logits, step_ms, _wall = _timed_step(model, toks[i], kw, cuda)
                toks[i] = logits.argmax(dim=-1, keepdim=True)
                if s >= warmup:
                    ms[i].append(step_ms)
                seen[i].append(toks[i].cpu())
    return ms, [torch.cat(t, dim=1) for t in seen], (started, time.time())


def run_paired(methods: list, mode: str, model: Any, src: KvSource, batch: int, context: int,
               args: argparse.Namespace, first: torch.Tensor, steps: int, harness: str) -> dict:
    """Both methods' caches filled (forward: the same prompt's prefill through each), then their decode steps taken
    in turn (:func:`paired_decode`); per-step ratios of the first method's time over the second's."""
    filled = context - steps
    caches: list = []
    firsts: list = []
    prefill: dict = {}
    try:
        for method in methods:
            cache = make_cache(method, mode, model, args, reserve_tokens(args, harness, context))
            caches.append(cache)
            tok, _logits, prefill_s, _stored_s, _sum = fill_for(cache, method, mode, model, src, batch, filled, args,
                                                                harness, first)
            if harness == "forward":
                prefill[method] = prefill_s
            firsts.append(tok)
        ms, tokens, span = paired_decode(model, caches, firsts, filled, steps, args.warmup_tokens, args.device)
    finally:
        for cache in caches:
            if hasattr(cache, "close"):
                cache.close()
        caches.clear()
        free_everything(args.device)
    return {"built_first": methods[0], "ms": dict(zip(methods, ms)), "prefill_s": prefill, "decode_unix": span,
            "tokens_equal": all(torch.equal(t, tokens[0]) for t in tokens), "_tokens": dict(zip(methods, tokens))}


def same_tokens_as_runs(tokens: dict, runs: dict, harness: str) -> "bool | None":
    """Whether each method's paired decode produced the tokens of its own round-robin run (verified against the
    point's reference there); None where a method has no such run. The forward harness's runs also hold the
    prefill's token, first."""
    verdicts = []
    for method, got in tokens.items():
        ref = next((r for r in runs.get(method, []) if isinstance(r, RunOut)), None)
        if ref is None or ref.tokens is None:
            return None
        want = ref.tokens[:, 1:] if harness == "forward" else ref.tokens
        verdicts.append(torch.equal(got, want))
    return all(verdicts)


def paired_summary(rounds: list, a: str, b: str) -> dict:
    """``a`` over ``b`` from :func:`run_paired` rounds: the median and spread of the per-step ratios (steps taken
    in turn), the ratio of the median steps, per round and over all."""
    ratios = [x / y for r in rounds for x, y in zip(r["ms"][a], r["ms"][b])]
    steps_a = [x for r in rounds for x in r["ms"][a]]
    steps_b = [y for r in rounds for y in r["ms"][b]]
    return {"methods": [a, b], "rounds": rounds, "steps": len(ratios),
            "ms_per_token": {a: _median(steps_a), b: _median(steps_b)},
            "ratio_step_median": _median(ratios), "ratio_p10": _pct(ratios, 0.1), "ratio_p90": _pct(ratios, 0.9),
            "ratio_of_medians": _median(steps_a) / _median(steps_b) if steps_b else None,
            "ratio_by_round": [_median([x / y for x, y in zip(r["ms"][a], r["ms"][b])]) for r in rounds],
            "tokens_equal": all(r["tokens_equal"] for r in rounds),
            "tokens_equal_runs": (None if any(r.get("tokens_equal_runs") is None for r in rounds)
                                  else all(r["tokens_equal_runs"] for r in rounds))}


def cache_stats(cache: Any, method: str, cfg: Any, batch: int, tokens: int, itemsize: int,
                count_bytes: bool = False) -> dict:
    """Store size and traffic of a method's cache after its decode steps."""
    raw = raw_kv_bytes(cfg, batch, tokens, itemsize)
    st: dict = {"raw_bytes": raw}
    if method in ("dynamic_gpu", "hf_offloaded"):
        host = blocks = gpu = 0
        for layer in cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is None or t.numel() == 0:
                    continue
                n = t.numel() * t.element_size()
                if method == "hf_offloaded":  # the layer prefetched for the next step counts as host-resident
                    host += n
                    blocks += _pow2ceil(n)
                else:
                    gpu += n
        st.update(host_bytes=host, host_pinned_block_bytes=blocks or None, gpu_kv_bytes=gpu, stored_bytes=raw,
                  ratio=1.0)
        if method == "hf_offloaded":  # every layer goes up whole and comes back whole, every step
            st.update(pcie_h2d_bytes_per_step=raw, pcie_d2h_bytes_per_step=raw, pcie_bytes_exact=False)
        else:
            st.update(pcie_h2d_bytes_per_step=0, pcie_d2h_bytes_per_step=0, pcie_bytes_exact=True)
        return st
    s = cache.stats()
    for key in ("host_bytes", "gpu_bytes", "stored_bytes", "ratio", "fit_s", "decode_steps", "partial_key_bytes",
                "selected_k_last", "transfer", "compress", "codec", "codecs", "host_layout", "dense_fetch",
                "graph_captures", "graph_replays", "append_graph_replays", "graph_eager_speculations",
                "host_slack_allowed_bytes", "chunk_bytes", "prefill", "sparse_reads"):
        if key in s:
            st[key] = s[key]
    st["manager_raw_bytes"] = s.get("raw_bytes")
    if cache.mode == "sparse":
        ks = list(s.get("selected_k_last") or [])
        st["mean_selected_k"] = statistics.mean(ks) if ks else None
        # 0 everywhere: the decoder-layer hooks never selected (e.g. a transformers that passes the cache to the
        # layers under another keyword), so every step fetched all tokens: not a sparse measurement
        st["sparse_selection_active"] = any(k > 0 for k in ks)
    # the CPU-gather path and dense bulk copies count their bytes on the host; the zero-copy kernels only with
    # count_bytes=True
    exact = method == "infinigen_cpu_gather" or count_bytes or (
        cache.mode == "dense" and s.get("dense_fetch") == "bulk" and s.get("transfer") == "zero_copy")
    if exact and s.get("pcie_read_bytes_per_step") is not None:
        st["pcie_h2d_bytes_per_step"] = s["pcie_read_bytes_per_step"]
    elif cache.mode == "dense":  # every stored byte crosses once per step
        st["pcie_h2d_bytes_per_step"] = s.get("stored_bytes")
    else:  # the selected rows of every layer, at the store's mean stored row size
        _, h, d = geometry(cfg)
        share = (s.get("stored_bytes") or 0) / max(1, s.get("raw_bytes") or 1)
        st["pcie_h2d_bytes_per_step"] = sum(2 * k * batch * h * d * itemsize * share
                                            for k in s.get("selected_k_last", []))
    st["pcie_d2h_bytes_per_step"] = 2 * geometry(cfg)[0] * batch * geometry(cfg)[1] * geometry(cfg)[2] * itemsize
    st["pcie_bytes_exact"] = bool(exact)
    return st


def gpu_need(method: str, mode: str, cfg: Any, batch: int, context: int, itemsize: int,
             dense_fetch: str = "bulk") -> int:
    """GPU bytes a run needs beyond the weights: the resident KV (dynamic_gpu), about six layer tensors of attention
    buffers and prefetches, 3 GB of headroom, and for ours in dense bulk mode two staging copies of a whole layer's
    chunks in flight (K and V, at most their raw size)."""
    layer = kv_layer_tensor_bytes(cfg, batch, context, itemsize)
    need = (raw_kv_bytes(cfg, batch, context, itemsize) if method == "dynamic_gpu" else 0) + 6 * layer + (3 << 30)
    if IBP_CACHES.get(method, {}).get("transfer") == "zero_copy" and mode == "dense" and dense_fetch == "bulk":
        need += 2 * 2 * layer
    return need


def gpu_fits(method: str, mode: str, cfg: Any, batch: int, context: int, itemsize: int, device: str,
             dense_fetch: str = "bulk") -> "str | None":
    """None when the method's GPU needs fit in free device memory, else the reason."""
    if device != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info()
    need = gpu_need(method, mode, cfg, batch, context, itemsize, dense_fetch)
    if need > free:
        return f"needs ~{need / GB:.1f} GB of GPU memory, {free / GB:.1f} GB free"
    return None


# ---------------------------------------------------------------------------------------------------------------
# the sweep


class Deadline:
    """Skips runs that would end after ``limit_s`` (seconds since start), from rates measured so far."""

    def __init__(self, limit_s: float) -> None:
        self.t0 = time.perf_counter()
        self.limit = limit_s
        self.rates: dict = {}  # method -> (s per GB filled, s per GB-step decoded)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def estimate(self, method: str, fill_gb: float, steps: int, step_gb: float) -> float:
        fill_rate, step_rate = self.rates.get(method, (1 / 4.0, 1 / 20.0))  # guesses: 4 GB/s fill, 20 GB/s decode
        return 2.0 + fill_gb * fill_rate + steps * step_gb * step_rate

    def learn(self, method: str, fill_gb: float, fill_s: float, steps: int, step_gb: float, decode_s: float) -> None:
        old = self.rates.get(method, (1 / 4.0, 1 / 20.0))
        self.rates[method] = (fill_s / fill_gb if fill_gb > 0.5 else old[0],
                              decode_s / (steps * step_gb) if step_gb > 0.5 and steps else old[1])

    def skip_reason(self, est: float) -> "str | None":
        if self.elapsed() + est > self.limit:
            return f"deadline: {self.elapsed():.0f} s spent, this run ~{est:.0f} s, limit {self.limit:.0f} s"
        return None


def fill_for(cache: Any, method: str, mode: str, model: Any, src: KvSource, batch: int, filled: int,
             args: argparse.Namespace, harness: str, first: torch.Tensor
             ) -> "tuple[torch.Tensor, torch.Tensor | None, float, float, float]":
    """A cache's ``filled`` prompt tokens: the forward harness's prefill (its first token and logits), or the fill
    harness's direct fill (``first`` given). Returns (first token, prefill logits or None, seconds to the first
    token, seconds until every row is stored, checksum of what went in)."""
    if harness == "forward":
        ids = prompt_ids(model.config.vocab_size, batch, filled, args.seed, args.device)
        tok, logits, prefill_s, fill_s = prefill_forward(model, cache, ids, args.device)
        return tok, logits, prefill_s, fill_s, float(ids.sum())
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    checksum = fill_cache(cache, method, mode, model, src, batch, filled, args)
    if hasattr(cache, "flush"):
        cache.flush()
    if args.device == "cuda":
        torch.cuda.synchronize()
    fill_s = time.perf_counter() - t0
    return first, None, fill_s, fill_s, checksum


def run_method(method: str, mode: str, model: Any, src: KvSource, batch: int, context: int,
               args: argparse.Namespace, keep_logits: bool, first: torch.Tensor, steps: int,
               harness: str = "fill", profile_steps: int = 0) -> RunOut:
    filled = context - steps
    pool0 = ibpcache_pool_stats()
    cache = make_cache(method, mode, model, args, reserve_tokens(args, harness, context))
    try:
        first, prefill_logits, prefill_s, fill_s, checksum = fill_for(cache, method, mode, model, src, batch, filled,
                                                                      args, harness, first)
        host_after_fill = host_snapshot()
        out = decode(model, cache, first, filled, steps, args.warmup_tokens, keep_logits, args.device, profile_steps)
        if harness == "forward":  # verification covers the prefill's token and logits too (step 0)
            out.tokens = torch.cat((first.cpu(), out.tokens), dim=1)
            if out.logits is not None:
                out.logits.insert(0, prefill_logits)
        out.fill_s, out.prefill_s, out.fill_checksum = fill_s, prefill_s, checksum
        pool1 = ibpcache_pool_stats()
        out.pool = {"pinned_bytes_added": pool1["pinned_bytes"] - pool0["pinned_bytes"],
                    "pin_s": pool1["pin_s"] - pool0["pin_s"], "take_wait_s": pool1["take_wait_s"] - pool0["take_wait_s"],
                    "free_bytes_before": pool0["free_bytes"]}
        itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
        out.stats = cache_stats(cache, method, model.config, batch, context, itemsize,
                                args.count_bytes or args.device == "cpu")  # the host path counts its bytes
        out.host = {"after_fill": host_after_fill, "after_decode": host_snapshot()}
        return out
    finally:
        if hasattr(cache, "close"):
            cache.close()
        del cache
        free_everything(args.device)


def agreement(out: RunOut, ref: RunOut) -> dict:
    """Tokens and logits of two runs (every step, warm-up included)."""
    same_tok = torch.equal(out.tokens, ref.tokens)
    steps_differ = (out.tokens != ref.tokens).any(dim=0)
    first_diff = int(steps_differ.int().argmax()) if bool(steps_differ.any()) else None
    res: dict = {"tokens_equal": bool(same_tok), "first_diff_step": first_diff}
    if out.logits is not None and ref.logits is not None:
        res["logits_equal"] = all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
        res["max_abs_logit_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out.logits,
                                                                                                      ref.logits))
    return res


def _median(xs: list) -> "float | None":
    return statistics.median(xs) if xs else None


def _pct(xs: list, q: float) -> "float | None":
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize_point(point: dict, runs: dict, skipped: dict, args: argparse.Namespace) -> None:
    """Fill ``point['methods']`` from the runs of every round, verify outputs, compute the targets."""
    mode = point["mode"]
    for method, reasons in skipped.items():
        if method not in runs:
            point["methods"][method] = {"label": METHODS[method], "skipped": reasons[0].split(": ", 1)[1],
                                        "skipped_rounds": reasons}
    for method, rounds in runs.items():
        done = [r for r in rounds if isinstance(r, RunOut)]
        errors = [r for r in rounds if isinstance(r, str)]
        rec: dict = {"label": METHODS[method]}
        if errors:
            rec["errors"] = errors
        if method in skipped:
            rec["skipped_rounds"] = skipped[method]
        if done:
            steps = [s for r in done for s in r.step_ms]
            rec.update(
                ms_per_token=_median(steps), p10_ms=_pct(steps, 0.1), p90_ms=_pct(steps, 0.9),
                wall_ms_per_token=_median([s for r in done for s in r.wall_ms]),
                ms_per_round=[_median(r.step_ms) for r in done], rounds=len(done),
                round_index=[i for i, r in enumerate(rounds) if isinstance(r, RunOut)],
                steps_ms_per_round=[r.step_ms for r in done],
                fill_s_per_round=[r.fill_s for r in done], run_s_per_round=[r.run_s for r in done],
                prefill_s=_median([r.prefill_s for r in done]), prefill_s_per_round=[r.prefill_s for r in done],
                prefill_stored_s=_median([r.fill_s for r in done]),
                host_pool_per_round=[r.pool for r in done], decode_unix_per_round=[r.decode_unix for r in done],
                pinned_pool_per_round=[r.pinned for r in done],
                fill_checksum=done[0].fill_checksum,
                repeat_outputs_identical=len({round(r.digest, 6) for r in done}) == 1
                and all(torch.equal(r.tokens, done[0].tokens) for r in done),
                host=done[-1].host, **done[-1].stats)
            profiled = [r.profile for r in done if r.profile is not None]
            if profiled:
                rec["decode_profile"] = profiled[-1]
            if rec.get("raw_bytes") and rec.get("ratio"):
                rec["host_bytes_over_raw_div_ratio"] = (rec.get("host_bytes") or 0) * rec["ratio"] / rec["raw_bytes"]
            if rec.get("host_slack_allowed_bytes") is not None:  # ours: the free part of one chunk per layer
                rec["host_slack_bytes"] = (rec.get("host_bytes") or 0) - (rec.get("stored_bytes") or 0)
            rec["host_store_gb"] = (rec.get("host_bytes") or 0) / GB
        point["methods"][method] = rec
    # verification: dense against the first reference that ran; sparse: every path against the first sparse one
    firsts = {m: next((r for r in rounds if isinstance(r, RunOut)), None) for m, rounds in runs.items()}
    refs = ("dynamic_gpu", "hf_offloaded", "infinigen_cpu_gather") if mode == "dense" else \
        ("infinigen_cpu_gather", "ibpcache_raw", "ibpcache")
    ref = next((m for m in refs if firsts.get(m) is not None), None)
    point["verification"] = {"reference": ref}
    if mode == "sparse":
        point["verification"]["sparse_selection_active"] = {
            mm: r.get("sparse_selection_active") for mm, r in point["methods"].items() if "ms_per_token" in r}
    checksums = {m: o.fill_checksum for m, o in firsts.items() if o is not None}
    point["verification"]["same_fill_bytes_checksum"] = len(set(checksums.values())) <= 1
    if ref is not None:
        for m, o in firsts.items():
            if o is None:
                continue
            agr = agreement(o, firsts[ref])
            if mode == "sparse" and point["methods"][m].get("sparse_selection_active") is False:
                point["methods"][m]["warning"] = ("sparse selection never ran (selected_k_last all 0): this run "
                                                  "fetched every token, its time is not a sparse measurement")
            point["methods"][m].update(agr, reference=ref)
            if mode == "sparse" and m != ref:
                sel, ref_sel = point["methods"][m].get("selected_k_last"), point["methods"][ref].get("selected_k_last")
                point["methods"][m]["selected_k_equal"] = sel == ref_sel
    point["targets"] = targets(point, args)


def targets(point: dict, args: argparse.Namespace) -> dict:
    """The issue's targets for this point, computed from the measurements (paired by round where possible)."""
    m = point["methods"]
    out: dict = {}

    def pair(ours: str, base: str) -> "dict | None":
        a, b = m.get(ours, {}), m.get(base, {})
        if not a.get("ms_per_token") or not b.get("ms_per_token"):
            return None
        ra = dict(zip(a["round_index"], a["ms_per_round"]))
        rb = dict(zip(b["round_index"], b["ms_per_round"]))
        per_round = [ra[i] / rb[i] for i in sorted(ra) if i in rb]
        return {"ratio": a["ms_per_token"] / b["ms_per_token"], "ratio_by_round": per_round,
                "ratio_round_median": _median(per_round), "rounds": len(per_round)}

    def prefill_pair(ours: str, base: str) -> "dict | None":
        a, b = m.get(ours, {}), m.get(base, {})
        if not a.get("prefill_s") or not b.get("prefill_s"):
            return None
        ra = dict(zip(a["round_index"], a["prefill_s_per_round"]))
        rb = dict(zip(b["round_index"], b["prefill_s_per_round"]))
        per_round = [ra[i] / rb[i] for i in sorted(ra) if i in rb]
        stored = (a["prefill_stored_s"] / b["prefill_stored_s"]) if b.get("prefill_stored_s") else None
        return {"ratio": a["prefill_s"] / b["prefill_s"], "ratio_by_round": per_round, "stored_ratio": stored}

    for base, bound in (("ibpcache_raw", 1.15), ("hf_offloaded", 1.0)):
        p = prefill_pair("ibpcache", base)
        if p is not None:
            out[f"prefill_ibpcache_over_{base}"] = dict(
                p, want=f"ibpcache prefill <= {bound} x {base}", met=p["ratio"] <= bound,
                met_every_round=all(r <= bound for r in p["ratio_by_round"]),
                met_stored=p["stored_ratio"] is not None and p["stored_ratio"] <= bound)

    if point["mode"] == "dense":
        for ours in ("ibpcache", "ibpcache_raw"):
            for base in ("hf_offloaded", "infinigen_cpu_gather", "dynamic_gpu"):
                p = pair(ours, base)
                if p is not None:
                    out[f"{ours}_over_{base}"] = p
        p = out.get("ibpcache_over_hf_offloaded")
        if p is not None:
            out["dense_target"] = {"want": "ibpcache ms/token <= 0.25 x hf_offloaded", "value": p["ratio"],
                                   "met": p["ratio"] <= 0.25,
                                   "met_every_round": all(r <= 0.25 for r in p["ratio_by_round"])}
    else:
        for ours in ("ibpcache", "ibpcache_raw"):
            p = pair(ours, "infinigen_cpu_gather")
            if p is not None:
                p["reduction"] = 1 - p["ratio"]
                p["reduction_by_round"] = [1 - r for r in p["ratio_by_round"]]
                out[f"{ours}_vs_infinigen_cpu_gather"] = p
        p = out.get("ibpcache_vs_infinigen_cpu_gather")
        if p is not None:
            active = all(m.get(x, {}).get("sparse_selection_active") is not False
                         for x in ("ibpcache", "infinigen_cpu_gather"))
            out["sparse_target"] = {"want": ">= 25% below infinigen_cpu_gather over >= 3 round-robin repeats",
                                    "value": p["reduction"], "rounds": p["rounds"], "selection_active": active,
                                    "met": p["reduction"] >= 0.25 and p["rounds"] >= 3 and active,
                                    "met_every_round": all(r >= 0.25 for r in p["reduction_by_round"])}
        p = pair("ibpcache_exp", "ibpcache_raw")
        if p is not None:
            out["ibpcache_exp_over_ibpcache_raw"] = p  # the forced codec: what the planner's raw fallback avoids
        p = pair("ibpcache", "ibpcache_raw")
        if p is not None:
            out["ibpcache_over_ibpcache_raw"] = p
            out["sparse_compression_target"] = {"want": "ibpcache ms/token <= 1.0 x ibpcache_raw", "value": p["ratio"],
                                                "met": p["ratio"] <= 1.0,
                                                "met_every_round": all(r <= 1.0 for r in p["ratio_by_round"])}
    pr = point.get("paired")
    if pr and pr.get("methods") == ["ibpcache", "ibpcache_raw"] and "ratio_step_median" in pr:
        bound = 1.0
        out["compression_target_paired"] = {
            "want": f"ibpcache <= {bound} x ibpcache_raw, decode steps taken in turn (median per-step ratio)",
            "value": pr["ratio_step_median"],
            "met": pr["ratio_step_median"] <= bound and pr["tokens_equal"] and pr["tokens_equal_runs"] is not False,
            "met_every_round": all(r <= bound for r in pr["ratio_by_round"]), "steps": pr["steps"]}
    ours = m.get("ibpcache", {})
    if ours.get("host_bytes_over_raw_div_ratio") is not None:
        allowed = ours.get("host_slack_allowed_bytes")
        slack = ours.get("host_slack_bytes")
        out["host_target"] = {"want": "host bytes of the KV store <= raw / ratio + at most one chunk per layer",
                              "value": ours["host_bytes_over_raw_div_ratio"], "ratio": ours.get("ratio"),
                              "slack_bytes": slack, "allowed_slack_bytes": allowed,
                              "met": slack is not None and allowed is not None and slack <= allowed}
    return out


def flat_records(points: list) -> list:
    recs = []
    for p in points:
        for method, r in p["methods"].items():
            row = {k: p.get(k) for k in ("harness", "shape", "batch", "context", "mode")}
            row["method"] = method
            row.update({k: v for k, v in r.items() if not isinstance(v, (dict, list)) or k == "ms_per_round"})
            recs.append(row)
    return recs


def plot(points: list) -> Any:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(25, 5))
    labels = [f"b{p['batch']} {p['context'] // 1024 if p['context'] >= 1024 else p['context']}"
              f"{'k' if p['context'] >= 1024 else ''}\n{p['mode']} {p.get('harness', 'fill')}" for p in points]
    width = 0.8 / len(ORDER)
    for j, method in enumerate(ORDER):
        xs = [i + (j - (len(ORDER) - 1) / 2) * width for i in range(len(points))]
        ms = [p["methods"].get(method, {}).get("ms_per_token") or 0.0 for p in points]
        host = [p["methods"].get(method, {}).get("host_store_gb") or 0.0 for p in points]
        pre = [p["methods"].get(method, {}).get("prefill_s") or 0.0 for p in points]
        axes[0].bar(xs, ms, width, label=method, color=f"C{j}")
        axes[2].bar(xs, host, width, color=f"C{j}")
        axes[3].bar(xs, pre, width, color=f"C{j}")
    axes[0].set_yscale("log")
    for i, p in enumerate(points):
        t = p.get("targets", {})
        key = "ibpcache_over_hf_offloaded" if p["mode"] == "dense" else "ibpcache_vs_infinigen_cpu_gather"
        if key in t:
            rounds = t[key]["ratio_by_round"]
            axes[1].scatter([i] * len(rounds), rounds, color="k", s=12)
            axes[1].bar(i, t[key]["ratio"], 0.5, color="C0" if p["mode"] == "dense" else "C1", alpha=0.6)
        raw = p["methods"].get("ibpcache", {})
        if raw.get("raw_bytes") and raw.get("ratio"):
            axes[2].plot([i - 0.4, i + 0.4], [raw["raw_bytes"] / raw["ratio"] / GB] * 2, "k--", lw=1)
    axes[1].axhline(0.25, color="C0", ls=":", label="dense target 0.25 (vs hf_offloaded)")
    axes[1].axhline(0.75, color="C1", ls="--", lw=0.8, label="sparse target 0.75 (vs infinigen)")
    titles = ("decode ms/token (median, log scale)", "ibpcache / baseline ms per token (dots: rounds)",
              "host GB of the KV store (dashed: raw / ratio)",
              "prefill s (forward: to the first token; fill: storing the KV)")
    for ax, title in zip(axes, titles):
        ax.set_xticks(range(len(points)), labels, fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    p0 = points[0] if points else {"shape": "?"}
    fig.suptitle(f"KV offload at real shapes: {SHAPES.get(p0['shape'], {}).get('label', p0['shape'])}")
    return fig


def parse_args(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_llm.py --shape", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=[s for s in SHAPES])
    p.add_argument("--harness", default="fill",
                   help="comma list of fill (KV filled with scaled real SmolLM2 rows, no prefill) and forward (the "
                        "plain loop: a prefill forward of random ids, then decode; library defaults), run in order")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batches", default=None, help="comma list (default per shape)")
    p.add_argument("--contexts", default=None, help="tokens in the cache at the last decode step (comma list)")
    p.add_argument("--modes", default="dense,sparse")
    p.add_argument("--methods", default=",".join(m for m in ORDER if m not in FORCED),
                   help=f"comma list of {', '.join(ORDER)} (default: all but the forced {', '.join(FORCED)})")
    p.add_argument("--decode-tokens", type=int, default=3, help="timed decode steps per run")
    p.add_argument("--paired", default=None, metavar="A,B",
                   help="after each point's rounds, also decode A's and B's caches in turn, step by step (same host "
                        "state: the plain loop is host-bound), --paired-rounds times; JSON: point['paired']")
    p.add_argument("--paired-rounds", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="in the last round, this many more decode steps per method run under the profiler (not "
                        "timed): host vs device time per step, kernels, threads (JSON: decode_profile)")
    p.add_argument("--warmup-tokens", type=int, default=2,
                   help="untimed decode steps first in every run (sparse: step 1 speculates eagerly, step 2 captures "
                        "the CUDA graphs of a k seen twice)")
    p.add_argument("--repeats", type=int, default=3, help="rounds, round-robin over the methods")
    p.add_argument("--max-host-gb", type=float, default=None,
                   help="skip a method whose host store would exceed this (default: 90%% of MemAvailable at start)")
    p.add_argument("--deadline-s", type=float, default=480.0, help="start no run that would end after this")
    p.add_argument("--no-warmup-run", action="store_true", help="skip the small untimed run of every method first")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--kv-source", default="chat", choices=("chat", "code"),
                   help="real SmolLM2 KV to scale up (chat: fp32 source, so bf16 is the real top 16 bits)")
    p.add_argument("--data-root", type=Path, default=None,
                   help="folder holding llm/chat_gnn_fp32.npz (default: $IBPCACHE_SHARED, ../shared/data, ...)")
    p.add_argument("--codec", default=None, help="IBPOffloadedCache(codec=...) if the installed version has it")
    p.add_argument("--sample-rows", type=int, default=4096)
    p.add_argument("--chunk-bytes", default="auto", choices=("auto", "auto_once", "1", "2", "4", "8"))
    p.add_argument("--count-bytes", action="store_true",
                   help="exact PCIe byte counters on the zero-copy paths (an atomic per row: off when timing)")
    p.add_argument("--dense-fetch", default="bulk", choices=("bulk", "zero_copy"),
                   help="IBPOffloadedCache(dense_fetch=...): how ours reads every token in dense mode")
    p.add_argument("--reserve", default="auto", choices=("auto", "context", "none"),
                   help="reserve_tokens of the caches: auto = the whole context in the fill harness, 0 (the library "
                        "default) in the forward harness; context / none for both")
    p.add_argument("--prefill", default="auto", choices=("auto", "async", "sync"),
                   help="IBPOffloadedCache(prefill=...): who stores ours' prompts (auto: a worker on CUDA)")
    p.add_argument("--pin-ahead", action="store_true",
                   help="IBPOffloadedCache.pin_ahead(...) for the prompts before the model is built (else the first "
                        "prefill of ours in the process waits for page-locking its blocks)")
    p.add_argument("--alpha", type=float, default=4.0)
    p.add_argument("--partial-ratio", type=float, default=0.2)
    p.add_argument("--max-num-kv", type=int, default=400)
    p.add_argument("--no-graphs", action="store_true",
                   help="IBPOffloadedCache(graphs=False): sparse speculation launched eagerly, not replayed from "
                        "CUDA graphs (applies to the CPU-gather path too)")
    p.add_argument("--probe-tokens", type=int, default=64, help="prompt positions whose queries seed sparse mode")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--cudnn-sdpa", action="store_true", help="allow cuDNN attention (not deterministic on H200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", action="store_true",
                   help="print every run with its host / GPU memory estimate and exit (no model, no GPU needed; "
                        "give --max-host-gb and --gpu-gb for the target machine)")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="--plan only: device memory to assume")
    p.add_argument("--tag", default="", help="suffix of the output name: bench_llm_<shape>[_<tag>].json")
    p.add_argument("--quick", action="store_true", help="small sizes (one batch of 2, short contexts, 1 round)")
    add_out_argument(p)
    args = p.parse_args(argv)
    spec = SHAPES[args.shape]
    if args.quick:
        args.batches = args.batches or "2"
        args.contexts = args.contexts or ("96" if args.shape == "tiny" else "2048")
        args.repeats = min(args.repeats, 2)
        args.decode_tokens = min(args.decode_tokens, 2)
        args.max_num_kv = min(args.max_num_kv, 24)  # fewer than the quick contexts: sparse really selects
    args.batches = args.batches or spec["batches"]
    args.contexts = args.contexts or spec["contexts"]
    bad = set(args.methods.split(",")) - set(METHODS)
    if bad:
        p.error(f"unknown methods {sorted(bad)}; known: {', '.join(METHODS)}")
    bad = set(args.harness.split(",")) - set(HARNESSES)
    if bad:
        p.error(f"unknown harness {sorted(bad)}; known: {', '.join(HARNESSES)}")
    return args


def plan(args: argparse.Namespace) -> list:
    """The sweep's runs with their memory estimates (what main() would run or skip, before time limits)."""
    cfg = build_config(args.shape)
    itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    max_host = args.max_host_gb * GB if args.max_host_gb else 0.9 * _meminfo().get("MemAvailable", 1 << 40)
    n_params = sum(p.numel() for p in _meta_model(cfg).parameters())
    weights = n_params * itemsize
    rows = []
    steps = args.warmup_tokens + args.decode_tokens
    for harness, batch, context in ((h, int(b), int(c)) for h in args.harness.split(",")
                                    for b in args.batches.split(",") for c in args.contexts.split(",")):
        for mode in args.modes.split(","):
            for method in ORDER:
                if method not in args.methods.split(",") or (mode == "sparse" and method not in SPARSE_METHODS):
                    continue
                host = host_estimate(method, cfg, batch, context, itemsize,
                                     reserved=reserve_tokens(args, harness, context) > 0)
                gpu = weights + gpu_need(method, mode, cfg, batch, context, itemsize, args.dense_fetch)
                why = None
                if host > max_host:
                    why = f"host ~{host / GB:.1f} GB > {max_host / GB:.1f} GB"
                elif gpu > args.gpu_gb * GB:
                    why = f"GPU ~{gpu / GB:.1f} GB > {args.gpu_gb:.0f} GB"
                rows.append({"harness": harness, "batch": batch, "context": context, "filled": context - steps,
                             "mode": mode,
                             "method": method, "raw_kv_gb": raw_kv_bytes(cfg, batch, context, itemsize) / GB,
                             "host_gb_est": host / GB, "gpu_gb_est": gpu / GB, "runs": args.repeats,
                             "skip": why})
    return rows


def run_pairs(point: dict, model: Any, src: KvSource, batch: int, context: int, args: argparse.Namespace,
              first: torch.Tensor, steps: int, harness: str, mode: str, runs: "dict | None" = None) -> None:
    """``--paired A,B`` at one point: ``--paired-rounds`` rounds of :func:`run_paired` (which cache is built first
    alternates), summarized into ``point['paired']`` (:func:`paired_summary`), or the reason it did not run.
    ``runs``: the point's round-robin runs, whose tokens each paired decode must reproduce."""
    a, b = args.paired.split(",")
    if mode == "sparse" and not {a, b} <= set(SPARSE_METHODS):
        point["paired"] = {"methods": [a, b], "skipped": "not both sparse methods"}
        return
    itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    need = sum(host_estimate(m, model.config, batch, context, itemsize, reserved=reserve_tokens(args, harness, context)
                             > 0) for m in (a, b))
    if need > 0.9 * _meminfo().get("MemAvailable", 1 << 50):
        point["paired"] = {"methods": [a, b], "skipped": f"host memory: both stores need ~{need / GB:.1f} GB"}
        return
    rounds = []
    for r in range(args.paired_rounds):
        order = [a, b] if r % 2 == 0 else [b, a]
        try:
            rnd = run_paired(order, mode, model, src, batch, context, args, first, steps, harness)
            rnd["tokens_equal_runs"] = same_tokens_as_runs(rnd.pop("_tokens"), runs or {}, harness)
            rounds.append(rnd)
        except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
            point["paired_error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"  [{harness} b{batch} ctx{context} {mode}] paired {a},{b}: ERROR {point['paired_error']}",
                  flush=True)
            free_everything(args.device)
            break
    if rounds:
        point["paired"] = paired_summary(rounds, a, b)
        pr = point["paired"]
        print(f"  [{harness} b{batch} ctx{context} {mode}] paired {a} / {b}: per-step ratio median "
              f"{pr['ratio_step_median']:.3f} (p10 {pr['ratio_p10']:.3f}, p90 {pr['ratio_p90']:.3f}; by round "
              + ", ".join(f"{x:.3f}" for x in pr["ratio_by_round"]) + f"), {pr['ms_per_token'][a]:.1f} vs "
              f"{pr['ms_per_token'][b]:.1f} ms/token, tokens equal {pr['tokens_equal']} (to the round-robin runs': "
              f"{pr['tokens_equal_runs']})", flush=True)


def _meta_model(cfg: Any) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def pin_ahead(args: argparse.Namespace, dtype: torch.dtype) -> int:
    """``--pin-ahead``: ``IBPOffloadedCache.pin_ahead`` for every point's prompt (raw size: enough for every method of
    ours), started before the model is built, as a server would while loading weights; bytes asked for."""
    if not args.pin_ahead or args.device != "cuda":
        return 0
    from ibpcache.loaders.kv import IBPOffloadedCache

    cfg, steps = build_config(args.shape), args.warmup_tokens + args.decode_tokens
    return sum(IBPOffloadedCache.pin_ahead(cfg, int(b), int(c) - steps, dtype, compress=False)
               for b in args.batches.split(",") for c in args.contexts.split(","))


def main(argv: "list | None" = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.plan:
        rows = plan(args)
        print(format_table(rows))
        print(f"{sum(r['runs'] for r in rows if not r['skip'])} runs of {args.warmup_tokens} + {args.decode_tokens} "
              f"decode steps; raw KV filled in total {sum(r['raw_kv_gb'] * r['runs'] for r in rows if not r['skip']):.0f} GB")
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--shape runs need a CUDA GPU (--device cpu runs the smoke test)")
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    if args.device == "cuda" and not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    import transformers

    deadline = Deadline(args.deadline_s)
    start_mem = _meminfo()
    max_host = args.max_host_gb * GB if args.max_host_gb else 0.9 * start_mem.get("MemAvailable", 1 << 40)
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    pinned_ahead = pin_ahead(args, dtype)
    t = time.perf_counter()
    model = build_model(args.shape, dtype, args.device, args.attn, args.seed)
    build_s = time.perf_counter() - t
    cfg = model.config
    src = KvSource(args.kv_source, args.dtype, args.device, geometry(cfg)[0], args.seed, args.data_root)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{SHAPES[args.shape]['label']}: {n_params / 1e9:.2f} B parameters on {args.device} in {build_s:.1f} s; "
          f"host budget {max_host / GB:.1f} GB; deadline {args.deadline_s:.0f} s", flush=True)
    methods = [m for m in ORDER if m in args.methods.split(",")]
    steps = args.warmup_tokens + args.decode_tokens
    meta = {"args": {k: (str(v) if v is not None else None) for k, v in vars(args).items()},
            "shape_label": SHAPES[args.shape]["label"], "config": cfg.to_dict() if hasattr(cfg, "to_dict") else {},
            "parameters": n_params, "model_build_s": build_s, "kv_fill": src.describe(), "methods": METHODS,
            "pin_ahead_bytes": pinned_ahead,
            "attn_implementation": getattr(cfg, "_attn_implementation", args.attn),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "host_mem_total_gb": start_mem.get("MemTotal", 0) / GB, "host_budget_gb": max_host / GB,
            "ibp_constructor_options": ibp_kwargs(args) or None,
            "context_meaning": "tokens in the cache at the last decode step; filled = context - (warm-up + timed) "
                               "(the forward harness's prompt length)",
            "harnesses": {"fill": "KV filled with scaled real SmolLM2 rows through Cache.update (reserve_tokens = "
                                  "context); prefill_s = the fill (storing only)",
                          "forward": "prefill forward of seeded random ids, logits_to_keep=1, then greedy decode; "
                                     "library defaults (reserve_tokens=0); prefill_s = time to the first token on the "
                                     "host, prefill_stored_s = until the cache holds every prompt row; step 0 of the "
                                     "verification is the prefill's token and logits"},
            "timing": "per decode step: CUDA events around the model forward + argmax (ms_per_token), and wall time "
                      "with a device sync per step (wall_ms_per_token); medians over every timed step of every round"}
    points: list = []
    name = f"bench_llm_{args.shape}" + (f"_{args.tag}" if args.tag else "")

    def save() -> None:
        meta["elapsed_s"] = deadline.elapsed()
        meta["targets"] = [{"harness": p["harness"], "batch": p["batch"], "context": p["context"], "mode": p["mode"],
                            **p["targets"]} for p in points if p.get("targets")]
        paths = write_results(args.out, name, flat_records(points), lambda _recs: plot(points), meta=meta,
                              extra={"points": points})
        return paths

    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    modes = args.modes.split(",")
    harnesses = args.harness.split(",")
    prev_class: list = [None]

    def prepare_pinned(method: str, need: int, batch: int, context: int) -> "tuple[str, str | None]":
        """Release torch's cached pinned blocks when the next store would not fit beside them; then
        (state, None), or (state, reason) when the host still lacks the memory (skip rather than be OOM-killed)."""
        cls = (PINNED_CLASS[method], batch, context)  # block sizes depend on the method class and the point

        def room() -> float:
            snap = host_snapshot()
            cached_free = 0.0  # reusable only if the stats say so (older torch: unknown, assume none)
            if "pinned_pool_gb" in snap and "pinned_active_gb" in snap:
                cached_free = max(0.0, snap["pinned_pool_gb"] - snap["pinned_active_gb"]) * GB
            if cls[0] == "chunks":  # ours reuses its own pool's free blocks (one block size for every point)
                cached_free = ibpcache_pool_stats()["free_bytes"]
            elif cls != prev_class[0]:
                cached_free = 0.0
            return _meminfo().get("MemAvailable", 1 << 50) + cached_free

        # Cached blocks of another method class (other block sizes) cannot be reused: they only count against
        # MemAvailable, so they are released exactly when the next store would not fit beside them.
        state = "kept"
        if need + (4 << 30) > room() and args.device == "cuda":
            t0 = time.perf_counter()
            how = release_pinned_pool()
            freed = release_ibpcache_pool()
            state = f"released ({how}; ibpcache pool {freed / GB:.1f} GB; {time.perf_counter() - t0:.1f} s)"
        if cls[0] is not None:
            prev_class[0] = cls
        for _ in range(10):  # freed pinned memory may take a moment to show up as available
            if need + (2 << 30) <= room():
                return state, None
            time.sleep(0.3)
        return state, (f"host memory: the store needs ~{need / GB:.1f} GB, {room() / GB:.1f} GB available "
                       f"after releasing the pinned pool ({state})")

    if not args.no_warmup_run:  # kernels, allocator, Numba/JIT: once per method and mode, small, not recorded
        t0 = time.perf_counter()
        for harness in harnesses:
            for mode in modes:
                for method in methods:
                    if (mode == "sparse" and method not in SPARSE_METHODS) or \
                            (args.device == "cpu" and method in CUDA_ONLY):
                        continue
                    try:
                        first = torch.randint(cfg.vocab_size, (batches[0], 1), generator=gen).to(args.device)
                        run_method(method, mode, model, src, batches[0], min(256, min(contexts)), args, False, first,
                                   2, harness)
                    except Exception as exc:  # noqa: BLE001 - recorded by the real runs
                        print(f"  warm-up {harness} {mode} {method}: {type(exc).__name__}: {exc}"[:300], flush=True)
        meta["warmup_run_s"] = time.perf_counter() - t0
        print(f"warm-up runs: {meta['warmup_run_s']:.1f} s", flush=True)

    from tqdm import tqdm

    total = sum(len([m for m in methods if mode == "dense" or m in SPARSE_METHODS])
                for _ in batches for _ in contexts for mode in modes) * args.repeats * len(harnesses)
    bar = tqdm(total=total, desc="runs", file=sys.stdout, mininterval=30, dynamic_ncols=False, ncols=100)
    for harness, batch, context, mode in ((h, b, c, m) for h in harnesses for b in batches for c in contexts
                                          for m in modes):
        point: dict = {"harness": harness, "shape": args.shape, "batch": batch, "context": context,
                       "mode": mode, "reserve_tokens": reserve_tokens(args, harness, context),
                       "filled_tokens": context - steps, "warmup_tokens": args.warmup_tokens,
                       "decode_tokens": args.decode_tokens, "raw_kv_gb": raw_kv_bytes(cfg, batch, context,
                                                                                     itemsize) / GB,
                       "methods": {}, "round_orders": []}
        points.append(point)
        if context - steps < 1:
            point["skipped"] = f"context {context} <= {steps} decode steps"
            continue
        todo = [m for m in methods if mode == "dense" or m in SPARSE_METHODS]
        runs: dict = {}
        skipped: dict = {}
        first = torch.randint(cfg.vocab_size, (batch, 1), generator=gen).to(args.device)
        fill_gb = raw_kv_bytes(cfg, batch, context, itemsize) / GB
        for rnd in range(args.repeats):
            order = todo if rnd % 2 == 0 else todo[::-1]
            point["round_orders"].append(order)
            for method in order:
                bar.update()
                reason = None
                need = host_estimate(method, cfg, batch, context, itemsize,
                                     reserved=reserve_tokens(args, harness, context) > 0)
                if args.device == "cpu" and method in CUDA_ONLY:
                    reason = "needs CUDA (this run is on the CPU)"
                elif need > max_host:
                    reason = (f"host store ~{need / GB:.1f} GB exceeds --max-host-gb "
                              f"{max_host / GB:.1f} GB")
                else:
                    reason = gpu_fits(method, mode, cfg, batch, context, itemsize, args.device,
                                      args.dense_fetch)
                step_gb = 0.0 if method == "dynamic_gpu" or mode == "sparse" else fill_gb
                est = deadline.estimate((harness, method), fill_gb, steps, step_gb)
                if reason is None:
                    reason = deadline.skip_reason(est)
                if reason is not None:
                    skipped.setdefault(method, []).append(f"round {rnd}: {reason}")
                    print(f"  [{harness} b{batch} ctx{context} {mode} r{rnd}] {method}: skipped ({reason})", flush=True)
                    continue
                pinned, short = prepare_pinned(method, need, batch, context)
                if short is not None:
                    skipped.setdefault(method, []).append(f"round {rnd}: {short}")
                    print(f"  [{harness} b{batch} ctx{context} {mode} r{rnd}] {method}: skipped ({short})", flush=True)
                    continue
                keep = not any(isinstance(r, RunOut) for r in runs.get(method, []))
                t0 = time.perf_counter()
                try:
                    out = run_method(method, mode, model, src, batch, context, args, keep, first, steps,
                                     harness, args.profile_steps if rnd == args.repeats - 1 else 0)
                    out.pinned = pinned
                    out.run_s = time.perf_counter() - t0
                    deadline.learn((harness, method), fill_gb, out.fill_s, steps, step_gb,
                                   sum(out.wall_ms) / 1e3 * steps / max(1, len(out.wall_ms)))
                    runs.setdefault(method, []).append(out)
                    h = out.host["after_decode"]
                    print(f"  [{harness} b{batch} ctx{context} {mode} r{rnd}] {method}: prefill "
                          f"{out.prefill_s:.2f} s (stored {out.fill_s:.2f} s) "
                          f"(pinned pool {pinned}), {_median(out.step_ms):.1f} ms/token "
                          f"(steps {', '.join(f'{s:.1f}' for s in out.step_ms)}), host store "
                          f"{(out.stats.get('host_bytes') or 0) / GB:.2f} GB, ratio "
                          f"{out.stats.get('ratio') or 1.0:.3f}, RSS {h.get('rss_gb', 0):.1f} GB, "
                          f"system used {h.get('system_used_gb', 0):.1f} GB, pinned pool "
                          f"{h.get('pinned_pool_gb', 0):.1f} GB; run {time.perf_counter() - t0:.1f} s",
                          flush=True)
                    if out.profile is not None:
                        pr = out.profile
                        print(f"    profiled {pr['steps']} steps: wall {pr['wall_ms']:.1f} ms/step, kernels "
                              f"{pr['kernel_ms']:.1f}, copies {pr['copy_ms']:.1f}; top: " + ", ".join(
                                  f"{k['name'][:40]} {k['ms_per_step']:.2f}" for k in pr["top_device_ms"][:4]),
                              flush=True)
                except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                    msg = f"{type(exc).__name__}: {exc}"[:500]
                    runs.setdefault(method, []).append(msg)
                    print(f"  [{harness} b{batch} ctx{context} {mode} r{rnd}] {method}: ERROR {msg}", flush=True)
                    free_everything(args.device)
                summarize_point(point, runs, skipped, args)
                save()
        if args.paired:
            run_pairs(point, model, src, batch, context, args, first, steps, harness, mode, runs)
        summarize_point(point, runs, skipped, args)
        save()
    bar.close()
    paths = save()
    cols = ["harness", "batch", "context", "mode", "method", "ms_per_token", "p10_ms", "p90_ms", "prefill_s",
            "prefill_stored_s", "rounds", "host_store_gb", "ratio", "tokens_equal", "logits_equal", "reference",
            "skipped"]
    print(format_table(flat_records(points), cols))
    for p in points:
        for key in ("dense_target", "sparse_target", "sparse_compression_target", "compression_target_paired",
                    "host_target",
                    "prefill_ibpcache_over_ibpcache_raw", "prefill_ibpcache_over_hf_offloaded"):
            if key in p.get("targets", {}):
                t = p["targets"][key]
                value = t.get("value", t.get("ratio"))
                print(f"{p['harness']} b{p['batch']} ctx{p['context']} {p['mode']}: {key} {t['want']}: value "
                      f"{value:.3f} met={t['met']}")
    print("wrote", *paths.values())
