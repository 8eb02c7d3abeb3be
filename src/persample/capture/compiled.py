"""The cached call of any model with no op intercepted: its forward compiled by
TorchDynamo into one graph, the graph run as plain torch calls.

A call that has run its :class:`~persample.capture.lean.Program` (every op checked
against an earlier call's, about 50 us an op here) a few times over is a training loop.
Its forward is then handed to TorchDynamo (``torch.compile`` with a backend of
persample's own, :func:`compiled_for`, one graph or none: ``fullgraph=True``), which
turns it into a graph of torch calls and guards it: the graph runs again only while
every Python value it was traced from still holds (the model's modules, their flags,
the functions they call, the shapes, dtypes and ``requires_grad`` of every tensor read,
autograd's mode); where one does not, it traces again, and a branch on a tensor's
values cannot be traced at all (then this path is not taken).

The first time a graph runs for a kind of call, a copy of it returning every node's
value runs node by node under the full capture (:class:`~persample.capture.recorder.Capture` with a
:class:`~persample.capture.lean.Tracer`; that call is then a full capture's): that
decides every tensor's layout as any call's capture does, and leaves a :class:`Plan`:
which nodes' values the records need (the operands and outputs of the ops that read
parameters, and the gradient edges of those outputs as each is right after its node: an
op writing in place, ``scores += position_bias``, gives its edge at its own node, not at
the node that made the tensor; those of the ops whose data flow may read values, decided
again at every call), and the layouts of the graph's outputs. Each later call runs a
copy of the graph that also returns those values (:class:`CompiledCapture`), and makes
the records from them as :class:`~persample.capture.lean.LeanCapture` does: the per-op
cost of the forward is then a few Python calls per op that reads parameters, none for
the others.
The graph has no module calls: each record's module is the eager forward's, where the
program's reads are the same ops on the same parameters.

Beyond TorchDynamo's guards, a call takes a plan only where each tensor the graph reads
is what it was when the plan was made: the same input of the batch (by place), the same
watched parameter, or neither (a buffer, a frozen parameter), each with the same
``requires_grad``. Where anything differs the graph is analysed again; where the data
flow of an op that may read values differs, or TorchDynamo runs the forward without the
graph (another thread's capture, a recompilation limit), the forward runs again under
the full capture (the default generators put back first: its random ops draw what they
would have drawn). TorchDynamo's tracing marks the parameters it reads (an attribute);
the marks are taken off after it, so that the model is left as it was.

A graph batch (torch_geometric's ``Batch``: its nodes and edges hold the samples by
index) has node and edge counts of its own at every call. Its calls share one class of
shapes (:func:`persample.engine.tapes.key_of`), and its forward is compiled with
TorchDynamo's automatic dynamic shapes (:func:`compiled_for`, ``sized``): after a first
graph of one batch's sizes, a second whose sizes are symbolic, passed as arguments, which
every later batch runs. Its plan (:func:`plan_of`, ``sized``) holds for calls of any
sizes: the sizes are left out of the key that picks it; an op whose data flow is decided
again takes its arguments from its node (sizes as the graph computes them for the call);
and there is no plan where an op reading parameters takes a size (its record would keep
the size of the call that made it) or where a layout the plan keeps is one a size moves.

TorchDynamo: Ansel et al., "PyTorch 2: Faster Machine Learning Through Dynamic Python
Bytecode Transformation and Graph Compilation" (ASPLOS 2024).
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch
from torch import Tensor, nn

from ..batch import Batched, op_leaves
from ..precision import autocast_state
from ..walk import dict_version, picked_modules
from .edges import edge_of
from .lean import (
    PARAM,
    LeanCapture,
    Program,
    Tracer,
    _alike,
    _alike_flow,
    _outputs,
    _paired,
    _plain,
    _Read,
    _same_flow,
    decided,
)
from .recall import Recall
from .records import Call, Derived, Op
from .tensors import KEPT, tensor_leaves

_LOCAL = threading.local()  # .job: the CompiledCapture of this thread's call, if any
_NUMBER = count()
PLANS = 8  # kinds of call one graph keeps a plan for


class Cannot(BaseException):
    """The graph cannot take a plan for this call (raised before it runs anything)."""


@dataclass(eq=False)
class Plan:
    """What a graph's call needs kept, for one kind of call (see the module docstring)."""

    program: Program  # the analysis's: its entries, layouts and reads
    graph: torch.fx.GraphModule  # the graph, returning the values below after its own
    n_out: int  # how many outputs the graph itself returns
    reads: tuple[_ReadOf, ...]  # per op reading parameters, in the program's order
    decide: tuple[_DecideOf, ...]  # per op whose data flow may read values
    keep: tuple  # per op whose shared outputs outlive the call as constants: its out
    outputs: tuple  # per graph output: its layout, or None where it is no tensor
    n_values: int  # how many node values the copy returns (then the reads' edges)
    sized: bool = False  # the graph takes the batch's sizes as arguments: the plan holds
    # for calls of any sizes (a graph batch's nodes and edges: see plan_of)


