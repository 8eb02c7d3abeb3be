"""What path each module takes (:func:`supported`), and a check against the loop (:func:`verify`).

For users with their own models: ``supported`` says, before any real run, which
modules get a fast layer rule, which the per-module ``torch.func`` fallback,
and which cannot be handled (with the reason and the fix); ``verify`` runs the
fast path and the obviously correct loop on a few samples and reports the
largest error per parameter.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from . import checks
from .engine import capture_backprops, loss_backprops, module_rule_of, write_per_sample
from .engine.paths import Path
from .errors import REFUSALS, InternalError, internal, internal_errors_raised
from .inputs import Batch, as_batch, samples_of
from .precision import autocast_state, without_autocast
from .reference import forward_per_sample_grads, loop_per_sample_grads
from .rng import restore, snapshot


@dataclass(frozen=True)
class Route:
    """The path of some of one module's trainable parameters."""

    module: str  # qualified name of the module holding them, "" for the root
    type: str  # the module's class name
    params: tuple[str, ...]  # its trainable parameters on this path
    path: str  # "rule", "module rule", "op vjp", "fallback", "vmap", "unused", "unsupported"
    reason: str  # the ops (or call) that compute them, or why there is no fast path


class Routes(list):
    """A list of :class:`Route` that prints as a table; ``plan``: for a traced answer,
    whether the capture took the data flow of an earlier call like it (``"cached:
    ..."``, see :func:`persample.clear_plans`) or decided it anew (``"new: ..."``)."""

    plan: str = ""

    def __str__(self) -> str:
        head = ("module", "type", "path", "parameters", "reason")
        lines = [(r.module or "<root>", r.type, r.path, ", ".join(r.params), r.reason)
                 for r in self]
        widths = [max(len(str(x[k])) for x in [head, *lines]) for k in range(4)]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(x, widths)) + "  " + x[4]
                         for x in [head, *lines])


# stock layers whose forward is ops with rules (the static answer without inputs)
_STOCK = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.Embedding, nn.EmbeddingBag,
          nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.instancenorm._InstanceNorm,
          nn.modules.batchnorm._BatchNorm, nn.PReLU, nn.MultiheadAttention)


def _static_route(name: str, module: nn.Module, params: tuple[str, ...]) -> Route:
    kind = type(module).__name__
    rule, _ = module_rule_of(module)
    refusal = rule.spec.refusal if rule is not None else None
    reason = checks.mixing_reason(module) or (refusal(module) if refusal else None)
    if reason:
        return Route(name, kind, params, "unsupported", reason)
    if rule is not None:
        return Route(name, kind, params, "module rule", f"{rule.base.__name__} rule")
    forward = type(module).forward
    if isinstance(module, _STOCK) and any(forward is cls.__dict__.get("forward")
                                          for cls in type(module).__mro__
                                          if cls.__module__.startswith("torch.nn.")):
        return Route(name, kind, params, "rule", f"the ops of {kind}.forward have rules")
    return Route(name, kind, params, "unknown",
                 "depends on the ops its forward runs: pass inputs to find out")


