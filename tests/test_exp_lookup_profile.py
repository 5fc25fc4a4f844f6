"""scripts/experiments/exp_lookup_profile.py on the CPU: argument checks, and a tiny run of one set on real MiniLM
rows (ratios, the CPU decoder's check of every codec's stored rows, the JSON written). The GPU timings need
``python scripts/experiments/exp_lookup_profile.py --out DIR`` on a GPU machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ibpcache.errors import InvalidArgumentError

SCRIPT = "experiments/exp_lookup_profile"


def test_parse_segs(script_module: Any) -> None:
    with script_module(SCRIPT) as mod:
        assert mod.parse_segs("auto, none,64") == ["auto", None, 64]
        for bad in ("0", "-3", "x", "auto,1.5"):
            with pytest.raises(InvalidArgumentError):
                mod.parse_segs(bad)


def test_parse_variants(script_module: Any) -> None:
    with script_module(SCRIPT) as mod:
        assert mod.parse_variants("base, u8,w24,u4w32,s,u8sw24") == {
            "base": (), "u8": ("-DIBP_EXP_LOOKUP_UNROLL=8",), "w24": ("-DIBP_EXP_MIN_WARPS=24",),
            "u4w32": ("-DIBP_EXP_LOOKUP_UNROLL=4", "-DIBP_EXP_MIN_WARPS=32"), "s": ("-DIBP_EXP_LOOKUP_SHFL=1",),
            "u8sw24": ("-DIBP_EXP_LOOKUP_UNROLL=8", "-DIBP_EXP_LOOKUP_SHFL=1", "-DIBP_EXP_MIN_WARPS=24")}
        assert mod.parse_variants("v0,v2,v0u8w24") == {
            "v0": ("-DIBP_EXP_STAGE_VEC16=0",), "v2": ("-DIBP_EXP_VEC16_UNROLL=2",),
            "v0u8w24": ("-DIBP_EXP_STAGE_VEC16=0", "-DIBP_EXP_LOOKUP_UNROLL=8", "-DIBP_EXP_MIN_WARPS=24")}
        assert mod.parse_variants("r24,v0r32") == {"r24": ("-DIBP_MIN_WARPS=24",),
                                                   "v0r32": ("-DIBP_EXP_STAGE_VEC16=0", "-DIBP_MIN_WARPS=32")}
        assert mod.parse_variants("c0,n4,r24c0n2") == {
            "c0": ("-DIBP_RAW_COPY=0",), "n4": ("-DIBP_SINGLE_UNROLL=4",),
            "r24c0n2": ("-DIBP_MIN_WARPS=24", "-DIBP_RAW_COPY=0", "-DIBP_SINGLE_UNROLL=2")}
        for bad in ("", "u0", "u33", "w65", "w0", "x8", "u8x", "w24u8", "uw", "su8", "u8ss", "v17", "u8v2", "v",
                    "r0", "r65", "r24w24", "c1", "n0", "n17", "q", "n4c0", "c0c0"):
            with pytest.raises(InvalidArgumentError):
                mod.parse_variants(bad)


def test_variants_of_raw_rows_are_the_ones_that_change_their_kernels(script_module: Any) -> None:
    import argparse

    with script_module(SCRIPT) as mod:
        args = argparse.Namespace(variants=mod.parse_variants("base,v0,r24,u8r32"))
        assert mod.variants_of("exp_segauto", args) == ["base", "v0", "r24", "u8r32"]
        assert mod.variants_of("raw", args) == mod.variants_of("ibp", args) == ["base", "r24", "u8r32"]
        assert mod.variants_of("raw", argparse.Namespace(variants=mod.parse_variants("v0"))) == ["base"]
        args = argparse.Namespace(variants=mod.parse_variants("base,c0,n4,u8"))
        assert mod.variants_of("raw", args) == ["base", "c0", "n4"]


def test_bad_arguments_exit(script_module: Any) -> None:
    with script_module(SCRIPT) as mod:
        for argv in (["--device", "cpu", "--dists", "gauss"], ["--device", "cpu", "--kernels", "pool,decode"],
                     ["--device", "cpu", "--reps", "5"], ["--device", "cpu", "--dtypes", "bf8"],
                     ["--device", "cpu", "--variants", "fast"]):
            with pytest.raises(SystemExit):
                mod.parse_args(argv)


def test_cpu_run_on_minilm_rows(tmp_path: Path, shared_data_dir: Path, script_module: Any) -> None:
    with script_module(SCRIPT) as mod:
        rc = mod.main(["--device", "cpu", "--quick", "--dtypes", "fp16", "--entry-bytes", "512", "--dists",
                       "zipf,uniform", "--seg", "auto,32", "--out", str(tmp_path)])
    assert rc == 0
    recs = json.loads((tmp_path / "exp_lookup_profile.json").read_text())["records"]
    by = {(r["dist"], r["method"]): r for r in recs}
    assert set(by) == {(d, m) for d in ("zipf", "uniform") for m in ("raw", "ibp", "exp_segauto", "exp_seg32")}
    assert all(r["verified"] for r in recs)
    assert all(r["variant"] == "base" for r in recs)  # variants are GPU timings: a CPU run has the defaults only
    assert all(by["zipf", m]["cpu_verified"] for m in ("raw", "ibp", "exp_segauto", "exp_seg32"))
    z = {m: by["zipf", m] for m in ("raw", "ibp", "exp_segauto", "exp_seg32")}
    assert z["raw"]["ratio"] == 1.0
    # real fp16 MiniLM rows: exponent coding stores smaller than IBP; 8 segments of 32 pay header bits for lanes
    assert z["exp_segauto"]["ratio"] > z["ibp"]["ratio"] > 1.05
    assert z["exp_seg32"]["n_seg"] == 8 and z["exp_seg32"]["ratio"] < z["exp_segauto"]["ratio"]