@dataclass(frozen=True, eq=False)
class _DecideOf:
    """One op whose data flow may read values, as a plan decides it again: its
    arguments and output with :class:`_Slot` for tensors, its leaves and what it makes
    (its output tensors, or the tensor it writes) as places in the values."""

    func: Any
    args: Any
    kwargs: Any
    out: Any
    entry: Any  # the program's entry
    leaves: tuple[int, ...]
    made: Any  # the output (or the written argument), slotted
    made_tensors: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class _ReadOf:
    """One op that reads parameters, as a plan makes its record: each tensor of its
    arguments and output a :class:`_Slot` of the values the graph's copy returns."""

    index: int  # its Op's index (the program's read)
    func: Any
    args: Any
    kwargs: Any
    out: Any
    leaves: tuple[int, ...]  # the values its leaves are, in order
    sources_all: frozenset[int]  # every parameter it reads
    derives: tuple[int, ...]  # which of its outputs are derived tensors
    call: tuple | None  # the module call it ran in: (name, weakref to the module)
    edges: tuple[int, ...]  # per output tensor: the place of its edge after the values


class _Slot:
    """The ``k``-th value the graph's copy returns, in an op's arguments."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


def _fill(x: Any, values: tuple) -> Any:
    """``x`` with each :class:`_Slot` replaced by its value."""
    kind = type(x)
    if kind is _Slot:
        return values[x.k]
    if kind is tuple or kind is list:
        return kind(_fill(a, values) for a in x)
    if kind is dict:
        return {k: _fill(a, values) for k, a in x.items()}
    return x


def _slotted(x: Any, slot: Any) -> Any:
    """``x`` with each tensor replaced by ``slot(tensor)``."""
    if isinstance(x, Tensor):
        return slot(x)
    if isinstance(x, tuple):  # (``torch.sort``'s named tuple too: a plain one here)
        return tuple(_slotted(a, slot) for a in x)
    if type(x) is list:
        return [_slotted(a, slot) for a in x]
    if type(x) is dict:
        return {k: _slotted(a, slot) for k, a in x.items()}
    return x


class Namespaces:
    """torch's namespaces as a graph was traced from them: TorchDynamo does not guard the
    functions it calls there (``torch.tanh``, ``F.gelu``), so a function patched after
    the trace would not run. :meth:`hold` is a dict version read per namespace while
    nothing changed; where one did, every name it had must still be the same object
    (a name added, a lazily imported submodule, is no change)."""

    def __init__(self) -> None:
        spaces = _namespaces()
        self.versions = [dict_version(vars(m)) for m in spaces]
        self.copies = [dict(vars(m)) for m in spaces]

    def hold(self) -> bool:
        for k, m in enumerate(_namespaces()):
            now = vars(m)
            version = dict_version(now)
            if version == self.versions[k]:
                continue
            if any(now.get(name, _MISSING) is not value
                   for name, value in self.copies[k].items()):
                return False
            self.versions[k] = version
        return True


_MISSING = object()


def _namespaces() -> tuple:
    import torch.nn.functional as F

    return torch, F, torch._C._nn, torch.special, torch.linalg, torch.fft


class _Runner:
    """TorchDynamo's answer for one graph: runs it as the calling thread's call wants
    (analysed, run with its values kept), or as it is outside persample's calls."""

    def __init__(self, gm: torch.fx.GraphModule, sizes: frozenset[int] = frozenset()):
        self.gm = gm
        self.sizes = sizes  # the arguments that are sizes (a graph of symbolic shapes)
        self.plans: dict[tuple, Plan | None] = {}
        self.namespaces = Namespaces()  # (as they were when it was traced)
        # its code calls torch's functions by name: none may be patched (the patch, which
        # the trace inlined, would run again)
        self.sound = all(_resolves(n.target) for n in gm.graph.nodes
                         if n.op == "call_function")

    def __call__(self, *args: Any) -> Any:
        job = getattr(_LOCAL, "job", None)
        if job is None:
            return self.gm(*args)
        return job.run(self, args)


