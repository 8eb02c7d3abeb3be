"""Capture, plan and backward: one batch's backprops at every planned edge.

:func:`capture_backprops` runs the forward under a :class:`~persample.capture.Capture`,
plans the per-sample work (:func:`persample.engine.paths.plan`), and pulls the cotangents back
to the planned gradient edges in one backward; :func:`loss_backprops` does it for the
per-sample losses, :func:`rules_grads` and :func:`rules_param_jacobian` then run the
rules (:mod:`persample.engine.pullback`). A batch of one needs no capture: its
per-sample gradient is the gradient (:func:`_one_sample`, the only place that knows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import TorchFunctionMode

from ..batch import SHARED, Batched, Layout, located, located_of, op_leaves
from ..capture import Capture
from ..capture.compiled import (
    Cannot,
    Compiled,
    CompiledCapture,
    broken,
    compiled_of,
    unmark,
    wrappers_hooked,
)
from ..capture.lean import Deopt, LeanCapture, Program, Tracer, _restore
from ..capture.stock import StockCapture, Template, global_hooks, template_of
from ..errors import LossNotPerSampleError, NeedsWholeModel, internal
from ..inputs import Batch
from ..loss import per_sample_losses
from ..patches import WhileCapturing
from ..precision import autocast_state
from ..rng import snapshot
from ..rules import open_capture
from ..sharded import fsdp_units, gatherer
from . import tapes
from .captured import Captured
from .paths import Path, Plan, edge_key, param_name, plan
from .pullback import write_per_sample

Backward = Callable[[Tensor, list[GradientEdge], Plan], tuple]


def hooked_parameter(model: nn.Module, watched: Iterable[Tensor]) -> str | None:
    """The name of the first of ``watched`` with a gradient hook (``p.register_hook(fn)``:
    peft's OSF projects its gradients so), else ``None``. Autograd runs such a hook on
    each gradient of that tensor, so the loop over samples runs it on each sample's; the
    rules, and ``torch.func`` (which differentiates stand-ins for the parameters), would
    not."""
    ids = {id(p) for p in watched}
    return next((name for name, p in model.named_parameters()
                 if id(p) in ids and p._backward_hooks), None)


def hooks_text(name: str, who: str) -> str:
    return (f"parameter {name!r} has a gradient hook (Tensor.register_hook), which "
            f"autograd runs on each gradient of it: the loop over samples runs it on each "
            f"sample's gradient, and {who} would not. method='auto' takes the loop; or "
            "remove the hook")


def capture_backprops(model: nn.Module, batch: Batch, root: Callable[[Any, Capture], Tensor],
                      backward: Backward, watched: dict[int, nn.Parameter], v: int,
                      records: bool = False) -> Captured:
    """Capture a forward, plan, and pull the cotangents back to every planned edge.

    The model's ``forward`` and the user's part of ``root`` (the loss) run as they are:
    their errors propagate unchanged. persample's own work (the capture's data flow,
    the planning, the backward to the planned edges) raises
    :class:`~persample.errors.InternalError` if it fails, or a refusal
    (:data:`~persample.errors.REFUSALS`) where the rules cannot split the model.
    A batch of one needs no capture: its per-sample gradient is the gradient (unless
    ``records``: its activations and backprops are wanted, as curvature's factors).
    """
    units = fsdp_units(model)
    if batch.n == 1 and not units and not records:  # (sharded: every rank replays, below)
        return _one_sample(model, batch, root, backward, watched, v)
    hooked = hooked_parameter(model, watched.values())
    if hooked is not None:
        raise NeedsWholeModel(hooks_text(hooked, "the rules"))
    inputs = located(batch)
    key = tapes.key_of(batch.n, v, inputs)
    tape = tapes.tape_for(model, key)
    template = tapes.stock_for(model, key)
    with torch.enable_grad():
        cap, output = _forward(model, batch, watched, inputs, tape, template,
                               compiles=not units)
        value = root(output, cap)
    if getattr(cap, "piece_read", None) is not None:
        raise NeedsWholeModel(cap.piece_read)
    traced = None
    if cap.tracer is not None:  # (after a program that failed: one more failure counted)
        fails = template.fails + 1 if isinstance(template, Program) else 0
        traced = cap.tracer.program(cap, output, fails) if fails < 3 else None
    gather = gatherer(units)
    for op in cap.ops if gather is not None else ():  # FSDP frees what the ops read
        op.gather = gather
    out_layout = cap.layout(output) if isinstance(output, Tensor) else None
    del output  # the model's output holds nothing the backward needs beyond `value`
    with internal("planning the per-sample work"):
        result = plan(cap, watched)
        cap.release_calls([call for call, _ in result.module_jobs + result.fallback_jobs])
        edges = result.edges()
    if not value.requires_grad:  # (the parameters only checked for a hidden path: none)
        if result.edges(reach=False):
            raise RuntimeError(
                "the result does not depend on any parameter through autograd (was the "
                "model's output detached?)")
        edges = []
    got = backward(value, edges, result) if edges else ()  # the model's own backward code
    with internal("reading the backward's gradients"):
        grads = {edge_key(e): g for e, g in zip(edges, got)}
        hidden = [p for p in result.reach if grads.get(edge_key(get_gradient_edge(p)))
                  is not None]
    if hidden:
        raise NeedsWholeModel(
            f"parameter {param_name(model, id(hidden[0]))} gets gradient through ops the "
            "capture cannot follow (a custom autograd.Function, TorchScript code, a "
            "tensor it was written into in place, or a tensor kept from an earlier call)")
    if isinstance(cap, (StockCapture, LeanCapture)):
        tapes.keep(model, key, tape)
        if type(cap) is LeanCapture:
            tapes.keep_stock(model, key, _kept_program(model, cap.program, units,
                                                       tapes.lean_ran(model, key),
                                                       tapes.sized(key)))
    elif cap.settle is not None:  # (the compiled graph's first call: tape and program kept)
        plain = _plain(result, cap)
        cap.settle(plain)
        tapes.keep(model, key, tape)
        if not plain:
            tapes.keep_stock(model, key, template.program)
    else:
        tapes.keep(model, key, cap.steps)
        plain = _plain(result, cap)
        found = template_of(model, cap, inputs, batch.shared, out_layout, plain)
        if found is None and cap.tracer is not None:
            found = traced if plain else None
            found = tapes.RETRY if found is None else found
            if isinstance(found, Program):  # (a graph batch of new sizes: each traced call
                # counts as one that ran, none of its size coming back)
                sized = tapes.sized(key)
                found = _kept_program(model, found, units,
                                      tapes.lean_ran(model, key) if sized else 0, sized)
        elif found is None and isinstance(template, int):
            found = template - 1 if template > 1 else None  # (then traced again)
        tapes.keep_stock(model, key, found)
    return Captured(cap, result, grads, batch.n, v)


def captured_forward(model: nn.Module, batch: Batch, watched: dict[int, nn.Parameter],
                     v: int = 1) -> tuple[Capture, Any]:
    """The forward as a call of the engine runs it (autograd on): under the full capture
    with the tape an earlier call like it left, or unintercepted where that call left a
    stock model's template (:mod:`persample.capture.stock`) or compiled
    (:mod:`persample.capture.compiled`); ``(capture, output)``. What the benchmark times
    against the plain forward.

    Examples:
        >>> net = torch.nn.Linear(3, 2)
        >>> from persample.inputs import as_batch
        >>> cap, out = captured_forward(net, as_batch(torch.randn(4, 3)),
        ...                             {id(p): p for p in net.parameters()})
        >>> cap.layout(out), len(cap.ops)
        (Batched(dim=0), 1)
    """
    inputs = located(batch)
    key = tapes.key_of(batch.n, v, inputs)
    with torch.enable_grad():
        cap, output = _forward(model, batch, watched, inputs, tapes.tape_for(model, key),
                               tapes.stock_for(model, key), compiles=not fsdp_units(model))
    if cap.settle is not None:  # (a compiled graph's first call: its plan kept or not)
        with internal("planning the per-sample work"):
            cap.settle(_plain(plan(cap, watched), cap))
    return cap, output


def _forward(model: nn.Module, batch: Batch, watched: dict[int, nn.Parameter], inputs: list,
             tape: list | None, template: Template | Program | Compiled | int | None,
             compiles: bool = False) -> tuple[Capture, Any]:
    """The forward under a capture: unintercepted where a stock model's template holds
    (:mod:`persample.capture.stock`), compiled where an earlier call's program has held
    often (:mod:`persample.capture.compiled`, where ``compiles``), each op checked
    against an earlier call's program where one holds (:mod:`persample.capture.lean`),
    else (or where the guards fail, the forward then run again) under the full capture,
    which traces a program where the call has a tape and no template (or a program that
    failed)."""
    numbered = inputs + [(t, SHARED) for t in batch.shared]  # (a program numbers both)
    if isinstance(template, Compiled):
        if compiles and not template.dead and tape is not None and (
                template.program.holds(watched, numbered, template.sized)):
            got = _compiled(model, batch, watched, numbered, tape, template)
            if got is not None:
                return got
        template = template.program
    if tape is not None and isinstance(template, Template) and template.holds(
            model, watched, inputs):
        with StockCapture(model, watched, batch.n, inputs, template, tape) as cap:
            output = batch.call(model)
        if not cap.missed:
            return cap, output
        del output
    if tape is not None and isinstance(template, Program) and template.holds(
            watched, numbered):
        lean = LeanCapture(watched, batch.n, numbered, template, tape)
        try:
            with lean:
                output = batch.call(model)
            if lean.finish(output):
                return lean, output
            del output
        except Deopt:
            pass
    cap = open_capture(model, watched, batch.n, inputs, batch.shared, tape=tape)
    if tape is not None and (template is None or isinstance(template, Program)):
        cap.tracer = Tracer(cap, numbered)  # (a program that failed: traced again)
    with cap:
        output = batch.call(model)
    return cap, output


def _kept_program(model: nn.Module, program: Program, units: list, ran: int,
                  sized: bool = False) -> Program | Compiled:
    """What to keep for later calls of a program that ``ran`` calls like it have run (0:
    just traced): the program, or once it has run :data:`tapes.COMPILE_AFTER` calls, its
    compiled call (:mod:`persample.capture.compiled`) where the model can take one
    (``sized``: for a graph batch of any sizes)."""
    if units or ran < tapes.COMPILE_AFTER:
        return program
    return compiled_of(model, program, sized) or program


def _compiled(model: nn.Module, batch: Batch, watched: dict[int, nn.Parameter], inputs: list,
              tape: list, template: Compiled) -> tuple[Capture, Any] | None:
    """The forward compiled (:mod:`persample.capture.compiled`): ``(capture, output)``,
    or ``None`` where it did not run as a plan of its graph (then autograd's and
    autocast's modes and the default generators are put back; where it never can,
    ``template.dead``)."""
    if WhileCapturing.users or global_hooks() or wrappers_hooked(model):  # (a capture
        return None  # open in any thread: compiled code runs eagerly; a global module
    # hook, or one on a torch.compile wrapper: TorchDynamo's graph would run without it)
    with torch._C.DisableTorchFunction():
        saved = (torch.is_grad_enabled(), autocast_state(), snapshot())
    cap = CompiledCapture(watched, batch.n, inputs, template.program, tape, lambda: (
        open_capture(model, watched, batch.n, inputs, batch.shared)), template.sized)
    try:
        with cap:
            try:
                output = template.fn(model, batch.args, batch.kwargs)
            finally:
                if cap.got is None:  # (traced in this call: the model left as it was)
                    unmark(model, template.marked)
    except Cannot:
        template.dead = True
    except Exception:  # (TorchDynamo cannot trace it, or the model's own error: the full
        template.dead = True  # capture raises that again)
        broken(model, template.sized)
    else:
        if cap.analysis is not None and cap.as_traced(output):
            cap.analysis.settle = cap.keep_plan
            return cap.analysis, output
        if cap.analysis is not None:  # (its graph's ops have another data flow: the
            cap.keep_plan(False)  # model not compiled again)
            template.dead = True
            broken(model, template.sized)
        elif cap.finish(output):
            return cap, output
        else:
            template.fails += 1  # (run otherwise, or another data flow)
            if template.fails >= 3:
                template.dead = True
                if cap.got is None:  # (TorchDynamo ran the forward without the graph)
                    broken(model, template.sized)
        del output
    _restore(saved)
    return None


def _plain(result: Plan, cap: Capture) -> bool:
    """Does every parameter the forward read take an op's rule (or make a derived tensor
    that ops taking rules read), with nothing left to the module rules, the fallback or
    autograd's confirmation of a read the capture could not follow? (A parameter no op
    read, a mask token of an unmasked call, is confirmed unused by the backward of every
    call, cached or not: it keeps no call from its cached path.)"""
    return not (result.module_jobs or result.fallback_jobs or result.ruled or result.handled
                or any(id(p) in cap.unseen_reads for p in result.reach)) and len(
        result.uses) == sum(1 for op in cap.ops if not all(lay.shared for lay in op.out_layouts))


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
    params = list(watched.values())
    edges = [get_gradient_edge(p) for p in params]
    got = backward(value, edges, Plan()) if value.requires_grad else [None] * len(edges)
    taken = {pid: Path("rule", "", "a batch of one: the ordinary gradient") for pid in watched}
    return Captured(whole, Plan(), {id(p): g for p, g in zip(params, got)}, 1, v, params,
                    taken)


def loss_backprops(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                   watched: dict[int, nn.Parameter],
                   retain_graph: bool | Callable[[Plan], bool] = False,
                   records: bool = False) -> Captured:
    """Capture one batch and the backprops ``(n, 1, *out)`` of each sample's own loss
    (the losses ``(n,)``, detached, in :attr:`Captured.losses`); ``retain_graph``: keep
    the model's autograd graph after the backward (or a function of the plan that says
    whether to); ``records``: capture a batch of one too."""
    kept: list[Tensor] = []

    def root(output: Any, cap: Capture) -> Tensor:
        reads = _ReadCheck(cap)

        def follow() -> _ReadCheck:  # (a batch of one: nothing else to follow)
            return reads

        if isinstance(cap, Capture):  # the targets' samples, and the loss's ops followed
            cap.add_inputs(located_of(targets, batch.n))
            follow = partial(_followed, cap, reads)
        losses = per_sample_losses(output, targets, loss_fn, batch.n, cap.layout, follow,
                                   reads.refuse)
        kept.append(losses.detach())
        return losses.sum()

    def backward(total: Tensor, edges: list, planned: Plan) -> tuple:
        retain = retain_graph(planned) if callable(retain_graph) else retain_graph
        grads = torch.autograd.grad(total, edges, allow_unused=True, retain_graph=retain)
        return tuple(None if g is None else g.unsqueeze(0) for g in grads)  # (1, *out)

    captured = capture_backprops(model, batch, root, backward, watched, 1, records)
    captured.losses = kept[0]
    return captured


@contextmanager
def _followed(cap: Capture, reads: _ReadCheck) -> Iterator[None]:
    """The loss's ops followed, parameters read there noted; a loss that mixes samples
    refused."""
    with cap.follow(), reads:
        yield
    if cap.mixing:
        raise mixing_error(cap.mixing)


class _ReadCheck(TorchFunctionMode):
    """While the loss runs: notes whether it reads a trainable parameter (the affine
    transform of a ``TransformedDistribution`` the model returned, evaluated in
    ``log_prob``). Where the capture follows the loss and sums its per-sample losses as
    they are, such a read is an op like the forward's, recorded with its gradient edge;
    where the losses returned are another call's (a scalar loss, or one evaluated again
    per sample), that read has a gradient path the capture did not see:
    :meth:`refuse` raises then."""

    def __init__(self, cap: Capture):
        super().__init__()
        self.watched = cap.watched
        self.read = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.read:
            for t in op_leaves(args, kwargs):
                if self.watched.get(id(t)) is t and t.requires_grad:
                    self.read = True
                    break
        return func(*args, **kwargs)

    def refuse(self) -> None:
        """Raise if the loss read a trainable parameter (called where its result is not
        the per-sample losses the capture followed)."""
        if self.read:
            raise ValueError(
                "a trainable parameter is read in loss_fn, outside the model's forward, "
                "and loss_fn's result is not per-sample losses the capture follows (a "
                "scalar, or losses whose samples it cannot locate), so its per-sample "
                "gradient cannot be attributed. Return per-sample losses (B,), read it "
                "inside the forward of a module, or freeze it.")


def mixing_error(op: str) -> LossNotPerSampleError:
    """The refusal of a loss whose terms mix samples (``op`` mixes them)."""
    return LossNotPerSampleError(
        f"loss_fn mixes samples: {op}. Its terms depend on several samples (a "
        "contrastive loss over the batch such as SimCLR's NT-Xent), so a sample's own "
        "loss, and its per-sample gradient, are not defined: each method, the loop "
        "included, would answer for a batch of one sample alone. Per-sample gradients "
        "need a loss that is a sum or mean of per-sample terms; for the gradient of this "
        "loss, use torch.autograd.")


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
    cap = cotangent_backprops(
        model, batch, lambda output: one_hot(outputs.start, outputs.stop, output), watched,
        len(outputs))
    with internal("the rules"):
        write_per_sample(cap, dest)
    return cap


def cotangent_backprops(model: nn.Module, batch: Batch,
                        cotangents: Callable[[Tensor], Tensor], watched: dict[int, nn.Parameter],
                        v: int = 1, records: bool = False) -> Captured:
    """Capture one batch and pull ``v`` cotangents per sample back from the model's
    output (one tensor with the samples in dim 0): ``cotangents(output)`` gives them,
    ``(v, n, *out)``, from the output's values (detached; ``v`` as they come, whatever
    the argument says); one batched backward (``is_grads_batched=True``) gives the
    backprops ``(n, v, *out)`` at every planned edge. The rows of a Jacobian (one-hot),
    K-FAC's loss-Hessian columns, a Fisher's sampled gradients. ``records``: capture a
    batch of one too."""
    n = batch.n
    seen: list[int] = []

    def root(output: Any, cap: Capture) -> Tensor:
        lay = cap.layout(output) if isinstance(output, Tensor) else None
        if not isinstance(output, Tensor) or output.dim() == 0 or output.shape[0] != n:
            raise ValueError(
                f"the model must return one tensor with the batch size {n} in dim 0, got "
                f"{tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__}")
        if n > 1 and lay != Batched(0):
            raise NeedsWholeModel(f"the model's output does not hold one sample per row ({lay})")
        return output

    def backward(output: Tensor, edges: list, _: Plan) -> tuple:
        cot = cotangents(output.detach())  # (v, n, *out_shape)
        seen.append(cot.shape[0])
        if cot.shape[0] > 1 and _convolves(output):
            return _column_by_column(output, edges, cot)
        return torch.autograd.grad(output, edges, cot, is_grads_batched=True, allow_unused=True)

    captured = capture_backprops(model, batch, root, backward, watched, v, records)
    captured.v = seen[0] if seen else v
    return captured


def _convolves(output: Tensor) -> bool:
    """Whether ``output``'s graph runs a convolution's backward: under
    ``is_grads_batched`` torch runs it as a loop over the cotangents plus copies of
    every input and result (the seed CNN's 10 GGN columns: 65 ms of 290), slower than
    a backward per cotangent."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "ConvolutionBackward0":
            return True
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return False


def _column_by_column(output: Tensor, edges: list, cot: Tensor) -> tuple:
    """What ``autograd.grad(..., is_grads_batched=True)`` gives, ``(v, *edge)`` per
    edge, from one backward per cotangent."""
    cols = [torch.autograd.grad(output, edges, c, retain_graph=k < len(cot) - 1,
                                allow_unused=True) for k, c in enumerate(cot)]
    return tuple(None if col[0] is None else torch.stack(col) for col in zip(*cols))


def one_hot(start: int, stop: int, like: Tensor) -> Tensor:
    """``(stop - start, B, *rest)`` for ``like`` ``(B, *rest)``: vector ``k`` is one-hot
    at flat index ``start + k`` of every sample (a broadcast view, not copied)."""
    n, rest = like.shape[0], like.shape[1:]
    v = like.new_zeros((stop - start, math.prod(rest)))
    v.diagonal(start).fill_(1)
    return v.view(stop - start, 1, *rest).expand(stop - start, n, *rest)
