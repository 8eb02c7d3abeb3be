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

from . import register_norm_rule, register_rule

# Measured on a 2-core x86 CPU (persample bench): an elementwise outer product
# writes at fill_ speed when each (sample, cotangent) block starts on a 64-byte
# boundary, and about 1.5x slower when not; bmm with k = 1 loses less to
# misalignment but has a high cost per block, so it only pays for big blocks.
_BMM_MIN_BLOCK = 1 << 18


def _aligned(dst: Tensor) -> bool:
    step = 64 // dst.element_size() or 1
    return dst.data_ptr() % 64 == 0 and all(s % step == 0 for s in dst.stride()[:-2])


def outer_into(g: Tensor, a: Tensor, dst: Tensor) -> None:
    """``dst[n, v] = outer(g[n, v], a[n])``; ``g (n, v, o)``, ``a (n, i)``, ``dst (n, v, o, i)``."""
    n, v, o = g.shape
    if v == 1 and not _aligned(dst) and dst[0, 0].numel() >= _BMM_MIN_BLOCK:
        torch.bmm(g.view(n, o, 1), a.unsqueeze(1), out=dst[:, 0])  # (n, o, 1) @ (n, 1, i)
    else:
        torch.mul(g.unsqueeze(3), a.view(n, 1, 1, -1), out=dst)  # (n,v,o,1) * (n,1,1,i)


def sum_outer_into(g: Tensor, a: Tensor, dst: Tensor) -> None:
    """``dst[n, v] = sum_t outer(g[n, v, t], a[n, t])``; ``g (n, v, t, o)``, ``a (n, t, i)``,
    ``dst (n, v, o, i)`` (a view of the result is fine). The per-sample weight gradient
    of any linear map applied at ``t`` positions (Linear on sequences, the gates of a
    recurrent layer, attention's projections)."""
    if a.shape[1] == 1:
        outer_into(g[:, :, 0], a[:, 0], dst)
    elif g.shape[1] == 1:
        torch.bmm(g[:, 0].transpose(1, 2), a, out=dst[:, 0])  # (n, o, t) @ (n, t, i)
    else:
        torch.matmul(g.transpose(2, 3), a.unsqueeze(1), out=dst)  # (n, v, o, i)


@register_rule(nn.Linear)
def linear(layer: nn.Linear, activations: tuple, backprops: Tensor, out: dict[str, Tensor]):
    n, v = backprops.shape[:2]
    a = activations[0].reshape(n, -1, layer.in_features)  # (n, t, i)
    g = backprops.reshape(n, v, -1, layer.out_features)  # (n, v, t, o)
    if "weight" in out:
        sum_outer_into(g, a, out["weight"])  # (n, v, o, i)
    if "bias" in out:
        torch.sum(g, dim=2, out=out["bias"])  # (n, v, o)


@register_norm_rule(nn.Linear)
def linear_norm(layer: nn.Linear, activations: tuple, backprops: Tensor, names: set[str]):
    """Squared per-sample gradient norms without the gradients ("ghost norm").

    ``T = 1``: ``|grad_W[n]|^2 = |a_n|^2 |g_n|^2``. ``T > 1``:
    ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` costs ``n T^2 (i + o)`` against ``n T i o``
    for materialising; the cheaper one is taken (Goodfellow 2015; Lee & Kifer 2021;
    Li et al. 2022).
    """
    n = backprops.shape[0]
    a = activations[0].reshape(n, -1, layer.in_features)  # (n, t, i)
    g = backprops.reshape(n, -1, layer.out_features)  # (n, t, o)
    t = a.shape[1]
    found = {}
    if "weight" in names:
        if t == 1:
            found["weight"] = a.square().sum((1, 2)) * g.square().sum((1, 2))
        elif t * (layer.in_features + layer.out_features) <= layer.in_features * layer.out_features:
            gram_a = torch.bmm(a, a.transpose(1, 2))  # (n, t, t)
            gram_g = torch.bmm(g, g.transpose(1, 2))  # (n, t, t)
            found["weight"] = (gram_a * gram_g).sum((1, 2))
        else:
            return None
    if "bias" in names:
        found["bias"] = g.sum(1).square().sum(1)  # (n,)
    return found
