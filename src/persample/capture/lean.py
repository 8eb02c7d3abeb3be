"""The cached call of any model: every op checked against the program a full capture
traced, none of them followed again.

A full capture (:class:`~persample.capture.recorder.Capture`) decides, op by op, where
the samples are; given the tape of an earlier call like it
(:mod:`persample.capture.tape`) it takes most ops' layouts from their steps, but still
pays, per op, for comparing the op with its step and keeping the layouts of its outputs
(about 100 us an op here, most of a small model's step). Where a full capture with a
tape ran with a :class:`Tracer`, the :class:`Program` it leaves lets a later call like
it run under :class:`LeanCapture` instead: a ``TorchFunctionMode`` that checks each op
of the forward against the program's entry at its place and keeps what the rules need
of the ops that read parameters, with no layout decided, unless the op's data flow may
read values.

What an entry checks, before the op runs: the same function; the same tensors read, each
by where it comes from (the output of the op at the same place, the same input, or the
same parameter or buffer object, of the same shape, dtype and ``requires_grad``); the
same arguments other than tensors (:func:`~persample.capture.tape.arguments_key`); and
after it, the outputs' shapes and dtypes. These are what a step of the tape compares (a
tensor's layout follows from where it comes from when every op before it matched), so a
call that passes them has the full capture's data flow; an op whose data flow may read
values (an index, a mask: no step on the tape) has it decided again
(:func:`~persample.batch.flow.propagate`) from its inputs' layouts, and compared. Where
an op differs, the forward stops (:class:`Deopt`, raised inside it) and runs again under
the full capture: programs hold no op that draws from a generator of its own, and no
write into a tensor from before the call (a buffer, an input, a view of either), and a
stop puts autograd's and autocast's modes and the default generators back as they were,
so the ops run before the stop changed nothing (Python code of the model's own between
them, a counter it keeps, runs twice).

A layout that holds the call's own indices (a mixture's rows sorted by expert,
:class:`~persample.batch.ops_indexing.Sorted`; rows gathered by an index of the call; a
graph batch's inputs, their rows by graph) is decided again at every call, by every op
that reads or makes one, from the layouts this call decided for its inputs; the program
keeps its form (which dim, which layout type), and an op whose layout differs but for the
indices' values stops the forward.

A write into a tensor the call made (a mask filled in place, ``w /= w.sum(-1)``,
``ReLU(inplace=True)``) is an entry like any other, its target's layout decided again at
every call (:func:`decided`); a program holds it only where the write reads no parameter
(or is a shift, ``scores += position_bias``, whose rule reads no value and whose record
keeps no copy of its target), draws nothing, writes samples into a shared tensor only
where no other tensor views it, and writes no tensor an op reading parameters (or
deciding its data flow by values) read before it, but for a shift's operands. A random op
(dropout in training) is recorded as the full capture records it
(:class:`~persample.draws.Draw`), and must draw where the traced one drew.

Where each tensor comes from is kept by the call (:class:`Numbers`: the number of each
op output, by identity, holding no tensor alive): a tensor of an earlier call, or of
another thread, has none of this call's numbers. (Not an attribute on the tensor: a
tensor with state of its own outlives its Python object's last reference while autograd
keeps it, and a forward's worth of them made every call pay a full garbage collection.)

The parameters' reads, and the loss, are recorded as under the full capture
(:class:`~persample.capture.records.Op`, :meth:`Capture.follow`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..batch import Batched, Flow, Layout, op_leaves, propagate
from ..batch.flow import METADATA, Ctx, in_place, name_of
from ..batch.layouts import SHARED, Mixed, Piece, Unknown
from ..batch.ops_indexing import Partly, written_layout
from ..batch.table import storage_of
from ..draws import RANDOM, Draw
from ..patches import WhileCapturing
from ..precision import autocast_state
from ..rng import generator_of
from .edges import edge_of
from .mode import hidden, must_hide
from .recall import Recall, recall_key
from .recorder import Capture
from .records import UNREAD_INPUTS, Call, Derived, Op, shapes_only
from .tape import _PLAIN, _TENSOR, Opaque, Step, _key, arguments_key, outs_of, value_leaf
from .tensors import KEPT, tensor_leaves


class Numbers:
    """Each tensor's number in one call (inputs first, then each op's outputs in order),
    by identity: ``id -> (weak reference, number)``, an entry valid while its tensor
    lives.

    Examples:
        >>> import torch
        >>> numbers, x = Numbers(), torch.zeros(2)
        >>> numbers.give(x), numbers.give(torch.ones(1)), numbers.of(x), numbers.of(x + 1)
        (0, 1, 0, None)
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, int]] = {}
        self.count = 0

    def give(self, t: Tensor) -> int:
        """The next number, to ``t``."""
        k = self.count
        self._by_id[id(t)] = (weakref.ref(t), k)
        self.count = k + 1
        return k

    def of(self, t: Tensor) -> int | None:
        """``t``'s number, or ``None``."""
        entry = self._by_id.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None


