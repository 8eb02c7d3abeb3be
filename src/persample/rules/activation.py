"""Per-sample gradients of ``nn.PReLU``.

Index conventions: ``n`` sample, ``v`` cotangent, ``c`` channel (dim 1 of the
input), ``s`` all positions after the channel.

``y = max(0, x) + w * min(0, x)`` with one slope per channel (``w`` of shape
``(c,)``, channel dim 1) or one shared slope (``w`` of shape ``(1,)``), so
``grad_w[n, v, c] = sum_s g[n, v, c, s] * min(0, x[n, c, s])``, summed over the
channels too when the slope is shared.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import register_rule


@register_rule(nn.PReLU)
def prelu(layer: nn.PReLU, activations: tuple, backprops: Tensor, out: dict):
    """``out["weight"] (n, v, c)`` (or ``(n, v, 1)``) ``= sum g * min(0, x)`` per slope."""
    if "weight" not in out:
        return
    x = activations[0]  # (n, c, *s), or (n,) with a shared slope
    g = backprops  # (n, v, c, *s)
    if layer.num_parameters > 1 and x.dim() < 2:
        raise ValueError(
            f"PReLU with {layer.num_parameters} slopes got an input of shape {tuple(x.shape)}; "
            "per-sample gradients need a batched input (n, c, *s)"
        )
    n, v = g.shape[:2]
    part = g * x.clamp(max=0).unsqueeze(1)  # (n, v, c, *s)
    dst = out["weight"]  # (n, v, c) or (n, v, 1)
    if layer.num_parameters > 1:
        torch.sum(part.reshape(n, v, layer.num_parameters, -1), dim=3, out=dst)
    else:
        torch.sum(part.reshape(n, v, -1), dim=2, keepdim=True, out=dst)
