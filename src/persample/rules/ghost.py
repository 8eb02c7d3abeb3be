"""Per-sample gradients as sums of outer products, and their inner products ("ghost
norms") without forming them.

A linear map applied at ``t`` positions gives each sample the weight gradient
``G_n = sum_t L[n, t] outer R[n, t]`` (``L`` the backprops, ``R`` the activations);
a table lookup gives the same form with ``L[n, t]`` the one-hot row of the id
``ids[n, t]``. For two such gradients of the same parameter (a tied embedding and
output layer, a layer called twice, weights shared across depth):

    <G_n, G'_n> = sum_{t, s} (L[n, t] . L'[n, s]) (R[n, t] . R'[n, s])

costs ``n T T' (r + c)`` instead of ``n T r c`` for materialising, and
``|G1 + G2|^2 = |G1|^2 + |G2|^2 + 2 <G1, G2>`` gives the norm of the sum. With ids,
``L[n, t] . L'[n, s]`` is a comparison of ids (``ids_t == ids'_s``) or a gather of
the dense factor at the id (``L'[n, s, ids_t]``).

The ``(n, T, T')`` products are computed in blocks of positions, so that a long
sequence never holds more than :data:`BLOCK_BYTES` of them at once.

Goodfellow (2015), "Efficient per-example gradient computations"; Li et al. (2022),
"Large language models can be strong differentially private learners" (ghost
clipping); Lee & Kifer (2021), "Scaling up differentially private deep learning
with fast per-example gradient clipping".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK_BYTES = 1 << 27  # at most this many bytes of (n, T, T') products at once


@dataclass
class Factors:
    """One use's per-sample gradient of a parameter seen as ``(r, c)``:
    ``G_n = sum_t L[n, t] outer R[n, t]``.

    Attributes:
        left: ``(n, t, r)`` floating, or ``(n, t)`` int64 row ids (one-hot rows).
        right: ``(n, t, c)`` floating (zeros at positions that give no gradient).
        backprops: which side holds the op's backprops (``"left"`` or ``"right"``);
            the other holds what it read (activations, ids, ones for a bias): K-FAC's
            output-side and input-side factors (:mod:`persample.curvature`).
    """

    left: Tensor
    right: Tensor
    backprops: str = "left"

    @property
    def ids(self) -> bool:
        return not self.left.is_floating_point()

    @property
    def positions(self) -> int:
        return self.right.shape[1]

    def cost(self, other: Factors) -> int:
        """Multiply-adds per sample of :func:`inner` with ``other``."""
        rows = 1 if self.ids or other.ids else self.left.shape[2]
        return self.positions * other.positions * (rows + self.right.shape[2])


def inner(a: Factors, b: Factors) -> Tensor:
    """``<G_n, G'_n>`` per sample, ``(n,)``, in ``a.right``'s dtype.

    Examples:
        >>> L, R = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
        >>> G = torch.einsum("ntr,ntc->nrc", L, R)
        >>> torch.allclose(inner(Factors(L, R), Factors(L, R)), G.square().sum((1, 2)))
        True
    """
    n, ta = a.right.shape[:2]
    tb = b.positions
    step = max(1, BLOCK_BYTES // max(1, n * tb * a.right.element_size() * 2))
    total = a.right.new_zeros(n)
    for start in range(0, ta, step):
        stop = min(ta, start + step)
        rr = torch.bmm(a.right[:, start:stop], b.right.transpose(1, 2))  # (n, ta', tb)
        rr.mul_(_left_products(a, b, start, stop))
        total += rr.sum((1, 2))
    return total


def _left_products(a: Factors, b: Factors, start: int, stop: int) -> Tensor:
    """``L[n, t] . L'[n, s]`` for ``t`` in ``[start, stop)``: ``(n, stop - start, tb)``."""
    la = a.left[:, start:stop]
    if a.ids and b.ids:
        return (la.unsqueeze(2) == b.left.unsqueeze(1)).to(a.right.dtype)
    if a.ids:  # L'[n, s, ids_t]
        n, tb = b.left.shape[:2]
        picked = torch.gather(b.left, 2, la.unsqueeze(1).expand(n, tb, la.shape[1]))
        return picked.transpose(1, 2)
    if b.ids:  # L[n, t, ids'_s]
        n, t = la.shape[:2]
        return torch.gather(la, 2, b.left.unsqueeze(1).expand(n, t, b.left.shape[1]))
    return torch.bmm(la, b.left.transpose(1, 2))


def squared_norm(uses: list[Factors]) -> Tensor:
    """``|sum_k G_k|^2`` per sample ``(n,)`` of a parameter with the given uses.

    Examples:
        >>> L1, R1 = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
        >>> ids, R2 = torch.randint(0, 4, (2, 6)), torch.randn(2, 6, 5)
        >>> G = torch.einsum("ntr,ntc->nrc", L1, R1) + torch.einsum(
        ...     "ntr,ntc->nrc", torch.nn.functional.one_hot(ids, 4).double(), R2.double()).float()
        >>> got = squared_norm([Factors(L1, R1), Factors(ids, R2)])
        >>> torch.allclose(got, G.square().sum((1, 2)), rtol=1e-4)
        True
    """
    total = None
    for k, a in enumerate(uses):
        for j in range(k, len(uses)):
            term = inner(a, uses[j]) * (1 if j == k else 2)
            total = term if total is None else total + term
    return total


def ghost_cost(uses: list[Factors]) -> int:
    """Multiply-adds per sample of :func:`squared_norm`."""
    return sum(a.cost(uses[j]) for k, a in enumerate(uses) for j in range(k, len(uses)))


