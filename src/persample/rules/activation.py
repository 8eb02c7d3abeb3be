"""Per-sample gradients of ``F.prelu``.

Index conventions: ``n`` sample, ``v`` cotangent, ``c`` channel (dim 1 of the
op's input), ``s`` the other positions of a sample.

``y = max(0, x) + w * min(0, x)`` with one slope per channel (``w (c,)``) or one
shared slope (``w (1,)``): ``grad_w[n, v, c] = sum_s g[n, v, c, s] * min(0, x[n, c, s])``,
summed over the channels too when the slope is shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .calls import OpCall
from .spec import Decline, OpSpec, register


def prelu(call: OpCall, g: Tensor, out: dict) -> None:
    """``out[w] (n, v, c)`` (or ``(n, v, 1)``) ``= sum g * min(0, x)`` per slope."""
    x, w = call.arg(0, "input"), call.arg(1, "weight")
    call.only(out, w)
    if w not in out:
        return
    if call.shared(x) or x in out:
        raise Decline("a shared input, or the input is a parameter")
    xf = call.front(x)  # (n, *per_sample): the op's batch dim, channels at 1
    n, v = g.shape[:2]
    part = g * xf.clamp(max=0).unsqueeze(1)  # (n, v, *per_sample)
    dst = out[w]
    if w.numel() == 1:
        torch.sum(part.reshape(n, v, -1), dim=2, keepdim=True, out=dst.view(n, v, 1))
    elif part.dim() < 4:
        raise Decline("per-channel slopes on an input without channels")
    else:
        channels = part.movedim(3, 2).reshape(n, v, w.numel(), -1)
        torch.sum(channels, dim=3, out=dst)


PRELU = register(OpSpec((F.prelu,), grad=prelu))
