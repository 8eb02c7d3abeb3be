"""Sums of outer products: the per-sample weight gradient of a linear map applied at
``t`` positions, written straight into its destination, for every rule family whose
gradient has that form (linear maps, convolutions over their patches, the recurrent
weights).

Index conventions: ``n`` sample, ``v`` cotangent, ``t`` position, ``i`` input feature,
``o`` output feature. Goodfellow (2015), "Efficient per-example gradient computations":
``grad_W[n, v] = sum_t g[n, v, t] outer a[n, t]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .ghost import Factors, inner

# Measured on a 2-core x86 CPU (persample bench): an elementwise outer product
# writes at fill_ speed when each (sample, cotangent) block starts on a 64-byte
# boundary, and about 1.5x slower when not; bmm with k = 1 loses less to
# misalignment but has a high cost per block, so it only pays for big blocks.
_BMM_MIN_BLOCK = 1 << 18


def _cache_aligned(dst: Tensor) -> bool:
    step = 64 // dst.element_size() or 1
    return dst.data_ptr() % 64 == 0 and all(s % step == 0 for s in dst.stride()[:-2])


def outer_into(g: Tensor, a: Tensor, dst: Tensor) -> None:
    """``dst[n, v] = outer(g[n, v], a[n])``; ``g (n, v, o)``, ``a (n, i)``, ``dst (n, v, o, i)``."""
    n, v, o = g.shape
    if v == 1 and not _cache_aligned(dst) and dst[0, 0].numel() >= _BMM_MIN_BLOCK:
        torch.bmm(g.view(n, o, 1), a.unsqueeze(1), out=dst[:, 0])  # (n, o, 1) @ (n, 1, i)
    else:
        torch.mul(g.unsqueeze(3), a.view(n, 1, 1, -1), out=dst)  # (n,v,o,1) * (n,1,1,i)


def sum_outer_into(g: Tensor, a: Tensor, dst: Tensor) -> None:
    """``dst[n, v] = sum_t outer(g[n, v, t], a[n, t])``; ``g (n, v, t, o)``, ``a (n, t, i)``
    or shared ``(t, i)``, ``dst (n, v, o, i)`` (a view of the result is fine). The
    per-sample weight gradient of any linear map applied at ``t`` positions."""
    if a.dim() == 2:  # shared by all samples
        torch.matmul(g.transpose(2, 3), a, out=dst)  # (n, v, o, t) @ (t, i)
    elif a.shape[1] == 1:
        outer_into(g[:, :, 0], a[:, 0], dst)
    elif g.shape[1] == 1:
        torch.bmm(g[:, 0].transpose(1, 2), a, out=dst[:, 0])  # (n, o, t) @ (n, t, i)
    else:
        torch.matmul(g.transpose(2, 3), a.unsqueeze(1), out=dst)  # (n, v, o, i)


APART = 1 << 20
"""On the CPU a product of at most this many entries is made apart and then added (see
:func:`add_product`)."""


def add_product(into: Tensor, m1: Tensor, m2: Tensor, alpha: float = 1) -> None:
    """``into += alpha * m1 @ m2``; a product in a lower precision than ``into`` (an op
    under autocast: its GEMM runs in bfloat16 as autograd's would) is added after. So is,
    on the CPU, one of at most :data:`APART` entries: a GEMM that adds onto memory out of
    the cache (a DP step's sums, filled with the noise before the first layer's sum)
    took 1.5-1.8x the time of the same product into a fresh temporary and an add (50
    layers of 300 x 300, one thread: 21-25 against 13 ms)."""
    if m1.dtype == into.dtype and (into.device.type != "cpu" or into.numel() > APART):
        into.addmm_(m1, m2, alpha=alpha)
    else:
        into.add_(m1 @ m2, alpha=alpha)


def ghost_norm(a: Tensor, g: Tensor) -> Tensor | None:
    """``|sum_t g_t outer a_t|^2`` per sample for ``a (n, t, i)``, ``g (n, t, o)``, or
    ``None`` when materialising is cheaper (``n T^2 (i + o)`` against ``n T i o``). The
    ``(n, t, t)`` grams are made in blocks of positions (``rules.ghost``)."""
    t, i, o = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        return a.square().sum((1, 2)) * g.square().sum((1, 2))
    if t * (i + o) <= i * o:
        one = Factors(g, a)
        return inner(one, one)
    return None
