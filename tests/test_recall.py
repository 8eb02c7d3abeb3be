"""Decisions recalled within one cached call (persample.capture.recall): an op deciding
its data flow again on the values, layouts and aliasing of an earlier op of the same
call takes that decision; any difference (other values, another layout, a tensor written
since, two tensors where one was read twice, a random op) decides anew. Every answer is
the loop's in float64, with sizes that coincide (B graphs of B nodes)."""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from torch import nn

import persample
from cached_calls import B, D, check
from persample.batch import SHARED, Batched, Flow
from persample.batch.ops_indexing import Partly
from persample.capture import compiled as compiled_module
from persample.capture import lean
from persample.capture.recall import Recall, recall_key
from test_cached_graphs import GCN, graphs

EDGES = 2 * B


def _key(func=torch.Tensor.index_select, *args):
    return recall_key(func, args or (None, 0, None), {})


class _At:
    """A program's entry, as far as a recall reads one: the key it keeps decisions by."""

    def __init__(self, key):
        self.recall = key


def test_a_decision_on_the_same_values_and_layouts_is_recalled_with_its_own_output():
    recall, idx = Recall(), torch.tensor([0, 1, 1, 2])
    x, out = torch.zeros(4), torch.ones(4)
    lay = Partly("why", 0, torch.tensor([0, -1, 1, 1]), weakref.ref(out))
    flow = Flow(lay)
    recall.keep(_At(_key()), [x, idx], (SHARED, Batched(0)), [out], flow)
    again = out.clone()
    got = recall.flow(_At(_key()), [x.clone(), idx.clone()], (SHARED, Batched(0)), [again])
    assert got is not None and got.outputs.ref() is again  # (its own output's layout)
    assert torch.equal(got.outputs.rows, lay.rows) and lay.ref() is out


@pytest.mark.parametrize("change", ["values", "layout", "written", "aliasing", "arguments"])
def test_any_difference_decides_anew(change):
    recall, idx, x, out = Recall(), torch.tensor([0, 1, 1, 2]), torch.zeros(4), torch.ones(4)
    recall.keep(_At(_key()), [x, idx, idx], (SHARED, Batched(0), Batched(0)), [out], Flow(SHARED))
    same = idx.clone()
    leaves, lays, key = [x, same, same], (SHARED, Batched(0), Batched(0)), _key()
    assert recall.flow(_At(key), leaves, lays, [out.clone()]) is not None  # (as it is)
    if change == "values":  # (equal shapes, one entry other)
        leaves[1][0] = 3
    elif change == "layout":
        lays = (SHARED, Batched(0, index=torch.tensor([0, 0, 1, 1])), Batched(0))
    elif change == "written":  # (the earlier decision's index written since: it read
        idx.add_(0)  # other values, whatever the entries are now)
    elif change == "aliasing":  # (read twice before, two equal tensors now)
        leaves = [x, same, same.clone()]
    else:
        key = _key(torch.Tensor.index_select, None, 1, None)
    assert recall.flow(_At(key), leaves, lays, [out.clone()]) is None


@pytest.mark.parametrize("func, recalled", [
    (torch.Tensor.index_select, True),  # (reads its index's values, never its data's)
    (torch.Tensor.index_add_, True),
    (torch.Tensor.mul, True),  # (elementwise: layouts alone)
    (torch.nonzero, False),  # (its positions are those of its data's nonzero values)
    (torch.sort, False),
])
def test_floating_point_data_is_compared_by_form_alone_where_no_decision_reads_it(
        func, recalled):
    recall, idx, x = Recall(), torch.tensor([0, 1, 1, 2]), torch.randn(4, 3)
    out = torch.randn(4, 3)
    key = recall_key(func, (None, 0, None), {})
    recall.keep(_At(key), [x, idx], (SHARED, Batched(0)), [out], Flow(SHARED))
    x.mul_(2)  # (written since, and other values: no decision of these reads them)
    other = [torch.randn(4, 3), idx.clone()]
    got = recall.flow(_At(key), other, (SHARED, Batched(0)), [torch.randn(4, 3)])
    assert (got is not None) == recalled
    wider = [torch.randn(4, 5), idx.clone()]  # (the form still counts)
    assert recall.flow(_At(key), wider, (SHARED, Batched(0)), [torch.randn(4, 5)]) is None


def test_sparse_and_nested_tensors_are_never_taken_for_equal():
    recall, out = Recall(), torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nested tensors: a prototype, torch warns)
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    sparse = torch.eye(2).to_sparse()
    for t in (nested, sparse):
        recall.keep(_At(_key()), [t], (SHARED,), [out], Flow(SHARED))
        assert recall.flow(_At(_key()), [t.clone()], (SHARED,), [out.clone()]) is None
        recall = Recall()


