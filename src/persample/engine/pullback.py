"""From backprops to per-sample results: the rules run, and what they give for
tensors computed from parameters is pulled back to the parameters.

:func:`write_per_sample` runs, for one captured batch (:class:`Captured`),
the module rules, then each op's rule with the backprops of its output (or, where
no rule applies, the op's own backward on per-sample copies of the inputs it
broadcasts, :func:`persample.engine.vjp.expand_vjp`, or its exact per-sample VJP,
:func:`persample.engine.vjp.op_vjp`), then the derived tensors newest first through the ops that
made them, then the per-module fallbacks. Results go to :class:`GradSink`: the first
contribution to a parameter is written in place, later ones (tied weights, several
calls) are added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves

from ..batch import SHARED, Batched, Ctx, Layout, broadcasts, propagate
from ..batch.ops_views import reshaped
from ..capture import Call, Op
from ..errors import InPlaceModificationError, NeedsWholeModel, UnsupportedModuleError
from ..precision import cast, without_autocast
from ..rules import (
    Decline,
    ModuleRule,
    OpCall,
    module_front,
    module_inputs,
    rules_of,
    spec_of,
)
from ..rules.calls import NOT_COVERED, Destinations, cast_input
from ..rules.ghost import Factors, formed
from ..rules.spec import InnerOp
from . import replay
from .captured import Captured
from .paths import Path
from .uses import sites_of, use_factors
from .vjp import (
    PIECES,
    expand_vjp,
    module_vjp,
    op_vjp,
    paired_vjp,
    pieces_vjp,
    shared_vjp,
)


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

    def holds(self, pid: int) -> bool:
        """Whether ``pid``'s destination already holds a contribution."""
        return pid in self.written

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


def write_per_sample(captured: Captured, dest: dict[int, Tensor], uses: list[Op] | None = None
                     ) -> None:
    """The planned rules into ``dest`` (``id(param) -> (n, v, *shape)``), for the
    parameters in it (``uses``: only these ops; default all)."""
    with without_autocast():  # the rules choose their dtypes (persample.precision)
        _write(captured, dest, uses)


def _write(captured: Captured, dest: dict[int, Tensor], uses: list[Op] | None) -> None:
    """The rules into ``dest``; on a cached call, their replay where one is kept, or
    their recording (:mod:`persample.engine.replay`)."""
    found = None if uses is not None or not replay.ENABLED[0] or replay.hopeless(
        captured) else replay.inputs_of(captured, dest)
    if found is None:
        _rules(captured, dest, uses)
        return
    inputs, sig = found
    kept, state = replay.replay_of(captured, sig)
    if kept is not None:
        _replayed(captured, kept, inputs, dest)
    elif state is replay.RECORD or replay.CHECK[0]:
        made = _recorded(captured, inputs, dest)
        if state is not None:
            replay.keep(captured, sig, made)
    else:
        plain = _rules(captured, dest, None)
        if state is replay.FIRST:  # (a second call like it records them)
            replay.keep(captured, sig, replay.RECORD if plain else None)


def _replayed(captured: Captured, kept: replay.Replay, inputs: list[Tensor],
              dest: dict[int, Tensor]) -> None:
    """The kept replay into ``dest`` (checked against the rules under ``CHECK``), and
    the paths the rules took when it was recorded; the rules where a decision the
    recording took differs in this call (:func:`_decided_alike`)."""
    if not _decided_alike(captured, kept.decisions):
        _rules(captured, dest, None)
        return
    _unchanged(captured.plan.uses, set(dest))
    before = dict(captured.taken)
    if replay.CHECK[0]:
        _rules(captured, dest, None)
        replay.check(kept, inputs, dest)
    else:
        kept(inputs)
    captured.taken.clear()
    captured.taken.update({**before, **kept.taken})


def _decided_alike(captured: Captured, decisions: list) -> bool:
    """Does this call take each pairing decision a replay was recorded with (the index
    values it read may differ) as the recording call did?"""
    if not decisions:
        return True
    ops = {d.op.index: d.op for d in captured.derived.values()}
    for index, out_align, want in decisions:
        op = ops.get(index)
        if op is None or _producer_pairings(op, out_align, captured.n) != want:
            return False
    return True


