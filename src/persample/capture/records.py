"""The records of one captured forward: the module calls (:class:`Call`), the ops that
read watched parameters (:class:`Op`), and the shared tensors computed from parameters
(:class:`Derived`).

A record keeps what the rules need later (an op's inputs, their layouts, how the op
pairs them with the samples, its output's gradient edge) and no more: an output that
carries samples is kept as a stand-in of its shape (:func:`shapes_only`), so that its
values (GPT-2's logits, ``(B, T, 50257)``) are freed as in a plain step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..batch import Batched, Flow, Layout
from ..precision import AutocastState
from .edges import Edge


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
    out_versions: list[int] = field(default_factory=list)  # of its outputs (module rules)
    autocast: AutocastState | None = None  # the autocast state it ran under
    first_draw: int = 0  # its random ops: the capture's draws[first_draw:end_draw]
    end_draw: int = 0
    own: frozenset[int] | None = None  # a call whose ops ran unfollowed: its parameters
    read: frozenset[int] = frozenset()  # ... and those of them its ops read
    inputs: frozenset[int] = frozenset()  # ... the ids of its input tensors
    inner: list[Inner] = field(default_factory=list)  # ... its ops a module rule may read

    def describe(self) -> str:
        return f"'{self.name or '<root>'}' ({type(self.module).__name__})"


@dataclass(eq=False)
class Inner:
    """An op of a call whose ops ran unfollowed (:attr:`Call.own`) that its module rule
    may read instead of computing it again: one reading the module's parameters or views
    of them, or one gathering rows of the call's inputs (``x[index]``); with the gradient
    edge of an output that is no view."""

    func: Any
    args: tuple
    kwargs: dict
    output: Any
    edge: Edge | None = None


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
    draw: Any = None  # its random numbers, if it draws (persample.draws.Draw)
    # a write of parameters into a tensor already derived (``w[3:] = q`` after ``w[:3] =
    # p``): the Derived its first leaf was before, which that leaf's cotangent goes to
    previous: Any = None
    out_versions: list[int] | None = None  # of its output tensors, where they are kept

    def record_output(self, out: Any, stand_in: Any = None,
                      versions: list[int] | None = None) -> None:
        """Keep what later steps read of the op's output: the tensors themselves for an
        op whose rule reads their values (:data:`KEPT_OUTPUTS`: a recurrent kernel's
        states), with their versions as the op made them (``versions``: those the traced
        call's op made, for a call recorded after its forward ran; else their versions
        now); else an earlier call's ``stand_in`` where it still stands for them, or new
        stand-ins (:func:`shapes_only`)."""
        if self.func in KEPT_OUTPUTS:
            self.output = out
            self.out_versions = list(versions) if versions is not None else [
                t._version for t in self.outputs]
        elif stand_in is not None and stands_for(stand_in, out):
            self.output = stand_in
        else:
            self.output = shapes_only(out, self.flow.outputs)

    def kept_outputs(self) -> list[Tensor] | None:
        """The output tensors as the op made them (:meth:`record_output`), or ``None``
        where they are not kept or one was modified in place since."""
        outs = self.outputs
        if self.out_versions is None or [t._version for t in outs] != self.out_versions:
            return None
        return outs

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
        """Was a leaf modified in place after the op ran (one whose value the op kept,
        :attr:`before`, does not count: what the op read is at hand)?"""
        saved = 0 if self.before is not None else -1
        return any(t._version != v and k != saved
                   for k, (t, v) in enumerate(zip(self.leaves, self.versions)))

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


# Ops whose rules read the values of their outputs (registered by those rules): their
# records keep the output tensors, as a plain step's autograd graph keeps them for the
# backward, instead of stand-ins.
KEPT_OUTPUTS: set = set()

# Ops whose rules read no input's value (a shift: registered by their specs,
# ``OpSpec.reads_inputs``): the record of one that writes in place (``scores += bias``)
# keeps no copy of the tensor it overwrites, and a write into one of their inputs after
# they ran is no concern of their rules (a cached call's program may hold both).
UNREAD_INPUTS: set = set()


def stands_for(stand_in: Any, out: Any) -> bool:
    """Does an earlier call's stand-in of an op's output (a tensor on the meta device)
    have this output's shape, strides and dtype?"""
    if not isinstance(stand_in, Tensor) or not isinstance(out, Tensor):
        return False
    return stand_in.device.type == "meta" and stand_in.shape == out.shape and (
        stand_in.stride() == out.stride() and stand_in.dtype == out.dtype)


def shapes_only(out: Any, layouts: Any) -> Any:
    """An op's output with each tensor carrying samples replaced by a stand-in of its
    shape, strides and dtype on the meta device: what comes later reads its gradient
    (through its edge) and its layout, never its values."""
    if isinstance(out, Tensor):
        if not isinstance(layouts, Batched):
            return out
        return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
    if isinstance(out, (tuple, list)) and isinstance(layouts, tuple) and len(out) == len(
            layouts):
        return type(out)(shapes_only(o, lay) for o, lay in zip(out, layouts)) \
            if type(out) in (tuple, list) else out
    return out