META, STEP, PARAM, DECIDE = "meta", "step", "param", "decide"


class Deopt(BaseException):
    """The forward left the program (raised inside it: a ``BaseException``, so that no
    ``except Exception`` of the model's own takes it)."""


@dataclass(frozen=True, eq=False)
class Entry:
    """One op of the program (see the module docstring)."""

    func: Any
    kind: str  # META, STEP, PARAM or DECIDE
    wants: tuple = ()  # per leaf: its op output's number (int), or the tensor itself
    metas: tuple = ()  # per leaf: (shape, dtype, requires_grad) of a tensor itself, or None
    key: tuple | None = None  # arguments_key (STEP, PARAM)
    outs: tuple | None = None  # outs_of its output
    made: int = 0  # how many outputs it numbers
    layouts: tuple = ()  # its leaves' layouts, as propagate read them
    flow: Flow | None = None  # its data flow (DECIDE, and PARAM reading values: matched)
    decide: bool = False  # its data flow is decided again (it may read values)
    keep: bool = False  # its output is shared and outlives the call as a constant (KEPT)
    op: int = -1  # PARAM: the number of its Op
    derives: tuple = ()  # PARAM: which of its outputs are derived tensors (shared, grad)
    grad: bool = True  # autograd was on when it ran
    draw: tuple | None = None  # a random op: (its kind, the layout of its numbers, where)
    write: bool = False  # it writes its first argument in place (a tensor of this call)
    dynamic: bool = False  # a leaf's or an output's layout holds this call's indices
    recall: tuple | None = None  # a decision: what the call keeps it under (recall_key)


@dataclass(frozen=True, eq=False)
class _Read:
    """What the full capture recorded of an op reading parameters, without its tensors."""

    layouts: tuple
    flow: Flow
    sources: dict
    call: tuple | None  # the module call it ran in: (name, weakref to the module)
    output: Any  # its output's stand-in (shapes_only): shapes, strides and dtypes
    out_versions: list[int] | None = None  # its outputs' versions as made, where kept


@dataclass(frozen=True, eq=False)
class Program:
    """A traced forward: its entries, the layout of every tensor it numbers, and the
    parameters it read (see the module docstring)."""

    entries: tuple[Entry, ...]
    layouts: tuple[Layout, ...]  # by number: inputs first, then each op's outputs
    inputs: int
    watched: frozenset[int]
    reads: tuple[_Read, ...]
    output: tuple[int, ...]  # the numbers of the model output's tensors, in order
    generators: tuple = ()  # the generators its random ops draw from
    fails: int = 0  # calls that left the programs before it (since a first was traced)

    @property
    def reads_outside(self) -> list[tuple]:
        """Per entry, its leaves (numbers, or the tensors from before the call)."""
        return [e.wants for e in self.entries]

    def holds(self, watched: dict, inputs: list, sized: bool = False) -> bool:
        """May a call with ``watched`` and ``inputs`` (``(tensor, layout)``) take it?
        (``sized``: a graph batch's indices may have other lengths than the program's, as
        a compiled call whose graph has the batch's sizes as arguments takes them.)"""
        if frozenset(watched) != self.watched or len(inputs) != self.inputs:
            return False
        if torch._C._is_torch_function_mode_enabled():
            return False
        return all(type(t) is Tensor and (lay == was if _plain(was) else _alike(lay, was, sized))
                   for (t, lay), was in zip(inputs, self.layouts))


