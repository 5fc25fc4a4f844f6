"""Tests of ibpcache.datasets: real loaders (shapes, dtypes, GCN order, bit-exact conversions), SU resampling and
the synthetic access streams (determinism, ranges, skew)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ibpcache import datasets as D
from ibpcache.errors import FormatError

BUNDLED = Path(D.__file__).parent / "data" / "cora"


# ---------------------------------------------------------------------------------------------- Cora


def test_cora_shapes_split_and_known_statistics(cora: D.GraphData) -> None:
    assert cora.features.shape == (2708, 1433) and cora.features.dtype == torch.float32
    assert cora.labels.shape == (2708,) and cora.labels.dtype == torch.int64
    assert cora.num_classes == 7
    # Published Cora facts: 49216 word occurrences, class sizes, 5278 undirected edges (PyG: 10556 directed).
    assert set(cora.features.unique().tolist()) == {0.0, 1.0}
    assert int(cora.features.sum()) == 49216
    assert torch.bincount(cora.labels).tolist() == [351, 217, 418, 818, 426, 298, 180]
    assert cora.num_edges == 10556
    assert cora.train_mask.sum() == 140 and bool(cora.train_mask[:140].all())
    assert cora.val_mask.sum() == 500 and bool(cora.val_mask[140:640].all())
    assert cora.test_mask.sum() == 1000
    assert not bool((cora.train_mask & cora.val_mask).any() or (cora.val_mask & cora.test_mask).any())


def test_cora_edges_symmetric_simple_sorted(cora: D.GraphData) -> None:
    src, dst = cora.src, cora.dst
    assert src.dtype == dst.dtype == torch.int64
    assert not bool((src == dst).any())
    key = src * cora.num_nodes + dst
    assert bool((key[1:] > key[:-1]).all())  # sorted by (src, dst), hence no duplicates
    assert torch.equal(torch.sort(dst * cora.num_nodes + src).values, key)  # every edge in both directions
    # Cora is strongly homophilous (about 81% of edges join same-class papers): a wrong node order would break it.
    assert float((cora.labels[src] == cora.labels[dst]).float().mean()) > 0.78


@pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")
def test_cora_matches_gcn_loader(cora: D.GraphData) -> None:
    """Same features and labels as the GCN paper's loader recipe, run with SciPy on the same files."""
    sp = pytest.importorskip("scipy.sparse")

    def load(part: str):
        with open(BUNDLED / f"ind.cora.{part}", "rb") as fh:
            return pickle.load(fh, encoding="latin1")

    test_file_order = np.loadtxt(BUNDLED / "ind.cora.test.index", dtype=np.int64)
    test_sorted = np.sort(test_file_order)
    feats = sp.vstack((load("allx"), load("tx"))).tolil()
    feats[test_file_order, :] = feats[test_sorted, :]
    labels = np.vstack((load("ally"), load("ty")))
    labels[test_file_order, :] = labels[test_sorted, :]
    assert np.array_equal(feats.toarray(), cora.features.numpy())
    assert np.array_equal(labels.argmax(1), cora.labels.numpy())
    assert torch.equal(cora.test_mask.nonzero().flatten(), torch.from_numpy(test_sorted))


def test_bundled_cora_equals_shared_copy(shared_data_dir: Path) -> None:
    shared = shared_data_dir / "gnn" / "planetoid"
    for path in sorted(BUNDLED.glob("ind.cora.*")):
        assert path.read_bytes() == (shared / path.name).read_bytes(), path.name
    assert (BUNDLED / "ATTRIBUTION.md").is_file()
    assert len(list(BUNDLED.glob("LICENSE*"))) == 2


def test_cora_loads_without_scipy() -> None:
    """The quick start installs no SciPy: the restricted unpickler must not need it."""
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "scipy" or name.startswith("scipy."):
                    raise ImportError("scipy blocked for this test")
        sys.meta_path.insert(0, Block())
        from ibpcache.datasets import load_cora
        g = load_cora()
        assert g.features.shape == (2708, 1433), g.features.shape
        assert not any(m == "scipy" or m.startswith("scipy.") for m in sys.modules)
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_planetoid_unpickler_refuses_foreign_objects(tmp_path: Path) -> None:
    (tmp_path / "ind.cora.x").write_bytes(pickle.dumps(print, protocol=2))
    files = D._PlanetoidFiles(tmp_path, "cora")
    with pytest.raises(FormatError, match=r"unexpected object .*print"):
        files.pickle("x")
    with pytest.raises(FileNotFoundError, match="ind.cora.tx"):
        files.pickle("tx")


