"""Record one forward pass: where the samples are in every tensor, and every op
that reads a trainable parameter.

Inside the ``with`` block, a ``TorchFunctionMode``
sees every op of the forward:

- it decides the layout of every output from the layouts of the inputs
  (:func:`persample.batch.propagate`), starting from the model's inputs (their
  per-sample tensors batched in dim 0, the rest shared), its parameters and
  buffers (shared), so the samples are followed by data flow;
- an op reading a watched parameter, directly or through *derived* tensors
  (shared tensors computed from parameters: ``W.t()``, ``pos[:, :T]``, a position
  embedding looked up with ``arange`` ids) is recorded as an :class:`Op`. If its
  output carries samples it is a *use*: its per-sample gradient comes from that
  op's rule, with the backprops of its output. Otherwise its output is derived,
  and the op is pulled back later from the per-sample cotangents its consumers give.
  A derived tensor widened to the batch (``bias.expand(B, H, T, T)``) is read as the
  tensor it widens by the ops that broadcast it anyway. Parameter data written in
  place into a shared tensor, and a derived tensor read after it changed in place, are
  reads the rules cannot follow (``unseen_reads``): no recorded op made what is read.
- each use keeps the :class:`~torch.autograd.graph.GradientEdge` of its output,
  taken right after the op: the gradient flowing into the node that produced it,
  which stays valid when the output is later modified in place
  (``nn.ReLU(inplace=True)``, ``out += identity``).

Forward hooks on every module keep the stack of module calls (for names, module
rules and the per-module fallback). A module with a module rule (the recurrent
layers) *claims* the ops reading its own parameters inside its call.

State lives in the :class:`Capture` object, never on the model, and the hooks
exist only inside the ``with`` block: they are removed in ``finally``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .batch import (
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
from .batch.flow import name_of, unbroadcast
from .batch.ops_indexing import setitem_layout
from .errors import raise_internal
from .precision import AutocastState, autocast_state


@dataclass(eq=False)
class Call:
    """One call of one module during the captured forward."""

    name: str  # qualified name of the module in the model ("" for the root)
    module: nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: Any = None
    parent: Call | None = None
    rule: Any = None  # the module's module rule (rules.ModuleRule), if it has one
    versions: list[int] = field(default_factory=list)  # of its input tensors, at the call
    edges: list[Edge | None] = field(default_factory=list)  # per output tensor
    autocast: AutocastState | None = None  # the autocast state it ran under

    def describe(self) -> str:
        return f"'{self.name or '<root>'}' ({type(self.module).__name__})"


@dataclass(eq=False)
class Op:
    """One op that reads watched parameters (directly or through derived tensors)."""

    func: Any
    args: tuple
    kwargs: dict
    output: Any
    leaves: list[Tensor]  # op_leaves(args, kwargs)
    layouts: list[Layout]  # of the leaves, when the op ran
    flow: Flow  # the layouts of its outputs, and how it pairs its inputs with samples
    sources: dict[int, frozenset[int]]  # leaf position -> ids of the params it comes from
    call: Call | None  # the innermost module call under way
    edges: list[Edge | None] = field(default_factory=list)  # per output tensor
    versions: list[int] = field(default_factory=list)  # of the leaves, after the op
    before: Tensor | None = None  # the value of an input the op overwrote in place
    claimed: Call | None = None  # a module-rule call that owns its parameters
    index: int = 0  # creation order
    sources_all: frozenset[int] = frozenset()  # every parameter it reads
    autocast: AutocastState | None = None  # the autocast state it ran under
    gather: Callable[[list[Tensor]], None] | None = None  # makes freed leaves readable (FSDP)

    @property
    def outputs(self) -> list[Tensor]:
        out = self.output
        if isinstance(out, Tensor):
            return [out]
        return [o for o in out if isinstance(o, Tensor)] if isinstance(out, (tuple, list)) else []

    @property
    def out_layouts(self) -> list[Layout]:
        lays = self.flow.outputs
        lays = list(lays) if isinstance(lays, tuple) else [lays]
        out = self.output
        items = list(out) if isinstance(out, (tuple, list)) else [out]
        return [lay for o, lay in zip(items, lays) if isinstance(o, Tensor)]

    def pairing(self, k: int) -> Layout | None:
        """How leaf ``k`` pairs with the samples: a batched layout, or ``None`` (shared)."""
        if self.flow.pairing is not None:
            return self.flow.pairing[k]
        lay = self.layouts[k]
        return lay if isinstance(lay, Batched) else None

    def value(self, k: int) -> Tensor:
        """Leaf ``k`` as the op read it (the saved value if the op overwrote it)."""
        if k == 0 and self.before is not None:
            return self.before
        return self.leaves[k]

    def ready(self) -> None:
        """Before the op is replayed: a sharded model's parameters it read, which FSDP
        freed after use, gathered again (rules read their shapes only)."""
        if self.gather is not None:
            self.gather(self.leaves)

    def changed(self) -> bool:
        """Was a leaf modified in place after the op ran?"""
        return any(t._version != v for t, v in zip(self.leaves, self.versions))

    def where(self) -> str:
        name = getattr(self.func, "__name__", repr(self.func))
        return f"{name} in module {self.call.describe()}" if self.call else name


@dataclass(eq=False)
class Derived:
    """A shared tensor computed from watched parameters, and the op that made it."""

    tensor: Tensor
    op: Op
    out: int  # which output of op
    version: int = 0  # the tensor's, when the op made it


class _Layouts:
    """Layouts by tensor identity, holding no tensor alive: ``id -> (weak ref, layout)``,
    an entry valid while its tensor lives (a dead tensor's id may be reused). A plain
    dict of weak references: several times cheaper per op than ``WeakIdKeyDictionary``."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, Layout]] = {}
        # storages of shared tensors written with samples, kept alive (so that no new tensor
        # is allocated at their address during the capture)
        self.contaminated: dict[int, Any] = {}

    def get(self, t: Tensor) -> Layout | None:
        entry = self._by_id.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def __setitem__(self, t: Tensor, layout: Layout) -> None:
        self._by_id[id(t)] = (weakref.ref(t), layout)

    def layout(self, t: Tensor) -> Layout:
        """``t``'s layout (:data:`_MISSING` if never set; a shared tensor whose storage was
        later written with sample data is Unknown)."""
        entry = self._by_id.get(id(t))
        if entry is None or entry[0]() is not t:
            return _MISSING
        lay = entry[1]
        if lay is SHARED and self.contaminated and _storage(t) in self.contaminated:
            return Unknown("a shared tensor later written in place with per-sample data")
        return lay


_MISSING = Unknown("a tensor made outside the captured ops (a custom autograd Function, "
                   "TorchScript, or a tensor kept from before)")


class _Mode(TorchFunctionMode):
    def __init__(self, capture: Capture):
        super().__init__()
        self.capture = capture
        self.expansions = capture.expansions  # (read per op: not through the proxy)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cap = self.capture
        if threading.get_ident() != cap.thread:
            return func(*args, **kwargs)
        expansion = self.expansions.get(func) if self.expansions else None
        if expansion is not None:
            failed = None
            try:
                with self:
                    out = expansion(*args, **kwargs)
            except Exception as err:
                failed = err
            if failed is not None:
                with torch._C.DisableTorchFunction():
                    func(*args, **kwargs)  # the op itself raises too: the user's error
                raise_internal(failed, f"the expansion of {name_of(func)}")
            if out is not NotImplemented:
                return out
        return cap.record(func, args, kwargs)


def _hidden(fn: Callable) -> Callable:
    """``fn`` hidden from TorchDynamo where ``torch.compile`` is in use (its module is
    loaded): a compiled module's forward under a capture then runs the capture's own
    work as plain Python between its graphs, instead of tracing it and recompiling it
    for every capture (``torch._dynamo.disable``)."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo.disable(fn) if dynamo is not None else fn


_HIDDEN_MODE: list[type] = []


def _must_hide() -> bool:
    """Must the capture's own code be hidden from TorchDynamo now? Once ``torch.compile``
    is in use, unless compiled code runs eagerly anyway (an open capture set that
    stance: see :class:`_WhileCapturing`); hiding costs a few microseconds per op."""
    return "torch._dynamo" in sys.modules and _WhileCapturing.stance is None


def _mode_class(hide: bool) -> type:
    """``_Mode``, or with ``hide``, ``_Mode`` with its ``__torch_function__`` hidden from
    TorchDynamo."""
    if not hide or "torch._dynamo" not in sys.modules:
        return _Mode
    if not _HIDDEN_MODE:
        _HIDDEN_MODE.append(type("_HiddenMode", (_Mode,), {
            "__torch_function__": _hidden(_Mode.__torch_function__)}))
    return _HIDDEN_MODE[0]


class _WhileCapturing:
    """What a capture changes outside itself while any capture is open (counted over
    threads, undone when the last one closes):

    - ``torch.utils.checkpoint``'s reentrant form (``use_reentrant=True``: a custom
      ``autograd.Function`` that runs the function under ``no_grad`` and runs it again
      in the backward) runs the function as it is, with autograd, in a capturing
      thread: the capture then sees its ops with their gradient edges, and the backward
      needs no second forward (which ``torch.autograd.grad`` refuses). Its gradients
      are the checkpoint's: those of the function where an input requires grad; where
      none does, the checkpoint itself runs (no gradient reaches inside). Other threads
      get the original.
    - once ``torch.compile`` is in use, compiled code runs eagerly
      (``torch.compiler.set_stance("force_eager")``): the capture must see every op,
      and TorchDynamo must not trace the capture's own work (``fullgraph=True`` would
      refuse the graph breaks); compiled code in other threads runs eagerly meanwhile.
    """

    lock = threading.Lock()
    local = threading.local()
    users = 0
    saved: Any = None
    stance: Any = None

    @classmethod
    def enter(cls) -> None:
        cls.local.depth = getattr(cls.local, "depth", 0) + 1
        with cls.lock:
            cls.users += 1
            if cls.users == 1:
                from torch.utils.checkpoint import CheckpointFunction

                cls.saved = CheckpointFunction.__dict__.get("apply")
                original = CheckpointFunction.apply
                CheckpointFunction.apply = classmethod(
                    lambda _, *args: cls.run(original, *args))
                if "torch._dynamo" in sys.modules:
                    try:
                        cls.stance = torch.compiler.set_stance("force_eager")
                    except RuntimeError:  # inside a compiled region: the hidden mode copes
                        cls.stance = None

    @classmethod
    def exit(cls) -> None:
        cls.local.depth -= 1
        with cls.lock:
            cls.users -= 1
            if cls.users == 0:
                from torch.utils.checkpoint import CheckpointFunction

                if cls.saved is None:
                    del CheckpointFunction.apply
                else:
                    CheckpointFunction.apply = cls.saved
                if cls.stance is not None:
                    cls.stance.__exit__(None, None, None)
                    cls.stance = None

    @classmethod
    def run(cls, original: Callable, function: Callable, preserve_rng_state: bool, *args):
        if (getattr(cls.local, "depth", 0) and torch.is_grad_enabled()
                and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            return function(*args)
        return original(function, preserve_rng_state, *args)


@contextmanager
def plain_checkpoints() -> Iterator[None]:
    """Inside: reentrant checkpoints run their function as it is, as during a capture
    (see :class:`_WhileCapturing`), so that the loop and ``torch.func`` can differentiate
    a model that uses them (``torch.autograd.grad`` and ``vmap`` refuse the reentrant
    checkpoint's second forward); the gradients are the checkpoint's."""
    _WhileCapturing.enter()
    try:
        yield
    finally:
        _WhileCapturing.exit()


def _holders(model: nn.Module, watched: dict[int, Tensor]) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the modules holding a watched parameter at any
    depth, in ``named_modules()`` order; one walk of the tree (``named_parameters`` per
    module would walk it again for each)."""
    found: list[tuple[str, nn.Module] | None] = []
    seen: set[int] = set()

    def walk(name: str, module: nn.Module) -> bool:
        first, slot = id(module) not in seen, len(found)
        if first:
            seen.add(id(module))
            found.append(None)
        holds = any(id(p) in watched for p in module._parameters.values() if p is not None)
        for key, child in module._modules.items():
            if child is not None and walk(f"{name}.{key}" if name else key, child):
                holds = True
        if first and holds:
            found[slot] = (name, module)
        return holds

    walk("", model)
    return [entry for entry in found if entry is not None]


def _storage(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


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
        expansions: ``{func: fn}``, ops run as their decomposition ``fn(*args,
            **kwargs)`` under the capture (``fn`` returns ``NotImplemented`` to leave a
            call whole); the engine passes :data:`persample.rules.registry.EXPANSIONS`.
        constant: ``constant(t)`` for a tensor the capture never saw made: is it shared
            (made before the call, so shared by every sample) rather than unknown (made
            by code the capture cannot see, from sample data perhaps)? Default
            :func:`user_leaf`.

    After the block: ``ops`` (every op reading a watched parameter, in order),
    ``derived`` (id of a derived tensor -> :class:`Derived`), ``calls`` (finished
    module calls), ``layout(t)`` for any tensor, ``unseen_reads`` (parameters read
    by ops without autograd: a gradient path the capture cannot see).

    Example:
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
                 expansions: dict[Any, Callable] | None = None):
        self.model, self.watched, self.n = model, watched, n
        self.constant = constant or user_leaf
        self.expansions = expansions or {}
        self.layouts = _Layouts()
        self.derived: dict[int, Derived] = {}
        self.ops: list[Op] = []
        self.calls: list[Call] = []
        self.stack: list[Call] = []
        self.unseen_reads: set[int] = set()
        self.contaminated = self.layouts.contaminated
        self.thread = threading.get_ident()
        # no reference cycle back to the capture (its graph would live until the cyclic
        # GC runs: gigabytes in a training loop of many micro-batches)
        self.ctx = Ctx(n, self.layouts.layout)
        self._module_rule = module_rule
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._mode: TorchFunctionMode | None = None  # made on entering
        for t in self._free_tensors(model, shared):
            self.layouts[t] = SHARED
        for item in batched:
            t, lay = item if isinstance(item, tuple) else (item, Batched(0))
            self.layouts[t] = lay

    def add_inputs(self, located: list[tuple[Tensor, Layout]]) -> None:
        """More tensors whose samples are known (the loss's targets)."""
        for t, lay in located:
            self.layouts[t] = lay

    @contextmanager
    def follow(self) -> Iterator[None]:
        """Inside: ops are followed (layouts) as during the forward, without the module
        hooks (the loss, after the model's forward)."""
        mode = _mode_class(_must_hide())(weakref.proxy(self))
        mode.__enter__()
        try:
            yield
        finally:
            mode.__exit__(None, None, None)
        self._stale_derived()

    @staticmethod
    def _free_tensors(model: nn.Module | None, shared: tuple) -> list[Tensor]:
        """The model's parameters and buffers, the tensors its modules hold as attributes
        (also in lists, tuples and dicts: masks, constants, caches made before the call),
        and the shared inputs."""
        found = [t for t in tree_leaves(shared) if isinstance(t, Tensor)]
        if model is None:
            return found
        for m in model.modules():
            found += [t for t in m._parameters.values() if t is not None]
            found += [t for t in m._buffers.values() if t is not None]
            for key, value in vars(m).items():
                if key in _INTERNALS or type(value) in _PLAIN:
                    continue
                if isinstance(value, Tensor):
                    found.append(value)
                elif isinstance(value, (list, tuple, dict)) and value:
                    found += _held_tensors(value)
        return found

    # -- layouts --------------------------------------------------------------

    def layout(self, t: Tensor) -> Layout:
        """The layout of ``t``; a tensor the capture never saw created is Unknown."""
        return self.layouts.layout(t)

    # -- the context manager --------------------------------------------------

    def __enter__(self) -> Capture:
        _WhileCapturing.enter()
        try:
            hide = _must_hide()  # (after the stance is set)
            # a module with no trainable parameter inside is not hooked: its parent's call
            # stands for it
            holders = _holders(self.model, self.watched) if self.model is not None else []
            post = _hidden(self._post_hook) if hide else self._post_hook
            for name, module in holders:
                pre = self._pre_hook(name)
                self._handles.append(module.register_forward_pre_hook(
                    _hidden(pre) if hide else pre, with_kwargs=True))
                self._handles.append(module.register_forward_hook(post, with_kwargs=True))
            self._mode = _mode_class(hide)(weakref.proxy(self))
            self._mode.__enter__()
        except BaseException:
            self._remove()
            _WhileCapturing.exit()
            raise
        return self

    def __exit__(self, _type, exc, _tb) -> None:
        try:
            self._mode.__exit__(None, None, None)
        finally:
            try:
                _WhileCapturing.exit()
            finally:
                self._remove()
        self._stale_derived()
        if exc is not None and self.stack:  # raised inside a module's forward: name it
            exc.add_note(where(self.stack[-1], exc))

    def _stale_derived(self) -> None:
        """A derived tensor whose op's inputs changed in place since the op ran (through
        any alias: a view, a ``detach()``) cannot be pulled back through that op, which
        would read their new values: its parameters' reads cannot be followed. (A derived
        tensor read after it changed is caught where it is read, :meth:`_sources`.)"""
        with torch._C.DisableTorchFunction():  # reading versions is no op of the model
            for d in self.derived.values():
                if d.op.changed():
                    self.unseen_reads |= d.op.sources_all

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

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, name: str):
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if threading.get_ident() != self.thread:
                return
            try:
                rule = self._module_rule(module) if self._module_rule else None
                call = Call(name, module, args, kwargs, rule=rule,
                            parent=self.stack[-1] if self.stack else None,
                            autocast=autocast_state())
                with torch._C.DisableTorchFunction():  # reading tensors here is no op of
                    call.versions = [t._version for t in _tensor_leaves((args, kwargs))]
            except Exception as err:
                raise_internal(err, f"the call of module '{name or '<root>'}'")
            self.stack.append(call)

        return pre_hook

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        call = self.stack.pop()
        try:
            call.output = output
            with torch._C.DisableTorchFunction():  # reading tensors here is no op of the model
                call.edges = [_edge(t) for t in _tensor_leaves(output)]
        except Exception as err:
            raise_internal(err, f"the output of module {call.describe()}")
        self.calls.append(call)

    # -- ops ------------------------------------------------------------------

    def record(self, func, args: tuple, kwargs: dict) -> Any:
        """Run one op (the model's own: its errors propagate as they are); record its
        outputs' layouts, and the op if it reads parameters (persample's work: an error
        there is an :class:`~persample.errors.InternalError` naming the op)."""
        try:
            leaves = op_leaves(args, kwargs)
            sources = self._sources(leaves)
            if sources:  # a derived tensor the op broadcasts anyway: its narrow form
                narrowed = unbroadcast(func, args, kwargs, self._unexpanded)
                if narrowed is not None:
                    args, kwargs = narrowed
                    leaves = op_leaves(args, kwargs)
                    sources = self._sources(leaves)
            layouts = [self._seen(t) for t in leaves]
            mutates = in_place(func, kwargs)
            before = None
            if sources and mutates and leaves and leaves[0] is args[0] and 0 not in sources:
                before = args[0].detach().clone()  # the rule needs the value it overwrites
        except Exception as err:
            raise_internal(err, f"the capture of {name_of(func)}")
        out = func(*args, **kwargs)
        try:
            return self._follow(func, args, kwargs, out, leaves, layouts, sources, mutates,
                                before)
        except Exception as err:
            raise_internal(err, f"the data flow of {name_of(func)}")

    def _follow(self, func, args, kwargs, out, leaves, layouts, sources, mutates, before
                ) -> Any:
        """The layouts of an op's outputs, and the op recorded if it reads parameters."""
        if func is torch.Tensor.__setitem__:
            self._set_layout(args[0], self._setitem(args), None)
            if sources:  # a parameter written into a tensor: no rule follows it
                self.unseen_reads |= frozenset().union(*sources.values())
            return out
        if not _has_tensor(out):
            return out
        flow = propagate(self.ctx, func, args, kwargs, out, layouts)
        if self.stack and _new_trouble(flow.outputs, layouts):
            flow = Flow(_located_in(flow.outputs, self.stack[-1]), flow.pairing, flow.writes)
        target = kwargs.get("out") if isinstance(kwargs.get("out"), Tensor) else (
            args[0] if mutates and args and isinstance(args[0], Tensor) else None)
        if target is not None and isinstance(out, Tensor):
            self._set_layout(target, flow.outputs, out)
            if sources and flow.outputs is SHARED:  # parameters written into a shared tensor:
                # what shares its storage no longer holds what the ops that made it computed
                self.unseen_reads |= frozenset().union(*sources.values())
        else:
            self._set_outputs(out, flow.outputs)
        for t, lay in flow.writes:  # other inputs the op overwrote (running statistics)
            self._set_layout(t, lay, None)
        if sources:
            self._record_op(func, args, kwargs, out, leaves, layouts, flow, sources, before)
        return out

    def _seen(self, t: Tensor) -> Layout:
        """``t``'s layout; a tensor the capture never saw made becomes Unknown, named
        with the module where it is first read."""
        lay = self.layouts.layout(t)
        if lay is not _MISSING:
            return lay
        if self.constant(t):
            self.layouts[t] = SHARED
            return SHARED
        where = f", first read in module {self.stack[-1].describe()}" if self.stack else ""
        lay = self.layouts[t] = Unknown(f"{_MISSING.why}{where}")
        return lay

    def _sources(self, leaves: list) -> dict[int, frozenset[int]]:
        found = {}
        watched, derived = self.watched, self.derived
        for k, t in enumerate(leaves):
            key = id(t)
            if watched.get(key) is t:
                found[k] = frozenset((key,))
            elif derived:
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

    def _set_outputs(self, out: Any, layouts: Any) -> None:
        if isinstance(out, Tensor):
            self.layouts[out] = layouts
        elif isinstance(out, (tuple, list)):
            lays = layouts if isinstance(layouts, tuple) else (layouts,) * len(out)
            for o, lay in zip(out, lays):
                if isinstance(o, Tensor):
                    self.layouts[o] = lay

    def _set_layout(self, target: Tensor, layout: Layout, out: Tensor | None) -> None:
        """An in-place op changed ``target``'s data: its new layout (aliases of a shared
        tensor that now holds sample data are marked too)."""
        old = self.layout(target)
        if old is SHARED and layout is not SHARED:
            self.contaminated[_storage(target)] = target.untyped_storage()
        self.layouts[target] = layout
        if out is not None and out is not target:
            self.layouts[out] = layout

    def _setitem(self, args: tuple) -> Layout:
        """``x[index] = value``: ``x`` keeps its layout if the value's samples land where
        ``x``'s are (or the value is shared); else it becomes Unknown."""
        x, index, value = args[0], args[1], args[2]
        found = setitem_layout(self.ctx, x, index, value)  # an index tensor on the batch dim
        if found is not None:
            return found
        lx = self.layout(x)
        lv = self.layout(value) if isinstance(value, Tensor) else SHARED
        if lv.shared or not lx.known:
            return lx
        if not lv.known:
            return lv
        if isinstance(lx, Batched):
            with torch._C.DisableTorchFunction():
                view = x[index]
            got = propagate(self.ctx, torch.Tensor.__getitem__, (x, index), {}, view).outputs
            if isinstance(got, Batched) and got == lv.moved(lv.dim + view.dim() - value.dim()):
                return lx
        return Unknown("a tensor written in place with per-sample data at other positions")

    def _record_op(self, func, args, kwargs, out, leaves, layouts, flow, sources, before) -> None:
        op = Op(func, args, kwargs, out, leaves, layouts, flow, sources,
                self.stack[-1] if self.stack else None, before=before, index=len(self.ops))
        op.sources_all = frozenset().union(*sources.values())
        op.autocast = autocast_state()
        op.versions = [t._version for t in leaves]
        outs, lays = op.outputs, op.out_layouts
        op.edges = [_edge(o) for o in outs]
        op.claimed = self._claim(op.sources_all)
        if not any(o.requires_grad for o in outs) and any(
                o.is_floating_point() or o.is_complex() for o in outs):
            self.unseen_reads |= op.sources_all  # read without autograd (or only .detach())
        self.ops.append(op)
        for k, (o, lay) in enumerate(zip(outs, lays)):
            if lay is SHARED and o.requires_grad and not any(o is t for t in leaves):
                self.derived[id(o)] = Derived(o, op, k, o._version)  # (x.to() may be x)
        op.output = _shapes_only(out, op.flow.outputs)


    def _claim(self, pids: frozenset[int]) -> Call | None:
        """The innermost module-rule call under way that holds one of these parameters."""
        for call in reversed(self.stack):
            if call.rule is not None and any(
                    id(p) in pids for p in call.module.parameters(recurse=False)):
                return call
        return None


