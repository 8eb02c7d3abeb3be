"""K-FAC factors (``persample.curvature.KFAC``) against K-FAC built by hand in float64:
module hooks record each layer's inputs and the gradients at its outputs for every
cotangent column (the loss Hessian's square-root columns, the loss gradient at the
labels, or at labels drawn from the model's distribution), and the factors follow
Martens & Grosse 2015 and, over positions, Eschenhagen et al. 2023 (expand, reduce)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import hessian, vmap

from persample.curvature import KFAC, label_sampler

N, T = 7, 3


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Positions(nn.Module):
    """A linear map shared over T positions, then pooled: weight sharing."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 4)

    def forward(self, x):  # (n, T, 5)
        return self.fc2(torch.tanh(self.fc1(x)).sum(1))


class Lookup(nn.Module):
    """An embedding lookup at T positions and a linear head; a LayerNorm (no factors)."""

    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.fc = nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 4)

    def forward(self, ids):  # (n, T)
        return self.fc(self.norm(self.emb(ids)).mean(1))


def _data(model_kind: str):
    g = torch.Generator().manual_seed(0)
    x = {"mlp": lambda: torch.randn(N, 5, generator=g),
         "positions": lambda: torch.randn(N, T, 5, generator=g),
         "lookup": lambda: torch.randint(0, 11, (N, T), generator=g),
         "conv": lambda: torch.randn(N, 2, 5, 6, generator=g)}[model_kind]()
    return x, torch.randint(0, 4, (N,), generator=g)


class Conv(nn.Module):
    """2-d and 1-d convolutions over their patches (padding, stride, dilation)."""

    def __init__(self):
        super().__init__()
        self.conv2 = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.conv1 = nn.Conv1d(3, 4, 2, dilation=2)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # (n, 2, 5, 6)
        h = torch.tanh(self.conv2(x))  # (n, 3, 3, 3)
        return self.fc(torch.tanh(self.conv1(h.flatten(2))).mean(2))  # (n, 3, 9) -> (n, 4)


MODELS = {"mlp": Mlp, "positions": Positions, "lookup": Lookup, "conv": Conv}


def _cotangents(fisher: str, out: torch.Tensor, y: torch.Tensor, loss_fn, generator=None):
    """``(v, n, C)``: the Hessian's square-root columns, or loss gradients (by hand)."""
    if fisher == "type-2":
        h = vmap(hessian(lambda o, t: loss_fn(o[None], t[None])))(out.detach(), y)
        values, vectors = torch.linalg.eigh(h)
        return (vectors * values.clamp(min=0).sqrt()[:, None, :]).permute(2, 0, 1)
    if fisher == "mc":
        y = label_sampler(loss_fn, generator)(out.detach(), y)  # the definition of the draw
        return y.unsqueeze(0)
    o = out.detach().requires_grad_(True)
    losses = nn.functional.cross_entropy(o, y, reduction="none")
    return torch.autograd.grad(losses.sum(), o)[0].unsqueeze(0)


def _patches(m, x):
    """``(n, t, c*k)``: the input under every placement of the kernel (``F.unfold``)."""
    if isinstance(m, nn.Conv1d):
        x = x.unsqueeze(2)
        kernel, dilation = (1, m.kernel_size[0]), (1, m.dilation[0])
        padding, stride = (0, m.padding[0]), (1, m.stride[0])
    else:
        kernel, dilation, padding, stride = m.kernel_size, m.dilation, m.padding, m.stride
    return nn.functional.unfold(x, kernel, dilation, padding, stride).transpose(1, 2)


def _by_hand(model, x, y, loss_fn, fisher, kind, generator=None):
    """``{module: (A, G)}`` from hooks: inputs and output gradients of each Linear (and
    the ids of the Embedding), per cotangent column."""
    inputs, grads = {}, {}
    mods = {n: m for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d))}

    def forward_hook(name):
        def hook(module, args, output):
            inputs[name] = args[0].detach()
            output.register_hook(lambda g: grads.setdefault(name, []).append(g.detach()))
        return hook

    handles = [m.register_forward_hook(forward_hook(n)) for n, m in mods.items()]
    try:
        out = model(x)
    finally:
        for h in handles:
            h.remove()
    cot = _cotangents(fisher, out, y, loss_fn, generator)
    for c in range(len(cot)):
        torch.autograd.grad(out, list(model.parameters()), cot[c], retain_graph=True,
                            allow_unused=True)
    found = {}
    for name, m in mods.items():
        a = inputs[name]
        if isinstance(m, (nn.Conv1d, nn.Conv2d)):  # positions last: move them before d
            gs = [g.flatten(2).transpose(1, 2) for g in grads[name]]  # (n, t, o)
            a = _patches(m, a)  # (n, t, c*k)
        else:
            gs = [g.reshape(N, -1, g.shape[-1]) for g in grads[name]]  # each (n, t, d_out)
        if kind == "expand":
            G = sum(torch.einsum("nti,ntj->ij", g, g) for g in gs) / N
        else:
            G = sum(g.sum(1).T @ g.sum(1) for g in gs) / N
        if fisher == "mc":
            G = G / len(cot)
        if isinstance(m, nn.Embedding):
            A = torch.bincount(a.reshape(-1), minlength=m.num_embeddings).double() / a.numel()
        else:
            a = a.reshape(N, -1, a.shape[-1])  # (n, t, d_in)
            A = (torch.einsum("nti,ntj->ij", a, a) / a[:, :, 0].numel() if kind == "expand"
                 else a.mean(1).T @ a.mean(1) / N)
        found[name] = (A, G)
    return found


