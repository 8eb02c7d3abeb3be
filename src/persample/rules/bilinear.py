"""Per-sample gradients of ``nn.Bilinear``.

Index conventions: ``n`` sample, ``v`` cotangent, ``t`` position inside a sample
(all dims between the batch and the features, flattened; ``T = 1`` for
``(n, i)`` inputs), ``i`` and ``j`` the features of the two inputs, ``o`` output
feature.

``y[n, t, o] = sum_ij x1[n, t, i] W[o, i, j] x2[n, t, j] + b[o]``, a Linear layer
on the outer product ``z[n, t] = x1[n, t] outer x2[n, t]`` (``i*j`` features), so
``grad_W[n, v] = sum_t g[n, v, t, :] outer z[n, t, :]`` and
``grad_b[n, v] = sum_t g[n, v, t, :]``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import register_rule
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