def forming_cost(uses: list[Factors], rows: int) -> int:
    """Multiply-adds per sample of forming ``sum_k G_k`` of ``(rows, c)``."""
    c = uses[0].right.shape[2]
    return rows * c * sum(1 if u.ids else u.positions for u in uses)


def materialise_cost(uses: list[Factors], rows: int) -> int:
    """Multiply-adds (and writes) per sample of forming ``sum_k G_k`` of ``(rows, c)``
    and squaring it."""
    return forming_cost(uses, rows) + rows * uses[0].right.shape[2]


def cross_inner(a: Factors, b: Factors) -> Tensor:
    """``<G_i, G'_j>`` for every sample ``i`` of ``a`` and ``j`` of ``b``: ``(n, m)``, in
    ``a.right``'s dtype, as ``sum_{t, s} (L[i, t] . L'[j, s]) (R[i, t] . R'[j, s])``.

    Computed in blocks of ``a``'s samples, at most :data:`BLOCK_BYTES` of
    ``(samples, T, m, T')`` products at once.

    Examples:
        >>> L, R = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
        >>> ids, R2 = torch.randint(0, 4, (3, 2)), torch.randn(3, 2, 5)
        >>> G = torch.einsum("ntr,ntc->nrc", L, R)
        >>> G2 = torch.einsum("ntr,ntc->nrc", torch.nn.functional.one_hot(ids, 4).float(), R2)
        >>> got = cross_inner(Factors(L, R), Factors(ids, R2))
        >>> torch.allclose(got, G.flatten(1) @ G2.flatten(1).T, rtol=1e-4, atol=1e-5)
        True
    """
    n, ta, c = a.right.shape
    m, tb = b.right.shape[:2]
    out = a.right.new_zeros(n, m)
    step = max(1, BLOCK_BYTES // max(1, ta * m * tb * a.right.element_size() * 2))
    right_b = b.right.reshape(m * tb, c)
    for start in range(0, n, step):
        stop = min(n, start + step)
        rr = (a.right[start:stop].reshape(-1, c) @ right_b.T).view(stop - start, ta, m, tb)
        rr.mul_(_cross_left(a, b, start, stop))
        out[start:stop] = rr.sum((1, 3))
    return out


def _cross_left(a: Factors, b: Factors, start: int, stop: int) -> Tensor:
    """``L[i, t] . L'[j, s]`` for ``a``'s samples ``[start, stop)``: ``(k, T, m, T')``."""
    la = a.left[start:stop]
    k, ta = la.shape[:2]
    m, tb = b.left.shape[:2]
    if a.ids and b.ids:
        return (la[:, :, None, None] == b.left[None, None]).to(a.right.dtype)
    if a.ids:  # L'[j, s, ids_it]
        picked = b.left[:, :, la.reshape(-1)]  # (m, T', k T)
        return picked.permute(2, 0, 1).reshape(k, ta, m, tb)
    if b.ids:  # L[i, t, ids'_js]
        return la[:, :, b.left.reshape(-1)].view(k, ta, m, tb)
    r = la.shape[2]
    return (la.reshape(-1, r) @ b.left.reshape(m * tb, r).T).view(k, ta, m, tb)


def formed(uses: list[Factors], out: Tensor | None = None) -> Tensor:
    """``sum_k G_k`` per sample, ``(n, r, c)``, of uses with floating factors (no ids),
    by few products over their positions joined: ``L^T R`` with ``L (n, T, r)`` and
    ``R (n, T, c)`` the uses' factors concatenated along ``T``. A layer called at every
    step of a loop, or weights shared across depth, then write the result once, where a
    product per use writes it ``k`` times and adds ``k - 1`` of them. The uses are
    joined in chunks of at most ``2 r c`` numbers a sample (about two results), each
    chunk's product added into the result by ``baddbmm``.

    Args:
        uses: each use's :class:`Factors`, ``left (n, t_k, r)`` and ``right (n, t_k,
            c)`` floating, of one dtype.
        out: ``(n, r, c)`` to write the sum into (of the factors' dtype), else a new
            tensor.

    Returns:
        ``(n, r, c)`` in the factors' dtype.

    Raises:
        ValueError: a use's left factor holds ids (a table lookup: its rows are added
            in place by the lookup's own rule).

    Examples:
        >>> L1, R1 = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
        >>> L2, R2 = torch.randn(2, 7, 4), torch.randn(2, 7, 5)
        >>> G = torch.einsum("ntr,ntc->nrc", L1, R1) + torch.einsum("ntr,ntc->nrc", L2, R2)
        >>> torch.allclose(formed([Factors(L1, R1), Factors(L2, R2)]), G, atol=1e-5)
        True
    """
    if any(u.ids for u in uses):
        raise ValueError("formed: a use's left factor holds row ids; add a lookup's rows "
                         "by its own rule")
    r, c = uses[0].left.shape[2], uses[0].right.shape[2]
    chunks: list[list[Factors]] = [[]]
    for u in uses:  # (greedy: a chunk holds uses while their factors fit the budget)
        if chunks[-1] and sum(v.positions for v in chunks[-1] + [u]) * (r + c) > 2 * r * c:
            chunks.append([])
        chunks[-1].append(u)
    for k, chunk in enumerate(chunks):
        left = torch.cat([u.left for u in chunk], 1) if len(chunk) > 1 else chunk[0].left
        right = torch.cat([u.right for u in chunk], 1) if len(chunk) > 1 else chunk[0].right
        if k == 0:  # (n, T, r)^T (n, T, c) -> (n, r, c)
            out = torch.bmm(left.transpose(1, 2), right, out=out) if out is not None else (
                torch.bmm(left.transpose(1, 2), right))
        else:
            out.baddbmm_(left.transpose(1, 2), right)
    return out
