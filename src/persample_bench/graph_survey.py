"""A survey of torch_geometric's message-passing convolutions: the path persample takes
for each layer's parameters, and its answer against the loop
(``python -m persample_bench.graph_survey``).

Each convolution is one model: the layer on the batch's node features and edges (with
the edge features, edge weights, edge types or positions where it reads them), a ReLU,
a mean pool per graph, a linear head of 2 outputs (sized from the layer's output), the
mean squared error against random targets. Layers without parameters get a linear
layer before them. The batch is ``B = 4`` random graphs of ``N = 4`` nodes and ``D = 4``
features (sizes that coincide: nothing can be told from a size), 12 edges each, none
into node 0 (a node that receives no message); each graph also has edge features
(12 x 3), positions (4 x 3), edge types in ``[0, 3)``, positive edge weights and the
largest eigenvalue of its normalized Laplacian (``lambda_max``, for ``ChebConv``).
Everything is float64, seeds fixed, one thread.

For each layer, one row: the paths :func:`persample.supported` reports for its
parameters (``"unused"`` left out); the reasons it gives for those not on ``rule`` or
``module rule``; the largest relative difference of
:func:`persample.per_sample_grads` from :func:`persample.loop_per_sample_grads` (over
the parameters, each's largest entry difference over its reference's largest entry),
or ``refused: <error>`` where persample raises; the warnings persample gave (a fallback,
a certificate's catch). A layer whose package is missing gets ``needs <package>``;
any other error is reported in its row and the survey goes on. The last line says how
many layers take the rules (every parameter on ``rule``, ``module rule`` or
``unused``) and which do not.

``--time`` adds the median of 5 per-sample calls over the median of 5 plain steps
(``zero_grad``, forward, loss, ``backward``) on a float32 copy; ``--layer NAME``
(repeatable) runs some layers only; ``--markdown`` prints a markdown table. Needs
``torch_geometric``.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import persample

from .real_models import require

B = N = D = 4  # graphs, nodes per graph and features coincide
EDGES = 3 * N
RULES = {"rule", "module rule", "unused"}
NOTE_CHARS = 100


def graphs() -> Any:
    """``B`` graphs of ``N`` nodes and ``EDGES`` random edges each (no self loop, none
    into node 0), in float64: ``x``, ``edge_index``, ``edge_attr``, ``pos``,
    ``edge_type``, ``edge_weight``, ``lambda_max`` (the largest eigenvalue of the graph's
    normalized Laplacian) and its edges split in two (``pos_edge_index``, every other
    edge, and ``neg_edge_index``), batched by ``Batch``."""
    pyg = require("torch_geometric")
    from torch_geometric.utils import get_laplacian, to_dense_adj

    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(B):
        dst = torch.randint(1, N, (EDGES,), generator=g)
        src = (dst + torch.randint(1, N, (EDGES,), generator=g)) % N
        edge_index = torch.stack([src, dst])
        weight = torch.rand(EDGES, generator=g, dtype=torch.float64) + 0.5
        lap_index, lap_weight = get_laplacian(edge_index, weight, "sym", num_nodes=N)
        lap = to_dense_adj(lap_index, edge_attr=lap_weight, max_num_nodes=N)[0]
        data.append(pyg.data.Data(
            x=torch.randn(N, D, generator=g, dtype=torch.float64), edge_index=edge_index,
            edge_attr=torch.randn(EDGES, 3, generator=g, dtype=torch.float64),
            pos=torch.randn(N, 3, generator=g, dtype=torch.float64),
            edge_type=torch.randint(0, 3, (EDGES,), generator=g), edge_weight=weight,
            lambda_max=torch.linalg.eigvals(lap).real.max().reshape(1),
            pos_edge_index=edge_index[:, ::2], neg_edge_index=edge_index[:, 1::2]))
    return pyg.data.Batch.from_data_list(data)


Call = Callable[[nn.Module, Any], torch.Tensor]


class Net(nn.Module):
    """``call(conv, data)`` (the layer on the batch), a ReLU, a mean pool per graph, a
    linear head of 2 outputs on the layer's ``width`` features."""

    def __init__(self, conv: nn.Module, call: Call, width: int):
        super().__init__()
        self.conv, self.call, self.head = conv, call, nn.Linear(width, 2)

    def forward(self, data: Any) -> torch.Tensor:
        from torch_geometric.nn import global_mean_pool

        return self.head(global_mean_pool(self.call(self.conv, data).relu(), data.batch))