@checks.keeps_buffers
def supported(model: nn.Module, inputs: Any = None, targets: Any = None,
              loss_fn: Callable[[Any, Any], Tensor] | None = None) -> Routes:
    """Which path each trainable parameter takes, by module: rule, op vjp, fallback, ...

    With ``inputs`` (a batch as for :func:`persample.per_sample_grads`) the model
    runs once, forward and one backward (of ``loss_fn(output, targets)`` if given,
    else of the sum of its outputs), through the same capture, planning and rules as
    a real call, and the answer is what that call does: ``"rule"`` (the op rules of
    the ops reading the parameter, whatever module class wraps them), ``"module
    rule"`` (a recurrent layer's rule), ``"op vjp"`` (the exact per-sample VJP of an op
    without a rule, slower), ``"fallback"`` (the
    per-module ``torch.func`` fallback over the call named in ``reason``), ``"vmap"``
    (the engine cannot split this model's gradients: ``method="auto"`` runs
    ``torch.func`` over the whole model, else the loop), ``"unused"`` (never read:
    zeros). Without ``inputs`` the answer comes from the module types alone:
    stock layers ``"rule"``, modules with a module rule ``"module rule"``, others
    ``"unknown"``.

    Args:
        model: any ``nn.Module``; it is left unchanged (no hooks, no state).
        inputs: optional, as for :func:`persample.per_sample_grads` (a tensor, a
            tuple, a dict, or ``(args, kwargs)``).
        targets, loss_fn: optional, as for :func:`persample.per_sample_grads`: the
            loss the call will differentiate (a loss that does not reach some output
            leaves the parameters only that output reads ``"unused"``).

    Returns:
        :class:`Routes`, a list of :class:`Route` ``(module, type, params, path,
        reason)``: one per module holding trainable parameters and path, in
        ``named_modules()`` order; ``print()`` shows it as a table. With ``inputs``,
        ``.plan`` says whether the capture took the data flow of an earlier call like
        it (``"cached: ..."``, :func:`persample.clear_plans`) or decided it anew.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``inputs`` hold no tensor. The
            errors of the model's own forward propagate.

    Examples:
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
        [('0', 'rule'), ('1', 'unknown')]
        >>> [(r.module, r.path) for r in supported(nn.Sequential(nn.Linear(2, 3), Gain()),
        ...                                        torch.randn(4, 2))]
        [('0', 'rule'), ('1', 'rule')]

    Source: the engine of this library (the batch by data flow, rules by op).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if inputs is None:
        return Routes(_static_routes(model))
    states = snapshot()  # (its forward's draws undone: the caller's stream goes on as it was)
    try:
        notes: list[str] = []
        routes = Routes(_traced_routes(model, as_batch(inputs), targets, loss_fn, notes))
        routes.plan = notes[0] if notes else ""
        return routes
    finally:
        restore(states)


def _static_routes(model: nn.Module) -> list[Route]:
    routes = []
    for name, module in model.named_modules():
        params = tuple(n for n, p in module.named_parameters(recurse=False) if p.requires_grad)
        if params:
            routes.append(_static_route(name, module, params))
    return routes


def traced_paths(model: nn.Module, batch: Batch, targets: Any = None,
                 loss_fn: Callable | None = None, notes: list[str] | None = None
                 ) -> dict[int, Path]:
    """Run the engine on ``batch`` with ``loss_fn`` (or the sum of the outputs) as the
    loss; the path each trainable parameter took (``id`` -> :class:`Path`). ``notes``
    gets the capture's plan note (:meth:`persample.engine.Captured.plan_note`)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    reason = checks.mixing_reason_of(model)
    if reason:
        return {pid: Path("unsupported", "", reason) for pid in params}
    if batch.n == 0:
        return {pid: Path("rule", "", "an empty batch: nothing to compute") for pid in params}

    def root(output: Any, cap) -> Tensor:
        leaves = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad
                  and t.is_floating_point()]
        return sum((t.sum() for t in leaves), torch.zeros(()))

    def backward(total: Tensor, edges: list, _: Any) -> tuple:
        grads = torch.autograd.grad(total, edges, allow_unused=True)
        return tuple(None if g is None else g.unsqueeze(0) for g in grads)

    try:
        if loss_fn is None:
            captured = capture_backprops(model, batch, root, backward, params, 1)
        else:
            captured = loss_backprops(model, batch, targets, loss_fn, params)
        with internal("the rules"):
            write_per_sample(captured, {pid: p.new_empty((batch.n, 1, *p.shape))
                                   for pid, p in params.items()})
    except REFUSALS + (InternalError,) as err:
        if isinstance(err, InternalError) and internal_errors_raised():
            raise
        why = (f"{err} method='auto' runs torch.func over the whole model (the loop if "
               "that fails)")
        return {pid: Path("vmap", "", why) for pid in params}
    if notes is not None:
        notes.append(captured.plan_note())
    paths = captured.paths  # (merged once: the plan's, updated by what the rules took)
    unread = Path("unused", "", "never read in this forward: zero per-sample gradients")
    return {pid: paths.get(pid, unread) for pid in params}


def _traced_routes(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable | None,
                   notes: list[str]) -> list[Route]:
    found = traced_paths(model, batch, targets, loss_fn, notes)
    modules = dict(model.named_modules())
    merged: dict[tuple[str, str, str], list[str]] = {}
    for qualified, p in model.named_parameters():  # a parameter registered twice: once
        path = found.get(id(p))
        if path is None:
            continue
        owner, _, name = qualified.rpartition(".")
        merged.setdefault((owner, path.kind, _reason(path)), []).append(name)
    return [Route(owner, type(modules[owner]).__name__, tuple(names), kind, reason)
            for (owner, kind, reason), names in merged.items()]


def _reason(path: Path) -> str:
    """A route's reason: the ops for ``rule``; for ``op vjp`` the op whose per-sample
    vector-Jacobian product ``torch.func`` computes (the first one the run recorded),
    why its rule did not apply, and the other ops; else the path's own reason."""
    if path.kind != "op vjp":
        return path.reason or path.where
    first, _, rest = path.where.partition("; ")
    why = path.reason or "no rule"
    also = f"; also {rest}" if rest else ""
    return (f"{first}: {why}, so its exact per-sample vector-Jacobian product comes from "
            f"torch.func (slower than a rule){also}")