def _backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    _as_eager(gm)
    return _Runner(gm, frozenset(k for k, x in enumerate(example_inputs)
                                 if isinstance(x, torch.SymInt)))


# ops a library calls only while TorchDynamo traces, in place of an eager op it keeps
# from the compiler, with that op's signature: qualified name -> the eager op
_EAGER_TWINS = {"transformers::grouped_mm_fallback": getattr(torch, "_grouped_mm", None)}


def _as_eager(gm: torch.fx.GraphModule) -> None:
    """Calls of an op in :data:`_EAGER_TWINS` made calls of the eager op it stands for,
    which the eager forward ran (transformers' ``grouped_mm_fallback``, a loop of one
    product per expert with a backward that also makes the weights' gradients, for
    ``torch._grouped_mm``): the graph runs the eager forward's kernels, and its ops
    take their rules. Where the eager op cannot run the call, the graph's first run
    fails and the forward is not compiled again."""
    changed = False
    for node in gm.graph.nodes:
        name = getattr(node.target, "_qualified_op_name", None)
        twin = _EAGER_TWINS.get(name) if node.op == "call_function" and name else None
        if twin is not None:
            node.target, changed = twin, True
    if changed:
        gm.recompile()


_STATIC = "_dynamo_static_input_type"  # what TorchDynamo's tracing sets on parameters


def _marked(model: nn.Module) -> frozenset[int]:
    """The parameters and buffers of ``model`` that carry TorchDynamo's static mark."""
    return frozenset(id(t) for t in (*model.parameters(), *model.buffers())
                     if _STATIC in t.__dict__)


def unmark(model: nn.Module, kept: frozenset[int]) -> None:
    """Take TorchDynamo's static mark, which its tracing set, off ``model``'s parameters
    and buffers (but those in ``kept``, marked before): the model is left as it was."""
    for t in (*model.parameters(), *model.buffers()):
        if _STATIC in t.__dict__ and id(t) not in kept:
            del t.__dict__[_STATIC]


