"""Adaptive clipping (Andrew et al. 2021) in PrivateStep and Opacus's
``clipping="adaptive"`` through PrivacyEngine: against the update written by hand from
the loop's per-sample gradients in float64 (the count's noise made negligible), and
the two noises' statistics."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from battery import TOL, clipped_sum_by_hand
from cases import BY_ID, build
from persample import loop_per_sample_grads
from persample.dp import AdaptiveClipping, PrivacyEngine, PrivateStep

B, STEPS = 8, 5
QUIET = 1e-9  # sigma_b: the count's noise far below one sample


def _ada(**options) -> AdaptiveClipping:
    return AdaptiveClipping(**{"target_unclipped_quantile": 0.5, "unclipped_num_std": QUIET,
                               "clipbound_learning_rate": 0.5, **options})


def _batches(inputs, targets):
    """STEPS consecutive batches of B."""
    for t in range(STEPS):
        part = slice(t * B, (t + 1) * B)
        yield inputs[part], targets[part]


def test_the_clipping_norm_follows_the_update_by_hand():
    """Five steps of two micro-batches each, SGD between them, C starting at 2x the
    first batch's median norm: each step's p.grad is the clipped mean at that step's C,
    and the next C is C exp(-eta (unclipped / B - gamma)) from the unclipped count over
    both parts."""
    c = BY_ID["simple-cnn"]
    model, inputs, targets = build(c, B * STEPS)
    loss_fn = c["loss_fn"]("mean")
    first = loop_per_sample_grads(model, inputs[:B], targets[:B], loss_fn)
    norms0 = sum(g.flatten(1).pow(2).sum(1) for g in first.values()).sqrt()
    ada = _ada(clipbound_learning_rate=1.0)
    C = 2 * float(norms0.median())
    step = PrivateStep(model, loss_fn, max_grad_norm=C, noise_multiplier=0.0,
                       expected_batch_size=B, adaptive_clipping=ada,
                       generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for x, y in _batches(inputs, targets):
        grads = loop_per_sample_grads(model, x, y, loss_fn)
        norms = sum(g.flatten(1).pow(2).sum(1) for g in grads.values()).sqrt()
        C = step.max_grad_norm  # this step's
        want = clipped_sum_by_hand(grads, C, divisor=B)
        step.accumulate(x[:3], y[:3])
        step.accumulate(x[3:], y[3:])
        step.release()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], **TOL, msg=name)
        unclipped = int((norms + 1e-6 <= C).sum())
        seen.append(unclipped)
        after = C * math.exp(-ada.clipbound_learning_rate * (unclipped / B - 0.5))
        assert step.max_grad_norm == pytest.approx(after, rel=1e-8)  # the count's noise
        opt.step()
    assert seen[0] == B and min(seen) < B  # C came down until some samples were clipped


def test_the_two_noises_and_the_accounted_sigma():
    """sigma 1, sigma_b 2: the gradient's noise has std sigma_g C / B' with sigma_g =
    (1 - 1/16)^-1/2 (the count takes its share), the count's noise has std 2 (read back
    from C's moves over releases of nothing), and the accountant records sigma."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(100, 300), nn.Tanh(), nn.Linear(300, 100))
    ada = AdaptiveClipping(target_unclipped_quantile=0.5, unclipped_num_std=2.0,
                           clipbound_learning_rate=0.1)
    step = PrivateStep(net, nn.MSELoss(), max_grad_norm=3.0, noise_multiplier=1.0,
                       expected_batch_size=10, adaptive_clipping=ada, sample_rate=0.1,
                       generator=torch.Generator().manual_seed(0))
    step.release()  # nothing accumulated: the noise alone
    z = torch.cat([p.grad.flatten() for p in net.parameters()])  # 60,400 numbers
    sigma_g = (1 - 1 / 16) ** -0.5
    assert abs(float(z.std()) / (sigma_g * 3.0 / 10) - 1) < 0.02
    small = nn.Linear(2, 1)
    step = PrivateStep(small, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=1.0,
                       expected_batch_size=10, adaptive_clipping=ada, sample_rate=0.1,
                       generator=torch.Generator().manual_seed(1))
    counts = []
    for _ in range(2000):
        before = step.max_grad_norm
        step.release()  # no sample: the noised count is the noise alone
        counts.append((0.5 - math.log(step.max_grad_norm / before) / 0.1) * 10)
    counts = torch.tensor(counts)
    assert abs(float(counts.mean())) < 0.15 and abs(float(counts.std()) / 2.0 - 1) < 0.05
    assert step.accountant.history == [[1.0, 0.1, 2000]]


