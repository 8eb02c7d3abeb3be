"""The capture + layer-rule engine (DESIGN.md points 1 to 3).

1. One forward with hooks records every call of every module that holds
   trainable parameters (and of their ancestors, for parameters used outside
   their own module).
2. One ``torch.autograd.grad(total_loss, outputs)`` gives each call's
   backprops; the summed weight gradients are never computed.
3. Each call's per-sample gradients come from its layer rule, written straight
   into the destination, or from the per-module ``torch.func`` fallback.
   A parameter used by several calls (weight tying, a module called twice)
   gets the sum of its contributions, sample by sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .capture import Call, Capture, output_tensors
from .fallback import fallback_grads
from .rules import Rule, find_rule


@dataclass
class Job:
    """One captured call and the parameters whose per-sample gradients it contributes."""

    call: Call
    params: dict[str, nn.Parameter]  # name relative to call.module -> parameter
    rule: Rule | None  # None: per-module fallback


class GradSink:
    """Destinations of the per-sample gradients, keyed by parameter identity.

    The first contribution to a parameter is written straight into its
    destination; later ones (tied weights, repeated calls) go to a temporary
    and are added.
    """

    def __init__(self, dest: dict[int, Tensor]):
        self.dest = dest
        self.written: set[int] = set()

    def targets(self, params: dict[str, nn.Parameter]) -> dict[str, Tensor]:
        return {
            name: torch.empty_like(self.dest[id(p)]) if id(p) in self.written else self.dest[id(p)]
            for name, p in params.items()
        }

    def commit(self, params: dict[str, nn.Parameter], out: dict[str, Tensor]) -> None:
        for name, p in params.items():
            if id(p) in self.written:
                self.dest[id(p)].add_(out[name])
            else:
                self.written.add(id(p))

    def zero_unwritten(self) -> None:
        for key, tensor in self.dest.items():
            if key not in self.written:
                tensor.zero_()


def hooked_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module holding a trainable parameter in its subtree, by qualified name."""
    wanted = set()
    for qualified, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            parts = qualified.split(".")[:-1]
            wanted.update(".".join(parts[:k]) for k in range(len(parts) + 1))
    return {name: m for name, m in model.named_modules() if name in wanted}


def own_params(module: nn.Module, wanted: set[int]) -> dict[str, nn.Parameter]:
    return {
        n: p for n, p in module.named_parameters(recurse=False) if id(p) in wanted
    }


def plan_jobs(model: nn.Module, calls: list[Call], wanted: set[int]) -> list[Job]:
    """Assign every wanted parameter to the calls that contribute to it.

    A parameter is handled by the calls of the modules holding it. If none of
    them was called (e.g. ``nn.MultiheadAttention`` uses ``out_proj.weight``
    without calling ``out_proj``), it goes to the deepest called ancestor, whose
    whole forward is differentiated by the fallback.
    """
    jobs: list[Job] = []
    called = {id(c.module) for c in calls}
    for call in calls:
        params = own_params(call.module, wanted)
        if params:
            rule, _ = find_rule(call.module)
            jobs.append(Job(call, params, rule))
    covered = {id(p) for job in jobs for p in job.params.values()}
    orphans: dict[str, dict[str, nn.Parameter]] = {}  # ancestor name -> {relative: param}
    for qualified, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in wanted or id(p) in covered:
            continue
        owner = qualified.rpartition(".")[0]
        ancestor = _deepest_called_ancestor(model, owner, called)
        relative = qualified[len(ancestor) + 1 :] if ancestor else qualified
        orphans.setdefault(ancestor, {})[relative] = p
        covered.add(id(p))
    for call in calls:
        if call.name in orphans and orphans[call.name]:
            jobs.append(Job(call, orphans[call.name], None))
    return jobs


def _deepest_called_ancestor(model: nn.Module, owner: str, called: set[int]) -> str:
    parts = owner.split(".") if owner else []
    for k in range(len(parts), -1, -1):
        name = ".".join(parts[:k])
        if id(model.get_submodule(name)) in called:
            return name
    return ""  # the root is always called


def total_loss(loss: Any, n: int, reduction: str) -> Tensor:
    """The sum over samples of the per-sample losses, from what ``loss_fn`` returned."""
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.dim() == 0:
        return loss * n if reduction == "mean" else loss
    if loss.shape == (n,):
        return loss.sum()
    raise ValueError(
        f"loss_fn returned shape {tuple(loss.shape)}; it must return per-sample losses of "
        f"shape ({n},) or a scalar reduced over the batch (say how with loss_reduction=). "
        "For a torch.nn loss, use reduction='none' and reduce extra dims per sample, "
        "or reduction='mean'/'sum'."
    )


def check_unchanged(job: Job, n: int) -> None:
    """Raise if a captured tensor was modified in place after its module ran."""
    now = [t._version for t in job.call.tensors()]
    if now != job.call.versions:
        raise RuntimeError(
            f"an input or output of module '{job.call.name}' ({type(job.call.module).__name__}) "
            "was modified in place after the module ran (e.g. by nn.ReLU(inplace=True) or "
            "x += ...), so its captured activations are no longer valid. Make that "
            "operation out of place, or use method='vmap'."
        )


