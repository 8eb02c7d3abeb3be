"""Pullbacks through the ops that rewrite a parameter before a layer reads it:
``torch._weight_norm`` (``parametrizations.weight_norm``, the older ``weight_norm``
hook), ``torch.linalg.matrix_exp`` of a skew-symmetric matrix
(``parametrizations.orthogonal``'s default map for square weights) and
``torch.linalg.householder_product`` (its map for the others).

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
  normal, ``i A`` Hermitian: one ``eigh`` for the batch, with ``Phi[j, k] = exp(i (m_j +
  m_k) / 2) sinc((m_j - m_k) / 2)`` for the eigenvalues ``l = i m`` of ``A^T`` (no
  division by a small difference). Its eigenvectors come in conjugate pairs, so the
  real and imaginary parts of those of the positive half (and the null vector of an odd
  size) are a real orthogonal basis ``Q`` (up to ``sqrt(2)``): each cotangent then takes
  two real products in (``Q^T G Q``), a map of its blocks, and two out, where the
  complex eigenbasis takes four complex ones. Where the pairs do not give such a basis
  (a zero eigenvalue repeated) the complex eigenbasis is used; ``A = 0`` (where
  ``orthogonal``'s trivialization starts) gives ``G`` itself. Any other matrix declines
  (the exact batched backward of the op then runs).
- The product of Householder reflections ``Q = (I - V T V^H)[:, :k]`` in its compact WY
  form (Schreiber & Van Loan 1989): ordinary products and one triangular solve, whose
  batched backward takes all cotangents at once, where the op's own backward runs once
  per sample.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..precision import accumulate_dtype
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
    if not a.any():  # (L(0, G) = G: orthogonal's trivialization starts there)
        out[a_t].copy_(g)
        return
    mu, vecs = torch.linalg.eigh(a.to(torch.complex128) * 1j)  # i A = V diag(mu) V^H
    found = _real_basis(mu, vecs)
    if found is None:  # (eigenvalues that pair with no real basis: zero ones, repeated)
        out[a_t].copy_(_adjoint_complex(mu, vecs, g))
        return
    basis, blocks = found
    out[a_t].copy_(_adjoint_real(basis.to(g.dtype), blocks, g))


def _phi(alpha: Tensor, beta: Tensor) -> Tensor:
    """``Phi`` of the eigenvalues ``i alpha`` and ``i beta`` (broadcast): ``(e^{i alpha} -
    e^{i beta}) / (i alpha - i beta)`` as ``exp(i (alpha + beta) / 2) sinc((alpha - beta)
    / 2)``."""
    return torch.polar(torch.sinc((alpha - beta) / (2 * math.pi)), (alpha + beta) / 2)


def _adjoint_complex(mu: Tensor, vecs: Tensor, g: Tensor) -> Tensor:
    """``L(A^T, G[n])`` in the complex eigenbasis: ``A^T = -A = V diag(i mu) V^H``."""
    phi = _phi(mu[..., :, None], mu[..., None, :]).to(_complex(g.dtype))  # (..., m, m)
    vecs = vecs.to(phi.dtype)
    inner = vecs.mH @ g.to(phi.dtype) @ vecs  # (n, v, ..., m, m)
    return (vecs @ (inner * phi) @ vecs.mH).real


def _real_basis(mu: Tensor, vecs: Tensor) -> tuple[Tensor, tuple] | None:
    """A real basis ``Q = [Re U, Im U, r]`` of the eigenvectors: ``U`` those of the ``p =
    m // 2`` largest eigenvalues ``mu`` of ``i A`` (their conjugates are those of ``-mu``),
    ``r`` the real null vector where ``m`` is odd; ``sqrt(2) Re U``, ``sqrt(2) Im U`` and
    ``r`` are orthonormal (checked: ``None`` where they are not, as when an eigenvalue is
    zero twice). Also ``Phi``'s blocks ``(Phi_PP, Phi_PN, Phi_P0)`` of the eigenvalues
    ``i mu_top`` (``U``), ``-i mu_top`` (``conj U``) and ``0`` (``r``) of ``A^T``."""
    m = mu.shape[-1]
    p = m // 2
    top, u = mu[..., m - p:], vecs[..., :, m - p:]  # (..., p), (..., m, p)
    cols = [u.real, u.imag]
    if m % 2:
        z = vecs[..., :, p:p + 1]  # (..., m, 1): the eigenvalue nearest 0
        k = z.abs().argmax(-2, keepdim=True)
        phase = z.gather(-2, k)
        r = (z * (phase.conj() / phase.abs())).real
        cols.append(r / r.norm(dim=-2, keepdim=True))
    basis = torch.cat(cols, -1)  # (..., m, m) float64
    scale = basis.new_full((m,), 2.0 ** 0.5)
    scale[2 * p:] = 1.0
    gram = (basis * scale).mT @ (basis * scale)
    if (gram - torch.eye(m, dtype=gram.dtype)).abs().amax() > 1e-10:
        return None
    zero = top.new_zeros(())
    return basis, (_phi(top[..., :, None], top[..., None, :]),
                   _phi(top[..., :, None], -top[..., None, :]), _phi(top, zero))


def _adjoint_real(basis: Tensor, blocks: tuple, g: Tensor) -> Tensor:
    """``L(A^T, G[n]) = Q B Q^T`` with ``K = Q^T G Q`` (two real products per cotangent,
    and two back): with ``U = Re U + i Im U`` and ``r`` the null vector, ``U^H G U =
    K_rr + K_ii + i (K_ri - K_ir)`` and ``U^H G conj(U) = K_rr - K_ii - i (K_ri + K_ir)``;
    their products with ``Phi``'s blocks, ``Z1`` and ``Z2``, give ``S = Z1 + Z2`` and ``D =
    Z2 - Z1``, and ``B = 2 [[Re S, -Im D], [-Im S, -Re D]]`` (the terms of ``conj U``
    being the conjugates of those of ``U``), bordered where ``m`` is odd by ``r``'s row and
    column (``Phi`` of ``0`` and ``i mu``) and ``K_00``."""
    phi_pp, phi_pn, phi_p0 = (b.to(_complex(g.dtype)) for b in blocks)
    m = basis.shape[-1]
    p = m // 2
    k = basis.mT @ g @ basis  # (n, v, ..., m, m)
    rr, ri = k[..., :p, :p], k[..., :p, p:2 * p]
    ir, ii = k[..., p:2 * p, :p], k[..., p:2 * p, p:2 * p]
    z1 = phi_pp * torch.complex(rr + ii, ri - ir)  # (n, v, ..., p, p)
    z2 = phi_pn * torch.complex(rr - ii, -(ri + ir))
    s, d = z1 + z2, z2 - z1
    b = torch.empty_like(k)
    b[..., :p, :p] = 2 * s.real
    b[..., :p, p:2 * p] = -2 * d.imag
    b[..., p:2 * p, :p] = -2 * s.imag
    b[..., p:2 * p, p:2 * p] = -2 * d.real
    if m % 2:
        c = phi_p0 * torch.complex(k[..., :p, 2 * p], -k[..., p:2 * p, 2 * p])  # (..., p)
        e = phi_p0 * torch.complex(k[..., 2 * p, :p], k[..., 2 * p, p:2 * p])
        b[..., :p, 2 * p] = 2 * c.real
        b[..., p:2 * p, 2 * p] = -2 * c.imag
        b[..., 2 * p, :p] = 2 * e.real
        b[..., 2 * p, p:2 * p] = 2 * e.imag
        b[..., 2 * p, 2 * p] = k[..., 2 * p, 2 * p]
    return basis @ b @ basis.mT


def householder_product(call: OpCall, g: Tensor, out: dict) -> None:
    """``torch.linalg.householder_product(A, tau)`` (``orthogonal``'s map for a weight
    that is not square) of ``A (..., m, k)`` and ``tau (..., k)`` shared by the samples;
    ``g (n, v, ..., m, k)``. The product in its compact WY form (:func:`_compact_wy`),
    differentiated for all cotangents in one batched backward of ordinary products and a
    triangular solve."""
    a_t, tau_t = call.arg(0, "input"), call.arg(1, "tau")
    if not (isinstance(a_t, Tensor) and isinstance(tau_t, Tensor)) or not (
            call.shared(a_t) and call.shared(tau_t)) or a_t is tau_t:
        raise Decline("a Householder product per sample")
    work = accumulate_dtype(g.dtype)
    a, tau = call.value(a_t).to(work), call.value(tau_t).to(work)
    wanted = [(x, t) for x, t in ((a, a_t), (tau, tau_t)) if t in out]
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x, _ in wanted]
        given = dict(zip((id(x) for x, _ in wanted), leaves))
        q = _compact_wy(given.get(id(a), a), given.get(id(tau), tau))
        got = torch.autograd.grad(q, leaves, g.flatten(0, 1).to(work), is_grads_batched=True)
    for (_, t), grad in zip(wanted, got):
        out[t].copy_(grad.unflatten(0, g.shape[:2]))


def _compact_wy(a: Tensor, tau: Tensor) -> Tensor:
    """``householder_product(a, tau)`` as ``(I - V T V^H)[:, :k]`` (Schreiber & Van Loan
    1989): ``V`` the unit lower trapezoidal reflectors of ``a (..., m, k)``, ``T`` upper
    triangular with ``T^-1 = diag(1 / tau) + triu(V^H V, 1)``, taken as ``(I + diag(tau)
    triu(V^H V, 1))^-1 diag(tau)`` (a unit triangular solve: ``tau = 0`` allowed)."""
    m, k = a.shape[-2:]
    eye = torch.eye(m, k, dtype=a.dtype, device=a.device)
    v = a.tril(-1) + eye  # (..., m, k)
    s = (v.mH @ v).triu(1)  # (..., k, k)
    unit = torch.eye(k, dtype=a.dtype, device=a.device) + tau[..., :, None] * s
    t = torch.linalg.solve_triangular(unit, torch.diag_embed(tau), upper=True,
                                      unitriangular=True)
    return eye - v @ (t @ v[..., :k, :].mH)


def _complex(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


WEIGHT_NORM = register(OpSpec((torch._weight_norm,), grad=weight_norm))
MATRIX_EXP = register(OpSpec((torch.linalg.matrix_exp, torch.matrix_exp), grad=matrix_exp))
HOUSEHOLDER = register(OpSpec((torch.linalg.householder_product, torch.orgqr),
                              grad=householder_product))