def _call(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    return model(*args, **kwargs)


def compiled_for(model: nn.Module, sized: bool = False) -> Any:
    """``model``'s forward as ``f(model, args, kwargs)``, compiled by TorchDynamo with
    persample's backend. Each model gets a code object of its own: its graphs and guards
    are kept apart from every other model's (and from the user's own ``torch.compile``).
    ``sized``: for calls whose sizes change from call to call (a graph batch's nodes and
    edges), with TorchDynamo's automatic dynamic shapes (a second graph, its sizes
    symbolic, once they have changed), else every size as it was traced.
    """
    code = _call.__code__.replace(co_name=f"_persample_forward_{next(_NUMBER)}")
    fn = types.FunctionType(code, _call.__globals__, code.co_name)
    compiled = torch.compile(fn, backend=_backend, fullgraph=True,
                             dynamic=None if sized else False)
    import torch._dynamo as dynamo

    def run(model: nn.Module, args: tuple, kwargs: dict) -> Any:
        with dynamo.config.patch(_GUARDS):  # (read when a graph's guards are made)
            return compiled(model, args, kwargs)

    return run


# TorchDynamo's guards it leaves out by default, each unsafe for persample: hooks added to
# or removed from a module after the trace (the graph would run without them), a
# parameter passed twice, a tensor changed in place where its module's dict did not
_GUARDS = {"skip_nnmodule_hook_guards": False,
           "skip_no_tensor_aliasing_guards_on_parameters": False,
           "skip_tensor_guards_with_matching_dict_tags": False}


def kind_of(args: tuple, inputs: list, watched: dict, sizes: frozenset[int] = frozenset()
            ) -> tuple:
    """Which tensor each input of the graph is, as a plan is made for it: the batch's
    input at a place, a watched parameter (which one), or another tensor (and its
    ``requires_grad``); other values as they are, but the graph's sizes (``sizes``: their
    places) as sizes, whatever they are."""
    found = []
    places = {id(t): k for k, (t, _) in enumerate(inputs)}
    for k, a in enumerate(args):
        if k in sizes:
            found.append(("size",))
        elif isinstance(a, Tensor):
            place = places.get(id(a))
            if place is not None and inputs[place][0] is a:
                found.append(("input", place))
            elif watched.get(id(a)) is a:  # (by identity: the records name it)
                found.append(("watched", id(a), a.shape, a.dtype))
            else:
                found.append(("other", a.requires_grad, a.shape, a.dtype))
        elif isinstance(a, (int, float, bool, str, type(None))):
            found.append(("value", type(a), a))
        else:
            found.append(("object", id(a)))
    return tuple(found)


def _with_outputs(gm: torch.fx.GraphModule, nodes: list, edges: list = ()
                  ) -> tuple[torch.fx.GraphModule, int]:
    """A copy of ``gm`` that returns ``nodes``' values after its own outputs, then the
    gradient edge of each of ``edges``' values as it is right after its node ran (an
    in-place op later moves a tensor's edge: ``ReLU(inplace=True)`` after a layer)."""
    graph = torch.fx.Graph()
    env: dict = {}
    at: dict = {}
    out_node = None
    for node in gm.graph.nodes:
        if node.op == "output":
            out_node = node
            continue
        env[node] = graph.node_copy(node, lambda m: env[m])
        if node in edges:
            at[node] = graph.call_function(edge_of, (env[node],))
    own = out_node.args[0]
    if not isinstance(own, (tuple, list)):
        raise _NoPlan("a graph whose output is not a tuple")
    graph.output(tuple(torch.fx.map_arg(tuple(own), lambda m: env[m]))
                 + tuple(env[m] for m in nodes) + tuple(at[m] for m in edges))
    return torch.fx.GraphModule(gm, graph), len(own)


class _NoPlan(Exception):
    """Why a graph's call can take no plan."""


class _Keeping(Tracer):
    """A tracer that also keeps each entry's op as it ran: ``(func, args, kwargs, out)``."""

    def __init__(self, cap: Any, inputs: list):
        super().__init__(cap, inputs)
        self.ran: list = []
        self.node: torch.fx.Node | None = None  # the graph's node running (where known)
        self.nodes: list = []  # per entry of ran: the node it ran in

    def traced(self, func, args: tuple, kwargs: dict) -> Any:
        k = len(self.entries)
        out = super().traced(func, args, kwargs)
        if self.dead is None:
            if len(self.entries) != k + 1:
                self.dead = "an op that made no entry"
            else:
                self.ran.append((func, args, kwargs, out))
                self.nodes.append(self.node)
        return out


class _Tagging(torch.fx.Interpreter):
    """Runs a graph node by node, telling the tracer which node each op runs in."""

    def __init__(self, gm: torch.fx.GraphModule, tracer: _Keeping):
        super().__init__(gm)
        self.tracer = tracer

    def run_node(self, n: torch.fx.Node) -> Any:
        self.tracer.node = n
        try:
            return super().run_node(n)
        finally:
            self.tracer.node = None

    def fetch_args_kwargs_from_env(self, n: torch.fx.Node) -> tuple[tuple, dict]:
        """The node's arguments as the graph's own code passes them: plain lists and
        dicts, not fx's immutable ones."""
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return _plain_tree(args), _plain_tree(kwargs)


def _calls(ops: list, program: Program) -> list:
    """The module call each op reading parameters ran in, by the eager forward's
    program (the graph has no module calls) where its reads are the same ops on the same
    parameters, in order; ``None`` each where they are not."""
    reads = program.reads
    if len(reads) != len(ops) or any(
            dict(op.sources) != read.sources or len(op.layouts) != len(read.layouts)
            or not all(map(_alike, op.layouts, read.layouts)) for op, read in zip(ops, reads)):
        return [None] * len(ops)
    found = []
    for read in reads:
        module = read.call[1]() if read.call is not None else None
        found.append(None if module is None else Call(read.call[0], module))
    return found


def _resolves(target: Any) -> bool:
    """Does the name the graph's code calls ``target`` by (``torch.tanh``: looked up when
    it runs) give ``target`` itself? Not where the function was patched: the graph would
    call the patch, which it has traced already."""
    from torch.fx.node import _get_qualified_name

    try:
        name = _get_qualified_name(target)
    except Exception:  # (no name: the graph holds the object itself)
        return True
    if not name.startswith("torch"):
        return True
    parts = name.split(".")
    found: Any = sys.modules.get(parts[0])
    for part in parts[1:]:
        found = getattr(found, part, _MISSING)
    return found is target


def plan_of(gm: torch.fx.GraphModule, cap: Any, tracer: _Keeping, values: tuple,
            output: tuple, calls: list, sized: bool = False) -> Plan:
    """The plan of a graph's call that ran under ``cap`` (a full capture traced by
    ``tracer``), ``values`` the value of each node of ``gm``, ``calls`` the module call
    of each of its ops reading parameters (or ``None``); raises :class:`_NoPlan`.

    ``sized``: the graph takes the batch's sizes as arguments (its shapes symbolic), and
    the plan is for calls of any sizes. Then the ops reading parameters may take no
    argument made of a size (their records are this call's arguments); an op whose data
    flow is decided again takes its arguments from its node's, sizes included, as the
    graph computes them at each call; and every layout the plan holds that is not
    decided again must be one that no size moves (shared, or one position per sample
    along a dim: not a dim of several positions per sample, whose count is a size)."""
    program = tracer.program(cap, list(output))
    if program is None:
        raise _NoPlan(tracer.dead or "no program")
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for n in nodes:
        if n.op == "call_function" and "autocast" in getattr(n.target, "__name__", ""):
            raise _NoPlan("autocast entered inside the forward")
    producer: dict[int, Any] = {}
    for n, v in zip(nodes, values):
        if isinstance(v, Tensor):
            producer.setdefault(id(v), n)
    wanted: dict = {}
    of_node = _NodeValues(nodes, values) if sized else None

    def slot(t: Tensor) -> _Slot:
        n = producer.get(id(t))
        if n is None:
            raise _NoPlan("a tensor made outside the graph's nodes")
        return _Slot(wanted.setdefault(n, len(wanted)))

    edges: dict = {}  # node -> the place of its edge among the edges returned

    def edge(t: Tensor, at: torch.fx.Node | None = None) -> int:
        slot(t)
        return edges.setdefault(producer[id(t)] if at is None else at, len(edges))

    reads, decide, keep = [], [], []
    value_of = {n: v for n, v in zip(nodes, values)}
    by_name = {n.name: n for n in nodes}
    for e, (func, args, kwargs, out), node in zip(program.entries, tracer.ran, tracer.nodes):
        sizes = sized and (e.kind is PARAM or e.decide) and of_node.takes_sizes(node)
        if e.kind is PARAM:
            if sizes:
                raise _NoPlan(f"an op reading parameters ({func}) takes a size of the batch")
            c = calls[e.op]
            at = None
            if e.write:  # (its output is a tensor an earlier node made: its edge is the
                # one right after this op's node, ``scores += bias``)
                at = None if node is None else by_name.get(node.name)  # (the node of
                # the copy that ran: the same name)
                if at is None or value_of.get(at) is not out:
                    raise _NoPlan(f"an op reading parameters ({func}) writes in place "
                                  "within a node of other ops")
            reads.append(_ReadOf(
                e.op, func, _slotted(args, slot), _slotted(kwargs, slot), _slotted(out, slot),
                tuple(slot(t).k for t in op_leaves(args, kwargs)),
                frozenset().union(*program.reads[e.op].sources.values()), e.derives,
                None if c is None else (c.name, weakref.ref(c.module)),
                tuple(edge(o, at) for o in _outputs(out))))
        if e.decide:  # (in order: a layout holding indices decided before its readers)
            made = args[0] if e.write else out
            slotted = (_slotted(args, slot), _slotted(kwargs, slot)) if not sizes else (
                of_node.arguments(node, args, kwargs, lambda m: _Slot(
                    wanted.setdefault(m, len(wanted)))))
            decide.append(_DecideOf(
                func, slotted[0], slotted[1], _slotted(out, slot), e,
                tuple(slot(t).k for t in op_leaves(args, kwargs)), _slotted(made, slot),
                tuple(slot(t).k for t in _outputs(made))))
        if e.keep:
            keep.append(_slotted(out, slot))
    if len(tracer.ran) != len(program.entries) or len(reads) != len(program.reads):
        raise _NoPlan("ops that ran and entries differ")
    reads.sort(key=lambda r: r.index)
    layouts = []
    numbers = tracer.numbers
    for o in output:
        k = numbers.of(o) if isinstance(o, Tensor) else None
        layouts.append(None if k is None else program.layouts[k])
    if sized and not all(_sizeless(lay) for lay in layouts + [
            x for r in program.reads for x in (*r.layouts, r.flow.outputs)]):
        raise _NoPlan("a layout of several positions per sample along a dim")
    graph, n_out = _with_outputs(gm, list(wanted), list(edges))
    return Plan(program, graph, n_out, tuple(reads), tuple(decide), tuple(keep),
                tuple(layouts), len(wanted), sized)


class _NodeValues:
    """The value of each node of a graph in the call that analysed it (``values``, in
    the order of ``nodes``), found for the nodes of the copy that ran (by name: the copy
    keeps them)."""

    def __init__(self, nodes: list, values: tuple):
        self.node = {n.name: n for n in nodes}
        self.value = {n.name: v for n, v in zip(nodes, values)}

    def _args(self, node: torch.fx.Node | None) -> list:
        if node is None or node.name not in self.node:
            raise _NoPlan("an op that ran outside the graph's nodes")
        found: list = []
        torch.fx.node.map_arg((node.args, node.kwargs), lambda m: found.append(m) or m)
        return found

    def takes_sizes(self, node: torch.fx.Node | None) -> bool:
        """Does the op of ``node`` take an argument the graph computes that is no tensor
        (a size, or a shape made of sizes)?"""
        return any(not isinstance(self.value.get(m.name), Tensor) for m in self._args(node))

    def arguments(self, node: torch.fx.Node, args: tuple, kwargs: dict, slot: Any
                  ) -> tuple[Any, dict]:
        """``(args, kwargs)`` of the op of ``node`` with each value the graph computes a
        :func:`slot` of its node (of ``gm``), checked against the op's ``args`` and
        ``kwargs`` as they ran in this call."""
        self._args(node)

        def slotted(x: Any) -> Any:
            return torch.fx.node.map_arg(x, lambda m: slot(self.node[m.name]))

        def filled(x: Any) -> Any:
            return torch.fx.node.map_arg(x, lambda m: self.value[m.name])

        mine = _plain_tree(slotted(node.args)), _plain_tree(slotted(dict(node.kwargs)))
        if not (_same_arguments(_plain_tree(filled(node.args)), args)
                and _same_arguments(_plain_tree(filled(dict(node.kwargs))), kwargs)):
            raise _NoPlan("an op whose arguments are not its node's")
        return mine


def _plain_tree(x: Any) -> Any:
    """fx's immutable lists and dicts as plain tuples, lists and dicts (as ops take them)."""
    if isinstance(x, tuple):
        return tuple(_plain_tree(a) for a in x)
    if isinstance(x, list):
        return [_plain_tree(a) for a in x]
    if isinstance(x, dict):
        return {k: _plain_tree(a) for k, a in x.items()}
    return x


def _same_arguments(a: Any, b: Any) -> bool:
    """The same arguments: the same tensors (by identity), equal values, lists and tuples
    alike."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same_arguments, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_arguments(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _sizeless(lay: Any) -> bool:
    """A layout no size of the batch moves: one that holds indices (decided again at
    each call), shared, mixed or unknown, or one position per sample along a dim."""
    if isinstance(lay, tuple):
        return all(_sizeless(x) for x in lay)
    if type(lay) is Batched and lay.index is None:
        return lay.outer == 1 and lay.inner == 1
    return True


class CompiledCapture(LeanCapture):
    """A capture of a call that runs the compiled forward (see the module docstring).

    Where the graph has a plan for the call, :meth:`finish` with the model's output
    makes the records from the values its copy returned (``False``: the forward ran
    otherwise or its data flow differs: run it again under the full capture). Where it
    has none yet, the graph runs under the full capture ``analyse()`` makes, which is
    then this call's (:attr:`analysis`; :meth:`keep_plan` keeps its plan once the call's
    plan is known). :class:`Cannot` propagates out of a graph that can take no plan.
    """

    def __init__(self, watched: dict, n: int, batched: list, program: Program, tape: list,
                 analyse: Any, sized: bool = False):
        super().__init__(watched, n, batched, program, tape)
        self.inputs = batched
        self.sized = sized  # a call whose graph batch has other sizes than the program's
        self.analyse = analyse
        self.layouts.fallback = None
        self.got: tuple | None = None  # (plan, values, the graph's outputs)
        self.analysis: Any = None  # the full capture the graph ran under
        self.pending: tuple | None = None  # (runner, key, plan or the reason for none)

    def __enter__(self) -> CompiledCapture:
        if getattr(_LOCAL, "job", None) is not None:
            raise Cannot
        _LOCAL.job = self
        return self

    def __exit__(self, _type, exc, _tb) -> None:
        _LOCAL.job = None

    def run(self, runner: _Runner, args: tuple) -> Any:
        """The graph's run for this call (called by TorchDynamo's code)."""
        if self.got is not None or self.analysis is not None:
            raise Cannot  # (a second graph: not one forward)
        if not runner.sound or not runner.namespaces.hold():
            raise Cannot  # (a function of torch's patched, before the trace or since)
        key = (*kind_of(args, self.inputs, self.watched, runner.sizes), self.n)
        plan = runner.plans.get(key, False)
        if plan is None:
            raise Cannot
        if plan is False:
            if len(runner.plans) >= PLANS:  # (a value among its inputs that keeps changing)
                raise Cannot
            return self._analysed(runner, key, args)
        out = plan.graph(*args)
        self.got = (plan, out[plan.n_out:], out[:plan.n_out])
        return out[:plan.n_out]

    def _analysed(self, runner: _Runner, key: tuple, args: tuple) -> Any:
        gm = runner.gm
        nodes = [n for n in gm.graph.nodes if n.op != "output"]
        everything, n_out = _with_outputs(gm, nodes)
        cap = self.analyse()
        tracer = cap.tracer = _Keeping(cap, self.inputs)
        _LOCAL.job = None  # (the graph's own calls, if any, run as they are)
        try:
            with cap:  # (node by node: each op's node known)
                out = _Tagging(everything, tracer).run(*args)
        finally:
            _LOCAL.job = self
        own, values = out[:n_out], out[n_out:]
        self.analysis = cap
        calls = _calls(cap.ops, self.program)
        for op, call in zip(cap.ops, calls):
            op.call = call
        try:
            self.pending = (runner, key, plan_of(gm, cap, tracer, values, own, calls,
                                                 bool(runner.sizes)))
        except _NoPlan as why:
            self.pending = (runner, key, str(why))
        cap.tracer = None
        return own

    def as_traced(self, output: Any) -> bool:
        """Did the analysed graph's call find the data flow of the eager forward's
        program: its output's layouts, nothing read unseen, no samples mixed? (The graph's
        ops may be others than the eager forward's: ``x.new_tensor(y)`` is
        ``torch.tensor`` there.)"""
        cap, program = self.analysis, self.program
        if cap is None or cap.unseen_reads or cap.mixing or cap.param_written:
            return False
        leaves = tensor_leaves(output)
        return len(leaves) == len(program.output) and all(
            _alike(cap.layouts.layout(t), program.layouts[k], self.sized)
            for t, k in zip(leaves, program.output))

    def keep_plan(self, plain: bool) -> None:
        """Keep the analysed graph's plan for later calls like this one, if the call's
        plan took the rules alone (``plain``); else mark the graph as taking none."""
        if self.pending is not None:
            runner, key, plan = self.pending
            runner.plans[key] = plan if plain and isinstance(plan, Plan) else None
            self.pending = None

    def finish(self, output: Any) -> bool:
        """After the forward: did it run one plan's graph, with the data flow of its
        analysis? Then the records, and the output's layouts."""
        if self.got is None:
            return False
        plan, values, outs = self.got
        program = plan.program
        ctx = self.lean_ctx
        dyn = {id(t): lay for t, lay in self.inputs if not _plain(lay)}  # id -> a layout
        # holding this call's indices (a graph batch's inputs: theirs)
        now: dict[int, tuple] = {}  # a read's index -> (its leaves' layouts, its data flow)
        recall = Recall()
        for d in plan.decide:
            entry = d.entry
            leaves, lays = [values[k] for k in d.leaves], entry.layouts
            if entry.dynamic:  # (a leaf's layout as this call decided it)
                lays = tuple(dyn.get(id(t), lay) for t, lay in zip(leaves, lays))
            self._deciding = (leaves, lays)
            made = [values[k] for k in d.made_tensors]
            flow = recall.flow(entry, leaves, lays, made)
            if flow is None:
                flow = decided(ctx, d.func, _fill(d.args, values), _fill(d.kwargs, values),
                               _fill(d.out, values), list(lays))
                recall.keep(entry, leaves, lays, made, flow)
            if not (_alike_flow(flow, entry.flow, plan.sized) if entry.dynamic else _same_flow(
                    flow, entry.flow)):
                return False
            if entry.dynamic:
                for o, lay in _paired(_fill(d.made, values), flow.outputs):
                    dyn[id(o)] = lay
                if entry.kind is PARAM:
                    now[entry.op] = (lays, flow)
        for o, lay in zip(outs, plan.outputs):  # (every one: a distribution's too)
            if lay is not None:
                self.layouts[o] = dyn.get(id(o), lay)
        for t in tensor_leaves(output):
            if not any(o is t for o in outs):
                return False
        state = self.no_autocast
        if state is None:
            state = autocast_state()
        with torch._C.DisableTorchFunction():
            for r in plan.reads:
                args, kwargs, out = _fill(r.args, values), _fill(r.kwargs, values), _fill(
                    r.out, values)
                leaves = [values[k] for k in r.leaves]
                read, call = program.reads[r.index], None
                if r.index in now:
                    lays, flow = now[r.index]
                    read = _Read(lays, flow, read.sources, read.call, read.output,
                                 read.out_versions)
                if r.call is not None:
                    module = r.call[1]()
                    if module is None:
                        return False
                    call = Call(r.call[0], module)
                op = Op(r.func, args, kwargs, out, leaves, list(read.layouts), read.flow,
                        read.sources, call, index=r.index)
                op.sources_all = r.sources_all
                op.autocast = state
                op.versions = [t._version for t in leaves]
                made = _outputs(out)
                op.edges = [values[plan.n_values + k] for k in r.edges]
                op.record_output(out, read.output, read.out_versions)
                self.ops.append(op)
                for k in r.derives:
                    self.derived[id(made[k])] = Derived(made[k], op, k, made[k]._version)
            for out in plan.keep:
                for o in _outputs(_fill(out, values)):
                    if not o.requires_grad:
                        KEPT.add(o)
        return True