def _shapes_only(out: Any, layouts: Any) -> Any:
    """An op's output with each tensor carrying samples replaced by a stand-in of its
    shape, strides and dtype on the meta device: what comes later reads its gradient
    (through its edge) and its layout, never its values, and the values (GPT-2's
    logits: ``(B, T, 50257)``) are freed as in a plain step."""
    if isinstance(out, Tensor):
        if not isinstance(layouts, Batched):
            return out
        return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
    if isinstance(out, (tuple, list)) and isinstance(layouts, tuple) and len(out) == len(
            layouts):
        return type(out)(_shapes_only(o, lay) for o, lay in zip(out, layouts)) \
            if type(out) in (tuple, list) else out
    return out


# what nn.Module keeps in its instance dict (parameters and buffers are read on their own)
_INTERNALS = frozenset(vars(nn.Module()))

# ops whose output is their first argument repeated along new or size-1 dims, where its
# shape broadcasts to the output's
_WIDENINGS = frozenset(f for f in (
    torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to, torch.Tensor.broadcast_to,
    torch.Tensor.repeat, torch.tile, torch.Tensor.tile) if f is not None)


def _broadcasts(small: torch.Size, big: torch.Size) -> bool:
    """``small`` broadcasts to ``big`` (right-aligned, each dim equal or 1)."""
    if len(small) > len(big):
        return False
    return all(a == b or a == 1 for a, b in zip(reversed(small), reversed(big)))


