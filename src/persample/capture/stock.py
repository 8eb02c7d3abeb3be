"""The cached call of a model built of torch's own layers only: no op intercepted.

A model that is an ``nn.Sequential`` (nested ones included) of torch's layers with
parameters (``nn.Linear``, ``nn.Conv1d``/``nn.Conv2d``, ``nn.LayerNorm``,
``nn.Embedding``: :data:`READS`) and parameter-free elementwise, shape, pooling or
non-drawing dropout layers (:data:`ELEMENTWISE`) runs code persample knows: each layer's
``forward`` is torch's, which reads no other tensor and never mixes samples. Once a
full capture of a call has decided its data flow
(:class:`~persample.capture.recorder.Capture`), a later call like it (same layers,
parameters, shapes, dtypes and watched set, nothing hooked or patched) needs no
``TorchFunctionMode``: :class:`StockCapture` runs the forward as it is, with a forward
hook on each layer whose parameters the rules need, and rebuilds the records the rules
read (each layer's :class:`~persample.capture.records.Op`: its functional form's
arguments as the layer's ``forward`` passes them, its output's gradient edge) from the
:class:`Template` of the full capture. The per-op cost of the forward is then that of
the ops that read parameters, one hook each.

The guards: :meth:`Template.holds` before the forward (every module the same object of
the same type, with no hook and no ``forward`` of its own, dropout drawing nothing; the
same parameters, shapes, dtypes, devices and ``requires_grad``; the functions the layers
call not patched; no ``TorchFunctionMode`` or global module hook active), and after it
the layers called in the template's order on inputs of its shapes and dtypes with the
arguments other than tensors its ops had (a stride, an ``eps``). A call that fails a
guard after the forward runs it again under the full capture: these layers hold no
state and draw no random numbers, so running them twice is running them once.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from ..batch import Batched, Flow, Layout, op_leaves
from ..precision import autocast_state
from .edges import edge_of
from .recorder import Capture
from .records import Call, Op

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.ELU,
               nn.Softplus, nn.Mish, nn.Hardtanh, nn.ReLU6, nn.Softsign, nn.Identity,
               nn.Flatten, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
               nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.Dropout, nn.Dropout1d,
               nn.Dropout2d)
"""Layers without parameters whose ``forward`` is one op of each sample's own positions
(elementwise, a shape, a pooling window; dropout where it draws nothing: in eval mode or
``p = 0``): the samples stay where they are."""


def _conv(m: nn.Module, x: Tensor) -> tuple[tuple, dict] | None:
    if m.padding_mode != "zeros":  # (F.pad first: another op)
        return None
    return (x, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups), {}


def _embedding(m: nn.Module, x: Tensor) -> tuple[tuple, dict] | None:
    if m.max_norm is not None:  # (renormalises the table in place)
        return None
    return (x, m.weight), dict(padding_idx=m.padding_idx, max_norm=m.max_norm,
                               norm_type=m.norm_type, scale_grad_by_freq=m.scale_grad_by_freq,
                               sparse=m.sparse)


READS: dict[type, Any] = {
    nn.Linear: lambda m, x: ((x, m.weight, m.bias), {}),
    nn.Conv1d: _conv,
    nn.Conv2d: _conv,
    nn.LayerNorm: lambda m, x: ((x, m.normalized_shape),
                                dict(weight=m.weight, bias=m.bias, eps=m.eps)),
    nn.Embedding: _embedding,
}
"""The layers with parameters, each with the ``(args, kwargs)`` its ``forward``'s call of
its functional form (``F.linear``, ``F.conv2d``, ...) hands to a ``TorchFunctionMode``,
rebuilt from the module as torch's ``forward`` builds them (``None``: a form that runs
other ops too)."""
_FUNCTIONS = ("linear", "conv1d", "conv2d", "layer_norm", "embedding", "relu", "gelu",
              "tanh", "sigmoid", "silu", "leaky_relu", "elu", "softplus", "mish", "hardtanh",
              "relu6", "softsign", "max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d",
              "adaptive_avg_pool1d", "adaptive_avg_pool2d", "dropout", "dropout1d",
              "dropout2d")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks",
                 "_global_forward_hooks_always_called")


def global_hooks() -> bool:
    """Is any global module hook registered (``register_module_forward_hook``...)? Both
    cached calls that run no capture (this one, and the compiled forward's, which
    TorchDynamo does not guard for them) leave such a call to the full capture."""
    return any(getattr(torch_module, name, None) for name in _GLOBAL_HOOKS)


def _functions() -> tuple:
    """The functional forms the layers call, as they are now (a patched one differs)."""
    return tuple(getattr(F, name, None) for name in _FUNCTIONS) + (
        torch.flatten, Tensor.flatten, torch.sigmoid, torch.tanh)


def _plain_module(m: nn.Module) -> bool:
    """torch's own code, untouched, drawing nothing: no hook, no ``forward`` of the
    instance's own, dropout only where it keeps everything."""
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or (
            m._backward_pre_hooks or "forward" in m.__dict__):
        return False
    return not isinstance(m, nn.modules.dropout._DropoutNd) or not m.training or m.p == 0


