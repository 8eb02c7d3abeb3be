"""A cached call's rules run again as the ATen ops they ran, with no rule's Python.

On a call whose data flow came from an earlier call like it (a stock template, a
program, a compiled call), the rules do the same work as last time on new tensors: the
same ops, in the same order, on inputs of the same shapes. The first such call runs the
rules as usual under a recorder (a ``TorchDispatchMode``) that writes down every ATen op
they run, where each tensor it reads comes from (an input of the rules, or an earlier
op's output) and its other arguments; the record becomes one generated Python function
(:class:`Replay`), as ``torch.fx`` generates code from a graph. Later calls with the same
signature run that function on their own inputs: one line per ATen op that computes,
and one ``as_strided`` per view an op reads, in place of the rules' Python and every
view op they made.

The inputs of the rules (:func:`inputs_of`) are the tensors an op's record holds (its
leaves and overwritten value, for the planned ops and the derived tensors' ops: a rule
that reads an op's output is not recorded), the backward's gradients at their edges,
and the destinations. The signature of a call holds, besides the record it replays
(the program or template, kept weakly), the batch size, each op's function, arguments
other than tensors (a norm's ``eps``), layouts, pairings, sources, edges' geometry and
autocast state, the plan's sets that choose which parameters each rule writes, and each
input's shape, strides, storage offset, dtype, device and identity (which inputs are
the same tensor). A call that differs in any of these records anew.

Nothing that could differ between calls of one signature is replayed:

- a rule that reads a tensor's values into Python (``.item()``, ``torch.equal``,
  ``bool(t)``: ``aten._local_scalar_dense`` and kin) or reads a tensor that is not an
  input of the rules nor made by them (an index layout's, a module's buffer outside the
  records);
- a random op, a module rule, a per-module fallback, a rule that declined (its
  parameters then take an op's VJP, which runs autograd or ``torch.func``), an op with
  random numbers or gathered parameters (FSDP), a layout other than shared or a plain
  batch dim (an index layout's values choose the rules' ops), an input that is a
  tensor subclass, sparse or nested;

such a call is not recorded, and its signature runs the rules as usual from then on.
A decision the rules take by asking a data-flow rule again (how a derived op's inputs
pair with the samples: BERT's token type ids expanded to the batch, whose lookup's rule
reads the ids) runs outside the record (:func:`deciding`); the replay keeps it with its
answer, and a call that would replay takes it again first: where an answer differs,
that call runs the rules.
The in-place check (an input modified after the op ran) runs at every call, replayed or
not. Random ops and value reads found while recording are the recorder's to see; the
reads of values that bypass the dispatcher (``Tensor.tolist()``) are in the index
layouts, excluded above, and in the rules that say so (``OpSpec.reads_values``: the
experts' grouped product), never replayed.
"""

from __future__ import annotations

import math
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..batch import SHARED, Batched
from ..capture.compiled import CompiledCapture
from ..capture.lean import LeanCapture
from ..capture.stock import StockCapture
from ..capture.tape import Opaque, arguments_key
from ..errors import InternalError
from ..rules import spec_of
from .captured import Captured
from .paths import edge_key

ENABLED = [os.environ.get("PERSAMPLE_RULES_REPLAY", "1") != "0"]
CHECK = [os.environ.get("PERSAMPLE_CHECK_REPLAY", "0") == "1"]  # (tests) every call that
# can be recorded is, and its replay compared bit for bit with the rules on the spot; a
# call that would replay runs the rules and compares
PER_RECORD = 8  # signatures kept per program or template (a DP step's norms and sums,
# the per-sample gradients, at a few batch sizes)
GRADS, NORMS, SUMS = "grads", "norms", "sums"  # (the rules a signature replays:
# per-sample gradients, a DP step's ghost norms, its clipped sums)

_REPLAYS: dict[int, tuple[weakref.ref, list]] = {}  # id(record) -> (record, [(sig, ...)])
_aten = torch.ops.aten
_VALUE_READS = {_aten._local_scalar_dense.default, _aten.equal.default,
                _aten.is_nonzero.default, _aten.item.default}
_PLAIN_TYPES = (Tensor, torch.nn.Parameter)
_METADATA = {_aten.promote_types.default}  # (their answer is the same for the same dtypes:
# nothing to run again)


