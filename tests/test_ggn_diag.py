"""Per-sample GGN diagonals against the loop in float64: for each sample alone,
``diag(J_n^T H_n J_n)`` from its output's Jacobian (``autograd.grad`` per output) and
its loss's Hessian at the output (``torch.func.hessian``); the Monte Carlo form against
the same draws by hand, and its mean over many draws against the exact one."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import hessian

from persample.curvature import ggn_diag, label_sampler, per_sample_ggn_diag

N = 6


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv1d(2, 3, 3), nn.Linear(9, 4)

    def forward(self, x):  # (n, 2, 5)
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(13, 8), nn.LayerNorm(8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, ids):  # (n, 5)
        return self.head(self.layer(self.norm(self.emb(ids))).mean(1))


def _case(kind: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4))
        x = torch.randn(N, 5, generator=g)
    elif kind == "conv":
        model, x = Conv(), torch.randn(N, 2, 5, generator=g)
    else:
        model, x = Tokens(), torch.randint(0, 13, (N, 5), generator=g)
    return model.double(), x, torch.randint(0, 4, (N,), generator=g)


def ggn_diag_by_loop(model, one_sample, labels, loss_fn):
    """``{name: (B, *shape)}``: each sample's ``diag(J^T H J)`` alone, its Jacobian by
    ``autograd.grad`` per output of ``one_sample(i)`` ``(1, C)``, its loss Hessian by
    ``torch.func.hessian``."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = {name: [] for name in params}
    for i in range(len(labels)):
        out = one_sample(i)[0]  # (C,)
        h = hessian(lambda o, i=i: loss_fn(o[None], labels[i:i + 1]))(out.detach())  # (C, C)
        jac = [torch.autograd.grad(out[c], list(params.values()), retain_graph=True,
                                   allow_unused=True) for c in range(len(out))]
        for k, (name, p) in enumerate(params.items()):
            j = torch.stack([torch.zeros_like(p) if row[k] is None else row[k] for row in jac])
            rows[name].append(torch.einsum("c...,cd,d...->...", j, h, j))
    return {name: torch.stack(r) for name, r in rows.items()}


def _loop(model, x, y, loss_fn):
    return ggn_diag_by_loop(model, lambda i: model(x[i:i + 1]), y[:N], loss_fn)


@pytest.mark.parametrize("kind", ["mlp", "conv", "tokens"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_exact_per_sample_diagonal_matches_the_loop(kind, loss):
    model, x, y = _case(kind)
    loss_fn = nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss()
    if loss == "mse":
        y = torch.randn(N, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = _loop(model, x, y, loss_fn)
    got = per_sample_ggn_diag(model, x, y, loss_fn)
    assert list(got) == list(want)
    for name, d in want.items():
        torch.testing.assert_close(got[name], d, rtol=1e-9, atol=1e-12, msg=name)
    total = ggn_diag(model, x, y, loss_fn)
    for name, d in want.items():
        torch.testing.assert_close(total[name], d.sum(0), rtol=1e-9, atol=1e-12, msg=name)
    flat = per_sample_ggn_diag(model, x, y, loss_fn, flat=True)
    assert flat.shape == (N, sum(p.numel() for p in model.parameters()))


def test_monte_carlo_draws_by_hand_and_their_mean():
    model, x, y = _case("mlp")
    loss_fn = nn.CrossEntropyLoss()
    got = per_sample_ggn_diag(model, x, y, loss_fn, mc_samples=3,
                              generator=torch.Generator().manual_seed(4))
    draw = label_sampler(loss_fn, torch.Generator().manual_seed(4))
    out = model(x)
    cot = torch.stack([draw(out.detach(), y) for _ in range(3)])  # (3, N, C)
    params = dict(model.named_parameters())
    want = {name: torch.zeros(N, *p.shape, dtype=p.dtype) for name, p in params.items()}
    for i in range(N):
        for m in range(3):
            grads = torch.autograd.grad(out[i], list(params.values()), cot[m, i],
                                        retain_graph=True)
            for (name, _), gr in zip(params.items(), grads):
                want[name][i] += gr.square() / 3
    for name, d in want.items():
        torch.testing.assert_close(got[name], d, rtol=1e-9, atol=1e-12, msg=name)
    many = ggn_diag(model, x, y, loss_fn, mc_samples=4000,
                    generator=torch.Generator().manual_seed(5))["2.weight"]
    exact = ggn_diag(model, x, y, loss_fn)["2.weight"]
    assert float((many - exact).abs().max() / exact.abs().max()) < 0.1


def test_bad_options():
    model, x, y = _case("mlp")
    with pytest.raises(ValueError, match="mc_samples must be an int >= 0"):
        per_sample_ggn_diag(model, x, y, nn.CrossEntropyLoss(), mc_samples=-1)
    with pytest.raises(ValueError, match="Monte Carlo curvature .* draws labels"):
        per_sample_ggn_diag(model, x, y, lambda o, t: o.sum(1), mc_samples=1)
