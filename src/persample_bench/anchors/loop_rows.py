"""The rows that loop over samples or outputs: what people write first, and what
every other row is checked against.

The per-sample gradients loop is ``compute_sample_grads`` of torch.func's
"Per-sample-gradients" tutorial (:func:`persample.loop_per_sample_grads`); the
Jacobian loops are the code of the questions the Jacobian workloads come from.
"""

from __future__ import annotations

import torch
from torch import Tensor

from persample.reference import forward_per_sample_grads, loop_param_jacobian, loop_per_sample_grads

from ..workloads import Workload
from .case import Method


def loop_grads(w: Workload) -> Method:
    """The ``"loop"`` row: one ``autograd.grad`` per sample, ``{name: (B, *shape)}``.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> m = loop_grads(grads_workload("cnn-grads", 2))
        >>> m.name, m.fn(None)["conv1.weight"].shape
        ('loop', torch.Size([2, 32, 1, 3, 3]))

    For a model that draws random numbers (``w.seed``, dropout in training mode) the loop
    is over the per-sample losses of one batch forward (each sample's loss on its rows
    of the output, one ``autograd.grad`` each, :func:`persample.reference.
    forward_per_sample_grads`): a loop of forwards would draw other masks per sample.

    Source: torch.func's "Per-sample-gradients" tutorial (``compute_sample_grads``).
    """
    if w.seed is not None:
        return Method("loop", lambda _: forward_per_sample_grads(
            w.model, w.inputs, w.targets, w.loss_fn),
            "over the per-sample losses of one batch forward (the forward that ran)")

    def loop(_: Tensor | None) -> dict[str, Tensor]:
        return loop_per_sample_grads(w.model, w.inputs, w.targets, w.loss_fn)

    return Method("loop", loop)


def question_param_jacobian(w: Workload) -> Method:
    """The ``"calculate_gradients loop"`` row: the question's loop over samples and
    outputs, ``{name: (B, Y, *shape)}``.

    Examples:
        >>> from persample_bench.workloads import jacobian_workload
        >>> m = question_param_jacobian(jacobian_workload("mlp-param-jac", 2))
        >>> m.fn(None)["0.weight"].shape
        torch.Size([2, 10, 20, 784])

    Source: the question "How to efficiently calculate gradients of all outputs with
    respect to parameters?" (its ``calculate_gradients``).
    """
    def question_loop(_: Tensor | None) -> dict[str, Tensor]:
        return loop_param_jacobian(w.model, w.inputs)

    return Method("calculate_gradients loop", question_loop)


def question_input_jacobian(w: Workload) -> Method:
    """The input Jacobian ``(B, Y, D)`` as the workload's question computes it: a loop over
    the classes (``clf-input-jac``), or the full ``(B, Y, B, D)`` Jacobian of
    ``autograd.functional.jacobian`` and then its diagonal blocks (``pinn-input-jac``).

    Examples:
        >>> from persample_bench.workloads import jacobian_workload
        >>> m = question_input_jacobian(jacobian_workload("clf-input-jac", 2))
        >>> m.name, m.fn(None).shape
        ('loop over classes', torch.Size([2, 10, 784]))

    Source: the Stack Overflow questions on only the diagonals of a batched Jacobian and
    "How to compute derivative of matrix output with respect to matrix input most
    efficiently?" (their own code).
    """
    model, x = w.model, w.inputs
    n, y = x.shape[0], model(x[:1]).shape[1]

    def full_jacobian(_: Tensor | None) -> Tensor:  # the full (B, Y, B, D), then its blocks
        full = torch.autograd.functional.jacobian(model, x)  # (B, Y, B, D)
        return torch.diagonal(full, dim1=0, dim2=2).permute(2, 0, 1)

    def class_loop(_: Tensor | None) -> Tensor:  # a loop over the classes
        xg = x.detach().requires_grad_()
        out = model(xg)
        ones = torch.ones(n, dtype=out.dtype, device=out.device)
        rows = [torch.autograd.grad(out[:, k], xg, ones, retain_graph=True)[0]
                for k in range(y)]
        return torch.stack(rows, dim=1)

    if w.name == "clf-input-jac":
        return Method("loop over classes", class_loop)
    return Method("autograd.functional.jacobian", full_jacobian)