def _outputs(out: Any) -> list[Tensor]:
    """An op's output tensors (a tensor, or a tuple or list of them)."""
    if isinstance(out, Tensor):
        return [out]
    return [o for o in out if isinstance(o, Tensor)] if isinstance(out, (tuple, list)) else []


def _made(out: Any, leaves: list) -> list[Tensor]:
    """An op's output tensors that are new (``x.to(x.dtype)`` returns ``x``: not new)."""
    return [o for o in _outputs(out) if not any(o is t for t in leaves)]


def _plain(lay: Any) -> bool:
    """A layout that holds no tensor: shared, mixed, unknown, or batched by position."""
    if lay is SHARED or lay is None or type(lay) in (Mixed, Unknown):
        return True
    if isinstance(lay, tuple):
        return all(_plain(x) for x in lay)
    return type(lay) is Batched and lay.index is None


class Tracer:
    """Traces the forward of a full capture into a :class:`Program` (the capture's forward
    mode hands it each op, :meth:`traced`). ``dead`` says why the call cannot be one."""

    def __init__(self, cap: Capture, inputs: list):
        self.cap = weakref.proxy(cap)
        self.numbers = Numbers()
        self.entries: list[Entry] = []
        self.layouts: list[Layout] = []
        self.dead: str | None = None
        self.generators: list = []
        self.decided: list[list] = []  # per op deciding again: its leaves and their versions
        self.written: dict[int, Any] = {}  # storage -> the shared tensor written with samples
        for t, lay in inputs:
            if type(t) is not Tensor:
                self.dead = "an input of a tensor subclass"
            self.numbers.give(t)
            self.layouts.append(lay)
        self.inputs = len(self.layouts)

    def _want(self, t: Tensor) -> Any:
        k = self.numbers.of(t)
        return t if k is None else k

    def traced(self, func, args: tuple, kwargs: dict) -> Any:
        """Run the op under the capture (:meth:`Capture.record`), and trace it."""
        cap = self.cap
        if self.dead is not None:
            return cap.record(func, args, kwargs)
        if func in METADATA:
            self.entries.append(Entry(func, META))
            return cap.record(func, args, kwargs)
        leaves = op_leaves(args, kwargs)
        wants = [self._want(t) for t in leaves]
        k, n_ops, n_draws = len(cap.steps), len(cap.ops), len(cap.draws)
        before = None
        if writes(func, kwargs):
            before = self._writable(func, args, kwargs, leaves)
        out = cap.record(func, args, kwargs)
        try:
            self._trace(func, args, kwargs, out, leaves, wants, k, n_ops, n_draws, before)
        except Opaque:
            self.dead = "an argument that cannot be compared"
        return out

    def _writable(self, func, args: tuple, kwargs: dict, leaves: list) -> Layout | None:
        """The layout of the tensor an in-place op is about to write, where a program may
        hold the write (:func:`writable`), else ``None`` (the program dead)."""
        if not writable(self.numbers, self.inputs, func, args, kwargs, lambda: _storages(
                [e.wants for e in self.entries], self.numbers, self.inputs)):
            self.dead = f"an op writing into a tensor made before the call ({name_of(func)})"
            return None
        return self.cap.layouts.layout(args[0])

    def _write_kept(self, func, args: tuple, out: Any, before: Layout | None, n_ops: int,
                    draw: Any) -> bool:
        """May the program hold this in-place op (run, its target's layout ``before``)?
        Where it reads no parameter (or is a shift: its record keeps no copy), draws
        nothing, writes no other input, and writes samples into a shared tensor only
        where no other tensor views it; else the program is dead."""
        if before is None:
            return False
        cap, name = self.cap, name_of(func)
        flow = cap._flow
        # (a shift reading parameters, ``scores += bias``, whose record keeps no copy of
        # its target, is held: its rule reads no value)
        shift = func in UNREAD_INPUTS and len(cap.ops) == n_ops + 1 and (
            cap.ops[n_ops].before is None)
        reads = len(cap.ops) != n_ops and not shift
        if reads or draw is not None or (flow is not None and flow.writes) or (
                func is not _SETITEM and out is not args[0]):
            self.dead = f"an op writing in place that reads parameters or draws ({name})"
            return False
        target = args[0]
        if before is SHARED and cap.layouts.layout(target) is not SHARED:
            where = storage_of(target)  # (a shared tensor written with samples: any other
            # tensor of its storage then reads as unknown; the program holds none)
            if any(t is not None and t is not target and storage_of(t) == where
                   for t in (ref() for ref, _ in self.numbers._by_id.values())):
                self.dead = f"an op writing samples into a shared tensor with views ({name})"
                return False
            self.written[where] = weakref.ref(target)
        return True

    def _trace(self, func, args, kwargs, out, leaves, wants, k, n_ops, n_draws, before
               ) -> None:
        cap = self.cap
        if len(cap.steps) != k + 1 or len(cap.ops) > n_ops + 1 or len(cap.draws) > n_draws + 1:
            self.dead = "an op that ran others under the capture"
            return
        draw = None
        if len(cap.draws) == n_draws + 1:
            d = cap.draws[-1]
            if d.generator is None or d.generator is not generator_of(args, {}):
                self.dead = f"a random op drawing from a generator of its own ({name_of(func)})"
                return
            draw = (d.kind, d.layout, d.where)
            if d.generator not in self.generators:
                self.generators.append(d.generator)
        layout = cap.layouts.layout
        if writes(func, kwargs) and not self._write_kept(func, args, out, before, n_ops, draw):
            return
        if self.written and any(
                (ref := self.written.get(storage_of(t))) is not None and ref() is not t
                for t in leaves):
            self.dead = f"a view of a shared tensor written with samples ({name_of(func)})"
            return
        lays = tuple(layout(t) for t in leaves)
        metas = tuple(None if type(w) is int else (t.shape, t.dtype, t.requires_grad)
                      for t, w in zip(leaves, wants))
        made = _made(out, leaves)
        made_lays = [layout(o) for o in made]
        dynamic = not all(map(_plain, lays)) or not all(map(_plain, made_lays))
        if before is not None:  # (a write: its target read as it was before it; a layout
            # it changes is decided at every call)
            dynamic = dynamic or not _plain(before) or not _same(lays[0], before)
            lays = (before,) + lays[1:]
        step = cap.steps[k]
        flow = cap._flow
        derives = ()
        if len(cap.ops) == n_ops + 1:  # (an index or ids among its inputs: values read)
            op = cap.ops[n_ops]
            if op.args is not args or op.kwargs is not kwargs:  # (a derived operand read
                # as the tensor it expands: the op recorded is not the op that ran)
                self.dead = f"an op reading a narrowed operand ({name_of(func)})"
                return
            kind, key, flow = PARAM, arguments_key(args, kwargs), op.flow
            decide = dynamic or any(map(value_leaf, leaves))
            derived = cap.derived
            derives = tuple(k for k, o in enumerate(_outputs(out)) if (
                d := derived.get(id(o))) is not None and d.tensor is o and d.op is op)
        elif isinstance(step, Step):  # (a layout holding this call's indices: decided)
            kind, key, decide = (DECIDE if dynamic else STEP), step.key, dynamic
            flow = step.flow
        elif before is not None:  # (a write: its layout decided again at every call)
            kind, key, decide = DECIDE, None, True
            flow = Flow(layout(args[0])) if func is _SETITEM else flow
        else:
            kind, key, decide = DECIDE, None, flow is not None
        if dynamic and flow is None:
            self.dead = f"an op on a layout holding indices, with no data flow ({name_of(func)})"
            return
        if decide and not all(lay.shared for lay in lays):  # (the values a decision
            # reads: indices and masks; a write's own target's are not what its layout
            # reads. One whose tensors are all shared, the target before a write too,
            # reads none: it gives shared ones whatever their values)
            self.decided.append([(t, t._version) for t in leaves if value_leaf(t) and (
                before is None or t is not args[0])])
        keep = False
        for o, lay in zip(made, made_lays):
            keep = keep or (lay is SHARED and not o.requires_grad)
            self.numbers.give(o)
            self.layouts.append(lay)
        recall = recall_key(func, args, kwargs) if (
            decide and kind is not PARAM and draw is None) else None
        self.entries.append(Entry(func, kind, tuple(wants), metas, key, outs_of(out),
                                  len(made), lays, flow, decide, keep,
                                  n_ops if kind is PARAM else -1, derives,
                                  torch.is_grad_enabled(), draw, before is not None, dynamic,
                                  recall))

    def program(self, cap: Capture, output: Any, fails: int = 0) -> Program | None:
        """The program, if a later call may run it (the capture's parameters all read by
        ops the rules take: the caller checks the plan); ``fails``: how many calls left
        the programs before this one."""
        if self.dead is not None or cap.unseen_reads or cap.claims or (
                cap.param_written or cap.mixing or cap.calls and any(
                    c.rule is not None for c in cap.calls)):
            return None
        if any(t._version != v for leaves in self.decided for t, v in leaves) or any(
                op.changed() and op.func not in UNREAD_INPUTS for op in cap.ops):  # (written
            # in place after an op whose rule reads it read it)
            return None
        reads = []
        for op in cap.ops:
            if op.claimed is not None or op.before is not None or op.draw is not None or (
                    op.previous is not None):
                return None
            call = None if op.call is None else (op.call.name, weakref.ref(op.call.module))
            reads.append(_Read(tuple(op.layouts), op.flow, dict(op.sources), call,
                               shapes_only(op.output, op.flow.outputs), op.out_versions))
        found = []
        for t in tensor_leaves(output):
            want = self._want(t)
            if type(want) is not int:
                return None
            found.append(want)
        return Program(tuple(self.entries), tuple(self.layouts), self.inputs,
                       frozenset(cap.watched), tuple(reads), tuple(found),
                       tuple(self.generators), fails)


