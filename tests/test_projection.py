"""``GradientProjector`` against its own map applied to the loop's per-sample gradients,
in float64, on every case and the real models; the map itself (Kronecker factors, the
dense matrix drawn in chunks), the split of ``dim``, seeds, and JL's norm preservation.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import Tensor, nn

import persample.projection as projection_module
from cases import CASE_IDS, CASES, N, build
from persample import GradientProjector, loop_per_sample_grads, per_sample_grads
from persample.engine.factored_batch import FactoredBatch, matrix_shape
from test_real_models import masked_loop
from zoo import ZOO

KINDS = ["kronecker", "gaussian", "rademacher"]


def assert_close_rel(got: Tensor, want: Tensor, rel: float = 1e-9) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.abs().max().clamp(min=1e-30)
    assert ((got - want).abs().max() / scale).item() <= rel


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def entries(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_projection_is_the_map_of_the_loops_gradients(c, kind):
    model, x, y = build(c, N)
    loss_fn = c["loss_fn"]("mean")
    proj = GradientProjector(model, min(24, entries(model)), kind=kind, seed=1)
    want = proj.project(loop_per_sample_grads(model, x, y, loss_fn))
    assert want.shape == (N, proj.dim)
    assert_close_rel(quiet(proj, x, y, loss_fn), want)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_real_models(name):
    """Kronecker (factors where ops give them, formed gradients elsewhere; the dense kinds
    take the formed path, checked on every case above)."""
    model, inputs, targets, loss_fn = ZOO[name]()
    reference = masked_loop if name == "timm-levit" else loop_per_sample_grads
    proj = GradientProjector(model, 64, seed=2)
    want = proj.project(reference(model, inputs, targets, loss_fn))
    assert_close_rel(quiet(proj, inputs, targets, loss_fn), want, 1e-8)


def test_kronecker_map_and_factor_path(monkeypatch):
    """A Linear's block is P_out^T G P_in of its per-sample gradient; MLP weights and
    biases come from the factors (materialising is forbidden here)."""
    monkeypatch.setattr(FactoredBatch, "grads",
                        lambda self, group: (_ for _ in ()).throw(AssertionError("formed")))
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
    proj = GradientProjector(model, 16, seed=3)
    assert proj.dim == sum(a * b for a, b in proj.dims.values()) == 16
    z = proj(x, y, nn.CrossEntropyLoss(), method="rules")
    grads = per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    p_out, p_in = proj.kronecker_factors("0.weight", torch.float64)
    d_out, d_in = proj.dims["0.weight"]
    block = torch.einsum("rd,nrc,ce->nde", p_out, grads["0.weight"], p_in).flatten(1)
    assert_close_rel(z[:, : d_out * d_in], block)


def test_dense_matrix_drawn_in_chunks(monkeypatch):
    """Small chunks of rows give the matrix stacked from those chunks, applied whole; the
    same seed the same projection, another seed another."""
    monkeypatch.setattr(projection_module, "CHUNK_BYTES", 4 * 10 * 7)  # 7 rows a chunk
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    for kind in ("gaussian", "rademacher"):
        proj = GradientProjector(model, 10, kind=kind, seed=4)
        phi = torch.cat([torch.cat([b for _, b in proj._blocks(n, torch.float64)])
                         for n in proj.params])  # (P, 10)
        assert phi.shape == (entries(model), 10)
        if kind == "rademacher":
            assert set(phi.abs().mul(math.sqrt(10)).round().unique().tolist()) == {1.0}
        g = torch.cat([v.flatten(1) for v in
                       loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()).values()], 1)
        z = proj(x, y, nn.CrossEntropyLoss())
        assert_close_rel(z, g @ phi)
        again = GradientProjector(model, 10, kind=kind, seed=4)(x, y, nn.CrossEntropyLoss())
        other = GradientProjector(model, 10, kind=kind, seed=5)(x, y, nn.CrossEntropyLoss())
        assert torch.equal(z, again) and not torch.allclose(z, other)


def test_float32_uses_the_same_matrices():
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    p64 = GradientProjector(model, 12, seed=6).kronecker_factors("2.weight", torch.float64)
    p32 = GradientProjector(model, 12, seed=6).kronecker_factors("2.weight", torch.float32)
    torch.testing.assert_close(p64[0].float(), p32[0])


def test_jl_preserves_norms():
    """Dense kinds at dim 2000: every projected norm within 15% of the gradient's (JL).
    Kronecker (higher variance, as LoGra notes): unbiased, the mean of |z|^2 / |g|^2
    over 100 seeds within 10% of 1 for every sample."""
    model = nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 10))
    x, y = torch.randn(12, 40), torch.randint(0, 10, (12,))
    loss_fn = nn.CrossEntropyLoss()
    g = torch.cat([v.flatten(1) for v in loop_per_sample_grads(model, x, y, loss_fn).values()],
                  1)
    for kind in ("gaussian", "rademacher"):
        z = GradientProjector(model, 2000, kind=kind, seed=7)(x, y, loss_fn)
        ratio = z.norm(dim=1) / g.norm(dim=1)
        assert ((ratio - 1).abs() < 0.15).all(), (kind, ratio)
    squares = torch.stack([GradientProjector(model, 2000, seed=s)(x, y, loss_fn).square()
                           .sum(1) for s in range(100)]).mean(0)
    assert ((squares / g.square().sum(1) - 1).abs() < 0.1).all()


def test_kronecker_sides_kept_whole_are_exact():
    """A side kept whole is the identity: a bias is projected exactly (not scaled by one
    random number, whose square would have variance 2), a small parameter kept whole."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 2, (7,))
    proj = GradientProjector(model, 40, seed=3)
    assert proj.dims["2.bias"] == (2, 1) and proj.dims["2.weight"] == (2, 5)
    p_out, p_in = proj.kronecker_factors("2.bias", torch.float64)
    eye = lambda n: torch.eye(n, dtype=torch.float64)  # noqa: E731
    assert torch.equal(p_out, eye(2)) and torch.equal(p_in, eye(1))
    grads = loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    z, at = proj(x, y, nn.CrossEntropyLoss()), 0
    for name in proj.params:  # the blocks of z, in the parameters' order
        d = proj.dims[name][0] * proj.dims[name][1]
        if name.startswith("2."):  # kept whole: the gradient itself
            torch.testing.assert_close(z[:, at:at + d], grads[name].flatten(1), rtol=1e-12,
                                       atol=1e-14)
        at += d
    # every parameter whole (dim = all entries): the gradients themselves, through the
    # factors of the embedding's ids and the linear map's positions
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2)).double()
    ids, y = torch.randint(0, 5, (4, 6)), torch.randn(4, 6, 2, dtype=torch.float64)
    proj = GradientProjector(model, 3 * 5 + 2 * 3 + 2)
    assert all(proj.dims[n] == matrix_shape(p) for n, p in proj.params.items())
    want = torch.cat([g.flatten(1) for g in loop_per_sample_grads(
        model, ids, y, nn.MSELoss()).values()], dim=1)
    torch.testing.assert_close(proj(ids, y, nn.MSELoss()), want, rtol=1e-12, atol=1e-14)


def test_split_and_bad_arguments():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 3))
    proj = GradientProjector(model, 50)  # equal shares from the smallest; the rest passes on
    # 1.bias whole (3 of 16); 1.weight's 23 as 3 x 7 (rows whole); 0.weight's 26 as 3 x 8
    # (columns whole: less spread than 5 x 5); the 2 left over fit no pair with less spread
    assert proj.dims == {"0.weight": (3, 8), "1.weight": (3, 7), "1.bias": (3, 1)}
    assert proj.dim == 48
    assert GradientProjector(model, 24, params=["1.weight"]).dims == {"1.weight": (3, 8)}
    with pytest.raises(ValueError, match="kind must be one of"):
        GradientProjector(model, 10, kind="sparse")
    with pytest.raises(ValueError, match="dim must be an int"):
        GradientProjector(model, 10_000)
    with pytest.raises(ValueError, match="grads lacks"):
        GradientProjector(model, 10).project({})
