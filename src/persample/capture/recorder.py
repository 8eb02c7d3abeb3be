"""The capture: one forward recorded, every op seen, the samples followed.

Inside the ``with`` block, the mode (:mod:`persample.capture.mode`) hands every op to
:meth:`Capture.record`, which runs it and asks :mod:`persample.batch` (the one place
that decides layouts) for the layouts of its outputs, starting from the model's inputs
(their per-sample tensors batched in dim 0, the rest shared), its parameters and
buffers (shared). An op reading a watched parameter, directly or through *derived*
tensors (shared tensors computed from parameters: ``W.t()``, ``pos[:, :T]``, a position
embedding looked up with ``arange`` ids) is recorded as an :class:`~persample.capture.
records.Op`. If its output carries samples it is a *use*: its per-sample gradient comes
from that op's rule, with the backprops of its output (read at its gradient edge,
:mod:`persample.capture.edges`). Otherwise its output is derived, and the op is pulled
back later from the per-sample cotangents its consumers give. A derived tensor widened
to the batch (``bias.expand(B, H, T, T)``) is read as the tensor it widens by the ops
that broadcast it anyway. Parameter data written in place into a shared tensor, and a
derived tensor read after it changed in place, are reads the rules cannot follow
(``unseen_reads``): no recorded op made what is read.

Forward hooks on every module holding a watched parameter keep the stack of module
calls (for names, module rules and the per-module fallback). A module with a module
rule *claims* the ops reading its own parameters inside its call. Inside the call of a
module rule whose output keeps its input's layout (``ModuleSpec.keeps_layout``: the
experts of a mixture, which the rule computes from the call's inputs whatever the ops
inside do), the ops run unfollowed, their reads of the module's parameters noted on the
call (``Call.read``); an op there that reads another parameter, draws random numbers or
writes a tensor made before the call is followed as anywhere else.

Rows of no sample given their sample by the op that meets them: a row-wise op reading
parameters (a linear layer) on a tensor some of whose rows hold no sample's data (the
aggregate of a node that got no message, :class:`~persample.batch.ops_indexing.Partly`)
makes such rows too. Where the only op that ever reads that output (through views,
``chunk`` and elementwise ops, which carry the rows on: with shared operands, or merging
them with another tensor's rows, ``RGCNConv``'s sum over its relations) pairs each
of those rows with one sample's row (``SAGEConv``'s ``lin_l(mean) + lin_r(x)``: the
node's own features added; a pool's scatter into each graph's row), that sample's loss
is the only one the row reaches, so the row's cotangent is that sample's alone: the
op's record takes the paired layout for its output and for the input rows it carried
(``claims``: such a capture makes no program). A second reader of a tensor on the way,
before or after (a gather could spread a row to other samples), leaves the record as it
was: its parameters then take the per-module fallback. A read of the shape alone
(``new_zeros``, the ``other`` of ``expand_as``) is no read.

Every random op is recorded as a :class:`~persample.draws.Draw` (``draws``, in order;
an op's own in ``Op.draw``, a call's range in ``Call.first_draw``/``end_draw``), so that
whatever is evaluated again draws the numbers this forward drew. While the loss runs
(:meth:`Capture.follow`), the first of its ops that mixes samples (``mixing``) is kept:
such a loss has no per-sample form. ``torch.autograd.grad(..., create_graph=True)``
in the forward or the loss is refused (:class:`~persample.errors.NeedsWholeModel`): the
backward ops of a gradient's own graph run inside autograd, unseen.

State lives in the :class:`Capture` object, never on the model, and the hooks exist only
inside the ``with`` block: they are removed in ``finally``. What a capture changes
outside itself while open is in :mod:`persample.patches`.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..batch import (
    SHARED,
    Batched,
    Ctx,
    Flow,
    Layout,
    Mixed,
    Unknown,
    in_place,
    op_leaves,
    propagate,
)
from ..batch.flow import (
    METADATA,
    SHAPE_READERS,
    aliases,
    broadcasts,
    handler_of,
    name_of,
    unbroadcast,
)
from ..batch.layouts import Piece, new_trouble, placed
from ..batch.ops_indexing import Partly, written_layout
from ..batch.table import MISSING, LayoutTable, storage_of
from ..draws import Draw, random_kind
from ..errors import NeedsWholeModel, module_note, raise_internal
from ..patches import WhileCapturing
from ..precision import autocast_state
from .edges import edge_of
from .mode import hidden, mode_class, must_hide
from .records import UNREAD_INPUTS, Call, Derived, Inner, Op
from .tape import Opaque, Step, arguments_key, outs_of, reads_of, reusable
from .tensors import KEPT, free_tensors, has_tensor, holders, tensor_leaves, user_leaf

_DETACHES = frozenset((torch.Tensor.detach, torch.detach, torch._C.TensorBase.grad.__get__))
_VALUES = (bool, int, float, complex, str)  # what a read of values into Python gives


def _read_into_python(out: Any) -> bool:
    """Is an op's result values read into Python (``item``, ``bool``, ``tolist``: a
    number, or a list of them), not tensors?"""
    if isinstance(out, _VALUES):
        return True
    return isinstance(out, list) and not (out and isinstance(out[0], Tensor))
# (a parameter's .grad is another tensor: read in the forward, as Module.to does, it is
# no gradient path)
_BY_MEMORY = frozenset(f for f in (torch.as_strided, torch.Tensor.as_strided,
                                   getattr(torch.Tensor, "as_strided_", None)) if f is not None)
# (ops whose data flow reads strides and storage offsets: decided at every call)
_MISSED = object()  # no step on the tape stands for this op
_APPLY = torch.autograd.Function.apply.__func__.__code__


def _inside_function() -> bool:
    """Is a custom ``autograd.Function``'s forward under way (its ``apply`` on the
    stack)? Asked only of the rare op reading a parameter without autograd."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _APPLY:
            return True
        frame = frame.f_back
    return False

