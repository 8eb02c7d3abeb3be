"""The capture + layer-rule engine (DESIGN.md points 1 to 3).

1. One forward with hooks records every call of every module that holds
   trainable parameters (and of their ancestors, for parameters used outside
   their own module).
2. One ``torch.autograd.grad(total_loss, outputs)`` gives each call's
   backprops; the summed weight gradients are never computed.
3. Each call's per-sample gradients come from its layer rule, written straight
   into the destination; a parameter without one, from the per-sample VJPs of
   the few ops that read it (``taps.py``) or the per-module ``torch.func``
   fallback.
   A parameter used by several calls (weight tying, a module called twice)
   gets the sum of its contributions, sample by sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import vmap
from torch.nn.utils.rnn import PackedSequence

from .capture import Call, Capture, output_tensors
from .fallback import fallback_grads
from .jacobian import one_hot
from .layout import Dim, forward_signature, front_activations, output_layouts
from .rules import Rule, find_rule
from .taps import Op, Tracer
from .vmap import batch_dims, unsqueeze


@dataclass
class Job:
    """One captured call and the parameters whose per-sample gradients it contributes."""

    call: Call
    params: dict[str, nn.Parameter]  # name relative to call.module -> parameter
    rule: Rule | None  # None: per-module fallback (or taps)
    taps: list[Op] | None = None  # ops through which one parameter enters (taps.py)
    tracer: Tracer | None = None


def job_outputs(job: Job) -> list[Tensor]:
    """The tensors whose backprops the job needs: the call's outputs (after its taps')."""
    return [op.output for op in job.taps or ()] + output_tensors(job.call) + job.call.extras


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


def plan_jobs(model: nn.Module, cap: Capture, wanted: set[int]) -> list[Job]:
    """Assign every used parameter to the calls that contribute to it.

    A parameter read only inside calls of a module holding it is handled by each
    call of those modules. A parameter read anywhere else (``out_proj.weight``
    inside ``nn.MultiheadAttention``; a weight reused with ``F.linear`` in a
    parent's forward) is handled by the deepest call under way at *every* read
    whose module contains it. Either way the call's rule does it if it has one
    (for parameters read elsewhere, only a ``nested`` rule); else the parameter's
    taps (the ops that bring it to the batch, ``taps.py``); else the per-module
    fallback, which differentiates the call's whole forward. Unused parameters
    get no job (zeros).
    """
    holders = _holders(model, wanted)
    escaped: dict[int, tuple[Call, dict[str, nn.Parameter]]] = {}
    for pid, stacks in cap.uses.items():
        if all(any(id(c.module) in holders[pid] for c in stack) for stack in stacks):
            continue
        call, name, param = _common_call(stacks, pid)
        escaped.setdefault(id(call), (call, {}))[1][name] = param
    taken = {id(p) for _, params in escaped.values() for p in params.values()}
    jobs = []
    for call in cap.calls:
        params = {n: p for n, p in call.module.named_parameters(recurse=False)
                  if id(p) in cap.uses and id(p) not in taken}
        if params:
            rule = _rule_for(call)
            jobs += [Job(call, params, rule)] if rule else _fallback_jobs(call, params, cap.tracer)
    for call, params in escaped.values():
        _add_escaped(jobs, call, params, cap.tracer)
    return jobs


def _add_escaped(jobs: list[Job], call: Call, params: dict[str, nn.Parameter],
                 tracer: Tracer | None) -> None:
    """Jobs for parameters read outside the modules holding them, inside ``call``: the
    call's own rule if it handles them (``nested``), else each parameter's taps (the
    ops that read it), else the fallback over the whole call."""
    rule = _rule_for(call)
    if rule is None or not rule.nested:
        jobs += _fallback_jobs(call, params, tracer)
        return
    for job in jobs:
        if job.call is call and job.rule is rule:  # one rule run for all of them
            job.params.update(params)
            return
    jobs.append(Job(call, params, rule))


def _fallback_jobs(call: Call, params: dict[str, nn.Parameter], tracer: Tracer | None
                   ) -> list[Job]:
    """Jobs without a rule: one per parameter the tracer followed to its taps (the ops
    that read it), and one per-module fallback over the whole call for the rest."""
    jobs, rest = [], {}
    for name, p in params.items():
        taps = tracer.taps_in(id(p), call) if tracer is not None else None
        if taps:
            jobs.append(Job(call, {name: p}, None, taps, tracer))
        else:
            rest[name] = p
    return jobs + ([Job(call, rest, None)] if rest else [])


def _holders(model: nn.Module, wanted: set[int]) -> dict[int, set[int]]:
    """id(param) -> ids of the modules holding it directly."""
    holders: dict[int, set[int]] = {pid: set() for pid in wanted}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if id(p) in holders:
                holders[id(p)].add(id(m))
    return holders


def _common_call(stacks: list[tuple[Call, ...]], pid: int) -> tuple[Call, str, nn.Parameter]:
    """The deepest call under way at every read of the parameter that contains it."""
    common: list[Call] = []
    for calls in zip(*stacks):
        if any(c is not calls[0] for c in calls):
            break
        common.append(calls[0])
    for call in reversed(common):
        for name, p in call.module.named_parameters(remove_duplicate=False):
            if id(p) == pid:
                return call, name, p
    raise ValueError(
        "a trainable parameter is read outside the model's forward (in loss_fn?) or outside "
        "every module that contains it, so its per-sample gradient cannot be attributed. "
        "Read it inside the forward of a module that holds it, or freeze it."
    )


def _interceptor(module: nn.Module) -> Callable | None:
    """The capture hook of ``module``'s rule, if it has one (see ``register_rule``)."""
    rule = find_rule(module)[0]
    return rule.capture if rule is not None else None


def _rule_for(call: Call) -> Rule | None:
    """The call's rule, if its inputs can be given to the rule positionally."""
    args = activations(call)
    if args is None or not args or not isinstance(args[0], (Tensor, PackedSequence)):
        return None
    return find_rule(call.module)[0]


def activations(call: Call) -> tuple | None:
    """The call's inputs as positional arguments of the module's ``forward``.

    Keyword inputs (``fc(input=x)``, ``bag(ids, offsets=o)``) are moved to their
    positional place; ``None`` if that is impossible (keyword-only arguments).
    """
    if not call.kwargs:
        return call.args
    signature = forward_signature(type(call.module).forward)
    try:
        bound = signature.bind(call.module, *call.args, **call.kwargs)
    except (AttributeError, TypeError):  # no signature, or the call does not fit it
        return None
    bound.apply_defaults()  # a keyword after a skipped default stays positional
    return None if bound.kwargs else bound.args[1:]  # without self


def total_loss(output: Any, targets: Any, loss_fn: Callable, n: int, reduction: str) -> Tensor:
    """The sum over samples of each sample's own loss ``loss_fn(output[i:i+1], targets[i:i+1])``.

    A ``(n,)`` loss is summed. A scalar loss is evaluated again per sample, with
    ``torch.func.vmap`` over batches of one, which is exact for any reduction
    (class weights, ``ignore_index``, means over extra dims); only if ``loss_fn``
    cannot be vmapped is the reduction undone by ``loss_reduction``
    (``"mean"``: times ``n``).
    """
    loss = loss_fn(output, targets)
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.shape == (n,):
        return loss.sum()
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn returned shape {tuple(loss.shape)}; it must return per-sample losses of "
            f"shape ({n},) or a scalar reduced over the batch (say how with loss_reduction=). "
            "For a torch.nn loss, use reduction='none' and reduce extra dims per sample, "
            "or reduction='mean'/'sum'."
        )
    try:
        return vmap(_one_sample_loss(loss_fn), in_dims=(0, batch_dims(targets)))(
            output, targets).sum()
    except Exception:  # loss_fn is not vmappable: undo the stated reduction
        return loss * n if reduction == "mean" else loss


