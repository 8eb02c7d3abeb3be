"""Pullbacks through the ops that rewrite a parameter before a layer reads it:
``torch._weight_norm`` (``parametrizations.weight_norm``, the older ``weight_norm``
hook) and ``torch.linalg.matrix_exp`` of a skew-symmetric matrix
(``parametrizations.orthogonal``'s default map for square weights).

Such an op makes a tensor shared by the samples (a derived weight ``W``); the rules of
the ops that read ``W`` give each sample's cotangent ``G[n] = dL_n/dW`` ``(n, v,
*W.shape)``, and these rules pull all of them back at once by the op's vector-Jacobian
product written for a batch of cotangents, where a batched ``autograd`` backward would
run the op's own backward once per sample (``_weight_norm``'s has no batching rule) or
differentiate a matrix exponential of twice the size per sample.

- Weight normalisation (Salimans & Kingma 2016), ``W = g v / ||v||`` with the norm over
  every dim but ``dim`` (``r = ||v||``, ``s[n] = sum G[n] * v`` over the same dims):
  ``grad g[n] = s[n] / r``, ``grad v[n] = (g / r) G[n] - (g s[n] / r^3) v``.
- The matrix exponential ``Q = exp(A)``: ``grad A[n] = L(A^T, G[n])``, ``L`` its Fréchet
  derivative (Najfeld & Havel 1995; Higham 2008, ch. 10). For a normal ``A = U diag(l)
  U^H``, ``L(A, E) = U ((U^H E U) * Phi) U^H`` with ``Phi[j, k] = (e^{l_j} - e^{l_k}) /
  (l_j - l_k)`` (``e^{l_j}`` where they are equal). A real skew-symmetric ``A`` is
  normal, ``i A`` Hermitian: one ``eigh`` for the batch, then four products per
  cotangent, with ``Phi[j, k] = exp(i (m_j + m_k) / 2) sinc((m_j - m_k) / 2)`` for the
  eigenvalues ``l = i m`` of ``A^T`` (no division by a small difference). Any other
  matrix declines (the exact batched backward of the op then runs).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .calls import OpCall
from .spec import Decline, OpSpec, register


def weight_norm(call: OpCall, g: Tensor, out: dict) -> None:
    """``torch._weight_norm(v, g, dim)``; ``g (n, v, *W.shape)``, the cotangents of
    the normalised weight."""
    v_t, g_t = call.arg(0, "v"), call.arg(1, "g")
    dim = call.arg(2, "dim", 0)
    if not (isinstance(v_t, Tensor) and isinstance(g_t, Tensor)) or not (
            call.shared(v_t) and call.shared(g_t)) or v_t is g_t:
        raise Decline("a weight normalised per sample")
    v, scale = call.value(v_t), call.value(g_t)  # v: W's shape; scale: g's
    kept = 0 if dim == -1 else dim % v.dim()  # (dim=-1: one norm, of the whole tensor)
    rows = 1 if dim == -1 else v.shape[kept]
    flat = v.movedim(kept, 0).reshape(rows, -1)  # (c, k): the norm's slices as rows
    n, cots = g.shape[:2], g.to(v.dtype)
    cot = cots.movedim(kept + 2, 2).reshape(*n, rows, -1)  # (n, v, c, k)
    r = flat.norm(dim=1)  # (c,)
    a = scale.reshape(rows) / r  # (c,): g / r
    s = torch.linalg.vecdot(cot, flat)  # (n, v, c): each row of G[n] . v
    if g_t in out:
        out[g_t].copy_((s / r).reshape(out[g_t].shape))
    if v_t not in out:
        return
    dst = out[v_t]
    direct = kept == 0 and dst.dtype == v.dtype and dst.is_contiguous()
    into = dst.view(*n, rows, -1) if direct else torch.empty_like(cot)
    torch.mul(cot, a[:, None], out=into)  # (g / r) G
    into.addcmul_((s * (a / r.square()))[..., None], flat, value=-1)  # - (g s / r^3) v
    if not direct:
        dst.copy_(into.view(*n, *v.movedim(kept, 0).shape).movedim(2, kept + 2))


def matrix_exp(call: OpCall, g: Tensor, out: dict) -> None:
    """``torch.linalg.matrix_exp(A)`` of a real skew-symmetric ``A (..., m, m)`` shared
    by the samples; ``g (n, v, ..., m, m)``."""
    a_t = call.arg(0, "input")
    if not isinstance(a_t, Tensor) or a_t not in out or not call.shared(a_t):
        raise Decline("a matrix exponential per sample")
    a = call.value(a_t)
    if a.is_complex() or a.dim() < 2 or not torch.equal(a, -a.mT):
        raise Decline("the matrix is not skew-symmetric: its exponential's own backward")
    m, vecs = torch.linalg.eigh(a.to(_complex(a.dtype)) * 1j)  # i A = V diag(m) V^H
    # A^T = -A = V diag(i m) V^H: Phi of the eigenvalues i m, divided differences of exp
    half = (m[..., :, None] - m[..., None, :]) / 2
    phi = torch.polar(torch.sinc(half / math.pi),
                      (m[..., :, None] + m[..., None, :]) / 2)  # (..., m, m)
    cot = g.to(vecs.dtype)
    inner = vecs.mH @ cot @ vecs  # (n, v, ..., m, m)
    out[a_t].copy_((vecs @ (inner * phi) @ vecs.mH).real)


def _complex(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


WEIGHT_NORM = register(OpSpec((torch._weight_norm,), grad=weight_norm))
MATRIX_EXP = register(OpSpec((torch.linalg.matrix_exp, torch.matrix_exp), grad=matrix_exp))