# ---------------------------------------------------------------------------------------------- PubMed


def test_pubmed_graph(pubmed: D.GraphData, shared_data_dir: Path) -> None:
    assert pubmed.features.shape == (19717, 500) and pubmed.features.dtype == torch.float32
    assert pubmed.num_classes == 3 and pubmed.labels.shape == (19717,)
    assert pubmed.num_edges == 88648
    assert pubmed.train_mask.sum() == 60 and pubmed.val_mask.sum() == 500 and pubmed.test_mask.sum() == 1000
    assert pubmed.feature_is_real is not None
    assert torch.equal(pubmed.feature_is_real, pubmed.train_mask | pubmed.test_mask)
    real = D.load_pubmed_rows(shared_data_dir)
    assert real.shape == (1060, 500) and real.dtype == torch.float32
    assert torch.equal(pubmed.features[:60], real[:60])
    # every row, real or borrowed, is one of the 1060 real rows
    known = {bytes(r.numpy().tobytes()) for r in real}
    assert all(bytes(r.numpy().tobytes()) in known for r in pubmed.features[::97])


def test_pubmed_borrowed_rows_are_seeded(shared_data_dir: Path) -> None:
    a, b, c = (D.load_pubmed(shared_data_dir, seed=s) for s in (0, 0, 1))
    assert torch.equal(a.features, b.features)
    assert not torch.equal(a.features, c.features)
    assert torch.equal(a.features[a.feature_is_real], c.features[c.feature_is_real])


# ---------------------------------------------------------------------------------------------- dense rows


def test_minilm(minilm: torch.Tensor) -> None:
    assert minilm.shape == (30522, 384) and minilm.dtype == torch.float32
    assert bool(torch.isfinite(minilm).all())


@pytest.mark.parametrize("name, tokens", [("chat", 314), ("code", 832)])
@pytest.mark.parametrize("which", ["k", "v"])
def test_kv_shapes_and_bit_exact_conversions(shared_data_dir: Path, name: str, tokens: int, which: str) -> None:
    fp32 = D.load_kv(name, which, "fp32", shared_data_dir)
    fp16 = D.load_kv(name, which, "fp16", shared_data_dir)
    bf16 = D.load_kv(name, which, "bf16", shared_data_dir)
    assert fp32.shape == fp16.shape == bf16.shape == (30 * 3 * tokens, 64)
    assert (fp32.dtype, fp16.dtype, bf16.dtype) == (torch.float32, torch.float16, torch.bfloat16)
    assert bf16.is_contiguous() and fp16.is_contiguous()
    # bf16 is the top half of each fp32 bit pattern (truncation), bit for bit
    expected_bits = (fp32.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(bf16.view(torch.int16), expected_bits)
    # chat (stored fp32): fp16 rounds to nearest even, as torch casts; code (stored fp16): fp32 is the exact
    # upcast, so casting it back gives the stored bits
    assert torch.equal(fp32.to(torch.float16).view(torch.int16), fp16.view(torch.int16))
    four_d = D.load_kv(name, which, "fp16", shared_data_dir, flat=False)
    assert four_d.shape == (30, 3, tokens, 64)
    assert torch.equal(four_d.reshape(-1, 64).view(torch.int16), fp16.view(torch.int16))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"name": "nope"}, "unknown KV"), ({"which": "q"}, "which"), ({"dtype": "int8"}, "dtype")],
)
def test_kv_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        D.load_kv(**kwargs)


def test_registry_names_and_rows(real_rows) -> None:
    expected = {"cora", "pubmed", "minilm"} | {
        f"kv_{n}_{w}_{d}" for n in ("chat", "code") for w in "kv" for d in ("fp16", "bf16", "fp32")
    }
    assert set(D.DATASETS) == expected
    assert real_rows("cora").shape == (2708, 1433)
    for name in ("pubmed", "kv_chat_k_bf16"):
        rows = real_rows(name)
        assert rows.ndim == 2 and rows.shape[0] > 1000
    with pytest.raises(FormatError, match="unknown data set 'x'"):
        D.load_rows("x")


def test_shared_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shared_data_dir: Path) -> None:
    (tmp_path / "data").symlink_to(shared_data_dir)
    monkeypatch.setenv(D.SHARED_ENV, str(tmp_path))
    assert D.shared_data_dir() == tmp_path / "data"
    with pytest.raises(FileNotFoundError, match="missing data file"):
        D.load_minilm(tmp_path)


# ---------------------------------------------------------------------------------------------- scale-up