_AS_OTHER = frozenset(aliases("expand_as", "view_as", "reshape_as", "type_as", "to"))  # ops
# whose tensors after the first are read for their shape, dtype and device alone
# ops whose output is their first argument repeated along new or size-1 dims, where its
# shape broadcasts to the output's
_WIDENINGS = frozenset(f for f in (
    torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to, torch.Tensor.broadcast_to,
    torch.Tensor.repeat, torch.tile, torch.Tensor.tile) if f is not None)


class Capture:
    """Context manager recording one forward (see the module docstring).

    Args:
        model: the model; its parameters, buffers and tensor attributes are shared
            (``None`` for a plain function: no module calls are kept).
        watched: the trainable parameters to follow (``id`` -> parameter).
        n: the batch size.
        batched: the input tensors that carry the samples: a tensor (samples in dim 0)
            or a pair ``(tensor, layout)`` (packed rows, a packed sequence's data).
        shared: the other input tensors (shared).
        module_rule: ``module -> rule or None``.
        constant: ``constant(t)`` for a tensor the capture never saw made: is it shared
            (made before the call, so shared by every sample) rather than unknown (made
            by code the capture cannot see, from sample data perhaps)? Default
            :func:`~persample.capture.tensors.user_leaf`.
        expansions: ``{func: fn}``, ops run as their decomposition ``fn(*args,
            **kwargs)`` under the capture (``fn`` returns ``NotImplemented`` to leave a
            call whole). :func:`persample.rules.open_capture` passes the rules' own.
        tape: the ``steps`` of an earlier capture of the same call (same model, inputs
            of the same shapes and layouts, same batch size, same watched parameters):
            each op that matches its step takes its layouts from it
            (:mod:`persample.capture.tape`).

    After the block: ``ops`` (every op reading a watched parameter, in order),
    ``derived`` (id of a derived tensor -> :class:`~persample.capture.records.Derived`),
    ``calls`` (finished module calls), ``layout(t)`` for any tensor, ``unseen_reads``
    (parameters read by ops without autograd: a gradient path the capture cannot see),
    ``steps`` (every op's :class:`~persample.capture.tape.Step`, ``None`` for one whose
    data flow is decided at every call) and ``replayed`` (how many ops took theirs from
    ``tape``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
        >>> x = torch.randn(5, 3)
        >>> with Capture(net, {id(p): p for p in net.parameters()}, 5, [x]) as cap:
        ...     y = net(x)
        >>> cap.layout(y), [op.func.__name__ for op in cap.ops]
        (Batched(dim=0), ['linear', 'linear'])
        >>> len(net[0]._forward_hooks)
        0
    """

    def __init__(self, model: nn.Module | None, watched: dict[int, nn.Parameter], n: int,
                 batched: list[Tensor | tuple[Tensor, Layout]], shared: tuple = (),
                 module_rule: Callable[[nn.Module], Any] | None = None,
                 constant: Callable[[Tensor], bool] | None = None,
                 expansions: dict[Any, Callable] | None = None,
                 tape: list[Step | None] | None = None):
        self.model, self.watched, self.n = model, watched, n
        self.constant = constant or user_leaf
        self.expansions = expansions or {}
        self.layouts = LayoutTable()
        self.derived: dict[int, Derived] = {}
        self.ops: list[Op] = []
        self.calls: list[Call] = []
        self.draws: list[Draw] = []  # every random op, in order (persample.draws)
        self.stack: list[Call] = []
        self.unseen_reads: set[int] = set()
        # shared tensors parameters were written into in place (``w[:3] = p``), by storage:
        # an alias of one read later was not made by the write's op
        self.param_written: dict[int, Tensor] = {}
        self._written_into: Tensor | None = None  # the op just followed made this derived
        # tensors carrying rows of no sample that a recorded row-wise op made, which their
        # one reader may pair with samples (see the module docstring): id(tensor) ->
        # (tensor, the chains of the ops whose rows it carries, whether it was read, the
        # rows of no sample it holds)
        self._claimable: dict[int, tuple[Tensor, tuple[_Chain, ...], bool, Tensor]] = {}
        self.claims = 0  # records so completed (their layouts are this call's: no program)
        self.following = False  # inside follow(): the loss's ops
        self.mixing: str | None = None  # the first op of the loss that mixes samples
        self.piece_read: str | None = None  # a read of one sample's piece into Python
        self.values_read: str | None = None  # the first read of sample data into Python
        self.mixed_in_loss: set[int] = set()  # (ids: tensors the loss's own ops mixed)
        self._unseen: list[Tensor] = []  # tensors read, never seen made, no gradient path
        self.thread = threading.get_ident()
        # no reference cycle back to the capture (its graph would live until the cyclic
        # GC runs: gigabytes in a training loop of many micro-batches)
        me = weakref.proxy(self)
        self.ctx = Ctx(n, self.layouts.layout, lambda op: me._constant(op))
        self._module_rule = module_rule
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._mode: Any = None  # made on entering
        self._flow: Flow | None = None  # the data flow of the op just followed
        self._quiet: Call | None = None  # the module-rule call whose ops are not followed
        self.steps: list[Step | None] = []  # every op seen, in order (the next tape)
        self._replay = tape  # the steps of an earlier capture of this call
        self.tracer: Any = None  # traces the forward (persample.capture.lean.Tracer)
        self.replayed = 0  # ops whose data flow was taken from the tape
        # a compiled graph's first call ran under it: keeps the graph's plan, given
        # whether the call's plan took the rules alone (persample.capture.compiled)
        self.settle: Callable[[bool], None] | None = None
        for t in free_tensors(model, shared):
            self.layouts[t] = SHARED
        for item in batched:
            t, lay = item if isinstance(item, tuple) else (item, Batched(0))
            self.layouts[t] = lay

    def add_inputs(self, located: list[tuple[Tensor, Layout]]) -> None:
        """More tensors whose samples are known (the loss's targets)."""
        for t, lay in located:
            self.layouts[t] = lay

    def layout(self, t: Tensor) -> Layout:
        """The layout of ``t``; a tensor the capture never saw created is Unknown."""
        return self.layouts.layout(t)

    @contextmanager
    def follow(self) -> Iterator[None]:
        """Inside: ops are followed (layouts) as during the forward, without the module
        hooks (the loss, after the model's forward)."""
        mode = mode_class(must_hide())(weakref.proxy(self))
        self.following = True
        mode.__enter__()
        try:
            yield
        finally:
            mode.__exit__(None, None, None)
            self.following = False
        self._stale_derived()

    # -- the context manager --------------------------------------------------

    def __enter__(self) -> Capture:
        WhileCapturing.enter()
        try:
            hide = must_hide()  # (after the stance is set)
            # a module with no trainable parameter inside is not hooked: its parent's call
            # stands for it
            found = holders(self.model, self.watched) if self.model is not None else []
            post = hidden(self._post_hook) if hide else self._post_hook
            for name, module in found:
                if isinstance(module, torch.jit.ScriptModule):
                    raise NeedsWholeModel(
                        f"module '{name or '<root>'}' ({module.original_name}) is TorchScript "
                        "(torch.jit.script): its ops run inside the TorchScript interpreter, "
                        "where the capture cannot see them. Use the module's Python form "
                        "(before scripting) for the rules")
                pre = self._pre_hook(name)
                self._handles.append(module.register_forward_pre_hook(
                    hidden(pre) if hide else pre, with_kwargs=True))
                self._handles.append(module.register_forward_hook(post, with_kwargs=True))
            self._mode = mode_class(hide)(weakref.proxy(self), self.tracer)
            self._mode.__enter__()
        except BaseException:
            self._remove()
            WhileCapturing.exit()
            raise
        return self

    def __exit__(self, _type, exc, _tb) -> None:
        try:
            self._mode.__exit__(None, None, None)
        finally:
            try:
                WhileCapturing.exit()
            finally:
                self._remove()
        self._stale_derived()
        for t in self._unseen:  # (from before any later call: KEPT)
            KEPT.add(t, t._version)
        self._unseen = []
        if exc is not None and self.stack:  # raised inside a module's forward: name it
            call = self.stack[-1]
            exc.add_note(module_note(call.describe(), call.module, call.args, exc))

    def _stale_derived(self) -> None:
        """A derived tensor whose op's inputs changed in place since the op ran (through
        any alias: a view, a ``detach()``) cannot be pulled back through that op, which
        would read their new values: its parameters' reads cannot be followed. (A derived
        tensor read after it changed is caught where it is read, :meth:`_sources`. Not an
        op whose rule reads no input's value, a view, whose inputs changed only through
        another tensor sharing their storage: what they hold now is not read, and their
        records still name the ops that made what it read.)"""
        with torch._C.DisableTorchFunction():  # reading versions is no op of the model
            for d in self.derived.values():
                if d.op.changed() and not (d.op.func in UNREAD_INPUTS and (
                        self._changed_through_aliases(d.op) or self._written_after(d))):
                    self.unseen_reads |= d.op.sources_all

    def _written_after(self, d: Derived) -> bool:
        """Did every input of ``d``'s op that changed since it ran change by later writes
        in place that the capture recorded, each taking the value before it as its
        :attr:`Op.previous`, back to ``d`` (``R.add_(a); R.add_(b)``: peft's OFT sums its
        Cayley-Neumann series so)? Its pullback then follows the chain."""
        for t, v in zip(d.op.leaves, d.op.versions):
            if t._version != v:
                link = self.derived.get(id(t))
                if link is None or link.tensor is not t or link.version != t._version:
                    return False
                while link is not None and link is not d:
                    link = link.op.previous
                if link is not d:
                    return False
        return True

    def _changed_through_aliases(self, op: Op) -> bool:
        """Did every input of ``op`` that changed since it ran change through another
        tensor sharing its storage (a view of all of it written in place), its record
        left as it was (stale: the op that made what ``op`` read)? An input written in
        place itself has a new record, the write's, and ``op`` read the value before it."""
        for t, v in zip(op.leaves, op.versions):
            if t._version != v:
                found = self.derived.get(id(t))
                if found is None or found.tensor is not t or found.version == t._version:
                    return False
        return True

    def release_calls(self, keep: list[Call]) -> None:
        """Forget the inputs, outputs and gradient edges of the module calls other than
        ``keep`` (the calls the plan runs a module rule or the fallback on): what they
        hold (every block's activations, a frozen layer's output, a model output's
        key-value cache) is then freed as the backward goes, as in a plain backward.
        Their names stay for messages."""
        kept = {id(call) for call in keep}
        for call in self.calls:
            if id(call) not in kept:
                call.args, call.kwargs, call.output, call.edges = (), {}, None, []
                call.inner = []

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- module calls -----------------------------------------------------------

    def _pre_hook(self, name: str):
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if threading.get_ident() != self.thread:
                return
            try:
                with torch._C.DisableTorchFunction():  # reading tensors here is no op of
                    # the model's (a rule's match reads its parameters' dims)
                    rule = self._module_rule(module) if self._module_rule else None
                    leaves = tensor_leaves((args, kwargs))
                    call = Call(name, module, args, kwargs, rule=rule,
                                parent=self.stack[-1] if self.stack else None,
                                autocast=autocast_state(), first_draw=len(self.draws))
                    call.versions = [t._version for t in leaves]
                if (rule is not None and rule.spec.keeps_layout and self._quiet is None
                        and not self.following and not self._sources(leaves)
                        and all(self._plain(t, rule.spec.rows) for t in leaves)
                        and not all(self.layouts.layout(t).shared for t in leaves)):
                    self._quiet = call  # its ops are the rule's: run, not followed
                    call.own = frozenset(id(p) for _, p in rule.spec.params(module))
                    call.inputs = frozenset(id(t) for t in leaves)
            except Exception as err:
                raise_internal(err, f"the call of module '{name or '<root>'}'")
            self.stack.append(call)

        return pre_hook

    def _plain(self, t: Tensor, rows: bool) -> bool:
        """Is ``t`` shared, or batched with one position per sample (``rows``: or each
        sample's rows one run, in sample order), as a module rule takes its inputs?"""
        lay = self.layouts.layout(t)
        return lay.one_position_each() or (rows and isinstance(lay, Batched)
                                           and lay.outer == 1 and lay.index is None)

    def _quietly(self, func, args: tuple, kwargs: dict) -> Any:
        """An op inside a module-rule call whose output keeps its input's layout
        (``ModuleSpec.keeps_layout``: the rule computes the call from its inputs and the
        backprops of its outputs): run without following it, unless it draws random
        numbers, reads a parameter other than the module's own, or writes a tensor made
        before the call (those are followed, :data:`_MISSED`)."""
        call = self._quiet
        leaves = op_leaves(args, kwargs)
        sources = self._sources(leaves) if leaves else {}
        if any(not pids <= call.own for pids in sources.values()):
            return _MISSED
        if (func is torch.Tensor.__setitem__ or in_place(func, kwargs)) and leaves and (
                self.layouts.layout(kwargs.get("out", leaves[0])) is not MISSING):
            return _MISSED
        if random_kind(func, args, kwargs) is not None:
            return _MISSED
        self.steps.append(None)
        if sources:
            call.read |= frozenset().union(*sources.values())
        out = func(*args, **kwargs)
        if leaves and _kept_inside(call, func, leaves):
            edge = edge_of(out) if isinstance(out, Tensor) and out._base is None else None
            call.inner.append(Inner(func, args, kwargs, out, edge))
        return out

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        call = self.stack.pop()
        if self._quiet is call:
            self._quiet = None
        try:
            call.output = output
            call.end_draw = len(self.draws)
            if call.rule is not None and call.rule.spec.keeps_layout:
                self._keeps_layout(call)
            with torch._C.DisableTorchFunction():  # reading tensors here is no op of the model
                outs = tensor_leaves(output)
                call.edges = [edge_of(t) for t in outs]
                if call.rule is not None:
                    call.out_versions = [t._version for t in outs]
        except Exception as err:
            raise_internal(err, f"the output of module {call.describe()}")
        self.calls.append(call)

    def _keeps_layout(self, call: Call) -> None:
        """A module rule's call whose output holds the samples as its first input does
        (``ModuleSpec.keeps_layout``): so recorded, whatever its ops did inside."""
        first = next((t for t in tensor_leaves((call.args, call.kwargs))), None)
        lay = self.layouts.layout(first) if first is not None else MISSING
        if isinstance(lay, Batched):
            for t in tensor_leaves(call.output):
                if t.shape[:lay.dim + 1] == first.shape[:lay.dim + 1]:
                    self.layouts[t] = lay

    # -- ops ------------------------------------------------------------------

    def expands(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Must an op with an expansion run as it (the mode asks)? Where it reads a
        watched parameter or a derived tensor, whose rules are its parts', or has no data
        flow of its own; else (BLOOM's ``baddbmm`` of its ALiBi bias and the activations)
        it is one op like any other, whose program a cached call may hold."""
        if handler_of(func) is None or self.param_written:
            return True
        watched, derived = self.watched, self.derived
        return any(watched.get(id(t)) is t or id(t) in derived
                   for t in op_leaves(args, kwargs))

    def record(self, func, args: tuple, kwargs: dict) -> Any:
        """Run one op (the model's own: its errors propagate as they are); record its
        outputs' layouts, and the op if it reads parameters (persample's work: an error
        there is an :class:`~persample.errors.InternalError` naming the op)."""
        if func is torch.autograd.grad:
            self._refuse_graph_of_grads(args, kwargs)
        if func in METADATA:  # (a shape, a dtype: no tensor made)
            self.steps.append(None)
            return func(*args, **kwargs)
        claimable = bool(self._claimable) and any(
            id(t) in self._claimable for t in op_leaves(args, kwargs))  # (followed here)
        if self._quiet is not None and not claimable:
            out = self._quietly(func, args, kwargs)
            if out is not _MISSED:
                return out
        if self._replay is not None and not claimable:
            out = self._from_tape(func, args, kwargs)
            if out is not _MISSED:
                return out
        try:
            leaves = op_leaves(args, kwargs)
            # (an op reading only shapes, zeros_like(weight), reads no parameter)
            sources = self._sources(leaves) if func not in SHAPE_READERS else {}
            if sources:  # a derived tensor the op broadcasts anyway: its narrow form
                narrowed = unbroadcast(func, args, kwargs, self._unexpanded)
                if narrowed is not None:
                    args, kwargs = narrowed
                    leaves = op_leaves(args, kwargs)
                    sources = self._sources(leaves)
            layouts = [self._seen(t) for t in leaves]
            mutates = in_place(func, kwargs)
            before = None
            if sources and (mutates or func is _SETITEM) and leaves and leaves[0] is args[0] and (
                    func not in UNREAD_INPUTS):
                before = args[0].detach().clone()  # the rule needs the value it overwrites
            kind = random_kind(func, args, kwargs)
            draw = None if kind is None else Draw(
                func, kind, args, kwargs, self.stack[-1].describe() if self.stack else "")
        except Exception as err:
            raise_internal(err, f"the capture of {name_of(func)}")
        out = func(*args, **kwargs)
        if _read_into_python(out) and any(lay is not SHARED for lay in layouts):
            if self.piece_read is None and any(isinstance(lay, Piece) for lay in layouts):
                self.piece_read = self._read_of_piece(func, leaves, layouts)
            if self.values_read is None:  # (its certificate also checks a sample alone)
                where = f" in module {self.stack[-1].describe()}" if self.stack else ""
                self.values_read = f"{name_of(func)}{where}"
        try:
            out = self._follow(func, args, kwargs, out, leaves, layouts, sources, mutates,
                               before, draw)
            if draw is not None:
                self._drawn(draw, args, out, layouts)
            self.steps.append(None if sources or mutates or draw is not None else
                              self._step(func, args, kwargs, layouts, leaves, out))
            return out
        except Exception as err:
            raise_internal(err, f"the data flow of {name_of(func)}")

    def _constant(self, op: str) -> None:
        """The data flow took a value of the samples' data for a constant (``op``): the
        certificate compares a sample alone, as for a read into Python."""
        if self.values_read is None:
            where = f" in module {self.stack[-1].describe()}" if self.stack else ""
            self.values_read = f"{op}{where}"

    def _refuse_graph_of_grads(self, args: tuple, kwargs: dict) -> None:
        """Raise :class:`~persample.errors.NeedsWholeModel` for ``torch.autograd.grad(...,
        create_graph=True)`` (input derivatives in a physics-informed loss, a gradient
        penalty, an inner optimisation step): the gradient it returns is differentiated
        again, through the backward ops autograd runs for it, which no capture sees. In the
        loss, also without a graph: each sample's loss evaluated again on its part of the
        outputs would differentiate tensors that part's graph does not hold. (In the
        forward, a gradient without a graph is a constant, followed as the output of an op
        without a data-flow rule.)"""
        create = kwargs.get("create_graph", args[4] if len(args) > 4 else False)
        if not create and not self.following:
            return
        where = ("loss_fn" if self.following else
                 f"module {self.stack[-1].describe()}" if self.stack else "the forward")
        raise NeedsWholeModel(
            f"torch.autograd.grad(..., create_graph=True) in {where}: the gradient it returns "
            "is differentiated again, through the backward ops autograd runs for it, which "
            "the capture cannot see, so the rules cannot split the parameters' gradients by "
            "sample" if create else
            "torch.autograd.grad in loss_fn: the samples of the gradient it returns are not "
            "followed, and each sample's loss evaluated again on its part of the model's "
            "outputs would differentiate tensors outside that part's graph")

    def _step(self, func, args: tuple, kwargs: dict, layouts: list[Layout], leaves: list,
              out: Any) -> Step | None:
        """The op's step for the next capture's tape, ``None`` where its data flow is to
        be decided at every call (:mod:`persample.capture.tape`)."""
        flow, outs = self._flow, outs_of(out)
        if flow is None or not outs or func in _BY_MEMORY or (
                self.following and _any_mixed(flow.outputs)) or not reusable(
                    func, flow, layouts, leaves):
            return None
        try:
            key = arguments_key(args, kwargs)
        except Opaque:
            return None
        return Step(func, key, reads_of(leaves, layouts), outs, flow)

    def _from_tape(self, func, args: tuple, kwargs: dict) -> Any:
        """Run an op that matches its step on the tape (see :mod:`persample.capture.tape`)
        with its outputs' layouts taken from the step; :data:`_MISSED` (not run) where
        there is no such step."""
        k = len(self.steps)
        step = self._replay[k] if k < len(self._replay) else None
        if step is None or step.func is not func:
            return _MISSED
        try:
            leaves = op_leaves(args, kwargs)
            if not self._matches(step, leaves) or arguments_key(args, kwargs) != step.key:
                return _MISSED
        except Opaque:
            return _MISSED
        except Exception as err:
            raise_internal(err, f"the capture of {name_of(func)}")
        out = func(*args, **kwargs)
        try:
            if outs_of(out) != step.outs:  # (sizes read from the data): decided here
                layouts = [self._seen(t) for t in leaves]
                out = self._follow(func, args, kwargs, out, leaves, layouts, {}, False, None)
                self.steps.append(None)
                return out
            outputs = step.flow.outputs
            self.layouts.set_outputs(out, outputs)
            if outputs is SHARED and isinstance(out, Tensor) and not out.requires_grad:
                KEPT.add(out)  # (as _follow keeps it)
            self.steps.append(step)
            self.replayed += 1
            return out
        except Exception as err:
            raise_internal(err, f"the data flow of {name_of(func)}")

    def _matches(self, step: Step, leaves: list) -> bool:
        """Does every leaf read as the step's did: same layout, shape, dtype and
        requires-grad, and no parameter or derived tensor among them?"""
        reads = step.reads
        if len(leaves) != len(reads):
            return False
        watched, derived, layout = self.watched, self.derived, self.layouts.layout
        for t, (lay, shape, dtype, grad) in zip(leaves, reads):
            key = id(t)
            if watched.get(key) is t or key in derived:
                return False
            got = layout(t)
            if got is MISSING:
                got = self._seen(t)
            if t.shape != shape or t.dtype != dtype or t.requires_grad != grad or (
                    got is not lay and (type(got) is not type(lay) or got != lay)):
                return False
        return True

    def _drawn(self, draw: Draw, args: tuple, out: Any, layouts: list[Layout]) -> None:
        """Keep a random op's draw, with where the samples are in its numbers: those of
        its input (dropout, attention weights before the last two dims) or its output."""
        draw.finish(out)
        kind = draw.kind.kind
        if kind in ("mask", "attention") and layouts:
            lay = layouts[0]
            if kind == "attention" and not (isinstance(lay, Batched) and lay.plain
                                            and lay.dim < args[0].dim() - 2):
                lay = None
        else:
            first = out[0] if isinstance(out, tuple) else out
            lay = self.layouts.layout(first) if isinstance(first, Tensor) else None
        draw.layout = lay if isinstance(lay, Batched) else None
        self.draws.append(draw)

    def _follow(self, func, args, kwargs, out, leaves, layouts, sources, mutates, before,
                draw=None) -> Any:
        """The layouts of an op's outputs, and the op recorded if it reads parameters
        (its data flow, if it has one, left in ``_flow``)."""
        self._flow, self._written_into = None, None
        pending = self._first_reads(leaves, func) if self._claimable else None
        if func is _SETITEM:
            lay = written_layout(self.ctx, *args[:3])
            self.layouts.written(args[0], lay)
            if sources and self._param_write(args[0], lay):  # ``w[:3] = p``: derived
                self._flow = Flow(SHARED)
                self._record_op(func, args, kwargs, args[0], leaves, layouts, self._flow,
                                sources, before, draw)
            elif sources:  # a parameter written into a tensor: no rule follows it
                self.unseen_reads |= frozenset().union(*sources.values())
            _kill(pending)
            return out
        if not has_tensor(out):
            _kill(pending)
            return out
        flow = propagate(self.ctx, func, args, kwargs, out, layouts)
        if self.stack and new_trouble(flow.outputs, layouts):
            flow = Flow(placed(flow.outputs, self.stack[-1].describe()), flow.pairing,
                        flow.writes)
        if pending:
            self._claimed(pending, func, leaves, layouts, flow, out)
        self._flow = flow
        target = kwargs.get("out") if isinstance(kwargs.get("out"), Tensor) else (
            args[0] if mutates and args and isinstance(args[0], Tensor) else None)
        if target is not None and isinstance(out, Tensor):
            self._base_written(target, flow.outputs)
            self.layouts.written(target, flow.outputs, out)
            if sources and flow.outputs is SHARED and not (
                    out is target and self._param_write(target, SHARED)):
                # parameters written into a shared tensor: what shares its storage no
                # longer holds what the ops that made it computed
                self.unseen_reads |= frozenset().union(*sources.values())
        else:
            self.layouts.set_outputs(out, flow.outputs)
            if flow.outputs is SHARED and isinstance(out, Tensor) and not out.requires_grad:
                KEPT.add(out)  # (for a later call that finds it cached; one with a gradient
                # path would carry this call's graph into the next: left unknown there)
        for t, lay in flow.writes:  # other inputs the op overwrote (running statistics)
            self.layouts.written(t, lay)
        if self.following and self.mixing is None:
            self.mixing = _mixes(func, flow.outputs, leaves, layouts, self.mixed_in_loss)
            if _mixed_here(flow.outputs, leaves, layouts, self.mixed_in_loss):
                self.mixed_in_loss.update(id(t) for t in tensor_leaves(out))
        if sources:
            self._record_op(func, args, kwargs, out, leaves, layouts, flow, sources, before,
                            draw)
        return out

    def _first_reads(self, leaves: list, func: Any) -> list[tuple[int, Tensor, tuple, Tensor]]:
        """The claimable tensors an op reads for the first time, ``(leaf position, tensor,
        its chains, the rows of no sample it holds)``, now marked read; a second read
        ends the chains of what it reads (see the module docstring). A read of the shape
        alone (``new_zeros``, the ``other`` of ``expand_as``) is none."""
        found = []
        references = (range(len(leaves)) if func in SHAPE_READERS else
                      range(1, len(leaves)) if func in _AS_OTHER else ())
        for k, t in enumerate(leaves):
            entry = self._claimable.get(id(t))
            if entry is None or entry[0] is not t or k in references:
                continue
            if entry[2]:
                _kill([(k, t, entry[1])])
            else:
                self._claimable[id(t)] = (t, entry[1], True, entry[3])
                found.append((k, t, entry[1], entry[3]))
        return found

    def _claimed(self, pending: list, func: Any, leaves: list, layouts: list[Layout],
                 flow: Flow, out: Any) -> None:
        """After the first read of claimable tensors (``pending``, :meth:`_first_reads`):
        where the op pairs a tensor's rows with samples (``flow.pairing``), its chains'
        records completed; where it carries the rows on (a view, an elementwise op with
        shared operands; an elementwise op merging such rows with another tensor's, some
        of them given a sample there), its output joins the chains; else the chains
        end."""
        for k, t, chains, rows in pending:
            live = tuple(c for c in chains if not c.dead)
            lay = layouts[k]
            if not live or not (isinstance(lay, Partly) and lay.rows is rows
                                and sum(u is t for u in leaves) == 1):
                _kill([(k, t, live)])
                continue
            pair = flow.pairing[k] if flow.pairing is not None else None
            carried = _carried(flow, out, leaves, lay.rows, broadcasts(func))
            if isinstance(pair, Batched) and pair.dim == lay.dim:
                for chain in live:
                    chain.complete(pair.moved(chain.own.dim))
                self.claims += 1
            elif carried:
                for o, at in carried:
                    entry = self._claimable.get(id(o))
                    more = entry[1] if entry is not None and entry[0] is o else ()
                    self._claimable[id(o)] = (o, more + live, False, at)
            else:
                _kill([(k, t, live)])

    def _param_write(self, target: Tensor, layout: Layout) -> bool:
        """Parameters written in place into a whole shared tensor (``w = buf.clone();
        w[:3] = p``, ``w.index_put_(idx, p)``): the tensor becomes a derived one, made by
        the write (replayed out of place from the value it overwrote; written again, the
        earlier value's cotangent goes to the op that made it, :attr:`Op.previous`). Not
        for a view (the base it writes into would not know) unless it is the whole of a
        base no op showed the capture (the product ``F.linear`` makes of a 3-d input,
        returned reshaped: Swin-v2's position-bias MLP, whose ReLU is in place), nor
        outside autograd."""
        if layout is not SHARED or not torch.is_grad_enabled() or not self._whole(target):
            return False
        self._written_into = target
        self.param_written[storage_of(target)] = target
        return True

    def _whole(self, t: Tensor) -> bool:
        """Is ``t`` all there is of its storage to the model: no view, or a view of all of
        a base that no recorded op made or read (made inside the op that returned ``t``),
        or that is itself derived (DeBERTa's projection of its position table, divided in
        place through its heads' view: the base, read again, is found changed since its
        op, :meth:`_sources`)?"""
        base = t._base
        if base is None:
            return True
        derived = self.derived.get(id(base))
        return (self.layouts.layout(base) is MISSING or (
            derived is not None and derived.tensor is base)) and t.numel() == base.numel() and (
            t.storage_offset() == base.storage_offset())

    def _base_written(self, view: Tensor, layout: Layout) -> None:
        """A slice of a shared tensor written in place with sample data (a key assembled
        by ``new_empty`` and ``k[..., :d].copy_(...)``, as DeepSeek's latent attention
        does): the base's layout after ``base[box] = data``, where the slice is a box of
        it, so that its other slices read as what they hold."""
        base = view._base
        if (base is None or layout is SHARED or not isinstance(layout, Batched)
                or self.layouts.layout(base) is not SHARED):
            return
        box = box_of(view, base)
        if box is None:
            return
        self.layouts[view] = layout
        found = written_layout(self.ctx, base, box, view)
        if isinstance(found, Batched):
            self.layouts[base] = found

    def _read_of_piece(self, func: Any, leaves: list, layouts: list) -> str | None:
        """Why reading one sample's piece into Python (``x[i].item()``, ``bool(x[i] >
        0)``) leaves the rules: the value may steer every sample's computation, which no
        layout shows (the loop gives each sample its own value); ``None`` if no leaf is
        its own piece."""
        for t, lay in zip(leaves, layouts):
            if isinstance(lay, Piece) and lay.ref is not None and lay.ref() is t:
                where = f", in module {self.stack[-1].describe()}" if self.stack else ""
                return (f"{name_of(func)} reads one sample's values into Python "
                        f"({lay.why}){where}")
        return None

    def _seen(self, t: Tensor) -> Layout:
        """``t``'s layout; a tensor the capture never saw made becomes Unknown, named
        with the module where it is first read."""
        lay = self.layouts.layout(t)
        if lay is not MISSING:
            return lay
        if self.constant(t) or KEPT.holds(t):  # (made before this call: no sample of it)
            self.layouts[t] = SHARED
            return SHARED
        where = f", first read in module {self.stack[-1].describe()}" if self.stack else ""
        lay = self.layouts[t] = Unknown(f"{MISSING.why}{where}")
        if not t.requires_grad and not t.is_inference():  # (made by code this call
            self._unseen.append(t)  # cannot see, in it perhaps: a later call reads it as
            # from before, Kept, unless written since: an inference tensor has no version)
        return lay

    def _record_op(self, func, args, kwargs, out, leaves, layouts, flow, sources, before,
                   draw) -> None:
        op = Op(func, args, kwargs, out, leaves, layouts, flow, sources,
                self.stack[-1] if self.stack else None, before=before, index=len(self.ops),
                draw=draw)
        op.sources_all = frozenset().union(*sources.values())
        op.autocast = autocast_state()
        op.versions = [t._version for t in leaves]
        outs, lays = op.outputs, op.out_layouts
        op.edges = [edge_of(o) for o in outs]
        op.claimed = self._claim(op.sources_all)
        if func not in _DETACHES and not any(o.requires_grad for o in outs) and any(
                o.is_floating_point() or o.is_complex() for o in outs) and (
                torch.is_grad_enabled() or _inside_function()):
            # read without autograd inside a custom autograd.Function, whose backward is
            # the gradient path; a .detach() or the user's torch.no_grad() makes a
            # constant by design: no gradient path
            self.unseen_reads |= op.sources_all
        self.ops.append(op)
        for k, (o, lay) in enumerate(zip(outs, lays)):
            if lay is SHARED and o.requires_grad and not any(o is t for t in leaves):
                self.derived[id(o)] = Derived(o, op, k, o._version)  # (x.to() may be x)
        target, self._written_into = self._written_into, None
        if target is not None and target.requires_grad:  # its new value is this op's
            earlier = self.derived.get(id(target))
            if earlier is not None and earlier.tensor is target and 0 in op.sources:
                op.previous = earlier  # (kept under its own id: the pullback's key)
                self.derived[id(earlier)] = earlier
            self.derived[id(target)] = Derived(target, op, 0, target._version)
        if _row_wise_partly(op, layouts):
            entry = self._claimable.get(id(out))
            more = entry[1] if entry is not None and entry[0] is out else ()
            self._claimable[id(out)] = (out, more + (_Chain(op, op.flow.outputs),), False,
                                        op.flow.outputs.rows)
        op.record_output(out)

    def _claim(self, pids: frozenset[int]) -> Call | None:
        """The innermost module-rule call under way that holds one of these parameters."""
        for call in reversed(self.stack):
            if call.rule is not None and any(
                    id(p) in pids for _, p in call.rule.spec.params(call.module)):
                return call
        return None

    # -- derived tensors --------------------------------------------------------

    def _sources(self, leaves: list) -> dict[int, frozenset[int]]:
        """Leaf position -> the watched parameters it comes from (itself, or a derived
        tensor's)."""
        found = {}
        watched, derived = self.watched, self.derived
        for k, t in enumerate(leaves):
            key = id(t)
            if watched.get(key) is t:
                found[k] = frozenset((key,))
                continue
            if self.param_written and id(t) not in derived and (
                    written := self.param_written.get(storage_of(t))) is not None:
                d = derived.get(id(written))  # an alias of a tensor parameters were written
                if d is not None:  # into: its value is not an op's the capture followed
                    self.unseen_reads |= d.op.sources_all
            if derived:
                d = derived.get(key)
                if d is not None and d.tensor is t:
                    with torch._C.DisableTorchFunction():
                        stale = t._version != d.version
                    if not stale:
                        found[k] = d.op.sources_all
                    elif self.layouts.layout(t) is SHARED:  # changed in place since its op
                        # made it (through any alias): that op no longer made what is read
                        found[k] = d.op.sources_all
                        self.unseen_reads |= d.op.sources_all
                    # else an in-place op wrote sample data into it since: what is read is
                    # that op's output, followed from its own gradient edge
        return found

    def _unexpanded(self, t: Tensor) -> Tensor | None:
        """The tensor a derived ``t`` repeats along new or size-1 dims (``bias.expand(B,
        H, T, T)``, ``cls.repeat(B, 1, 1)``, ``pos.expand_as(x)``), if neither changed
        since: ``t`` is it broadcast, entry for entry. An op that broadcasts ``t`` anyway
        reads it instead (:func:`persample.batch.flow.unbroadcast`): its per-sample
        cotangent then has that tensor's shape, shared by the samples, and the op's own
        backward gives it, where ``t``, as wide as the batch, would need one row per
        sample of a per-sample VJP."""
        found = None
        while True:
            d = self.derived.get(id(t))
            if (d is None or d.tensor is not t or d.op.func not in _WIDENINGS
                    or 0 not in d.op.sources or t._version != d.version or d.op.changed()):
                return found
            src = d.op.args[0]
            if src.dim() == 0 or src.dtype != t.dtype or not _broadcasts(src.shape, t.shape):
                return found  # (a 0-dim tensor would change the type promotion)
            found = t = src


def _kept_inside(call: Call, func: Any, leaves: list) -> bool:
    """Is this op of an unfollowed call one its module rule may read (:class:`Inner`)?"""
    own = call.own
    for t in leaves:
        if id(t) in own or (t._base is not None and id(t._base) in own):
            return True
    return func is _GETITEM and id(leaves[0]) in call.inputs


_GETITEM = torch.Tensor.__getitem__
_SETITEM = torch.Tensor.__setitem__


def _any_mixed(outputs: Any) -> bool:
    return any(isinstance(lay, Mixed) for lay in (outputs if isinstance(outputs, tuple)
                                                  else (outputs,)))


def _mixed_here(outputs: Any, leaves: list, layouts: list[Layout], mixed: set[int]) -> bool:
    """Is an op's output mixed by the loss itself: by this op (no input mixed), or from
    an input the loss mixed (not from a model output in which samples are mixed)?"""
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    if not any(isinstance(lay, Mixed) for lay in outs):
        return False
    ins = [t for t, lay in zip(leaves, layouts) if isinstance(lay, Mixed)]
    return not ins or any(id(t) in mixed for t in ins)


def _mixes(func: Any, outputs: Any, leaves: list, layouts: list[Layout], mixed: set[int]
           ) -> str | None:
    """Does this op of the loss make terms that mix samples (SimCLR's similarities of
    every pair, ``z - z.mean(0)``)? The op and why, or ``None``. A reduction over the
    batch to a number (a mean of per-sample terms) does not; an output of the model in
    which samples are mixed is the model's matter (``mixed``: the tensors the loss's own
    ops mixed)."""
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    made = next((lay for lay in outs if isinstance(lay, Mixed)), None)
    if made is None:
        return None
    if "pairs samples" in made.why and not any(isinstance(lay, Mixed) for lay in layouts):
        return f"{name_of(func)} ({made.why})"
    widened = [t for t, lay in zip(leaves, layouts)
               if isinstance(lay, Mixed) and t.dim() > 0 and id(t) in mixed]
    if widened and any(isinstance(lay, Batched) for lay in layouts):
        return f"{name_of(func)} (combines each sample with a result over the batch)"
    return None


def _broadcasts(small: torch.Size, big: torch.Size) -> bool:
    """``small`` broadcasts to ``big`` (right-aligned, each dim equal or 1)."""
    if len(small) > len(big):
        return False
    return all(a == b or a == 1 for a, b in zip(reversed(small), reversed(big)))


def box_of(view: Tensor, base: Tensor) -> tuple | None:
    """The slices ``box`` with ``base[box]`` the same view as ``view`` (same offset, shape
    and strides), where ``view`` keeps ``base``'s strides; ``None`` else."""
    if view.dim() != base.dim() or view.stride() != base.stride() or any(
            s1 < s2 for s1, s2 in zip(base.stride(), base.stride()[1:])):
        return None
    offset, box = view.storage_offset() - base.storage_offset(), []
    for size, whole, stride in zip(view.shape, base.shape, base.stride()):
        start = offset // stride if stride else 0
        offset -= start * stride
        if start + size > whole:
            return None
        box.append(slice(None) if size == whole else slice(start, start + size))
    return tuple(box) if offset == 0 else None


def _row_wise_partly(op: Op, layouts: list[Layout]) -> bool:
    """Is the op row-wise along rows of no sample it carried from an input (its one output
    a :class:`Partly` with the very rows of an input's, pairing nothing itself)?"""
    own = op.flow.outputs
    return (isinstance(own, Partly) and op.flow.pairing is None and len(op.outputs) == 1
            and own.ref is not None and own.ref() is op.output and any(
                isinstance(lay, Partly) and lay.rows is own.rows for lay in layouts))


@dataclass(eq=False)
class _Chain:
    """A recorded row-wise op whose output's rows of no sample may take the samples their
    one reader pairs them with (see the module docstring)."""

    op: Op
    own: Partly  # the op's output layout: the chain's rows
    saved: tuple | None = None  # (layouts, flow) of the record before it was completed
    dead: bool = False

    def complete(self, pair: Batched) -> None:
        """The record's output, and the inputs whose rows it carried, paired as ``pair``
        (in the output's dims) pairs them."""
        op = self.op
        if self.dead:
            return
        if self.saved is not None:  # (a second piece of the rows paired: alike, or none)
            if pair != op.flow.outputs:
                self.kill()
            return
        self.saved = (op.layouts, op.flow)
        op.layouts = [pair.moved(lay.dim) if isinstance(lay, Partly)
                      and lay.rows is self.own.rows else lay for lay in op.layouts]
        op.flow = Flow(pair, op.flow.pairing, op.flow.writes)

    def kill(self) -> None:
        """No sample for the rows: the record as it was."""
        if self.saved is not None:
            self.op.layouts, self.op.flow = self.saved
            self.saved = None
        self.dead = True


def _carried(flow: Flow, out: Any, leaves: list, rows: Tensor, aligned: bool = False
             ) -> list[tuple[Tensor, Tensor]]:
    """The outputs of an op that carries the rows ``rows`` on to each of them, with the
    rows of no sample each holds (``(output, its rows)``), else none: a view, ``chunk``
    of another dim, an elementwise op with shared operands (each output a
    :class:`Partly` of those very rows, the op pairing nothing); ``aligned`` (an
    elementwise op: its output's positions are its inputs'), an output of as many rows
    that another input's samples filled in part (``RGCNConv``'s sum of its relations'
    means)."""
    outs = [out] if isinstance(out, Tensor) else list(out) if isinstance(
        out, (tuple, list)) else []
    lays = flow.outputs if isinstance(flow.outputs, tuple) else (flow.outputs,)
    if (flow.pairing is not None or not outs or len(outs) != len(lays)
            or any(not isinstance(o, Tensor) or any(o is u for u in leaves) for o in outs)):
        return []
    if not all(isinstance(lay, Partly) and lay.ref is not None and lay.ref() is o
               for o, lay in zip(outs, lays)):
        return []
    if all(lay.rows is rows for lay in lays):
        return [(o, rows) for o in outs]
    if aligned and len(outs) == 1 and lays[0].rows.shape == rows.shape:
        return [(outs[0], lays[0].rows)]
    return []


def _kill(pending: list | None) -> None:
    for item in pending or ():
        for chain in item[2]:
            chain.kill()
