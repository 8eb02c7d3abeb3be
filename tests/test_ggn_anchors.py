"""Per-sample GGN diagonals against BackPACK's ``BatchDiagGGNExact`` and their sum
against its ``DiagGGNExact`` on an ``nn.Sequential`` (a convolution, linear layers),
in float64. BackPACK's are of the batch loss: with ``reduction="mean"`` each sample's
term is its own GGN diagonal over the batch size."""

from __future__ import annotations

import copy

import backpack  # installed by the README's set-up (--no-deps, beside the test extra)
import pytest
import torch
from backpack.extensions import BatchDiagGGNExact, DiagGGNExact
from torch import nn

from persample import ggn_diag, per_sample_ggn_diag


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_against_backpack(reduction, loss):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 5),
                          nn.Tanh(), nn.Linear(5, 4)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 1, 6, 6, generator=g, dtype=torch.float64)
    y = (torch.randint(0, 4, (6,), generator=g) if loss == "ce"
         else torch.randn(6, 4, generator=g, dtype=torch.float64))
    make = nn.CrossEntropyLoss if loss == "ce" else nn.MSELoss
    theirs = backpack.extend(copy.deepcopy(model))  # (BackPACK keeps hooks on its copy)
    with pytest.warns(UserWarning), backpack.backpack(BatchDiagGGNExact(), DiagGGNExact()):
        backpack.extend(make(reduction=reduction))(theirs(x), y).backward()
    ours = per_sample_ggn_diag(model, x, y, make(reduction=reduction))
    total = ggn_diag(model, x, y, make(reduction=reduction))
    # BackPACK's terms are of the batch loss: a mean divides each sample's by the batch
    # (MSE's mean also by the output's size, which each sample's own loss has too)
    scale = 1 / 6 if reduction == "mean" else 1.0
    for (name, _), p in zip(model.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.diag_ggn_exact_batch, ours[name] * scale, rtol=1e-9,
                                   atol=1e-13, msg=name)
        torch.testing.assert_close(p.diag_ggn_exact, total[name] * scale, rtol=1e-9,
                                   atol=1e-13, msg=name)
