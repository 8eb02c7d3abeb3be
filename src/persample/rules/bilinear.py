"""Per-sample gradients of ``nn.Bilinear``.

Index conventions: ``n`` sample, ``v`` cotangent, ``t`` position inside a sample
(all dims between the batch and the features, flattened; ``T = 1`` for
``(n, i)`` inputs), ``i`` and ``j`` the features of the two inputs, ``o`` output
feature.

``y[n, t, o] = sum_ij x1[n, t, i] W[o, i, j] x2[n, t, j] + b[o]``, a Linear layer
on the outer product ``z[n, t] = x1[n, t] outer x2[n, t]`` (``i*j`` features), so
``grad_W[n, v] = sum_t g[n, v, t, :] outer z[n, t, :]`` and
``grad_b[n, v] = sum_t g[n, v, t, :]``.

Norm rule ("ghost norm", as for Linear): ``|grad_W[n]|^2 = |g|^2 |x1|^2 |x2|^2`` for
``T = 1``, and ``sum_{t,s} (g_t . g_s)(x1_t . x1_s)(x2_t . x2_s)`` for ``T > 1``
when ``T^2 (o + i + j)`` is below the ``T o i j`` of materialising.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import register_norm_rule, register_rule
from .linear import outer_into


def _as_matrices(dst: Tensor) -> tuple[Tensor, bool]:
    """``dst (n, v, o, i, j)`` as ``(n, v, o, i*j)``: a view, or a new tensor to copy back."""
    n, v, o, i, j = dst.shape
    try:
        return dst.view(n, v, o, i * j), False
    except RuntimeError:
        return dst.new_empty(n, v, o, i * j), True


@register_rule(nn.Bilinear)
def bilinear(layer: nn.Bilinear, activations: tuple, backprops: Tensor, out: dict[str, Tensor]):
    """Inputs ``(n, *s, i)``, ``(n, *s, j)``, backprops ``(n, v, *s, o)``: the Linear rule
    on the outer products ``z (n, t, i*j)``."""
    n, v = backprops.shape[:2]
    g = backprops.reshape(n, v, -1, layer.out_features)  # (n, v, t, o)
    if "weight" in out:
        x1 = activations[0].reshape(n, -1, layer.in1_features)  # (n, t, i)
        x2 = activations[1].reshape(n, -1, layer.in2_features)  # (n, t, j)
        z = (x1.unsqueeze(3) * x2.unsqueeze(2)).flatten(2)  # (n, t, i*j)
        dst, copy = _as_matrices(out["weight"])  # (n, v, o, i*j)
        if z.shape[1] == 1:
            outer_into(g[:, :, 0], z[:, 0], dst)
        elif v == 1:
            torch.bmm(g[:, 0].transpose(1, 2), z, out=dst[:, 0])  # (n, o, t) @ (n, t, i*j)
        else:
            torch.matmul(g.transpose(2, 3), z.unsqueeze(1), out=dst)  # (n, v, o, i*j)
        if copy:
            out["weight"].copy_(dst.view(out["weight"].shape))
    if "bias" in out:
        torch.sum(g, dim=2, out=out["bias"])  # (n, v, o)


@register_norm_rule(nn.Bilinear)
def bilinear_norm(layer: nn.Bilinear, activations: tuple, backprops: Tensor, names: set[str]):
    """Squared per-sample gradient norms ``{name: (n,)}`` without the ``(n, o, i, j)``
    gradients, or ``None`` when materialising them is cheaper."""
    n = backprops.shape[0]
    g = backprops.reshape(n, -1, layer.out_features)  # (n, t, o)
    found = {}
    if "weight" in names:
        x1 = activations[0].reshape(n, -1, layer.in1_features)  # (n, t, i)
        x2 = activations[1].reshape(n, -1, layer.in2_features)  # (n, t, j)
        t = g.shape[1]
        sizes = (layer.out_features, layer.in1_features, layer.in2_features)
        if t == 1:
            found["weight"] = (g.square().sum((1, 2)) * x1.square().sum((1, 2))
                               * x2.square().sum((1, 2)))
        elif t * sum(sizes) <= sizes[0] * sizes[1] * sizes[2]:
            grams = [torch.bmm(a, a.transpose(1, 2)) for a in (g, x1, x2)]  # 3 x (n, t, t)
            found["weight"] = (grams[0] * grams[1] * grams[2]).sum((1, 2))
        else:
            return None
    if "bias" in names:
        found["bias"] = g.sum(1).square().sum(1)  # (n,)
    return found
