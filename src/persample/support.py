"""What path each module takes (:func:`supported`), and a check against the loop (:func:`verify`).

For users with their own models: ``supported`` says, before any real run, which
modules get a fast layer rule, which the per-module ``torch.func`` fallback,
and which cannot be handled (with the reason and the fix); ``verify`` runs the
fast path and the obviously correct loop on a few samples and reports the
largest error per parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .capture import Capture
from .engine import hooked_modules, plan_jobs
from .reference import loop_per_sample_grads, rows
from .rules import find_rule
from .rules.recurrent import training_dropout


@dataclass(frozen=True)
class Route:
    """The path of one module's trainable parameters."""

    module: str  # qualified name, "" for the root
    type: str  # the module's class name
    params: tuple[str, ...]  # its trainable parameters handled on this path
    path: str  # "rule", "taps", "fallback", "unsupported" or "unused"
    reason: str  # the rule's family, or why there is no rule / no path


class Routes(list):
    """A list of :class:`Route` that prints as a table."""

    def __str__(self) -> str:
        head = ("module", "type", "path", "parameters", "reason")
        lines = [(r.module or "<root>", r.type, r.path, ", ".join(r.params), r.reason)
                 for r in self]
        widths = [max(len(str(x[k])) for x in [head, *lines]) for k in range(4)]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(x, widths)) + "  " + x[4]
                         for x in [head, *lines])


def _static_route(name: str, module: nn.Module, params: tuple[str, ...]) -> Route:
    kind = type(module).__name__
    reason = checks.mixing_reason(module) or (
        training_dropout(module) if isinstance(module, nn.RNNBase) else None)
    if reason:
        return Route(name, kind, params, "unsupported", reason)
    rule, why = find_rule(module)
    if rule is not None:
        return Route(name, kind, params, "rule", f"{rule.base.__name__} rule")
    return Route(name, kind, params, "fallback",
                 f"{why}: torch.func per module (if it fails, method='auto' uses the loop)")


@checks.keeps_buffers
def supported(model: nn.Module, inputs: Tensor | tuple | None = None) -> Routes:
    """Which path each module with trainable parameters takes: rule, fallback or none.

    Without ``inputs`` the answer comes from the module types alone. With
    ``inputs`` (a batch as for :func:`persample.per_sample_grads`) the model is
    run once, without any backward, and the answer is what the engine would
    really do: a parameter read outside its own module (``out_proj`` inside
    ``nn.MultiheadAttention``, a tied weight used with ``F.linear``) is shown on
    the call that differentiates it; a parameter without a rule that the capture
    can follow op by op (a class token, a custom module's scale) is ``"taps"``;
    parameters the forward never reads are ``"unused"`` (zero gradients).

    Args:
        model: any ``nn.Module``; it is left unchanged (no hooks, no state).
        inputs: optional tensor ``(B, ...)`` or tuple of tensors, passed as
            ``model(*inputs)``.

    Returns:
        :class:`Routes`, a list of :class:`Route` ``(module, type, params, path,
        reason)`` in ``named_modules()`` order (with inputs: call order); ``path``
        is ``"rule"``, ``"fallback"``, ``"unsupported"``, ``"unused"`` or (with
        inputs) ``"taps"``.
        ``print()`` shows it as a table.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``inputs`` is not a tensor or
            a tuple of tensors. Errors of the model's own forward propagate.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3), nn.PReLU())
        >>> [(r.module, r.path) for r in supported(net)]
        [('0', 'rule'), ('2', 'rule'), ('3', 'rule')]
        >>> class Gain(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.g = nn.Parameter(torch.ones(3))
        ...     def forward(self, x):
        ...         return x * self.g
        >>> [(r.module, r.path) for r in supported(nn.Sequential(nn.Linear(2, 3), Gain()))]
        [('0', 'rule'), ('1', 'fallback')]

    Source: the engine of this library (DESIGN.md points 1 to 3).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if inputs is None:
        return Routes(_static_routes(model))
    return Routes(_traced_routes(model, checks.as_args(inputs)))


def _static_routes(model: nn.Module) -> list[Route]:
    routes = []
    for name, module in model.named_modules():
        params = tuple(n for n, p in module.named_parameters(recurse=False) if p.requires_grad)
        if params:
            routes.append(_static_route(name, module, params))
    return routes


def _traced_routes(model: nn.Module, args: tuple) -> list[Route]:
    params = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    with torch.enable_grad(), Capture(hooked_modules(model), set(params), len(args[0])) as cap:
        model(*args)  # with grad: the taps follow only ops that autograd records
    merged: dict[tuple[int, str], Route] = {}  # one row per call and path
    seen: set[int] = set()
    for job in plan_jobs(model, cap, set(params)):
        seen.update(id(p) for p in job.params.values())
        route = _job_route(job)
        key = (id(job.call), route.path)
        if key in merged:
            route = Route(route.module, route.type, merged[key].params + route.params,
                          route.path, route.reason)
        merged[key] = route
    routes = list(merged.values())
    unused = tuple(name for pid, name in params.items() if pid not in seen)
    if unused:
        routes.append(Route("", type(model).__name__, unused, "unused",
                            "never read in this forward: zero per-sample gradients"))
    return routes


def _job_route(job) -> Route:
    names = tuple(job.params)
    if job.taps:
        return Route(job.call.name, type(job.call.module).__name__, names, "taps",
                     f"per-sample VJPs of the {len(job.taps)} op(s) that bring it to the batch")
    if job.rule is not None:
        return Route(job.call.name, type(job.call.module).__name__, names, "rule",
                     f"{job.rule.base.__name__} rule")
    route = _static_route(job.call.name, job.call.module, names)
    if route.path == "rule":  # a rule exists but this call does not fit it
        return Route(route.module, route.type, names, "fallback",
                     "inputs not positional, or parameters used outside the module")
    return route


@dataclass
class Verification:
    """The result of :func:`verify`: the largest errors per parameter."""

    abs_error: dict[str, float]  # max |fast - loop| per parameter
    rel_error: dict[str, float]  # abs_error / max |loop|
    rtol: float  # the tolerance ok was judged by
    samples: int

    @property
    def ok(self) -> bool:
        """Every parameter's relative error is within ``rtol``."""
        return all(e <= self.rtol for e in self.rel_error.values())

    @property
    def worst(self) -> str | None:
        """The parameter with the largest relative error."""
        return max(self.rel_error, key=self.rel_error.get) if self.rel_error else None

    def __str__(self) -> str:
        width = max([len(n) for n in self.abs_error] + [9])
        lines = [f"{'parameter':{width}}  max abs error  max rel error"]
        lines += [f"{n:{width}}  {self.abs_error[n]:13.3e}  {self.rel_error[n]:13.3e}"
                  for n in self.abs_error]
        verdict = "OK" if self.ok else "MISMATCH"
        lines.append(f"{verdict}: {self.samples} samples, rtol {self.rtol:g}")
        return "\n".join(lines)


