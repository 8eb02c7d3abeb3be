"""Per-sample gradients of ``nn.Linear``.

Index conventions: ``n`` sample, ``v`` cotangent (1 for a loss gradient; the
output index for a parameter Jacobian), ``t`` position inside a sample (all dims
between the batch and the features, flattened; ``T = 1`` for an ``(n, i)``
input), ``i`` input feature, ``o`` output feature.

Goodfellow (2015), "Efficient per-example gradient computations"; seed 004:
``grad_W[n, v] = sum_t g[n, v, t, :] outer a[n, t, :]`` and
``grad_b[n, v] = sum_t g[n, v, t, :]``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import register_rule


@register_rule(nn.Linear)
def linear(layer: nn.Linear, activations: tuple, backprops: Tensor, out: dict[str, Tensor]):
    n, v = backprops.shape[:2]
    a = activations[0].reshape(n, -1, layer.in_features)  # (n, t, i)
    g = backprops.reshape(n, v, -1, layer.out_features)  # (n, v, t, o)
    if "weight" in out:
        dst = out["weight"]  # (n, v, o, i)
        if a.shape[1] == 1:
            # T = 1: an outer product per sample and cotangent, written straight into dst.
            torch.mul(g.transpose(2, 3), a.unsqueeze(1), out=dst)  # (n,v,o,1) * (n,1,1,i)
        elif v == 1:
            torch.bmm(g[:, 0].transpose(1, 2), a, out=dst[:, 0])  # (n, o, t) @ (n, t, i)
        else:
            torch.matmul(g.transpose(2, 3), a.unsqueeze(1), out=dst)  # (n, v, o, i)
    if "bias" in out:
        torch.sum(g, dim=2, out=out["bias"])  # (n, v, o)
