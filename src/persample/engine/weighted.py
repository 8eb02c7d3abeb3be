"""Weighted sums ``sum_i w_i g_i`` of per-sample gradients from a captured batch, without
forming the gradients ("book-keeping", Bu et al. 2023): the backprops of an op's output
scaled by each sample's weight, pulled back through that op alone (or, for a module
call, through the model's graph from that output). A DP step's clipped sum is one (the
weights its clip factors); a certificate's random combination is another.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..batch import Batched
from ..rules.vjp import summed_vjp
from .captured import Captured


def scaled(g: Tensor, lay: Any, w: Tensor) -> Tensor:
    """Backprops ``g`` (an output's own shape, layout ``lay``) times each sample's weight
    ``w (n,)``; a shared output (no samples) as it is."""
    return g * lay.scale(w, g) if isinstance(lay, Batched) else g


def op_weighted_sum(captured: Captured, op: Any, group: list, w: Tensor) -> dict[int, Tensor]:
    """``d/dW <w * G, out>`` for ``group``'s parameters (``{id(p): (*shape)}``): the op
    replayed on the values it read (unchanged since it ran) and one backward of it
    alone (the model's graph is not needed)."""
    (edge,), (lay,) = op.edges, op.out_layouts
    g = scaled(captured.grad(edge)[0], lay, w)  # (*out)
    wanted = {id(p) for p in group}
    wrt = [k for k, t in enumerate(op.leaves) if id(t) in wanted]
    found: dict[int, Tensor] = {}
    for k, got in zip(wrt, summed_vjp(op, g, wrt)):
        pid = id(op.leaves[k])
        found[pid] = got if pid not in found else found[pid] + got
    return found


def edge_weighted_sum(captured: Captured, edge: Any, lay: Any, group: list, w: Tensor
                      ) -> dict[int, Tensor]:
    """``d/dW <w * G, out>`` for the output at ``edge`` (layout ``lay``) of a module call:
    the gradient of ``group``'s parameters for that output's backprops scaled per
    sample, through the model's graph (which must have been kept)."""
    g = scaled(captured.grad(edge)[0], lay, w)
    grads = torch.autograd.grad([edge.edge], group, [edge.place(g)], retain_graph=True)
    return {id(p): got for p, got in zip(group, grads)}
