"""``scripts/bench_llm.py --shape ...`` (scripts/lib/llm_shapes.py): the real-shape KV benchmark, on the CPU.

The sweep itself is run once at its tiny CPU shape (2 layers, Numba host path for ours; the CUDA-only baselines are
skipped with a reason), in both harnesses (fill: KV filled with real rows; forward: the plain prefill + decode
loop); its JSON must have the issue's schema, every method, and verified outputs. The helpers (shapes, the KV fill,
host estimates) are checked directly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_llm.py"
CUDA_ONLY = ("hf_offloaded", "infinigen_cpu_gather")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: Any, shared_data_dir: Path) -> dict:
    out = tmp_path_factory.mktemp("bench_llm_tiny")
    from scripts.lib.llm_shapes import ORDER

    res = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--device", "cpu", "--quick",
                          "--repeats", "2", "--cpu-threads", "1", "--harness", "fill,forward", "--out", str(out),
                          "--profile-steps", "2", "--paired", "ibpcache,ibpcache_raw",
                          "--methods", ",".join(ORDER)],  # the forced methods too
                         capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                           "IBPCACHE_SHARED": str(shared_data_dir)})
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert (out / "bench_llm_tiny.png").is_file()
    return json.loads((out / "bench_llm_tiny.json").read_text())


def _point(data: dict, mode: str, harness: str = "fill") -> dict:
    pts = [p for p in data["points"] if p["mode"] == mode and p["harness"] == harness]
    assert len(pts) == 1
    return pts[0]


def test_schema_and_every_method(tiny_run: dict) -> None:
    from scripts.lib.llm_shapes import METHODS, SPARSE_METHODS

    assert {(p["mode"], p["harness"]) for p in tiny_run["points"]} == {(m, h) for m in ("dense", "sparse")
                                                                         for h in ("fill", "forward")}
    for p in tiny_run["points"]:
        assert p["shape"] == "tiny" and p["batch"] == 2 and p["context"] == 96
        assert p["reserve_tokens"] == (96 if p["harness"] == "fill" else 0)
        assert p["filled_tokens"] == 96 - p["warmup_tokens"] - p["decode_tokens"]
        want = set(METHODS) if p["mode"] == "dense" else set(SPARSE_METHODS)
        assert set(p["methods"]) == want
        for name, m in p["methods"].items():
            if name in CUDA_ONLY:  # recorded, with the reason, not silently dropped
                assert "CUDA" in m["skipped"]
                continue
            assert m["ms_per_token"] > 0 and m["rounds"] == 2 and len(m["ms_per_round"]) == 2
            assert m["p10_ms"] <= m["ms_per_token"] <= m["p90_ms"]
            assert 0 < m["prefill_s"] <= m["prefill_stored_s"] + 1e-9 and len(m["prefill_s_per_round"]) == 2
            assert m["repeat_outputs_identical"], name
            assert m["raw_bytes"] == 2 * 2 * 2 * 2 * 96 * 128 * 2  # K+V x layers x batch x heads x tokens x D x 2 B
        assert p["verification"]["same_fill_bytes_checksum"]
        assert len(p["round_orders"]) == 2 and p["round_orders"][1] == p["round_orders"][0][::-1]
    recs = tiny_run["records"]
    assert {(r["harness"], r["mode"], r["method"]) for r in recs} == {(p["harness"], p["mode"], m)
                                                                      for p in tiny_run["points"] for m in p["methods"]}
    assert tiny_run["meta"]["kv_fill"]["source_shape"][-1] == 64


def test_profiled_steps_say_where_a_step_went_without_changing_the_timed_ones(tiny_run: dict) -> None:
    for p in tiny_run["points"]:
        for name, m in p["methods"].items():
            if "skipped" in m:
                continue
            prof = m["decode_profile"]  # the last round's extra steps, after the timed ones
            assert prof["steps"] == 2 and prof["wall_ms"] > 0, name
            assert prof["kernel_ms"] == 0.0 and prof["top_device_ms"] == []  # the CPU run has no device activity
            threads = prof["threads"]["threads"]
            assert threads and sum(t["ops"] for t in threads.values()) > 0
            assert any(op["name"].startswith("aten::") for op in prof["threads"]["top_ops"])
            assert len(m["steps_ms_per_round"][-1]) == p["decode_tokens"]  # the profiled steps are not timed


def test_paired_steps_alternate_both_caches_and_agree(tiny_run: dict) -> None:
    for p in tiny_run["points"]:
        pr = p["paired"]
        assert pr["methods"] == ["ibpcache", "ibpcache_raw"] and pr["tokens_equal"]
        assert pr["tokens_equal_runs"] is True  # each paired decode reproduces its own round-robin run's tokens
        assert all("_tokens" not in r for r in pr["rounds"])
        assert [r["built_first"] for r in pr["rounds"]] == ["ibpcache", "ibpcache_raw"]  # two rounds, order swapped
        for r in pr["rounds"]:
            assert set(r["ms"]) == {"ibpcache", "ibpcache_raw"}
            assert all(len(x) == p["decode_tokens"] and min(x) > 0 for x in r["ms"].values())
            if p["harness"] == "forward":
                assert set(r["prefill_s"]) == {"ibpcache", "ibpcache_raw"}
        assert pr["steps"] == 2 * p["decode_tokens"]
        assert pr["ratio_p10"] <= pr["ratio_step_median"] <= pr["ratio_p90"]
        t = p["targets"]["compression_target_paired"]
        assert t["value"] == pr["ratio_step_median"] and t["met"] == (t["value"] <= 1.0)


def test_paired_tokens_are_checked_against_the_round_robin_runs() -> None:
    from scripts.lib.llm_shapes import RunOut, same_tokens_as_runs

    run = RunOut(tokens=torch.tensor([[7, 1, 2, 3]]))  # forward harness: the prefill's token first
    assert same_tokens_as_runs({"a": torch.tensor([[1, 2, 3]])}, {"a": ["error", run]}, "forward") is True
    assert same_tokens_as_runs({"a": torch.tensor([[1, 2, 4]])}, {"a": [run]}, "forward") is False
    assert same_tokens_as_runs({"a": torch.tensor([[7, 1, 2, 3]])}, {"a": [run]}, "fill") is True
    assert same_tokens_as_runs({"a": torch.tensor([[1, 2, 3]])}, {"b": [run]}, "forward") is None


def test_paired_summary_ratios_are_per_step() -> None:
    from scripts.lib.llm_shapes import paired_summary

    rounds = [{"ms": {"a": [10.0, 20.0, 40.0], "b": [20.0, 20.0, 20.0]}, "tokens_equal": True,
               "tokens_equal_runs": True},
              {"ms": {"a": [30.0], "b": [10.0]}, "tokens_equal": False, "tokens_equal_runs": None}]
    s = paired_summary(rounds, "a", "b")
    assert s["steps"] == 4 and s["ratio_step_median"] == 1.5  # ratios 0.5, 1, 2, 3
    assert s["ratio_by_round"] == [1.0, 3.0] and s["ratio_of_medians"] == 25.0 / 20.0
    assert s["ms_per_token"] == {"a": 25.0, "b": 20.0} and not s["tokens_equal"] and s["tokens_equal_runs"] is None


def test_forced_methods_run_only_when_asked() -> None:
    from scripts.lib.llm_shapes import FORCED, METHODS, parse_args

    assert FORCED and set(FORCED) <= set(METHODS)
    assert not set(FORCED) & set(parse_args(["--shape", "tiny"]).methods.split(","))


@pytest.mark.parametrize("harness", ["fill", "forward"])
def test_dense_outputs_equal_the_resident_cache(tiny_run: dict, harness: str) -> None:
    p = _point(tiny_run, "dense", harness)
    assert p["verification"]["reference"] == "dynamic_gpu"
    for name in ("ibpcache", "ibpcache_raw"):
        m = p["methods"][name]
        assert m["tokens_equal"] and m["logits_equal"] and m["max_abs_logit_diff"] == 0.0, name
        assert m["first_diff_step"] is None
    ours = p["methods"]["ibpcache"]
    assert ours["ratio"] > 1.0 and ours["stored_bytes"] < ours["raw_bytes"]  # real (or the model's own) KV compresses
    assert p["targets"]["host_target"]["met"]
    assert "prefill_ibpcache_over_ibpcache_raw" in p["targets"]


@pytest.mark.parametrize("harness", ["fill", "forward"])
def test_sparse_paths_agree(tiny_run: dict, harness: str) -> None:
    p = _point(tiny_run, "sparse", harness)
    raw, ours, forced = p["methods"]["ibpcache_raw"], p["methods"]["ibpcache"], p["methods"]["ibpcache_exp"]
    assert p["verification"]["reference"] == "ibpcache_raw"
    assert ours["tokens_equal"] and ours["logits_equal"] and ours["selected_k_equal"]
    assert forced["tokens_equal"] and forced["logits_equal"] and forced["selected_k_equal"]
    assert {c["method"] for layer in forced["codecs"] for c in layer} == {"exponent"}  # used as named
    assert "ibpcache_exp_over_ibpcache_raw" in p["targets"]
    assert raw["sparse_selection_active"] and ours["sparse_selection_active"]  # the hooks ran (transformers 5.24: cache=)
    assert 0 < ours["mean_selected_k"] <= 24  # --quick caps max_num_kv below the context: a real selection
    assert "warning" not in ours


def test_shapes_match_the_published_models() -> None:
    from transformers import AutoModelForCausalLM

    from scripts.lib.llm_shapes import build_config, geometry

    for shape, params, geo in (("llama8b", 8.030e9, (32, 8, 128)), ("qwen7b", 7.616e9, (28, 4, 128))):
        cfg = build_config(shape)
        assert geometry(cfg) == geo
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        assert abs(sum(p.numel() for p in model.parameters()) - params) < 1e-3 * params, shape
    llama = build_config("llama8b")
    rope = getattr(llama, "rope_parameters", None) or getattr(llama, "rope_scaling", None)
    assert rope["rope_type"] == "llama3"
    assert float(rope.get("rope_theta", getattr(llama, "rope_theta", 0))) == 500000.0


def test_kv_fill_is_real_rows_and_deterministic(shared_data_dir: Path) -> None:
    from ibpcache.datasets import load_kv
    from scripts.lib.llm_shapes import KvSource

    src = KvSource("chat", "bf16", "cpu", num_layers=4, seed=3)
    a = src.make(2, 0, batch=2, heads=5, tokens=33, head_dim=128)
    assert a.shape == (2, 5, 33, 128) and a.dtype == torch.bfloat16
    assert torch.equal(a, src.make(2, 0, batch=2, heads=5, tokens=33, head_dim=128))  # same bytes for every method
    assert not torch.equal(a, src.make(2, 1, batch=2, heads=5, tokens=33, head_dim=128))  # V differs from K
    real = load_kv("chat", "k", "bf16", flat=False)[src.layer_map[2]]  # [3, T, 64]
    rows = {tuple(r.view(torch.int16).tolist()) for r in real.reshape(-1, 64)}
    halves = a.reshape(-1, 2, 64)
    assert all(tuple(h.view(torch.int16).tolist()) in rows for h in halves.reshape(-1, 64)[:200])
    assert src.layer_map == [0, 10, 19, 29]


def test_host_estimates_round_pinned_blocks() -> None:
    from scripts.lib.llm_shapes import build_config, host_estimate, raw_kv_bytes

    cfg = build_config("llama8b")
    raw = raw_kv_bytes(cfg, 16, 32768, 2)
    assert raw == 32 * 2 * 16 * 8 * 128 * 2 * 32768  # 68.7 GB, the number
    assert host_estimate("infinigen_cpu_gather", cfg, 16, 32768, 2) == raw  # 1 GiB per layer tensor exactly
    assert host_estimate("hf_offloaded", cfg, 16, 32768, 2) == raw + 2 * (1 << 30)
    assert host_estimate("infinigen_cpu_gather", cfg, 16, 32769, 2) == 2 * raw  # one token over: 2 GiB blocks
    assert host_estimate("dynamic_gpu", cfg, 16, 32768, 2) == 0
    # without reserve_tokens (the forward harness) the CPU-gather store grows 1.5x at the first step: 1 + 2 GiB
    assert host_estimate("infinigen_cpu_gather", cfg, 16, 32768, 2, reserved=False) == 3 * raw


def test_bench_llm_dispatches_on_shape() -> None:
    from scripts.bench_llm import _shape_arg

    assert _shape_arg(["--shape", "llama8b", "--quick"]) == "llama8b"
    assert _shape_arg(["--shape=qwen7b"]) == "qwen7b"
    assert _shape_arg(["--quick"]) is None
    res = subprocess.run([sys.executable, str(SCRIPT), "--shape", "llama8b", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "--max-host-gb" in res.stdout and "--deadline-s" in res.stdout


def test_plan_lists_every_run_and_what_would_not_fit() -> None:
    from scripts.lib.llm_shapes import parse_args, plan

    rows = plan(parse_args(["--shape", "llama8b", "--contexts", "32768,8192", "--max-host-gb", "115",
                            "--gpu-gb", "80"]))
    assert len(rows) == 2 * (5 + 3)
    skips = {(r["context"], r["mode"], r["method"]): r["skip"] for r in rows}
    assert skips[(32768, "dense", "dynamic_gpu")].startswith("GPU")  # 68.7 GB of KV + 16 GB of weights
    assert skips[(8192, "dense", "dynamic_gpu")] is None
    assert all(v is None for k, v in skips.items() if k[2] != "dynamic_gpu")
    both = plan(parse_args(["--shape", "llama8b", "--contexts", "131072", "--batches", "1", "--harness",
                            "fill,forward", "--max-host-gb", "115", "--gpu-gb", "80"]))
    assert {r["harness"] for r in both} == {"fill", "forward"} and len(both) == 2 * (5 + 3)
    assert all(r["skip"] is None for r in both), "128k tokens at batch 1 (17.2 GB of KV) fit every method"
    tight = plan(parse_args(["--shape", "llama8b", "--contexts", "32768", "--max-host-gb", "60"]))
    assert all(r["skip"] and r["skip"].startswith("host") for r in tight if r["method"] != "dynamic_gpu")