def _one_sample_loss(loss_fn: Callable) -> Callable:
    def one(output_i: Any, targets_i: Any) -> Tensor:
        return loss_fn(unsqueeze(output_i), unsqueeze(targets_i)).sum()

    return one


class InPlaceModificationError(RuntimeError):
    """A captured activation was modified in place after its module ran."""


def check_unchanged(job: Job) -> None:
    """Raise if a captured tensor was modified in place after its module ran."""
    if job.taps:
        changed = any(job.tracer.changed(op) for op in job.taps)
    else:
        changed = [t._version for t in job.call.tensors()] != job.call.versions
    if changed:
        raise InPlaceModificationError(
            f"an input or output of module '{job.call.name}' ({type(job.call.module).__name__}) "
            "was modified in place after the module ran (e.g. by nn.ReLU(inplace=True) or "
            "x += ...), so its captured activations are no longer valid. Make that "
            "operation out of place, or use method='vmap'."
        )


def _backprops_of(job: Job, grads: dict[int, Tensor | None], n: int, v: int) -> list[Tensor]:
    """The call's backprops ``(n, v, *out)``, batch first, from ``(v, *out_shape)`` grads."""
    found = []
    layouts = ([Dim(0)] * len(job.taps or ()) + output_layouts(job.call, n)
               + [Dim(0)] * len(job.call.extras))
    for out, layout in zip(job_outputs(job), layouts):
        g = grads[id(out)]
        g = layout.front_cotangents(out.new_zeros((v, *out.shape)) if g is None else g)
        if g.dim() < 2 or g.shape[0] != n:
            raise ValueError(
                f"module '{job.call.name}' ({type(job.call.module).__name__}) returned a tensor "
                f"of shape {tuple(out.shape)} whose dim 0 is not the batch size {n}: the rules "
                "need the batch in dim 0 of every layer's input and output (a reshape to "
                "(batch * seq, features) mixes samples; the stock sequence modules' "
                "batch_first=False layout is understood). Keep the batch dim, or use "
                "method='vmap'."
            )
        found.append(g)
    return found


