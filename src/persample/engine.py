"""The capture + rule engine (DESIGN.md points 1 to 3 and 7 to 9).

1. One forward under :class:`~persample.capture.Capture` records the layout of
   every tensor (by data flow) and every op that reads a trainable parameter.
2. :func:`plan` gives every parameter its path: the module rule of a call that
   claims it (recurrent layers), else the rules of the ops that read it (or their
   exact per-sample VJPs, ``fallback.op_vjp``), else the per-module fallback over
   the innermost call containing all its reads. What the engine cannot follow at
   all raises :class:`NeedsWholeModel`, which ``method="auto"`` answers with
   ``torch.func`` over the whole model or the loop.
3. One ``torch.autograd.grad`` from the summed per-sample losses to the gradient
   edges of those ops' outputs gives their backprops; the summed weight gradients
   are never computed.
4. :func:`write_per_sample` runs the rules into the result; parameters reached
   through derived tensors (``W.t()``, a position embedding on ``arange`` ids) get
   the per-sample cotangents of those tensors pulled back through the ops that
   made them. A parameter used by several ops is summed per sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_leaves

from .batch import FREE, Batched, Ctx, Layout, Mixed, Unknown, front_cotangents, propagate
from .batch.ops_views import reshaped
from .capture import Call, Capture, Derived, Op
from .fallback import UnsupportedModuleError, expand_vjp, module_vjp, op_vjp, shared_vjp
from .inputs import Batch
from .rules import OpCall, Rule, find_op_rule, module_rule


class NeedsWholeModel(RuntimeError):
    """The engine cannot split some parameter's gradient by sample; ``torch.func``
    over the whole model or the loop can (``method="auto"`` takes them)."""


class MixedSamplesError(ValueError):
    """An op mixes samples (a reduction over the batch, BatchNorm in training mode)."""


class InPlaceModificationError(RuntimeError):
    """A tensor a rule needs was modified in place after its op ran."""


@dataclass
class Path:
    """How one parameter's per-sample gradient is computed."""

    kind: str  # "rule", "module rule", "taps", "fallback", "unused"
    where: str  # the ops or the module call
    reason: str = ""


@dataclass
class Plan:
    """What to compute after the backward (see :func:`plan`)."""

    module_jobs: list[tuple[Call, dict[str, nn.Parameter]]] = field(default_factory=list)
    uses: list[Op] = field(default_factory=list)  # ops with per-sample outputs, in order
    fallback_jobs: list[tuple[Call, dict[str, nn.Parameter]]] = field(default_factory=list)
    handled: set[int] = field(default_factory=set)  # params handled by module/fallback jobs
    paths: dict[int, Path] = field(default_factory=dict)
    reach: list[nn.Parameter] = field(default_factory=list)  # params to check for hidden paths
    whole: list[nn.Parameter] = field(default_factory=list)  # a batch of one: plain gradients

    def edges(self) -> list[GradientEdge]:
        """Every gradient edge the backward must reach, without repeats."""
        found: dict[tuple[int, int], GradientEdge] = {}
        sources = [e for op in self.uses for e in op.edges]
        sources += [e for call, _ in self.module_jobs + self.fallback_jobs for e in call.edges]
        sources += [get_gradient_edge(p) for p in self.reach]
        for e in sources:
            if e is not None:
                found.setdefault(edge_key(e), e)
        return list(found.values())


def edge_key(e: GradientEdge) -> tuple[int, int]:
    return id(e.node), e.output_nr


def _describe_op(op: Op) -> str:
    return op.where()


