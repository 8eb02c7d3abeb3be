"""Pullbacks through ``F.interpolate`` of a tensor computed from parameters alone: BEiT's
relative position table resized to the window, position embeddings interpolated to the
image's size.

Every mode of ``F.interpolate`` is linear in its input, so the per-sample cotangents
``g (n, v, N, C, *out)`` of an output made from a shared input ``(N, C, *in)`` pull
back through one backward of the same call on ``n * v * N`` inputs (zeros: the
vector-Jacobian product does not read the input's values): the cotangents joined along
its first dim, as PyTorch's own backward of the op would take a batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .calls import OpCall
from .spec import Decline, OpSpec, register


def interpolate(call: OpCall, g: Tensor, out: dict) -> None:
    """``y = interpolate(x, ...)`` of a shared ``x (N, C, *in)``: see the module docstring."""
    x = call.arg(0, "input")
    call.only(out, x)
    if not call.shared(x):
        raise Decline("an input paired with the samples")
    n, v = g.shape[:2]
    with torch.enable_grad():
        z = x.new_zeros((n * v * x.shape[0], *x.shape[1:]), dtype=g.dtype).requires_grad_()
        y = F.interpolate(z, *call.args[1:], **call.kwargs)  # (n v N, C, *out)
        (grad,) = torch.autograd.grad(y, z, g.reshape(y.shape))
    out[x].copy_(grad.view(n, v, *x.shape))


INTERPOLATE = register(OpSpec((F.interpolate,), grad=interpolate))
