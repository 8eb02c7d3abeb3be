"""The capture + rule engine: the batch by data flow, rules by op.

1. One forward under :class:`~persample.capture.Capture` records the layout of
   every tensor (by data flow) and every op that reads a trainable parameter.
2. :func:`~persample.plan.plan` gives every parameter its path (``plan.py``).
3. One ``torch.autograd.grad`` from the summed per-sample losses to the gradient
   edges of the planned ops' outputs gives their backprops; the summed weight
   gradients are never computed.
4. :func:`~persample.pullback.write_per_sample` runs the rules into the result
   (``pullback.py``).

A batch of one needs no capture: its per-sample gradient is the gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import TorchFunctionMode

from .batch import Batched, Layout, op_leaves
from .capture import Capture
from .errors import NeedsWholeModel, internal
from .inputs import Batch, located_of
from .plan import Captured, Path, Plan, edge_key, param_name, plan
from .pullback import write_per_sample
from .rules import module_rule
from .sharded import fsdp_units, gatherer

Backward = Callable[[Tensor, list[GradientEdge], Plan], tuple]


def capture_backprops(model: nn.Module, batch: Batch, root: Callable[[Any, Capture], Tensor],
                      backward: Backward, watched: dict[int, nn.Parameter], v: int) -> Captured:
    """Capture a forward, plan, and pull the cotangents back to every planned edge.

    The model's ``forward`` and the user's part of ``root`` (the loss) run as they are:
    their errors propagate unchanged. persample's own work (the capture's data flow,
    the planning, the backward to the planned edges) raises
    :class:`~persample.errors.InternalError` if it fails, or a refusal
    (:data:`~persample.errors.REFUSALS`) where the rules cannot split the model.
    A batch of one needs no capture: its per-sample gradient is the gradient.
    """
    units = fsdp_units(model)
    if batch.n == 1 and not units:  # (sharded: every rank replays the same ops, below)
        return _one_sample(model, batch, root, backward, watched, v)
    with torch.enable_grad():
        with Capture(model, watched, batch.n, batch.located, batch.shared, module_rule) as cap:
            output = batch.call(model)
        value = root(output, cap)
    gather = gatherer(units)
    for op in cap.ops if gather is not None else ():  # FSDP frees what the ops read
        op.gather = gather
    del output  # the model's output holds nothing the backward needs beyond `value`
    with internal("planning the per-sample work"):
        result = plan(cap, watched)
        cap.release_calls([call for call, _ in result.module_jobs + result.fallback_jobs])
        edges = result.edges()
    if edges and not value.requires_grad:
        raise RuntimeError(
            "the result does not depend on any parameter through autograd (was the "
            "model's output detached?)")
    got = backward(value, edges, result) if edges else ()  # the model's own backward code
    with internal("reading the backward's gradients"):
        grads = {edge_key(e): g for e, g in zip(edges, got)}
        hidden = [p for p in result.reach if grads.get(edge_key(get_gradient_edge(p)))
                  is not None]
    if hidden:
        raise NeedsWholeModel(
            f"parameter {param_name(model, id(hidden[0]))} gets gradient through ops the "
            "capture cannot follow (a custom autograd.Function, TorchScript code, or a "
            "tensor it was written into in place)")
    return Captured(cap, result, grads, batch.n, v)


class _Whole:
    """A batch of one: every tensor of the forward is that sample's."""

    def __init__(self, model: nn.Module, watched: dict[int, nn.Parameter]):
        self.model, self.watched, self.derived = model, watched, {}

    def layout(self, t: Tensor) -> Layout:
        return Batched(0)


def _one_sample(model, batch, root, backward, watched, v) -> Captured:
    whole = _Whole(model, watched)
    with torch.enable_grad():
        value = root(batch.call(model), whole)
    result = Plan(whole=list(watched.values()))
    result.paths = {pid: Path("rule", "", "a batch of one: the ordinary gradient")
                    for pid in watched}
    edges = [get_gradient_edge(p) for p in result.whole]
    got = backward(value, edges, result) if value.requires_grad else [None] * len(edges)
    return Captured(whole, result, {id(p): g for p, g in zip(result.whole, got)}, 1, v)


