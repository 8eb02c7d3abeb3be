"""Planning: the path of every parameter's per-sample gradient, from one capture.

After the captured forward (:mod:`persample.capture`), :func:`plan` gives every
parameter the forward read its path: the module rule of a call that claims it
(the recurrent layers), else the rules of the ops that read it (checked and
recorded as they run, :mod:`persample.engine.pullback`), else the per-module fallback over the
innermost call around all its reads whose inputs and outputs have known layouts.
What cannot be followed at all raises :class:`~persample.errors.NeedsWholeModel`.
The plan lists the gradient edges the one backward must reach.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_leaves

from ..batch import Batched
from ..capture import Call, Capture, Op
from ..errors import NeedsWholeModel
from ..rules import spec_of


@dataclass
class Path:
    """How one parameter's per-sample gradient is computed."""

    kind: str  # "rule", "module rule", "op vjp", "fallback", "unused"
    where: str  # the ops or the module call
    reason: str = ""


@dataclass
class Plan:
    """What to compute after the backward (see :func:`plan`)."""

    module_jobs: list[tuple[Call, dict[str, nn.Parameter]]] = field(default_factory=list)
    uses: list[Op] = field(default_factory=list)  # ops with per-sample outputs, in order
    fallback_jobs: list[tuple[Call, dict[str, nn.Parameter]]] = field(default_factory=list)
    handled: set[int] = field(default_factory=set)  # params handled by module/fallback jobs
    by_fallback: set[int] = field(default_factory=set)  # ... by fallback jobs: every read
    # ops inside a module-rule call that also read other parameters (a learned initial
    # state): id(op) -> the module's own parameters, which its rule gives, not the op
    ruled: dict[int, set[int]] = field(default_factory=dict)
    paths: dict[int, Path] = field(default_factory=dict)
    reach: list[nn.Parameter] = field(default_factory=list)  # params to check for hidden paths

    def edges(self, reach: bool = True) -> list[GradientEdge]:
        """Every gradient edge the backward must reach, without repeats (``reach=False``:
        without the parameters' own, checked for a hidden gradient path)."""
        found: dict[tuple[int, int], GradientEdge] = {}
        sources = [e.edge for op in self.uses for e in op.edges if e is not None]
        sources += [e.edge for call, _ in self.module_jobs + self.fallback_jobs
                    for e in call.edges if e is not None]
        sources += [i.edge.edge for call, _ in self.module_jobs for i in call.inner
                    if i.edge is not None and i.func in call.rule.spec.inner]  # (the rule's)
        sources += [get_gradient_edge(p) for p in self.reach] if reach else []
        for e in sources:
            found.setdefault(edge_key(e), e)
        return list(found.values())


def edge_key(e: GradientEdge) -> tuple[int, int]:
    return id(e.node), e.output_nr


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
        if all(lay.shared for lay in lays):
            continue  # makes a derived tensor: pulled back from its consumers
        bad = next((lay for lay in lays if not lay.known), None)
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
    # "unused" only where autograd confirms it: a parameter no recorded op read may still
    # get gradient (through a graph kept from an earlier call, or code the capture never
    # saw); the backward checks its edge
    result.reach += [p for pid, p in watched.items() if pid not in reads and pid not in
                     result.handled and pid not in cap.unseen_reads and p.requires_grad]
    _paths(cap, result, reads, watched)
    return result


def _module_jobs(cap: Capture, result: Plan) -> set[Op]:
    """Module-rule calls whose inputs and outputs have plain layouts: they take the ops
    reading their own parameters inside them. An op that also reads other parameters (a
    learned initial state expanded to the batch) stays on its own path for those
    (:attr:`Plan.ruled`): the module rule gives its own parameters only."""
    owned: set[Op] = set()
    by_call: dict[int, list[Op]] = {}
    for op in cap.ops:
        if op.claimed is not None:
            by_call.setdefault(id(op.claimed), []).append(op)
    for call in cap.calls:
        ops = by_call.get(id(call), [])
        if (not ops and not call.read) or call.rule is None or not _plain_layouts(
                cap, call, ops):
            continue
        own = {id(p) for _, p in call.rule.spec.params(call.module)}
        if _reads_own_derived(cap, call, own):
            continue
        read = call.read.union(*(op.sources_all for op in ops))  # (unfollowed ops' too)
        params = {name: p for name, p in call.rule.spec.params(call.module)
                  if id(p) in own and id(p) in read}
        result.module_jobs.append((call, params))
        owned.update(op for op in ops if op.sources_all <= own)
        result.ruled.update((id(op), own) for op in ops if not op.sources_all <= own)
        result.handled.update(id(p) for p in params.values())
    return owned