def plan(cap: Capture, watched: dict[int, nn.Parameter]) -> Plan:
    """Assign every watched parameter that the forward read to its path."""
    result = Plan()
    owned = _module_jobs(cap, result)
    reads: dict[int, list[Op]] = {}
    for op in cap.ops:
        for pid in op.sources_all:
            reads.setdefault(pid, []).append(op)
    needs_fallback: dict[int, str] = {}
    for op in cap.ops:
        if op in owned:
            continue
        lays = op.out_layouts
        if all(lay is FREE for lay in lays):
            continue  # makes a derived tensor: pulled back from its consumers
        bad = next((lay for lay in lays if isinstance(lay, (Mixed, Unknown))), None)
        if bad is not None:
            for pid in op.sources_all:
                needs_fallback.setdefault(pid, f"{bad.why} (at {op.where()})")
            continue
        result.uses.append(op)
    for pid in cap.unseen_reads & set(watched):
        if any(op not in owned and any(isinstance(lay, Batched) for lay in op.out_layouts)
               for op in reads.get(pid, [])):
            needs_fallback.setdefault(pid, "also read where autograd cannot be followed "
                                      "(a custom autograd.Function, no_grad, or in place)")
        elif pid not in result.handled:
            result.reach.append(watched[pid])
    _fallbacks(cap, result, needs_fallback, reads, watched)
    _paths(cap, result, reads, watched)
    return result


def _module_jobs(cap: Capture, result: Plan) -> set[Op]:
    """Module-rule calls whose inputs and outputs have plain layouts: they take the ops
    reading their own parameters inside them."""
    owned: set[Op] = set()
    by_call: dict[int, list[Op]] = {}
    for op in cap.ops:
        if op.claimed is not None:
            by_call.setdefault(id(op.claimed), []).append(op)
    for call in cap.calls:
        ops = by_call.get(id(call))
        if not ops or call.rule is None or module_layouts(cap, call) is None:
            continue
        own = {id(p) for p in call.module.parameters(recurse=False)}
        params = {name: p for name, p in call.module.named_parameters(recurse=False)
                  if id(p) in own and any(id(p) in op.sources_all for op in ops)}
        result.module_jobs.append((call, params))
        owned.update(ops)
        result.handled.update(id(p) for p in params.values())
    return owned


def module_layouts(cap: Capture, call: Call) -> tuple[list, list] | None:
    """The layouts of a module call's input and output tensors, if a module rule can take
    them (plain batched or free; packed sequences as they are); else ``None``."""
    ins = [cap.layout(t) for t in tree_leaves((call.args, call.kwargs)) if isinstance(t, Tensor)
           and not _in_packed(t, call.args)]
    outs = [cap.layout(t) for t in tree_leaves(call.output) if isinstance(t, Tensor)
            and t.requires_grad]
    if all((lay is FREE or (isinstance(lay, Batched) and lay.outer == lay.inner == 1))
           for lay in ins + outs):
        return ins, outs
    return None


def _in_packed(t: Tensor, args: tuple) -> bool:
    from torch.nn.utils.rnn import PackedSequence

    return any(isinstance(a, PackedSequence) and any(t is x for x in a) for a in args)


def _fallbacks(cap: Capture, result: Plan, needs: dict[int, str], reads: dict[int, list[Op]],
               watched: dict[int, nn.Parameter]) -> None:
    """The per-module fallback for parameters no rule can take: the innermost call
    around all their reads whose inputs and outputs have known layouts."""
    for pid, reason in needs.items():
        if pid in result.handled:
            continue
        calls = [op.call for op in reads[pid]]
        call = _common_call(calls)
        while call is not None and not _replayable(cap, call):
            call = call.parent
        if call is None:
            raise NeedsWholeModel(
                f"parameter {_param_name(cap.model, pid)}: {reason}; no module around its "
                "uses has inputs and outputs whose samples can be located")
        params = next((found for job, found in result.fallback_jobs if job is call), None)
        if params is None:
            params = {}
            result.fallback_jobs.append((call, params))
        for name, p in call.module.named_parameters(remove_duplicate=False):
            if id(p) == pid:
                params.setdefault(name, p)
                break
        result.handled.add(pid)
        result.paths[pid] = Path("fallback", call.describe(), reason)
    # the parameters of fallback calls are computed there, whatever other ops read them
    result.uses = [op for op in result.uses if not op.sources_all <= result.handled]


def _common_call(calls: list[Call | None]) -> Call | None:
    """The innermost call containing every one of ``calls``."""
    chains = []
    for call in calls:
        chain = []
        while call is not None:
            chain.append(call)
            call = call.parent
        chains.append(chain[::-1])
    common = None
    for level in zip(*chains):
        if any(c is not level[0] for c in level):
            break
        common = level[0]
    return common


