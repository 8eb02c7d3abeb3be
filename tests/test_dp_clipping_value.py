"""One clipping value, ``persample.dp.Clipping``, taken as ``clipping=`` by every DP front
door: each kind gives what its shorthand keywords give (float64, noise 0, the same
sums to rounding), and the front doors refuse both or neither by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from persample.dp import AdaptiveClipping, Clipping, PrivacyEngine, PrivateStep, private_grad
from persample.dp.training import make_private

B = 8


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 5, generator=g).double(), torch.randint(0, 3, (B,), generator=g)


KINDS = [
    (Clipping.flat(0.3), {"max_grad_norm": 0.3}),
    (Clipping.layerwise(0.3), {"max_grad_norm": 0.3, "per_layer": True}),
    (Clipping.grouped([0.2, 0.1], [["0.weight", "2.weight"], ["0.bias", "2.bias"]]),
     {"max_grad_norm": [0.2, 0.1],
      "param_groups": [["0.weight", "2.weight"], ["0.bias", "2.bias"]]}),
    (Clipping.automatic(0.05), {"max_grad_norm": "automatic", "automatic_gamma": 0.05}),
    (Clipping.automatic(per_layer=True), {"max_grad_norm": "automatic", "per_layer": True}),
]
IDS = ["flat", "layerwise", "grouped", "automatic", "automatic-layerwise"]


def _grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("clipping, shorthand", KINDS, ids=IDS)
def test_clipping_is_the_shorthand_in_private_grad_and_the_step(clipping, shorthand):
    x, y = _data()
    loss = nn.CrossEntropyLoss()
    want_net, net = _net(), _net()
    private_grad(want_net, x, y, loss, noise_multiplier=0.0, **shorthand)
    private_grad(net, x, y, loss, noise_multiplier=0.0, clipping=clipping)
    for got, want in zip(_grads(net), _grads(want_net)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    step = PrivateStep(_net(), loss, clipping=clipping, noise_multiplier=1.0,
                       expected_batch_size=B)
    short = PrivateStep(_net(), loss, noise_multiplier=1.0, expected_batch_size=B, **shorthand)
    assert step.clipping == clipping and step.bounds == short.bounds
    assert step.clipping.sensitivity == pytest.approx(short.bounds.sensitivity)


def test_the_clipping_moves_the_sums():
    """A test that would fail if ``clipping=`` were ignored: a smaller bound, other sums."""
    x, y = _data()
    a, b = _net(), _net()
    private_grad(a, x, y, nn.CrossEntropyLoss(), noise_multiplier=0.0,
                 clipping=Clipping.flat(1e-3))
    private_grad(b, x, y, nn.CrossEntropyLoss(), noise_multiplier=0.0,
                 clipping=Clipping.flat(10.0))
    assert not torch.allclose(a[0].weight.grad, b[0].weight.grad)


def test_make_private_and_the_privacy_engine_take_a_clipping():
    x, y = torch.randn(64, 5).double(), torch.randint(0, 3, (64,))
    data = TensorDataset(x, y)
    net = _net()
    training = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), data,
                            nn.CrossEntropyLoss(), epochs=1, noise_multiplier=1.0,
                            expected_batch_size=16, clipping=Clipping.automatic())
    assert training.step.clipping == Clipping.automatic()
    net = _net()
    engine = PrivacyEngine()
    module, opt, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=16), noise_multiplier=1.0,
        clipping=Clipping.layerwise(0.5))
    assert engine.steps[-1].clipping == Clipping.layerwise(0.5)
    for xb, yb in loader:  # one step runs
        opt.zero_grad()
        nn.CrossEntropyLoss()(module(xb), yb).backward()
        opt.step()
        break


def test_adaptive_clipping_is_one_value_too():
    ada = AdaptiveClipping(target_unclipped_quantile=0.5, unclipped_num_std=B / 20)
    step = PrivateStep(_net(), nn.CrossEntropyLoss(), clipping=Clipping.flat(0.3, adaptive=ada),
                       noise_multiplier=0.5, expected_batch_size=B)
    x, y = _data()
    step.accumulate(x, y)
    step.release()
    assert step.max_grad_norm != 0.3  # moved towards the median norm


@pytest.mark.parametrize("call", ["step", "private_grad", "make_private", "engine"])
def test_both_or_neither_are_refused_by_name(call):
    x, y = _data()
    net, loss = _net(), nn.CrossEntropyLoss()

    def run(**kw):
        if call == "step":
            PrivateStep(net, loss, noise_multiplier=1.0, expected_batch_size=B, **kw)
        elif call == "private_grad":
            private_grad(net, x, y, loss, noise_multiplier=1.0, **kw)
        elif call == "make_private":
            make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), TensorDataset(x, y),
                         loss, epochs=1, noise_multiplier=1.0, expected_batch_size=4, **kw)
        else:
            PrivacyEngine().make_private(
                module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
                noise_multiplier=1.0, **kw)

    with pytest.raises(ValueError, match="not both|no max_grad_norm"):
        run(clipping=Clipping.flat(1.0), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        run()
    if call != "engine":  # (Opacus's clipping= takes its strings)
        with pytest.raises(TypeError, match="persample.dp.Clipping"):
            run(clipping="flat")


@pytest.mark.parametrize("make, match", [
    (lambda: Clipping.flat(0.0), "positive"),
    (lambda: Clipping.grouped([1.0], [["a"], ["b"]]), "2 clipping norms"),
    (lambda: Clipping(1.0, per_layer=True, param_groups=[["a"]]), "not both"),
    (lambda: Clipping.automatic(gamma=-1.0), "automatic_gamma"),
    (lambda: Clipping(1.0, per_layer=True, adaptive=object()), "moves one clipping norm"),
], ids=["bound", "groups", "layerwise-and-groups", "gamma", "adaptive-layerwise"])
def test_a_bad_clipping_is_refused_when_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_unknown_group_names_are_refused_by_the_step():
    with pytest.raises(ValueError, match="'nope'.*not a trainable parameter"):
        PrivateStep(_net(), nn.CrossEntropyLoss(), noise_multiplier=1.0, expected_batch_size=B,
                    clipping=Clipping.grouped([1.0], [["nope"]]))


def test_privacy_arguments_take_a_clipping():
    from persample.integrations.transformers import PrivacyArguments

    ada = AdaptiveClipping(target_unclipped_quantile=0.5, unclipped_num_std=1.0)
    args = PrivacyArguments(noise_multiplier=0.5, clipping=Clipping.flat(2.0, adaptive=ada))
    assert args.chosen_clipping().adaptive is ada
    assert PrivacyArguments(noise_multiplier=0.5, per_layer=True).chosen_clipping() == \
        Clipping.layerwise(1.0)
    with pytest.raises(ValueError, match="not both"):
        PrivacyArguments(noise_multiplier=0.5, max_grad_norm=2.0, clipping=Clipping.flat(1.0))
