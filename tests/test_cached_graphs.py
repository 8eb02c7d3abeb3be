"""Graph batches in the cached calls (persample.capture.lean, .compiled): torch_geometric's
``Batch`` (its rows by graph, its ``ptr`` shared by every sample; message passing by
index ops, by torch_geometric's ``GCNConv``, by ``torch.sparse.mm``), each call's wiring
decided again from that call's node and edge ids, every answer the loop's in float64."""

from __future__ import annotations

import copy

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


def ragged(seed: int, cross: bool = False):
    """A ``Batch`` of ``B`` graphs of 2 to ``2 N`` nodes each (graph 0 ``2 + seed``) and
    twice as many edges, wired by ``seed``: each seed's node and edge counts are its own,
    as in an epoch of graph batches; ``cross``: one edge of graph 0 then points into
    graph 1."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.data import Batch, Data

    g, counts = torch.Generator().manual_seed(100 + seed), torch.Generator().manual_seed(0)
    data = []
    for i in range(B):
        nodes = 2 + seed if i == 0 else int(torch.randint(2, 2 * N + 1, (), generator=counts))
        src = torch.randint(0, nodes, (2 * nodes,), generator=g)
        dst = (src + torch.randint(1, nodes, (2 * nodes,), generator=g)) % nodes
        data.append(Data(x=torch.randn(nodes, D, generator=g, dtype=torch.float64),
                         edge_index=torch.stack([src, dst])))
    batch = Batch.from_data_list(data)
    if cross:
        batch.edge_index[1, 0] = int(batch.ptr[1])  # (the first node of graph 1)
    return batch


@pytest.mark.parametrize("kind", ["hand-gin", "pyg-gcn"])
def test_graph_batches_of_new_sizes_at_each_call_take_the_compiled_call(compiled, kind):
    """Every call a batch of node and edge counts no call before it had: after the first
    calls (the program traced, the forward compiled, then compiled again with its sizes
    symbolic), each call runs the compiled graph with that call's wiring decided again,
    and every answer is the loop's."""
    model, y, loss = _model(kind), torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    sizes = set()
    for k in range(8):
        batch = ragged(k)
        sizes.add((batch.num_nodes, batch.num_edges))
        check(model, batch, y, loss)
    assert len(sizes) == 8, sizes
    later = ragged(20)
    assert (later.num_nodes, later.num_edges) not in sizes
    note = persample.verify(model, later, y, loss).plan
    assert note.startswith("cached: compiled") == compiled, note
    check(model, ragged(21), y, loss)


@pytest.mark.parametrize("kind", ["hand-gin", "pyg-gcn"])
def test_an_edge_between_graphs_of_a_batch_of_new_sizes_is_caught(compiled, kind):
    model, y, loss = _model(kind), torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    for k in range(6):
        check(model, ragged(k), y, loss)
    for k in range(2):
        with pytest.raises(persample.LossNotPerSampleError):
            persample.per_sample_grads(model, ragged(10 + k, cross=True), y, loss,
                                       method="rules")
    check(model, ragged(12), y, loss)


def equal(seed: int):
    """A ``Batch`` of ``B`` graphs of ``2 + seed`` nodes each (graphs of equal sizes: a
    position layout of ``2 + seed`` nodes per sample where the data flow finds one),
    ``2 (2 + seed)`` edges each, wired by ``seed``."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.data import Batch, Data

    g, nodes = torch.Generator().manual_seed(200 + seed), 2 + seed
    data = []
    for _ in range(B):
        src = torch.randint(0, nodes, (2 * nodes,), generator=g)
        dst = (src + torch.randint(1, nodes, (2 * nodes,), generator=g)) % nodes
        data.append(Data(x=torch.randn(nodes, D, generator=g, dtype=torch.float64),
                         edge_index=torch.stack([src, dst])))
    return Batch.from_data_list(data)


@pytest.mark.parametrize("kind", ["hand-gin", "pyg-gcn"])
def test_graphs_of_equal_sizes_that_change_at_each_call_stay_exact(compiled, kind):
    """Graphs of equal sizes, whose data flow may find a layout by position (so many
    nodes per sample, a count that each call changes): every answer is the loop's."""
    model, y, loss = _model(kind), torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    for k in range(8):
        check(model, equal(k), y, loss)
        check(model, ragged(k), y, loss)


class SizedAlpha(nn.Module):
    """``addmm`` with an ``alpha`` made of the batch's node count: an op reading
    parameters that takes a size of the batch (a plan of any sizes would hold the size
    of the call that made it). The node count is every graph's together, so the loop,
    each graph alone, computes another function: the cached calls are checked against
    the full capture's answer instead."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(D, dtype=torch.float64))
        self.head = nn.Linear(D, 2, dtype=torch.float64)

    def forward(self, data):
        x = torch.addmm(self.b, data.x, self.w, alpha=10.0 / data.x.shape[0])
        return self.head(torch.zeros(data.num_graphs, D, dtype=x.dtype).index_add_(
            0, data.batch, x))


def test_an_op_reading_parameters_with_a_size_of_the_batch_takes_no_plan_of_any_size(compiled):
    """Where an op reading parameters takes a size of the batch, the graph of symbolic
    sizes takes no plan: every call answers what the full capture answers."""
    torch.manual_seed(0)
    model, y, loss = SizedAlpha(), torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    for k in range(8):
        got = persample.per_sample_grads(model, ragged(k), y, loss, method="rules")
        fresh = copy.deepcopy(model)  # (its first call: the full capture)
        want = persample.per_sample_grads(fresh, ragged(k), y, loss, method="rules")
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


def test_a_graph_batchs_calls_of_any_sizes_share_one_key():
    """The key of what is kept for later calls leaves out the sizes of the dims that hold
    samples by index (a graph batch's nodes and edges), and only those: the calls of a
    plain batch keep one key per shape."""
    from persample.batch import located
    from persample.engine import tapes
    from persample.inputs import as_batch

    keys = {tapes.key_of(B, 1, located(as_batch(ragged(k)))) for k in range(3)}
    assert len(keys) == 1 and tapes.sized(keys.pop())
    plain = [tapes.key_of(B, 1, located(as_batch(torch.zeros(B, t)))) for t in (3, 4)]
    assert plain[0] != plain[1] and not any(map(tapes.sized, plain))
