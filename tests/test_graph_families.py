"""torch_geometric's message-passing layers on a ``Batch`` (each graph a sample), in
float64: attention (GAT, GATv2, TransformerConv with a Set2Set readout), max and mean
aggregation (EdgeConv, GraphConv, SAGE), sums (GIN), an adjacency built in the forward
and multiplied by ``torch.sparse.mm``. Node 0 of every graph receives no
message, so its aggregate holds no sample's data until the layer adds the node's own
features. Every answer equals the loop's; the parameters take the rules, or a fallback
local to one module or op (never the whole model). A linear layer on such an aggregate
(``SAGEConv``, ``GraphConv``) takes its rule: the one op reading its output adds the
node's own features, which gives each row of no message its node's sample; where a
second op reads that output, the layer keeps its fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import persample
from zoo import require

B = N = D = 4  # graphs, nodes per graph and features coincide: nothing inferred from sizes
EDGES = 3 * N


def graphs():
    """``B`` graphs of ``N`` nodes, ``EDGES`` random edges each, none into node 0."""
    require("torch_geometric")
    from torch_geometric.data import Batch, Data

    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(B):
        dst = torch.randint(1, N, (EDGES,), generator=g)
        src = (dst + torch.randint(1, N, (EDGES,), generator=g)) % N  # (no self loop)
        data.append(Data(x=torch.randn(N, D, generator=g, dtype=torch.float64),
                         edge_index=torch.stack([src, dst])))
    features = torch.Generator().manual_seed(2)  # (edge features, for the layers that take
    for d in data:  # them: node 0's self loop gets the mean of none)
        d.edge_attr = torch.randn(EDGES, 3, generator=features, dtype=torch.float64)
    return Batch.from_data_list(data)


class SparseGCN(nn.Module):
    """A graph convolution by ``torch.sparse.mm`` with the adjacency built in the forward
    from the batch's edges (their weights ones, or, where ``weighted``, from the features
    of the nodes they join: per-sample values)."""

    def __init__(self, weighted: bool = False, width: int = D):
        super().__init__()
        self.weighted, self.width = weighted, width
        self.lin, self.head = nn.Linear(width, width), nn.Linear(width, 2)

    def forward(self, data):
        x, (src, dst), n = data.x, data.edge_index, data.x.shape[0]
        values = (x[src] * x[dst]).sum(-1).sigmoid() if self.weighted else torch.ones(
            src.shape[0], dtype=x.dtype)
        adj = torch.sparse_coo_tensor(torch.stack([dst, src]), values, (n, n),
                                      check_invariants=True)
        h = self.lin(torch.sparse.mm(adj, x) + x).relu()
        return self.head(torch.zeros(data.num_graphs, self.width, dtype=h.dtype).index_add_(
            0, data.batch, h))


class Net(nn.Module):
    """One layer of the family, a ReLU, a readout per graph (mean, or Set2Set), a head."""

    def __init__(self, kind: str):
        super().__init__()
        from torch_geometric import nn as gnn

        mlp = nn.Sequential(nn.Linear(2 * D if kind == "edge" else D, D), nn.ReLU(),
                            nn.Linear(D, D))
        self.conv = {
            "gat": lambda: gnn.GATConv(D, D, heads=2, concat=False),
            "gatv2": lambda: gnn.GATv2Conv(D, D, heads=2, concat=False),
            "gat-edges": lambda: gnn.GATConv(D, D, heads=2, concat=False, edge_dim=3),
            "gatv2-edges": lambda: gnn.GATv2Conv(D, D, heads=2, concat=False, edge_dim=3),
            "transformer": lambda: gnn.TransformerConv(D, D, heads=2, concat=False),
            "edge": lambda: gnn.EdgeConv(mlp),
            "graph-max": lambda: gnn.GraphConv(D, D, aggr="max"),
            "graph": lambda: gnn.GraphConv(D, D),
            "sage": lambda: gnn.SAGEConv(D, D),
            "sage-max": lambda: gnn.SAGEConv(D, D, aggr="max"),
            "sage-no-root": lambda: gnn.SAGEConv(D, D, root_weight=False),  # (pooled as it is)
            "gcn-sums": lambda: gnn.GCNConv(D, D, normalize=False),  # (its bias on the sum)
            "gin": lambda: gnn.GINConv(mlp),
            "cluster": lambda: gnn.ClusterGCNConv(D, D),  # (x[row == col] += ...: a mask)
            "pna": lambda: gnn.PNAConv(D, D, ["mean", "max"], ["identity", "amplification"],
                                       deg=torch.tensor([1, 2, 2]), towers=2),  # (its
            # aggregates joined feature-wise, its towers a repeat of the nodes)
            "gated": lambda: gnn.GatedGraphConv(D, num_layers=2),  # (a GRU cell on the sum:
            # its input gates chunked, each piece added to the state's)
            "pdn": lambda: gnn.PDNConv(D, D, edge_dim=3, hidden_channels=D),  # (a write
            # of the self loops found among the edges: none)
        }[kind]()
        self.readout = gnn.aggr.Set2Set(D, processing_steps=2) if kind == "transformer" else (
            gnn.aggr.MeanAggregation())
        self.head = nn.Linear(2 * D if kind == "transformer" else D, 2)

    def forward(self, data):
        edges = (data.edge_attr,) if getattr(self.conv, "edge_dim", None) else ()
        h = self.conv(data.x, data.edge_index, *edges).relu()
        return self.head(self.readout(h, data.batch))


# the path of the parameters that do not take a rule, and why
LOCAL: dict[str, str] = {}


@pytest.mark.parametrize("kind", ["gat", "gatv2", "gat-edges", "gatv2-edges", "transformer",
                                  "edge", "graph-max", "graph", "sage", "sage-max",
                                  "sage-no-root", "gcn-sums", "gin",
                                  "cluster", "pdn", "pna", "gated", "sparse",
                                  "sparse-weighted"])
def test_message_passing_layers_are_exact_and_stay_local(kind):
    torch.manual_seed(0)
    model = (SparseGCN(kind == "sparse-weighted") if kind.startswith("sparse") else
             Net(kind)).double()
    batch = graphs()
    y, loss = torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a certificate's catch would warn, then fall back)
        routes = persample.supported(model, batch, y, loss)
        got = persample.per_sample_grads(model, batch, y, loss)
    paths = {r.path for r in routes} - {"unused"}
    assert paths <= {"rule", LOCAL.get(kind, "rule")}, [(r.module, r.path, r.reason)
                                                        for r in routes if r.path != "rule"]
    want = persample.loop_per_sample_grads(model, batch, y, loss)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)


class Readers(nn.Module):
    """A linear layer on the messages summed into each node (node 0 of every graph gets
    none: its row holds only the bias), its output read by the add of the node's own
    features (``"one"``; through views: ``"view"``; summed first with a second layer on
    the aggregate: ``"two"``; two of its rows swapped first: ``"swapped"``), and also by
    a sum of the rows of no message, spread to every graph, before that add or after it.
    In the batch, that sum runs over every graph's node 0, which no graph alone has: the
    reference is each graph's loss differentiated in the batch's forward."""

    def __init__(self, readers: str):
        super().__init__()
        self.readers = readers
        self.lin, self.root = nn.Linear(D, D), nn.Linear(D, D, bias=False)
        if readers.startswith("two"):
            self.other = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, data):
        x, (src, dst) = data.x, data.edge_index
        summed = torch.zeros_like(x).index_add_(0, dst, x.index_select(0, src))
        y = self.lin(summed)
        def spread():
            return y.index_select(0, torch.arange(0, x.shape[0], N)).sum(0)  # (shared)
        if self.readers.startswith("two"):  # (two layers' rows of no message, summed)
            y = y + self.other(summed)
            h = y + self.root(x)
            h = h + spread() if self.readers == "two-after" else h
        elif self.readers == "swapped":  # (node 0 of graphs 0 and 1 swapped, rows of
            # no message both: the rows moved, not carried on as an elementwise op
            # carries them; each then added to the other graph's node)
            order = torch.arange(x.shape[0])
            order[0], order[N] = N, 0
            h = y.index_select(0, order) + self.root(x)
        elif self.readers == "before":
            h = spread() + (y + self.root(x))
        elif self.readers == "after":
            h = (y + self.root(x)) + spread()
        elif self.readers.startswith("view"):  # (the rows carried by a view to the add)
            h = y.view(-1, 2, D // 2).flatten(1) + self.root(x)
            h = h + spread() if self.readers == "view-after" else h
        else:
            h = y + self.root(x)
        return self.head(torch.zeros(data.num_graphs, D, dtype=h.dtype).index_add_(
            0, data.batch, h.relu()))


@pytest.mark.parametrize("readers", ["one", "before", "after", "view", "view-after", "two",
                                     "two-after", "swapped"])
def test_rows_of_no_message_take_the_sample_of_their_one_reader(readers):
    """The layer on the aggregate takes its rule where its output has one reader, the
    fallback where it has two (its rows of no message then reach every graph's loss).
    Both answers equal the batch forward's per-sample gradients (the certificate off:
    the values are what is checked)."""
    torch.manual_seed(0)
    model, batch = Readers(readers).double(), graphs()
    y, loss = torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    paths = {r.module: r.path for r in persample.supported(model, batch, y, loss)}
    one = readers in ("one", "view", "two")
    want_paths = {"lin": "rule" if one else "fallback", "root": "rule", "head": "rule"}
    if readers.startswith("two"):
        want_paths["other"] = want_paths["lin"]
    assert paths == want_paths, paths
    got = persample.per_sample_grads(model, batch, y, loss, method="rules", check="never")
    want = persample.forward_per_sample_grads(model, batch, y, loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("weighted", [False, True])
def test_an_adjacency_joining_two_graphs_is_refused(weighted):
    torch.manual_seed(0)
    model, batch = SparseGCN(weighted).double(), graphs()
    batch.edge_index[0, 0] = N  # (a node of graph 1 sends to one of graph 0)
    y = torch.randn(B, 2, dtype=torch.float64)
    with pytest.raises(persample.LossNotPerSampleError, match="sparse_mm" if not weighted else
                       "__getitem__"):  # (the weights gather the two nodes first)
        persample.per_sample_grads(model, batch, y, nn.MSELoss(), method="rules")


class BatchLevel(nn.Module):
    """Layers whose forward reads the whole batch: ``ChebConv`` scales every graph's
    Laplacian by the largest edge weight of the batch (``lambda_max`` not given);
    ``to_dense_batch`` places each graph's nodes by the node counts of the graphs before
    it (a ``cumsum`` over the graphs); ``TopKPooling`` keeps each graph's top nodes by
    the same offsets."""

    def __init__(self, kind: str):
        super().__init__()
        from torch_geometric import nn as gnn

        self.kind = kind
        self.conv = gnn.ChebConv(D, D, K=2) if kind == "cheb" else gnn.GraphConv(D, D)
        self.pool = gnn.TopKPooling(D, ratio=0.5) if kind == "topk" else None
        self.head = nn.Linear(D, 2)

    def forward(self, data):
        from torch_geometric.nn import global_add_pool
        from torch_geometric.utils import to_dense_batch

        h, batch = self.conv(data.x, data.edge_index).relu(), data.batch
        if self.kind == "dense":
            return self.head(to_dense_batch(h, batch)[0].sum(1))
        if self.kind == "topk":
            h, _, _, batch, _, _ = self.pool(h, data.edge_index, batch=batch)
        return self.head(global_add_pool(h, batch))


@pytest.mark.parametrize(("kind", "op"), [("cheb", "max reduces over the batch"),
                                          ("dense", "cumsum works along the batch dim"),
                                          ("topk", "cumsum works along the batch dim")])
def test_layers_that_read_the_whole_batch_are_refused_by_the_op(kind, op):
    """Their samples mix (a graph's output moves with the others' edges or sizes): the
    rules refuse by the op's name, the routes say the same, and ``auto`` answers exactly
    by another method."""
    torch.manual_seed(0)
    model, batch = BatchLevel(kind).double(), graphs()
    y, loss = torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    with pytest.raises(persample.LossNotPerSampleError, match=op):
        persample.per_sample_grads(model, batch, y, loss, method="rules")
    assert any(op in r.reason for r in persample.supported(model, batch, y, loss))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (auto says which method it fell back to)
        got = persample.per_sample_grads(model, batch, y, loss)
    want = persample.loop_per_sample_grads(model, batch, y, loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)


class Set2SetReadout(nn.Module):
    """A GCN layer read out by ``Set2Set``, whose LSTM runs from its own earlier state."""

    def __init__(self):
        super().__init__()
        from torch_geometric import nn as gnn

        self.conv, self.readout = gnn.GCNConv(D, D), gnn.aggr.Set2Set(D, processing_steps=2)
        self.head = nn.Linear(2 * D, 2)

    def forward(self, data):
        return self.head(self.readout(self.conv(data.x, data.edge_index).relu(), data.batch))


def test_set2set_in_float32_takes_the_rules():
    """``Set2Set``'s LSTM runs from its own earlier state: its first step, on zeros,
    makes a state from the parameters alone, whose rows the next step and the nodes'
    graph index pair with the samples. Each step's weights take the recurrent kernel's
    rule (the first step's state pulled back once for every graph's row, its three
    outputs at once); in float32 on the CPU, where the kernel is oneDNN's, whose
    backward ``vmap`` cannot batch."""
    torch.manual_seed(0)
    model, batch = Set2SetReadout().float(), graphs()
    batch.x, batch.edge_attr = batch.x.float(), batch.edge_attr.float()
    y, loss = torch.randn(B, 2), nn.MSELoss()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = {r.module: r.path for r in persample.supported(model, batch, y, loss)}
        got = persample.per_sample_grads(model, batch, y, loss, method="rules")
    assert paths == {"conv.lin": "rule", "conv": "rule", "readout.lstm": "rule",
                     "head": "rule"}, paths
    want = persample.loop_per_sample_grads(model, batch, y, loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)


def test_set2sets_lstm_steps_are_formed_in_one_product(compiled, monkeypatch):
    """Each processing step of ``Set2Set`` calls the LSTM kernel; the recurrent rule
    gives its weights' parts as factors (``OpCall.defer``) and the engine forms each
    weight's steps in one product. Exact against the loop at every cached call, on new
    node features each time."""
    from persample.engine import pullback
    from persample.rules import ghost

    formed = []
    monkeypatch.setattr(pullback, "formed",
                        lambda uses, out=None: formed.append(len(uses)) or ghost.formed(uses, out))
    torch.manual_seed(0)
    model, batch, loss = Set2SetReadout(), graphs(), nn.MSELoss()
    for call in range(4):
        batch.x = torch.randn_like(batch.x)
        y = torch.randn(B, 2)
        got = persample.per_sample_grads(model, batch, y, loss, method="rules", check="never")
        want = persample.loop_per_sample_grads(model, batch, y, loss)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13)
        if call == 0:  # (the weights input-to-hidden and hidden-to-hidden, two steps each)
            assert formed == [2, 2], formed


class Tiled(nn.Module):
    """Node features tiled twice along the nodes (``repeat``), pooled by the batch vector
    tiled alike: each copy keeps its node's graph."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, data):
        h = self.lin(data.x).repeat(2, 1)
        return self.head(torch.zeros(data.num_graphs, D, dtype=h.dtype).index_add_(
            0, data.batch.repeat(2), h.relu()))


