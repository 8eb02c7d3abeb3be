"""Influence scores against the explicit inverse of the damped curvature, in float64:
the curvature built densely from the loop (per-sample gradients of every loss-Hessian
column) and :class:`persample.KFAC`'s factors, inverted with ``torch.linalg.inv``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import hessian

import persample
from persample import KFAC
from persample.influence import EKFAC, fit_preconditioner

N, Q = 24, 5


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 3)).double()
    g = torch.Generator().manual_seed(1)
    train = (torch.randn(N, 4, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (N,), generator=g))
    query = (torch.randn(Q, 4, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (Q,), generator=g))
    return model, train, query, nn.CrossEntropyLoss()


def _columns_by_loop(model, x, y, loss_fn):
    """``{name: (N, C, *shape)}``: each sample's ``J_n^T s_nc`` for the columns of its
    loss Hessian's square root, by ``autograd.grad`` sample by sample."""
    params = dict(model.named_parameters())
    out = {name: [] for name in params}
    for i in range(len(y)):
        o = model(x[i:i + 1])[0]
        h = hessian(lambda z, i=i: loss_fn(z[None], y[i:i + 1]))(o.detach())
        values, vectors = torch.linalg.eigh(h)
        root = vectors * values.clamp(min=0).sqrt()
        cols = [torch.autograd.grad(o, list(params.values()), root[:, c], retain_graph=True)
                for c in range(len(o))]
        for k, name in enumerate(params):
            out[name].append(torch.stack([c[k] for c in cols]))
    return {name: torch.stack(v) for name, v in out.items()}


def _grads(model, x, y, loss_fn):
    return persample.loop_per_sample_grads(model, x, y, loss_fn)


def _dense_scores(blocks: dict, damping: dict, gq: dict, gt: dict) -> torch.Tensor:
    """``sum_p g_q^T (F_p + lambda_p I)^{-1} g_t`` with each block ``F_p`` dense."""
    total = 0
    for name, f in blocks.items():
        inv = torch.linalg.inv(f + damping[name] * torch.eye(len(f), dtype=f.dtype))
        total = total + gq[name].flatten(1) @ inv @ gt[name].flatten(1).T
    return total


def _basis_matrix(b) -> torch.Tensor:
    """``Q_rows (x) Q_cols`` for the row-major flattening of a ``(r, c)`` matrix."""
    rows = b.rows if b.rows is not None else torch.eye(b.values.shape[0], dtype=b.values.dtype)
    return torch.kron(rows, b.cols)


@pytest.mark.parametrize("curvature", ["ekfac", "kfac", "diagonal", "identity"])
def test_scores_against_the_explicit_inverse(curvature):
    model, train, query, loss_fn = _setup()
    scores = persample.influence(model, train, query, loss_fn, curvature=curvature,
                                 batch_size=10)
    gq, gt = _grads(model, *query, loss_fn), _grads(model, *train, loss_fn)
    if curvature == "identity":
        want = sum(gq[k].flatten(1) @ gt[k].flatten(1).T for k in gq)
        torch.testing.assert_close(scores, want, rtol=1e-10, atol=1e-12)
        return
    cols = _columns_by_loop(model, *train, loss_fn)
    ggn = {name: torch.einsum("nci,ncj->ij", c.flatten(2), c.flatten(2)) / N
           for name, c in cols.items()}  # each parameter's exact GGN block
    kfac = KFAC(model, shared="diagonal")
    kfac.update(*train, loss_fn)
    factored = set(kfac.factors) if curvature != "diagonal" else set()
    assert factored == ({"0.weight", "0.bias", "3.weight", "3.bias"}
                        if curvature != "diagonal" else set())
    blocks, damping = {}, {}
    for name in cols:
        if name not in factored:  # the exact diagonal
            diag = torch.diagonal(ggn[name])
            blocks[name], damping[name] = torch.diag(diag), 0.1 * float(diag.mean())
            continue
        (f,) = kfac.factors[name]
        values, vectors = {}, {}
        for side in ("A", "G"):
            values[side], vectors[side] = torch.linalg.eigh(getattr(f, side))
        if curvature == "kfac":
            blocks[name] = torch.kron(f.G, f.A)  # rows: G (nn.Linear (out, in))
            damping[name] = 0.1 * float((values["G"][:, None] * values["A"][None]).mean())
        else:  # EK-FAC: the exact GGN's diagonal in the K-FAC eigenbasis
            basis = torch.kron(vectors["G"], vectors["A"])
            corrected = torch.diagonal(basis.T @ ggn[name] @ basis)
            blocks[name] = basis @ torch.diag(corrected) @ basis.T
            damping[name] = 0.1 * float(corrected.mean())
    want = _dense_scores(blocks, damping, gq, gt)
    torch.testing.assert_close(scores, want, rtol=1e-8, atol=1e-10)