def _recorded(captured: Captured, inputs: list[Tensor], dest: dict[int, Tensor]
              ) -> replay.Replay | None:
    """The rules into ``dest`` under the recorder: their replay, or ``None`` where they
    cannot be replayed (checked on the spot under ``CHECK``)."""
    before, decisions = dict(captured.taken), []
    recorder = replay.Recorder(inputs)
    with recorder:
        plain = _rules(captured, dest, None, decisions)
    if not plain or recorder.failed is not None:
        return None
    made = recorder.replay({k: p for k, p in captured.taken.items() if before.get(k) is not p})
    made.decisions = decisions
    if replay.CHECK[0]:
        replay.check(made, inputs, dest)
    return made


def _unchanged(ops: list[Op], wanted: set[int]) -> None:
    """Raise where an input a rule reads was modified in place after its op ran."""
    for op in ops:
        if not op.sources_all.isdisjoint(wanted) and op.changed() and _needs_values(op):
            raise InPlaceModificationError(
                f"an input of {op.where()} was modified in place after the op ran, and "
                "its rule needs it. Make that operation out of place, or use "
                "method='vmap'.")


def _rules(captured: Captured, dest: dict[int, Tensor], uses: list[Op] | None,
           decisions: list | None = None) -> bool:
    """The rules into ``dest``: whether every op took its own rule (no module rule,
    fallback or VJP), the condition of a replay; ``decisions``: where to keep the
    pairing decisions the derived pullbacks took (:meth:`Pullbacks._pairings`)."""
    sink = GradSink(dest)
    pulls = Pullbacks(captured, sink, decisions)
    wanted = set(dest)
    for p in captured.whole:  # a batch of one: grads by parameter
        g = captured.grads.get(id(p))
        if id(p) in dest and g is not None:
            sink.commit(id(p), g.unsqueeze(0))  # (1, v, *shape)
    with torch.no_grad():
        if uses is None and captured.v == 1 and not captured.whole:
            pulls.several = _joined(captured, sink, pulls)
        for call, params in captured.plan.module_jobs:
            if any(id(p) in wanted for p in params.values()):
                _module_rule(captured, call, params, sink, pulls)
        ops = captured.plan.uses if uses is None else uses
        for op in sorted(ops, key=_adds):  # adding rules last
            if op.sources_all.isdisjoint(wanted):
                continue
            _unchanged([op], wanted)
            pulls.apply(op, captured.backprops(op.edges, op.out_layouts),
                        op.out_layouts)
        pulls.pull_derived()
        pulls.form_deferred()
        for call, params in captured.plan.fallback_jobs:
            if any(id(p) in wanted for p in params.values()):
                _fallback(captured, call, params, sink)
    for pid in set() if captured.whole else wanted - pulls.seen - captured.plan.handled:
        if pid in captured.plan.paths:  # read, but no gradient of the loss reaches it
            captured.taken[pid] = Path("unused", captured.plan.paths[pid].where,
                                       "no gradient of the loss reaches it: zeros")
    sink.zero_unwritten()
    return pulls.plain and not captured.plan.module_jobs and not captured.plan.fallback_jobs


def _joined(captured: Captured, sink: GradSink, pulls: Pullbacks) -> set[int]:
    """Parameters several ops read directly, each use with a factor rule (a layer called
    at every step of a loop, weights shared across depth): the part of their per-sample
    gradients those uses give, formed at once from their factors joined along positions
    (``rules.ghost.formed``) and written into the destination first; those ops' rules
    then skip them, and any other contribution (a derived tensor read, a use without
    factors) is added as before. Returns the parameters several ops or calls read."""
    plan = captured.plan
    count = sites_of(captured)
    several = {pid for pid in sink.dest if count.get(pid, 0) > 1} - plan.by_fallback
    tables = {id(op.leaves[k]) for op in plan.uses if _adds(op) for k in op.sources}
    if not several - tables:  # (a tied table: its lookups add their rows in place)
        return several
    for pid, (ops, uses) in use_factors(captured, several - tables, every=False).items():
        if any(pid in plan.ruled.get(id(op), ()) for op in ops) or any(u.ids for u in uses):
            continue  # (a module rule gives it there; a lookup adds its rows in place)
        rows, cols = uses[0].left.shape[2], uses[0].right.shape[2]
        if min(rows, cols) == 1:
            continue  # (a bias: a sum)
        _form_into(sink, pid, captured.param(pid), uses)
        for op in ops:
            pulls.joined.setdefault(id(op), set()).add(pid)
            pulls.note(op, [k for k, pids in op.sources.items() if pids == {pid}], "rule",
                       None)
    return several