def test_nodes_tiled_by_repeat_keep_their_graphs():
    torch.manual_seed(0)
    model, batch = Tiled().double(), graphs()
    y, loss = torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    assert {r.path for r in persample.supported(model, batch, y, loss)} == {"rule"}
    got = persample.per_sample_grads(model, batch, y, loss, method="rules")
    want = persample.loop_per_sample_grads(model, batch, y, loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)


def _ring_graphs(seed: int, isolated: bool):
    """``B`` graphs of ``N`` nodes: a ring (every node gets a message) and random edges,
    or (``isolated``) the same without any edge into node 0."""
    require("torch_geometric")
    from torch_geometric.data import Batch, Data

    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(B):
        src = torch.cat([torch.arange(N), torch.randint(0, N, (N,), generator=g)])
        dst = torch.cat([(torch.arange(N) + 1) % N, torch.randint(0, N, (N,), generator=g)])
        keep = dst != 0 if isolated else torch.ones_like(dst, dtype=torch.bool)
        data.append(Data(x=torch.randn(N, D, generator=g, dtype=torch.float64),
                         edge_index=torch.stack([src[keep], dst[keep]])))
    return Batch.from_data_list(data)


def test_rows_of_no_message_that_come_and_go_between_calls(monkeypatch):
    """A training loop whose batches have nodes without messages at some calls only: the
    calls without them take the cached paths (a program, then the compiled forward),
    those with them the full capture, whose completed records no cached path keeps (a
    cached path would decide the layer's rows again, without their reader, and take the
    module fallback). Every call equals the loop, and none takes a fallback."""
    from persample.engine import pullback

    fallbacks = []
    original = pullback._fallback
    monkeypatch.setattr(pullback, "_fallback", lambda *a: fallbacks.append(1) or original(*a))
    torch.manual_seed(0)
    net = Net("sage").double()
    loss = nn.MSELoss()
    calls = [(_ring_graphs(k, isolated), torch.randn(B, 2, dtype=torch.float64)) for k, isolated
             in enumerate([True] * 10 + [False] * 5 + [True] * 3)]
    wants = [persample.loop_per_sample_grads(net, batch, y, loss) for batch, y in calls]
    for (batch, y), want in zip(calls, wants):  # (one after another, as a loop calls)
        got = persample.per_sample_grads(net, batch, y, loss, check="never")
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
    assert not fallbacks


