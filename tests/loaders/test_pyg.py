"""PyG: IBPFeatureStore + TorchNeighborSampler give the same batches and the same training as PyG's in-memory Data."""

from __future__ import annotations

from typing import Any

import pytest
import torch

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


def _train(data: Any, source: Any, seed: int = 0, epochs: int = 2) -> tuple[list[float], list[torch.Tensor]]:
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
        for batch in _loader(data, source, seed + epoch):
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
    finally:
        seg.unlink()
        seg.close()
    assert losses == ref_losses  # bit-identical features -> identical arithmetic -> identical losses
    assert all(torch.equal(a, b) for a, b in zip(ref_feats, feats))
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
    with pytest.raises(ValueError, match="whole attributes"):
        store.put_tensor(cora.features, attr_name="z", index=torch.tensor([1]))
    with pytest.raises(TypeError, match="put_tensor"):
        IBPFeatureStore().put_tensor([1, 2], attr_name="z", index=None)
    with pytest.raises(ValueError, match="outside"):
        TorchNeighborSampler(torch.tensor([[0], [5]]), 3, [2])


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