class _LeanMode(TorchFunctionMode):
    def __init__(self, cap: LeanCapture):
        super().__init__()
        self.cap = cap  # (the cycle is broken on leaving: LeanCapture.__exit__)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        cap = self.cap
        if threading.get_ident() != cap.thread:
            return func(*args, **(kwargs or {}))
        try:
            return cap.run(func, args, kwargs or {})
        except Deopt:
            cap.failed = True  # (and every later op: a model's bare except cannot go on)
            raise


class _HiddenLeanMode(_LeanMode):
    pass


class LeanCapture(Capture):
    """A capture that runs a :class:`Program` (see the module docstring). On leaving
    without an error, :meth:`finish` with the model's output makes the records; a
    :class:`Deopt` propagates out of the forward (the caller runs it again under the
    full capture)."""

    def __init__(self, watched: dict, n: int, batched: list, program: Program, tape: list):
        super().__init__(None, watched, n, batched)
        self.program = program
        self.steps = list(tape)  # (the data flow is the earlier call's)
        self.replayed = len(tape)
        self.numbers = Numbers()
        self.k = 0  # the next entry
        self.failed = False  # an op left the program
        self.seen: list[tuple] = []  # per parameter read: its op as it ran
        self.dyn: dict[int, Layout] = {}  # number -> a layout holding this call's indices
        self.recall = Recall()  # the decisions made (dropped at the end of the forward)
        me = weakref.proxy(self)  # (no reference cycle: the records hold activations)
        self.lean_ctx = Ctx(n, lambda t: me._layout_of(t), lambda op: None)  # (a cached
        # call's choices by the batch's data are constants as in the call it replays)
        self._deciding: tuple = ((), ())  # the leaves and layouts of the op deciding
        self._lean: _LeanMode | None = None
        self.no_autocast = None  # autocast_state() where none is on (taken on entering)
        self.saved: tuple = ()  # autograd's and autocast's state on entering (_restore)
        for t, lay in batched:
            k = self.numbers.give(t)
            if not _plain(lay):  # (an input's rows by this call's indices: a graph batch)
                self.dyn[k] = lay
        self.layouts.fallback = lambda t: me._numbered(t)  # (what the loss reads: any of
        # the tensors it numbered)

    def _numbered(self, t: Tensor) -> Layout | None:
        """The layout of a tensor this call numbered (``None``: not one)."""
        k = self.numbers.of(t)
        return None if k is None else self.dyn.get(k, self.program.layouts[k])

    def _layout_of(self, t: Tensor) -> Layout:
        """A tensor's layout, for an op whose data flow is decided again: its leaves' as
        the full capture had them, a numbered tensor's by its number."""
        leaves, layouts = self._deciding
        for x, lay in zip(leaves, layouts):
            if x is t:
                return lay
        return SHARED if self.watched.get(id(t)) is t else self.layouts.layout(t)

    def __enter__(self) -> LeanCapture:
        with torch._C.DisableTorchFunction():
            self.no_autocast = autocast_state() if not (
                torch._C._is_any_autocast_enabled()) else None
            self.saved = (torch.is_grad_enabled(), self.no_autocast or autocast_state(),
                          [(g, g.get_state()) for g in self.program.generators])
        WhileCapturing.enter()
        try:
            kind = _LeanMode
            if must_hide():
                if "__torch_function__" not in _HiddenLeanMode.__dict__:
                    _HiddenLeanMode.__torch_function__ = hidden(_LeanMode.__torch_function__)
                kind = _HiddenLeanMode
            self._lean = kind(self)
            self._lean.__enter__()
        except BaseException:
            WhileCapturing.exit()
            raise
        return self

    def __exit__(self, _type, exc, _tb) -> None:
        try:
            self._lean.__exit__(None, None, None)
        finally:
            self._lean.cap = None
            self._lean = None
            WhileCapturing.exit()
            if self.failed:  # (a stop inside a context manager's entering skips its exit)
                _restore(self.saved)

    def run(self, func, args: tuple, kwargs: dict) -> Any:
        """One op of the forward: checked against its entry, run, its outputs numbered."""
        entries, k = self.program.entries, self.k
        if k >= len(entries) or self.failed:
            raise Deopt
        e = entries[k]
        if e.func is not func and e.func != func:  # (a getter's method-wrapper is new)
            raise Deopt
        self.k = k + 1
        if e.kind is META:
            return func(*args, **kwargs)
        if torch.is_grad_enabled() is not e.grad:
            raise Deopt
        leaves = op_leaves(args, kwargs)
        if len(leaves) != len(e.wants):
            raise Deopt
        numbers = self.numbers._by_id
        for t, want, meta in zip(leaves, e.wants, e.metas):
            if meta is None:
                entry = numbers.get(id(t))
                if entry is None or entry[1] != want or entry[0]() is not t:
                    raise Deopt
            elif t is not want or t.shape != meta[0] or t.dtype != meta[1] or (
                    t.requires_grad != meta[2]):
                raise Deopt
        if e.key is not None and not _same_key(args, kwargs, e.key):
            raise Deopt
        if e.write and not writable(self.numbers, self.program.inputs, func, args, kwargs,
                                    lambda: _storages(self.program.reads_outside,
                                                      self.numbers, self.program.inputs)):
            raise Deopt  # (a view of a tensor from before the call: its write would stay)
        kind = RANDOM.get(func)
        if kind is not None and kind.draws(args, kwargs) is not (e.draw is not None):
            raise Deopt  # (drawing now where it did not, or the reverse: training flags)
        draw = None
        if e.draw is not None:
            draw = Draw(func, e.draw[0], args, kwargs, e.draw[2])
            draw.layout = e.draw[1]
            self.draws.append(draw)
        out = func(*args, **kwargs)
        if draw is not None:
            draw.finish(out)
        if outs_of(out) != e.outs:
            raise Deopt
        made = _made(out, leaves)
        if len(made) != e.made:
            raise Deopt
        for o in made:
            self.numbers.give(o)
        flow = None
        if e.decide:
            lays = e.layouts
            if e.dynamic:  # (a leaf's layout as this call decided it)
                dyn = self.dyn
                lays = tuple(dyn.get(w, lay) if type(w) is int else lay
                             for w, lay in zip(e.wants, lays))
            self._deciding = (leaves, lays)
            outs = _outputs(args[0] if e.write else out)
            flow = self.recall.flow(e, leaves, lays, outs)
            if flow is None:
                flow = decided(self.lean_ctx, func, args, kwargs, out, list(lays))
                self.recall.keep(e, leaves, lays, outs, flow)
            if not (_alike_flow(flow, e.flow) if e.dynamic else _same_flow(flow, e.flow)):
                raise Deopt
            if e.dynamic:
                for o, lay in _paired(args[0] if e.write else out, flow.outputs):
                    entry = numbers.get(id(o))
                    if entry is not None and entry[0]() is o:
                        self.dyn[entry[1]] = lay
                flow = (lays, flow)
        if e.kind is PARAM:
            with torch._C.DisableTorchFunction():
                versions = [t._version for t in leaves]
                outs = _outputs(out)
                edges = [edge_of(o) for o in outs]
                derived = tuple((k, outs[k], outs[k]._version) for k in e.derives)
            state = self.no_autocast
            if state is None or torch._C._is_any_autocast_enabled():
                state = autocast_state()
            self.seen.append((e.op, func, args, kwargs, out, leaves, versions, edges, state,
                              derived, flow if e.dynamic else None))
        if e.keep:
            for o in made:
                if not o.requires_grad:
                    KEPT.add(o)
        return out

    def finish(self, output: Any) -> bool:
        """After the forward: did it run the whole program? Then the records the full
        capture would have made, and the output's layouts."""
        program = self.program
        self.recall = Recall()
        if self.k != len(program.entries) or self.failed:
            return False
        leaves = tensor_leaves(output)
        if len(leaves) != len(program.output):
            return False
        for t, want in zip(leaves, program.output):
            if self.numbers.of(t) != want:
                return False
        for t, want in zip(leaves, program.output):
            self.layouts[t] = self.dyn.get(want, program.layouts[want])
        for index, func, args, kwargs, out, leaves_, versions, edges, state, derived, now in (
                self.seen):
            read = program.reads[index]
            if now is not None:  # (its layouts as this call decided them)
                read = _Read(now[0], now[1], read.sources, read.call, read.output,
                             read.out_versions)
            call = None
            if read.call is not None:
                module = read.call[1]()
                if module is None:
                    return False
                call = Call(read.call[0], module)
            op = Op(func, args, kwargs, out, leaves_, list(read.layouts), read.flow,
                    read.sources, call, index=index)
            op.sources_all = frozenset().union(*read.sources.values())
            op.autocast = state
            op.versions = versions
            op.edges = edges
            op.record_output(out, read.output, read.out_versions)
            self.ops.append(op)
            for k, o, version in derived:
                self.derived[id(o)] = Derived(o, op, k, version)
        return True


