"""torch_geometric's message-passing layers as graph classification trains them:
persample's per-sample gradients against a plain step, alternated in one process
(``python -m persample_bench.graph_layers``).

Two sizes, each a stack of one layer kind, a ReLU after each, a mean pool per graph and
a linear head, cross-entropy, float32, one thread:

- ``digits``: the benchmark's ``gcn-batch-grads`` batch (the digits' 8x8 pixels as 32
  graphs of 16 to 64 nodes, :func:`persample_bench.workloads.graph_batch`), two layers
  of 64, 2 classes, the same batch at every call;
- ``graphs-128``: a new ``Batch`` at every call, drawn from 6 of 128 random graphs of
  15 to 40 nodes with 32 features and twice as many edges as nodes, three layers of 128,
  10 classes.

Each call is ``persample.per_sample_grads(model, batch, labels, loss)`` as its users
call it; the plain step is ``zero_grad``, the forward, the loss and ``backward``. After
warm-up, per-sample calls and plain steps alternate; the table gives their medians and
their ratio. Needs ``torch_geometric``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

import persample

from .real_models import require
from .workloads import graph_batch

LAYERS = ("gcn", "sage", "graph", "gin", "gcn-set2set")  # (the last: GCN layers read out
# by Set2Set, 3 steps, in place of the mean pool)
SIZES = ("digits", "graphs-128")


def _layer(kind: str, fan_in: int, fan_out: int) -> nn.Module:
    gnn = require("torch_geometric").nn
    if kind == "gin":
        return gnn.GINConv(nn.Sequential(nn.Linear(fan_in, fan_out), nn.ReLU(),
                                         nn.Linear(fan_out, fan_out)))
    return {"gcn": gnn.GCNConv, "sage": gnn.SAGEConv, "graph": gnn.GraphConv}[kind](
        fan_in, fan_out)


class Stack(nn.Module):
    """Layers of one kind, a ReLU after each, a mean pool per graph (``Set2Set`` for
    ``"gcn-set2set"``), a linear head."""

    def __init__(self, kind: str, widths: list[int], classes: int):
        super().__init__()
        gnn = require("torch_geometric").nn
        conv = kind.removesuffix("-set2set")
        self.convs = nn.ModuleList(_layer(conv, a, b) for a, b in zip(widths, widths[1:]))
        self.readout = (gnn.aggr.Set2Set(widths[-1], processing_steps=3) if conv != kind
                        else gnn.aggr.MeanAggregation())
        self.head = nn.Linear(widths[-1] * (2 if conv != kind else 1), classes)

    def forward(self, data: Any) -> torch.Tensor:
        h = data.x
        for conv in self.convs:
            h = conv(h, data.edge_index).relu()
        return self.head(self.readout(h, data.batch))


def _random_graphs(count: int, seed: int) -> Any:
    """``count`` random graphs of 15 to 40 nodes, 32 features, 2 edges a node."""
    data = require("torch_geometric").data
    g = torch.Generator().manual_seed(seed)
    graphs = []
    for _ in range(count):
        n = int(torch.randint(15, 40, (1,), generator=g))
        graphs.append(data.Data(x=torch.randn(n, 32, generator=g, dtype=torch.float32),
                                edge_index=torch.randint(0, n, (2, 2 * n), generator=g)))
    return data.Batch.from_data_list(graphs)


def calls(kind: str, size: str) -> tuple[nn.Module, list[tuple[Any, torch.Tensor]]]:
    """The model and the ``(batch, labels)`` of its calls, in turn."""
    torch.manual_seed(0)
    if size == "digits":
        batch, labels = graph_batch(32)
        return Stack(kind, [batch.x.shape[1], 64, 64], 2).float(), [(batch, labels)]
    batches = [(_random_graphs(128, k), torch.randint(0, 10, (128,))) for k in range(6)]
    return Stack(kind, [32, 128, 128, 128], 10).float(), batches


def measure(kind: str, size: str, rounds: int = 3) -> tuple[float, float]:
    """Median seconds of a per-sample call and of a plain step, alternated."""
    model, work = calls(kind, size)
    loss = nn.CrossEntropyLoss()

    def step(batch: Any, labels: torch.Tensor) -> None:
        model.zero_grad()
        loss(model(batch), labels).backward()

    for batch, labels in work * 2:  # (plans, compiled calls, the allocator)
        persample.per_sample_grads(model, batch, labels, loss)
        step(batch, labels)
    ours, plain = [], []
    for _ in range(rounds):
        for batch, labels in work * (6 // len(work)):
            start = time.perf_counter()
            persample.per_sample_grads(model, batch, labels, loss)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            step(batch, labels)
            plain.append(time.perf_counter() - start)
    return statistics.median(ours), statistics.median(plain)


def main(argv: list[str] | None = None) -> None:
    """Print the table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", action="append", choices=LAYERS)
    parser.add_argument("--size", action="append", choices=SIZES)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| layer | size | persample | plain step | ratio |")
    print("|---|---|---|---|---|")
    for size in args.size or SIZES:
        for kind in args.layer or LAYERS:
            ours, plain = measure(kind, size, args.rounds)
            print(f"| {kind} | {size} | {ours * 1e3:,.1f} ms | {plain * 1e3:,.1f} ms | "
                  f"{ours / plain:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
