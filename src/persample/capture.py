"""Record every call of the chosen modules during one forward pass.

DESIGN.md point 1 ("capture, don't re-derive"): forward hooks store, for each
call of a parameterised module, its positional and keyword inputs and its
output. The engine then asks autograd once for the gradient of the loss with
respect to all recorded outputs (the layers' *backprops*).

A ``TorchFunctionMode`` also records under which module calls each parameter
is read, so that a parameter used outside its own module (``out_proj.weight``
inside ``nn.MultiheadAttention``, a tied weight read with ``F.linear``) is
differentiated where it is really used.

State lives in the :class:`Capture` object, never on the model, and the hooks
exist only inside the ``with`` block: they are removed in ``finally``, also
when the forward raises.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


@dataclass
class Call:
    """One call of one module during the captured forward."""

    name: str  # qualified name of the module in the model ("" for the root)
    module: nn.Module
    args: tuple[Any, ...] = ()  # positional inputs as the module's forward received them
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword inputs
    output: Any = None  # what the module returned
    versions: list[int] = field(default_factory=list)  # version counters at capture
    parent: Call | None = None  # the call under way when this one started
    intercept: Any = None  # a rule's capture(call, func, args, kwargs), or None
    extras: list[Tensor] = field(default_factory=list)  # kept by intercept: need backprops
    saved: Any = None  # kept by intercept: values the rule reads

    def tensors(self) -> list[Tensor]:
        """The input and output tensors whose later in-place change would corrupt the rule."""
        return [t for t in tree_leaves((self.args, self.output)) if isinstance(t, Tensor)]


def flat_outputs(output: Any) -> list[Tensor]:
    """The tensors in a module's output (a tensor, or any nest of tuples, lists, dicts)."""
    return [t for t in tree_leaves(output) if isinstance(t, Tensor)]


def output_tensors(call: Call) -> list[Tensor]:
    """The output tensors of ``call`` that autograd can differentiate with respect to."""
    return [o for o in flat_outputs(call.output) if o.requires_grad]


Stack = tuple[Call, ...]  # the module calls under way, outermost first


def _op_leaves(args: tuple, kwargs: dict) -> list:
    """The tensors an op reads: its arguments and the items of list/tuple arguments
    (``torch.cat([a, b])``, the LSTM's weight list); faster than a pytree walk, which
    matters since it runs for every op of the forward."""
    leaves = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            leaves += [x for x in a if isinstance(x, Tensor)]
        elif isinstance(a, Tensor):
            leaves.append(a)
    return leaves


class _ParameterUses(TorchFunctionMode):
    """Records, for each watched parameter, the call stack at every op that reads it."""

    def __init__(self, capture: Capture):
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cap = self.capture
        leaves = _op_leaves(args, kwargs)
        for leaf in leaves:
            if isinstance(leaf, nn.Parameter) and id(leaf) in cap.watched:
                cap.uses.setdefault(id(leaf), []).append(tuple(cap.stack))
        tracer = cap.tracer
        pids = tracer.sources(leaves) if tracer is not None else ()
        call = cap.stack[-1] if cap.stack else None
        output = None
        if call is not None and call.intercept is not None:
            output = call.intercept(call, func, args, kwargs)
        if output is None:
            output = func(*args, **kwargs)
        if pids:
            tracer.record(func, args, kwargs, output, leaves, pids, tuple(cap.stack))
        return output


def _where(call: Call, exc: BaseException) -> str:
    """A note for an exception raised inside ``call``: the module, and for ids the range."""
    note = f"(raised inside module '{call.name or '<root>'}' ({type(call.module).__name__}))"
    ids = call.args[0] if call.args else None
    size = getattr(call.module, "num_embeddings", None)
    if isinstance(exc, IndexError) and size is not None and isinstance(ids, Tensor):
        if ids.numel() and not ids.is_floating_point():
            note = (
                f"module '{call.name or '<root>'}' ({type(call.module).__name__}) got ids from "
                f"{int(ids.min())} to {int(ids.max())}, but num_embeddings={size}: every id "
                f"must be in [0, {size}). Fix the tokenizer or vocabulary size."
            )
    return note


class Capture:
    """Context manager recording the calls of ``modules`` and where parameters are used.

    ``modules`` maps qualified names to modules; ``watched`` is the set of
    ``id(param)`` whose uses to record; with the batch size ``n``, ``tracer``
    also follows them op by op (:mod:`persample.taps`). Inside the block, ``calls`` lists every
    finished call (innermost first, as calls finish), and ``uses[id(param)]``
    the call stacks under which an op read the parameter.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(3, 2))
        >>> with Capture({"": net, "0": net[0]}, {id(net[0].weight)}) as cap:
        ...     _ = net(torch.randn(4, 3))
        >>> [c.name for c in cap.calls], [[c.name for c in s] for s in cap.uses[id(net[0].weight)]]
        (['0', ''], [['', '0']])
        >>> len(net[0]._forward_hooks)
        0
    """

    def __init__(self, modules: dict[str, nn.Module], watched: set[int] | None = None,
                 n: int | None = None, intercept: Any = None):
        self.modules = modules
        self.watched = watched or set()
        # with the batch size: follow the watched parameters op by op (taps.py)
        from .taps import Tracer  # taps -> layout -> capture

        self.tracer = Tracer(self.watched, n) if n is not None else None
        self.calls: list[Call] = []
        self.stack: list[Call] = []
        self.uses: dict[int, list[Stack]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._mode = _ParameterUses(self)
        self._thread = threading.get_ident()  # hooks ignore calls from other threads
        self._intercept = intercept  # intercept(module) -> a rule's capture function or None

    def __enter__(self) -> Capture:
        try:
            for name, module in self.modules.items():
                self._handles.append(module.register_forward_pre_hook(
                    self._make_pre_hook(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(
                    self._post_hook, with_kwargs=True))
            self._mode.__enter__()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, _type: type | None, exc: BaseException | None, _tb: object) -> None:
        try:
            self._mode.__exit__(None, None, None)
        finally:
            self._remove()
        if exc is not None and self.stack:  # raised inside a module's forward: name it
            exc.add_note(_where(self.stack[-1], exc))

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_pre_hook(self, name: str):
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if threading.get_ident() != self._thread:
                return  # the same model run by another thread at the same time
            parent = self.stack[-1] if self.stack else None
            intercept = self._intercept(module) if self._intercept else None
            self.stack.append(Call(name, module, args, kwargs, parent=parent,
                                   intercept=intercept))

        return pre_hook

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        call = self.stack.pop()
        call.args, call.kwargs, call.output = args, kwargs, output
        call.versions = [t._version for t in call.tensors()]
        self.calls.append(call)
