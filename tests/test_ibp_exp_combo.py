"""scripts/experiments/ibp_exp_combo.py: the bound on IBP-then-exponent coding (issue 26 asks whether the
combination stores fewer bytes than either codec alone). CPU only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SCRIPT = "experiments/ibp_exp_combo"


def test_exponent_fields_are_where_the_script_says(script_module: Any) -> None:
    with script_module(SCRIPT) as mod:
        one = torch.tensor([-1.5], dtype=torch.float32)
        bits = mod.exponent_bit_mask(torch.float32, 4)
        assert int.from_bytes(bytes(bits), "little") == 0x7F800000
        assert int.from_bytes(bytes(mod.exponent_bit_mask(torch.bfloat16, 2)), "little") == 0x7F80
        assert int.from_bytes(bytes(mod.exponent_bit_mask(torch.float16, 2)), "little") == 0x7C00
        assert mod.chunks(one.view(torch.uint8).reshape(1, 4).numpy(), 4)[0, 0] == 0xBFC00000


def test_the_bound_finds_invariant_mantissa_bits_and_only_those(script_module: Any, minilm: torch.Tensor) -> None:
    """Native fp32 rows: IBP's mask lies (almost) inside the exponent fields, so the combination gains nothing. The same
    rows rounded to fp16 and widened back to fp32 have 13 zero mantissa bits per element that IBP drops and the
    exponent coder stores: there the bound beats both codecs."""
    with script_module(SCRIPT) as mod:
        x = minilm[:3000].contiguous()
        native = mod.combo_bound(x)
        assert native["ibp_mask_bits_outside_exponent"] < 0.01 * 8 * native["row_bytes"]
        assert native["combo_gain"] < 1.01
        widened = mod.combo_bound(x.half().float())
        assert widened["ibp_mask_bits_outside_exponent"] > 0 and widened["combo_gain"] > 1.02
        assert widened["combo_bound_ratio"] > max(widened["ibp_ratio"], widened["exponent_ratio"])


def test_main_writes_json(script_module: Any, tmp_path: Path, minilm: torch.Tensor) -> None:
    with script_module(SCRIPT) as mod:
        assert mod.main(["--tables", "minilm", "--dtypes", "bf16", "--rows", "2000", "--out", str(tmp_path)]) == 0
    recs = json.loads((tmp_path / "ibp_exp_combo.json").read_text())["records"]
    assert [(r["table"], r["dtype"]) for r in recs] == [("minilm", "bf16")]
    assert recs[0]["combo_bound_ratio"] >= recs[0]["exponent_ratio"] - 1e-9