_DEFAULT_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4}


def verify(
    model: nn.Module,
    inputs: Tensor | tuple,
    targets: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    samples: int = 4,
    *,
    loss_reduction: str = "mean",
    method: str = "auto",
    rtol: float | None = None,
) -> Verification:
    """Check the fast per-sample gradients against the loop on the first ``samples`` samples.

    For a custom model: runs :func:`persample.per_sample_grads` with ``method``
    and :func:`persample.loop_per_sample_grads` (one ``autograd.grad`` per sample)
    on the same samples and reports, per parameter, the largest absolute error
    and the largest error relative to the loop's largest entry. For a tight
    check, convert the model and inputs to float64 first.

    Args:
        model, inputs, targets, loss_fn, loss_reduction, method: as for
            :func:`persample.per_sample_grads`.
        samples: how many samples (from the start of the batch) to check; the
            whole batch if it has fewer.
        rtol: the relative error accepted by ``.ok``; default ``1e-8`` for
            float64 models, ``1e-4`` for float32, ``1e-2`` for lower precisions.

    Returns:
        :class:`Verification` with ``abs_error`` and ``rel_error`` (dicts by
        parameter name, in the parameters' units), ``ok``, ``worst``; ``print()``
        shows a table.

    Raises:
        ValueError: ``samples < 1``, and the errors of
            :func:`persample.per_sample_grads` (which propagate: a failing fast path
            is itself a finding).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        >>> x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
        >>> report = verify(net, x, y, nn.CrossEntropyLoss())
        >>> report.ok, report.samples
        (True, 4)

    Source: the loop over samples is the reference of every test here (the
    obviously correct method, seed 001).
    """
    from .api import per_sample_grads

    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    args = checks.as_args(inputs)
    k = min(samples, args[0].shape[0])
    a, t = rows(args, 0, k), rows(targets, 0, k)
    fast = per_sample_grads(model, a, t, loss_fn, loss_reduction=loss_reduction, method=method)
    slow = loop_per_sample_grads(model, a, t, loss_fn)
    abs_error, rel_error = {}, {}
    for name, want in slow.items():
        err = (fast[name] - want).abs().max().item() if want.numel() else 0.0
        scale = want.abs().max().item() if want.numel() else 0.0
        abs_error[name] = err
        rel_error[name] = err / scale if scale > 0 else err
    dtype = next(iter(slow.values())).dtype
    return Verification(abs_error, rel_error, rtol or _DEFAULT_RTOL.get(dtype, 1e-2), k)
