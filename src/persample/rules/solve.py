"""``torch.linalg.solve``, ``linalg.solve_ex`` and ``cholesky_solve``: ``X = A^-1 B``
(``left=False``: ``X = B A^-1``; ``A = L L^T`` from its Cholesky factor), a learned
matrix solved against each sample's right-hand sides (Gaussian-process and Kalman layers,
implicit linear layers), or each sample's matrix against a learned right-hand side.

Index conventions: ``n`` sample, ``v`` cotangent, ``...`` the batch dims of the solve.
With ``G (n, v, ..., C, k)`` the backprops of ``X`` (a batch of vectors ``B (..., C)``
solved as ``B.unsqueeze(-1)``), the per-sample gradients are the solve's own vector-
Jacobian product (Giles, "An extended collection of matrix derivative results for
forward and reverse mode algorithmic differentiation", 2008), per sample::

    grad_B[n, v] = A^-T G[n, v]            (left=False: G[n, v] A^-T)
    grad_A[n, v] = - grad_B[n, v] X[n]^T   (left=False: - X[n]^T grad_B[n, v])

each summed over the batch dims the parameter was broadcast over. ``X`` is solved again
from the inputs the op read. (torch.func's batched vector-Jacobian product of a solve
whose operands broadcast is wrong in torch 2.13; persample's own ``torch.func`` calls
expand them first: :func:`persample.patches.solves_broadcast`.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .calls import OpCall, write_reduced
from .spec import OpSpec, register


def _batched(call: OpCall, t: Tensor) -> Tensor:
    """``t`` as it broadcasts against ``G (n, v, ...)``: a shared input as it is, one
    carrying samples as ``(n, 1, *per_sample)``."""
    return t.detach() if call.shared(t) else call.front(t).unsqueeze(1)


def solve(call: OpCall, g: Tensor, out: dict[Tensor, Tensor]) -> None:
    """``g (n, v, *x_shape)`` -> ``out[t] (n, v, *shape)`` for ``t`` among ``A``, ``B``."""
    a, b = call.arg(0, "A"), call.arg(1, "B")
    left = call.arg(2, "left", True)
    call.only(out, a, b)
    if a is b:  # (X = I: its two paths cancel)
        if a in out:
            out[a].zero_()
        return
    vectors = b.dim() == 1 or (b.dim() == a.dim() - 1 and b.shape == a.shape[:-1])
    av, bv = _batched(call, a), _batched(call, b)
    if vectors:  # (solved as columns: X, G and B get a trailing dim of 1; torch solves
        # vectors with left=True only)
        bv, g = bv.unsqueeze(-1), g.unsqueeze(-1)
    x = torch.linalg.solve(av, bv, left=left)  # (n or 1, v or 1, ..., C, k)
    gb = torch.linalg.solve(av.mT, g, left=left)  # (n, v, ..., C, k)
    if b in out:
        write_reduced(call, out, b, gb.squeeze(-1) if vectors else gb)
    if a in out:
        ga = -(gb @ x.mT) if left else -(x.mT @ gb)  # (n, v, ..., C, C)
        write_reduced(call, out, a, ga)


SOLVE = register(OpSpec((torch.linalg.solve,), grad=solve))


def solve_ex(call: OpCall, g: list, out: dict[Tensor, Tensor]) -> None:
    """``linalg.solve_ex``: ``g[0]``, the backprops of ``X``, as :func:`solve`'s (``info``
    holds integers: no gradient)."""
    if g[0] is None:
        call.only(out, call.arg(0, "A"), call.arg(1, "B"))
        for t in out.values():
            t.zero_()
        return
    solve(call, g[0], out)


SOLVE_EX = register(OpSpec((torch.linalg.solve_ex,), grad=solve_ex, multi_output=True))


def cholesky_solve(call: OpCall, g: Tensor, out: dict[Tensor, Tensor]) -> None:
    """``cholesky_solve(B, L, upper=)``: ``X = (L L^T)^-1 B`` (``U^T U`` where ``upper``);
    ``g (n, v, *x_shape)`` -> ``out[t]`` for ``t`` among ``B``, ``L``, per sample::

        grad_B = (L L^T)^-1 G,   S = grad_B X^T + X grad_B^T,
        grad_L = - S L   (upper: - U S)

    (torch's own ``cholesky_solve`` backward, which reads the whole of ``L``)."""
    b, factor = call.arg(0, "input"), call.arg(1, "input2")
    upper = call.arg(2, "upper", False)
    call.only(out, b, factor)
    lv, bv = _batched(call, factor), _batched(call, b)
    x = torch.cholesky_solve(bv, lv, upper=upper)  # (n or 1, v or 1, ..., C, k)
    gb = torch.cholesky_solve(g, lv, upper=upper)  # (n, v, ..., C, k)
    if b in out:
        write_reduced(call, out, b, gb)
    if factor in out:
        s = gb @ x.mT
        s = s + s.mT  # (n, v, ..., C, C)
        write_reduced(call, out, factor, -(lv @ s) if upper else -(s @ lv))


CHOLESKY_SOLVE = register(OpSpec((torch.cholesky_solve,), grad=cholesky_solve))
