"""Real models (``zoo.py``: transformers, peft, timm, torchvision) through every public
function, against the loop over samples in float64, on the fast path.

Each model is called as its users call it (keyword inputs, padding masks, a
``ModelOutput``), with sizes that coincide (batch = sequence length = heads =
windows). Tolerance: relative error <= 1e-8 per parameter; absolute errors below
1e-12 count as exact. ``supported(model, inputs)`` must say ``rule`` for every
parameter, and the call must have taken no fallback (no warning).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import Tensor

import persample
from cases import assert_exact, dp_grads
from zoo import ZOO

# small outputs: the per-sample parameter Jacobian (B, Y, P) is tested on these
SMALL_OUTPUT = {"gpt2-cls", "bert", "distilbert", "deberta-v2", "vit", "resnet18",
                "mobilenet-v3", "densenet", "convnext", "swin", "timm-vit-layerscale",
                "timm-resnet", "timm-convnext", "timm-levit", "timm-mobilevit"}
SLOW = {"resnet18", "efficientnet-b0", "timm-efficientnet"}


def masked_loop(model, inputs, targets, loss_fn) -> dict[str, Tensor]:
    """Each sample's own loss differentiated on the whole batch (samples independent).

    The reference for LeViT: torch 2.13's CPU BatchNorm2d backward is wrong for a batch
    of one sample when the gradient arrives channels-last (LeViT's stem output is
    ``flatten(2).transpose(1, 2)``), so the plain loop's batch-of-one gradients are
    off there (checked against finite differences), while the batch's are right.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    losses = loss_fn(model(inputs), targets)
    want = {n: p.new_zeros((len(losses), *p.shape)) for n, p in params.items()}
    for i in range(len(losses)):
        grads = torch.autograd.grad(losses[i], list(params.values()), retain_graph=True,
                                    allow_unused=True)
        for (n, _), g in zip(params.items(), grads):
            if g is not None:
                want[n][i] = g
    return want


@functools.cache
def case(name: str):
    """``(model, inputs, targets, loss_fn, loop per-sample gradients)``, built once."""
    model, inputs, targets, loss_fn = ZOO[name]()
    reference = masked_loop if name == "timm-levit" else persample.loop_per_sample_grads
    return model, inputs, targets, loss_fn, reference(model, inputs, targets, loss_fn)


def no_fallback():
    """A context in which a warning (a fallback of ``auto``) fails the test."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("error", message=".*Falling back")
    warnings.filterwarnings("error", message=".*performance drop")
    return ctx


def ids(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


@pytest.mark.parametrize("name", ids(ZOO))
def test_per_sample_grads(name, snapshot):
    model, inputs, targets, loss_fn, want = case(name)
    state = snapshot(model)
    ctx = no_fallback()
    try:
        got = persample.per_sample_grads(model, inputs, targets, loss_fn)
    finally:
        ctx.__exit__(None, None, None)
    assert_exact(got, want)
    state.assert_unchanged()


@pytest.mark.parametrize("name", ids(ZOO))
def test_every_parameter_on_a_rule(name):
    """``supported`` runs the same planning and rules as a real call: every parameter
    is on a rule (an op rule or a module rule), none on the slower exact paths."""
    model, inputs, _, _, _ = case(name)
    routes = persample.supported(model, inputs)
    assert routes, name
    off = [(r.module, r.params, r.path, r.reason) for r in routes
           if r.path not in ("rule", "module rule")]
    assert not off, off
    covered = {f"{r.module}.{p}" if r.module else p for r in routes for p in r.params}
    assert covered == {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", ids(ZOO))
def test_norms(name):
    model, inputs, targets, loss_fn, want = case(name)
    ctx = no_fallback()
    try:
        total, layers = persample.per_sample_grad_norms(model, inputs, targets, loss_fn,
                                                        per_layer=True)
    finally:
        ctx.__exit__(None, None, None)
    assert_exact(layers, {n: g.flatten(1).norm(dim=1) for n, g in want.items()})
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    assert_exact({"total": total}, {"total": flat.norm(dim=1)})


@pytest.mark.parametrize("name", ids(ZOO))
def test_private_grad_without_noise_is_the_clipped_sum(name, snapshot):
    """Noise 0: ``p.grad`` is the loop's per-sample gradients clipped to ``C`` (the
    median norm, so some are clipped and some not), summed, over the batch size."""
    model, inputs, targets, loss_fn, want = case(name)
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    c = norms.median().item()
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    ctx = no_fallback()
    try:
        got, grads = dp_grads(model, inputs, targets, loss_fn, c)
    finally:
        ctx.__exit__(None, None, None)
    assert_exact({"norms": got}, {"norms": norms})
    assert_exact(grads, {n: torch.tensordot(factors, g, dims=1) / len(norms)
                         for n, g in want.items()})


@pytest.mark.parametrize("name", ids(sorted(SMALL_OUTPUT)))
def test_param_jacobian(name):
    """``(B, Y, P)`` of the logits, for the models whose output is small."""
    model, inputs, _, _, _ = case(name)

    class Logits(torch.nn.Module):  # param_jacobian wants one tensor out
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args, **kwargs):
            out = self.model(*args, **kwargs)
            return out if isinstance(out, Tensor) else out.logits

    wrapped = Logits()
    ctx = no_fallback()
    try:
        got = persample.param_jacobian(wrapped, inputs)
    finally:
        ctx.__exit__(None, None, None)
    reference = masked_jacobian if name == "timm-levit" else persample.loop_param_jacobian
    assert_exact(got, reference(wrapped, inputs))


def masked_jacobian(model, inputs) -> dict[str, Tensor]:
    """Like :func:`masked_loop`: each (sample, output) entry differentiated on the batch."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = model(inputs)  # (B, Y)
    want = {n: p.new_zeros((*out.shape, *p.shape)) for n, p in params.items()}
    for i in range(out.shape[0]):
        for k in range(out.shape[1]):
            grads = torch.autograd.grad(out[i, k], list(params.values()), retain_graph=True,
                                        allow_unused=True)
            for (n, _), g in zip(params.items(), grads):
                if g is not None:
                    want[n][i, k] = g
    return want
