"""PrivateStep: micro-batches accumulated then released equal private_grad on their
concatenation (float64, noise 0), the noise's std is sigma * C / expected_batch_size, the
model and p.grad are untouched by accumulate, a parameter changed mid-step is named, and
the state (sums, samples, generator; the accountant's) round-trips a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from persample.dp import PrivacyAccountant, PrivateStep, private_grad

B = T = E = 4  # sizes chosen to coincide


class Net(nn.Module):
    """A conv (materialised norms), a wide linear (ghost norm) and an embedding."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 2)
        self.fc = nn.Linear(27, 16)
        self.emb = nn.Embedding(5, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:  # (b, 1, 4, 4), (b,)
        h = torch.tanh(self.fc(torch.tanh(self.conv(x)).flatten(1))) + self.emb(ids)
        return self.head(h)


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 4, 4, generator=g)
    ids = torch.randint(0, 5, (n,), generator=g)
    return (x, ids), torch.randint(0, 3, (n,), generator=g)


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("sizes", [(4, 4, 4), (5, 1, 0, 6)], ids=["even", "uneven"])
def test_micro_batches_equal_the_whole_batch(sizes, per_layer):
    torch.manual_seed(0)
    model = Net()
    parts = [_data(n, seed) for seed, n in enumerate(sizes)]
    inputs = tuple(torch.cat([p[0][k] for p in parts]) for k in range(2))
    targets = torch.cat([p[1] for p in parts])
    loss_fn = nn.CrossEntropyLoss()
    opts = dict(max_grad_norm=0.1, noise_multiplier=0.0, per_layer=per_layer)
    private_grad(model, inputs, targets, loss_fn, expected_batch_size=16, **opts)
    want = _grads(model)
    step = PrivateStep(model, loss_fn, expected_batch_size=16, **opts)
    norms = [step.accumulate(x, y).norms for x, y in parts]
    assert [len(n) for n in norms] == list(sizes) and step.samples == sum(sizes)
    step.release()
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, want[name], rtol=1e-10, atol=1e-13)
    assert step.samples == 0 and step.sums is None


def test_accumulate_leaves_the_model_and_grads_alone(snapshot):
    torch.manual_seed(0)
    model = Net()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    state = snapshot(model)
    step = PrivateStep(model, nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0,
                       expected_batch_size=8)
    step.accumulate(*_data(B, 0))
    state.assert_unchanged()
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())
    assert not any(k.startswith("_persample") for k in vars(model))


def test_release_with_nothing_accumulated_is_noise_only():
    torch.manual_seed(0)
    model = nn.Linear(30, 20)
    step = PrivateStep(model, nn.MSELoss(), max_grad_norm=0.5, noise_multiplier=1.3,
                       expected_batch_size=10, generator=torch.Generator().manual_seed(1))
    draws = []
    for _ in range(200):
        step.release()
        draws.append(torch.cat([model.weight.grad.flatten(), model.bias.grad]))
    z = torch.stack(draws)  # (200, 620)
    want = 1.3 * 0.5 / 10  # sigma C / B', not sqrt(anything) times it
    assert abs(float(z.std()) / want - 1) < 0.02
    assert abs(float(z.mean())) < 4 * want / math.sqrt(z.numel())


def test_a_parameter_changed_mid_step_is_named_and_nothing_is_added():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = PrivateStep(model, nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=0.0,
                       expected_batch_size=8)
    step.accumulate(*_data(B, 0))
    step.release()
    opt.step()  # fine: after release
    step.accumulate(*_data(B, 1))
    before = {k: t.clone() for k, t in step.sums.items()}
    opt.step()  # not fine: mid-step
    with pytest.raises(ValueError, match=r"parameter 'conv.weight' was modified"):
        step.accumulate(*_data(B, 2))
    assert all(torch.equal(step.sums[k], before[k]) for k in before)
    assert step.samples == B


def test_a_replaced_or_new_parameter_is_named():
    torch.manual_seed(0)
    model = Net()
    step = PrivateStep(model, nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=0.0,
                       expected_batch_size=8)
    model.head = nn.Linear(16, 3)
    with pytest.raises(ValueError, match=r"'head.weight' is no longer the one"):
        step.accumulate(*_data(B, 0))


