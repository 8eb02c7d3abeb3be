"""How each op carries the samples from its inputs to its outputs (data flow).

:func:`propagate` is the one place that decides the layout of an op's outputs
(:mod:`persample.batch.layouts`) from the layouts of its inputs and the op's own
semantics: an elementwise op keeps the batch where broadcasting puts it, a
``reshape`` moves it by index arithmetic (``(B, T, E) -> (B*T, E)`` merges it with
``T``), ``transpose`` permutes it, ``x[arange(B), last]`` follows the index
values, a reduction over it mixes samples. Nothing is inferred from a size that
happens to equal the batch size. An op the table does not know gives
:class:`Unknown` for a tensor that sample data flows into (the parameters it
meets then take an exact slower path, and say so), and :data:`SHARED` when none does.

Ops are matched by the function object the ``TorchFunctionMode`` receives
(``torch.add``, ``torch.Tensor.add``, ``torch.Tensor.__add__``, ...). The handlers
live by family in ``ops_elementwise.py``, ``ops_views.py``, ``ops_indexing.py``,
``ops_products.py`` and ``ops_layers.py``, which the package lists (its
``__init__``); each registers, with :func:`register`, every alias of its ops that
exists in this torch, and an op has one handler only. This module imports none of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .layouts import SHARED, Layout, Mixed, Piece, Unknown

Handler = Callable[["Ctx", Any, tuple, dict, Any], Any]
HANDLERS: dict[Any, Handler] = {}
GETTERS: dict[str, Handler] = {}  # Tensor properties (.T, .mT, .data) by name


@dataclass
class Ctx:
    """What a handler may ask: the batch size and the layout of any tensor; ``read(op)``
    notes that the op took a value of the samples' data as a constant (a number read out
    of the batch: the certificate then compares a sample alone), ``None`` where nothing
    notes it (such a value then is not taken for a constant)."""

    n: int
    layout_of: Callable[[Tensor], Layout]
    read: Callable[[str], None] | None = None

    def layout(self, t: Any) -> Layout:
        return self.layout_of(t) if isinstance(t, Tensor) else SHARED


@dataclass(frozen=True)
class Flow:
    """An op's result: one layout per output tensor, and per input tensor how the op
    pairs it with the samples (``pairing``: ``None`` for the default: batched inputs
    by their own layout, shared ones by none); ``writes``: inputs other than an in-place
    op's first that the op overwrites, with their layouts afterwards (the running
    statistics BatchNorm updates)."""

    outputs: Any  # a Layout, or a tuple of them for a tuple output
    pairing: tuple | None = None  # per input tensor (op_leaves order): Layout or None
    writes: tuple = ()  # (tensor, layout) pairs


def op_leaves(args: tuple, kwargs: dict) -> list:
    """The tensors an op reads: its arguments and the items of list/tuple arguments
    (``torch.cat([a, b])``, the LSTM's weight list), in order."""
    leaves = []
    for a in args:
        if isinstance(a, Tensor):
            leaves.append(a)
        elif isinstance(a, (list, tuple)):
            leaves += [x for x in a if isinstance(x, Tensor)]
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, Tensor):
                leaves.append(a)
            elif isinstance(a, (list, tuple)):
                leaves += [x for x in a if isinstance(x, Tensor)]
    return leaves


def in_place(func: Any, kwargs: dict) -> bool:
    """``x.add_(p)``, ``x += p``, ``torch.add(x, p, out=y)``, ``F.relu(x, inplace=True)``."""
    if kwargs and (kwargs.get("out") is not None or kwargs.get("inplace")):
        return True
    found = _IN_PLACE_NAMES.get(func)
    if found is None:
        name = getattr(func, "__name__", "")
        found = (name.endswith("_") and not name.endswith("__")) or name in IN_PLACE_OPERATORS
        _IN_PLACE_NAMES[func] = found
    return found


_IN_PLACE_NAMES: dict[Any, bool] = {}  # func -> its name says it writes its first argument
IN_PLACE_OPERATORS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "div", "mod", "pow", "lshift",
    "rshift", "and", "or", "xor"))
"""The augmented assignments' methods (``x += y``: ``__iadd__``); ``__invert__``,
``__index__`` and ``__int__`` begin alike and write nothing."""