def _form_into(sink: GradSink, pid: int, p: Tensor, uses: list[Factors]) -> None:
    """``p``'s part ``sum_k G_k`` of the uses' factors (``rules.ghost.formed``) into the
    sink: straight into its destination where that is the first part and of the
    factors' dtype, else through a temporary, added."""
    n, rows, cols = uses[0].left.shape[0], uses[0].left.shape[2], uses[0].right.shape[2]
    dest, into = sink.dest[pid], None
    if not sink.holds(pid) and dest.dtype == uses[0].right.dtype:
        try:
            into = dest.view(n, rows, cols)
        except RuntimeError:  # (a destination whose rows cannot be seen so)
            into = None
    got = formed(uses, into)  # (n, rows, cols)
    sink.commit(pid, dest if got is into else got.view(n, 1, *p.shape))


def _adds(op: Op) -> bool:
    """Can the op's gradient rule add into what another op wrote (``OpSpec.adds``)?"""
    spec = spec_of(op.func)
    return spec is not None and spec.adds


def _needs_values(op: Op) -> bool:
    """A shift needs only the backprops (``OpSpec.reads_inputs``); other rules read the
    inputs, except those the op itself overwrites (the running statistics of a norm that
    uses the input's own: a later call updating them again changes nothing the rule
    reads)."""
    spec = spec_of(op.func)
    if spec is not None and not spec.reads_inputs:
        return False
    written = {id(t) for t, _ in op.flow.writes}
    return any(t._version != v and id(t) not in written
               for k, (t, v) in enumerate(zip(op.leaves, op.versions))
               if k != 0 or op.before is None)  # (the value it overwrote is kept)