_SETITEM = Tensor.__setitem__


def writes(func: Any, kwargs: dict) -> bool:
    """Does the op write a tensor in place (``x[i] = v``, ``x.add_(y)``, ``out=``)?"""
    return func is _SETITEM or in_place(func, kwargs) or name_of(func) == "__set__"


def writable(numbers: Numbers, inputs: int, func: Any, args: tuple, kwargs: dict,
             outside: Callable[[], set]) -> bool:
    """May a program hold this write: one into its first argument, a tensor this call
    made (numbered after the ``inputs``), whose storage is that call's too (its base, if
    a view, numbered so, or the hidden result of an op such as ``linear`` on 3-d
    inputs: none of the storages ``outside()`` gives, those of the tensors from before
    the call that the ops read)? Then a call that stops and runs again under the full
    capture finds no write of its own left."""
    if name_of(func) == "__set__" or kwargs.get("out") is not None or not args or (
            type(args[0]) is not Tensor):
        return False
    t = args[0]
    k = numbers.of(t)
    if k is None or k < inputs:
        return False
    base = t._base
    if base is None:
        return True
    k = numbers.of(base)
    if k is not None:
        return k >= inputs
    return storage_of(base) not in outside()


def _storages(wants: Any, numbers: Numbers, inputs: int) -> set:
    """The storages of the tensors from before a call: its inputs (``numbers`` below
    ``inputs``) and the tensors in ``wants`` (entries' leaves read as themselves)."""
    found = {storage_of(t) for ws in wants for t in ws if type(t) is not int}
    for ref, k in numbers._by_id.values():
        t = ref()
        if t is not None and k < inputs:
            found.add(storage_of(t))
    return found


