"""Real data for tests and benchmarks, and ways to make it bigger without making it fake.

IBP exploits bit patterns that real rows share, so a compression ratio measured on random numbers says nothing.
Every loader here returns real rows:

* Cora (bundled in ``ibpcache/data/cora``, so the quick start needs no download) and PubMed (Planetoid files
  from the shared data folder), in the GCN paper's node order and split;
* the trained MiniLM word-embedding table (dense float32 rows, the DLRM-like case);
* real KV-cache rows of SmolLM2-135M as fp16, bf16 or fp32.

To reach benchmark sizes, :func:`scale_up` / :func:`resample_rows` resample real rows with replacement (the
paper's "SU" data sets); :func:`power_law_graph`, :func:`zipf_ids`, :func:`hot_set_ids` and
:func:`degree_proportional_ids` make the graphs and access streams that decide which of those rows are hot.

Only NumPy and PyTorch are used (no CUDA, no SciPy): the Planetoid pickles hold SciPy CSR matrices, which a
restricted unpickler reads into plain arrays.
"""

from __future__ import annotations

import collections
import functools
import math
import numbers
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ibpcache.errors import FormatError

__all__ = [
    "GraphData",
    "shared_data_dir",
    "load_cora",
    "load_pubmed",
    "load_pubmed_rows",
    "load_minilm",
    "load_kv",
    "resample_rows",
    "scale_up",
    "power_law_graph",
    "degree_proportional_ids",
    "zipf_ids",
    "hot_set_ids",
    "DATASETS",
    "load_rows",
]

#: Environment variable naming the shared folder (``.../shared``) or its ``data`` folder.
SHARED_ENV = "IBPCACHE_SHARED"

_REPO_ROOT = Path(__file__).resolve().parent.parent
_MINILM_FILE = "embeddings/word_embeddings_30522x384_f32.npy"
_KV_FILES = {"chat": "llm/chat_gnn_fp32.npz", "code": "llm/code_json_decoder_fp16.npz"}
_KV_DTYPES = ("fp16", "bf16", "fp32")
#: Rows copied per step by :func:`resample_rows`; bounds the temporary index tensor, not the result.
_RESAMPLE_CHUNK_ROWS = 1 << 20


@dataclass(frozen=True)
class GraphData:
    """A node-classification graph as plain tensors (no framework objects, so any loader can wrap it).

    ``src``/``dst`` hold every undirected edge in both directions, without self loops or duplicates, sorted by
    ``(src, dst)``. ``feature_is_real[i]`` is False where node ``i``'s feature row was borrowed from another node
    (PubMed ships features for only 1060 nodes); None means every row is the node's own.
    """

    name: str
    features: torch.Tensor  # float32 [N, F]
    labels: torch.Tensor  # int64 [N]
    src: torch.Tensor  # int64 [E]
    dst: torch.Tensor  # int64 [E]
    train_mask: torch.Tensor  # bool [N]
    val_mask: torch.Tensor  # bool [N]
    test_mask: torch.Tensor  # bool [N]
    num_classes: int
    feature_is_real: torch.Tensor | None = None  # bool [N]

    @property
    def num_nodes(self) -> int:
        return int(self.features.shape[0])

    @property
    def num_edges(self) -> int:
        """Directed edge count (each undirected edge counts twice)."""
        return int(self.src.numel())


# --------------------------------------------------------------------------------------------------------------
# Locating data


def shared_data_dir() -> Path:
    """Return the shared real-data folder, so tests and benchmarks find it from any checkout.

    Looked up in order: ``$IBPCACHE_SHARED`` (the ``shared`` folder or its ``data`` folder), ``../shared/data``
    beside the repository, ``../shared/data`` beside the working directory, ``/work/shared/data``.
    Raises FileNotFoundError naming every place tried.
    """
    candidates: list[Path] = []
    env = os.environ.get(SHARED_ENV)
    if env:
        candidates += [Path(env) / "data", Path(env)]
    candidates += [_REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    candidates.append(Path("/work/shared/data"))
    for cand in candidates:
        if (cand / "gnn").is_dir() or (cand / "embeddings").is_dir() or (cand / "llm").is_dir():
            return cand
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"shared data folder not found (set {SHARED_ENV}); tried: {tried}")


