"""``torch.addcmul``: ``y = input + value * tensor1 * tensor2``, a scale and a shift in one
op (``torch.addcmul(shift, x, scale)``, as adaptive normalisation layers write it).

Index conventions: ``n`` sample, ``v`` cotangent, ``*s`` the output's per-sample shape.
With ``g (n, v, *s)`` the backprops of ``y``, each sample's gradient is the product of
its backprops with the other operand, summed over the dims the parameter was broadcast
over (the per-example gradients of Goodfellow, "Efficient per-example gradient
computations", 2015, for an elementwise op)::

    grad_input[n, v]   = sum_{broadcast} g[n, v]
    grad_tensor1[n, v] = sum_{broadcast} value * g[n, v] * tensor2[n]
    grad_tensor2[n, v] = sum_{broadcast} value * g[n, v] * tensor1[n]
"""

from __future__ import annotations

import torch
from torch import Tensor

from .calls import OpCall, operand, write_reduced
from .spec import Decline, OpSpec, register


def addcmul(call: OpCall, g: Tensor, out: dict[Tensor, Tensor]) -> None:
    """``g (n, v, *s)`` -> ``out[t] (n, v, *shape)`` for the parameter inputs ``t``."""
    x, a, b = call.arg(0, "input"), call.arg(1, "tensor1"), call.arg(2, "tensor2")
    value = call.arg(3, "value", 1)
    call.only(out, x, a, b)
    operands = [t for t in (x, a, b) if isinstance(t, Tensor)]
    if any(t in out and sum(u is t for u in operands) > 1 for t in operands):
        raise Decline("a parameter read twice")  # the engine takes the op's exact VJP
    rank = g.dim() - 2
    wanted = [(x, lambda: g),
              (a, lambda: value * g * operand(call, b, rank)),
              (b, lambda: value * g * operand(call, a, rank))]
    for t, grad in wanted:
        if isinstance(t, Tensor) and t in out:
            write_reduced(call, out, t, grad())


ADDCMUL = register(OpSpec((torch.addcmul,), grad=addcmul))