@pytest.mark.parametrize("kind", ["expand", "reduce"])
@pytest.mark.parametrize("fisher", ["type-2", "empirical", "mc"])
@pytest.mark.parametrize("model_kind", list(MODELS))
def test_factors_match_kfac_by_hand(model_kind, fisher, kind):
    torch.manual_seed(0)
    model = MODELS[model_kind]().double()
    x, y = _data(model_kind)
    loss_fn = nn.CrossEntropyLoss()
    kfac = KFAC(model, fisher=fisher, kind=kind, generator=torch.Generator().manual_seed(5))
    kfac.update(x, y, loss_fn)
    want = _by_hand(model, x, y, loss_fn, fisher, kind, torch.Generator().manual_seed(5))
    factors = kfac.factors
    for name, (A, G) in want.items():
        weight = name + ".weight"
        (got,) = factors[weight]
        assert got.rows == ("A" if name == "emb" else "G")
        torch.testing.assert_close(got.A, A, rtol=1e-10, atol=1e-12, msg=weight)
        torch.testing.assert_close(got.G, G, rtol=1e-10, atol=1e-12, msg=weight)
        if name != "emb":  # the bias: A = 1, G the weight's
            (bias,) = factors[name + ".bias"]
            torch.testing.assert_close(bias.A, torch.ones(1, 1, dtype=A.dtype))
            torch.testing.assert_close(bias.G, G, rtol=1e-10, atol=1e-12)
    if model_kind == "lookup":  # the LayerNorm: its exact diagonal
        assert set(kfac.diagonals) == {"norm.weight", "norm.bias"}


def test_the_diagonal_of_the_rest_is_the_ggns():
    """A parameter without factors: the exact diagonal of ``sum_n J_n^T H_n J_n / N``
    (type-2), from the loop's per-sample Jacobians."""
    torch.manual_seed(0)
    model = Lookup().double()
    x, y = _data("lookup")
    loss_fn = nn.CrossEntropyLoss()
    kfac = KFAC(model, fisher="type-2", params=["norm.weight", "norm.bias", "fc.weight"])
    kfac.update(x, y, loss_fn)
    want = {"norm.weight": 0, "norm.bias": 0}
    for i in range(N):
        out = model(x[i:i + 1])
        h = hessian(lambda o, i=i: loss_fn(o, y[i:i + 1]))(out.detach())[0, :, 0]  # (C, C)
        params = [model.norm.weight, model.norm.bias]
        jac = [torch.stack([torch.autograd.grad(out[0, c], p, retain_graph=True)[0]
                            for c in range(4)]) for p in params]  # (C, *shape)
        for name, j in zip(want, jac):
            want[name] = want[name] + torch.einsum("c...,cd,d...->...", j, h, j) / N
    for name, d in want.items():
        torch.testing.assert_close(kfac.diagonals[name], d, rtol=1e-10, atol=1e-12)
    assert set(kfac.factors) == {"fc.weight"}


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
def test_accumulated_over_batches(fisher):
    """Three batches, the last of one sample: the factors of their union."""
    torch.manual_seed(0)
    model = Mlp().double()
    x, y = _data("mlp")
    both = KFAC(model, fisher=fisher)
    both.update(x[:3], y[:3], nn.CrossEntropyLoss())
    both.update(x[3:6], y[3:6], nn.CrossEntropyLoss())
    both.update(x[6:], y[6:], nn.CrossEntropyLoss())  # a batch of one: captured too
    assert not both.diagonals
    whole = KFAC(model, fisher=fisher)
    whole.update(x, y, nn.CrossEntropyLoss())
    assert both.num_data == whole.num_data == N
    for name, uses in whole.factors.items():
        torch.testing.assert_close(both.factors[name][0].A, uses[0].A, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(both.factors[name][0].G, uses[0].G, rtol=1e-12, atol=1e-14)


def test_bad_options_are_named():
    model = Mlp().double()
    with pytest.raises(ValueError, match="fisher must be one of"):
        KFAC(model, fisher="exact")
    with pytest.raises(ValueError, match="kind must be one of"):
        KFAC(model, kind="mean")
    with pytest.raises(ValueError, match="mc_samples must be an int >= 1"):
        KFAC(model, fisher="mc", mc_samples=0)
    x, y = _data("mlp")
    with pytest.raises(ValueError, match="Monte Carlo curvature .* draws labels"):
        KFAC(model, fisher="mc").update(x, y, lambda o, t: (o - 1).square().sum(1))
    with pytest.raises(ValueError, match=r"fisher='type-2' takes a model output \(B, C\)"):
        KFAC(nn.Linear(5, 4).double(), fisher="type-2").update(
            torch.randn(N, T, 5), torch.randn(N, T, 4), lambda o, t: (o - t).square().sum((1, 2)))
