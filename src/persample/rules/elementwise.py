"""Per-sample gradients of parameters entering an elementwise op or a concatenation:
a scale (``x * gamma``: hand-written RMSNorm classes, T5's ``LayerNorm``, LayerScale),
a shift (``x + pos``, ``scores + bias``, a bias added by hand), a division, and
``torch.cat`` (a class token joined to the patches).

Index conventions: ``n`` sample, ``v`` cotangent, ``*s`` the output's per-sample
shape. With ``g (n, v, *s)`` the backprops of ``y = x * w``, ``grad_w[n, v] =
sum_{broadcast} g * x``: the product summed over the dims ``w`` is broadcast over
(``w`` shared by all samples: its own shape; ``w`` paired with the samples, as a
class token expanded to the batch: its per-sample shape). ``y = x + w`` gives
``sum_{broadcast} g``. In-place forms (``x.mul_(gamma)``, ``scores += bias``) read
the value ``x`` had before the op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import OpCall, register_op_rule


def reduce_to(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t (n, v, *s)`` summed over the dims broadcasting gave it beyond ``shape``:
    ``(n, v, *shape)``."""
    extra = t.dim() - 2 - len(shape)
    dims = list(range(2, 2 + extra)) + [
        2 + extra + k for k, size in enumerate(shape) if size == 1 and t.shape[2 + extra + k] != 1]
    if dims:
        t = t.sum(dims, keepdim=True)
    return t.reshape(*t.shape[:2], *shape)


def _target(call: OpCall, p: Tensor) -> tuple[int, ...]:
    """The shape of ``p``'s per-sample cotangent: its own, or per sample when paired."""
    return tuple(p.shape) if call.shared(p) else tuple(call.front(p).shape[1:])


def operand(call: OpCall, x, rank: int):
    """``x`` broadcastable against ``g (n, v, *s)`` with ``len(s) == rank``."""
    if not isinstance(x, Tensor):
        return x
    if call.shared(x):
        return x.detach()
    xf = call.front(x)  # (n, *per_sample)
    return xf.view(xf.shape[0], 1, *[1] * (rank - (xf.dim() - 1)), *xf.shape[1:])


def _two(call: OpCall) -> tuple:
    """The two operands in the op's own order (``__r*__`` methods swap them)."""
    name = getattr(call.func, "__name__", "")
    a = call.arg(0, "input")
    b = call.arg(1, "other")
    return (b, a) if name.startswith("__r") else (a, b)


def write_reduced(call: OpCall, out: dict, p, value: Tensor) -> None:
    """``value (n, v, *s)`` summed over the dims ``p`` was broadcast over, into ``p``'s
    result (``p``'s own shape, or its per-sample shape where the op pairs it)."""
    out[p].copy_(reduce_to(value, _target(call, p)))


_MUL = [torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply, torch.Tensor.mul_,
        torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__imul__]


@register_op_rule(*_MUL)
def mul(call: OpCall, g: Tensor, out: dict) -> str | None:
    """``y = a * b``: ``grad_a = sum g * b``, ``grad_b = sum g * a``."""
    a, b = _two(call)
    if a is b or call.only(out, a, b):
        return "the same tensor on both sides, or other inputs"
    rank = g.dim() - 2
    for p, other in ((a, b), (b, a)):
        if isinstance(p, Tensor) and p in out:
            write_reduced(call, out, p, g * operand(call, other, rank))
    return None


ADD_OPS = {  # op -> the sign of its second operand
    torch.add: 1, torch.Tensor.add: 1, torch.Tensor.add_: 1, torch.Tensor.__add__: 1,
    torch.Tensor.__radd__: 1, torch.Tensor.__iadd__: 1, torch.sub: -1, torch.subtract: -1,
    torch.Tensor.sub: -1, torch.Tensor.sub_: -1, torch.Tensor.subtract: -1,
    torch.Tensor.__sub__: -1, torch.Tensor.__rsub__: -1, torch.Tensor.__isub__: -1}


@register_op_rule(*ADD_OPS)
def add(call: OpCall, g: Tensor, out: dict) -> str | None:
    """``y = a + alpha * b`` (``a - alpha * b``): ``grad_a = sum g``, ``grad_b = +-alpha sum g``."""
    a, b = _two(call)
    if a is b or call.only(out, a, b):
        return "the same tensor on both sides, or other inputs"
    alpha = call.kwargs.get("alpha", 1)
    sign = ADD_OPS[call.func]
    for p, scale in ((a, 1), (b, sign * alpha)):
        if isinstance(p, Tensor) and p in out:
            write_reduced(call, out, p, g if scale == 1 else g * scale)
    return None


_DIV = [torch.div, torch.divide, torch.true_divide, torch.Tensor.div, torch.Tensor.div_,
        torch.Tensor.divide, torch.Tensor.true_divide, torch.Tensor.__truediv__,
        torch.Tensor.__rtruediv__, torch.Tensor.__itruediv__]


@register_op_rule(*_DIV)
def div(call: OpCall, g: Tensor, out: dict) -> str | None:
    """``y = a / b``: ``grad_a = sum g / b``, ``grad_b = -sum g a / b^2``."""
    if call.kwargs.get("rounding_mode") is not None:
        return "a rounding division"
    a, b = _two(call)
    if a is b or call.only(out, a, b):
        return "the same tensor on both sides, or other inputs"
    rank = g.dim() - 2
    af, bf = operand(call, a, rank), operand(call, b, rank)
    if isinstance(a, Tensor) and a in out:
        write_reduced(call, out, a, g / bf)
    if isinstance(b, Tensor) and b in out:
        write_reduced(call, out, b, -g * af / (bf * bf))
    return None


@register_op_rule(torch.cat, torch.concat, torch.concatenate)
def cat(call: OpCall, g: Tensor, out: dict) -> str | None:
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
            part = g.narrow(2 + dim, start, size)
            out[t].copy_(reduce_to(part, _target(call, t)))
        start += size
    return None


@register_op_rule(torch.Tensor.expand, torch.broadcast_to, torch.Tensor.broadcast_to,
                  torch.Tensor.expand_as)
def expand(call: OpCall, g: Tensor, out: dict) -> str | None:
    """``y = x.expand(...)`` (a class token ``cls.expand(B, -1, -1)``): ``grad_x`` is ``g``
    summed over the expanded dims, for each sample's slice or the whole output."""
    x = call.args[0]
    if x not in out or not call.shared(x) or call.only(out, x):
        return "not a shared tensor expanded"
    out[x].copy_(reduce_to(g, tuple(x.shape)))
    return None
