"""Per-sample gradients of ``nn.Linear``.

Index conventions: ``n`` sample, ``t`` position inside a sample (all dims between
the batch and the features, flattened; ``T = 1`` for a plain ``(n, i)`` input),
``i`` input feature, ``o`` output feature.

Goodfellow (2015), "Efficient per-example gradient computations"; seed 004:
``grad_W[n] = sum_t g[n, t, :] outer a[n, t, :]``, ``grad_b[n] = sum_t g[n, t, :]``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import register_rule


def as_sequences(x: Tensor) -> Tensor:
    """``(n, *, f) -> (n, t, f)``; a view wherever the layout allows."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


@register_rule(nn.Linear)
def linear(layer: nn.Linear, activations: tuple, backprops: Tensor, out: dict[str, Tensor]):
    a = activations[0]  # (n, *, i)
    g = backprops  # (n, *, o)
    if "weight" in out:
        dst = out["weight"]  # (n, o, i)
        if a.dim() == 2:
            # T = 1: an outer product per sample, written straight into dst.
            torch.mul(g.unsqueeze(2), a.unsqueeze(1), out=dst)
        else:
            a3, g3 = as_sequences(a), as_sequences(g)  # (n, t, i), (n, t, o)
            torch.bmm(g3.transpose(1, 2), a3, out=dst)
    if "bias" in out:
        if g.dim() == 2:
            out["bias"].copy_(g)
        else:
            torch.sum(as_sequences(g), dim=1, out=out["bias"])  # (n, o)