class Replay:
    """The ATen ops one run of the rules made, as a generated function of its inputs
    (``(*inputs) -> None``; it writes into the destinations among them)."""

    def __init__(self, fn: Callable, ops: int, taken: dict):
        self.fn, self.ops, self.taken = fn, ops, taken
        self.answer: Any = None  # (what the rules' caller needs: :func:`replayed`)
        self.decisions: list = []  # (the decisions taken while recording: :func:`deciding`)

    def __call__(self, inputs: list[Tensor]) -> None:
        with torch.no_grad():  # (as the rules ran)
            self.fn(*inputs)


def inputs_of(captured: Captured, dest: dict[int, Tensor], extra: tuple = (),
              kind: str = GRADS) -> tuple[list, tuple] | None:
    """``(inputs, signature)`` of the rules on ``captured`` into ``dest``, or ``None``
    where they are not replayed (see the module's docstring). ``extra``: tensors the
    rules read besides the records (a DP step's clip factors), after the destinations;
    ``kind``: which rules (:data:`GRADS`, :data:`NORMS`, :data:`SUMS`), each replayed
    apart. The records' part is made once per captured batch (a DP step replays two
    kinds of rules on it)."""
    base = captured.replay_base
    if base is None:
        base = captured.replay_base = _records_part(captured) or False
    if base is False:
        return None
    tensors, sig, seen = list(base[0]), [kind, *base[1]], dict(base[2])
    sig.append(tuple(dest))
    sig.append(len(extra))
    for t in (*dest.values(), *extra):
        tensors.append(t)
        if not _signed(t, seen, sig):
            return None
    return tensors, tuple(sig)


def _records_part(captured: Captured) -> tuple[list, list, dict] | None:
    """The records' inputs, their part of the signature and which distinct tensor each
    is (``id -> number``), or ``None`` where the rules are not replayed."""
    cap, plan = captured.capture, captured.plan
    if not isinstance(cap, (StockCapture, LeanCapture, CompiledCapture)):
        return None
    if captured.whole or plan.module_jobs or plan.fallback_jobs:
        return None
    tensors: list = []
    sig: list = [captured.n, captured.v, frozenset(plan.handled),
                 frozenset(plan.by_fallback), tuple(plan.paths)]
    ops = list(plan.uses) + [d.op for d in captured.derived.values()]
    for op in ops:
        spec = spec_of(op.func)
        if (op.draw is not None or op.gather is not None or op.claimed is not None
                or (spec is not None and spec.reads_values)):
            return None
        flow = op.flow
        for group in (op.layouts, op.out_layouts, flow.pairing or ()):
            for lay in group:
                if not (lay is None or lay is SHARED or (
                        type(lay) is Batched and lay.index is None)):
                    return None
        if flow.writes:
            return None
        try:
            constants = arguments_key(op.args, op.kwargs)
        except Opaque:  # (an argument of a type it cannot compare across calls)
            return None
        sig.append((op.func, spec, constants, op.autocast,  # (the rules registered now:
                    # a rule replaced since records anew)
                    op.layouts, flow.outputs, flow.pairing, op.before is None,
                    tuple(op.sources.items()),
                    frozenset(plan.ruled.get(id(op), ())),
                    tuple(None if e is None else e.view for e in op.edges)))
        tensors += op.leaves  # (not its outputs: a rule that reads one is not recorded)
        if op.before is not None:
            tensors.append(op.before)
        for e in op.edges:
            g = None if e is None else captured.grads.get(edge_key(e.edge))
            if g is not None:
                tensors.append(g)
            sig.append(g is None)
    seen: dict[int, int] = {}  # id -> which distinct tensor (a repeat is its number)
    for t in tensors:
        if not _signed(t, seen, sig):
            return None
    return tensors, sig, seen


def _signed(t: Tensor, seen: dict[int, int], sig: list) -> bool:
    """Add input ``t`` to the signature: its geometry, dtype, device and
    ``requires_grad``, or the number of the same tensor seen before; ``False`` for a
    tensor that is not replayed (a subclass, a sparse or nested tensor)."""
    k = seen.get(id(t))
    if k is not None:
        sig.append(k)
        return True
    if type(t) not in _PLAIN_TYPES or t.layout is not torch.strided:
        return False
    seen[id(t)] = len(seen)
    sig.append((t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad))
    return True


FIRST, RECORD = "first", "record"  # (the states of a signature before its replay)


def hopeless(captured: Captured, kind: str = GRADS) -> bool:
    """Has a call of this record failed to record these rules (a value read, a declined
    rule)? Its later calls then skip the signature (a few hundred microseconds on a
    transformer)."""
    record = _record_of(captured)
    found = _REPLAYS.get(id(record))
    return found is not None and found[0]() is record and any(
        state is None and known[0] == kind for known, state in found[1])


