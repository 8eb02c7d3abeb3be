"""``make_private``: DP-SGD set up from a privacy target in one call, the model and the
optimizer left as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from persample.dp import PrivateStep, make_private, noise_multiplier_for

N, B = 400, 40  # q = 0.1: 10 logical batches an epoch


def _setup(seed: int = 0, **kw):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g))
    opts = dict(target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0,
                expected_batch_size=B, physical_batch_size=16,
                generator=torch.Generator().manual_seed(seed)) | kw
    return net, opt, make_private(net, opt, data, nn.CrossEntropyLoss(), **opts)


def _train(private) -> list[list[int]]:
    sizes = []
    for _ in range(private.epochs):
        for logical in private.batches():
            parts = [len(y) for x, y in logical for _ in [private.accumulate(x, y)]]
            sizes.append(parts)
            private.release()
    return sizes


def test_the_target_is_spent_over_the_planned_steps():
    net, opt, private = _setup()
    assert private.sample_rate == B / N and private.steps_per_epoch == 10
    assert private.noise_multiplier == pytest.approx(
        noise_multiplier_for(3.0, 1e-5, 0.1, 20), rel=1e-9)
    assert isinstance(private.step, PrivateStep)
    sizes = _train(private)
    assert private.step.accountant.steps == len(sizes) == 20
    assert 0.98 * 3.0 <= private.epsilon(1e-5) <= 3.0
    # physical batches of at most 16, a logical batch whole (Poisson: sizes vary)
    assert all(all(0 < s <= 16 for s in parts) for parts in sizes)
    assert all(all(s == 16 for s in parts[:-1]) for parts in sizes)
    assert len({sum(parts) for parts in sizes}) > 1


def test_the_model_and_the_optimizer_are_not_wrapped():
    net, opt, private = _setup()
    params = list(net.parameters())
    _train(private)
    assert type(net) is nn.Sequential and type(opt) is torch.optim.SGD
    assert list(net.parameters()) == params and opt.param_groups[0]["params"] == params
    assert not net._forward_hooks and all(not m._forward_hooks for m in net.modules())
    assert all(p.grad is None for p in params)  # release zeroes them after the step


def test_a_seed_reproduces_the_run():
    runs = []
    for _ in range(2):
        net, _, private = _setup(seed=5)
        _train(private)
        runs.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    other, _, private = _setup(seed=6)
    _train(private)
    assert not torch.equal(runs[0][0], other[0].weight)


@pytest.mark.parametrize(("bad", "match"), [
    (dict(expected_batch_size=N + 1), "at most the number of samples"),
    (dict(physical_batch_size=0), "physical_batch_size must be an int >= 1"),
    (dict(epochs=0), "epochs must be an int >= 1"),
    (dict(target_epsilon=-1.0), "epsilon"),
])
def test_bad_plans_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        _setup(**bad)