class Before(nn.Module):
    """A linear layer, then a layer without parameters (``APPNP``, ``LGConv``...)."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.lin, self.conv = nn.Linear(D, D), conv

    def forward(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        return self.conv(self.lin(x), *args)


# how a layer is called on the batch
def _plain(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.edge_index)


def _weighted(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.edge_index, d.edge_weight)


def _attr(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.edge_index, d.edge_attr)


def _typed(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.edge_index, d.edge_type)


def _pos(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.pos, d.edge_index)


def _batch(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.batch)


def _x0(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.x, d.edge_index)


def _cheb(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.edge_index, d.edge_weight, d.batch, d.lambda_max)


def _signed(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.pos_edge_index, d.neg_edge_index)


def _dna(m: nn.Module, d: Any) -> torch.Tensor:
    return m(torch.stack([d.x, d.x.tanh()], 1), d.edge_index, d.edge_weight)


def _ppf(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.pos, nn.functional.normalize(d.pos, dim=-1), d.edge_index)


def _pan(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.edge_index)[0]


def _xconv(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.pos, d.batch)


def _gps(m: nn.Module, d: Any) -> torch.Tensor:
    return m(d.x, d.edge_index, d.batch)


def _mlp(fan_in: int, fan_out: int = D) -> nn.Module:
    return nn.Sequential(nn.Linear(fan_in, D), nn.ReLU(), nn.Linear(D, fan_out))


# name -> (the layer, how it is called), from torch_geometric.nn; models are in training
# mode, so GENConv and GPSConv go without their default BatchNorm (the statistics of the
# whole batch, refused by design)
CASES: dict[str, Callable[[Any], tuple[nn.Module, Call]]] = {
    "gcn": lambda g: (g.GCNConv(D, D), _weighted),
    "cheb": lambda g: (g.ChebConv(D, D, K=3), _cheb),  # (lambda_max per graph)
    "cheb-no-lambda": lambda g: (g.ChebConv(D, D, K=3), _weighted),  # (the batch's max)
    "sage": lambda g: (g.SAGEConv(D, D), _plain),
    "graph": lambda g: (g.GraphConv(D, D), _weighted),
    "gravnet": lambda g: (g.GravNetConv(D, D, space_dimensions=2, propagate_dimensions=2,
                                        k=2), _batch),
    "gated": lambda g: (g.GatedGraphConv(D, num_layers=2), _weighted),
    "resgated": lambda g: (g.ResGatedGraphConv(D, D), _plain),
    "gat": lambda g: (g.GATConv(D, D, heads=2), _plain),
    "gatv2": lambda g: (g.GATv2Conv(D, D, heads=2), _plain),
    "transformer": lambda g: (g.TransformerConv(D, D, heads=2), _plain),
    "agnn": lambda g: (g.AGNNConv(), _plain),
    "tag": lambda g: (g.TAGConv(D, D, K=2), _weighted),
    "gin": lambda g: (g.GINConv(_mlp(D), train_eps=True), _plain),
    "gine": lambda g: (g.GINEConv(_mlp(D), train_eps=True, edge_dim=3), _attr),
    "arma": lambda g: (g.ARMAConv(D, D, num_stacks=2, num_layers=2), _weighted),
    "sg": lambda g: (g.SGConv(D, D, K=2), _weighted),
    "ssg": lambda g: (g.SSGConv(D, D, alpha=0.1, K=2), _weighted),
    "appnp": lambda g: (Before(g.APPNP(K=2, alpha=0.1)), _weighted),
    "mf": lambda g: (g.MFConv(D, D, max_degree=6), _plain),
    "rgcn": lambda g: (g.RGCNConv(D, D, num_relations=3), _typed),
    "fast-rgcn": lambda g: (g.FastRGCNConv(D, D, num_relations=3), _typed),
    "rgat": lambda g: (g.RGATConv(D, D, num_relations=3), _typed),
    "signed": lambda g: (g.SignedConv(D, D, first_aggr=True), _signed),
    "dna": lambda g: (g.DNAConv(D, heads=2), _dna),
    "pointnet": lambda g: (g.PointNetConv(_mlp(D + 3), _mlp(D)), _pos),
    "gmm": lambda g: (g.GMMConv(D, D, dim=3, kernel_size=2), _attr),
    "spline": lambda g: (g.SplineConv(D, D, dim=3, kernel_size=2), _attr),
    "nn": lambda g: (g.NNConv(D, D, _mlp(3, D * D)), _attr),
    "cg": lambda g: (g.CGConv(D, dim=3), _attr),
    "edge": lambda g: (g.EdgeConv(_mlp(2 * D)), _plain),
    "dynamic-edge": lambda g: (g.DynamicEdgeConv(_mlp(2 * D), k=2), _batch),
    "x": lambda g: (g.XConv(D, D, dim=3, kernel_size=2), _xconv),
    "ppf": lambda g: (g.PPFConv(_mlp(D + 4), _mlp(D)), _ppf),
    "feast": lambda g: (g.FeaStConv(D, D, heads=2), _plain),
    "point-transformer": lambda g: (g.PointTransformerConv(D, D), _pos),
    "hypergraph": lambda g: (g.HypergraphConv(D, D), _plain),  # (edges as (node, hyperedge))
    "le": lambda g: (g.LEConv(D, D), _weighted),
    "pna": lambda g: (g.PNAConv(D, D, ["mean", "max"], ["identity", "amplification"],
                                deg=torch.tensor([1, 2, 2]), towers=2), _plain),
    "cluster-gcn": lambda g: (g.ClusterGCNConv(D, D), _plain),
    "gen": lambda g: (g.GENConv(D, D, learn_t=True, norm=None), _plain),  # (no BatchNorm)
    "gcn2": lambda g: (g.GCN2Conv(D, alpha=0.1, theta=0.5, layer=1),
                       lambda m, d: m(d.x, d.x, d.edge_index, d.edge_weight)),
    "pan": lambda g: (g.PANConv(D, D, filter_size=2), _pan),
    "wl-continuous": lambda g: (Before(g.WLConvContinuous()), _weighted),
    "film": lambda g: (g.FiLMConv(D, D, num_relations=3), _typed),
    "supergat": lambda g: (g.SuperGATConv(D, D, heads=2), _plain),
    "fa": lambda g: (g.FAConv(D), _x0),
    "eg": lambda g: (g.EGConv(D, D, num_heads=2, num_bases=2), _plain),
    "pdn": lambda g: (g.PDNConv(D, D, edge_dim=3, hidden_channels=D), _attr),
    "general": lambda g: (g.GeneralConv(D, D), _plain),
    "lg": lambda g: (Before(g.LGConv()), _weighted),
    "point-gnn": lambda g: (g.PointGNNConv(nn.Linear(D, 3), _mlp(D + 3), _mlp(D)),
                            lambda m, d: m(d.x, d.pos, d.edge_index)),
    "antisymmetric": lambda g: (g.AntiSymmetricConv(D), _plain),
    "dirgnn-gcn": lambda g: (g.DirGNNConv(g.GCNConv(D, D)), _plain),
    "dirgnn-sage": lambda g: (g.DirGNNConv(g.SAGEConv(D, D)), _plain),
    "mixhop": lambda g: (g.MixHopConv(D, D, powers=[0, 1, 2]), _weighted),
    "gps": lambda g: (g.GPSConv(D, g.GINConv(_mlp(D)), heads=1, norm=None), _gps),
}


@dataclass
class Row:
    """One layer's outcome (``needs``: the missing package; ``error``: why the survey
    could not build or run it; ``refused``: persample's error)."""

    layer: str
    paths: set[str] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    diff: float | None = None
    refused: str = ""
    needs: str = ""
    error: str = ""
    warned: list[str] = field(default_factory=list)
    ratio: str = ""

    @property
    def on_rules(self) -> bool:
        """Every parameter on ``rule``, ``module rule`` or ``unused``, and no error."""
        return bool(self.paths) and self.paths <= RULES and not (
            self.refused or self.needs or self.error)