Backward = Callable[[Any, list[Tensor]], tuple[Any, ...]]


@dataclass
class Captured:
    """The captured calls of one batch, with each job's backprops."""

    jobs: list[Job]
    backprops: list[list[Tensor]]  # per job, per differentiable output: (n, v, *out_shape)
    n: int


def capture_backprops(model: nn.Module, args: tuple, root: Callable[[Any], Tensor],
                      backward: Backward, wanted: set[int], v: int) -> Captured:
    """Capture a forward and pull the cotangents back to every call's output.

    ``root(output)`` gives the tensor to differentiate (the summed loss, or the
    model's output); ``backward(root_value, outputs)`` returns for each captured
    output its ``(v, *out_shape)`` cotangents (or ``None``), which are then put
    batch first, ``(n, v, ...)``, by the output's layout; ``wanted`` holds the
    ``id`` of the parameters to differentiate.
    """
    n = args[0].shape[0]
    with torch.enable_grad(), Capture(hooked_modules(model), wanted, n, _interceptor) as cap:
        value = root(model(*args))
    jobs = plan_jobs(model, cap, wanted)
    for job in jobs:
        check_unchanged(job)
    outs = {id(t): t for job in jobs for t in job_outputs(job)}
    if outs and not value.requires_grad:
        raise RuntimeError(
            "the result does not depend on any parameter through autograd (was the "
            "model's output detached?)"
        )
    got = backward(value, list(outs.values())) if outs else ()
    grads = dict(zip(outs.keys(), got))
    return Captured(jobs, [_backprops_of(job, grads, n, v) for job in jobs], n)


def write_per_sample(cap: Captured, dest: dict[int, Tensor]) -> None:
    """Apply every job's rule (or the fallback) into ``dest`` (id -> (n, v, *shape))."""
    sink = GradSink(dest)
    with torch.no_grad():
        for job, backprops in zip(cap.jobs, cap.backprops):
            _apply(job, backprops, cap.n, sink)
    sink.zero_unwritten()