def propagate(ctx: Ctx, func: Any, args: tuple, kwargs: dict, out: Any,
              layouts: list[Layout] | None = None) -> Flow:
    """The layouts of ``out = func(*args, **kwargs)`` (see the module docstring);
    ``layouts``: those of the op's leaves, if the caller has them already."""
    if layouts is None:
        layouts = [ctx.layout(t) for t in op_leaves(args, kwargs)]
    if any(type(lay) is Piece for lay in layouts) and not in_place(func, kwargs):
        carried = carried_piece(ctx, op_leaves(args, kwargs), out)
        if carried is not None:
            return Flow(carried)
    bad = worst(layouts)
    if bad is None:
        return Flow(every(out, SHARED))
    if isinstance(bad, (Mixed, Unknown)) and not _reads_values(func):
        return Flow(every(out, bad))
    handler = handler_of(func)
    if handler is None:
        return Flow(every(out, Unknown(f"no data-flow rule for {name_of(func)}")))
    got = handler(ctx, func, args, kwargs, out)  # raising here is a bug of the handler
    return got if isinstance(got, Flow) else Flow(got)


def own_layout(ctx: Ctx, t: Any, kind: type) -> Any:
    """``t``'s layout if it is of ``kind``, a layout that describes one tensor only
    (:class:`~persample.batch.layouts.Piece`, ``ops_indexing.Partly``), made for ``t``
    itself; else ``None``."""
    if not isinstance(t, Tensor):
        return None
    lay = ctx.layout(t)
    if isinstance(lay, kind) and lay.ref is not None and lay.ref() is t:
        return lay
    return None


def own_piece(ctx: Ctx, t: Any) -> Piece | None:
    """``t``'s layout if it is a :class:`~persample.batch.layouts.Piece` made for ``t``
    itself."""
    return own_layout(ctx, t, Piece)


def carried_piece(ctx: Ctx, tensors: list, out: Any) -> Any:
    """The layouts of an op's outputs where its tensors are one sample's pieces and
    shared tensors (whatever the op: each output entry is made of that sample's data
    and shared data alone): that sample's piece, for each output tensor; ``None`` where
    no input is a piece, or another input is not shared (pieces of other samples: the
    op's own rule decides, ``cat`` joining them into a batch dim)."""
    found = None
    for t in tensors:
        own = own_piece(ctx, t)
        if own is None and ctx.layout(t) is not SHARED:
            return None
        if own is not None:
            if found is not None and own.sample != found.sample:
                return None
            found = own
    if found is None:
        return None
    return _pieces_for(out, found)


def _pieces_for(out: Any, found: Piece) -> Any:
    if isinstance(out, Tensor):
        return Piece(found.why, found.sample, weakref.ref(out))
    if isinstance(out, (tuple, list)):
        return tuple(_pieces_for(o, found) for o in out)
    return SHARED  # (a non-tensor output: no layout)


Narrow = Callable[[Tensor], "Tensor | None"]
# ops that broadcast some tensor operands right-aligned: func -> (func, args, kwargs,
# narrow) -> the same call with operands replaced by the smaller tensors ``narrow`` gives
# for them, or ``None`` where the op's output would change (see :func:`unbroadcast`)
UNBROADCASTS: dict[Any, Callable[[Any, tuple, dict, Narrow], tuple | None]] = {}


def unbroadcast(func: Any, args: tuple, kwargs: dict, narrow: Narrow) -> tuple | None:
    """``(args, kwargs)`` of the same op, with operands that the op broadcasts anyway
    replaced by ``narrow(t)``: a smaller tensor that broadcasts to ``t`` (a tensor an
    ``expand`` made is read as the tensor it expanded). The output is the same, entry for
    entry; ``None`` where the op broadcasts nothing, ``narrow`` gives nothing, or the
    output's shape would change."""
    found = UNBROADCASTS.get(func)
    return None if found is None else found(func, args, kwargs, narrow)


def handler_of(func: Any) -> Handler | None:
    """The data-flow handler of ``func`` (a tensor property's ``__get__`` by its name), or
    ``None``."""
    found = HANDLERS.get(func)
    if found is None and getattr(func, "__name__", "") == "__get__":
        found = GETTERS.get(getattr(getattr(func, "__self__", None), "__name__", ""))
    return found


# Ops that read a mixed tensor only as positions (``index_select`` by ``torch.sort``'s
# indices, the lengths of ``pack_padded_sequence``, EmbeddingBag offsets): their rule runs
# even when such an input mixes samples, and checks the data inputs itself.
VALUE_READERS: set = set()


# Handlers whose decision reads no floating-point tensor's values: only layouts, shapes,
# and the values of integer and boolean tensors (indices, masks, counts). Elementwise ops,
# views of one input, and reads and writes at index values are; ``nonzero`` and sorts,
# whose positions come from any dtype's values, are not.
FLOAT_BLIND: set = set()


# Handlers whose decision reads no tensor's values at all where every layout they see is
# plain (batched by position, or shared): elementwise ops, and views and joins of whole
# tensors (:func:`reads_layouts_only`). Where a layout holds rows of no sample
# (``ops_indexing.Partly``) they read them, but such a layout is never plain.
LAYOUTS_ONLY: set = set()