def _shared_file(relative: str, root: str | os.PathLike[str] | None) -> Path:
    """Resolve a file under the shared data folder and fail with its full path if it is missing."""
    base = Path(root) if root is not None else shared_data_dir()
    path = base / relative
    if not path.is_file():
        raise FileNotFoundError(f"missing data file {path}")
    return path


# --------------------------------------------------------------------------------------------------------------
# Planetoid (Cora, PubMed)


class _CsrState:
    """Receives a pickled ``scipy.sparse.csr_matrix``'s state, so reading it needs no SciPy."""

    state: dict[str, Any]

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.state = state

    def to_dense(self) -> np.ndarray:
        """Dense float32 copy; duplicate entries add up, as ``csr_matrix.toarray`` does."""
        st = self.state
        if st.get("format", "csr") != "csr":
            raise FormatError(f"expected a CSR matrix in the Planetoid pickle, got format {st.get('format')!r}")
        n_rows, n_cols = (int(v) for v in st["_shape"])
        indptr = np.asarray(st["indptr"], dtype=np.int64)
        indices = np.asarray(st["indices"], dtype=np.int64)
        data = np.asarray(st["data"], dtype=np.float32)
        if indptr.shape != (n_rows + 1,) or indices.shape != data.shape or indptr[-1] != data.size:
            raise FormatError("corrupt CSR matrix in the Planetoid pickle (indptr/indices/data disagree)")
        out = np.zeros((n_rows, n_cols), dtype=np.float32)
        row_of = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(indptr))
        np.add.at(out, (row_of, indices), data)
        return out


def _numpy_reconstruct() -> Callable[..., Any]:
    """``numpy.core.multiarray._reconstruct`` without NumPy 2's deprecation warning for ``numpy.core``."""
    try:
        from numpy._core.multiarray import _reconstruct  # type: ignore[attr-defined]
    except ImportError:  # NumPy < 1.26 has no numpy._core
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return _reconstruct


class _PlanetoidUnpickler(pickle.Unpickler):
    """Python-2 pickle reader that builds only the few types Planetoid files contain (and nothing executable)."""

    _ALLOWED: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("collections", "defaultdict"): collections.defaultdict,
        ("__builtin__", "list"): list,
        ("builtins", "list"): list,
        ("scipy.sparse.csr", "csr_matrix"): _CsrState,
        ("scipy.sparse._csr", "csr_matrix"): _CsrState,
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")}:
            return _numpy_reconstruct()
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise FormatError(f"unexpected object {module}.{name} in a Planetoid pickle") from None