class Dropped(nn.Module):
    """GATv2 with edge features and attention dropout, then SAGE and a dropout: the
    records completed by their readers in a training-mode forward."""

    def __init__(self):
        super().__init__()
        from torch_geometric import nn as gnn

        self.gat = gnn.GATv2Conv(D, D, heads=2, concat=False, edge_dim=3, dropout=0.3)
        self.sage, self.drop, self.head = gnn.SAGEConv(D, D), nn.Dropout(0.2), nn.Linear(D, 2)

    def forward(self, data):
        from torch_geometric import nn as gnn

        h = self.gat(data.x, data.edge_index, data.edge_attr).relu()
        h = self.drop(self.sage(h, data.edge_index)).relu()
        return self.head(gnn.global_mean_pool(h, data.batch))


def test_completed_records_in_training_mode_follow_the_forward_that_ran():
    """Each call's per-sample gradients are those of the forward that ran: one batch
    forward under the call's seed, each graph's loss differentiated."""
    torch.manual_seed(0)
    model, batch = Dropped().double().train(), graphs()
    y, loss = torch.randn(B, 2, dtype=torch.float64), nn.MSELoss()
    assert {r.path for r in persample.supported(model, batch, y, loss)} == {"rule"}
    for seed in range(3):
        torch.manual_seed(seed)
        got = persample.per_sample_grads(model, batch, y, loss, method="rules")
        torch.manual_seed(seed)
        want = persample.forward_per_sample_grads(model, batch, y, loss)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)