def user_leaf(t: Tensor) -> bool:
    """A leaf tensor that requires grad, or a parameter: made by the user, never computed
    (from sample data or anything else), so shared by every sample (FSDP2 gathers a
    sharded model's parameters, frozen ones too, into new parameters in the forward)."""
    return (t.requires_grad or isinstance(t, nn.Parameter)) and t.grad_fn is None


def _new_trouble(outputs: Any, inputs: list[Layout]) -> bool:
    """An output mixes samples or loses them here, and no input did already."""
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    if all(isinstance(o, tuple) or o.known for o in outs):  # (a nested output: left alone)
        return False
    return all(lay.known for lay in inputs)


def _located_in(outputs: Any, call: Call) -> Any:
    """The layouts, with the module the trouble started in named in their reason."""
    if isinstance(outputs, tuple):
        return tuple(_located_in(o, call) for o in outputs)
    if isinstance(outputs, (Mixed, Unknown)):  # (replace keeps a subclass's fields)
        return dataclasses.replace(outputs, why=f"{outputs.why}, in module {call.describe()}")
    return outputs


_PLAIN = (int, float, bool, str, type(None))


def _held_tensors(value: Any, depth: int = 3) -> list[Tensor]:
    """The tensors in nested lists, tuples and dicts (a module attribute), to ``depth``."""
    if isinstance(value, Tensor):
        return [value]
    if depth == 0 or not isinstance(value, (list, tuple, dict)):
        return []
    items = value.values() if isinstance(value, dict) else value
    return [t for item in items for t in _held_tensors(item, depth - 1)]


