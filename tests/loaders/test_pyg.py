"""PyG: IBPFeatureStore + TorchNeighborSampler give the same batches and the same training as PyG's in-memory Data."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpcache.errors import InvalidArgumentError, InvalidIdsError, InvalidTypeError, UnsupportedError

pytest.importorskip("torch_geometric")


def _data(cora: Any) -> Any:
    from torch_geometric.data import Data

    return Data(x=cora.features, y=cora.labels, edge_index=torch.stack([cora.src, cora.dst]),
                num_nodes=cora.num_nodes)


def _loader(data: Any, source: Any, seed: int) -> Any:
    from torch_geometric.loader import NodeLoader

    from ibpcache.loaders.pyg import TorchNeighborSampler

    sampler = TorchNeighborSampler(data.edge_index, data.num_nodes, [10, 5], seed=seed)
    train = torch.nonzero(data.y >= 0).reshape(-1)[:1024]
    torch.manual_seed(seed)  # the loader's shuffle
    return NodeLoader(source, sampler, input_nodes=train, batch_size=128, shuffle=True)


def _train(data: Any, source: Any, seed: int = 0, epochs: int = 2, pipelined: bool = False
           ) -> tuple[list[float], list[torch.Tensor]]:
    from torch_geometric.nn import SAGEConv

    class Sage(torch.nn.Module):
        def __init__(self, d_in: int, n_cls: int) -> None:
            super().__init__()
            self.c1, self.c2 = SAGEConv(d_in, 32), SAGEConv(32, n_cls)

        def forward(self, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
            return self.c2(self.c1(x, ei).relu(), ei)

    torch.manual_seed(seed)
    model = Sage(data.num_features, int(data.y.max()) + 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses, feats = [], []
    for epoch in range(epochs):
        loader = _loader(data, source, seed + epoch)
        if pipelined:
            from ibpcache.loaders.pyg import pipelined as pipe

            loader = pipe(loader)
        for batch in loader:
            opt.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = torch.nn.functional.cross_entropy(out, batch.y[: batch.batch_size])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            feats.append(batch.x)
    return losses, feats


def _store(cora: Any, rows: Any) -> Any:
    from ibpcache.loaders.pyg import IBPFeatureStore

    store = IBPFeatureStore(device="cpu", budget_bytes=0.05)
    store.put_tensor(rows, attr_name="x", index=None)
    store.put_tensor(cora.labels, attr_name="y", index=None, compress=False)
    return store


def test_batches_match_pyg_in_memory(cora: Any) -> None:
    data = _data(cora)
    store = _store(cora, cora.features)
    ref, ours = list(_loader(data, data, 3)), list(_loader(data, (store, data), 3))
    assert len(ref) == len(ours) > 1
    for a, b in zip(ref, ours):
        assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)
        assert torch.equal(a.x.view(torch.uint8), b.x.view(torch.uint8)) and torch.equal(a.y, b.y)
        assert a.batch_size == b.batch_size
    assert store.stats()["x"]["hits"] + store.stats()["x"]["misses"] > 0


def test_graphsage_training_identical_with_shared_store(cora: Any) -> None:
    import os
    import secrets

    from ibpcache import Codec, CompressedRows

    data = _data(cora)
    name = f"test-pyg-{os.getpid()}-{secrets.token_hex(3)}"
    seg = Codec.fit(cora.features).compress(cora.features, layout="packed", pin=False).share(name)
    try:
        store = _store(cora, CompressedRows.attach(name))
        ref_losses, ref_feats = _train(data, data)
        losses, feats = _train(data, (store, data))
        piped_losses, piped_feats = _train(data, (store, data), pipelined=True)  # fetched in the pipeline's thread
    finally:
        seg.unlink()
        seg.close()
    assert losses == ref_losses == piped_losses  # bit-identical features -> identical arithmetic -> same losses
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(ref_feats, feats, piped_feats))
    assert ref_losses[-1] < ref_losses[0]  # it does learn


def test_feature_store_api(cora: Any) -> None:
    from ibpcache.loaders.pyg import IBPFeatureStore, TorchNeighborSampler

    store = _store(cora, cora.features)
    idx = torch.tensor([4, 0, 2707, 4])
    assert torch.equal(store.get_tensor(group_name=None, attr_name="x", index=idx), cora.features[idx])
    assert torch.equal(store.get_tensor(group_name=None, attr_name="x", index=None), cora.features)
    assert store.get_tensor_size(group_name=None, attr_name="x", index=None) == tuple(cora.features.shape)
    assert {a.attr_name for a in store.get_all_tensor_attrs()} == {"x", "y"}
    assert store.remove_tensor(group_name=None, attr_name="y", index=None)
    with pytest.raises(InvalidArgumentError, match="whole attributes"):
        store.put_tensor(cora.features, attr_name="z", index=torch.tensor([1]))
    with pytest.raises(InvalidTypeError, match="IBPFeatureStore.put_tensor"):
        IBPFeatureStore().put_tensor([1, 2], attr_name="z", index=None)
    with pytest.raises(InvalidIdsError, match="outside"):
        TorchNeighborSampler(torch.tensor([[0], [5]]), 3, [2])
    with pytest.raises(InvalidIdsError, match="float32"):  # float node ids were truncated to ints
        TorchNeighborSampler(torch.tensor([[0.0], [1.5]]), 3, [2])
    with pytest.raises(InvalidArgumentError, match="num_neighbors"):
        TorchNeighborSampler(torch.tensor([[0], [1]]), 3, [2.5])
    with pytest.raises(UnsupportedError, match="nodes only"):
        TorchNeighborSampler(torch.tensor([[0], [1]]), 3, [2]).sample_from_edges(None)


# ------------------------------------------------------------------------------------------------------------
# get_tensor's index reads as torch indexing (and PyG's in-memory Data) does, or is refused; never misread


@pytest.fixture(scope="module")
def stores(cora: Any) -> tuple[Any, Any]:
    """(ours, PyG's in-memory Data) over Cora's features, both as FeatureStores."""
    from torch_geometric.data import Data

    from ibpcache.loaders.pyg import IBPFeatureStore

    ours = IBPFeatureStore(device="cpu", budget_bytes=0.05)
    ours.put_tensor(cora.features, attr_name="x", index=None)
    return ours, Data(x=cora.features, num_nodes=cora.num_nodes)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _indices(cora: Any) -> list[Any]:
    n = cora.num_nodes
    return [
        cora.train_mask,  # 140 rows: read as x[mask.long()] (2708 copies of rows 0/1) before
        cora.test_mask, torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool),
        cora.train_mask.tolist(),  # a list of bools is a mask in torch too
        torch.tensor([4, 0, 2707, 4]), torch.tensor([4, 0, 2707, 4], dtype=torch.int32),
        torch.tensor([-1, -2708, 5, -1]), torch.tensor([[1, 2], [3, -4]]), torch.tensor(7), torch.tensor(-3),
        torch.empty(0, dtype=torch.int64), [3, 1, 3], [], range(5, 40, 7), range(-3, 2), slice(10, 30, 4),
        slice(-5, None), slice(None), None, 0, 2707, -1,
    ]


def test_index_reads_as_torch_and_pyg_in_memory_do(cora: Any, stores: tuple[Any, Any]) -> None:
    ours, data = stores
    x = cora.features
    for index in _indices(cora):
        got = ours.get_tensor(attr_name="x", index=index)
        assert _same(got, data.get_tensor(attr_name="x", index=index)), index
        assert _same(got, x if index is None else x[index]), index
    assert ours.get_tensor(attr_name="x", index=cora.train_mask).shape == (140, 1433)
    assert _same(ours.get_tensor(attr_name="x"), x)  # index left out: all rows, as Data does


def test_integer_dtypes_widen_exactly_and_numpy_indices_work(cora: Any, stores: tuple[Any, Any]) -> None:
    """torch indexes with int64/int32 only; the narrower ints and uint16/32 hold the same ids, read the same."""
    import numpy as np

    ours, _ = stores
    x = cora.features
    ids = torch.tensor([5, 0, 2707, 100, 5])
    for dtype in (torch.int8, torch.int16, torch.int32, torch.uint16, torch.uint32):
        small = ids.clamp(max=torch.iinfo(dtype).max).to(dtype)
        assert _same(ours.get_tensor(attr_name="x", index=small), x[small.to(torch.int64)]), dtype
    arr = np.array([[3, -1], [0, 2]])
    assert _same(ours.get_tensor(attr_name="x", index=arr), x[torch.from_numpy(arr)])
    back = ours.get_tensor(attr_name="x", index=arr, convert_type=True)  # PyG: numpy index -> numpy rows
    assert isinstance(back, np.ndarray) and np.array_equal(back, x[torch.from_numpy(arr)].numpy())


@pytest.mark.parametrize("index, match", [
    (torch.tensor([1.0, 2.0]), "dtype torch.float32"),
    (torch.tensor([1.9]), "dtype torch.float32"),  # truncated to row 1 before
    (torch.tensor([1.0], dtype=torch.float64), "dtype torch.float64"),
    (torch.tensor([1, 2], dtype=torch.uint8), "uint8 indices as a deprecated bool mask"),
    (torch.tensor([1], dtype=torch.uint64), "uint64"),
    (torch.ones(10, dtype=torch.bool), r"must have shape \[2708\].*got shape \(10,\)"),
    (torch.ones(2708, 2, dtype=torch.bool), r"must have shape \[2708\]"),
    (torch.tensor(True), r"must have shape \[2708\]"),
    (True, "a bool"),
    ((1, 2), "tuple"),
    (1.0, "got float"),
    ([1.0, 2.0], "dtype torch.float32"),
    ([[1, 2], [3]], "cannot read list"),
    (torch.tensor([2708]), "id 2708 is out of range for 2708 rows"),
    (torch.tensor([0, -2709]), "id -2709 is out of range"),
    (2708, "id 2708 is out of range"),
    (-2709, "id -2709 is out of range"),
    (slice(None, None, -1), "slice step must be a positive int"),
])
def test_indices_torch_would_read_otherwise_are_refused(stores: tuple[Any, Any], index: Any, match: str) -> None:
    ours, _ = stores
    with pytest.raises(InvalidIdsError, match=match) as info:
        ours.get_tensor(attr_name="x", index=index)
    assert isinstance(info.value, IndexError)  # what torch (and PyG's Data) raise for bad indices


@settings(max_examples=60)
@given(st.lists(st.integers(min_value=-2708, max_value=2707), max_size=300),
       st.sampled_from([torch.int64, torch.int32, torch.int16]))
def test_any_int_index_equals_torch_indexing(stores: tuple[Any, Any], ids: list[int], dtype: torch.dtype) -> None:
    ours, data = stores
    index = torch.tensor(ids, dtype=dtype) if ids else torch.empty(0, dtype=dtype)
    x = data.x
    assert _same(ours.get_tensor(attr_name="x", index=index), x[index.to(torch.int64)])


def test_group_name_may_be_left_out_when_unambiguous(cora: Any, stores: tuple[Any, Any]) -> None:
    from ibpcache.loaders.pyg import IBPFeatureStore

    ours, data = stores
    assert ours.get_tensor_size(attr_name="x") == data.get_tensor_size(attr_name="x") == (2708, 1433)
    assert ours.get_tensor_size(attr_name="nope") is None
    hetero = IBPFeatureStore(device="cpu")
    hetero.put_tensor(cora.features[:100], group_name="paper", attr_name="x", index=None, compress=False)
    hetero.put_tensor(cora.features[100:130], group_name="author", attr_name="x", index=None, compress=False)
    hetero.put_tensor(cora.labels[:100], group_name="paper", attr_name="y", index=None, compress=False)
    assert hetero.get_tensor_size(attr_name="y") == (100,)
    assert _same(hetero.get_tensor(attr_name="y", index=[0, -1]), cora.labels[[0, 99]])
    assert hetero.get_tensor_size(group_name="author", attr_name="x") == (30, 1433)
    with pytest.raises(InvalidArgumentError, match=r"'x' is held by groups \['paper', 'author'\]; pass group_name"):
        hetero.get_tensor_size(attr_name="x")
    with pytest.raises(InvalidArgumentError, match="pass group_name"):
        hetero.get_tensor(attr_name="x", index=None)


def test_repr_and_errors_name_the_public_class(stores: tuple[Any, Any]) -> None:
    ours, _ = stores
    assert repr(ours) == "IBPFeatureStore(device=cpu, attrs=['x'])"
    assert type(ours).__name__ == "IBPFeatureStore"
    with pytest.raises(InvalidTypeError) as info:
        ours.put_tensor("rows", attr_name="z", index=None)
    assert "IBPFeatureStore" in str(info.value) and "_Store" not in str(info.value)


def test_sampler_takes_at_most_k_distinct_in_neighbours(cora: Any) -> None:
    from torch_geometric.sampler import NodeSamplerInput

    from ibpcache.loaders.pyg import TorchNeighborSampler

    ei = torch.stack([cora.src, cora.dst])
    s = TorchNeighborSampler(ei, cora.num_nodes, [3], seed=1)
    seeds = torch.arange(0, 200)
    out = s.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds))
    assert torch.equal(out.node[:200], seeds)
    src, dst = out.node[out.row], out.node[out.col]
    edges = set(zip(cora.src.tolist(), cora.dst.tolist()))
    assert all((a, b) in edges for a, b in zip(src.tolist(), dst.tolist()))  # real edges, neighbour -> seed
    indeg = torch.bincount(cora.dst, minlength=cora.num_nodes)[seeds]
    per_seed = torch.bincount(out.col, minlength=200)
    assert torch.equal(per_seed, indeg.clamp(max=3))  # min(k, degree) each, no repeats
    assert len(set(zip(src.tolist(), dst.tolist()))) == out.row.numel()


# ------------------------------------------------------------------------------------------------------------
# Pipelined loading and the sampler's keys


def test_pipelined_loader_same_batches_and_training(cora: Any) -> None:
    from ibpcache.loaders.pyg import pipelined

    data = _data(cora)
    store = _store(cora, cora.features)
    plain, piped = list(_loader(data, (store, data), 5)), list(pipelined(_loader(data, (store, data), 5)))
    assert len(plain) == len(piped) == 8
    for a, b in zip(plain, piped):
        assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)
        assert torch.equal(a.x.view(torch.uint8), b.x.view(torch.uint8)) and torch.equal(a.y, b.y)
        assert torch.equal(b.x, cora.features[b.n_id]) and a.batch_size == b.batch_size
    ref_losses, ref_feats = _train(data, (store, data))
    losses, feats = _train(data, (store, data), pipelined=True)
    assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(ref_feats, feats))
    in_memory = list(pipelined(_loader(data, data, 5)))  # PyG's own Data as the source works the same
    assert all(torch.equal(a.x, b.x) and torch.equal(a.edge_index, b.edge_index) for a, b in zip(plain, in_memory))


def test_a_batch_sample_depends_on_its_seeds_not_on_the_batches_before(cora: Any) -> None:
    from torch_geometric.sampler import NodeSamplerInput

    from ibpcache.loaders.pyg import TorchNeighborSampler

    ei = torch.stack([cora.src, cora.dst])
    a, b = torch.arange(0, 100), torch.arange(500, 700)
    s1, s2 = TorchNeighborSampler(ei, cora.num_nodes, [5, 3], seed=4), TorchNeighborSampler(ei, cora.num_nodes,
                                                                                                [5, 3], seed=4)
    first = [s1.sample_from_nodes(NodeSamplerInput(input_id=None, node=x)) for x in (a, b)]
    second = [s2.sample_from_nodes(NodeSamplerInput(input_id=None, node=x)) for x in (b, a)][::-1]
    for x, y in zip(first, second):
        assert torch.equal(x.node, y.node) and torch.equal(x.row, y.row) and torch.equal(x.col, y.col)
        assert torch.equal(x.edge, y.edge) and x.num_sampled_nodes == y.num_sampled_nodes
    s2.set_epoch(1)
    other = s2.sample_from_nodes(NodeSamplerInput(input_id=None, node=a))
    assert not torch.equal(other.node, first[0].node)  # the epoch is part of the key
    with pytest.raises(InvalidArgumentError, match="distinct"):
        s1.sample_from_nodes(NodeSamplerInput(input_id=None, node=torch.tensor([3, 3])))


@pytest.mark.gpu
def test_gpu_sampler_and_pipelined_store(cora: Any) -> None:
    from torch_geometric.loader import NodeLoader
    from torch_geometric.sampler import NodeSamplerInput

    from ibpcache.loaders.pyg import IBPFeatureStore, TorchNeighborSampler, pipelined

    ei = torch.stack([cora.src, cora.dst])
    cpu = TorchNeighborSampler(ei, cora.num_nodes, [10, 5], seed=2)
    gpu = TorchNeighborSampler(ei, cora.num_nodes, [10, 5], seed=2, device="cuda")
    seeds = torch.randperm(cora.num_nodes, generator=torch.Generator().manual_seed(0))[:512]
    x = cpu.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds))
    y = gpu.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds.cuda()))
    assert y.node.is_cuda
    for a, b in ((x.node, y.node), (x.row, y.row), (x.col, y.col), (x.edge, y.edge)):
        assert torch.equal(a, b.cpu())
    data = _data(cora)
    store = IBPFeatureStore(device="cuda", budget_bytes=0.05)
    store.put_tensor(cora.features, attr_name="x", index=None)
    store.put_tensor(cora.labels, attr_name="y", index=None, compress=False)
    loader = NodeLoader((store, data), gpu, input_nodes=torch.arange(2048), batch_size=256, shuffle=False)
    batches = list(pipelined(loader))
    assert len(batches) == 8
    for batch in batches:
        assert batch.x.is_cuda and torch.equal(batch.x.cpu(), cora.features[batch.n_id.cpu()])
        assert torch.equal(batch.y.cpu(), cora.labels[batch.n_id.cpu()])