def replayed(captured: Captured, kind: str, dest: dict[int, Tensor], extra: tuple,
             run: Callable[[], tuple[bool, Any]],
             written: Callable[[Any], Any] | None = None) -> Any:
    """``run()``'s answer, its rules replayed where a replay of them is kept.

    ``run()`` runs the rules of ``kind`` into ``dest`` (reading ``extra`` too) and
    returns ``(plain, answer)``: whether they may be recorded (every op took its own
    rule), and what the caller needs besides ``dest`` (which ops took which rule: a
    function of the signature, kept with the replay and given back on a replayed
    call). The states as for the per-sample rules (:func:`replay_of`); under ``CHECK``
    every call that can be recorded is, and its replay compared with the rules on the
    destinations ``written(answer)`` names (default: all; a destination the rules left
    unwritten holds whatever its memory held)."""

    start = {k: t.clone() for k, t in dest.items()} if CHECK[0] else None  # (rules that
    # add to the destinations: the replay is checked from the same start)

    def checked(replay: Replay, answer: Any) -> None:
        keys = dest if written is None else written(answer)
        check(replay, inputs, {k: dest[k] for k in keys}, start)

    found = None if not ENABLED[0] or hopeless(captured, kind) else inputs_of(
        captured, dest, extra, kind)
    if found is None:
        return run()[1]
    inputs, sig = found
    kept, state = replay_of(captured, sig)
    if kept is not None:
        if not CHECK[0]:
            kept(inputs)
            return kept.answer
        _, answer = run()
        checked(kept, answer)
        if answer != kept.answer:
            raise InternalError(f"the replayed {kind} rules took other paths than the rules")
        return answer
    if state is RECORD or CHECK[0]:
        recorder = Recorder(inputs)
        with recorder:
            plain, answer = run()
        if plain and recorder.failed is None:
            made = recorder.replay({})
            made.answer = answer
            if CHECK[0]:
                checked(made, answer)
            if state is not None:
                keep(captured, sig, made)
        elif state is not None:
            keep(captured, sig, None)
        return answer
    plain, answer = run()
    if state is FIRST:  # (a second call like it records them)
        keep(captured, sig, RECORD if plain else None)
    return answer


def replay_of(captured: Captured, sig: tuple) -> tuple[Replay | None, str | None]:
    """``(replay, state)``: the replay kept for ``sig``, else what this call does:
    ``FIRST`` (a signature not seen: run the rules, and keep whether they all took
    their own rule), ``RECORD`` (they did last time: record them), ``None`` (run them)."""
    kept = _kept(_record_of(captured))
    if kept is None:
        return None, None
    for known, found in kept:  # (a few, compared as tuples: the layouts, dtypes and
        if known == sig:  # devices of a call like it are the same objects)
            return (found, None) if isinstance(found, Replay) else (None, found)
    return None, FIRST if len(kept) < PER_RECORD else None


def keep(captured: Captured, sig: tuple, replay: Replay | str | None) -> None:
    kept = _kept(_record_of(captured))
    if kept is None:
        return
    kept[:] = [(known, found) for known, found in kept if known != sig]
    kept.insert(0, (sig, replay))


def _kept(record: Any) -> list | None:
    """The replays kept for ``record`` (a program or template, held weakly: its entry
    goes with it); ``None`` for no record."""
    if record is None:
        return None
    found = _REPLAYS.get(id(record))
    if found is not None and found[0]() is record:
        return found[1]
    key = id(record)
    _REPLAYS[key] = (weakref.ref(record, lambda _: _REPLAYS.pop(key, None)), [])
    return _REPLAYS[key][1]


def _record_of(captured: Captured) -> Any:
    cap = captured.capture
    return cap.template if isinstance(cap, StockCapture) else getattr(cap, "program", None)


def check(replay: Replay, inputs: list[Tensor], dest: dict[int, Tensor],
          start: dict[int, Tensor] | None = None) -> None:
    """Replay into copies of the destinations and compare with what the rules wrote
    (``CHECK``: the tests' bit-for-bit check of the replay). ``start``: the
    destinations' values before the rules ran, for rules that add to them (a DP step's
    clipped sums)."""
    got = {k: _alike(t) for k, t in dest.items()}
    for k, t in (start or {}).items():
        if k in got:
            got[k].copy_(t)
    swap = {id(t): got[k] for k, t in dest.items()}
    replay([swap.get(id(t), t) for t in inputs])
    for k, t in dest.items():  # (bit for bit: NaN where the rules wrote NaN)
        if not torch.equal(_bits(got[k]), _bits(t)):
            raise InternalError(f"the replayed rules differ from the rules for the "
                                f"parameter of id {k}")