def test_ekfac_eigenvalues_by_hand():
    """The corrected eigenvalues: the mean over samples and columns of each sample's
    gradient in the K-FAC eigenbasis, squared."""
    model, train, _, loss_fn = _setup()
    kfac = KFAC(model, shared="diagonal")
    kfac.update(*train, loss_fn)
    ekfac = EKFAC(kfac)
    ekfac.update(train[0][:10], train[1][:10], loss_fn)
    ekfac.update(train[0][10:], train[1][10:], loss_fn)
    cols = _columns_by_loop(model, *train, loss_fn)
    for name, b in ekfac.bases.items():
        m = cols[name].reshape(N, 3, *b.values.shape)
        rotated = (b.rows.T if b.rows is not None else 1) @ m @ b.cols
        torch.testing.assert_close(b.values, rotated.square().sum((0, 1)) / N, rtol=1e-10,
                                   atol=1e-13)


def test_self_influence_and_a_fitted_preconditioner():
    model, train, _, loss_fn = _setup()
    pre = fit_preconditioner(model, train, loss_fn, damping=0.05)
    assert set(pre.damping.values()) == {0.05}
    full = persample.influence(model, train, train, loss_fn, preconditioner=pre)
    own = persample.self_influence(model, train, loss_fn, preconditioner=pre)
    torch.testing.assert_close(own, torch.diagonal(full), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(full, full.T, rtol=1e-8, atol=1e-10)  # a symmetric form
    with pytest.raises(ValueError, match="curvature must be one of"):
        persample.influence(model, train, train, loss_fn, curvature="exact")
    with pytest.raises(ValueError, match="damping must be >= 0"):
        fit_preconditioner(model, train, loss_fn, damping=-1.0)


def test_projected_scores_are_the_projections_of_the_exact_ones():
    """With a projector: the projection of each preconditioned query gradient against
    that of each training gradient (both formed here by the loop), the training side
    projected by persample from activations and backprops; unbiased over projections,
    and refused for a projector of other parameters."""
    model, train, query, loss_fn = _setup()
    pre = fit_preconditioner(model, train, loss_fn, curvature="ekfac", batch_size=10)
    exact = persample.influence(model, train, query, loss_fn, preconditioner=pre,
                                batch_size=10)
    proj = persample.GradientProjector(model, 12, seed=3)
    got = persample.influence(model, train, query, loss_fn, preconditioner=pre,
                              projector=proj, batch_size=10)
    q = pre.apply(_grads(model, *query, loss_fn))
    want = proj.project(q) @ proj.project(_grads(model, *train, loss_fn)).T
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(got, exact, rtol=0.05)  # a projection, not the exact scores
    # E[P P^T] = I: over many projections, the mean is the exact scores within 5
    # standard errors, every score
    draws = torch.stack([persample.influence(
        model, train, query, loss_fn, preconditioner=pre, batch_size=10,
        projector=persample.GradientProjector(model, 12, seed=s)) for s in range(300)])
    error = draws.double().std(0) / 300 ** 0.5
    assert ((draws.double().mean(0) - exact).abs() <= 5 * error).all()
    other = persample.GradientProjector(model, 4, params=["3.weight"])
    with pytest.raises(ValueError, match="same params"):
        persample.influence(model, train, query, loss_fn, preconditioner=pre, projector=other)
