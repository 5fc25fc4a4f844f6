"""Regenerate tests/golden/*.npz: small real-data and edge-case inputs, their fitted codec, and the exact
compressed bytes the CPU encoder produces. GPU tests compare the GPU encoder's bytes against these.

Run only when a format changes: `python scripts/make_golden.py --kind ibp` (IBP: ``<case>_c<C>_<layout>.npz``) or
`--kind exponent` (exponent coding: ``exp_<case>.npz``); `--kind all` writes both.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from ibpcache import Codec, ExponentCodec, datasets
from ibpcache.format import FORMAT_VERSION

OUT = Path(__file__).resolve().parents[1] / "tests" / "golden"


def _special_floats() -> torch.Tensor:
    """float32 rows mixing real-looking values with NaN payloads, +/-Inf, -0.0 and denormals."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 37, generator=g) * 0.01).to(torch.float32)
    bits = x.view(torch.int32)
    bits[::5, 3] = 0x7FC00001  # quiet NaN with payload
    bits[1::7, 5] = 0x7F800001  # signalling NaN
    x[2::6, 7] = float("inf")
    x[3::6, 8] = float("-inf")
    x[::4, 9] = -0.0
    bits[::3, 11] = 0x00000001  # smallest denormal
    bits[1::3, 12] = -2147483647  # negative denormal pattern 0x80000001
    return x


def cases() -> dict[str, torch.Tensor]:
    cora = datasets.load_cora().features[:48]
    out = {"cora48_f32": cora, "special_f32": _special_floats()}
    try:
        out["minilm32_f32"] = datasets.load_minilm()[:32]
        out["kv_chat_k_bf16_96"] = datasets.load_kv("chat", "k", "bf16")[:96]
        out["kv_code_v_fp16_96"] = datasets.load_kv("code", "v", "fp16")[:96]
        out["pubmed24_odd_u8"] = datasets.load_pubmed_rows()[:24].view(torch.uint8)[:, :1999].contiguous()
    except FileNotFoundError:
        pass
    return out


def _bits(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Elements of ``dtype`` with the given bit patterns."""
    width = torch.int32 if torch.empty((), dtype=dtype).element_size() == 4 else torch.int16
    return torch.tensor(values, dtype=torch.int64).to(width).view(dtype)


def _odd_fp16() -> tuple[torch.Tensor, torch.Tensor]:
    """33-element float16 rows (an odd width) with NaN payloads, infinities, -0.0 and denormals, and the rows the
    code is fitted on (so some exponents are rare and some rows are stored raw)."""
    g = torch.Generator().manual_seed(11)
    fit = (torch.randn(400, 33, generator=g) * 0.1).to(torch.float16)
    x = (torch.randn(40, 33, generator=g) * 0.1).to(torch.float16)
    x[::3, 1] = _bits([0x7E01], torch.float16)  # NaN with payload
    x[1::4, 2] = float("inf")
    x[2::4, 3] = float("-inf")
    x[::2, 4] = -0.0
    x[::5, 5] = _bits([0x0001], torch.float16)  # smallest denormal
    x[-3:] = _bits([0x7BFF], torch.float16)  # every exponent rare: stored raw
    return x, fit


def exponent_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor, "int | str | None"]]:
    """name -> (rows stored, rows the code is fitted on, seg)."""
    special = _special_floats()
    out: dict[str, tuple[torch.Tensor, torch.Tensor, "int | str | None"]] = {
        "special_f32_d37_seg8": (special, (torch.randn(300, 37, generator=torch.Generator().manual_seed(3)) * 0.01),
                                 8),
        "odd_f16_d33_seg16": (*_odd_fp16(), 16),
    }
    try:
        minilm = datasets.load_minilm()[:2000]
        out["minilm32_f32_auto"] = (minilm[:32], minilm, "auto")
        out["minilm32_bf16_auto"] = (minilm[:32].to(torch.bfloat16), minilm.to(torch.bfloat16), "auto")
        k = datasets.load_kv("chat", "k", "bf16")[:96]
        out["kv_chat_k_bf16_96_s1"] = (k, k, None)
        v = datasets.load_kv("code", "v", "fp16")[:96]
        out["kv_code_v_fp16_96_s1"] = (v, v, None)
        v32 = datasets.load_kv("chat", "v", "fp32")[:96]
        out["kv_chat_v_f32_96_auto"] = (v32, v32, "auto")
    except FileNotFoundError:
        pass
    return out


def write_exponent() -> None:
    for name, (x, fit_on, seg) in exponent_cases().items():
        codec = ExponentCodec.fit(fit_on, seg=seg)
        data, lengths, _ = codec.encode(x)
        np.savez_compressed(
            OUT / f"exp_{name}.npz", version=FORMAT_VERSION,
            x=x.contiguous().view(torch.uint8).reshape(x.shape[0], -1).numpy(), dtype=str(x.dtype),
            shape=np.array(x.shape), code_lengths=codec.code_lengths, seg=codec.seg, data=data.numpy(),
            lengths=lengths.numpy())
        print(f"exp_{name}", tuple(x.shape), x.dtype, f"seg={codec.seg} S={codec.n_seg}",
              f"raw rows={int((lengths == codec.row_bytes).sum())}")


def write_ibp() -> None:
    for name, x in cases().items():
        for c in (1, 2, 4, 8):
            codec = Codec.fit(x, chunk_bytes=c)
            for layout in ("inplace", "packed"):
                p = codec.compress(x, layout=layout, pin=False)
                np.savez_compressed(
                    OUT / f"{name}_c{c}_{layout}.npz", version=FORMAT_VERSION,
                    x=x.contiguous().view(torch.uint8).reshape(x.shape[0], -1).numpy(), dtype=str(x.dtype),
                    shape=np.array(x.shape), mask=codec.mask, bitval=codec.bitval, chunk_bytes=c,
                    threshold=codec.threshold, data=p.data.numpy(), lengths=p.lengths.numpy())
        print(name, tuple(x.shape), x.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=("ibp", "exponent", "all"), required=True,
                   help="which golden files to rewrite (the others are left as they are)")
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.kind in ("ibp", "all"):
        write_ibp()
    if args.kind in ("exponent", "all"):
        write_exponent()


if __name__ == "__main__":
    main()