def _replayable(cap: Capture, call: Call) -> bool:
    """Inputs unchanged since the call, and every input and output tensor located."""
    leaves = [t for t in tree_leaves((call.args, call.kwargs)) if isinstance(t, Tensor)]
    if [t._version for t in leaves] != call.versions:
        return False
    outs = [t for t in tree_leaves(call.output) if isinstance(t, Tensor)]
    return all(_located(cap.layout(t)) for t in leaves + outs)


def _located(lay: Layout) -> bool:
    return lay is FREE or (isinstance(lay, Batched) and lay.index is None)


def _param_name(model: nn.Module, pid: int) -> str:
    for name, p in model.named_parameters():
        if id(p) == pid:
            return f"'{name}'"
    return "?"


def _paths(cap: Capture, result: Plan, reads: dict[int, list[Op]],
           watched: dict[int, nn.Parameter]) -> None:
    for call, params in result.module_jobs:
        for p in params.values():
            result.paths[id(p)] = Path("module rule", call.describe(),
                                       f"{call.rule.base.__name__} rule")
    for op in result.uses:  # provisional: the rules run decide (Pullbacks.note)
        kind = "rule" if find_op_rule(op.func) is not None else "taps"
        for pid in op.sources_all - result.handled:
            result.paths.setdefault(pid, Path(kind, _describe_op(op)))


# ---------------------------------------------------------------------------
# the backward and the rules


@dataclass
class Captured:
    """One batch: its capture, plan and backprops."""

    cap: Capture
    plan: Plan
    grads: dict[tuple[int, int], Tensor | None]  # per edge: (v, *shape) or None
    n: int
    v: int

    def backprops(self, edges: list[GradientEdge | None], layouts: list[Layout],
                  like: list[Tensor]) -> list[Tensor | None]:
        """Per output: ``(n, v, *per_sample)`` cotangents (``None`` without an edge)."""
        found = []
        for e, lay, t in zip(edges, layouts, like):
            if e is None or not isinstance(lay, Batched):
                found.append(None)
                continue
            g = self.grads.get(edge_key(e))
            g = t.new_zeros((self.v, *t.shape)) if g is None else g
            found.append(front_cotangents(g, lay, self.n))
        return found


Backward = Callable[[Tensor, list[GradientEdge]], tuple]


def capture_backprops(model: nn.Module, batch: Batch, root: Callable[[Any, Capture], Tensor],
                      backward: Backward, watched: dict[int, nn.Parameter], v: int) -> Captured:
    """Capture a forward, plan, and pull the cotangents back to every planned edge.

    A batch of one needs no capture: its per-sample gradient is the gradient.
    """
    if batch.n == 1:
        return _one_sample(model, batch, root, backward, watched, v)
    with torch.enable_grad():
        with Capture(model, watched, batch.n, batch.batched, batch.shared, module_rule) as cap:
            output = batch.call(model)
        value = root(output, cap)
    result = plan(cap, watched)
    edges = result.edges()
    if edges and not value.requires_grad:
        raise RuntimeError(
            "the result does not depend on any parameter through autograd (was the "
            "model's output detached?)")
    got = backward(value, edges) if edges else ()
    grads = {edge_key(e): g for e, g in zip(edges, got)}
    hidden = [p for p in result.reach if grads.get(edge_key(get_gradient_edge(p))) is not None]
    if hidden:
        raise NeedsWholeModel(
            f"parameter {_param_name(model, id(hidden[0]))} gets gradient through ops the "
            "capture cannot follow (a custom autograd.Function or TorchScript code)")
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
    got = backward(value, edges) if value.requires_grad else [None] * len(edges)
    return Captured(whole, result, {id(p): g for p, g in zip(result.whole, got)}, 1, v)


class GradSink:
    """Destinations of the per-sample gradients, keyed by parameter identity.

    The first contribution to a parameter is written straight into its
    destination; later ones (tied weights, repeated calls) go to a temporary
    and are added.
    """

    def __init__(self, dest: dict[int, Tensor]):
        self.dest = dest
        self.written: set[int] = set()

    def target(self, pid: int, shape: tuple) -> Tensor | None:
        """Where to write the next contribution to ``pid``; ``None`` for a parameter
        not wanted (the caller writes into a scratch tensor)."""
        d = self.dest.get(pid)
        if d is None:
            return None
        return torch.empty_like(d) if pid in self.written else d

    def commit(self, pid: int, value: Tensor) -> None:
        if pid not in self.dest:
            return
        if pid in self.written:
            self.dest[pid].add_(value)
        else:
            if value.data_ptr() != self.dest[pid].data_ptr():
                self.dest[pid].copy_(value)
            self.written.add(pid)

    def zero_unwritten(self) -> None:
        for key, tensor in self.dest.items():
            if key not in self.written:
                tensor.zero_()