class Pullbacks:
    """Per-sample cotangents of ops' inputs, into the sink (parameters) or onto the
    derived tensors, which are then pulled back through the ops that made them."""

    def __init__(self, captured: Captured, sink: GradSink, decisions: list | None = None):
        self.captured, self.sink = captured, sink
        self.decisions = [] if decisions is None else decisions  # (op index, pairing of
        # its output, its leaves' pairings): see :meth:`_pairings`
        self.only = set(sink.dest)
        self.seen: set[int] = set()  # parameters whose path this run has recorded
        self.pending: dict[int, list[tuple[Tensor, Batched | None]]] = {}
        self.plain = True  # every op took its own rule (none declined)
        self.joined: dict[int, set[int]] = {}  # id(op) -> the parameters whose uses'
        # factors there gave their part (formed with others')
        self.several: set[int] = set()  # parameters several ops or calls read
        self.deferred: dict[int, list[Factors]] = {}  # their parts rules gave as factors

    def apply(self, op: Op, cots: list[Tensor | None], out_pairings: list,
              pairings: list | None = None) -> None:
        """``cots`` per output ``(n, v, *per_sample)``; ``pairings`` overrides how the
        op's leaves pair with the samples (derived ops pulled back per sample)."""
        n, plan = self.captured.n, self.captured.plan
        handled = plan.by_fallback | plan.ruled.get(id(op), set()) | self.joined.get(
            id(op), set())  # (given elsewhere)
        wrt = [k for k, pids in op.sources.items()
               if not pids <= handled and not pids.isdisjoint(self.only)]
        if not wrt or all(c is None for c in cots):
            return
        call = OpCall(op, n)
        call.out_pairings = out_pairings
        if pairings is not None:
            call.op = _Paired(op, pairings)
            call.out_pairing = out_pairings[0] if len(out_pairings) == 1 else None
        paired = {k: call.op.pairing(k) for k in wrt}
        shapes = {k: tuple(op.leaves[k].shape) if paired[k] is None else
                  tuple(paired[k].per_sample_shape(op.leaves[k], n)) for k in wrt}
        out = {}
        for k in wrt:
            t = op.leaves[k]
            if t in out:
                continue
            direct = self._param(t) is not None and paired[k] is None
            if direct and _adds(op) and self.sink.holds(id(t)):
                out[t] = self.sink.dest[id(t)]  # the rule adds to what is there
                call.adding.add(t)
                continue
            v = self.captured.v
            found = self.sink.target(id(t), shapes[k]) if direct else None
            out[t] = found if found is not None else t.new_empty(
                (n, v, *shapes[k]), layout=torch.strided)  # (a sparse input's rows: dense)
        call.dtype = next(iter(out.values())).dtype  # the results' (the parameter's)
        call.defers = {t for t in out if id(t) in self.several and t not in call.adding
                       and self._param(t) is not None}
        single = [cast(c, call.dtype) for c in cots if c is not None]
        twice = len({id(op.leaves[k]) for k in wrt}) < len(wrt)  # (``W @ W``: a rule writes
        # each place's part into the one destination, the second over the first)
        reason = "reads one tensor at two places" if twice else _run_rule(
            op, call, cots, single, out)
        kind = "rule"
        self.plain = self.plain and reason is None
        if reason == NOT_COVERED:  # a derived input beside the rule's own parameters
            kind, reason = self._apart(op, call, wrt, cots, single, out_pairings, out)
        if reason is not None and call.adding:  # declined before writing: the others write
            for t in call.adding:  # into a temporary, added below
                out[t] = torch.empty_like(out[t])
            call.adding = set()
        if reason is not None and not self._broadcast(op, call, wrt, out_pairings, out):
            kind = self._op_vjp(op, call, cots, out_pairings, wrt, out)
        self.note(op, wrt, kind, reason, handled)
        done = set()
        for t, left, right in call.deferred if reason is None else ():
            self.deferred.setdefault(id(t), []).append(Factors(left, right))
            done.add(id(t))
        for k in wrt:
            t = op.leaves[k]
            if id(t) in done:
                continue
            done.add(id(t))
            if t in call.adding:
                continue  # added in place
            if self._param(t) is not None and paired[k] is None:
                self.sink.commit(id(t), out[t])
            elif self._param(t) is not None:
                raise NeedsWholeModel(f"a parameter paired with the samples in {op.where()}")
            else:  # (the first leaf of a second write: the tensor's earlier value)
                key = id(op.previous) if k == 0 and op.previous is not None else id(t)
                self.pending.setdefault(key, []).append((out[t], paired[k]))

    def _apart(self, op: Op, call: OpCall, wrt: list[int], cots: list, single: list,
               out_pairings: list, out: dict) -> tuple[str, str | None]:
        """The rule for the parameters the op reads, the derived inputs beside them by
        their own VJP (one backward for the samples where the op is the same for each, or
        paired with them): the path taken and the rule's reason if it still declines."""
        params = [k for k in wrt if self._param(op.leaves[k]) is not None]
        derived = [k for k in wrt if k not in params]
        reason = None
        if params:
            reason = _run_rule(op, call, cots, single, {op.leaves[k]: out[op.leaves[k]]
                                                        for k in params})
        if reason is not None:
            return "rule", reason
        return self._op_vjp(op, call, cots, out_pairings, derived, out), None

    def _param(self, t: Tensor) -> nn.Parameter | None:
        return self.captured.watched_param(t)

    def _broadcast(self, op: Op, call: OpCall, wrt: list[int], out_pairings: list, out: dict
                   ) -> bool:
        """Shared inputs of an op that broadcasts them over the samples: the op's own
        backward on per-sample copies (:func:`persample.engine.vjp.expand_vjp`)."""
        if (len(op.outputs) != 1 or not isinstance(out_pairings[0], Batched)
                or not broadcasts(op.func) or op.edges[0] is None):
            return False
        g = self.captured.grad(op.edges[0])
        if g is None:
            return False
        paired = [call.op.pairing(k) for k in wrt]  # (a shared input as long as the batch)
        try:
            got = expand_vjp(op, wrt, g, out_pairings[0], self.captured.n, paired)
        except (ValueError, RuntimeError):
            return False
        for k, value in zip(wrt, got):
            out[op.leaves[k]].copy_(value)
        return True

    def note(self, op: Op, wrt: list[int], kind: str, reason: str | None,
             handled: frozenset | set = frozenset()) -> None:
        """Record the path the parameters behind ``wrt`` took here (``op vjp`` outweighs
        ``rule``; the ops are listed), but for those ``handled`` elsewhere (a per-module
        fallback, a module rule: a derived input's sources may include theirs, whose
        gradients those give, not this op's)."""
        paths, where = self.captured.taken, op.where()
        for k in wrt:
            for pid in op.sources[k]:
                if pid in handled:
                    continue
                old = paths.get(pid)
                if old is None or pid not in self.seen:
                    paths[pid] = Path(kind, where, "" if kind == "rule" else f"{reason}")
                elif kind == "op vjp" and old.kind == "rule":
                    paths[pid] = Path("op vjp", f"{where}; {old.where}", f"{reason}")
                elif where not in old.where:
                    paths[pid] = Path(old.kind, f"{old.where}; {where}", old.reason)
                self.seen.add(pid)

    def _op_vjp(self, op: Op, call: OpCall, cots, out_pairings, wrt, out) -> str:
        pairings = [call.op.pairing(k) for k in range(len(op.leaves))]
        kind = "rule"
        try:
            if op.func in PIECES and wrt == [0]:  # (a multi-output op: no rule kind)
                got = [pieces_vjp(op, cots, pairings[0], self.captured.n)]
            elif all(a is None for a in pairings) and all(a is None for a in out_pairings):
                got = shared_vjp(op, cots, wrt)  # the same op for every sample
            elif (found := paired_vjp(op, cots, out_pairings, pairings, wrt,
                                      self.captured.n)) is not None:
                got = found  # every sample's blocks in one backward
            else:
                got = op_vjp(op, cots, out_pairings, pairings, wrt, self.captured.n)
                kind = "op vjp"
        except Exception as err:  # torch.func raises many kinds of errors
            raise NeedsWholeModel(
                f"no rule for {op.where()} and torch.func could not differentiate it per "
                f"sample: {err}") from err
        for k, g in zip(wrt, got):
            out[op.leaves[k]].copy_(g)
        return kind

    def form_deferred(self) -> None:
        """The parts rules gave as factors (:meth:`OpCall.defer`), each parameter's in one
        product (``rules.ghost.formed``), into the sink."""
        for pid, uses in self.deferred.items():
            if pid in self.sink.dest:
                _form_into(self.sink, pid, self.captured.param(pid), uses)
        self.deferred = {}

    def _pairings(self, op: Op, out_align: Batched | None) -> list:
        """:func:`_producer_pairings`, a decision that may read index values: kept in
        ``decisions`` for a replay of these rules to take again at each call
        (:func:`persample.engine.replay.deciding`)."""
        if out_align is None:
            return [None] * len(op.leaves)
        with replay.deciding():
            found = _producer_pairings(op, out_align, self.captured.n)
        self.decisions.append((op.index, out_align, found))
        return found

    def pull_derived(self) -> None:
        """Derived tensors, newest first: their cotangents back through their ops."""
        derived = self.captured.derived
        while self.pending:
            key = max(self.pending, key=lambda i: derived[i].op.index)
            op = derived[key].op
            keys = [k for k in self.pending if derived[k].op is op]  # (an op's outputs)
            items = [(derived[k].out, *self._own_positions(op, cot, pairing))
                     for k in keys for cot, pairing in _merge(self.pending.pop(k))]
            for out, cot, pairing in _together(op, items, self._pairings):
                cots, pairings = [None] * len(op.outputs), [None] * len(op.outputs)
                for k, c, a in zip(out, cot, pairing):
                    cots[k], pairings[k] = c, a
                self.apply(op, cots, pairings, self._pairings(op, pairing[0]))


    def _own_positions(self, op: Op, cot: Tensor, pairing: Batched | None
                       ) -> tuple[Tensor, Batched | None]:
        """An unpaired cotangent of a derived op's output as one paired with the samples
        where each sample's is zero but at its own position (:func:`_on_own_positions`)
        and the op carries that pairing to an input that is not a parameter (a
        parameter is never paired: its gradient is its own); else as it is. Tried only
        where the op also reads a floating-point tensor that is not a parameter (the
        state of Set2Set's first step, pulled back through the kernel that made it):
        reading the cotangent's values keeps a cached call from replaying its rules."""
        if pairing is not None or not any(
                t.is_floating_point() and self._param(t) is None for t in op.leaves):
            return cot, pairing
        got, found = _on_own_positions(cot, self.captured.n)
        if found is None:
            return cot, None
        leaves = self._pairings(op, found)
        if not any(leaves) or any(a is not None and self._param(t) is not None
                                  for t, a in zip(op.leaves, leaves)):
            return cot, None
        return got, found