def _bits(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _alike(t: Tensor) -> Tensor:
    """An empty tensor of ``t``'s geometry: its shape, strides and storage offset in a
    storage of its size (the replay makes views by their offsets in the storage)."""
    size = t.untyped_storage().nbytes() // t.element_size()
    return t.new_empty(size).as_strided(t.shape, t.stride(), t.storage_offset())


_LOCAL = threading.local()  # .recording: the recorders open in this thread, innermost
# last (a dispatch mode is the thread's own)


def _recording() -> list[Recorder]:
    found = getattr(_LOCAL, "recording", None)
    if found is None:
        found = _LOCAL.recording = []
    return found


@contextmanager
def deciding() -> Iterator[None]:
    """Inside: the ops that decide how a rule pairs tensors with the samples (a data-flow
    rule asked again, which may read index values), run and not written down. A replay
    keeps such a decision with its answer (``Replay.decisions``), to be taken again on
    every call that would replay it (:func:`persample.engine.pullback` does): the
    replay runs only where each answer is the same."""
    open_now = _recording()
    recorder = open_now[-1] if open_now else None
    if recorder is None:
        yield
        return
    was, recorder.paused = recorder.paused, True
    try:
        yield
    finally:
        recorder.paused = was


def unreplayable(why: str) -> None:
    """The rules being recorded now cannot be replayed (``why``): they took a form only
    this call's values allow (the innermost open recorder of this thread fails)."""
    open_now = _recording()
    if open_now and open_now[-1].failed is None:
        open_now[-1].failed = why


class Recorder(TorchDispatchMode):
    """Writes down the ATen ops run under it, each tensor argument by where it comes
    from (an input, or an earlier op's output); ``failed`` says why the ops cannot be
    replayed (``None``: they can).

    A view (``view``, ``permute``, ``select``, ``expand``, ``detach``: the rules make
    about three for each product) is not written down: it is kept as its root tensor's
    geometry (shape, strides, storage offset) and made by one ``as_strided`` of the
    root where an op first reads it (the root itself where the geometry is the root's;
    one view for every view of the same geometry of the same root: the query, key and
    value projections read one input); the geometry is the recorded call's, which the
    replay's signature (every input's shape, strides and offset) makes the same."""

    def __init__(self, inputs: list[Tensor]):
        super().__init__()
        self.paused = False  # (inside :func:`deciding`: ops run, none written down)
        # id -> (a weak reference, the name): an id is a tensor's while the reference
        # holds it (the rules' temporaries die as they go, as without the recorder)
        self.names: dict[int, tuple[weakref.ref, str]] = {}
        self.views: dict[int, tuple] = {}  # id -> (its reference, root's name, geometry)
        self.geometry: dict[str, tuple] = {}  # name -> (shape, stride, offset)
        self.made: dict[tuple, str] = {}  # (root's name, geometry) -> the view's name
        for k, t in reversed(list(enumerate(inputs))):  # (the first of the same tensor)
            self._call(t, f"s{k}")
        self.n_inputs = len(inputs)
        self.steps: list[tuple[Any, Any, dict, str]] = []
        self.failed: str | None = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (the recorder runs in eager code only; wrapping it for TorchDynamo
        # would import TorchDynamo at its first op: over a second, once per process)

    def __enter__(self) -> Recorder:
        _recording().append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _recording().remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.failed is None and not self.paused:
            try:
                self._note(func, args, kwargs, out)
            except Exception as why:  # (an op it cannot write down: the rules go on as
                self.failed = f"{func}: {why}"  # they are, and are not replayed)
        return out

    def _note(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if func in _METADATA:
            return
        if func in _VALUE_READS or torch.Tag.nondeterministic_seeded in func.tags:
            raise _Unknown(f"{func} reads values or draws")
        if self._view(func, args, out):
            return
        text = (self._source(args), {k: self._source(v) for k, v in kwargs.items()})
        name = f"r{len(self.steps)}"
        if isinstance(out, Tensor):
            self._call(out, name)
        elif isinstance(out, (tuple, list)) and all(
                isinstance(o, Tensor) or o is None for o in out):
            for j, o in enumerate(out):
                if o is not None:
                    self._call(o, f"{name}[{j}]")
        elif out is not None:
            raise _Unknown(f"{func} returns {type(out).__name__}")
        self.steps.append((func, *text, name))

    def _call(self, t: Tensor, name: str) -> None:
        """Name ``t`` (an input, an op's output): read by that name from now on."""
        self.names[id(t)] = (weakref.ref(t), name)
        self.views.pop(id(t), None)
        self.geometry[name] = (tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _view(self, func: Any, args: tuple, out: Any) -> bool:
        """Keep ``out``, a view of ``args[0]`` of the same dtype, as its root's geometry."""
        if not (func.is_view and isinstance(out, Tensor) and args
                and isinstance(args[0], Tensor) and out.dtype == args[0].dtype
                and not out.is_conj() and not out.is_neg() and out is not args[0]):
            return False
        base = args[0]
        found = self.views.get(id(base))
        root = found[1] if found is not None and found[0]() is base else self._name(base)
        self.names.pop(id(out), None)
        self.views[id(out)] = (weakref.ref(out), root, tuple(out.shape), tuple(out.stride()),
                               out.storage_offset())
        return True

    def _name(self, t: Tensor) -> str:
        """``t``'s name, a view made by ``as_strided`` of its root where first read."""
        found = self.names.get(id(t))
        if found is not None and found[0]() is t:
            return found[1]
        found = self.views.get(id(t))
        if found is None or found[0]() is not t:
            raise _Unknown(f"reads a {tuple(t.shape)} tensor that is not an input")
        root, geometry = found[1], found[2:]
        if self.geometry.get(root) == geometry:  # (the root itself: a detach, a view as is)
            name = root
        elif (root, geometry) in self.made:  # (the same view made for another rule)
            name = self.made[root, geometry]
        else:
            name = self.made[root, geometry] = f"r{len(self.steps)}"
            self.steps.append((_aten.as_strided.default, (_Ref(root), *geometry), {}, name))
        self.names[id(t)] = (weakref.ref(t), name)
        self.views.pop(id(t), None)
        return name

    def _source(self, value: Any) -> Any:
        """``value`` with each tensor replaced by its name (:class:`_Ref`)."""
        if isinstance(value, Tensor):
            return _Ref(self._name(value))
        if isinstance(value, (list, tuple)):
            return type(value)(self._source(v) for v in value)
        if isinstance(value, dict):
            raise _Unknown("a dict argument")
        return value

    def replay(self, taken: dict) -> Replay:
        """The generated function of the ops written down."""
        consts: dict[str, Any] = {}
        lines = [f"def replay({', '.join(f's{k}' for k in range(self.n_inputs))}):"]
        for k, (func, args, kwargs, name) in enumerate(self.steps):
            consts[f"f{k}"] = func._op if type(func) is torch._ops.OpOverload else func  # (what
            # OpOverload.__call__ calls: one Python frame less per op)
            call = ", ".join([_text(a, consts) for a in args]
                             + [f"{key}={_text(v, consts)}" for key, v in kwargs.items()])
            lines.append(f"    {name} = f{k}({call})")
        lines.append("    return None")
        code = "\n".join(_with_frees(lines))
        scope: dict[str, Any] = dict(consts)
        exec(compile(code, "<persample rules replay>", "exec"), scope)
        return Replay(scope["replay"], len(self.steps), taken)


class _Unknown(Exception):
    """A tensor argument that is neither an input of the rules nor made by them."""


class _Ref(str):
    """A tensor argument: the name it has in the generated function."""


def _text(value: Any, consts: dict) -> str:
    """Source text of an argument: a name, a literal, or a constant of the scope."""
    if isinstance(value, _Ref):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_text(v, consts) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + "".join(_text(v, consts) + ", " for v in value) + ")"
    if value is None or isinstance(value, (bool, str)) or (
            type(value) is int) or (type(value) is float and math.isfinite(value)):
        return repr(value)
    name = f"c{len(consts)}"
    consts[name] = value
    return name


def _with_frees(lines: list[str]) -> list[str]:
    """``del`` of each op's result after its last use (the rules free their
    temporaries as they go; the replay must not hold them all to the end)."""
    pattern = re.compile(r"\br(\d+)\b")
    last: dict[str, int] = {}
    for k, line in enumerate(lines):
        for m in pattern.finditer(line):
            last[f"r{m.group(1)}"] = k
    out = []
    for k, line in enumerate(lines):
        out.append(line)
        dead = sorted(name for name, at in last.items() if at == k)
        if dead and k > 0:
            out.append(f"    del {', '.join(dead)}")
    return out