def _short(text: str, chars: int = NOTE_CHARS) -> str:
    """``text`` on one line, cut to ``chars`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= chars else line[:chars - 3] + "..."


def _gist(reason: str) -> str:
    """A route's reason in one line: its first sentence, without the words every such
    reason starts with, cut to ``NOTE_CHARS``."""
    reason = reason.split(" method='auto' runs")[0].removeprefix(
        "loss_fn reads the model's output, ")
    reason = re.sub(r"^(in which the samples are mixed|whose samples cannot be located): ",
                    lambda m: "samples mixed: " if "mixed" in m.group(1) else
                    "samples not located: ", reason)
    return _short(reason.split(". ")[0])


def _modules(names: list[str]) -> str:
    """The first three of ``names``, and how many more."""
    more = f" +{len(names) - 3}" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def _error(err: BaseException) -> str:
    """The exception's class and the first line of its message."""
    first = (str(err).strip().splitlines() or [""])[0]
    return _short(f"{type(err).__name__}: {first}")


def _missing(err: BaseException) -> str | None:
    """The package an ``ImportError`` asks for (else ``None``)."""
    if not isinstance(err, ImportError):
        return None
    found = re.search(r"requires '([^'<>=]+)", str(err))
    return found.group(1) if found else (err.name or _short(str(err), 40))


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """The warnings in ``caught`` that persample gave (not torch's or the layer's own),
    each once, shortened."""
    libs = (os.path.dirname(torch.__file__), os.path.dirname(require("torch_geometric").__file__))
    seen: dict[str, None] = {}
    for w in caught:
        if not str(w.filename).startswith(libs):
            text = str(w.message)
            method = re.search(r"Falling back to (method='\w+')", text)
            if method:  # (its reason is the routes')
                text = f"{text.split(':')[0]}; fell back to {method.group(1)}"
            seen[_short(text)] = None
    return list(seen)


