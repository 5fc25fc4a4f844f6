"""Experiment: are greedy tokens on the GPU reproducible run to run, and across cache implementations?

Runs greedy generation twice with each of: plain DynamicCache, IBPOffloadedCache dense raw (zero-copy), and dense
compressed, on the same batch of real prompts (CPython sources), and prints the first position where any sequence
differs from the first DynamicCache run. If DynamicCache differs from itself, exact token equality on this GPU is
not a property any cache can have; if only ours differ, the cache feeds attention something different.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root: scripts.lib
from bench_llm import stdlib_prompts  # noqa: E402

from ibpcache.loaders.kv import IBPOffloadedCache  # noqa: E402
from scripts.lib.models import load_smollm2  # noqa: E402


def first_diff(a: torch.Tensor, b: torch.Tensor) -> "int | None":
    neq = (a != b).any(dim=0).nonzero()
    return None if neq.numel() == 0 else int(neq[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf", default=None)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=1920)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--attn", default=None, help="attn_implementation (e.g. eager, sdpa)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    model, tok = load_smollm2(dtype=dtype, device=args.device, gguf=args.gguf, attn_implementation=args.attn)
    ids = stdlib_prompts(tok, args.batch, args.prompt_len, model.config.vocab_size).to(args.device)
    mask = torch.ones_like(ids)
    from transformers import DynamicCache

    makers = {
        "dynamic": lambda: DynamicCache(),
        "ibp_raw": lambda: IBPOffloadedCache(model.config, mode="dense", compress=False),
        "ibp_compressed": lambda: IBPOffloadedCache(model.config, mode="dense", compress=True),
    }
    outs = {}
    for name, make in makers.items():
        for rep in range(2):
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                     do_sample=False, past_key_values=make(), pad_token_id=tok.pad_token_id)
            outs[f"{name}#{rep}"] = out[:, ids.shape[1]:].cpu()
    ref = outs["dynamic#0"]
    res = {k: first_diff(ref, v) for k, v in outs.items()}
    res["attn"] = args.attn or "default"
    res["dtype"] = args.dtype
    print(json.dumps(res))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"kv_token_stability_{args.dtype}_{args.attn or 'default'}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
