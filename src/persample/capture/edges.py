"""Where the gradient of a recorded output is read: the autograd edge of the node that
produced it, taken right after the op.

That edge stays valid when the output is later modified in place
(``nn.ReLU(inplace=True)``, ``out += identity``), which a tensor kept in a hook does not.
An output that is a view of a non-leaf base (``F.linear`` on a sequence returns one) is
read through its base's edge and its place in the base's storage: an in-place op
through another view of the base later re-bases the view's own node out of the graph,
never the base's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass(frozen=True, eq=False)
class Edge:
    """The gradient edge of a recorded output, and for a view of a non-leaf base the
    geometry that maps the base's gradient to the view's.

    Attributes:
        edge: the autograd edge (of the output, or of its base).
        view: ``((base shape, base stride, span), (shape, stride, offset))`` for a view,
            else ``None``.
    """

    edge: GradientEdge
    view: tuple | None = None

    def take(self, g: Tensor) -> Tensor:
        """``(v, *base.shape)`` gradients of the base -> ``(v, *output.shape)``."""
        if self.view is None:
            return g
        (base_shape, base_stride, span), (shape, stride, offset) = self.view
        v = g.shape[0]
        if offset == 0 and _row_major(base_shape, base_stride) and _row_major(shape, stride) \
                and math.prod(shape) == math.prod(base_shape):
            return g.reshape((v, *shape))  # a reshape of the whole base (F.linear's view)
        flat = g.new_zeros((v, span))
        flat.as_strided((v, *base_shape), (span, *base_stride)).copy_(g)
        return flat.as_strided((v, *shape), (span, *stride), offset)

    def place(self, g: Tensor) -> Tensor:
        """The inverse for one cotangent: ``g (*output.shape)`` into a base-shaped zero."""
        if self.view is None:
            return g
        (base_shape, base_stride, span), (shape, stride, offset) = self.view
        flat = g.new_zeros(span)
        flat.as_strided(shape, stride, offset).copy_(g)
        return flat.as_strided(base_shape, base_stride).clone()


def _row_major(shape: tuple, stride: tuple) -> bool:
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def edge_of(t: Tensor) -> Edge | None:
    """Where ``t``'s gradient, at its current version, will be read (``None`` without
    autograd).

    Examples:
        >>> import torch
        >>> w = torch.ones(3, requires_grad=True)
        >>> y = (w * 2).view(3, 1)
        >>> e = edge_of(y)
        >>> e.view is not None, tuple(e.take(torch.ones(1, 3)).shape)
        (True, (1, 3, 1))
    """
    if not t.requires_grad:
        return None
    base = t._base
    try:
        if base is None or base.grad_fn is None:
            return Edge(get_gradient_edge(t))
        start = base.storage_offset()
        span = 1 + sum((size - 1) * stride for size, stride in zip(base.shape, base.stride()))
        geometry = ((tuple(base.shape), tuple(base.stride()), max(span, 1)),
                    (tuple(t.shape), tuple(t.stride()), t.storage_offset() - start))
        return Edge(get_gradient_edge(base), geometry)
    except (RuntimeError, AssertionError):  # (a view made under no_grad has no edge)
        return None
