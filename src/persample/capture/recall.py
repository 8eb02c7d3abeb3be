"""Data-flow decisions a call has made already, kept for the rest of the call.

A cached call decides again, at every call, the data flow of each op whose layout may
depend on values (an index, a mask; :func:`persample.capture.lean.decided`). Models often
repeat such an op on the same values within one call: every torch_geometric layer adds
the same self loops to the same ``edge_index`` and normalizes by the same degrees, every
layer of a graph network gathers by the same rows. A decision is a function of the op,
its arguments other than tensors, its tensors' values, their layouts, and which of them
are the same tensor; where all of these equal an earlier decision's of the same call,
that decision stands, its layouts re-attached to this op's outputs (a
:class:`~persample.batch.ops_indexing.Partly` describes one tensor only). Comparing is
one ``torch.equal`` per tensor, against the several passes over the indices a decision
takes. An op whose decision reads no floating-point values
(:func:`~persample.batch.flow.reads_no_floats`: elementwise ops, reads and writes at
index values) has its floating-point tensors compared by their form alone: every
layer of a graph network gathers its own features by the same rows, and adds its
messages into the same nodes, with the same decision.

An op whose first calls (three) found no earlier decision of its call to take is not
compared again: comparing costs about a tenth of deciding, and most ops that repeat one
layer's decision do so from the first call on.

Not kept: an op that draws random numbers (its values are not its inputs'), an op whose
arguments other than tensors have no key (:func:`persample.capture.tape.arguments_key`),
a decision that also rewrites other tensors (``Flow.writes``), and one whose tensors
were written in place after it (their versions moved: the values it read are gone).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..batch import Batched, Flow, Layout
from ..batch.flow import reads_no_floats
from ..batch.layouts import Piece
from ..batch.ops_indexing import Partly, Sorted
from ..draws import RANDOM
from .tape import Opaque, arguments_key


def recall_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """What an op's decision is kept under (its function and arguments other than
    tensors), or ``None`` where it may not be kept."""
    if func in RANDOM:
        return None
    try:
        return func, arguments_key(args, kwargs)
    except Opaque:
        return None


@dataclass(eq=False)
class _Made:
    """One decision: the tensors it read and made (with their versions then), their
    layouts, and its flow."""

    tensors: list[Tensor]  # its leaves, then its output tensors
    versions: list[int]
    layouts: tuple  # its leaves' layouts
    flow: Flow
    blind: bool  # its floating-point tensors' values not read (compared by form alone)


class Recall:
    """The decisions of one call, by :func:`recall_key` (see the module docstring)."""

    __slots__ = ("made", "equal")

    def __init__(self):
        self.made: dict[tuple, list[_Made]] = {}
        self.equal: dict[int, tuple] = {}  # id(t) -> (t, u, versions): t found equal to u

    def flow(self, entry: Any, leaves: list, layouts: tuple, outs: list) -> Flow | None:
        """The flow of an earlier decision on these values and layouts, its layouts
        re-attached to ``outs``; ``None`` where none was made. (``entry``: the program's
        entry of the op, whose ``recall`` is its key; an entry whose first calls found
        no earlier decision to take is not compared again.)"""
        key = entry.recall
        if key is None:
            return None
        candidates = self.made.get(key)
        if not candidates:
            return None
        odds = _ODDS.get(entry)
        if odds is None:  # (calls compared, calls that found one, where it was found)
            odds = _ODDS[entry] = [0, 0, 0]
        elif odds[0] >= _TRIES and not odds[1]:
            return None
        odds[0] += 1
        last = odds[2] if odds[2] < len(candidates) else 0  # (the same op's decision as
        tensors = leaves + outs  # in the last call, most likely: tried first)
        for k in (last, *range(last), *range(last + 1, len(candidates))):
            old = candidates[k]
            if _same(old, tensors, layouts, old.blind, self.equal):
                odds[1] += 1
                odds[2] = k
                return _reattached(old.flow, old.tensors[len(leaves):], outs)
        return None

    def keep(self, entry: Any, leaves: list, layouts: tuple, outs: list, flow: Flow) -> None:
        """Keep a decision just made (``entry``: as for :meth:`flow`)."""
        key = entry.recall
        if key is None or flow.writes:
            return
        tensors = leaves + outs
        self.made.setdefault(key, []).append(_Made(
            tensors, [t._version for t in tensors], layouts, flow, reads_no_floats(key[0])))


_ODDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # entry -> [tried, found,
# the place among the candidates found last]
_TRIES = 3  # calls an entry is compared in before one that never found is left alone


def _same(old: _Made, tensors: list, layouts: tuple, blind: bool, equal: dict) -> bool:
    """Do ``tensors`` and their ``layouts`` hold what ``old`` read and made (``blind``:
    floating-point tensors by their form alone)? (The forms first, the values last: most
    decisions that differ differ in a shape.) ``equal``: the pairs of tensors found equal
    so far in the call (an op's outputs compared when its decision was recalled are the
    next op's inputs), kept up to date."""
    if len(tensors) != len(old.tensors) or len(layouts) != len(old.layouts):
        return False
    for t, v in zip(old.tensors, old.versions):
        if t._version != v and not (blind and _floating(t)):
            return False
    for k, (a, b) in enumerate(zip(tensors, old.tensors)):
        if a is not b and not _comparable(a, b):
            return False
        for a2, b2 in zip(tensors[k + 1:], old.tensors[k + 1:]):
            if (a is a2) != (b is b2):  # (a tensor read twice, or two equal ones)
                return False
    if not all(_equal_layouts(la, a, lb, b, equal) for la, a, lb, b in zip(
            layouts, tensors, old.layouts, old.tensors)):
        return False
    pairs = sorted(zip(tensors, old.tensors), key=lambda p: p[0].is_floating_point())
    return all(_known_equal(a, b, equal) for a, b in pairs if not (blind and _floating(a)))
    # (indices first: small, and where two decisions differ, most often their indices do)


def _known_equal(a: Tensor, b: Tensor, equal: dict) -> bool:
    """:func:`_equal_tensors`, a pair found equal earlier in the call (neither written
    since) taken as it was found."""
    if a is b:
        return True
    found = equal.get(id(a))
    if found is not None and found[0] is a and found[1] is b and found[2] == (
            a._version, b._version):
        return True
    if not _equal_tensors(a, b):
        return False
    equal[id(a)] = (a, b, (a._version, b._version))
    return True


def _floating(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _unexpanded(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a`` and ``b`` (of one shape) without the dims both only repeat (stride 0:
    torch_geometric's node ids expanded over the features), which ``torch.equal`` would
    otherwise walk entry by entry."""
    for k in range(a.dim()):
        if a.shape[k] > 1 and a.stride(k) == 0 and b.stride(k) == 0:
            a, b = a.narrow(k, 0, 1), b.narrow(k, 0, 1)
    return a, b


def _comparable(a: Tensor, b: Tensor) -> bool:
    """Dense tensors of one shape, dtype and device (no sparse or nested one: they are
    never taken for equal)."""
    return (a.layout == b.layout == torch.strided and not a.is_nested and not b.is_nested
            and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device)


def _equal_tensors(a: Tensor, b: Tensor) -> bool:
    return a is b or (_comparable(a, b) and torch.equal(*_unexpanded(a, b)))


def _equal_layouts(a: Layout, ta: Tensor, b: Layout, tb: Tensor, equal: dict) -> bool:
    """The same layout, each of its own tensor (a :class:`Partly` counts as its tensor's
    own where it was made for it, else as Unknown)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, Partly):
        return (a.dim == b.dim and (_refers(a, ta) == _refers(b, tb))
                and _equal_indices(a.rows, b.rows, equal))
    if isinstance(a, Piece):
        return a.sample == b.sample and _refers(a, ta) == _refers(b, tb)
    if isinstance(a, Batched):
        return ((a.dim, a.outer, a.inner) == (b.dim, b.outer, b.inner)
                and _equal_indices(a.index, b.index, equal)
                and (not isinstance(a, Sorted) or _equal_indices(a.keys, b.keys, equal)))
    return False


def _refers(lay: Partly | Piece, t: Tensor) -> bool:
    return lay.ref is not None and lay.ref() is t


def _equal_indices(a: Tensor | None, b: Tensor | None, equal: dict) -> bool:
    if a is None or b is None:
        return a is b
    return _known_equal(a, b, equal)


def _reattached(flow: Flow, old: list[Tensor], outs: list[Tensor]) -> Flow:
    """``flow`` with each :class:`Partly` (or :class:`Piece`) made for one of ``old`` made
    for the output in its place instead (``flow`` itself where it holds none)."""
    outputs = flow.outputs
    swapped = (tuple(_swap(lay, old, outs) for lay in outputs) if type(outputs) is tuple
               else _swap(outputs, old, outs))
    if swapped is outputs or (type(swapped) is tuple and all(
            a is b for a, b in zip(swapped, outputs))):
        return flow
    return Flow(swapped, flow.pairing, flow.writes)


def _swap(lay: Any, old: list[Tensor], outs: list[Tensor]) -> Any:
    """``lay``, a :class:`Partly` (or :class:`Piece`) made for one of ``old`` made for the
    output in its place."""
    if type(lay) is tuple:
        return tuple(_swap(x, old, outs) for x in lay)
    if isinstance(lay, (Partly, Piece)) and lay.ref is not None:
        target = lay.ref()
        for o, n in zip(old, outs):
            if target is o:
                if type(lay) is Partly:  # (made directly: a fifth of replace's cost)
                    return Partly(lay.why, lay.dim, lay.rows, weakref.ref(n))
                return dataclasses.replace(lay, ref=weakref.ref(n))
    return lay