def _together(op: Op, items: list[tuple[int, Tensor, Batched | None]],
              pairings_of: Callable[[Op, Batched], list]) -> list:
    """The cotangents of a derived op's outputs (``(output, cotangent, pairing)``), as
    ``(outputs, cotangents, pairings)`` pulled back at once: those of distinct outputs
    whose pairings give its inputs one pairing (a recurrent kernel's output and final
    states, each paired with the samples by its sequences), else one at a time."""
    outs = [k for k, _, _ in items]
    if len(items) > 1 and len(set(outs)) == len(outs) and all(
            p is not None for _, _, p in items):
        first = pairings_of(op, items[0][2])
        if all(pairings_of(op, p) == first for _, _, p in items[1:]):
            return [tuple(zip(*items))]
    return [((k,), (c,), (p,)) for k, c, p in items]


def _run_rule(op: Op, call: OpCall, cots: list, single: list[Tensor], out: dict) -> str | None:
    """The op's gradient rule into ``out``; the reason it declined (``None``: done)."""
    spec = rules_of(op)
    if spec is None and spec_of(op.func) is not None:
        return "complex tensors, which its rule is not written for"
    if spec is None or spec.grad is None or (not spec.multi_output and (
            len(cots) != 1 or len(single) != 1)):
        return "no rule"
    g = [None if c is None else cast(c, call.dtype) for c in cots] if spec.multi_output else (
        single[0])
    try:
        spec.grad(call, g, out)
    except Decline as why:
        return str(why)
    return None


