"""The calls rules read: one op as a rule sees it (:class:`OpCall`), the operands of an
op that broadcasts them (:func:`operand`, :func:`write_reduced`), and the inputs and
backprops of a module-rule call with the samples in front (:func:`module_inputs`,
:func:`module_front`), for the module rules and their norm rules."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..batch import SHARED, Batched, Layout, front, front_cotangents
from ..batch.layouts import in_sample_order, one_per_sample, sample_of_positions
from ..capture import Call, Capture
from ..precision import cast
from .spec import Decline

NOT_COVERED = "asked for an input the rule does not cover"


class Destinations(dict):
    """A rule's ``out`` (a name or tensor -> its destination ``(n, v, *shape)``) that may
    take a weight's part as factors instead of its being written: ``defer(key, left,
    right)`` (``left (n, T, r)``, ``right (n, T, c)``, the part ``sum_t left[n, t] outer
    right[n, t]``) returns whether the engine took them (see :meth:`OpCall.defer`)."""

    def __init__(self, out: dict, defer: Any):
        super().__init__(out)
        self._defer = defer

    def defer(self, key: Any, left: Tensor, right: Tensor) -> bool:
        return self._defer(key, left, right)


class OpCall:
    """One recorded op (:class:`persample.capture.Op`) as a rule sees it.

    ``args``/``kwargs`` as the op received them; ``arg(i, name, default)`` reads one
    by position or keyword; ``front(t)`` brings the samples of input ``t`` to the
    front; ``shared(t)`` tells whether ``t`` is the same for every sample; ``n``
    is the batch size.
    """

    def __init__(self, op: Any, n: int, dtype: torch.dtype | None = None):
        self.op, self.n, self.dtype = op, n, dtype
        self.adding: set[Tensor] = set()  # inputs whose result to add to (``adds`` rules)
        self.out_pairing: Batched | None = None  # the output's, for a derived op pulled
        # back per sample (its output paired with the samples), else None
        self.out_pairings: list = []  # each output's (its layout; for a derived op
        # pulled back, its cotangent's pairing, None: every sample's of the whole output)
        self.defers: set[Tensor] = set()  # parameters whose part the rule may give as
        # factors (``defer``) where other ops also read them: summed with theirs after
        self.deferred: list[tuple[Tensor, Tensor, Tensor]] = []  # (t, left, right) given
        self.func, self.args, self.kwargs = op.func, op.args, op.kwargs
        self._pos = {}
        for k, t in enumerate(op.leaves):
            self._pos.setdefault(id(t), k)

    def defer(self, t: Tensor, left: Tensor, right: Tensor) -> bool:
        """Give ``t``'s per-sample gradient as factors, ``sum_t left[n, t] outer
        right[n, t]`` (``left (n, T, r)``, ``right (n, T, c)``, ``t`` seen as ``(r, c)``),
        instead of writing it, where the engine allows (``t`` in :attr:`defers`): it
        forms every deferred part of ``t`` in one product. Returns whether it took them
        (else the rule writes as usual)."""
        if t not in self.defers:
            return False
        self.deferred.append((t, left, right))
        return True

    def arg(self, i: int, name: str | None = None, default: Any = None) -> Any:
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return self.args[i] if i < len(self.args) else default

    def _k(self, t: Tensor) -> int:
        return self._pos[id(t)]

    def pairing(self, t: Tensor) -> Batched | None:
        return self.op.pairing(self._k(t))

    def shared(self, t: Tensor) -> bool:
        return self.pairing(t) is None

    def value(self, t: Tensor) -> Tensor:
        """The value of input ``t`` the op read (the saved one if the op overwrote it in
        place), detached, as it is laid out."""
        return cast(self.op.value(self._k(t)).detach(), self.dtype)

    def front(self, t: Tensor) -> Tensor:
        """``(n, *per_sample)`` for an input carrying samples; a shared input as it is.
        The value the op read (the saved one if the op overwrote it in place)."""
        if not isinstance(t, Tensor):
            return t
        value, lay = self.value(t), self.pairing(t)
        return value if lay is None else front(value, lay, self.n)

    def where(self) -> str:
        return self.op.where()

    def only(self, out: dict, *tensors: Any) -> None:
        """Raise :class:`~persample.rules.spec.Decline` if ``out`` asks for inputs other
        than ``tensors`` (a derived input the rule does not differentiate: the engine
        then does)."""
        mine = [t for t in tensors if isinstance(t, Tensor)]
        if not all(any(k is t for t in mine) for k in out):
            raise Decline(NOT_COVERED)

    def operands(self) -> tuple[Any, Any]:
        """The two operands of a binary op in the op's own order (``__r*__`` methods,
        ``w * x`` seen as ``x.__rmul__(w)``, swap them)."""
        a, b = self.arg(0, "input"), self.arg(1, "other")
        return (b, a) if self.func.__name__.startswith("__r") else (a, b)


def reduce_to(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t (n, v, *s)`` summed over the dims broadcasting gave it beyond ``shape``:
    ``(n, v, *shape)``."""
    extra = t.dim() - 2 - len(shape)
    dims = list(range(2, 2 + extra)) + [
        2 + extra + k for k, size in enumerate(shape) if size == 1 and t.shape[2 + extra + k] != 1]
    if dims:
        t = t.sum(dims, keepdim=True)
    return t.reshape(*t.shape[:2], *shape)