def _tensor_leaves(tree: Any) -> list[Tensor]:
    """The tensors of ``tree`` in ``tree_leaves`` order. Module inputs and outputs are
    mostly a tensor, or plain tuples, lists and dicts of tensors and numbers: those are
    walked here, several times faster than the general pytree walk, which takes the rest."""
    if isinstance(tree, Tensor):
        return [tree]
    found: list[Tensor] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is tuple or kind is list:
            items = node
        elif kind is dict:
            items = list(node.values())
        else:
            return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]
        for item in reversed(items):  # depth first, in order
            if isinstance(item, Tensor):
                stack.append(item)
            elif type(item) in (tuple, list, dict):
                stack.append(item)
            elif not isinstance(item, _PLAIN):
                return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]
        while stack and isinstance(stack[-1], Tensor):
            found.append(stack.pop())
    return found


def _has_tensor(out: Any) -> bool:
    if isinstance(out, Tensor):
        return True
    return isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out)


@dataclass(frozen=True, eq=False)
class Edge:
    """Where the gradient of a captured output is read: the autograd edge of the node
    that produced it. An output that is a view of a non-leaf base (``F.linear`` on a
    sequence returns one) is read through its base's edge and its place in the base's
    storage: an in-place op through another view of the base later re-bases the view's
    own node out of the graph, never the base's."""

    edge: GradientEdge
    view: tuple | None = None  # base (shape, stride, span), view (shape, stride, offset)

    def take(self, g: Tensor) -> Tensor:
        """``(v, *base.shape)`` gradients of the base -> ``(v, *output.shape)``."""
        if self.view is None:
            return g
        (base_shape, base_stride, span), (shape, stride, offset) = self.view
        v = g.shape[0]
        if offset == 0 and _row_major(base_shape, base_stride) and _row_major(shape, stride) \
                and math.prod(shape) == math.prod(base_shape):
            return g.reshape((v, *shape))  # a reshape of the whole base (F.linear's view)
        flat = g.new_zeros((v, span))
        flat.as_strided((v, *base_shape), (span, *base_stride)).copy_(g)
        return flat.as_strided((v, *shape), (span, *stride), offset)

    def place(self, g: Tensor) -> Tensor:
        """The inverse for one cotangent: ``g (*output.shape)`` into a base-shaped zero."""
        if self.view is None:
            return g
        (base_shape, base_stride, span), (shape, stride, offset) = self.view
        flat = g.new_zeros(span)
        flat.as_strided(shape, stride, offset).copy_(g)
        return flat.as_strided(base_shape, base_stride).clone()