def _backprops_of(job: Job, grads: dict[int, Tensor | None], n: int, v: int) -> list[Tensor]:
    found = []
    for out in output_tensors(job.call):
        g = grads[id(out)]
        found.append(out.new_zeros((n, v, *out.shape[1:])) if g is None else g)
    for g in found:
        if g.dim() < 2 or g.shape[0] != n:
            raise ValueError(
                f"module '{job.call.name}' ({type(job.call.module).__name__}) returned a tensor "
                f"of shape {tuple(g.shape[:1]) + tuple(g.shape[2:])} whose dim 0 is not the "
                f"batch size {n}: the rules need the batch in dim 0 of every layer's input "
                "and output (a reshape to (batch * seq, features) mixes samples). Keep the "
                "batch dim, or use method='vmap'."
            )
    return found


Backward = Callable[[Any, list[Tensor]], tuple[Any, ...]]


def run_rules(model: nn.Module, args: tuple, root: Callable[[Any], Tensor], backward: Backward,
              dest: dict[int, Tensor]) -> None:
    """The engine: capture a forward, pull cotangents back to every call, apply the rules.

    ``root(output)`` gives the tensor to differentiate (the summed loss, or the
    model's output); ``backward(root_value, outputs)`` returns for each captured
    output its ``(n, v, *out_shape)`` backprops (or ``None``); ``dest`` maps
    ``id(param)`` to the ``(n, v, *param.shape)`` destination.
    """
    n = args[0].shape[0]
    with torch.enable_grad(), Capture(hooked_modules(model)) as cap:
        value = root(model(*args))
    jobs = plan_jobs(model, cap.calls, set(dest))
    for job in jobs:
        check_unchanged(job, n)
    outs = {id(t): t for job in jobs for t in output_tensors(job.call)}
    if outs and not value.requires_grad:
        raise RuntimeError(
            "the result does not depend on any parameter through autograd (was the "
            "model's output detached?)"
        )
    got = backward(value, list(outs.values())) if outs else ()
    grads = dict(zip(outs.keys(), got))
    v = next(iter(dest.values())).shape[1]
    sink = GradSink(dest)
    with torch.no_grad():
        for job in jobs:
            _apply(job, _backprops_of(job, grads, n, v), n, sink)
    sink.zero_unwritten()


def _apply(job: Job, backprops: list[Tensor], n: int, sink: GradSink) -> None:
    """Per-sample results of one call, by its rule or the fallback, into ``sink``."""
    out = sink.targets(job.params)
    if not backprops:  # no output depends on the parameters: zero contribution
        for t in out.values():
            t.zero_()
    elif job.rule is not None and len(backprops) == 1:
        job.rule.fn(job.call.module, job.call.args, backprops[0], out)
    else:
        for name, g in fallback_grads(job.call, job.params, backprops, n).items():
            out[name].copy_(g)
    sink.commit(job.params, out)


def rules_grads(
    model: nn.Module,
    args: tuple,
    targets: Any,
    loss_fn: Callable,
    loss_reduction: str,
    dest: dict[int, Tensor],
) -> None:
    """Per-sample gradients of one batch into ``dest`` (id(param) -> (n, *shape))."""
    n = args[0].shape[0]

    def root(output: Any) -> Tensor:
        return total_loss(loss_fn(output, targets), n, loss_reduction)

    def backward(total: Tensor, outs: list[Tensor]) -> tuple:
        grads = torch.autograd.grad(total, outs, allow_unused=True)
        return tuple(None if g is None else g.unsqueeze(1) for g in grads)  # (n, 1, *out)

    run_rules(model, args, root, backward, {k: t.unsqueeze(1) for k, t in dest.items()})


def rules_param_jacobian(
    model: nn.Module, args: tuple, outputs: range, dest: dict[int, Tensor]
) -> None:
    """Rows ``outputs`` of the per-sample parameter Jacobian of one batch into ``dest``.

    DESIGN.md point 4: the cotangents are one-hot over the (flattened) output
    index and the same for every sample; since samples are independent, one
    batched backward (``is_grads_batched=True``) gives all ``n * v`` rows.
    ``dest`` maps ``id(param)`` to ``(n, v, *param.shape)`` with ``v = len(outputs)``.
    """
    n = args[0].shape[0]

    def root(output: Any) -> Tensor:
        if not isinstance(output, Tensor) or output.dim() == 0 or output.shape[0] != n:
            raise ValueError(
                f"the model must return one tensor with the batch size {n} in dim 0, got "
                f"{tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__}"
            )
        return output

    def backward(output: Tensor, outs: list[Tensor]) -> tuple:
        flat_out = output.shape[1:].numel()
        onehot = output.new_zeros(len(outputs), flat_out)  # (v, Y)
        onehot[torch.arange(len(outputs)), torch.tensor(list(outputs))] = 1
        cot = onehot.view(len(outputs), 1, *output.shape[1:]).expand(-1, *output.shape)
        grads = torch.autograd.grad(output, outs, cot, is_grads_batched=True, allow_unused=True)
        return tuple(None if g is None else g.movedim(0, 1) for g in grads)  # (n, v, *out)

    run_rules(model, args, root, backward, dest)