def test_state_dict_round_trip_resumes_the_same_step():
    loss_fn = nn.CrossEntropyLoss()
    opts = dict(max_grad_norm=0.1, noise_multiplier=1.0, expected_batch_size=8)
    torch.manual_seed(0)
    model = Net()
    whole = PrivateStep(model, loss_fn, generator=torch.Generator().manual_seed(3), **opts)
    whole.accumulate(*_data(B, 0))
    whole.accumulate(*_data(B, 1))
    whole.release()
    want = _grads(model)

    first = PrivateStep(model, loss_fn, generator=torch.Generator().manual_seed(3), **opts)
    first.accumulate(*_data(B, 0))
    state = first.state_dict()
    saved = {**state, "sums": {k: t.clone() for k, t in state["sums"].items()}}
    resumed = PrivateStep(model, loss_fn, generator=torch.Generator().manual_seed(99), **opts)
    resumed.load_state_dict(saved)
    assert resumed.samples == B
    resumed.accumulate(*_data(B, 1))
    resumed.release()
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, want[name], rtol=1e-10, atol=1e-13)


def test_state_dict_of_another_model_is_refused():
    step = PrivateStep(Net(), nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=0.0,
                       expected_batch_size=8)
    step.accumulate(*_data(B, 0))
    other = PrivateStep(nn.Linear(3, 2), nn.MSELoss(), max_grad_norm=1.0,
                        noise_multiplier=0.0, expected_batch_size=8)
    with pytest.raises(ValueError, match="do not match parameter 'weight'"):
        other.load_state_dict(step.state_dict())


def test_accountant_state_round_trips():
    acct = PrivacyAccountant()
    acct.step(1.1, 0.01, count=30)
    acct.step(0.9, 0.02, count=5)
    again = PrivacyAccountant("pld")
    again.load_state_dict(acct.state_dict())
    assert again.accountant == "rdp" and again.steps == 35
    assert again.epsilon(1e-5) == acct.epsilon(1e-5)
    with pytest.raises(ValueError):
        again.load_state_dict({"accountant": "rdp", "history": [[1.0, 0.01, 0]]})


@pytest.mark.parametrize("bad", [dict(max_grad_norm=0.0), dict(noise_multiplier=-1.0),
                                 dict(expected_batch_size=0), dict(expected_batch_size=None)])
def test_bad_options(bad):
    opts = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8) | bad
    with pytest.raises(ValueError):
        PrivateStep(nn.Linear(2, 1), nn.MSELoss(), **opts)


def test_each_release_is_one_accounted_step():
    """With ``sample_rate`` the step accounts its releases itself: epsilon after k releases
    is epsilon(sigma, q, k), whatever the micro-batches; a given accountant continues."""
    from persample.dp import epsilon

    model, loss_fn = Net(), nn.CrossEntropyLoss()
    step = PrivateStep(model, loss_fn, max_grad_norm=1.0, noise_multiplier=1.1,
                       expected_batch_size=8, sample_rate=0.02)
    assert step.epsilon(1e-5) == 0.0
    for k in range(3):
        for part in range(k):  # 0, 1 and 2 micro-batches: a release is one step
            step.accumulate(*_data(B, part))
        step.release()
    assert step.accountant.steps == 3
    assert step.epsilon(1e-5) == pytest.approx(epsilon(1.1, 0.02, 3, 1e-5), rel=1e-12)

    earlier = PrivacyAccountant("pld")
    earlier.step(1.1, 0.02, count=7)
    more = PrivateStep(model, loss_fn, max_grad_norm=1.0, noise_multiplier=1.1,
                       expected_batch_size=8, sample_rate=0.02, accountant=earlier)
    more.release()
    assert more.accountant is earlier and earlier.steps == 8


def test_the_accounted_steps_travel_in_the_state_dict():
    opts = dict(max_grad_norm=1.0, noise_multiplier=1.1, expected_batch_size=8,
                sample_rate=0.02)
    model, loss_fn = Net(), nn.CrossEntropyLoss()
    step = PrivateStep(model, loss_fn, **opts)
    for _ in range(5):
        step.release()
    resumed = PrivateStep(model, loss_fn, **opts)
    resumed.load_state_dict(step.state_dict())
    assert resumed.accountant.steps == 5 and resumed.epsilon(1e-5) == step.epsilon(1e-5)
    plain = PrivateStep(model, loss_fn, max_grad_norm=1.0, noise_multiplier=1.1,
                        expected_batch_size=8)
    assert "accountant" not in plain.state_dict() and plain.accountant is None
    with pytest.raises(ValueError, match="pass sample_rate=q"):
        plain.epsilon(1e-5)


@pytest.mark.parametrize("bad", [dict(sample_rate=0.0), dict(sample_rate=1.5),
                                 dict(sample_rate=True), dict(accountant="rdp"),
                                 dict(sample_rate=0.1, accountant="moments")])
def test_bad_accounting_options(bad):
    opts = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8) | bad
    with pytest.raises(ValueError, match="sample_rate|accountant"):
        PrivateStep(nn.Linear(2, 1), nn.MSELoss(), **opts)