@dataclass(eq=False)
class Compiled:
    """A call that runs its forward compiled: the function (:func:`compiled_for`, one per
    model) and the program it was taken from (run where the compiled call cannot)."""

    fn: Any
    program: Program
    marked: frozenset[int]  # the model's tensors TorchDynamo's static mark was on before
    dead: bool = False  # it cannot run (then the program runs)
    fails: int = 0  # calls whose forward ran, but not as a plan of its graph
    sized: bool = False  # for calls of any sizes of a graph batch (compiled_for's sized)


_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {sized: (fn,
# marked)}
_BROKEN: weakref.WeakSet = weakref.WeakSet()  # models TorchDynamo could not compile
_BROKEN_SIZED: weakref.WeakSet = weakref.WeakSet()  # ... for calls of any sizes
_ENABLED = [True]


def broken(model: nn.Module, sized: bool = False) -> None:
    """``model``'s forward could not be compiled (or ran otherwise): not tried again
    (``sized``: for calls of any sizes, where the calls of one size may still be)."""
    try:
        (_BROKEN_SIZED if sized else _BROKEN).add(model)
    except TypeError:
        pass


def _is_wrapper(name: str, m: nn.Module) -> bool:
    """Is ``m`` the module ``torch.compile`` returned (an ``OptimizedModule``)?"""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(m, dynamo.OptimizedModule)


def wrappers_hooked(model: nn.Module) -> bool:
    """Does a module ``torch.compile`` returned, ``model`` or one inside it, hold hooks of
    its own? TorchDynamo traces such a module as the module it wraps (``_orig_mod``), and
    a graph of it would run without the wrapper's hooks: then the call is not compiled."""
    return any(_has_hooks(m) for m in picked_modules(model, _is_wrapper))


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks)


def compiled_of(model: nn.Module, program: Program, sized: bool = False) -> Compiled | None:
    """The compiled call of ``model`` for calls that run ``program``, where TorchDynamo
    can run it: ``None`` where compiling is off or unsupported, for a model that is
    distributed (``DistributedDataParallel``), or one holding a ``torch.compile``
    wrapper with hooks of its own (:func:`wrappers_hooked`). A model the user compiled
    takes it too: TorchDynamo traces the module it wraps into a graph of persample's own,
    kept apart from the user's compiled code (which runs as before outside the calls).
    ``sized``: for calls of a graph batch of any sizes (:func:`compiled_for`)."""
    if not _ENABLED[0]:
        return None
    try:
        import torch._dynamo as dynamo
    except Exception:  # (a build without TorchDynamo)
        return None
    if not dynamo.is_dynamo_supported() or isinstance(
            model, torch.nn.parallel.DistributedDataParallel) or wrappers_hooked(model):
        return None
    if model in _BROKEN or (sized and model in _BROKEN_SIZED):
        return None
    try:
        fns = _FNS.setdefault(model, {})
    except TypeError:  # (no weak reference to the model)
        return None
    found = fns.get(sized)
    if found is None:
        found = fns[sized] = (compiled_for(model, sized), _marked(model))
    return Compiled(found[0], program, found[1], sized=sized)
