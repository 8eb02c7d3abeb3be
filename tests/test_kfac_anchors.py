"""K-FAC factors against curvlinops' ``KFACLinearOperator`` in float64 (its Kronecker
factors of each layer), where it runs: linear layers, weight sharing over positions,
a 2-d convolution; the type-2 Fisher, the empirical one and the Monte Carlo one with
the same seed, expand and reduce."""

from __future__ import annotations

import curvlinops  # installed by the README's set-up (--no-deps, beside the test extra)
import pytest
import torch
from torch import nn

from persample import KFAC
from test_kfac import Mlp, Positions, _data


class Conv2(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.fc = nn.Linear(27, 4)

    def forward(self, x):  # (n, 2, 5, 6)
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


MODELS = {"mlp": Mlp, "positions": Positions, "conv": Conv2}


@pytest.mark.parametrize("kind", ["expand", "reduce"])
@pytest.mark.parametrize("fisher", ["type-2", "empirical", "mc"])
@pytest.mark.parametrize("model_kind", list(MODELS))
def test_factors_match_curvlinops(model_kind, fisher, kind):
    torch.manual_seed(0)
    model = MODELS[model_kind]().double()
    x, y = _data(model_kind)
    x = x.double() if x.is_floating_point() else x
    loss_fn = nn.CrossEntropyLoss()
    theirs = curvlinops.KFACLinearOperator(
        model, loss_fn, list(model.parameters()), [(x, y)], fisher_type=fisher,
        kfac_approx=kind, check_deterministic=False, seed=5, mc_samples=1)
    theirs.compute_kronecker_factors()
    ours = KFAC(model, fisher=fisher, kind=kind, generator=torch.Generator().manual_seed(5))
    ours.update(x, y, loss_fn)
    compared = 0
    for name in theirs._input_covariances:
        (f,) = ours.factors[f"{name}.weight"]
        torch.testing.assert_close(f.A, theirs._input_covariances[name], rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(f.G, theirs._gradient_covariances[name], rtol=1e-8,
                                   atol=1e-12)
        compared += 1
    assert compared == 2


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
def test_ekfac_eigenvalues_match_curvlinops(fisher):
    """EK-FAC's corrected eigenvalues against curvlinops' ``EKFACLinearOperator`` (64
    samples: distinct eigenvalues, so the bases agree up to signs, which the squares
    do not see)."""
    from persample.influence import EKFAC

    torch.manual_seed(0)
    model = Mlp().double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (64,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    theirs = curvlinops.EKFACLinearOperator(model, loss_fn, list(model.parameters()),
                                            [(x, y)], fisher_type=fisher,
                                            check_deterministic=False)
    theirs.compute_kronecker_factors()
    theirs.compute_eigenvalue_correction()
    kfac = KFAC(model, fisher=fisher, shared="diagonal")
    kfac.update(x, y, loss_fn)
    ekfac = EKFAC(kfac)
    ekfac.update(x, y, loss_fn)
    names = [name for name, _ in model.named_parameters()]
    compared = 0
    for module in ("fc1", "fc2"):
        for pos, values in theirs._corrected_eigenvalues[module].items():
            ours = ekfac.bases[names[pos]].values
            torch.testing.assert_close(ours, values.reshape(ours.shape), rtol=1e-8,
                                       atol=1e-14)
            compared += 1
    assert compared == 4