def _on_own_positions(cot: Tensor, n: int) -> tuple[Tensor, Batched | None]:
    """A shared tensor's per-sample cotangents ``(n, v, *shape)``, as cotangents paired
    with the samples where each sample's is zero but at its own position along a dim
    (``(n, v, *per_sample)``, ``Batched(dim)``): the same numbers, so a row-wise op that
    made the tensor is pulled back once for every sample's row instead of once per
    sample over every row (Set2Set's LSTM state, read per graph by the nodes' graph
    index). Else the cotangents as they are, unpaired.

    The values are read apart from a recording of the rules
    (:func:`persample.engine.replay.deciding`): where they pair none, the rules go on
    with the cotangents as they are, which a replay may take for any values (the same
    numbers either way); where they pair, that form holds for these values alone, and
    the rules are not replayed."""
    ar = None
    with replay.deciding():
        for d, size in enumerate(cot.shape[2:]):
            if size != n or n < 2:
                continue
            ar = torch.arange(n, device=cot.device) if ar is None else ar
            moved = cot.movedim(2 + d, 2)  # (n, v, n, *rest)
            if moved[0, :, 1:].any():  # (sample 0 off its own position: a quick no)
                continue
            off = moved.clone()
            off[ar, :, ar] = 0
            if not off.any():  # sample i's cotangent at its position i, (n, v, ..., 1, ...)
                replay.unreplayable("a shared tensor's cotangents paired with the samples "
                                    "by their values")
                return moved[ar, :, ar].unsqueeze(2 + d), Batched(d)
    return cot, None


def _merge(items: list[tuple[Tensor, Batched | None]]) -> list[tuple[Tensor, Batched | None]]:
    """Sum the cotangents that share a form (own shape, or the same pairing)."""
    merged: list[tuple[Tensor, Batched | None]] = []
    for cot, pairing in items:
        for k, (c, a) in enumerate(merged):
            if a == pairing and c.shape == cot.shape:
                merged[k] = (c + cot, a)
                break
        else:
            merged.append((cot, pairing))
    return merged