def _stock(m: nn.Module) -> bool:
    kind = type(m)
    if kind in READS:
        return set(m._parameters) <= {"weight", "bias"} and not m._buffers
    return kind in ELEMENTWISE + (nn.Sequential,) and not m._parameters and not m._buffers


class _Tensor:
    """Where a tensor stands in an op's arguments kept without it (:attr:`_Read.constants`)."""


TENSOR = _Tensor()


def _constants(args: tuple, kwargs: dict) -> tuple:
    """An op's arguments, each tensor as :data:`TENSOR`: ``(args, sorted kwargs items)``."""
    return (tuple(TENSOR if isinstance(a, Tensor) else a for a in args),
            tuple(sorted((k, TENSOR if isinstance(a, Tensor) else a)
                         for k, a in kwargs.items())))


def _same(a: Any, b: Any) -> bool:
    """Tensors the same object; tuples and lists item by item; the rest equal and of the
    same type (``1`` is not ``True``, ``(2, 2)`` not ``[2, 2]``)."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is tuple or kind is list:
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, Tensor):
        return a is b
    return a is b or a == b


def _same_arguments(built: tuple[tuple, dict] | None, args: tuple, kwargs: dict) -> bool:
    """The arguments a layer's ``forward`` passes now, against those an op was called
    with: tensors the same objects, the rest equal and of the same type."""
    if built is None:
        return False
    now, named = built
    return (len(now) == len(args) and all(_same(a, b) for a, b in zip(now, args))
            and named.keys() == kwargs.keys()
            and all(_same(named[k], kwargs[k]) for k in named))


@dataclass(frozen=True)
class _Read:
    """One call of a layer with parameters in the template: its module, the shape and
    dtype of its input, and what the full capture recorded of its op (function, the
    arguments other than the input and parameters, leaf layouts, data flow, which leaves
    are which watched parameters)."""

    name: str
    module: weakref.ref
    shape: torch.Size
    dtype: torch.dtype
    func: Any
    constants: tuple  # the op's arguments, each tensor as TENSOR (_constants)
    layouts: tuple[Layout, ...]
    flow: Flow
    sources: dict[int, frozenset[int]]


@dataclass(frozen=True)
class Template:
    """What a full capture of a stock model's call decided, and what it ran on."""

    modules: tuple[tuple[weakref.ref, type], ...]  # model.modules(), in order
    # every module's parameter slots, in order: (ref, shape, dtype, device, requires_grad)
    params: tuple[tuple[weakref.ref, torch.Size, torch.dtype, torch.device, bool] | None, ...]
    watched: frozenset[int]
    functions: tuple
    reads: tuple[_Read, ...]
    output: Layout  # the model output's layout

    def holds(self, model: nn.Module, watched: dict[int, nn.Parameter], inputs: list) -> bool:
        """May a call on ``model`` with ``watched`` and ``inputs`` (``(tensor, layout)``)
        take this template (before its forward)?"""
        if len(inputs) != 1 or type(inputs[0][0]) is not Tensor:  # (a subclass runs code)
            return False
        if torch._C._is_torch_function_mode_enabled() or global_hooks():
            return False
        if frozenset(watched) != self.watched or _functions() != self.functions:
            return False
        mods, params = self.modules, self.params
        k = j = -1
        for k, m in enumerate(model.modules()):
            if k >= len(mods) or mods[k][0]() is not m or type(m) is not mods[k][1] or (
                    not _plain_module(m)):
                return False
            for p in m._parameters.values():
                j += 1
                if j >= len(params) or (p is None) != (params[j] is None):
                    return False
                if p is None:
                    continue
                ref, shape, dtype, device, grad = params[j]
                if ref() is not p or p.shape != shape or p.dtype != dtype or (
                        p.device != device or p.requires_grad != grad):
                    return False
        return k + 1 == len(mods) and j + 1 == len(params)


def _parameters(model: nn.Module) -> list[Tensor | None]:
    """Every module's registered parameters, in ``modules()`` order (a shared one as
    often as it is registered, ``None`` where a slot is empty: ``bias=False``)."""
    return [p for m in model.modules() for p in m._parameters.values()]


