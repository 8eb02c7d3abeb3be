"""The data flow of one captured forward, kept so that the next capture of the same call
need not decide it again.

A training loop calls the same model with the same shapes thousands of times, and the
layouts of its tensors come out the same each time. A capture's *tape* keeps, for every
op it saw (in order), a :class:`Step` (``None`` for an op decided at every call): the
function, the op's arguments other than tensors (dims, slices, flags), the layout,
shape, dtype and requires-grad of each tensor it read, and the layouts the data flow
gave its outputs. The data flow (:func:`persample.batch.flow.propagate`) is a function
of exactly these, so a later capture given the tape
(:class:`persample.capture.Capture`'s ``tape``) takes an op's layouts from its step
wherever the op at that place matches it in all of them, and decides them itself
wherever it does not (another path through the model's code, other shapes, another
layout): a step never answers for an op it does not match.

Decided again at every call (no step): ops reading a parameter or a tensor derived from
one (recorded for the rules at every call), random ops (their numbers are drawn anew),
in-place ops, ops whose data flow may read values (any integer or boolean tensor among
their inputs: indices, masks, ids), strides (``as_strided``) or the tensors a layout
holds (a packed batch's sample ids, a sorted dim's keys, the rows a scatter wrote: no
step keeps a tensor), ops of the loss that mix samples, and ops with an argument of a
type other than plain values (numbers, strings, slices, dtypes, devices, sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..batch import Batched, Flow, Mixed, Shared, Unknown
from ..batch.flow import reads_layouts_only

_PLAIN = frozenset((int, float, bool, str, type(None), type(Ellipsis), torch.dtype,
                    torch.device, torch.memory_format, torch.layout))
_TENSOR = object()  # a tensor's place in an op's arguments (checked through its leaves)


class Opaque(Exception):
    """An argument a step cannot compare across calls."""


def arguments_key(args: tuple, kwargs: dict) -> tuple:
    """An op's arguments other than tensors, comparable across calls; raises
    :class:`Opaque` for any argument whose type is not a plain value.

    Examples:
        >>> import torch
        >>> x = torch.zeros(2, 3)
        >>> arguments_key((x, 1, slice(0, 2)), {}) == arguments_key((x, 1, slice(0, 2)), {})
        True
        >>> arguments_key((x, 1), {}) == arguments_key((x, 0), {})
        False
    """
    return _key(args), (tuple((k, _key(v)) for k, v in kwargs.items()) if kwargs else ())


def _key(x: Any) -> Any:
    kind = type(x)
    if kind in _PLAIN:
        return kind, x  # (1, 1.0 and True compare equal: their types tell them apart)
    if isinstance(x, Tensor):
        return _TENSOR
    if kind is tuple or kind is list or kind is torch.Size:
        return kind, tuple(_key(v) for v in x)
    if kind is slice:
        return slice, _key(x.start), _key(x.stop), _key(x.step)
    raise Opaque(kind.__name__)


@dataclass(frozen=True, eq=False)
class Step:
    """One op as it ran, whose data flow a later capture may take (see the module
    docstring; an op decided at every call has no step)."""

    func: Any
    key: tuple  # arguments_key of its arguments
    reads: tuple  # per leaf: (layout, shape, dtype, requires_grad)
    outs: tuple  # per output tensor: (shape, dtype)
    flow: Flow  # its outputs' layouts (and pairing)


def reads_of(leaves: list[Tensor], layouts: list) -> tuple:
    """Each leaf's layout, shape, dtype and whether it requires grad."""
    return tuple((lay, t.shape, t.dtype, t.requires_grad) for t, lay in zip(leaves, layouts))


def outs_of(out: Any) -> tuple | None:
    """``(shape, dtype)`` of each output tensor (a tensor, or a tuple/list of them);
    ``None`` for an output of another form."""
    if isinstance(out, Tensor):
        return ((out.shape, out.dtype),)
    if isinstance(out, (tuple, list)):
        return tuple((o.shape, o.dtype) for o in out if isinstance(o, Tensor))
    return None


def reusable(func: Any, flow: Flow, layouts: list, leaves: list[Tensor]) -> bool:
    """Can this op's data flow be taken from its step at a later call? Not where it may
    read values (an integer or boolean input, a sparse matrix's indices, unless the op's
    flow reads layouts alone: :func:`~persample.batch.flow.reads_layouts_only`), where a
    layout holds a tensor (a packed batch's sample ids, the keys of a sorted dim, the
    rows a scatter wrote: layouts other than the plain kinds), or where the op writes
    other inputs."""
    if flow.writes or (any(map(value_leaf, leaves)) and not reads_layouts_only(func, leaves)):
        return False
    outs = flow.outputs if isinstance(flow.outputs, tuple) else (flow.outputs,)
    return all(_plain(lay) for lay in outs + tuple(flow.pairing or ()) + tuple(layouts))


def value_leaf(t: Tensor) -> bool:
    """Does a data-flow decision read this input's values (an index, a mask: integer or
    boolean; a sparse matrix, by its indices)?"""
    return not (t.is_floating_point() or t.is_complex()) or t.is_sparse


def _plain(lay: Any) -> bool:
    """A layout that holds no tensor: shared, mixed, unknown, or batched by position."""
    if lay is None or type(lay) in (Shared, Mixed, Unknown):
        return True
    return type(lay) is Batched and lay.index is None
