"""The methods ``persample bench`` compares: plain backward, the loop, torch.func,
Opacus and BackPACK (when installed), and persample itself.

Each per-sample method is a function ``(workload) -> (B, P) tensor`` (the
per-sample gradients of each sample's own loss, flattened in
``named_parameters()`` order) or ``None`` when it is not installed.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..api import per_sample_grads
from ..reference import loop_per_sample_grads
from ..vmap import vmap_per_sample_grads
from .workloads import Workload


def flat(grads: list[Tensor]) -> Tensor:
    return torch.cat([g.flatten(1) for g in grads], dim=1)


def plain_backward(w: Workload) -> Callable[[], None]:
    """Forward + ``loss.backward()``: the ordinary summed gradient (the floor's ``t_plain``)."""
    model = w.model

    def run() -> None:
        for p in model.parameters():
            p.grad = None
        w.loss_fn(model(w.inputs), w.targets).backward()

    return run


def loop(w: Workload) -> Callable[[], Tensor]:
    def run() -> Tensor:
        grads = loop_per_sample_grads(w.model, w.inputs, w.targets, w.loss_fn)
        return flat(list(grads.values()))

    return run


def torch_func(w: Workload) -> Callable[[], Tensor]:
    """Seed 001's tutorial: ``vmap(grad(functional_call))``."""
    params = dict(w.model.named_parameters())

    def run() -> Tensor:
        grads = vmap_per_sample_grads(w.model, (w.inputs,), w.targets, w.loss_fn, params)
        return flat(list(grads.values()))

    return run


def opacus(w: Workload) -> Callable[[], Tensor] | None:
    """Opacus ``GradSampleModule`` (hooks mode): ``p.grad_sample`` after one backward."""
    try:
        from opacus import GradSampleModule
    except ImportError:
        return None
    # Opacus records activations only in training mode; the workloads have no
    # dropout or BatchNorm, so train() computes the same function.
    model = GradSampleModule(copy.deepcopy(w.model).train(), loss_reduction="mean")

    def run() -> Tensor:
        model.zero_grad(set_to_none=True)
        w.loss_fn(model(w.inputs), w.targets).backward()
        return flat([p.grad_sample for p in model.parameters()])

    return run


def backpack(w: Workload) -> Callable[[], Tensor] | None:
    """BackPACK ``BatchGrad``: ``p.grad_batch`` (of the mean loss's terms, times B)."""
    try:
        from backpack import backpack as context
        from backpack import extend
        from backpack.extensions import BatchGrad
    except ImportError:
        return None
    model = extend(copy.deepcopy(w.model))
    loss_fn = extend(nn.CrossEntropyLoss())
    n = w.inputs.shape[0]

    def run() -> Tensor:
        model.zero_grad(set_to_none=True)
        with context(BatchGrad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # full backward hooks on modules without input grads
            loss_fn(model(w.inputs), w.targets).backward()
        return flat([p.grad_batch for p in model.parameters()]).mul_(n)

    return run


def persample_out(w: Workload, out: Tensor) -> Callable[[], Tensor]:
    """persample writing into a caller-owned ``(B, P)`` buffer (``out=``)."""

    def run() -> Tensor:
        return per_sample_grads(w.model, w.inputs, w.targets, w.loss_fn, out=out)

    return run


def persample_new(w: Workload) -> Callable[[], Tensor]:
    """persample allocating its result on each call (``flat=True``)."""

    def run() -> Tensor:
        return per_sample_grads(w.model, w.inputs, w.targets, w.loss_fn, flat=True)

    return run