def _row_major(shape: tuple, stride: tuple) -> bool:
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def _edge(t: Tensor) -> Edge | None:
    """Where ``t``'s gradient, at its current version, will be read (``None`` without
    autograd)."""
    if not t.requires_grad:
        return None
    base = t._base
    try:
        if base is None or base.grad_fn is None:
            return Edge(get_gradient_edge(t))
        start = base.storage_offset()
        span = 1 + sum((size - 1) * stride for size, stride in zip(base.shape, base.stride()))
        geometry = ((tuple(base.shape), tuple(base.stride()), max(span, 1)),
                    (tuple(t.shape), tuple(t.stride()), t.storage_offset() - start))
        return Edge(get_gradient_edge(base), geometry)
    except RuntimeError:
        return None


def where(call: Call, exc: BaseException) -> str:
    """A note for an exception raised inside ``call``: the module, and for ids the range."""
    note = f"(raised inside module {call.describe()})"
    ids = call.args[0] if call.args else None
    size = getattr(call.module, "num_embeddings", None)
    if isinstance(exc, IndexError) and size is not None and isinstance(ids, Tensor):
        if ids.numel() and not ids.is_floating_point():
            note = (
                f"module {call.describe()} got ids from {int(ids.min())} to {int(ids.max())}, "
                f"but num_embeddings={size}: every id must be in [0, {size}). Fix the "
                "tokenizer or vocabulary size."
            )
    return note