def test_bounds_and_the_checkpoint():
    c = BY_ID["mlp"]
    model, inputs, targets = build(c, B)
    loss_fn = c["loss_fn"]("mean")
    ada = _ada(max_clipbound=2.0, min_clipbound=1.5, clipbound_learning_rate=10.0)
    step = PrivateStep(model, loss_fn, max_grad_norm=1.8, noise_multiplier=0.0,
                       expected_batch_size=B, adaptive_clipping=ada)
    step.accumulate(inputs, targets)
    step.release()
    assert step.max_grad_norm in (1.5, 2.0)  # a large step, held within the bounds
    step.accumulate(inputs[:3], targets[:3])
    saved = step.state_dict()
    again = PrivateStep(model, loss_fn, max_grad_norm=1.8, noise_multiplier=0.0,
                        expected_batch_size=B, adaptive_clipping=ada)
    again.load_state_dict(saved)
    assert again.max_grad_norm == step.max_grad_norm and again.unclipped == step.unclipped
    assert again.bounds.bounds == (step.max_grad_norm,)


@pytest.mark.parametrize(("options", "ada", "match"), [
    (dict(noise_multiplier=2.0), dict(unclipped_num_std=1.0),
     r"noise_multiplier < 2 \* unclipped_num_std \(2\), got 2"),
    (dict(per_layer=True), {}, r"moves one clipping norm"),
    (dict(max_grad_norm="automatic"), {}, r"moves one clipping norm"),
])
def test_what_adaptive_clipping_refuses(options, ada, match):
    net = nn.Linear(3, 2)
    kwargs = dict(max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=4,
                  adaptive_clipping=_ada(**{"unclipped_num_std": 1.0, **ada}))
    with pytest.raises(ValueError, match=match):
        PrivateStep(net, nn.MSELoss(), **{**kwargs, **options})


def test_bad_options_and_user_ids_are_refused():
    for bad, match in [(dict(target_unclipped_quantile=1.5), "target_unclipped_quantile"),
                       (dict(unclipped_num_std=0.0), "unclipped_num_std must be > 0"),
                       (dict(min_clipbound=2.0, max_clipbound=1.0), "min_clipbound")]:
        with pytest.raises(ValueError, match=match):
            _ada(**bad)
    net = nn.Linear(3, 2)
    step = PrivateStep(net, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=0.0,
                       expected_batch_size=4, adaptive_clipping=_ada())
    with pytest.raises(ValueError, match="not users"):
        step.accumulate(torch.randn(4, 3), torch.randn(4, 2), torch.arange(4))


def test_opacus_adaptive_clipping_through_privacy_engine():
    """Opacus's clipping="adaptive" and its options: the engine's step is PrivateStep
    with AdaptiveClipping (the same C after each logical batch as by hand)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(120, 6, generator=g),
                         torch.randint(0, 3, (120,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    twin = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    twin.load_state_dict(model.state_dict())
    engine = PrivacyEngine()
    options = dict(target_unclipped_quantile=0.5, unclipped_num_std=QUIET,
                   clipbound_learning_rate=0.5, max_clipbound=10.0, min_clipbound=1e-3)
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=20), noise_multiplier=0.0,
        max_grad_norm=0.05, clipping="adaptive", **options)
    by_hand = PrivateStep(twin, nn.CrossEntropyLoss(), max_grad_norm=0.05,
                          noise_multiplier=0.0, expected_batch_size=20,
                          adaptive_clipping=AdaptiveClipping(**options))
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    bounds = []
    for k, (x, y) in enumerate(loader):
        if k == 4:
            break
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(private(x), y).backward()
        optimizer.step()
        by_hand.accumulate(x, y)
        by_hand.release()
        twin_opt.step()
        bounds.append(optimizer.max_grad_norm)
        assert optimizer.max_grad_norm == pytest.approx(by_hand.max_grad_norm, rel=1e-9)
    assert len(set(bounds)) == 4  # C moved every step
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    for bad, match in [(dict(clipping="adaptive"), "needs target_unclipped_quantile"),
                       (dict(target_unclipped_quantile=0.5), "with clipping='adaptive' only")]:
        with pytest.raises(ValueError, match=match):
            PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(data, batch_size=20), noise_multiplier=1.0,
                max_grad_norm=1.0, **bad)


def test_make_private_takes_it():
    """make_private's step clips adaptively: C moves at each logical batch; with user_ids
    it is refused."""
    from persample.dp import make_private

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g))
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ada = AdaptiveClipping(target_unclipped_quantile=0.5, unclipped_num_std=2.0)
    training = make_private(model, opt, data, nn.CrossEntropyLoss(), epochs=1,
                            max_grad_norm=5.0, noise_multiplier=1.0, expected_batch_size=40,
                            physical_batch_size=16, adaptive_clipping=ada,
                            generator=torch.Generator().manual_seed(0))
    bounds = []
    for physical in training.batches():
        for x, y in physical:
            training.accumulate(x, y)
        training.release()
        bounds.append(training.step.max_grad_norm)
    assert len(bounds) == training.steps_per_epoch and len(set(bounds)) == len(bounds)
    with pytest.raises(ValueError, match="user_ids or adaptive_clipping, not both"):
        make_private(model, opt, data, nn.CrossEntropyLoss(), epochs=1, max_grad_norm=5.0,
                     noise_multiplier=1.0, expected_batch_size=40, adaptive_clipping=ada,
                     user_ids=torch.arange(200) // 2)
