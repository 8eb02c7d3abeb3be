"""Per-sample gradients of ``torch.einsum`` with respect to its shared operands.

Index conventions: ``n`` sample, ``v`` cotangent; a sample's tensors keep their batch
dim, of size 1. For ``out = einsum(eq, A, W, ...)``
with the samples in one letter ``b`` of the batched operands and of the output (their
batch dims), the gradient of a shared operand ``W`` (subscripts ``w``, each letter once,
no ``b``) for sample ``n`` is the einsum of the cotangent (subscripts ``b v`` and the
output's others) with every other operand, summed over what ``W`` does not index:
``einsum("bv<out>, <A>, ... -> bv<w>")``. Any subscripts, operands of any rank (a 3-d
expert table ``"bti,hio->btho"``, Transformer-XL's ``"bid,jd->bij"``, a bilinear form
``"bi,ij,bj->b"`` reading ``x`` twice), ``...`` spelled out as letters.
"""

from __future__ import annotations

import string

import torch
from torch import Tensor

from ..batch import Batched
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


def _batch_letter(call: OpCall, tensors: list[Tensor], subs: list[str], out_subs: str) -> str:
    """The samples' letter: at the batch dim of the output, or (a derived op pulled back
    per sample, its output shared) of the operands paired with the samples. The samples
    may be merged with other positions in that dim (``(B * heads, ...)``: VitDet's
    relative positions), alike in every operand and the output: a sample's part of the
    dim then holds its ``outer * inner`` positions, in the same order in each."""
    letters, forms = set(), set()
    for t, s in zip(tensors, subs):
        pairing = call.pairing(t)
        if pairing is not None:
            if pairing.index is not None or s.count(s[pairing.dim]) != 1:
                raise Decline("an operand paired with the samples in an irregular or "
                              "repeated dim")
            letters.add(s[pairing.dim])
            forms.add((pairing.outer, pairing.inner))
    lay = call.op.out_layouts[0]
    if isinstance(lay, Batched) and lay.index is None:
        letters.add(out_subs[lay.dim])
        forms.add((lay.outer, lay.inner))
    if len(letters) != 1 or not letters <= set(out_subs):
        raise Decline("no one letter of the samples kept by the output")
    if len(forms) > 1:
        raise Decline("operands whose samples are merged with other positions unalike")
    return letters.pop()


def einsum(call: OpCall, g: Tensor, out: dict) -> None:
    """``out[t] (n, v, *per_sample_shape)`` for each operand ``t`` asked for: a shared one
    (a parameter, its own shape), or one paired with the samples (a derived operand
    pulled back per sample, its shape with the batch dim of size 1)."""
    eq, operands = _operands(call)
    call.only(out, *operands)
    tensors = [t for t in operands if isinstance(t, Tensor)]
    if len(tensors) != len(operands) or any(
            sum(x is t for x in tensors) > 1 for t in tensors if t in out):
        raise Decline("an operand that is not a tensor, or one asked for twice")
    try:
        subs, out_subs = einsum_subscripts(eq, [t.dim() for t in tensors])
    except ValueError as err:
        raise Decline(str(err)) from None
    b = _batch_letter(call, tensors, subs, out_subs)
    free = [c for c in string.ascii_letters if c not in eq and c not in "".join(subs)]
    v, one = free[:2]  # the cotangents; a sample's own batch dim, of size 1
    g_subs = b + v + out_subs.replace(b, one)
    fronted, fronted_subs = [], []  # every operand with its samples in front
    for t, s in zip(tensors, subs):
        pairing = call.pairing(t)
        if pairing is None and b in s:
            raise Decline("a shared operand indexed by the samples' letter")
        if pairing is not None and s[pairing.dim] != b:
            raise Decline("an operand paired with the samples in another letter")
        fronted.append(call.front(t))
        fronted_subs.append(s if pairing is None else b + s.replace(b, one))
    for k, (t, s) in enumerate(zip(tensors, subs)):
        if t not in out:
            continue
        if len(set(s)) != len(s):
            raise Decline("a diagonal of an operand asked for")
        want = s if call.pairing(t) is None else s.replace(b, one)
        others = [(x, xs) for j, (x, xs) in enumerate(zip(fronted, fronted_subs)) if j != k]
        seen = set(g_subs).union(*(set(xs) for _, xs in others))
        if not set(want) <= seen:
            raise Decline("a dim of the operand summed by the op alone")
        terms = ",".join([g_subs] + [xs for _, xs in others])
        out[t].copy_(torch.einsum(f"{terms}->{b}{v}{want}", g, *(x for x, _ in others)))


EINSUM = register(OpSpec((torch.einsum,), grad=einsum))