def test_the_graph_layers_table_runs(capsys):
    """``python -m persample_bench.graph_layers``, as the performance log names it, on one
    layer and size: a row with both times and their ratio."""
    require("torch_geometric")
    from persample_bench import graph_layers

    graph_layers.main(["--layer", "sage", "--size", "digits", "--rounds", "1"])
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| sage | digits | ") and row.endswith("x |"), row


def test_a_scatter_of_no_rows_is_no_error_and_names_no_sample():
    """MFConv writes each degree's nodes into its output by ``index_copy_``, an empty
    index for every degree no node has: the data flow of a scatter of no rows had failed
    (reshaping 0 entries to ``(0, -1)``), and an empty index had passed for one whose
    values are its entries' samples (rows 0..B-1 of the output named samples 0..B-1,
    then "mixed" by the next degree's nodes). On the rules, equal to the loop, with
    persample's internal errors raised."""
    from torch_geometric import nn as gnn

    class MF(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = gnn.MFConv(3, D, max_degree=6), nn.Linear(D, 2)

        def forward(self, data):
            return self.head(gnn.global_mean_pool(self.conv(data.x, data.edge_index).relu(),
                                                  data.batch))

    from test_mechanisms import graph_batch  # (rings: every node of degree 2 or more)

    torch.manual_seed(0)
    model, data, y = MF(), graph_batch(), torch.randn(B, 2)
    assert persample.verify(model, data, y, nn.MSELoss()).method == "rules"
    got = persample.per_sample_grads(model, data, y, nn.MSELoss(), method="rules")
    want = persample.loop_per_sample_grads(model, data, y, nn.MSELoss())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


def test_nodes_whose_ids_equal_their_graphs_name_no_sample():
    """Node 0 (of graph 0) picked alone by a mask on the features and written back by
    ``index_copy_``: its id equals its graph's, which once named rows 0..B-1 of the
    output samples 0..B-1 (the rows of an output of one row per sample), and the other
    nodes written next were called mixing samples. On the rules, equal to the loop,
    whichever node is picked."""
    from torch_geometric import nn as gnn

    from test_mechanisms import graph_batch

    class Pick(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, data):
            x = data.x
            picked = x[:, 0] > 50
            out = x.new_empty(x.shape[0], 4)
            for lin, idx in ((self.a, picked.nonzero().view(-1)),
                             (self.b, (~picked).nonzero().view(-1))):
                out.index_copy_(0, idx, lin(x.index_select(0, idx)))
            return self.head(gnn.global_mean_pool(out.relu(), data.batch))

    torch.manual_seed(0)
    model, y = Pick(), torch.randn(B, 2)
    for node in (0, 5):
        data = graph_batch()
        data.x[node, 0] = 100.0
        assert persample.verify(model, data, y, nn.MSELoss()).method == "rules", node
        got = persample.per_sample_grads(model, data, y, nn.MSELoss(), method="rules")
        want = persample.loop_per_sample_grads(model, data, y, nn.MSELoss())
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


class MeanTimesWeight(nn.Module):
    """The mean of each node's messages times a weight by ``@`` (node 0 of every graph
    gets none: its row holds no sample's data), plus the node's own features times
    another, pooled per graph; with ``relations``, ``RGCNConv`` (a mean per edge type)."""

    def __init__(self, relations: bool = False):
        super().__init__()
        from torch_geometric import nn as gnn

        self.relations = relations
        if relations:
            self.conv = gnn.RGCNConv(D, D, num_relations=3)
        else:
            self.w_l, self.w_r = (nn.Parameter(torch.randn(D, D)) for _ in range(2))
        self.head = nn.Linear(D, 2)

    def forward(self, data):
        from torch_geometric.utils import scatter

        if self.relations:
            types = (data.edge_attr[:, :2] > 0).sum(1)  # (each edge's own: its graph's)
            h = self.conv(data.x, data.edge_index, types)
        else:
            src, dst = data.edge_index
            mean = scatter(data.x[src], dst, 0, dim_size=data.x.shape[0], reduce="mean")
            h = mean @ self.w_l + data.x @ self.w_r
        return self.head(scatter(h.relu(), data.batch, 0, reduce="mean"))


@pytest.mark.parametrize("relations", [False, True])
def test_rows_of_no_message_times_a_weight_by_matmul_stay_rows_of_no_sample(relations):
    """``mean @ W`` carries the rows of no sample on, made for its own output (it had
    passed on its input's, which every later op took for an unknown layout: the whole
    model went to ``vmap``). With the node's own features added, on the rules; so is
    ``RGCNConv``, whose products of each edge type's mean are summed before the node's
    own features are added: a sum of two such products carries their rows on, those of
    no sample in both still waiting for their sample. Equal to the loop."""
    torch.manual_seed(0)
    model, batch, y = MeanTimesWeight(relations), graphs(), torch.randn(B, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = {f"{r.module}.{p}": r.path
                 for r in persample.supported(model, batch, y, nn.MSELoss()) for p in r.params}
        got = persample.per_sample_grads(model, batch, y, nn.MSELoss())
    assert set(paths.values()) == {"rule"}, paths
    want = persample.loop_per_sample_grads(model, batch, y, nn.MSELoss())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


class Recurrent(nn.Module):
    """A graph readout by a recurrent layer run from its own earlier state, as
    ``Set2Set`` runs its LSTM (``kind``: ``"lstm"``, ``"gru"``, ``"rnn"``): the first
    step on zeros (a state from the parameters alone), each next step on the attention
    over the graph's nodes; ``steps`` steps."""

    def __init__(self, kind: str, steps: int = 3):
        super().__init__()
        from torch_geometric import nn as gnn

        self.conv, self.steps = gnn.GCNConv(D, D), steps
        self.cell = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](2 * D, D)
        self.head = nn.Linear(2 * D, 2)

    def forward(self, data):
        from torch_geometric.utils import scatter, softmax

        x, index = self.conv(data.x, data.edge_index).relu(), data.batch
        zeros = x.new_zeros(1, data.num_graphs, D)
        h = (zeros, zeros) if isinstance(self.cell, nn.LSTM) else zeros
        q_star = x.new_zeros(data.num_graphs, 2 * D)
        for _ in range(self.steps):
            q, h = self.cell(q_star.unsqueeze(0), h)
            q = q.view(data.num_graphs, D)
            a = softmax((x * q[index]).sum(-1, keepdim=True), index)
            q_star = torch.cat([q, scatter(a * x, index, 0, reduce="sum")], -1)
        return self.head(q_star)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_a_recurrent_readout_from_its_own_state_takes_the_rules(kind):
    """Each step of the recurrent layer on the rules (graphs, nodes, features and the
    hidden size all ``B``), every answer equal to the loop in float64: the rows of the
    first step's state paired with the graphs by their readers."""
    torch.manual_seed(0)
    model, batch, y = Recurrent(kind).double(), graphs(), torch.randn(B, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = {r.module: r.path for r in persample.supported(model, batch, y, nn.MSELoss())}
        got = persample.per_sample_grads(model, batch, y, nn.MSELoss(), method="rules")
    assert paths == {"conv": "rule", "conv.lin": "rule", "cell": "rule", "head": "rule"}, paths
    want = persample.loop_per_sample_grads(model, batch, y, nn.MSELoss())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


def test_the_first_steps_state_is_pulled_back_once_for_every_graph(monkeypatch):
    """The first step's output and final states (made from the parameters alone) get
    each sample's cotangent at that sample's row only: they are pulled back paired with
    the graphs, the three at once (the kernel's rule runs for that step once, and once
    for the second step; the third takes the LSTM's module rule), never by a VJP per
    sample over every row (a batch of graphs times itself)."""
    import persample.engine.pullback as pullback
    import persample.rules.recurrent as recurrent

    counts = {"kernel": 0, "shared": 0}

    def counted(fn, key):
        def run(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(recurrent, "recurrent", counted(recurrent.recurrent, "kernel"))
    monkeypatch.setattr(pullback, "shared_vjp", counted(pullback.shared_vjp, "shared"))
    torch.manual_seed(0)
    model, batch, y = Recurrent("lstm").double(), graphs(), torch.randn(B, 2)
    got = persample.per_sample_grads(model, batch, y, nn.MSELoss(), method="rules")
    assert counts == {"kernel": 2, "shared": 0}, counts
    want = persample.loop_per_sample_grads(model, batch, y, nn.MSELoss())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


def _isolated_graphs():
    """``B`` graphs of ``N`` nodes whose node 0 has no edge in or out."""
    from torch_geometric.data import Batch, Data

    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(B):
        dst = torch.randint(1, N, (EDGES,), generator=g)
        src = (dst - 1 + torch.randint(1, N - 1, (EDGES,), generator=g)) % (N - 1) + 1
        data.append(Data(x=torch.randn(N, D, generator=g, dtype=torch.float64),
                         edge_index=torch.stack([src, dst])))  # (no self loop, none at 0)
    return Batch.from_data_list(data)


@pytest.mark.parametrize("inner", ["sage", "gcn"])
def test_both_directions_rows_of_no_message_meet_on_the_rules(inner):
    """``DirGNNConv`` sums its layer over the incoming and over the outgoing edges (an
    isolated node: a row of no sample in both) before the node's own features: the
    rows of no sample carried through that sum take the sample of the node they are
    added to. On the rules, equal to the loop."""
    require("torch_geometric")
    from torch_geometric import nn as gnn

    class Dir(nn.Module):
        def __init__(self):
            super().__init__()
            layer = gnn.SAGEConv(D, D) if inner == "sage" else gnn.GCNConv(D, D)
            self.conv, self.head = gnn.DirGNNConv(layer), nn.Linear(D, 2)

        def forward(self, data):
            h = self.conv(data.x, data.edge_index).relu()
            return self.head(gnn.global_mean_pool(h, data.batch))

    torch.manual_seed(0)
    model, batch, y = Dir().double(), _isolated_graphs(), torch.randn(B, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = {r.path for r in persample.supported(model, batch, y, nn.MSELoss())}
        got = persample.per_sample_grads(model, batch, y, nn.MSELoss())
    assert paths <= {"rule", "unused"}, paths
    want = persample.loop_per_sample_grads(model, batch, y, nn.MSELoss())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


class ByGraph(nn.Module):
    """Each node given a row of a table by its graph's id in the batch (``kind``): a
    parameter of a row per graph (``"table"``), rows computed from it (``"scaled"``), an
    embedding looked up by the graph ids (``"embedding"``); or a virtual node, one
    learned row for every graph (an embedding of zeros, ``"virtual"``), read the same
    way, which each graph alone reads alike."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.table = nn.Parameter(torch.randn(B, D))
        self.emb, self.head = nn.Embedding(B, D), nn.Linear(D, 2)

    def forward(self, data):
        from torch_geometric.nn import global_mean_pool

        graph = data.batch
        rows = {"table": lambda: self.table[graph], "scaled": lambda: (self.table * 2)[graph],
                "embedding": lambda: self.emb(graph),
                "virtual": lambda: self.emb(graph.new_zeros(data.num_graphs))[graph]}[
            self.kind]()
        return self.head(global_mean_pool(data.x + rows, graph))


@pytest.mark.parametrize("kind", ["table", "scaled", "embedding", "virtual"])
def test_a_table_read_at_each_graphs_own_id_is_refused_by_name(kind):
    """In the batch graph ``i`` reads row ``i``; alone it is graph 0 and reads row 0: a
    table of a row per graph mixes the samples by their place in the batch, and the rules
    refuse it naming the op (the loop's answer differs from the batch's). A virtual node,
    the same row for every graph, reads alike in both: on the rules, equal to the loop."""
    torch.manual_seed(0)
    model, batch, y = ByGraph(kind).double(), graphs(), torch.randn(B, 2)
    if kind == "virtual":
        paths = {r.path for r in persample.supported(model, batch, y, nn.MSELoss())}
        got = persample.per_sample_grads(model, batch, y, nn.MSELoss(), method="rules")
        want = persample.loop_per_sample_grads(model, batch, y, nn.MSELoss())
        assert paths <= {"rule", "unused"}, paths
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)
        return
    with pytest.raises(persample.LossNotPerSampleError, match="the rows its"):
        persample.per_sample_grads(model, batch, y, nn.MSELoss(), method="rules")
