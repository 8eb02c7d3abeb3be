"""Clipping by group and automatic clipping, in one backward, against DP-SGD written by
hand from the loop's per-sample gradients in float64 (noise 0 for the sums; the
noise's std, ``sigma`` times the sensitivity, separately)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from battery import TOL, clipped_sum_by_hand
from cases import BY_ID, build
from persample import loop_per_sample_grads
from persample.dp import PrivateStep, private_grad
from persample.dp.clipping import Clipping

N = 6
CASES = ["mlp", "simple-cnn", "embedding-linear-ce", "tied-embedding-output",
         "linear-called-twice", "conv-called-twice", "layernorm-last-dim",
         "multihead-attention", "transformer-encoder-layer", "tied-rule-and-fallback"]


def _setup(case_id: str, n: int = N):
    c = BY_ID[case_id]
    model, inputs, targets = build(c, n)
    loss_fn = c["loss_fn"]("mean")
    grads = loop_per_sample_grads(model, inputs, targets, loss_fn)
    return model, inputs, targets, loss_fn, grads


def _groups(names: list[str]) -> list[list[str]]:
    """Two groups that interleave the parameters (not a layer each)."""
    return [names[0::2], names[1::2]] if len(names) > 1 else [names]


def _group_bounds(grads, groups) -> list[float]:
    """Each group's median per-sample norm: some samples clipped in every group."""
    return [float(sum(grads[n].flatten(1).pow(2).sum(1) for n in g).sqrt().median())
            for g in groups]


def _options(kind: str, grads) -> dict:
    names = list(grads)
    if kind == "groups":
        groups = _groups(names)
        return dict(max_grad_norm=_group_bounds(grads, groups), param_groups=groups)
    if kind == "automatic":
        return dict(max_grad_norm="automatic")
    if kind == "automatic-per-layer":
        return dict(max_grad_norm="automatic", per_layer=True)
    if kind == "automatic-groups":
        return dict(max_grad_norm="automatic", param_groups=_groups(names),
                    automatic_gamma=0.5)
    raise AssertionError(kind)


def _by_hand(grads, options: dict, divisor: float) -> dict:
    return clipped_sum_by_hand(grads, options["max_grad_norm"],
                               per_layer=options.get("per_layer", False),
                               param_groups=options.get("param_groups"),
                               gamma=options.get("automatic_gamma", 0.01), divisor=divisor)


def _grads_of(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


KINDS = ["groups", "automatic", "automatic-per-layer", "automatic-groups"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case_id", CASES)
def test_private_grad_matches_clipping_by_hand(case_id, kind):
    model, inputs, targets, loss_fn, grads = _setup(case_id)
    options = _options(kind, grads)
    want = _by_hand(grads, options, N)
    flat = _by_hand(grads, dict(max_grad_norm=1.0), N)
    assert any(not torch.allclose(want[k], flat[k]) for k in want)  # not flat clipping
    got = private_grad(model, inputs, targets, loss_fn, noise_multiplier=0.0, **options)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in grads.values()).sqrt()
    torch.testing.assert_close(got.norms, norms, **TOL)
    for name, g in _grads_of(model).items():
        torch.testing.assert_close(g, want[name], **TOL, msg=name)


@pytest.mark.parametrize("kind", ["groups", "automatic"])
def test_micro_batches_add_up_to_one_call(kind):
    model, inputs, targets, loss_fn, grads = _setup("simple-cnn", 8)
    options = _options(kind, grads)
    step = PrivateStep(model, loss_fn, noise_multiplier=0.0, expected_batch_size=8,
                       **options)
    for part in (slice(0, 3), slice(3, 8)):
        step.accumulate(inputs[part], targets[part])
    step.release()
    want = _by_hand(grads, options, 8)
    for name, g in _grads_of(model).items():
        torch.testing.assert_close(g, want[name], **TOL, msg=name)


@pytest.mark.parametrize(("options", "sensitivity"), [
    (dict(max_grad_norm=[3.0, 4.0], param_groups=[["0.weight", "2.bias"],
                                                  ["0.bias", "2.weight"]]), 5.0),
    (dict(max_grad_norm="automatic"), 1.0),
    (dict(max_grad_norm="automatic", per_layer=True), 1.0),
    (dict(max_grad_norm=2.0, per_layer=True), 2.0),
])
def test_the_noise_std_is_sigma_times_the_sensitivity(options, sensitivity):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(100, 300), nn.Tanh(), nn.Linear(300, 100))
    step = PrivateStep(net, nn.MSELoss(), noise_multiplier=1.5, expected_batch_size=10,
                       generator=torch.Generator().manual_seed(0), **options)
    assert step.clipping.sensitivity == pytest.approx(sensitivity)
    step.release()  # nothing accumulated: the noise alone, over B' = 10
    z = torch.cat([p.grad.flatten() for p in net.parameters()])  # 60,400 numbers
    assert abs(float(z.std()) / (1.5 * sensitivity / 10) - 1) < 0.02