def write_per_sample(cap: Captured, dest: dict[int, Tensor], uses: list[Op] | None = None
                     ) -> None:
    """The planned rules into ``dest`` (``id(param) -> (n, v, *shape)``), for the
    parameters in it (``uses``: only these ops; default all)."""
    sink = GradSink(dest)
    pulls = Pullbacks(cap, sink)
    wanted = set(dest)
    for p in cap.plan.whole:  # a batch of one: grads by parameter
        g = cap.grads.get(id(p))
        if id(p) in dest and g is not None:
            sink.commit(id(p), g.unsqueeze(0))  # (1, v, *shape)
    with torch.no_grad():
        for call, params in cap.plan.module_jobs:
            if any(id(p) in wanted for p in params.values()):
                _module_rule(cap, call, params, sink)
        for op in cap.plan.uses if uses is None else uses:
            if op.sources_all.isdisjoint(wanted):
                continue
            if op.changed() and _needs_values(op):
                raise InPlaceModificationError(
                    f"an input of {op.where()} was modified in place after the op ran, and "
                    "its rule needs it. Make that operation out of place, or use "
                    "method='vmap'.")
            pulls.apply(op, cap.backprops(op.edges, op.out_layouts, op.outputs),
                        op.out_layouts)
        pulls.pull_derived()
        for call, params in cap.plan.fallback_jobs:
            if any(id(p) in wanted for p in params.values()):
                _fallback(cap, call, params, sink)
    sink.zero_unwritten()


def _needs_values(op: Op) -> bool:
    """An add (a shift) needs only the backprops; other rules read the inputs."""
    from .rules.elementwise import _ADD

    return op.func not in _ADD