def test_scale_up_size_dtype_and_determinism(cora: D.GraphData) -> None:
    rows = cora.features[:300]
    row_bytes = 1433 * 4
    big = D.scale_up(rows, 1000 * row_bytes + 1, seed=3)
    assert big.shape == (1001, 1433) and big.dtype == torch.float32
    assert torch.equal(big, D.scale_up(rows, 1000 * row_bytes + 1, seed=3))
    assert not torch.equal(big, D.scale_up(rows, 1000 * row_bytes + 1, seed=4))
    assert D.scale_up(rows, 1, seed=0).shape == (1, 1433)
    # every output row is a real input row
    known = {r.numpy().tobytes() for r in rows}
    assert all(r.numpy().tobytes() in known for r in big)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.uint8, torch.int64])
def test_resample_keeps_dtype_and_row_shape(dtype: torch.dtype) -> None:
    rows = torch.arange(5 * 3 * 4).reshape(5, 3, 4).to(dtype)
    out = D.resample_rows(rows, 17, seed=0)
    assert out.dtype == dtype and out.shape == (17, 3, 4)
    flat = rows.reshape(5, -1)
    assert all(any(torch.equal(o.reshape(-1), f) for f in flat) for o in out)
    assert D.resample_rows(rows, 0).shape == (0, 3, 4)