@pytest.mark.parametrize(("options", "match"), [
    (dict(max_grad_norm=[1.0, 2.0]), r"a list needs param_groups"),
    (dict(max_grad_norm=[1.0], param_groups=[["0.weight", "0.bias"], ["2.weight", "2.bias"]]),
     r"with 2 param_groups, max_grad_norm must be a list of 2"),
    (dict(max_grad_norm=[1.0, -1.0], param_groups=[["0.weight", "0.bias"],
                                                   ["2.weight", "2.bias"]]),
     r"every clipping norm must be a positive number, got -1.0"),
    (dict(max_grad_norm=[1.0, 1.0], param_groups=[["0.weight", "0.bias"], ["2.weight"]]),
     r"parameter '2.bias' is in no group"),
    (dict(max_grad_norm=[1.0, 1.0], param_groups=[["0.weight", "0.bias", "2.bias"],
                                                  ["2.weight", "2.bias"]]),
     r"'2.bias' is in param_groups\[0\] and param_groups\[1\]"),
    (dict(max_grad_norm=[1.0, 1.0], param_groups=[["0.weight", "0.bias"],
                                                  ["2.weight", "head.bias"]]),
     r"param_groups\[1\] names 'head.bias', which is not a trainable parameter"),
    (dict(max_grad_norm=1.0, per_layer=True, param_groups=[["0.weight", "0.bias",
                                                            "2.weight", "2.bias"]]),
     r"pass it or param_groups, not both"),
    (dict(max_grad_norm="auto"), r"or 'automatic', got 'auto'"),
    (dict(max_grad_norm="automatic", automatic_gamma=0.0), r"automatic_gamma must be"),
    (dict(max_grad_norm=0.0), r"must be a positive number"),
])
def test_bad_clipping_is_named_and_changes_nothing(options, match, snapshot):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    state = snapshot(net)
    with pytest.raises(ValueError, match=match):
        private_grad(net, x, y, nn.CrossEntropyLoss(), noise_multiplier=1.0, **options)
    with pytest.raises(ValueError, match=match):
        PrivateStep(net, nn.CrossEntropyLoss(), noise_multiplier=1.0, expected_batch_size=5,
                    **options)
    state.assert_unchanged()


def test_flat_and_per_layer_factors_are_the_step_before():
    """Flat and per-layer clipping through Clipping compute what the step computed
    before: the same ops, so the same bits."""
    sq = {"a": torch.tensor([4.0, 0.01, 9.0]), "b": torch.tensor([1.0, 0.0, 16.0])}
    flat = Clipping.flat(2.0).bound(["a", "b"]).factors(sq)
    norms = torch.stack([sq["a"], sq["b"]]).sum(0).sqrt()
    assert torch.equal(flat["a"], (2.0 / (norms + 1e-6)).clamp(max=1.0))
    per = Clipping.layerwise(2.0).bound(["a", "b"]).factors(sq)
    bound = 2.0 / math.sqrt(2)
    assert torch.equal(per["b"], (bound / (sq["b"].sqrt() + 1e-6)).clamp(max=1.0))