@dataclass
class Verification:
    """The result of :func:`verify`: the largest errors per parameter."""

    abs_error: dict[str, float]  # max |fast - loop| per parameter
    rel_error: dict[str, float]  # abs_error / max |loop|
    rtol: float  # the tolerance ok was judged by
    samples: int
    method: str = "rules"  # the path the fast call took ("rules", or why it fell back)
    mismatched: list[int] = field(default_factory=list)  # samples beyond rtol
    note: str | None = None  # why they differ, where verify could tell (float32 rounding)
    random_ops: list[str] = field(default_factory=list)  # the random ops the forward ran
    plan: str = ""  # the rules' capture: "cached: ..." (an earlier call's data flow) or "new: ..."
    certificates: list = field(default_factory=list)  # the fast call's, in the order run

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
        if self.plan and self.method == "rules":
            lines.append(f"plan: {self.plan}")
        lines += [f"certificate: {c.describe()}" for c in self.certificates]
        lines.append(f"{verdict}: {self.samples} samples, rtol {self.rtol:g}")
        if self.mismatched:
            lines.append(f"samples beyond rtol: {_listed(self.mismatched)}")
        if self.note:
            lines.append(self.note)
        if self.random_ops:
            lines.append(f"random ops: {', '.join(self.random_ops)}; the reference is the "
                         "forward that ran (the same draws)")
        if self.method != "rules":
            lines.append(f"method: {self.method}")
        return "\n".join(lines)


def _listed(samples: list[int], most: int = 10) -> str:
    more = f" and {len(samples) - most} more" if len(samples) > most else ""
    return ", ".join(map(str, samples[:most])) + more


_DEFAULT_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 2e-2}


@checks.keeps_buffers
def verify(
    model: nn.Module,
    inputs: Tensor | tuple,
    targets: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    samples: int | None = None,
    *,
    method: str = "auto",
    rtol: float | None = None,
) -> Verification:
    """Check the fast per-sample gradients against the loop, on every sample of the batch
    (or its first ``samples``).

    For a custom model: runs :func:`persample.per_sample_grads` with ``method``
    and :func:`persample.loop_per_sample_grads` (one ``autograd.grad`` per sample)
    on the same samples and reports, per parameter, the largest absolute error
    and the largest error relative to the loop's largest entry. For a tight
    check, convert the model and inputs to float64 first.

    A model that draws random numbers (dropout in training mode, stochastic depth) is
    checked against the forward that ran: the generators are put back where the call
    found them, one forward of the batch draws the same numbers, and each sample's loss
    on its rows of the output gets one ``autograd.grad``
    (:func:`persample.reference.forward_per_sample_grads`; where the output has no row
    per sample, the loop replaying each sample's part of the draws). The report names
    the random ops (``random_ops``).

    Args:
        model, inputs, targets, loss_fn, method: as for
            :func:`persample.per_sample_grads`.
        samples: how many samples (from the start of the batch) to check; default
            (``None``) the whole batch: a difference in one sample (a float32 near-tie
            in a max-pool, say) is found wherever it is.
        rtol: the relative error accepted by ``.ok``; default ``1e-8`` for
            float64 models, ``1e-4`` for float32, ``2e-2`` for bfloat16 (8 significand
            bits), ``1e-2`` for float16; under ``torch.autocast``, its dtype's (the loop
            then rounds as autocast does).

    Returns:
        :class:`Verification` with ``method`` (``"rules"``, or why ``auto`` fell back
        to ``torch.func`` or the loop), ``plan`` (for the rules: ``"cached: ..."``
        where the capture took the data flow of an earlier call like it, see
        :func:`persample.clear_plans`, else ``"new: ..."``), ``random_ops`` (``["dropout in module
        'drop' (Dropout)", ...]``, empty for a model that draws nothing),
        ``certificates`` (with ``method="auto"``, each
        :class:`~persample.certificate.Certificate` the fast call ran: it is always
        certified here, and a rejected method's is listed before the one that answered;
        an explicit method is not certified, its rows are compared), ``abs_error`` and
        ``rel_error`` (dicts by
        parameter name, in the parameters' units), ``ok``, ``worst``, ``mismatched``
        (the samples beyond ``rtol``) and ``note``: for a model below float64 whose
        mismatched samples agree with the loop when a float64 copy of the model is
        checked, a note that the difference is rounding (a near-tie of a max-pool,
        argmax or comparison decided differently in the batched forward), not an error;
        ``print()`` shows a table.

    Raises:
        ValueError: ``samples < 1``, and the errors of
            :func:`persample.per_sample_grads` (which propagate: a failing fast path
            is itself a finding).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        >>> x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
        >>> report = verify(net, x, y, nn.CrossEntropyLoss())
        >>> report.ok, report.samples
        (True, 16)

    Source: the loop over samples is the reference of every test here (the
    obviously correct method of PyTorch's "Per-sample-gradients" tutorial).
    """
    from .api import grads_taken
    from .whole import recorded_draws

    if samples is not None and (not isinstance(samples, int) or samples < 1):
        raise ValueError(f"samples must be a positive int or None (all), got {samples!r}")
    batch = as_batch(inputs)
    k = batch.n if samples is None else min(samples, batch.n)
    part, t = batch.samples(0, k), samples_of(targets, 0, k)
    states = snapshot()
    fast, taken = grads_taken(model, part, t, loss_fn, method=method,  # (an explicit
                              check="always" if method == "auto" else "never")  # method:
    # its rows compared)
    restore(states)
    random_ops = [d.describe() for d in recorded_draws(model, part)]
    restore(states)
    slow = (_forward_that_ran(model, part, t, loss_fn, states) if random_ops
            else loop_per_sample_grads(model, part, t, loss_fn))
    dtype = next(iter(slow.values())).dtype
    low = next((low for _, enabled, low in autocast_state() if enabled), dtype)
    tol = rtol or _DEFAULT_RTOL.get(low, 1e-2)
    abs_error, rel_error, per_sample = _errors(fast, slow)
    bad = [i for i, e in enumerate(per_sample.tolist()) if e > tol]
    report = Verification(abs_error, rel_error, tol, k, taken.describe(), bad,
                          plan=taken.plan, random_ops=random_ops,
                          certificates=taken.certificates)
    if bad and dtype != torch.float64 and not random_ops:
        report.note = _rounding_note(model, part, t, loss_fn, method, bad)
    return report