def template_of(model: nn.Module, cap: Capture, inputs: list, shared: tuple,
                output: Layout | None, plain_plan: bool) -> Template | None:
    """The template of a full capture of ``model``'s call, if a later call like it may run
    unintercepted: a stock model (every module torch's own ``nn.Sequential`` or a layer of
    :data:`READS` or :data:`ELEMENTWISE`, untouched), one input batched in dim 0 and
    nothing shared, every recorded op a layer's functional form called as its ``forward``
    calls it, on its own parameters, taking the rules (``plain_plan``), no derived tensor,
    random draw or read the capture could not follow, and a model output (a tensor, laid
    out as ``output``) whose samples are known."""
    if not plain_plan or shared or len(inputs) != 1 or type(inputs[0][0]) is not Tensor:
        return None
    if not isinstance(inputs[0][1], Batched) or inputs[0][1] != Batched(0):
        return None
    if cap.derived or cap.draws or cap.unseen_reads or cap.param_written or cap.mixing:
        return None
    modules = list(model.modules())
    if not all(_stock(m) and _plain_module(m) for m in modules):
        return None
    if torch._C._is_torch_function_mode_enabled() or global_hooks():
        return None
    if not isinstance(output, Batched):
        return None
    reads = []
    for op in cap.ops:
        m = op.call.module if op.call is not None else None
        build = READS.get(type(m))
        if build is None or not op.args or not isinstance(op.args[0], Tensor) \
                or not _same_arguments(build(m, op.args[0]), op.args, op.kwargs):
            return None
        if op.claimed is not None or op.before is not None or op.draw is not None or (
                op.previous is not None or not isinstance(op.layouts[0], Batched)
                or op.flow.pairing is not None):
            return None
        x = op.args[0]
        constants = _constants(op.args, op.kwargs)
        reads.append(_Read(op.call.name, weakref.ref(m), x.shape, x.dtype, op.func,
                           constants, tuple(op.layouts), op.flow, dict(op.sources)))
    params = tuple(None if p is None else (weakref.ref(p), p.shape, p.dtype, p.device,
                                           p.requires_grad) for p in _parameters(model))
    return Template(tuple((weakref.ref(m), type(m)) for m in modules), params,
                    frozenset(cap.watched), _functions(), tuple(reads), output)


class StockCapture(Capture):
    """A capture of a stock model's call that takes its :class:`Template`: the forward
    runs unintercepted, a forward hook on each layer the template read keeps its
    functional form's arguments and its output,
    and on leaving the records are those the full capture would have made. The loss is
    followed as in any capture (:meth:`Capture.follow`). :attr:`missed` says a guard
    failed after the forward (the caller runs it again under a full capture)."""

    def __init__(self, model: nn.Module, watched: dict[int, nn.Parameter], n: int,
                 batched: list, template: Template, tape: list):
        super().__init__(None, watched, n, batched)
        self.model, self.template = model, template
        self.steps = list(tape)  # (the data flow is the earlier call's: kept as it was)
        self.replayed = len(tape)
        self.missed = False
        self._seen_calls: list[tuple] = []  # (module, input, output, edge, versions)
        self._output: Tensor | None = None

    def __enter__(self) -> StockCapture:
        try:
            for read in self.template.reads:
                m = read.module()
                if m is None:
                    raise RuntimeError("a layer of the template was freed")
                self._handles.append(m.register_forward_hook(self._read, with_kwargs=True))
            self._handles.append(self.model.register_forward_hook(self._root))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, _type, exc, _tb) -> None:
        self._remove()
        if exc is None:
            self.missed = not self._records()

    def _read(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Keep the call's input and output, with the output's gradient edge and the
        inputs' versions taken now: a later in-place op (``nn.ReLU(inplace=True)``)
        moves the output's own node (:mod:`persample.capture.edges`)."""
        if threading.get_ident() != self.thread:
            return
        x = args[0] if args else kwargs.get("input")
        if not isinstance(output, Tensor) or not isinstance(x, Tensor):
            self._seen_calls.append((module, x, output, None, None))
            return
        built = READS[type(module)](module, x)
        if built is None:
            self._seen_calls.append((module, x, output, None, None))
            return
        leaves = op_leaves(*built)
        self._seen_calls.append((module, built, output, edge_of(output),
                                 [t._version for t in leaves]))

    def _root(self, module: nn.Module, args: tuple, output: Any) -> None:
        if threading.get_ident() == self.thread:
            self._output = output

    def _records(self) -> bool:
        """The ops and calls from the hooked layers, if every one ran as the template's
        did (``False`` where they did not: nothing recorded)."""
        reads, seen = self.template.reads, self._seen_calls
        if len(seen) != len(reads) or not isinstance(self._output, Tensor):
            return False
        for read, (m, built, _out, _, versions) in zip(reads, seen):
            if read.module() is not m or versions is None or built[0][0].shape != read.shape \
                    or built[0][0].dtype != read.dtype or not _same(_constants(*built),
                                                                read.constants):
                return False
        state = autocast_state()
        for k, (read, (m, (args, kwargs), out, edge, versions)) in enumerate(zip(reads, seen)):
            leaves = op_leaves(args, kwargs)
            call = Call(read.name, m, (args[0],), {}, out)
            op = Op(read.func, args, kwargs, out, leaves, list(read.layouts), read.flow,
                    read.sources, call, index=k)
            op.sources_all = frozenset().union(*read.sources.values())
            op.autocast = state
            op.versions = versions
            op.edges = [edge]
            op.record_output(out)
            self.ops.append(op)
            self.calls.append(call)
        self.layouts[self._output] = self.template.output
        return True