def reads_layouts_only(func: Any, leaves: list) -> bool:
    """Does ``func``'s data flow, on plain layouts, read only its tensors' layouts and
    shapes, even of an integer or boolean tensor (a mask's ``ge``, ``to``, ``expand``, or
    ``mask[:, None]``: basic indexing, no index tensor)? Then a call like an earlier one
    may take the earlier call's flow."""
    handler = handler_of(func)
    if handler in LAYOUTS_ONLY:
        return True
    return func is torch.Tensor.__getitem__ and len(leaves) == 1


def reads_no_floats(func: Any) -> bool:
    """Does ``func``'s data flow depend on no floating-point tensor's values (its
    handler is in :data:`FLOAT_BLIND`)?"""
    return handler_of(func) in FLOAT_BLIND


# ops that read only their tensor arguments' shape, dtype and device (``zeros_like``)
SHAPE_READERS: set[Any] = set()

# reads of a tensor's metadata, which make no tensor: no data flow, nothing to record
METADATA: frozenset = frozenset(
    [getattr(torch._C.TensorBase, name).__get__ for name in (
        "shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_sparse", "is_meta",
        "is_quantized", "is_nested", "requires_grad", "is_leaf")]
    + [getattr(torch._C.TensorBase, name) for name in (
        "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
        "is_floating_point", "is_complex", "element_size", "is_contiguous", "get_device")]
    + [torch.Tensor.__len__]
    + [getattr(torch.ops.aten, op).default for op in ("sym_numel", "sym_storage_offset")]
    + [getattr(torch.ops.aten, op).int for op in ("sym_size", "sym_stride")])  # (in a
# compiled graph)


def _reads_values(func: Any) -> bool:
    return func in VALUE_READERS


def name_of(func: Any) -> str:
    owner = getattr(getattr(func, "__self__", None), "__name__", None)
    return f"{owner}.{func.__name__}" if owner and func.__name__ == "__get__" else getattr(
        func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def worst(layouts: list[Layout]) -> Layout | None:
    """Mixed over Unknown over batched; ``None`` when every input is shared."""
    found = None
    for lay in layouts:
        if isinstance(lay, Mixed):
            return lay
        if isinstance(lay, Unknown) or (lay is not SHARED and found is None):
            found = lay
    return found


def every(out: Any, layout: Layout) -> Any:
    """``layout`` for every tensor of ``out`` (a tensor or a tuple/list of them)."""
    if isinstance(out, (tuple, list)):
        return tuple(every(o, layout) for o in out)
    return layout


# handlers of ops that broadcast their inputs right-aligned against the output
# (elementwise ops, ``where``, the mask of ``scaled_dot_product_attention``)
BROADCASTING: set[Handler] = set()


def broadcasts(func: Any) -> bool:
    """Does the op broadcast its inputs right-aligned against its output (its handler is
    in :data:`BROADCASTING`)?"""
    return HANDLERS.get(func) in BROADCASTING


def register(handler: Handler, *funcs: Any, override: bool = False) -> None:
    for f in funcs:
        if f is None:
            continue
        if not override and HANDLERS.get(f, handler) is not handler:
            raise AssertionError(f"{f} has two data-flow rules")
        HANDLERS[f] = handler


def aliases(*names: str, where: tuple = ()) -> list:
    """Every function of these names in torch, torch.Tensor, torch.nn.functional,
    torch.special and torch.linalg (those that exist in this torch)."""
    spaces = where or (torch, torch.Tensor, F, torch.special, torch.linalg, torch._C._nn,
                       torch._C._VariableFunctions)
    found = []
    for name in names:
        for space in spaces:
            f = getattr(space, name, None)
            if f is not None and callable(f) and not isinstance(f, type):
                found.append(f)
    return found


def arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``name``) of an op, or ``default``."""
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def broadcast_shapes(*shapes: Any) -> tuple[int, ...]:
    """``torch.broadcast_shapes`` of plain integer shapes, in Python (torch's goes
    through its reference implementation: tens of microseconds a call); raises
    ``RuntimeError`` where they do not broadcast.

    Examples:
        >>> broadcast_shapes((3, 1), (1, 4)), broadcast_shapes((2,), ())
        ((3, 4), (2,))
    """
    found: list[int] = []
    for dims in zip_longest(*(reversed(tuple(s)) for s in shapes), fillvalue=1):
        size = 1
        for d in dims:
            if d != 1:
                if size != 1 and size != d:
                    raise RuntimeError(f"shapes {shapes} do not broadcast")
                size = d
        found.append(size)
    return tuple(reversed(found))


def dim_of(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def mixed(func: Any, what: str) -> Mixed:
    return Mixed(f"{name_of(func)} {what}")
