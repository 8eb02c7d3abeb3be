"""Per-sample gradients of parameters entering an elementwise op or a concatenation:
a scale (``x * gamma``: hand-written RMSNorm classes, T5's ``LayerNorm``, LayerScale),
a shift (``x + pos``, ``scores + bias``, a bias added by hand), a division, a choice by a
mask (``where(mask, bias, min)``), and ``torch.cat`` (a class token joined to the
patches).

Index conventions: ``n`` sample, ``v`` cotangent, ``*s`` the output's per-sample
shape. With ``g (n, v, *s)`` the backprops of ``y = x * w``, ``grad_w[n, v] =
sum_{broadcast} g * x``: the product summed over the dims ``w`` is broadcast over
(``w`` shared by all samples: its own shape; ``w`` paired with the samples, as a
class token expanded to the batch: its per-sample shape). ``y = x + w`` gives
``sum_{broadcast} g``. In-place forms (``x.mul_(gamma)``, ``scores += bias``) read
the value ``x`` had before the op. Complex tensors (GFNet's global filter, a complex
weight times a spectrum) follow PyTorch's convention: ``g * conj(x)``, and a real ``w``
read by a complex op gets the real part.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .calls import OpCall, operand, write_reduced
from .spec import Decline, OpSpec, register


def _distinct(a, b) -> None:
    if a is b:
        raise Decline("the same tensor on both sides")


def mul(call: OpCall, g: Tensor, out: dict) -> None:
    """``y = a * b``: ``grad_a = sum g * conj(b)``, ``grad_b = sum g * conj(a)``."""
    a, b = call.operands()
    _distinct(a, b)
    call.only(out, a, b)
    rank = g.dim() - 2
    for p, other in ((a, b), (b, a)):
        if isinstance(p, Tensor) and p in out:
            write_reduced(call, out, p, g * operand(call, other, rank))


def shift(call: OpCall, g: Tensor, out: dict, sign: int = 1) -> None:
    """``y = a + alpha * b`` (``sign = -1``: ``a - alpha * b``): ``grad_a = sum g``,
    ``grad_b = sign * alpha * sum g``."""
    a, b = call.operands()
    _distinct(a, b)
    call.only(out, a, b)
    scale = sign * call.kwargs.get("alpha", 1)
    scale = scale.conjugate() if isinstance(scale, complex) else scale
    for p, by in ((a, 1), (b, scale)):
        if isinstance(p, Tensor) and p in out:
            write_reduced(call, out, p, g if by == 1 else g * by)


def subtract(call: OpCall, g: Tensor, out: dict) -> None:
    """``y = a - alpha * b``."""
    shift(call, g, out, sign=-1)


def div(call: OpCall, g: Tensor, out: dict) -> None:
    """``y = a / b``: ``grad_a = sum g / conj(b)``, ``grad_b = -sum g conj(a / b^2)``."""
    if call.kwargs.get("rounding_mode") is not None:
        raise Decline("a rounding division")
    a, b = call.operands()
    _distinct(a, b)
    call.only(out, a, b)
    rank = g.dim() - 2
    af, bf = operand(call, a, rank), operand(call, b, rank)
    if isinstance(a, Tensor) and a in out:
        write_reduced(call, out, a, g / bf)
    if isinstance(b, Tensor) and b in out:
        write_reduced(call, out, b, -g * af / (bf * bf))


def where(call: OpCall, g: Tensor, out: dict) -> None:
    """``y = where(c, a, b)`` (``a.where(c, b)``): ``grad_a = sum g * c``, ``grad_b = sum g
    * not c`` (T5's position bias kept where the mask allows, ``where(mask, bias, min)``)."""
    if len(call.args) + len(call.kwargs) < 3:
        raise Decline("where(condition): indices")
    if call.func is torch.Tensor.where:  # (the tensor it is called on is the input)
        c, a, b = call.arg(1, "condition"), call.args[0], call.arg(2, "other")
    else:
        c, a, b = call.arg(0, "condition"), call.arg(1, "input"), call.arg(2, "other")
    _distinct(a, b)
    call.only(out, a, b)
    keep = operand(call, c, g.dim() - 2)  # (bool, broadcastable against g)
    for p, chosen in ((a, keep), (b, ~keep)):
        if isinstance(p, Tensor) and p in out:
            write_reduced(call, out, p, g * chosen)


def cat(call: OpCall, g: Tensor, out: dict) -> None:
    """``y = cat(tensors, dim)``: each input gets its slice of ``g`` (a class token
    joined to every sample's patches: its per-sample slice)."""
    tensors = call.arg(0, "tensors")
    rank = g.dim() - 2
    dim = call.arg(1, "dim", call.kwargs.get("axis", 0))
    dim = dim + rank if dim < 0 else dim
    start = 0
    for t in tensors:
        if t.dim() == 1 and t.numel() == 0 and rank > 1:  # legacy empty input
            continue
        size = t.shape[dim]
        if t in out:
            write_reduced(call, out, t, g.narrow(2 + dim, start, size))
        start += size


def expand(call: OpCall, g: Tensor, out: dict) -> None:
    """``y = x.expand(...)`` (a class token ``cls.expand(B, -1, -1)``): ``grad_x`` is ``g``
    summed over the expanded dims, for each sample's slice or the whole output."""
    x = call.args[0]
    if x not in out or not call.shared(x):
        raise Decline("not a shared tensor expanded")
    call.only(out, x)
    write_reduced(call, out, x, g)


def broadcast_tensors(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``torch.broadcast_tensors`` (``torch.distributions`` broadcasts its parameters
    with it) as one ``expand`` per input, to the common shape: the same views, each
    then an op with one output, so that a shared tensor widened to the batch (a
    state-independent ``log_std`` beside batched means) is a derived tensor the
    ``expand`` rule pulls back, and the ops that broadcast it anyway read the tensor it
    widens. (A multi-output op has no gradient rule; its per-sample VJP would be
    ``torch.func``'s.)"""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return tuple(t.expand(shape) for t in tensors)


# (complex tensors too: operand() conjugates, write_reduced() keeps a real input's part)
MUL = register(OpSpec((torch.mul,), grad=mul, complex=True))
ADD = register(OpSpec((torch.add,), grad=shift, reads_inputs=False, complex=True))
SUB = register(OpSpec((torch.sub,), grad=subtract, reads_inputs=False, complex=True))
DIV = register(OpSpec((torch.div,), grad=div, complex=True))
WHERE = register(OpSpec((torch.where,), grad=where))
CAT = register(OpSpec((torch.cat,), grad=cat, complex=True))
EXPAND = register(OpSpec((torch.Tensor.expand, torch.broadcast_to, torch.Tensor.expand_as),
                         grad=expand, complex=True))
BROADCAST_TENSORS = register(OpSpec((torch.broadcast_tensors,), expand=broadcast_tensors))