def target_shape(call: OpCall, p: Tensor) -> tuple[int, ...]:
    """The shape of ``p``'s per-sample cotangent: its own, or per sample when paired."""
    return tuple(p.shape) if call.shared(p) else tuple(call.front(p).shape[1:])


def operand(call: OpCall, x: Any, rank: int) -> Any:
    """``x`` broadcastable against ``g (n, v, *s)`` with ``len(s) == rank``, conjugated
    where complex: the factor a product's vector-Jacobian product multiplies ``g`` by
    (``g * conj(a)`` for ``a * b``, PyTorch's convention)."""
    if not isinstance(x, Tensor):
        return x.conjugate() if isinstance(x, complex) else x
    if call.shared(x):
        return x.detach().conj()
    xf = call.front(x)  # (n, *per_sample)
    return xf.view(xf.shape[0], 1, *[1] * (rank - (xf.dim() - 1)), *xf.shape[1:]).conj()


def write_reduced(call: OpCall, out: dict, p: Tensor, value: Tensor) -> None:
    """``value (n, v, *s)`` summed over the dims ``p`` was broadcast over, into ``p``'s
    result (``p``'s own shape, or its per-sample shape where the op pairs it); a real
    ``p`` read by a complex op gets the real part."""
    value = reduce_to(value, target_shape(call, p))
    out[p].copy_(value.real if value.is_complex() and not out[p].is_complex() else value)


def module_front(g: Tensor, lay: Layout, n: int, lead: int) -> Tensor:
    """For module rules: the batch dim (``lead`` dims in) moved to the front in sample
    order and removed from its place, ``(n, *rest)``; a permuted batch dim (a packed
    sequence's final states) likewise. An irregular one (a packed sequence's rows,
    several per sample) is padded per sample: that dim then holds the most positions
    of one sample, each sample's in their order (zeros after its own)."""
    if not isinstance(lay, Batched):
        return g
    d = lay.dim + lead
    if lay.index is None:
        if lay.outer == 1 and lay.inner > 1:  # rows merged with the batch: (n, rows, ...)
            return front_cotangents(g, lay, n) if lead else lay.front(g, n)
        if not lay.plain:
            raise ValueError(f"a module rule got a merged batch dim ({lay})")
        return g.movedim(d, 0)
    if one_per_sample(lay.index, n):
        return in_sample_order(g, lay.index.to(g.device), d)
    return front_cotangents(g, lay, n) if lead else lay.front(g, n)


def cast_input(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, PackedSequence):
        return x._replace(data=cast(x.data, dtype))
    if isinstance(x, (tuple, list)):
        return type(x)(cast_input(xi, dtype) for xi in x)
    return cast(x, dtype)


def module_inputs(capture: Capture, call: Call) -> tuple | None:
    """The call's inputs as positional arguments, samples in dim 0."""
    args = positional(call)
    if args is None:
        return None
    return tuple(_front_value(capture, a, call) for a in args)


def _front_value(capture: Capture, x: Any, call: Call) -> Any:
    """One input of a module-rule call with its samples in dim 0 (in sample order); a
    packed sequence re-labelled so that unpacking it gives its sequences in sample
    order."""
    if isinstance(x, PackedSequence):
        lay = _paired(capture, x.data, call)
        if not isinstance(lay, Batched):
            return x
        rows = sample_of_positions(lay, x.data.shape[0], capture.n, x.data.device)
        first = rows[: int(x.batch_sizes[0])]  # the sample of each sequence
        return PackedSequence(x.data, x.batch_sizes, first, torch.argsort(first))
    if isinstance(x, (tuple, list)):
        return type(x)(_front_value(capture, xi, call) for xi in x)
    if isinstance(x, Tensor):
        return module_front(x, _paired(capture, x, call), capture.n, 0)
    return x


def _paired(capture: Capture, x: Tensor, call: Call) -> Layout:
    """``x``'s layout; for a shared input, how the call's own ops pair it with the samples
    (the recurrent kernel pairs zeros made for the batch by their batch dim)."""
    lay = capture.layout(x)
    if lay is not SHARED:
        return lay
    for op in capture.ops:
        if op.claimed is call:
            for k, t in enumerate(op.leaves):
                if t is x and isinstance(op.pairing(k), Batched):
                    return op.pairing(k)
    return lay


def positional(call: Call) -> tuple | None:
    """The call's inputs as positional arguments of the module's ``forward`` (keyword
    inputs moved to their place); ``None`` if impossible (keyword-only arguments)."""
    import inspect

    if not call.kwargs:
        return call.args
    try:
        bound = inspect.signature(type(call.module).forward).bind(
            call.module, *call.args, **call.kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return None if bound.kwargs else bound.args[1:]