def build(name: str) -> tuple[Net, Any, torch.Tensor]:
    """The model of layer ``name`` (float64, seed 0), the batch and the targets."""
    gnn = require("torch_geometric").nn
    torch.manual_seed(0)
    conv, call = CASES[name](gnn)
    conv = conv.double()
    batch = graphs()
    with torch.no_grad():
        width = call(conv, batch).shape[-1]
    model = Net(conv, call, width).double()
    y = torch.randn(B, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return model, batch, y


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest, over the parameters, of the largest entry difference over the
    reference's largest entry."""
    return max(((got[k] - w).abs().max() / w.abs().max().clamp_min(1e-300)).item()
               for k, w in want.items())


def _ratio(model: Net, batch: Any, y: torch.Tensor, loss: nn.Module) -> str:
    """Median of 5 per-sample calls over median of 5 plain steps, on a float32 copy."""
    model = copy.deepcopy(model).float()
    batch = batch.clone().apply(lambda t: t.float() if t.is_floating_point() else t)
    y = y.float()

    def step() -> None:
        model.zero_grad()
        loss(model(batch), y).backward()

    def median(run: Callable[[], Any]) -> float:
        run()  # (plans, the allocator)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = median(lambda: persample.per_sample_grads(model, batch, y, loss))
        plain = median(step)
    return f"{ours / plain:.1f}x ({ours * 1e3:.1f} / {plain * 1e3:.1f} ms)"


def survey(name: str, timed: bool = False) -> Row:
    """Layer ``name``'s row; never raises (an error is reported in the row)."""
    row = Row(name)
    try:
        model, batch, y = build(name)
    except Exception as err:  # (the layer's package missing, or a bad case)
        row.needs = _missing(err) or ""
        row.error = "" if row.needs else f"not built: {_error(err)}"
        return row
    loss = nn.MSELoss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            routes = persample.supported(model, batch, y, loss)
            row.paths = {r.path for r in routes} - {"unused"}
            by_reason: dict[tuple[str, str], list[str]] = {}
            for r in routes:
                if r.path not in RULES:
                    by_reason.setdefault((r.path, _gist(r.reason)), []).append(
                        r.module or "<root>")
            row.reasons = [f"{_modules(modules)} ({path}): {reason}"
                           for (path, reason), modules in by_reason.items()]
        except Exception as err:
            row.error = f"supported: {_error(err)}"
        try:
            got = persample.per_sample_grads(model, batch, y, loss)
        except Exception as err:
            row.needs = _missing(err) or ""
            row.refused = _error(err)
        row.warned = _ours(caught)
    if not row.refused:
        try:
            want = persample.loop_per_sample_grads(model, batch, y, loss)
            if got.keys() != want.keys():
                row.error = f"names differ: {sorted(got.keys() ^ want.keys())}"
            else:
                row.diff = _relative(got, want)
        except Exception as err:
            row.error = f"loop: {_error(err)}"
    if timed and not row.refused:
        try:
            row.ratio = _ratio(model, batch, y, loss)
        except Exception as err:
            row.ratio = f"not timed: {_error(err)}"
    return row


def _cells(row: Row, timed: bool) -> list[str]:
    if row.needs and not row.paths:
        cells = [row.layer, "", f"needs {row.needs}", ""]
    else:
        diff = (f"refused: {row.refused}" if row.refused else
                "" if row.diff is None else f"{row.diff:.1e}")
        notes = row.reasons + [f"warned: {w}" for w in row.warned] + (
            [row.error] if row.error else [])
        cells = [row.layer, ", ".join(sorted(row.paths)), diff, "; ".join(notes)]
    return cells + ([row.ratio] if timed else [])


def main(argv: list[str] | None = None) -> list[Row]:
    """Print the table and the summary; return the rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", action="append", choices=list(CASES), metavar="NAME",
                        help="a layer to survey (repeatable; default: all)")
    parser.add_argument("--time", action="store_true",
                        help="also time per-sample calls against plain steps (float32)")
    parser.add_argument("--markdown", action="store_true", help="a markdown table")
    args = parser.parse_args(argv)
    require("torch_geometric")
    torch.set_num_threads(1)
    head = ["layer", "paths", "max rel diff", "notes"] + (["per-sample / step"]
                                                          if args.time else [])
    widths = [18, 24, 12]

    def show(cells: list[str]) -> None:
        if args.markdown:
            print("| " + " | ".join(c.replace("|", "/") for c in cells) + " |", flush=True)
        else:
            print("  ".join(c.ljust(w) for c, w in zip(cells, widths + [0] * 9)).rstrip(),
                  flush=True)

    show(head)
    if args.markdown:
        show(["---"] * len(head))
    rows = []
    for name in args.layer or CASES:
        rows.append(survey(name, args.time))
        show(_cells(rows[-1], args.time))
    ran = [r for r in rows if not (r.needs and not r.paths)]
    off = [r.layer for r in ran if not r.on_rules]
    print(f"\n{len(ran) - len(off)} of {len(ran)} convolutions take the rules"
          + (f"; not: {', '.join(off)}" if off else "")
          + "".join(f"; {r.layer} needs {r.needs}" for r in rows if r not in ran))
    return rows


if __name__ == "__main__":
    main()