class Pullbacks:
    """Per-sample cotangents of ops' inputs, into the sink (parameters) or onto the
    derived tensors, which are then pulled back through the ops that made them."""

    def __init__(self, cap: Captured, sink: GradSink):
        self.cap, self.sink = cap, sink
        self.only = set(sink.dest)
        self.seen: set[int] = set()  # parameters whose path this run has recorded
        self.pending: dict[int, list[tuple[Tensor, Batched | None]]] = {}

    def apply(self, op: Op, cots: list[Tensor | None], out_aligns: list,
              aligns: list | None = None) -> None:
        """``cots`` per output ``(n, v, *per_sample)``; ``aligns`` overrides how the
        op's leaves pair with the samples (derived ops pulled back per sample)."""
        n, handled = self.cap.n, self.cap.plan.handled
        wrt = [k for k, pids in op.sources.items()
               if not pids <= handled and not pids.isdisjoint(self.only)]
        if not wrt or all(c is None for c in cots):
            return
        call = OpCall(op, n)
        if aligns is not None:
            call.op = _Aligned(op, aligns)
        shapes = {k: tuple(op.leaves[k].shape) if call.op.align(k) is None else
                  tuple(_front_shape(op.leaves[k], call.op.align(k), n)) for k in wrt}
        out = {}
        for k in wrt:
            t = op.leaves[k]
            if id(t) in out:
                continue
            direct = self._param(t) is not None and call.op.align(k) is None
            v = self.cap.v
            found = self.sink.target(id(t), shapes[k]) if direct else None
            out[id(t)] = found if found is not None else t.new_empty((n, v, *shapes[k]))
        rule = find_op_rule(op.func)
        single = [c for c in cots if c is not None]
        reason = "no rule" if rule is None or len(cots) != 1 or len(single) != 1 else rule(
            call, single[0], out)
        kind = "rule"
        if reason is not None and not self._broadcast(op, call, wrt, out_aligns, out):
            kind = self._taps(op, call, cots, out_aligns, wrt, out)
        self.note(op, wrt, kind, reason)
        done = set()
        for k in wrt:
            t = op.leaves[k]
            if id(t) in done:
                continue
            done.add(id(t))
            if self._param(t) is not None and call.op.align(k) is None:
                self.sink.commit(id(t), out[id(t)])
            elif self._param(t) is not None:
                raise NeedsWholeModel(f"a parameter paired with the samples in {op.where()}")
            else:
                self.pending.setdefault(id(t), []).append((out[id(t)], call.op.align(k)))

    def _param(self, t: Tensor) -> nn.Parameter | None:
        p = self.cap.cap.watched.get(id(t))
        return p if p is t else None

    def _broadcast(self, op: Op, call: OpCall, wrt: list[int], out_aligns: list, out: dict
                   ) -> bool:
        """Shared inputs of an op that broadcasts them over the samples: the op's own
        backward on per-sample copies (``fallback.expand_vjp``)."""
        if (len(op.outputs) != 1 or not isinstance(out_aligns[0], Batched)
                or any(call.op.align(k) is not None for k in wrt)
                or not _broadcasting(op.func) or op.edges[0] is None):
            return False
        g = self.cap.grads.get(edge_key(op.edges[0]))
        if g is None:
            return False
        try:
            got = expand_vjp(op, wrt, g, out_aligns[0], self.cap.n)
        except (ValueError, RuntimeError):
            return False
        for k, value in zip(wrt, got):
            out[id(op.leaves[k])].copy_(value)
        return True

    def note(self, op: Op, wrt: list[int], kind: str, reason: str | None) -> None:
        """Record the path the parameters behind ``wrt`` took here (``taps`` outweighs
        ``rule``; the ops are listed)."""
        paths = self.cap.plan.paths
        for k in wrt:
            for pid in op.sources[k]:
                old = paths.get(pid)
                where = _describe_op(op)
                if old is None or pid not in self.seen:
                    paths[pid] = Path(kind, where, "" if kind == "rule" else f"{reason}")
                elif kind == "taps" and old.kind == "rule":
                    paths[pid] = Path("taps", f"{where}; {old.where}", f"{reason}")
                elif where not in old.where:
                    paths[pid] = Path(old.kind, f"{old.where}; {where}", old.reason)
                self.seen.add(pid)

    def _taps(self, op: Op, call: OpCall, cots, out_aligns, wrt, out) -> str:
        aligns = [call.op.align(k) for k in range(len(op.leaves))]
        kind = "rule"
        try:
            if all(a is None for a in aligns) and all(a is None for a in out_aligns):
                got = shared_vjp(op, cots, wrt)  # the same op for every sample
            else:
                got = op_vjp(op, cots, out_aligns, aligns, wrt, self.cap.n)
                kind = "taps"
        except Exception as err:  # torch.func raises many kinds of errors
            raise NeedsWholeModel(
                f"no rule for {op.where()} and torch.func could not differentiate it per "
                f"sample: {err}") from err
        for k, g in zip(wrt, got):
            out[id(op.leaves[k])].copy_(g)
        return kind

    def pull_derived(self) -> None:
        """Derived tensors, newest first: their cotangents back through their ops."""
        derived = self.cap.cap.derived
        while self.pending:
            key = max(self.pending, key=lambda i: derived[i].op.index)
            d: Derived = derived[key]
            for cot, align in _merge(self.pending.pop(key)):
                cots = [None] * len(d.op.outputs)
                cots[d.out] = cot
                aligns = [None] * len(d.op.outputs)
                aligns[d.out] = align
                self.apply(d.op, cots, aligns, _producer_aligns(d.op, align, self.cap.n))


def _broadcasting(func: Any) -> bool:
    """Ops that broadcast their inputs right-aligned against the output (elementwise,
    ``where``, the mask of ``scaled_dot_product_attention``)."""
    from .batch.flow import HANDLERS
    from .batch.ops_elementwise import _where, broadcast
    from .batch.ops_layers import _sdpa

    return HANDLERS.get(func) in (broadcast, _where, _sdpa)


