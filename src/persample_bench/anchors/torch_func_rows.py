"""The ``torch.func`` rows: ``vmap`` over the batch of ``grad``, ``jacrev`` or ``jacfwd``
of one sample's function, as torch.func's tutorial and the questions' accepted
answers write them (``functional_call`` with the parameters as a dict).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.func import functional_call, grad, jacfwd, jacrev, vmap
from torch.utils._pytree import tree_map

from ..workloads import Workload
from .case import Method, num_params
from .memory import jacfwd_skip


def torch_func(w: Workload) -> Method:
    """``vmap(grad(compute_loss))`` with ``functional_call``, as torch.func's tutorial has it.

    Returns ``{name: (B, *param.shape)}`` for the trainable parameters (frozen ones, as
    under LoRA, are passed as constants). Each sample is a batch of one
    (``unsqueeze(0)``). For a dict of inputs with an all-ones ``attention_mask`` (no
    padding), the mask is left out (noted): transformers tests it with data-dependent
    control flow, which ``vmap`` refuses, and without padding the model computes the
    same function without it.

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> m = torch_func(grads_workload("cnn-grads", 2))
        >>> m.fn(None)["conv1.weight"].shape
        torch.Size([2, 32, 1, 3, 3])

    Source: torch.func's "Per-sample-gradients" tutorial.
    """
    model, loss_fn = w.model, w.loss_fn
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    inputs, note = w.inputs, ""
    if isinstance(inputs, dict) and "attention_mask" in inputs \
            and bool((inputs["attention_mask"] == 1).all()):
        inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        note = ("called without attention_mask (all ones here): transformers tests the mask "
                "with data-dependent control flow, which vmap refuses")

    def compute_loss(params: dict[str, Tensor], x: Any, y: Tensor) -> Tensor:
        batch, weights = tree_map(lambda t: t.unsqueeze(0), x), {**frozen, **params}
        out = (functional_call(model, weights, (), batch) if isinstance(batch, dict)
               else functional_call(model, weights, (batch,)))
        return loss_fn(out, y.unsqueeze(0)).sum()

    randomness = "error"
    if w.seed is not None:  # a model in training mode: vmap refuses random ops unless told
        randomness = "different"
        note = "; ".join(filter(None, [note, (
            "randomness='different' (vmap refuses random ops by default): each sample "
            "draws its own dropout masks inside vmap, not the batch forward's, so its "
            "gradients are of another forward")]))
    per_sample = vmap(grad(compute_loss), in_dims=(None, 0, 0), randomness=randomness)
    return Method("torch.func vmap", lambda _: per_sample(params, inputs, w.targets), note)


def param_jacobian_rows(w: Workload) -> list[Method]:
    """``vmap(jacrev)`` and ``vmap(jacfwd)`` of one sample's output with respect to the
    parameters (dicts ``{name: (B, Y, *shape)}``), as the question's accepted answer
    writes them; ``vmap(jacfwd)`` is skipped where it would need over the memory limit
    (:func:`~persample_bench.anchors.memory.jacfwd_skip`).

    Examples:
        >>> from persample_bench.workloads import jacobian_workload
        >>> rev, fwd = param_jacobian_rows(jacobian_workload("mlp-param-jac", 2))
        >>> rev.name, rev.fn(None)["0.weight"].shape, fwd.fn is None
        ('vmap(jacrev)', torch.Size([2, 10, 20, 784]), False)

    Source: the accepted answer to "How to efficiently calculate gradients of all outputs
    with respect to parameters?".
    """
    model, x = w.model, w.inputs
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_output(th: dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(model, th, (xi.unsqueeze(0),))[0]

    def transform(jac_fn) -> Callable[[Tensor], dict[str, Tensor]]:
        per_sample = vmap(jac_fn(sample_output), in_dims=(None, 0))
        return lambda _: per_sample(params, x)

    why = jacfwd_skip(x.shape[0], num_params(model), max(q.numel() for q in params.values()),
                      x.element_size())
    fwd = Method("vmap(jacfwd)", None, why) if why else Method("vmap(jacfwd)", transform(jacfwd))
    return [Method("vmap(jacrev)", transform(jacrev)), fwd]


def input_jacobian_rows(w: Workload) -> list[Method]:
    """``vmap(jacrev)`` and ``vmap(jacfwd)`` of one sample's output with respect to its
    input: ``(B, Y, D)`` tensors.

    Examples:
        >>> from persample_bench.workloads import jacobian_workload
        >>> [m.fn(None).shape for m in input_jacobian_rows(jacobian_workload("pinn-input-jac", 2))]
        [torch.Size([2, 400, 1]), torch.Size([2, 400, 1])]
    """
    model, x = w.model, w.inputs

    def sample_fn(xi: Tensor) -> Tensor:
        return model(xi.unsqueeze(0))[0]

    return [Method("vmap(jacrev)", lambda _: vmap(jacrev(sample_fn))(x)),
            Method("vmap(jacfwd)", lambda _: vmap(jacfwd(sample_fn))(x))]