class _PlanetoidFiles:
    """Reads the ``ind.<name>.<part>`` files of one Planetoid data set from a folder or package resource."""

    def __init__(self, folder: Any, name: str) -> None:
        self.folder = folder  # Path or importlib.resources Traversable
        self.name = name

    def _file(self, part: str) -> Any:
        entry = self.folder / f"ind.{self.name}.{part}"
        if not entry.is_file():
            raise FileNotFoundError(f"missing Planetoid file {entry}")
        return entry

    def pickle(self, part: str) -> Any:
        with self._file(part).open("rb") as fh:
            return _PlanetoidUnpickler(fh, encoding="latin1").load()

    def dense(self, part: str) -> np.ndarray:
        obj = self.pickle(part)
        if isinstance(obj, _CsrState):
            return obj.to_dense()
        return np.asarray(obj)

    def test_index(self) -> np.ndarray:
        text = self._file("test.index").read_text()
        return np.array([int(tok) for tok in text.split()], dtype=np.int64)

    def edges(self, n_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Adjacency lists -> both directions, no self loops, no duplicates, sorted by (src, dst)."""
        graph = self.pickle("graph")
        keys = np.fromiter(graph.keys(), dtype=np.int64, count=len(graph))
        counts = np.fromiter((len(v) for v in graph.values()), dtype=np.int64, count=len(graph))
        src = np.repeat(keys, counts)
        dst = np.fromiter((d for v in graph.values() for d in v), dtype=np.int64, count=int(counts.sum()))
        if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n_nodes):
            raise FormatError(f"{self.name}: adjacency lists name nodes outside [0, {n_nodes})")
        both_src = np.concatenate([src, dst])
        both_dst = np.concatenate([dst, src])
        keep = both_src != both_dst
        key = np.unique(both_src[keep] * n_nodes + both_dst[keep])
        return torch.from_numpy(key // n_nodes), torch.from_numpy(key % n_nodes)


def _gcn_order(stacked: np.ndarray, test_file_order: np.ndarray) -> np.ndarray:
    """Put test rows where the GCN paper's loader puts them.

    ``tx``/``ty`` row ``i`` belongs to node ``test.index[i]`` (file order). The GCN loader stacks
    ``allx`` on ``tx`` and then runs ``features[test_idx_reorder] = features[sorted(test_idx_reorder)]``;
    this does the same on a NumPy array (the right side is a copy, so the update is safe).
    """
    out = stacked.copy()
    out[test_file_order] = stacked[np.sort(test_file_order)]
    return out


def _split_masks(n_nodes: int, n_train: int, test_idx: np.ndarray) -> tuple[torch.Tensor, ...]:
    """The GCN split: train = the first ``len(y)`` nodes, val = the next 500, test = ``test.index``."""
    train = torch.zeros(n_nodes, dtype=torch.bool)
    val = torch.zeros(n_nodes, dtype=torch.bool)
    test = torch.zeros(n_nodes, dtype=torch.bool)
    train[:n_train] = True
    val[n_train : n_train + 500] = True
    test[torch.from_numpy(test_idx)] = True
    return train, val, test


def _labels(files: _PlanetoidFiles, test_idx: np.ndarray) -> tuple[torch.Tensor, int]:
    """One-hot ``ally``/``ty`` -> int64 class ids in node order."""
    onehot = _gcn_order(np.vstack([files.dense("ally"), files.dense("ty")]), test_idx)
    return torch.from_numpy(onehot.argmax(axis=1).astype(np.int64)), int(onehot.shape[1])


def _bundled_cora() -> Any:
    return resources.files("ibpcache").joinpath("data", "cora")


def load_cora(folder: str | os.PathLike[str] | None = None) -> GraphData:
    """Cora from the copy bundled with the package (or from ``folder`` holding ``ind.cora.*``).

    2708 nodes, 1433 binary bag-of-words features (float32), 7 classes, 10556 directed edges; node order, labels
    and the 140/500/1000 split are those of the GCN paper's loader.
    """
    files = _PlanetoidFiles(Path(folder) if folder is not None else _bundled_cora(), "cora")
    test_idx = files.test_index()
    features = _gcn_order(np.vstack([files.dense("allx"), files.dense("tx")]), test_idx)
    labels, n_classes = _labels(files, test_idx)
    n_nodes = features.shape[0]
    src, dst = files.edges(n_nodes)
    train, val, test = _split_masks(n_nodes, files.dense("y").shape[0], test_idx)
    return GraphData("cora", torch.from_numpy(features), labels, src, dst, train, val, test, n_classes)


def _pubmed_files(root: str | os.PathLike[str] | None) -> _PlanetoidFiles:
    base = Path(root) if root is not None else shared_data_dir()
    return _PlanetoidFiles(base / "gnn" / "planetoid", "pubmed")


def load_pubmed_rows(root: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """The 1060 real PubMed feature rows (``x`` stacked on ``tx``, file order): float32 [1060, 500] TF-IDF.

    ``root`` is the shared data folder (default: :func:`shared_data_dir`).
    """
    files = _pubmed_files(root)
    return torch.from_numpy(np.vstack([files.dense("x"), files.dense("tx")]))


def load_pubmed(root: str | os.PathLike[str] | None = None, seed: int = 0) -> GraphData:
    """PubMed's full graph (19717 nodes, 3 classes, 88648 directed edges) with a real feature row on every node.

    The Planetoid release has features for only 1060 nodes: the 60 training nodes (``x``) and the 1000 test
    nodes (``tx``). Those nodes keep their own rows; every other node gets a copy of one of the 1060 real rows,
    drawn uniformly with replacement by a ``torch.Generator`` seeded with ``seed`` (so the result is deterministic).
    ``feature_is_real`` marks which nodes hold their own row. Labels, edges and the split are the real ones.
    """
    files = _pubmed_files(root)
    test_idx = files.test_index()
    x, tx = files.dense("x"), files.dense("tx")
    labels, n_classes = _labels(files, test_idx)
    n_nodes = int(labels.numel())
    real_rows = torch.from_numpy(np.vstack([x, tx]))
    features = resample_rows(real_rows, n_nodes, seed=seed)
    features[: x.shape[0]] = torch.from_numpy(x)
    features[torch.from_numpy(test_idx)] = torch.from_numpy(tx)
    is_real = torch.zeros(n_nodes, dtype=torch.bool)
    is_real[: x.shape[0]] = True
    is_real[torch.from_numpy(test_idx)] = True
    src, dst = files.edges(n_nodes)
    train, val, test = _split_masks(n_nodes, x.shape[0], test_idx)
    return GraphData("pubmed", features, labels, src, dst, train, val, test, n_classes, is_real)


# --------------------------------------------------------------------------------------------------------------
# Dense rows: embedding table and KV cache


def load_minilm(root: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """The trained all-MiniLM-L6-v2 word-embedding table: float32 [30522, 384] (1536-byte rows)."""
    return torch.from_numpy(np.load(_shared_file(_MINILM_FILE, root)))


def _bf16_truncate(fp32: np.ndarray) -> torch.Tensor:
    """bfloat16 = the top 16 bits of each float32 bit pattern (truncation, not rounding), done bit-exactly."""
    top = (np.ascontiguousarray(fp32, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return torch.from_numpy(top.view(np.int16)).view(torch.bfloat16)


def load_kv(
    name: str = "chat",
    which: str = "k",
    dtype: str = "fp16",
    root: str | os.PathLike[str] | None = None,
    flat: bool = True,
) -> torch.Tensor:
    """Real KV-cache rows of SmolLM2-135M (30 layers x 3 KV heads, head dim 64).

    ``name="chat"``: 314 tokens stored as float32; ``"code"``: 832 tokens of Python stored as float16.
    Returns ``[layers * heads * tokens, 64]`` (one row = one token of one head, layer-major) or, with
    ``flat=False``, ``[layers, heads, tokens, 64]``.

    Conversions: fp32 -> fp16 rounds to nearest even (NumPy's cast); fp32 -> bf16 keeps the top 16 bits of each
    float32 (truncation). The code file is fp16 already: its fp32 is the exact upcast, and its bf16 is that
    upcast truncated, which drops 3 of fp16's 10 mantissa bits (real values, but not the model's own bf16 run).
    """
    if name not in _KV_FILES:
        raise FormatError(f"unknown KV data set {name!r}; expected one of {sorted(_KV_FILES)}")
    if which not in ("k", "v"):
        raise FormatError(f"which must be 'k' or 'v', got {which!r}")
    if dtype not in _KV_DTYPES:
        raise FormatError(f"dtype must be one of {_KV_DTYPES}, got {dtype!r}")
    with np.load(_shared_file(_KV_FILES[name], root)) as npz:
        stored = npz[which]
    if stored.ndim != 4:
        raise FormatError(f"expected a [layers, heads, tokens, dim] array, got shape {stored.shape}")
    if dtype == "bf16":
        out = _bf16_truncate(stored.astype(np.float32))
    else:
        out = torch.from_numpy(np.ascontiguousarray(stored.astype(np.float16 if dtype == "fp16" else np.float32)))
    return out.reshape(-1, stored.shape[-1]) if flat else out


# --------------------------------------------------------------------------------------------------------------
# Scaling real rows up ("SU") and synthetic access patterns over them


def _generator(seed: int) -> torch.Generator:
    if not isinstance(seed, int | np.integer) or isinstance(seed, bool):
        raise FormatError(f"seed must be an int, got {type(seed).__name__}")
    return torch.Generator(device="cpu").manual_seed(int(seed))


def _check_count(value: Any, name: str, minimum: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
        raise FormatError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def resample_rows(
    rows: torch.Tensor, n_out: int, seed: int = 0, *, pin_memory: bool = False
) -> torch.Tensor:
    """``n_out`` rows drawn uniformly with replacement from ``rows`` (deterministic for a given ``seed``).

    Works chunk by chunk (:data:`_RESAMPLE_CHUNK_ROWS` rows at a time) straight into the result, so multi-GB
    outputs need no Python loop per row and no full-size index tensor. ``pin_memory=True`` allocates the result
    in pinned host memory (needs CUDA), which saves a second copy when the rows become a zero-copy host store.
    """
    if not isinstance(rows, torch.Tensor):
        raise FormatError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.ndim < 1 or rows.shape[0] == 0:
        raise FormatError(f"rows must have at least one row, got shape {tuple(rows.shape)}")
    n_out = _check_count(n_out, "n_out", 0)
    if pin_memory and rows.device.type != "cpu":
        raise FormatError("pin_memory=True needs rows on the CPU")
    gen = _generator(seed)
    out = torch.empty((n_out, *rows.shape[1:]), dtype=rows.dtype, device=rows.device, pin_memory=pin_memory)
    for start in range(0, n_out, _RESAMPLE_CHUNK_ROWS):
        stop = min(start + _RESAMPLE_CHUNK_ROWS, n_out)
        idx = torch.randint(rows.shape[0], (stop - start,), generator=gen).to(rows.device)
        torch.index_select(rows, 0, idx, out=out[start:stop])
    return out


def scale_up(rows: torch.Tensor, target_bytes: int, seed: int = 0, *, pin_memory: bool = False) -> torch.Tensor:
    """The paper's "SU" data set: real rows resampled with replacement up to ``target_bytes``.

    Returns ``ceil(target_bytes / row_bytes)`` rows (at least one), so the result is at least ``target_bytes``
    and less than one row more. Row statistics stay those of the real data; only the row count grows.
    """
    target_bytes = _check_count(target_bytes, "target_bytes", 1)
    if not isinstance(rows, torch.Tensor) or rows.ndim < 1 or rows.shape[0] == 0:
        raise FormatError("rows must be a non-empty torch.Tensor")
    row_bytes = rows[0].numel() * rows.element_size()
    if row_bytes == 0:
        raise FormatError(f"rows of zero bytes cannot be scaled up (shape {tuple(rows.shape)})")
    return resample_rows(rows, max(1, math.ceil(target_bytes / row_bytes)), seed, pin_memory=pin_memory)


def _sample_weighted(weights: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` int64 indices drawn with replacement, P(i) proportional to ``weights[i]`` (inverse CDF, vectorised)."""
    cdf = torch.cumsum(weights.to(torch.float64), 0)
    total = float(cdf[-1])
    u = torch.rand(n, dtype=torch.float64, generator=gen) * total
    idx = torch.searchsorted(cdf, u, right=True)
    # u can round up to `total`; clamp to the last index that has weight, never to a zero-weight tail.
    last = int(torch.nonzero(weights > 0)[-1])
    return idx.clamp_(max=last)


def _power_law_ranks(n_nodes: int, beta: float, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` ranks in ``[0, n_nodes)`` with P(rank r) proportional to the integral of ``x ** -beta`` over
    ``[r + 1, r + 2)``: a closed-form inverse CDF, O(1) per sample (a binary search over a CDF of millions of
    nodes was 5x slower)."""
    u = torch.rand(count, dtype=torch.float64, generator=gen)
    top = float(n_nodes + 1)
    if abs(beta - 1.0) < 1e-12:
        x = torch.exp(u * math.log(top))
    else:
        e = 1.0 - beta
        x = (u * (top**e - 1.0) + 1.0).pow_(1.0 / e)
    return x.floor_().to(torch.int64).sub_(1).clamp_(0, n_nodes - 1)


def power_law_graph(
    n_nodes: int, avg_degree: float = 50, seed: int = 0, alpha: float = 2.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Chung-Lu random graph whose degrees follow a power law with exponent ``alpha``; returns (src, dst).

    The node of rank ``r`` has weight ~ ``(r + 1) ** (-1 / (alpha - 1))`` (exactly: that density integrated over
    ``[r + 1, r + 2)``, which has a closed-form inverse CDF); ``round(n_nodes * avg_degree / 2)`` undirected edges
    pick both ends independently by weight, self loops are dropped, and every edge is returned in both
    directions, so the mean degree is about ``avg_degree``. Multi-edges are kept (as in Chung-Lu; samplers
    handle them). Ranks map to node ids through a seeded random permutation, so hot nodes are spread over the id
    range instead of being the smallest ids. Vectorised and deterministic for a given ``seed``; memory is about
    40 bytes per directed edge.
    """
    n_nodes = _check_count(n_nodes, "n_nodes", 1)
    if not avg_degree > 0:
        raise FormatError(f"avg_degree must be > 0, got {avg_degree!r}")
    if not alpha > 1:
        raise FormatError(f"alpha (power-law exponent) must be > 1, got {alpha!r}")
    gen = _generator(seed)
    beta = 1.0 / (alpha - 1.0)
    n_pairs = round(n_nodes * avg_degree / 2)
    perm = torch.randperm(n_nodes, generator=gen)
    a = perm[_power_law_ranks(n_nodes, beta, n_pairs, gen)]
    b = perm[_power_law_ranks(n_nodes, beta, n_pairs, gen)]
    keep = a != b
    a, b = a[keep], b[keep]
    return torch.cat([a, b]), torch.cat([b, a])


def degree_proportional_ids(degrees: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` node ids drawn with replacement, P(id) proportional to ``degrees[id]``.

    This is how often neighbour sampling touches a node's features, so it is the access stream of a GNN
    feature cache. Nodes of degree 0 are never drawn.
    """
    if not isinstance(degrees, torch.Tensor) or degrees.ndim != 1 or degrees.numel() == 0:
        raise FormatError("degrees must be a non-empty 1-D torch.Tensor")
    if degrees.dtype == torch.bool or degrees.is_complex():
        raise FormatError(f"degrees must be integer or float, got {degrees.dtype}")
    weights = degrees.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise FormatError("degrees must be finite and non-negative")
    if not float(weights.sum()) > 0:
        raise FormatError("degrees must not all be zero")
    return _sample_weighted(weights, _check_count(n, "n", 0), _generator(seed))


def zipf_ids(n_rows: int, n: int, a: float = 1.05, seed: int = 0, hot_seed: "int | None" = None) -> torch.Tensor:
    """``n`` ids in ``[0, n_rows)`` from a bounded Zipf law: the row of rank ``k`` (1-based) has P ~ ``k ** -a``.

    Unlike ``numpy.random.zipf`` (needs ``a > 1``, unbounded support, rank == value), any ``a >= 0`` works
    (``a = 0`` is uniform), every id is in range, and ranks are mapped to ids through a seeded random
    permutation, so the hottest rows are not simply the smallest ids. Sampling is an exact inverse-CDF lookup
    (a float64 CDF of ``n_rows`` entries, 16 bytes per row of temporary memory).

    The permutation (which rows are hot) comes from ``seed`` unless ``hot_seed`` is given. Draws that must share
    one hot set (a cache's batches, a presampled hotness trace, several ranks) pass the same ``hot_seed`` and
    different ``seed``s: with only ``seed`` varying, each draw has its own hot rows and a cache sees a uniform trace.
    """
    n_rows = _check_count(n_rows, "n_rows", 1)
    n = _check_count(n, "n", 0)
    if not (isinstance(a, numbers.Real) and math.isfinite(a) and a >= 0):
        raise FormatError(f"Zipf exponent a must be a finite number >= 0, got {a!r}")
    gen = _generator(seed)
    perm = torch.randperm(n_rows, generator=gen if hot_seed is None else _generator(hot_seed))
    weights = torch.arange(1, n_rows + 1, dtype=torch.float64).pow_(-float(a))
    return perm[_sample_weighted(weights, n, gen)]


def hot_set_ids(n_rows: int, n: int, hot_rows: int, share: float = 0.9, seed: int = 0,
                hot_seed: "int | None" = None) -> torch.Tensor:
    """``n`` ids in ``[0, n_rows)``: each, with probability ``share``, uniform over a hot set of ``hot_rows`` rows,
    else uniform over all rows.

    A working-set trace: the accesses concentrate on a set of known size (the rows a training set's neighbourhoods
    or a day's popular items touch) instead of a Zipf law's long tail, so whether a cache holds the hot set is a
    question of capacity alone. It is the trace on which a node cache larger than one GPU's cache can turn misses
    into hits: under Zipf 1.05 a second GPU's worth of cache adds few hits. The hot rows are the first ``hot_rows``
    of a seeded permutation (``hot_seed``, else ``seed``), so draws sharing ``hot_seed`` share the hot set, as with
    :func:`zipf_ids`.
    """
    n_rows = _check_count(n_rows, "n_rows", 1)
    n = _check_count(n, "n", 0)
    hot_rows = _check_count(hot_rows, "hot_rows", 1)
    if hot_rows > n_rows:
        raise FormatError(f"hot_rows must be <= n_rows ({n_rows}), got {hot_rows}")
    if not (isinstance(share, numbers.Real) and 0.0 <= float(share) <= 1.0):
        raise FormatError(f"share must be a number in [0, 1], got {share!r}")
    gen = _generator(seed)
    hot = torch.randperm(n_rows, generator=gen if hot_seed is None else _generator(hot_seed))[:hot_rows]
    in_hot = torch.rand(n, dtype=torch.float64, generator=gen) < float(share)
    picks = hot[torch.randint(0, hot_rows, (n,), generator=gen)]
    anywhere = torch.randint(0, n_rows, (n,), generator=gen)
    return torch.where(in_hot, picks, anywhere)


# --------------------------------------------------------------------------------------------------------------
# Registry of real row matrices for benchmarks


def _cora_rows() -> torch.Tensor:
    return load_cora().features


def _kv_entries() -> dict[str, Callable[[], torch.Tensor]]:
    return {
        f"kv_{name}_{which}_{dtype}": functools.partial(load_kv, name, which, dtype)
        for name in _KV_FILES
        for which in ("k", "v")
        for dtype in _KV_DTYPES
    }


#: name -> loader returning that data set's real rows as a 2-D tensor (a fresh tensor on every call).
DATASETS: dict[str, Callable[[], torch.Tensor]] = {
    "cora": _cora_rows,
    "pubmed": load_pubmed_rows,
    "minilm": load_minilm,
    **_kv_entries(),
}


def load_rows(name: str) -> torch.Tensor:
    """Rows of the registered data set ``name`` (see :data:`DATASETS`)."""
    try:
        loader = DATASETS[name]
    except KeyError:
        raise FormatError(f"unknown data set {name!r}; known: {', '.join(sorted(DATASETS))}") from None
    return loader()
