"""``secure_mode=True``: the DP noise (and ``make_private``'s Poisson sampling) from the
operating system's cryptographically secure generator, on every entry point: the right
distribution, a fresh draw every release, torch's generators never read, and the same
clipped sums as the seeded mode."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

from persample.dp import PoissonBatchSampler, PrivateStep, make_private, private_grad
from persample.dp.noise import SecureSource, secure_normal, secure_uniform

SIGMA, C, B = 1.5, 0.5, 8


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 300), nn.Tanh(), nn.Linear(300, 10))


def _data(n=B):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 40, generator=g), torch.randint(0, 10, (n,), generator=g)


def _flat(net):
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def test_secure_normal_is_standard_normal():
    z = secure_normal(300_000, 2.0, torch.float64) / 2.0
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-3
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    u = secure_uniform(100_000)
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    assert secure_normal(7, 1.0).shape == (7,) and secure_normal(0, 1.0).shape == (0,)


def test_private_grad_noise_is_secure_and_exact():
    """With the noise subtracted by sigma 0's sums: N(0, (sigma C / B)^2) per coordinate,
    a new draw each call, and torch's default generator never read."""
    x, y = _data()
    net = _net()
    private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=C, noise_multiplier=0.0,
                 secure_mode=True)
    exact = _flat(net)
    seeded = _net()
    private_grad(seeded, x, y, nn.CrossEntropyLoss(), max_grad_norm=C, noise_multiplier=0.0)
    torch.testing.assert_close(exact, _flat(seeded), rtol=0, atol=0)  # the same sums
    before = torch.get_rng_state()
    draws = []
    for _ in range(2):
        got = private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=C,
                           noise_multiplier=SIGMA, secure_mode=True)
        assert got.norms.shape == (B,)
        draws.append((_flat(net) - exact) / (SIGMA * C / B))
    assert torch.equal(before, torch.get_rng_state())  # the seeded generator was not used
    for z in draws:
        assert stats.kstest(z.double().numpy(), "norm").pvalue > 1e-4
    assert not torch.equal(draws[0], draws[1])


def test_private_step_and_its_checkpoint():
    net = _net()
    step = PrivateStep(net, nn.CrossEntropyLoss(), max_grad_norm=C, noise_multiplier=SIGMA,
                       expected_batch_size=B, secure_mode=True)
    assert isinstance(step.generator, SecureSource)
    x, y = _data()
    before = torch.get_rng_state()
    step.accumulate(x[:4], y[:4])
    step.accumulate(x[4:], y[4:])
    assert step.state_dict()["generator"] is None  # nothing to save: no seed
    step.release()
    assert torch.equal(before, torch.get_rng_state())
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())


@pytest.mark.parametrize("call", ["private_grad", "PrivateStep", "make_private"])
def test_a_generator_and_secure_mode_are_refused(call):
    net, (x, y) = _net(), _data()
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="secure_mode=True.*no seed.*one or the other"):
        if call == "private_grad":
            private_grad(net, x, y, nn.CrossEntropyLoss(), max_grad_norm=C,
                         noise_multiplier=SIGMA, generator=gen, secure_mode=True)
        elif call == "PrivateStep":
            PrivateStep(net, nn.CrossEntropyLoss(), max_grad_norm=C, noise_multiplier=SIGMA,
                        expected_batch_size=B, generator=gen, secure_mode=True)
        else:
            make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                         TensorDataset(*_data(100)), nn.CrossEntropyLoss(),
                         noise_multiplier=SIGMA, epochs=1, max_grad_norm=C,
                         expected_batch_size=B, generator=gen, secure_mode=True)
    with pytest.raises(ValueError, match="secure_mode must be True or False"):
        PrivateStep(net, nn.CrossEntropyLoss(), max_grad_norm=C, noise_multiplier=SIGMA,
                    expected_batch_size=B, secure_mode="yes")


def _secure_run(n: int) -> tuple[list[int], torch.Tensor]:
    torch.manual_seed(0)  # what a seeded run would repeat
    net = _net()
    private = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                           TensorDataset(*_data(n)), nn.CrossEntropyLoss(),
                           noise_multiplier=SIGMA, epochs=3, max_grad_norm=C,
                           expected_batch_size=40, secure_mode=True)
    assert isinstance(private.sampler.generator, SecureSource)
    assert isinstance(private.step.generator, SecureSource)
    sizes = []
    for _ in range(private.epochs):
        for logical in private.batches():
            sizes.append(sum(len(y) for x, y in logical
                             for _ in [private.accumulate(x, y)]))
            private.release()
    return sizes, torch.cat([p.detach().flatten() for p in net.parameters()])


def test_make_private_samples_and_noises_securely():
    """The Poisson sampling from the OS too: each logical batch's size is Binomial(N, q),
    and two runs from the same torch seed differ (nothing seeded decides them)."""
    n = 400
    sizes, last = _secure_run(n)
    again, other = _secure_run(n)
    assert len(sizes) == 30 and len(set(sizes)) > 5
    assert sizes != again and not torch.equal(last, other)
    mean, sd = 40, math.sqrt(n * 0.1 * 0.9)
    assert abs(sum(sizes + again) / 60 - mean) < 4 * sd / math.sqrt(60)


def test_the_secure_sampler_is_one_process_only():
    with pytest.raises(ValueError, match="seeded alike on every rank"):
        PoissonBatchSampler(100, 0.1, generator=SecureSource(), rank=0, world_size=2)
