"""``params=``: per-sample derivatives of a chosen subset of the parameters, the rest of
the model untouched (not frozen) and without per-sample work, against the loop over
samples in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import persample
from battery import TOL
from persample.rules import spec_of

B = 4  # = features = outputs: sizes chosen to coincide


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(B, B), nn.Tanh(), nn.LayerNorm(B), nn.Linear(B, 3))
    return net.double()


def _data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(B, B, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (B,), generator=g))


@pytest.mark.parametrize("method", ["rules", "vmap", "loop", "auto"])
@pytest.mark.parametrize("by", ["names", "tensors", "mixed"])
def test_a_subset_equals_the_full_result_restricted(method, by):
    net, (x, y), loss_fn = _net(), _data(), nn.CrossEntropyLoss()
    full = persample.loop_per_sample_grads(net, x, y, loss_fn)
    chosen = ["3.weight", "0.bias", "2.weight"]
    sel = {"names": chosen, "tensors": [net.get_parameter(n) for n in chosen],
           "mixed": ["3.weight", net[0].bias, "2.weight"]}[by]
    got = persample.per_sample_grads(net, x, y, loss_fn, method=method, params=sel)
    assert list(got) == ["0.bias", "2.weight", "3.weight"]  # named_parameters() order
    for name, g in got.items():
        torch.testing.assert_close(g, full[name], **TOL)
    flat = persample.per_sample_grads(net, x, y, loss_fn, method=method, params=sel, flat=True)
    torch.testing.assert_close(flat, torch.cat([g.flatten(1) for g in got.values()], 1), **TOL)
    assert all(p.requires_grad and p.grad is None for p in net.parameters())  # untouched


@pytest.mark.parametrize("method", ["rules", "vmap", "loop"])
def test_norms_and_jacobians_of_a_subset(method):
    net, (x, y), loss_fn = _net(), _data(), nn.CrossEntropyLoss()
    full = persample.loop_per_sample_grads(net, x, y, loss_fn)
    total, layers = persample.per_sample_grad_norms(net, x, y, loss_fn, method=method,
                                                    per_layer=True, params=["0.weight"])
    assert list(layers) == ["0.weight"]
    torch.testing.assert_close(total, full["0.weight"].flatten(1).norm(dim=1), **TOL)
    jac = persample.param_jacobian(net, x, method=method, params=["3.bias", "0.weight"])
    want = persample.loop_param_jacobian(net, x)
    assert list(jac) == ["0.weight", "3.bias"]
    for name, j in jac.items():
        torch.testing.assert_close(j, want[name], **TOL)
    flat = persample.param_jacobian(net, x, method=method, params=["3.bias"], flat=True)
    assert flat.shape == (B, 3, 3)


def test_the_rest_costs_no_per_sample_work(patch_spec):
    """Only the ops reading a chosen parameter run a rule."""
    calls = []
    linear = spec_of(F.linear).grad

    def spy(call, g, out):
        calls.append(sorted(tuple(t.shape) for t in out))
        return linear(call, g, out)

    patch_spec(F.linear, grad=spy)
    net, (x, y) = _net(), _data()
    persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), method="rules",
                               params=["3.weight"])
    assert calls == [[(3, B)]]


@pytest.mark.parametrize(("params", "error", "match"), [
    (["nope"], ValueError, "'nope' is not a parameter of the Sequential"),
    ([], ValueError, "params is empty"),
    ([torch.zeros(2)], ValueError, r"a tensor of shape \(2,\) is not a parameter"),
    ([3], TypeError, "names or parameters, got int"),
])
def test_bad_selections_are_named(params, error, match):
    net, (x, y) = _net(), _data()
    with pytest.raises(error, match=match):
        persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), params=params)


def test_a_frozen_parameter_is_refused_not_unfrozen():
    net, (x, y) = _net(), _data()
    net[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="'0.weight' is frozen"):
        persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), params=["0.weight"])
    assert not net[0].weight.requires_grad