def _merge(items: list[tuple[Tensor, Batched | None]]) -> list[tuple[Tensor, Batched | None]]:
    """Sum the cotangents that share a form (own shape, or the same pairing)."""
    merged: list[tuple[Tensor, Batched | None]] = []
    for cot, align in items:
        for k, (c, a) in enumerate(merged):
            if a == align and c.shape == cot.shape:
                merged[k] = (c + cot, a)
                break
        else:
            merged.append((cot, align))
    return merged


def _front_shape(t: Tensor, lay: Batched, n: int) -> torch.Size:
    from .batch import front

    return front(t.new_empty(()).expand(t.shape), lay, n).shape[1:]  # no data read


class _Aligned:
    """An op seen with other pairings of its leaves (a derived op pulled back per sample)."""

    def __init__(self, op: Op, aligns: list):
        self._op, self._aligns = op, aligns

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)

    def align(self, k: int) -> Any:
        return self._aligns[k]


def _producer_aligns(op: Op, out_align: Batched | None, n: int) -> list:
    """How a derived op's leaves pair with the samples when its output is paired at
    ``out_align`` (a class token expanded to the batch, DeBERTa's repeated keys): each
    leaf is paired with the one layout that the op's own data-flow rule carries to
    ``out_align`` (a transpose's swapped dim, a reshape's merged dim, embedding ids'
    dims), else shared."""
    if out_align is None:
        return [None] * len(op.leaves)
    out = op.outputs[0]
    found = []
    for k, t in enumerate(op.leaves):
        candidates = [out_align.moved(d) for d in range(t.dim())]
        if out_align.index is None and out.dim():
            candidates.append(reshaped(out_align, tuple(out.shape), tuple(t.shape), n))
        found.append(next((c for c in candidates if c is not None and _carries(
            op, k, c, out_align, n)), None))
    return found


def _carries(op: Op, k: int, lay: Batched, want: Batched, n: int) -> bool:
    """Does the op's data-flow rule take leaf ``k`` at ``lay`` (the others shared) to
    ``want``?"""
    t = op.leaves[k]
    if lay.index is None and t.shape[lay.dim] != lay.outer * n * lay.inner:
        return False
    if lay.index is not None and t.shape[lay.dim] != lay.index.numel():
        return False
    ctx = Ctx(n, lambda x: lay if x is t else FREE)
    got = propagate(ctx, op.func, op.args, op.kwargs, op.output).outputs
    got = got[0] if isinstance(got, tuple) else got
    return isinstance(got, Batched) and got == want


# ---------------------------------------------------------------------------
# module rules and the per-module fallback


def module_front(g: Tensor, lay: Layout, n: int, lead: int) -> Tensor:
    """For module rules: the batch dim moved to the front (and removed from its place);
    irregular layouts (a packed sequence's rows) padded per sample."""
    if not isinstance(lay, Batched):
        return g
    if lay.index is None:
        return g.movedim(lay.dim + lead, 0)
    fronted = front_cotangents(g, lay, n) if lead else lay.front(g, n)
    return fronted


def _module_rule(cap: Captured, call: Call, params: dict[str, nn.Parameter],
                 sink: GradSink) -> None:
    rule: Rule = call.rule
    outs = [t for t in tree_leaves(call.output) if isinstance(t, Tensor)]
    pairs = [(t, e) for t, e in zip(outs, call.edges) if t.requires_grad]
    backprops = []
    for t, e in pairs:
        g = cap.grads.get(edge_key(e)) if e is not None else None
        g = t.new_zeros((cap.v, *t.shape)) if g is None else g
        lay = cap.cap.layout(t)
        backprops.append(module_front(g, lay, cap.n, 1) if isinstance(lay, Batched) else g)
    inputs = _module_inputs(cap, call)
    if inputs is None:
        raise UnsupportedModuleError(f"module {call.describe()}: inputs not positional")
    out = {}
    for name, p in params.items():
        found = sink.target(id(p), p.shape)
        out[name] = found if found is not None else p.new_empty((cap.n, cap.v, *p.shape))
    rule.fn(call.module, inputs, backprops if rule.multi_output else backprops[0], out)
    for name, p in params.items():
        sink.commit(id(p), out[name])


def _module_inputs(cap: Captured, call: Call) -> tuple | None:
    """The call's inputs as positional arguments, samples in dim 0."""
    args = positional(call)
    if args is None:
        return None
    return tuple(_front_value(cap, a) for a in args)


