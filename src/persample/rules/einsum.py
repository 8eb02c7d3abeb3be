"""Per-sample gradients of ``torch.einsum`` with respect to its shared operands.

Index conventions: ``n`` sample, ``v`` cotangent; a sample's tensors keep their batch
dim, of size 1. For ``out = einsum(eq, A, W, ...)``
with the samples in one letter ``b`` of the batched operands and of the output (their
batch dims), the gradient of a shared operand ``W`` (subscripts ``w``, each letter once,
no ``b``) for sample ``n`` is the einsum of the cotangent (subscripts ``b v`` and the
output's others) with every other operand, summed over what ``W`` does not index:
``einsum("bv<out>, <A>, ... -> bv<w>")``. Any subscripts, operands of any rank (a 3-d
expert table ``"bti,hio->btho"``, Transformer-XL's ``"bid,jd->bij"``), ``...`` spelled
out as letters.
"""

from __future__ import annotations

import string

import torch
from torch import Tensor

from ..batch.ops_products import einsum_subscripts
from .calls import OpCall
from .spec import Decline, OpSpec, register


def _operands(call: OpCall) -> tuple[str, list]:
    eq, rest = call.args[0], list(call.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = list(rest[0])
    if not isinstance(eq, str):
        raise Decline("the sublist form of einsum")
    return eq.replace(" ", ""), rest


def einsum(call: OpCall, g: Tensor, out: dict) -> None:
    """``out[W] (n, v, *W.shape)`` for each shared operand ``W`` asked for."""
    eq, operands = _operands(call)
    call.only(out, *operands)
    tensors = [t for t in operands if isinstance(t, Tensor)]
    if len(tensors) != len(operands) or len({id(t) for t in tensors}) != len(tensors):
        raise Decline("an operand that is not a tensor, or one tensor twice")
    try:
        subs, out_subs = einsum_subscripts(eq, [t.dim() for t in tensors])
    except ValueError as err:
        raise Decline(str(err)) from None
    lay = call.op.out_layouts[0]
    if not getattr(lay, "plain", False):
        raise Decline("an output without one plain batch dim")
    b = out_subs[lay.dim]
    free = [c for c in string.ascii_letters if c not in eq and c not in "".join(subs)]
    v, one = free[:2]  # the cotangents; a sample's own batch dim, of size 1
    g_subs = b + v + out_subs.replace(b, one)
    fronted, fronted_subs = [], []
    for t, s in zip(tensors, subs):
        pairing = call.pairing(t)
        if pairing is None:
            if b in s:
                raise Decline("a shared operand indexed by the samples' letter")
        elif not pairing.plain or s[pairing.dim] != b or s.count(b) != 1:
            raise Decline("a batched operand whose batch dim is not the output's")
        fronted.append(call.front(t))
        fronted_subs.append(s if pairing is None else b + s.replace(b, one))
    for k, (t, s) in enumerate(zip(tensors, subs)):
        if t not in out:
            continue
        if call.pairing(t) is not None or len(set(s)) != len(s):
            raise Decline("a batched operand, or a diagonal of a parameter")
        others = [(x, xs) for j, (x, xs) in enumerate(zip(fronted, fronted_subs)) if j != k]
        seen = set(g_subs).union(*(set(xs) for _, xs in others))
        if not set(s) <= seen:
            raise Decline("a parameter dim summed by the op alone")
        terms = ",".join([g_subs] + [xs for _, xs in others])
        got = torch.einsum(f"{terms}->{b}{v}{s}", g, *(x for x, _ in others))
        out[t].copy_(got)


EINSUM = register(OpSpec((torch.einsum,), grad=einsum))