def _forward_that_ran(model: nn.Module, part: Batch, targets: Any, loss_fn: Callable,
                      states: list) -> dict[str, Tensor]:
    """The per-sample gradients of one forward of ``part`` from the generators'
    ``states``: each sample's loss on its rows of the output, or where the output has
    no row per sample, the loop replaying each sample's draws."""
    from .whole import loop_grads

    try:
        return forward_per_sample_grads(model, part, targets, loss_fn)
    except Exception:
        restore(states)
        return loop_grads(model, part, targets, loss_fn)


def _errors(fast: dict[str, Tensor], slow: dict[str, Tensor]
            ) -> tuple[dict[str, float], dict[str, float], Tensor]:
    """Per parameter the largest absolute error and that over the loop's largest entry;
    per sample the largest of those relative errors, (k,)."""
    abs_error, rel_error, per_sample = {}, {}, None
    for name, want in slow.items():
        if not want.numel():
            abs_error[name] = rel_error[name] = 0.0
            continue
        diff = (fast[name] - want).abs().unsqueeze(-1).flatten(1).amax(1).double()  # (k,)
        scale = want.abs().max().item()
        abs_error[name] = diff.max().item()
        rel = diff / scale if scale > 0 else diff
        rel_error[name] = rel.max().item()
        per_sample = rel if per_sample is None else torch.maximum(per_sample, rel)
    k = next(iter(slow.values())).shape[0]
    return abs_error, rel_error, per_sample if per_sample is not None else torch.zeros(k)


_MAXIMA = ("MaxPool", "AdaptiveMaxPool", "FractionalMaxPool", "MaxUnpool")


def _rounding_note(model, part, targets, loss_fn, method, bad: list[int]
                   ) -> str | None:
    """When the samples beyond tolerance agree in float64 (a copy of the model, the
    inputs widened), the difference is the low precision's rounding, not an error of
    the fast path: say so, naming the model's max-pools (the usual near-tie)."""
    from .api import grads_taken

    try:
        wide = copy.deepcopy(model).double()
        to64 = partial(tree_map, lambda t: t.double() if isinstance(t, Tensor)
                       and t.is_floating_point() else t)
        part64 = dataclasses.replace(part, args=to64(part.args), kwargs=to64(part.kwargs))
        with without_autocast():
            fast, _ = grads_taken(wide, part64, to64(targets), loss_fn, method=method)
            slow = loop_per_sample_grads(wide, part64, to64(targets), loss_fn)
    except Exception:  # the float64 copy is a diagnosis, never a new failure
        return None
    _, _, per_sample = _errors(fast, slow)
    if per_sample[bad].max().item() > _DEFAULT_RTOL[torch.float64]:
        return None
    maxima = [f"{type(m).__name__} {name!r}" for name, m in model.named_modules()
              if type(m).__name__.startswith(_MAXIMA)]
    where = (f"a near-tie in {', '.join(maxima)} picks another element in the batched "
             "forward than in the single-sample one" if maxima else
             "a near-tie of a max, argmax, sort or comparison in the forward is decided "
             "differently in the batched and the single-sample forward")
    return (f"rounding, not an error: in float64 (a copy of the model) samples "
            f"{_listed(bad)} agree with the loop (max rel error "
            f"{per_sample[bad].max().item():.1e}); in {_low_name(model)} {where}")


def _low_name(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "low precision"