class _Paired:
    """An op seen with other pairings of its leaves (a derived op pulled back per sample)."""

    def __init__(self, op: Op, pairings: list):
        self._op, self._pairings = op, pairings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)

    def pairing(self, k: int) -> Any:
        return self._pairings[k]


def _producer_pairings(op: Op, out_align: Batched | None, n: int) -> list:
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
    if t.shape[lay.dim] != lay.size(n):
        return False
    ctx = Ctx(n, lambda x: lay if x is t else SHARED)
    got = propagate(ctx, op.func, op.args, op.kwargs, op.output).outputs
    got = got[0] if isinstance(got, tuple) else got
    return isinstance(got, Batched) and got == want


def _module_rule(captured: Captured, call: Call, params: dict[str, nn.Parameter],
                 sink: GradSink, pulls: Pullbacks | None = None) -> None:
    """A module call's rule into the sink; the parts of weights other calls also read
    (a recurrent layer called at every step of a decoder's loop) may be handed over as
    factors, formed with the others' (:meth:`Pullbacks.form_deferred`)."""
    rule: ModuleRule = call.rule
    outs = [t for t in tree_leaves(call.output) if isinstance(t, Tensor)]
    pairs = [(t, e) for t, e in zip(outs, call.edges) if t.requires_grad]
    backprops = []
    for t, e in pairs:
        g = captured.grad(e)
        g = t.new_zeros((captured.v, *t.shape)) if g is None else g
        lay = captured.layout(t)
        backprops.append(module_front(g, lay, captured.n, 1) if isinstance(lay, Batched) else g)
    inputs = module_inputs(captured.capture, call)
    if inputs is None:
        raise UnsupportedModuleError(f"module {call.describe()}: inputs not positional")
    out = {}
    for name, p in params.items():
        found = sink.target(id(p), p.shape)
        out[name] = found if found is not None else p.new_empty((captured.n, captured.v, *p.shape))
    dtype = next(iter(out.values())).dtype  # under autocast: the parameters', not the op's
    backprops = [cast(g, dtype) for g in backprops]
    inputs = tuple(cast_input(x, dtype) for x in inputs)
    spec = rule.spec
    extra = {}
    if spec.outputs:  # the values as the call returned them, if none changed since
        same = [t._version for t in outs] == call.out_versions
        extra["outputs"] = [cast(module_front(t, captured.layout(t), captured.n, 0), dtype)
                            for t, _ in pairs] if same else None
    if spec.inner:
        extra["inner"] = [InnerOp(i.func, i.args, i.kwargs, i.output, captured.grad(i.edge)
                                  if i.func in spec.inner else None) for i in call.inner]
    deferred = set()

    def defer(name: str, left: Tensor, right: Tensor) -> bool:
        pid = id(params[name])
        if pulls is None or pid not in pulls.several:
            return False
        pulls.deferred.setdefault(pid, []).append(Factors(left, right))
        deferred.add(name)
        return True

    spec.grad(call.module, inputs, backprops if spec.multi_output else backprops[0],
              Destinations(out, defer), **extra)
    for name, p in params.items():
        if name not in deferred:
            sink.commit(id(p), out[name])


def _fallback(captured: Captured, call: Call, params: dict[str, nn.Parameter], sink: GradSink
              ) -> None:
    leaves = [t for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, Tensor)]
    in_pairings = [_pairing_of(captured.layout(t)) for t in leaves]
    outs = [t for t in tree_leaves(call.output) if isinstance(t, Tensor)]
    out_lays = [captured.layout(t) for t in outs]
    cots = captured.backprops(call.edges, out_lays)
    # (a tensor the call returns twice, transformers' last hidden state and the last of its
    # hidden states, has one gradient: taken once)
    cots = [None if any(o is outs[j] for j in range(k)) else c
            for k, (o, c) in enumerate(zip(outs, cots))]
    if all(c is None for c in cots):  # no gradient reaches the call: zeros
        return
    out_pairings = [_pairing_of(lay) for lay in out_lays]
    draws = captured.capture.draws[call.first_draw:call.end_draw]
    got = module_vjp(call, params, in_pairings, cots, out_pairings, captured.n, draws)
    for name, p in params.items():
        sink.commit(id(p), got[name])


def _pairing_of(lay: Layout) -> Batched | None:
    return lay if isinstance(lay, Batched) else None
