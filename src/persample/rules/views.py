"""Pullbacks through shape ops on tensors computed from parameters: ``W.t()``,
``x.transpose``, ``permute``, ``view``/``reshape``, ``unsqueeze``, casts, ``repeat``, and
the triangles ``triu``/``tril`` (which keep entries in place), and the values of a
sparse COO tensor (placed at its indices).

These ops only move entries, so the per-sample cotangent of their output maps to
their input by the inverse move, on the trailing dims of ``g (n, v, *shape)``:
whether ``shape`` is the whole output (a tensor shared by the samples) or one
sample's slice of it (an output paired with the samples, DeBERTa's relative keys
``repeat``-ed to ``(B*H, ...)``: the engine then pairs the input the same way,
checked by the op's data-flow rule).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .calls import OpCall
from .spec import Decline, OpSpec, register


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _input(call: OpCall, out: dict) -> Tensor:
    """The one tensor the op moves; another tensor it reads only for its shape, dtype or
    device (``reshape_as(w)``, ``type_as(w)``, ``to(w)``: NFNet's standardised weight
    ``batch_norm(w.reshape(1, C, -1)).reshape_as(w)``) gets a zero cotangent."""
    x = call.args[0] if call.args else call.kwargs.get("input")
    if not isinstance(x, Tensor) or x not in out:
        raise Decline("not one tensor")
    if len(out) > 1:
        if call.func not in _REFERENCES:
            raise Decline("not one tensor")
        for key, dst in out.items():
            if key is not x:
                dst.zero_()
    return x


def transpose(call: OpCall, g: Tensor, out: dict) -> None:
    x = _input(call, out)
    a = _dim(call.arg(1, "dim0"), x.dim())
    b = _dim(call.arg(2, "dim1"), x.dim())
    out[x].copy_(g.transpose(a + 2, b + 2))


def t(call: OpCall, g: Tensor, out: dict) -> None:
    x = _input(call, out)
    out[x].copy_(g.transpose(-1, -2) if x.dim() == 2 else g)


def permute(call: OpCall, g: Tensor, out: dict) -> None:
    x = _input(call, out)
    dims = call.kwargs.get("dims", call.args[1] if len(call.args) == 2 and isinstance(
        call.args[1], (tuple, list)) else call.args[1:])
    order = [_dim(d, x.dim()) for d in dims]
    inverse = [order.index(k) for k in range(len(order))]
    out[x].copy_(g.permute(0, 1, *[k + 2 for k in inverse]))


_REFERENCES = (torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.type_as,
               torch.Tensor.to)
_RESHAPES = (torch.Tensor.view, torch.reshape, torch.flatten, torch.unflatten,
             torch.Tensor.view_as, torch.Tensor.reshape_as, torch.unsqueeze, torch.squeeze,
             torch.Tensor.contiguous, torch.clone, torch.Tensor.to, torch.Tensor.type_as,
             torch.Tensor.float, torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16)


def reshape(call: OpCall, g: Tensor, out: dict) -> None:
    """Reshapes and casts: the same entries in row-major order."""
    if (call.func is torch.Tensor.view and len(call.args) == 2
            and isinstance(call.args[1], torch.dtype)):
        raise Decline("a view as another dtype")
    x = _input(call, out)
    dst = out[x]
    if dst[0, 0].numel() != g[0, 0].numel():
        raise Decline("the sample's part changed size")
    dst.copy_(g.reshape(dst.shape))


def repeat(call: OpCall, g: Tensor, out: dict) -> None:
    """``x.repeat(...)`` whose output is paired with the samples, each sample's slice
    whole copies of ``x`` (DeBERTa's ``pos_key.repeat(B, 1, 1)``; ViTMAE's mask token
    ``repeat(B, masked, 1)``): a sample's cotangent summed over its copies."""
    x = _input(call, out)
    if not call.shared(x):
        raise Decline("not a shared tensor repeated")
    n, v = g.shape[:2]
    part, whole = tuple(g.shape[2:]), tuple(call.op.outputs[0].shape)  # a sample's, all
    tile = (1,) * (len(part) - x.dim()) + tuple(x.shape)
    if len(part) < x.dim() or not _whole_copies(part, whole, tile, call.out_pairing):
        raise Decline("a repeat whose sample slices are not whole copies")
    copies = g.reshape(n, v, *[k for p, t in zip(part, tile) for k in (p // t, t)])
    summed = copies.sum([2 + 2 * d for d in range(len(part))])  # (n, v, *tile)
    out[x].copy_(summed.reshape(n, v, *x.shape))


def transposed(call: OpCall, g: Tensor, out: dict) -> None:
    """The properties ``x.mT``, ``x.mH`` (the last two dims swapped; a real tensor's
    conjugate is itself), ``x.T`` and ``x.H`` (every dim reversed)."""
    x = _input(call, out)
    last_two = call.func.__self__.__name__ in ("mT", "mH")
    if x.dim() < 2:
        out[x].copy_(g)
    elif last_two or x.dim() == 2:
        out[x].copy_(g.transpose(-1, -2))
    else:
        out[x].copy_(g.permute(0, 1, *range(x.dim() + 1, 1, -1)))


def triangle(call: OpCall, g: Tensor, out: dict) -> None:
    """``triu``/``tril(x, diagonal)`` of a tensor whose matrix dims hold no samples (an
    orthogonal parametrization's reflectors, a symmetric weight ``X.triu() +
    X.triu(1).mT``): the cotangent kept on the same triangle of each matrix."""
    x = _input(call, out)
    lay = call.pairing(x)
    if lay is not None and lay.dim >= x.dim() - 2:
        raise Decline("the samples in the matrix dims")
    upper = "triu" in call.func.__name__  # (not ``out=``: into a strided view of a flat
    # result, triu's and tril's ``out=`` write entries elsewhere)
    out[x].copy_((torch.triu if upper else torch.tril)(g, call.arg(1, "diagonal", 0)))


def sparse_values(call: OpCall, g: Tensor, out: dict) -> None:
    """``sparse_coo_tensor(indices, values, size)`` of values shared by the samples (a
    sparse update of a weight: peft's ShiRA): stored value ``k`` is the entry at
    ``indices[:, k]``, so its cotangent is the output's there, ``g[:, :, *indices]``
    ``(n, v, nnz, *dense)`` (a value stored twice gets the entry's twice, as autograd
    gives it)."""
    indices = call.arg(0, "indices")
    values = call.arg(1, "values")
    if not isinstance(values, Tensor) or values not in out or len(out) > 1 or not (
            call.shared(values) and isinstance(indices, Tensor)):
        raise Decline("not the values of one shared sparse tensor")
    g = g.to_dense() if g.layout != torch.strided else g
    out[values].copy_(g[(slice(None), slice(None), *indices.to(g.device))])


def _whole_copies(part: tuple, whole: tuple, tile: tuple, lay: Any) -> bool:
    """Is a sample's slice ``part`` of a repeat's output ``whole`` made of whole copies of
    ``tile``: every dim a multiple of it, the dims other than the paired one whole, and
    along the paired dim each block of a sample's positions (``inner`` of them) whole
    copies (``lay``: the output's pairing, ``None`` where it is not paired)?"""
    if any(p % t for p, t in zip(part, tile)):
        return False
    if any(p != w for d, (p, w) in enumerate(zip(part, whole)) if lay is None or d != lay.dim):
        return False
    return lay is None or (lay.index is None and lay.inner % tile[lay.dim] == 0)


# (their rules read shapes only: an input written in place after they ran, DeBERTa's
# projection of its position table divided in place through its heads' view, is no concern)
TRANSPOSE = register(OpSpec((torch.transpose,), grad=transpose, reads_inputs=False))
T = register(OpSpec((torch.t,), grad=t, reads_inputs=False))
PERMUTE = register(OpSpec((torch.permute,), grad=permute, reads_inputs=False))
RESHAPE = register(OpSpec(_RESHAPES, grad=reshape, reads_inputs=False))
REPEAT = register(OpSpec((torch.Tensor.repeat,), grad=repeat, reads_inputs=False))
TRIANGLE = register(OpSpec((torch.triu, torch.tril), grad=triangle, reads_inputs=False))
SPARSE_VALUES = register(OpSpec((torch.sparse_coo_tensor,), grad=sparse_values,
                                reads_inputs=False))
TRANSPOSED = register(OpSpec(tuple(getattr(torch.Tensor, name).__get__
                                   for name in ("mT", "mH", "T", "H")), grad=transposed,
                             reads_inputs=False))
