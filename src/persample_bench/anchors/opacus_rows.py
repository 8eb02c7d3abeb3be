"""The Opacus rows: ``GradSampleModule``'s per-sample gradients (hooks mode), its
ghost clipping's per-sample norms, and one DP-SGD step by ``DPOptimizer`` with
hooks or with ghost clipping.

Opacus is called as its documentation shows and with the inputs as its users pass
them (:meth:`~persample_bench.workloads.Workload.opacus_call`: per-sample
``position_ids``). A model Opacus refuses gives a row with ``fn=None`` and
``"failed: ..."``; Opacus missing, ``"not installed ..."``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from ..workloads import DP_MAX_GRAD_NORM, Workload
from .case import Method, failed, optional_method, scalar_loss

NOT_INSTALLED = "not installed (pip install -e '.[bench]')"


def opacus_ready(model: nn.Module) -> nn.Module:
    """A copy of ``model`` for Opacus: eval mode, except that the modules holding
    trainable parameters are in training mode (Opacus records activations only
    there). Dropout and attention dropout stay off, so the function is the model's.
    BatchNorm would change meaning, but Opacus refuses it anyway.

    Examples:
        >>> net = opacus_ready(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)))
        >>> [m.training for m in net]
        [True, False]
    """
    ready = copy.deepcopy(model).eval()
    for m in ready.modules():
        m.training = any(p.requires_grad for p in m.parameters(recurse=False))
    return ready


def opacus(w: Workload) -> Method:
    """Opacus ``GradSampleModule`` (hooks mode): ``{name: p.grad_sample}`` for the
    trainable parameters after one backward of the mean loss
    (``loss_reduction="mean"``, so that the rows are each sample's own gradient).

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> opacus(grads_workload("cnn-grads", 2)).name
        'Opacus hooks'

    Source: Opacus's ``GradSampleModule`` documentation.
    """
    name = "Opacus hooks"
    try:
        from opacus import GradSampleModule
    except ImportError:
        return Method(name, None, NOT_INSTALLED)
    try:
        model = GradSampleModule(opacus_ready(w.model), loss_reduction="mean")
    except Exception as err:  # e.g. a layer Opacus does not support
        return failed(name, err)

    def run(_: Tensor) -> dict[str, Tensor]:
        model.zero_grad(set_to_none=True)
        scalar_loss(w.loss_fn(w.opacus_call(model), w.targets)).backward()
        out = {k: p.grad_sample for k, p in model._module.named_parameters()
               if p.requires_grad}
        for p in model._module.parameters():  # the result holds them; the model need not
            p.grad_sample = None  # (as Opacus's optimizer.zero_grad sets it)
        return out

    return Method(name, run)


def ghost_norms(w: Workload) -> Method:
    """``"Opacus ghost clipping"``'s per-sample gradient norms ``(B,)``: the first of its
    two backwards (:func:`ghost_step` with ``norms=True``); for an
    ``nn.CrossEntropyLoss`` on a tensor input only.

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> ghost_norms(dp_workload("cnn-norms", 2)).name
        'Opacus ghost clipping'
    """
    return optional_method(lambda: ghost_step(w), "Opacus ghost clipping", "opacus", w,
                           lambda step: step(None, norms=True))


def opacus_dp_step(w: Workload, noise: dict, ghost: bool) -> Method:
    """One DP-SGD step by Opacus's ``DPOptimizer``, with hooks (``"Opacus hooks"``) or
    with ghost clipping (``"Opacus ghost clipping"``); the row returns the noised
    gradients ``{name: p.grad}``.

    Args:
        w: the workload; ghost clipping needs an ``nn.CrossEntropyLoss`` or the
            workload's ``opacus_ce``.
        noise: ``{"sigma": ...}``, read at each call (the case turns noise on after
            the results are checked).
        ghost: ghost clipping instead of hooks.

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> opacus_dp_step(dp_workload("cnn-dp-step", 2), {"sigma": 0.0}, ghost=True).name
        'Opacus ghost clipping'

    Source: Opacus's ``DPOptimizer`` and ``DPOptimizerFastGradientClipping``.
    """
    name = "Opacus ghost clipping" if ghost else "Opacus hooks"
    try:
        import opacus  # noqa: F401
    except ImportError:
        return Method(name, None, NOT_INSTALLED)
    if ghost and not isinstance(w.loss_fn, nn.CrossEntropyLoss) and w.opacus_ce is None:
        return Method(name, None, "not applicable: it takes an nn.CrossEntropyLoss")
    try:
        step = ghost_step(w, noise) if ghost else _hooks_step(w, noise)
    except Exception as err:  # e.g. a layer Opacus does not support
        return failed(name, err)
    return Method(name, lambda _: step(None))


def _hooks_step(w: Workload, noise: dict):
    """``run(_)``: one ``DPOptimizer`` step over ``GradSampleModule``'s hooks; the
    optimizer is made again when ``noise["sigma"]`` changes (Opacus fixes it then)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = GradSampleModule(opacus_ready(w.model))
    state = {}

    def run(_: Tensor | None) -> dict[str, Tensor]:
        if state.get("sigma") != noise["sigma"]:  # Opacus fixes sigma at construction
            state["opt"] = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       noise_multiplier=noise["sigma"],
                                       max_grad_norm=DP_MAX_GRAD_NORM,
                                       expected_batch_size=w.n)
            state["sigma"] = noise["sigma"]
        opt = state["opt"]
        opt.zero_grad(set_to_none=True)
        scalar_loss(w.loss_fn(w.opacus_call(model), w.targets)).backward()
        opt.step()
        return {k: p.grad for k, p in model._module.named_parameters() if p.requires_grad}

    return run


def ghost_step(w: Workload, noise: dict | None = None):
    """``run(_, norms=False)``: one step of Opacus's ghost clipping
    (``GradSampleModuleFastGradientClipping``, ``DPOptimizerFastGradientClipping``,
    ``DPLossFastGradientClipping``), returning the noised gradients; with
    ``norms=True`` only its first backward, returning the per-sample norms.
    ``noise``: as for :func:`opacus_dp_step` (default: no noise)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    noise = noise if noise is not None else {"sigma": 0.0}
    model = GradSampleModuleFastGradientClipping(
        opacus_ready(w.model), max_grad_norm=DP_MAX_GRAD_NORM, use_ghost_clipping=True)
    state = {}

    def run(_: Tensor | None, norms: bool = False) -> Any:
        if state.get("sigma") != noise["sigma"]:
            opt = DPOptimizerFastGradientClipping(
                torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=noise["sigma"],
                max_grad_norm=DP_MAX_GRAD_NORM, expected_batch_size=w.n)
            state.update(sigma=noise["sigma"], opt=opt, loss=DPLossFastGradientClipping(
                model, opt, nn.CrossEntropyLoss(), "mean"))
        opt = state["opt"]
        opt.zero_grad(set_to_none=True)
        out = w.opacus_call(model)
        if w.opacus_ce is None:  # the loss is an nn.CrossEntropyLoss of the output
            loss = state["loss"](out, w.targets)
        else:  # logits (N, C), labels (N,), and (B, L) for the per-sample mean
            logits, labels, shape = w.opacus_ce(out, w.targets)
            loss = state["loss"](logits, labels, shape=shape)
        if norms:  # the first of Opacus's two backwards gives the norms
            torch.mean(loss.loss_per_sample).backward()
            return model.get_norm_sample()
        loss.backward()
        opt.step()
        return {k: p.grad for k, p in model._module.named_parameters() if p.requires_grad}

    return run
