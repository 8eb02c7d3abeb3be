"""Graph batches in the cached calls (persample.capture.lean, .compiled): torch_geometric's
``Batch`` (its rows by graph, its ``ptr`` shared by every sample; message passing by
index ops, by torch_geometric's ``GCNConv``, by ``torch.sparse.mm``), each call's wiring
decided again from that call's node and edge ids, every answer the loop's in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import persample
from cached_calls import B, D, check, kept
from persample.capture.compiled import Compiled
from persample.capture.lean import Program

N, EDGES = B, 2 * B  # nodes and edges per graph (the nodes as many as the graphs)


def graphs(seed: int, cross: bool = False):
    """A ``Batch`` of ``B`` graphs of ``N`` nodes and ``EDGES`` edges, wired at random by
    ``seed`` (the same shapes in every call); ``cross``: one edge of graph 0 then points
    into graph 1 (its samples mixed)."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.data import Batch, Data

    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(B):  # (no self loop: GCN's own then make as many edges every call)
        src = torch.randint(0, N, (EDGES,), generator=g)
        dst = (src + torch.randint(1, N, (EDGES,), generator=g)) % N
        data.append(Data(x=torch.randn(N, D, generator=g, dtype=torch.float64),
                         edge_index=torch.stack([src, dst])))
    batch = Batch.from_data_list(data)
    if cross:
        batch.edge_index[1, 0] = N  # (a node of graph 1)
    return batch


class HandGIN(nn.Module):
    """GIN (Xu et al. 2019) by hand: messages gathered by source ids, summed into their
    targets with ``index_add_``, pooled per graph by the batch vector."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        self.eps = nn.Parameter(torch.tensor(0.1))
        self.head = nn.Linear(D, 2)

    def forward(self, data):
        x, (src, dst) = data.x, data.edge_index
        summed = torch.zeros_like(x).index_add_(0, dst, x.index_select(0, src))
        h = self.mlp((1 + self.eps) * x + summed)
        return self.head(torch.zeros(data.num_graphs, D, dtype=h.dtype).index_add_(
            0, data.batch, h))


class GCN(nn.Module):
    """torch_geometric's ``GCNConv`` twice (self loops, symmetric degree normalisation),
    then ``global_mean_pool``."""

    def __init__(self):
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.conv1, self.conv2, self.head = GCNConv(D, D), GCNConv(D, D), nn.Linear(D, 2)

    def forward(self, data):
        from torch_geometric.nn import global_mean_pool

        h = self.conv1(data.x, data.edge_index).relu()
        h = self.conv2(h, data.edge_index).relu()
        return self.head(global_mean_pool(h, data.batch))


def _model(kind: str) -> nn.Module:
    pytest.importorskip("torch_geometric")
    from test_graph_families import SparseGCN

    torch.manual_seed(0)
    make = {"hand-gin": HandGIN, "pyg-gcn": GCN, "sparse": lambda: SparseGCN(width=D)}[kind]
    return make().double()


@pytest.mark.parametrize("kind", ["hand-gin", "pyg-gcn", "sparse"])
def test_graph_batches_wired_anew_each_call_take_the_cached_call(compiled, kind):
    model, y, loss = _model(kind), torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    for k in range(5):
        check(model, graphs(k), y, loss)
    assert any(isinstance(found, (Program, Compiled)) for found in kept(model)), kept(model)
    note = persample.verify(model, graphs(9), y, loss).plan
    compiles = compiled and kind != "sparse"  # (no sparse tensor in a TorchDynamo graph)
    assert note.startswith("cached: compiled" if compiles else "cached: each of"), note
    assert all(r.path == "rule" for r in persample.supported(model, graphs(9), y, loss))


@pytest.mark.parametrize("kind", ["hand-gin", "pyg-gcn", "sparse"])
def test_an_edge_between_graphs_in_a_later_call_is_caught(compiled, kind):
    model, y, loss = _model(kind), torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    for k in range(4):
        check(model, graphs(k), y, loss)
    for k in range(2):  # (the same shapes, ops and arguments: one edge joins two samples)
        with pytest.raises(persample.LossNotPerSampleError):
            persample.per_sample_grads(model, graphs(k, cross=True), y, loss, method="rules")
    for k in range(2):
        check(model, graphs(k), y, loss)