def _reads_own_derived(cap: Capture, call: Call, own: set[int]) -> bool:
    """Is an input of the call a tensor an earlier op made from the module's own
    parameters (Set2Set's LSTM state from its step before)? The rule gives the gradients
    of the parameters as this call reads them, not through that input: its ops keep
    their own paths."""
    for t in tree_leaves((call.args, call.kwargs)):
        d = cap.derived.get(id(t)) if isinstance(t, Tensor) else None
        if d is not None and d.tensor is t and not d.op.sources_all.isdisjoint(own):
            return True
    return False


def _plain_layouts(cap: Capture, call: Call, ops: list[Op]) -> bool:
    """Can a module rule take the call: every input and output tensor plainly batched
    (its batch dim holding one position per sample, in any order) or shared? Of a packed
    sequence only the rows count (its sizes and orders are positions): batched, one
    or more rows per sample, or shared. A shared input reaches the rule as the call's ops
    pair it with the samples (zeros given as a recurrent layer's initial state); where
    they pair a tensor made inside the call instead (the layer reordered it) while a
    shared input is not read by them, how that input pairs is not known."""
    leaves = tree_leaves((call.args, call.kwargs),
                         is_leaf=lambda a: isinstance(a, PackedSequence))
    ins = [t for a in leaves for t in ((a.data,) if isinstance(a, PackedSequence) else (a,))
           if isinstance(t, Tensor)]
    outs = [t for t in tree_leaves(call.output) if isinstance(t, Tensor) and t.requires_grad]
    if all(cap.layout(t).shared for t in ins + outs):  # (no sample inside: its ops make
        return False  # derived tensors, pulled back from their consumers)
    rows = call.rule.spec.rows  # (several rows per sample: tokens merged with the batch)
    if not all(cap.layout(t).one_position_each() or (rows and _merged_rows(cap.layout(t)))
               for t in ins + outs):
        return False
    read = {id(t) for op in ops for t in op.leaves}
    shared = [t for t in ins if cap.layout(t).shared]
    paired_inside = any(
        isinstance(op.pairing(k), Batched) and not any(t is x for x in ins)
        for op in ops for k, t in enumerate(op.leaves))
    return not (paired_inside and any(id(t) not in read for t in shared))


def _merged_rows(lay: Any) -> bool:
    """Each sample's rows one run of the batch dim, in sample order (``(B*T, H)``)."""
    return isinstance(lay, Batched) and lay.outer == 1 and lay.index is None


def _fallbacks(cap: Capture, result: Plan, needs: dict[int, str], reads: dict[int, list[Op]],
               watched: dict[int, nn.Parameter]) -> None:
    """The per-module fallback for parameters no rule can take: the innermost call
    around all their reads whose inputs and outputs have known layouts."""
    by_rule = set(result.handled)  # the module rules' parameters
    for pid, reason in needs.items():
        if pid in by_rule:
            raise NeedsWholeModel(
                f"parameter {param_name(cap.model, pid)} takes its module's rule, and is "
                f"also read outside that module where no rule can follow it: {reason}")
        if pid in result.handled:
            continue
        calls = [op.call for op in reads[pid]]
        call = _common_call(calls)
        # the call of a module holding the parameter (one handed it as an argument to
        # the module reading it is differentiated with the module it was handed to)
        while call is not None and not (_replayable(cap, call) and _holds(call, pid)):
            call = call.parent
        if call is None:
            raise NeedsWholeModel(
                f"parameter {param_name(cap.model, pid)}: {reason}; no module around its "
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
    # inside; a module rule's parameter read outside its module keeps those reads' uses
    result.by_fallback = result.handled - by_rule
    result.uses = [op for op in result.uses if not op.sources_all <= result.by_fallback]
    written = {id(p) for _, params in result.fallback_jobs for p in params.values()}
    if not result.by_fallback <= written:  # nothing handled is left unwritten
        pid = next(iter(result.by_fallback - written))
        raise RuntimeError(f"parameter {param_name(cap.model, pid)} was given to a fallback "
                           "that does not differentiate it")


def _holds(call: Call, pid: int) -> bool:
    return any(id(p) == pid for p in call.module.parameters())


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
    return all(cap.layout(t).located() for t in leaves + outs)


def param_name(model: nn.Module, pid: int) -> str:
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
    for op in result.uses:  # provisional: the rules as they run decide (Captured.taken)
        spec = spec_of(op.func)
        kind = "rule" if spec is not None and spec.grad is not None else "op vjp"
        where = None
        for pid in op.sources_all - result.handled:
            if pid not in result.paths:
                where = op.where() if where is None else where
                result.paths[pid] = Path(kind, where)
