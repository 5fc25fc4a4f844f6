"""Regenerate tests/golden/*.npz: small real-data and edge-case inputs, their fitted codec, and the exact
compressed bytes the CPU encoder produces. GPU tests compare the GPU encoder's bytes against these.

Run only when the format version changes: `python scripts/make_golden.py`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ibpcache import Codec, datasets
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


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
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


if __name__ == "__main__":
    main()