def run_rules(model: nn.Module, args: tuple, root: Callable[[Any], Tensor], backward: Backward,
              dest: dict[int, Tensor]) -> None:
    """The engine: capture, backprops, rules; results into ``dest`` (id -> (n, v, *shape))."""
    v = next(iter(dest.values())).shape[1]
    write_per_sample(capture_backprops(model, args, root, backward, set(dest), v), dest)


def _apply(job: Job, backprops: list[Tensor], n: int, sink: GradSink) -> None:
    """Per-sample results of one call, by its rule or the fallback, into ``sink``."""
    out = sink.targets(job.params)
    if job.call.extras and not _rule_applies(job, backprops):  # kept for no rule here
        backprops = backprops[: len(backprops) - len(job.call.extras)]
    if not backprops:  # no output depends on the parameters: zero contribution
        for t in out.values():
            t.zero_()
    elif job.taps:
        _apply_taps(job, backprops, n, out)
    elif _rule_applies(job, backprops):
        inputs = front_activations(job.call, activations(job.call), n)
        if job.call.extras:  # backprops of the outputs, then of the extras
            job.rule.fn(job.call.module, inputs, backprops, out, extras=job.call.extras,
                        saved=job.call.saved)
        else:
            job.rule.fn(job.call.module, inputs,
                        backprops if job.rule.multi_output else backprops[0], out)
    else:
        for name, g in fallback_grads(job.call, job.params, backprops, n).items():
            out[name].copy_(g)
    sink.commit(job.params, out)


def _rule_applies(job: Job, backprops: list[Tensor]) -> bool:
    """A rule that takes this call's number of outputs."""
    rule = job.rule
    return rule is not None and (len(backprops) == 1 or rule.multi_output)


def _apply_taps(job: Job, backprops: list[Tensor], n: int, out: dict[str, Tensor]) -> None:
    """The sum over the ops reading the parameter of their per-sample VJPs; the
    per-module fallback over the whole call if an op cannot be replayed per sample."""
    ((name, p),) = job.params.items()
    k = len(job.taps)
    try:
        grads = [job.tracer.tap_grads(op, p, g) for op, g in zip(job.taps, backprops[:k])]
    except Exception:  # an op torch.func cannot batch: differentiate the whole call
        out[name].copy_(fallback_grads(job.call, job.params, backprops[k:], n)[name])
        return
    out[name].copy_(grads[0] if k == 1 else torch.stack(grads).sum(0))  # (n, v, *shape)


def loss_backprops(model: nn.Module, args: tuple, targets: Any, loss_fn: Callable,
                   loss_reduction: str, wanted: set[int], retain_graph: bool = False) -> Captured:
    """Capture one batch and the backprops ``(n, 1, *out)`` of each sample's own loss."""
    n = args[0].shape[0]

    def root(output: Any) -> Tensor:
        return total_loss(output, targets, loss_fn, n, loss_reduction)

    def backward(total: Tensor, outs: list[Tensor]) -> tuple:
        grads = torch.autograd.grad(total, outs, allow_unused=True, retain_graph=retain_graph)
        return tuple(None if g is None else g.unsqueeze(0) for g in grads)  # (1, *out)

    return capture_backprops(model, args, root, backward, wanted, 1)


def rules_grads(
    model: nn.Module,
    args: tuple,
    targets: Any,
    loss_fn: Callable,
    loss_reduction: str,
    dest: dict[int, Tensor],
) -> None:
    """Per-sample gradients of one batch into ``dest`` (id(param) -> (n, *shape))."""
    cap = loss_backprops(model, args, targets, loss_fn, loss_reduction, set(dest))
    write_per_sample(cap, {k: t.unsqueeze(1) for k, t in dest.items()})


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
        cot = one_hot(outputs.start, outputs.stop, output)  # (v, n, *out_shape)
        grads = torch.autograd.grad(output, outs, cot, is_grads_batched=True, allow_unused=True)
        return grads  # (v, *out_shape)

    run_rules(model, args, root, backward, dest)