def test_random_ops_and_opaque_arguments_are_never_recalled():
    assert recall_key(torch.bernoulli, (torch.ones(2),), {}) is None
    assert recall_key(torch.Tensor.index_select, (torch.ones(2), object()), {}) is None
    assert recall_key(torch.Tensor.index_select, (torch.ones(2), 0, torch.ones(2)), {})


class TwoPasses(nn.Module):
    """Two message passings of the same shapes, the second's targets shifted by a
    per-edge offset the batch carries (zero: the same edges, so that the second pass's
    decisions are the first's; one offset into the next graph: samples joined)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, data):
        x, (src, dst) = data.x, data.edge_index
        for lin, into in ((self.a, dst), (self.b, dst + data.hop)):
            x = torch.zeros_like(x).index_add_(0, into, lin(x).index_select(0, src)).tanh()
        return self.head(torch.zeros(data.num_graphs, D, dtype=x.dtype).index_add_(
            0, data.batch, x))


def _two_passes(seed: int, cross: bool = False, uneven: bool = False):
    """``B`` graphs of ``B`` nodes (``uneven``: every other one of ``B + 1``), ``EDGES``
    edges and a self loop per node (the same shapes in every call), offsets zero;
    ``cross``: the first edge's offset points into the next graph."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.data import Batch, Data

    g = torch.Generator().manual_seed(seed)
    sizes = [B + (i % 2 if uneven else 0) for i in range(B)]
    data = [Data(x=torch.randn(m, D, generator=g, dtype=torch.float64),
                 edge_index=torch.cat([torch.randint(0, m, (2, EDGES), generator=g),
                                       torch.arange(m).expand(2, m)], 1),  # (self loops:
                 hop=torch.zeros(EDGES + m, dtype=torch.long)) for m in sizes]  # every
    # node gets a message)
    batch = Batch.from_data_list(data)
    if cross:
        batch.hop[0] = B  # (a node of the next graph)
    return batch


def test_a_second_pass_that_joins_graphs_is_caught_after_a_first_that_does_not(compiled):
    torch.manual_seed(0)
    model, y, loss = TwoPasses().double(), torch.randn(B, 2, dtype=torch.float64), (
        nn.MSELoss())
    for k in range(4):
        check(model, _two_passes(k), y, loss)
    for k in range(2):
        with pytest.raises(persample.LossNotPerSampleError):
            persample.per_sample_grads(model, _two_passes(k, cross=True), y, loss,
                                       method="rules")
    check(model, _two_passes(7), y, loss)


def test_a_second_pass_on_other_features_recalls_the_first_passs_gather_and_scatter(
        compiled, monkeypatch):
    torch.manual_seed(0)
    model, y, loss = TwoPasses().double(), torch.randn(B, 2, dtype=torch.float64), (
        nn.MSELoss())
    for k in range(4):
        check(model, _two_passes(k, uneven=True), y, loss)
    made = []
    for module in (lean, compiled_module):
        real = module.decided
        monkeypatch.setattr(module, "decided", lambda *a, real=real: made.append(a[1]) or (
            real(*a)))
    check(model, _two_passes(5, uneven=True), y, loss)
    names = [getattr(f, "__name__", "") for f in made]
    assert names.count("index_select") == 1 and names.count("index_add_") == 2, names
    # (the second pass's gather and scatter recalled; the readout's scatter decided. Graphs
    # of one size have their nodes' samples in a regular layout after the first scatter,
    # and as indices before it: the forms differ, and the second pass decides anew)


def test_gcn_layers_recall_the_normalisation_the_first_layer_decided(compiled, monkeypatch):
    pytest.importorskip("torch_geometric")
    torch.manual_seed(0)
    model, y, loss = GCN().double(), torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    for k in range(4):
        check(model, graphs(k), y, loss)
    made = []
    for module in (lean, compiled_module):
        real = module.decided
        monkeypatch.setattr(module, "decided", lambda *a, real=real: made.append(a[1]) or (
            real(*a)))
    recalled = []
    real_flow = Recall.flow
    monkeypatch.setattr(Recall, "flow", lambda self, key, *a: (
        lambda got: recalled.append(got is not None) or got)(real_flow(self, key, *a)))
    check(model, graphs(8), y, loss)
    assert made and sum(recalled) >= len(made) // 3, (len(made), sum(recalled))