def decided(ctx: Ctx, func: Any, args: tuple, kwargs: dict, out: Any,
            layouts: list[Layout]) -> Flow:
    """The data flow of an op decided again (:func:`~persample.batch.flow.propagate`;
    ``x[i] = v``: ``x``'s layout after it, as the full capture decides it)."""
    if func is _SETITEM:
        return Flow(written_layout(ctx, *args[:3]))
    return propagate(ctx, func, args, kwargs, out, layouts)


def _same_key(args: tuple, kwargs: dict, key: tuple) -> bool:
    """``arguments_key(args, kwargs) == key``, without making the key where the
    arguments are tensors and plain values (most ops)."""
    (_, want), named = key  # (the arguments' key: (tuple, per argument))
    if len(args) != len(want) or bool(kwargs) != bool(named):
        return False
    for a, w in zip(args, want):
        kind = type(a)
        if w is _TENSOR:
            if not isinstance(a, Tensor):
                return False
        elif kind in _PLAIN:
            if type(w) is not tuple or w[0] is not kind or w[1] != a:
                return False
        else:
            try:
                if _key(a) != w:
                    return False
            except Opaque:
                return False
    if not named:
        return True
    try:
        return arguments_key((), kwargs)[1] == named
    except Opaque:
        return False


def _restore(saved: tuple) -> None:
    """Autograd's, autocast's and the generators' state as before a forward that stopped
    (the ops before the stop may have set them: ``torch.set_grad_enabled(False)``'s own
    op, then a stop before its ``with`` block, whose exit would have reset it)."""
    grad, autocast, generators = saved
    with torch._C.DisableTorchFunction():
        torch._C._set_grad_enabled(grad)
        for g, state in generators:  # (the random ops run before the stop drew nothing)
            g.set_state(state)
        for device, enabled, dtype in autocast:
            if device == "cuda" and not torch.cuda.is_available():
                continue
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)