def test_resample_across_chunks_is_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "_RESAMPLE_CHUNK_ROWS", 7)
    rows = torch.arange(50, dtype=torch.int64).unsqueeze(1)
    a = D.resample_rows(rows, 100, seed=9)
    assert torch.equal(a, D.resample_rows(rows, 100, seed=9))
    assert a.unique().numel() > 30  # all chunks drew fresh indices


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda r: D.scale_up(r, 0), "target_bytes"),
        (lambda r: D.scale_up(r, -5), "target_bytes"),
        (lambda r: D.scale_up(r[:0], 100), "non-empty"),
        (lambda r: D.scale_up(r.numpy(), 100), "non-empty"),
        (lambda r: D.resample_rows(r, -1), "n_out"),
        (lambda r: D.resample_rows(r, 3, seed=1.5), "seed"),
    ],
)
def test_scale_up_bad_input(call, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        call(torch.ones(4, 8))


# ---------------------------------------------------------------------------------------------- access streams


def test_zipf_ids_range_determinism_and_skew() -> None:
    n_rows, n, a = 5000, 200_000, 1.05
    ids = D.zipf_ids(n_rows, n, a=a, seed=1)
    assert ids.dtype == torch.int64 and ids.shape == (n,)
    assert int(ids.min()) >= 0 and int(ids.max()) < n_rows
    assert torch.equal(ids, D.zipf_ids(n_rows, n, a=a, seed=1))
    counts = torch.bincount(ids, minlength=n_rows).double()
    top = counts.sort(descending=True).values
    harmonic = float((torch.arange(1, n_rows + 1, dtype=torch.float64) ** -a).sum())
    assert abs(float(top[0]) / n - 1 / harmonic) < 0.01  # rank 1 has P = 1 / H(n_rows, a)
    assert abs(float(top[1]) / float(top[0]) - 2**-a) < 0.05
    hottest = {int(D.zipf_ids(n_rows, 5000, a=a, seed=s).bincount().argmax()) for s in range(4)}
    assert hottest != {0}  # the permutation moves the hot rows away from id 0


def test_zipf_draws_share_a_hot_set_only_through_hot_seed() -> None:
    """A cache benchmark's batches must share one hot set: the same ``hot_seed`` gives the same hottest rows for
    any ``seed`` (and other draws of them); ``seed`` alone gives each draw its own hot rows."""
    n_rows, n = 20_000, 50_000

    def top(ids: torch.Tensor, k: int = 20) -> set[int]:
        return set(torch.bincount(ids, minlength=n_rows).topk(k).indices.tolist())

    shared = [D.zipf_ids(n_rows, n, seed=s, hot_seed=7) for s in range(3)]
    assert not torch.equal(shared[0], shared[1])
    assert len(top(shared[0]) & top(shared[1])) >= 15 and len(top(shared[1]) & top(shared[2])) >= 15
    own = [D.zipf_ids(n_rows, n, seed=s) for s in range(2)]
    assert len(top(own[0]) & top(own[1])) <= 2
    with pytest.raises(FormatError):
        D.zipf_ids(10, 5, hot_seed=1.5)


def test_hot_set_ids_share_of_accesses_and_shared_hot_rows() -> None:
    """``share`` of the draws land on the ``hot_rows`` hot rows (plus the uniform part's own hot-row hits), every hot
    row is drawn about equally often, the same ``hot_seed`` gives the same hot rows for other ``seed``s."""
    n_rows, n, hot_rows, share = 10_000, 400_000, 1_500, 0.9
    ids = D.hot_set_ids(n_rows, n, hot_rows, share, seed=3, hot_seed=11)
    assert ids.dtype == torch.int64 and ids.shape == (n,) and int(ids.min()) >= 0 and int(ids.max()) < n_rows
    assert torch.equal(ids, D.hot_set_ids(n_rows, n, hot_rows, share, seed=3, hot_seed=11))
    counts = torch.bincount(ids, minlength=n_rows).double()
    hot = counts.topk(hot_rows).indices
    expect_hot = share + (1 - share) * hot_rows / n_rows
    assert abs(float(counts[hot].sum()) / n - expect_hot) < 0.01
    per_hot = counts[hot] / n
    assert float(per_hot.std() / per_hot.mean()) < 0.12  # uniform within the hot set: Poisson spread only
    other = D.hot_set_ids(n_rows, n, hot_rows, share, seed=4, hot_seed=11)
    assert not torch.equal(ids, other)
    assert set(torch.bincount(other, minlength=n_rows).topk(hot_rows).indices.tolist()) == set(hot.tolist())
    assert int(torch.bincount(D.hot_set_ids(n_rows, 1000, 1, 1.0, seed=0), minlength=n_rows).count_nonzero()) == 1
    for bad in ({"hot_rows": 0}, {"hot_rows": n_rows + 1}, {"share": 1.5}, {"share": "0.5"}):
        with pytest.raises(FormatError):
            D.hot_set_ids(n_rows, 10, **({"hot_rows": 5} | bad))


def test_zipf_uniform_and_bad_args() -> None:
    ids = D.zipf_ids(10, 100_000, a=0.0, seed=0)
    counts = torch.bincount(ids, minlength=10).double() / 100_000
    assert bool(((counts - 0.1).abs() < 0.01).all())
    assert D.zipf_ids(10, 0).shape == (0,)
    for kwargs in ({"n_rows": 0, "n": 5}, {"n_rows": 5, "n": -1}, {"n_rows": 5, "n": 5, "a": -1.0}):
        with pytest.raises(FormatError):
            D.zipf_ids(**kwargs)


def test_power_law_graph() -> None:
    n, deg = 20_000, 20
    src, dst = D.power_law_graph(n, avg_degree=deg, seed=5)
    assert src.dtype == dst.dtype == torch.int64 and src.shape == dst.shape
    assert int(src.min()) >= 0 and int(src.max()) < n and int(dst.max()) < n
    assert not bool((src == dst).any())
    half = src.numel() // 2
    assert torch.equal(src[:half], dst[half:]) and torch.equal(dst[:half], src[half:])
    assert abs(src.numel() / n - deg) < 0.5
    degrees = torch.bincount(src, minlength=n)
    assert int(degrees.max()) > 20 * deg  # heavy tail
    assert float(degrees.float().median()) < deg  # most nodes are below the mean
    assert int(degrees.argmax()) != 0  # hubs are permuted over the id range
    again = D.power_law_graph(n, avg_degree=deg, seed=5)
    assert torch.equal(src, again[0]) and torch.equal(dst, again[1])
    assert not torch.equal(src, D.power_law_graph(n, avg_degree=deg, seed=6)[0])
    with pytest.raises(FormatError, match="alpha"):
        D.power_law_graph(10, alpha=1.0)
    with pytest.raises(FormatError, match="avg_degree"):
        D.power_law_graph(10, avg_degree=0)


def test_degree_proportional_ids() -> None:
    degrees = torch.tensor([0, 1, 0, 3, 6], dtype=torch.int64)
    ids = D.degree_proportional_ids(degrees, 100_000, seed=2)
    assert ids.dtype == torch.int64
    freq = torch.bincount(ids, minlength=5).double() / 100_000
    assert freq[0] == 0 and freq[2] == 0  # degree 0 is never drawn
    assert bool(((freq - degrees.double() / 10).abs() < 0.01).all())
    assert torch.equal(ids, D.degree_proportional_ids(degrees, 100_000, seed=2))
    for bad in (torch.zeros(3), torch.tensor([1.0, -1.0]), torch.tensor([]), torch.ones(2, 2)):
        with pytest.raises(FormatError):
            D.degree_proportional_ids(bad, 10)