def _front_value(cap: Captured, x: Any) -> Any:
    from torch.nn.utils.rnn import PackedSequence

    if isinstance(x, PackedSequence):
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(_front_value(cap, xi) for xi in x)
    if isinstance(x, Tensor):
        return module_front(x, cap.cap.layout(x), cap.n, 0)
    return x


def positional(call: Call) -> tuple | None:
    """The call's inputs as positional arguments of the module's ``forward`` (keyword
    inputs moved to their place); ``None`` if impossible (keyword-only arguments)."""
    import inspect

    if not call.kwargs:
        return call.args
    try:
        bound = inspect.signature(type(call.module).forward).bind(
            call.module, *call.args, **call.kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return None if bound.kwargs else bound.args[1:]


def _fallback(cap: Captured, call: Call, params: dict[str, nn.Parameter], sink: GradSink
              ) -> None:
    leaves = [t for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, Tensor)]
    in_aligns = [_align_of(cap.cap.layout(t)) for t in leaves]
    outs = [t for t in tree_leaves(call.output) if isinstance(t, Tensor)]
    out_lays = [cap.cap.layout(t) for t in outs]
    cots = cap.backprops(call.edges, out_lays, outs)
    got = module_vjp(call, params, in_aligns, cots, [_align_of(lay) for lay in out_lays], cap.n)
    for name, p in params.items():
        sink.commit(id(p), got[name])


def _align_of(lay: Layout) -> Batched | None:
    return lay if isinstance(lay, Batched) else None


# ---------------------------------------------------------------------------
# the public functions' engines


def loss_backprops(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                   loss_reduction: str, watched: dict[int, nn.Parameter],
                   retain_graph: bool = False) -> Captured:
    """Capture one batch and the backprops ``(n, 1, *out)`` of each sample's own loss."""
    from .loss import total_loss

    def root(output: Any, cap: Capture) -> Tensor:
        with _ReadCheck(cap):
            return total_loss(output, targets, loss_fn, batch.n, loss_reduction, cap.layout)

    def backward(total: Tensor, edges: list) -> tuple:
        grads = torch.autograd.grad(total, edges, allow_unused=True, retain_graph=retain_graph)
        return tuple(None if g is None else g.unsqueeze(0) for g in grads)  # (1, *out)

    return capture_backprops(model, batch, root, backward, watched, 1)


class _ReadCheck:
    """While the loss runs: a parameter read there has a gradient path the capture
    did not see (the loss must only use the model's output)."""

    def __init__(self, cap: Capture):
        from torch.overrides import TorchFunctionMode

        watched = cap.watched

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                from .batch import op_leaves

                for t in op_leaves(args, kwargs or {}):
                    if id(t) in watched and watched[id(t)] is t and t.requires_grad:
                        raise ValueError(
                            "a trainable parameter is read in loss_fn, outside the model's "
                            "forward, so its per-sample gradient cannot be attributed. Read "
                            "it inside the forward of a module, or freeze it.")
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def rules_grads(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                loss_reduction: str, dest: dict[int, Tensor],
                watched: dict[int, nn.Parameter]) -> Captured:
    """Per-sample gradients of one batch into ``dest`` (``id(param) -> (n, *shape)``)."""
    cap = loss_backprops(model, batch, targets, loss_fn, loss_reduction, watched)
    write_per_sample(cap, {k: t.unsqueeze(1) for k, t in dest.items()})
    return cap


def rules_param_jacobian(model: nn.Module, batch: Batch, outputs: range,
                         dest: dict[int, Tensor], watched: dict[int, nn.Parameter]) -> Captured:
    """Rows ``outputs`` of the per-sample parameter Jacobian of one batch into ``dest``.

    DESIGN.md point 4: the cotangents are one-hot over the (flattened) output index
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

    def backward(output: Tensor, edges: list) -> tuple:
        cot = one_hot(outputs.start, outputs.stop, output)  # (v, n, *out_shape)
        return torch.autograd.grad(output, edges, cot, is_grads_batched=True, allow_unused=True)

    cap = capture_backprops(model, batch, root, backward, watched, len(outputs))
    write_per_sample(cap, dest)
    return cap