def _same_flow(a: Flow, b: Flow) -> bool:
    """The same layouts (mixed and unknown ones whatever their reason: the full capture
    names the module where they arose), writing nothing."""
    return _same(a.outputs, b.outputs) and _same(a.pairing, b.pairing) and not a.writes and (
        not b.writes)


def _alike_flow(a: Flow, b: Flow, sized: bool = False) -> bool:
    """:func:`_same_flow`, where layouts holding indices need only hold them in the
    same places (the indices are this call's; ``sized``: of any lengths)."""
    return _alike(a.outputs, b.outputs, sized) and _alike(a.pairing, b.pairing, sized) and not (
        a.writes or b.writes)


def _alike(a: Any, b: Any, sized: bool = False) -> bool:
    """The same layout but for the values of the index tensors it holds (``sized``: and
    their lengths: a graph batch's nodes and edges, which each batch has its own)."""
    if type(a) is not type(b):
        return False
    if type(a) is tuple:
        return len(a) == len(b) and all(_alike(x, y, sized) for x, y in zip(a, b))
    if isinstance(a, Partly):
        return a.dim == b.dim and _same_shape(a.rows, b.rows, sized)
    if isinstance(a, Piece):
        return a.sample == b.sample
    if isinstance(a, Batched):
        return (a.dim, a.outer, a.inner) == (b.dim, b.outer, b.inner) and _same_shape(
            a.index, b.index, sized) and _same_shape(
            getattr(a, "keys", None), getattr(b, "keys", None), sized)
    return type(a) in (Mixed, Unknown) or a == b


def _same_shape(a: Tensor | None, b: Tensor | None, sized: bool = False) -> bool:
    if a is None or b is None:
        return a is b
    return a.dim() == b.dim() if sized else a.shape == b.shape


def _paired(out: Any, layouts: Any) -> list[tuple[Tensor, Layout]]:
    """An op's output tensors with their layouts (as :meth:`LayoutTable.set_outputs`
    pairs them)."""
    if isinstance(out, Tensor):
        return [(out, layouts)]
    if isinstance(out, (tuple, list)):
        lays = layouts if isinstance(layouts, tuple) else (layouts,) * len(out)
        return [(o, lay) for o, lay in zip(out, lays) if isinstance(o, Tensor)]
    return []


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is tuple:
        return len(a) == len(b) and all(map(_same, a, b))
    return type(a) in (Mixed, Unknown) or a == b