def loss_backprops(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                   watched: dict[int, nn.Parameter],
                   retain_graph: bool | Callable[[Plan], bool] = False) -> Captured:
    """Capture one batch and the backprops ``(n, 1, *out)`` of each sample's own loss;
    ``retain_graph``: keep the model's autograd graph after the backward (or a function
    of the plan that says whether to)."""
    from .loss import total_loss

    def root(output: Any, cap: Capture) -> Tensor:
        follow = None
        if isinstance(cap, Capture):  # (a batch of one has none) the targets' samples, and
            cap.add_inputs(located_of(targets, batch.n))  # the loss's ops followed
            follow = cap.follow
        with _ReadCheck(cap):
            return total_loss(output, targets, loss_fn, batch.n, cap.layout, follow)

    def backward(total: Tensor, edges: list, planned: Plan) -> tuple:
        retain = retain_graph(planned) if callable(retain_graph) else retain_graph
        grads = torch.autograd.grad(total, edges, allow_unused=True, retain_graph=retain)
        return tuple(None if g is None else g.unsqueeze(0) for g in grads)  # (1, *out)

    return capture_backprops(model, batch, root, backward, watched, 1)


class _ReadCheck(TorchFunctionMode):
    """While the loss runs: a parameter read there has a gradient path the capture
    did not see (the loss must only use the model's output)."""

    def __init__(self, cap: Capture):
        super().__init__()
        self.watched = cap.watched

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in op_leaves(args, kwargs):
            if self.watched.get(id(t)) is t and t.requires_grad:
                raise ValueError(
                    "a trainable parameter is read in loss_fn, outside the model's forward, "
                    "so its per-sample gradient cannot be attributed. Read it inside the "
                    "forward of a module, or freeze it.")
        return func(*args, **kwargs)


def rules_grads(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                dest: dict[int, Tensor], watched: dict[int, nn.Parameter]) -> Captured:
    """Per-sample gradients of one batch into ``dest`` (``id(param) -> (n, *shape)``)."""
    cap = loss_backprops(model, batch, targets, loss_fn, watched)
    with internal("the rules"):
        write_per_sample(cap, {k: t.unsqueeze(1) for k, t in dest.items()})
    return cap


def rules_param_jacobian(model: nn.Module, batch: Batch, outputs: range,
                         dest: dict[int, Tensor], watched: dict[int, nn.Parameter]) -> Captured:
    """Rows ``outputs`` of the per-sample parameter Jacobian of one batch into ``dest``.

    The cotangents are one-hot over the (flattened) output index
    and the same for every sample; since samples are independent, one batched
    backward (``is_grads_batched=True``) gives all ``n * v`` rows. ``dest`` maps
    ``id(param)`` to ``(n, v, *param.shape)`` with ``v = len(outputs)``.
    """
    from .jacobian import one_hot

    n = batch.n

    def root(output: Any, cap: Capture) -> Tensor:
        lay = cap.layout(output) if isinstance(output, Tensor) else None
        if not isinstance(output, Tensor) or output.dim() == 0 or output.shape[0] != n:
            raise ValueError(
                f"the model must return one tensor with the batch size {n} in dim 0, got "
                f"{tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__}")
        if n > 1 and not (isinstance(lay, Batched) and lay.dim == 0 and lay.outer == lay.inner == 1
                and lay.index is None):
            raise NeedsWholeModel(f"the model's output does not hold one sample per row ({lay})")
        return output

    def backward(output: Tensor, edges: list, _: Plan) -> tuple:
        cot = one_hot(outputs.start, outputs.stop, output)  # (v, n, *out_shape)
        return torch.autograd.grad(output, edges, cot, is_grads_batched=True, allow_unused=True)

    cap = capture_backprops(model, batch, root, backward, watched, len(outputs))
    with internal("the rules"):
        write_per_sample(cap, dest)
    return cap
