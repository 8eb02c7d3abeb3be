"""How each op carries the samples from its inputs to its outputs (data flow).

:func:`propagate` is the one place that decides the layout of an op's outputs
(:mod:`persample.batch.layouts`) from the layouts of its inputs and the op's own
semantics: an elementwise op keeps the batch where broadcasting puts it, a
``reshape`` moves it by index arithmetic (``(B, T, E) -> (B*T, E)`` merges it with
``T``), ``transpose`` permutes it, ``x[arange(B), last]`` follows the index
values, a reduction over it mixes samples. Nothing is inferred from a size that
happens to equal the batch size. An op the table does not know gives
:class:`Unknown` for a tensor that sample data flows into (the parameters it
meets then take an exact slower path, and say so), and :data:`FREE` when none does.

Ops are matched by the function object the ``TorchFunctionMode`` receives
(``torch.add``, ``torch.Tensor.add``, ``torch.Tensor.__add__``, ...); the
families below register every alias that exists in this torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .layouts import FREE, Batched, Layout, Mixed, Unknown

Handler = Callable[["Ctx", Any, tuple, dict, Any], Any]
_HANDLERS: dict[Any, Handler] = {}
_GETTERS: dict[str, Handler] = {}  # Tensor properties (.T, .mT, .data) by name


@dataclass
class Ctx:
    """What a handler may ask: the batch size and the layout of any tensor."""

    n: int
    layout_of: Callable[[Tensor], Layout]

    def layout(self, t: Any) -> Layout:
        return self.layout_of(t) if isinstance(t, Tensor) else FREE


@dataclass(frozen=True)
class Flow:
    """An op's result: one layout per output tensor, and per input tensor how the op
    pairs it with the samples (``align``: ``None`` for the default: batched inputs
    by their own layout, free ones shared)."""

    outputs: Any  # a Layout, or a tuple of them for a tuple output
    align: tuple | None = None  # per input tensor (op_leaves order): Layout or None


def op_leaves(args: tuple, kwargs: dict) -> list:
    """The tensors an op reads: its arguments and the items of list/tuple arguments
    (``torch.cat([a, b])``, the LSTM's weight list), in order."""
    leaves = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            leaves += [x for x in a if isinstance(x, Tensor)]
        elif isinstance(a, Tensor):
            leaves.append(a)
    return leaves


def in_place(func: Any, kwargs: dict) -> bool:
    """``x.add_(p)``, ``x += p``, ``torch.add(x, p, out=y)``, ``F.relu(x, inplace=True)``."""
    name = getattr(func, "__name__", "")
    return (kwargs.get("out") is not None or bool(kwargs.get("inplace"))
            or (name.endswith("_") and not name.endswith("__"))
            or (name.startswith("__i") and name.endswith("__")
                and name not in ("__index__", "__int__", "__init__", "__iter__")))


def propagate(ctx: Ctx, func: Any, args: tuple, kwargs: dict, out: Any) -> Flow:
    """The layouts of ``out = func(*args, **kwargs)`` (see the module docstring)."""
    leaves = op_leaves(args, kwargs)
    layouts = [ctx.layout(t) for t in leaves]
    worst = _worst(layouts)
    if worst is None:
        return Flow(_all(out, FREE))
    if isinstance(worst, (Mixed, Unknown)) and not _reads_values(func):
        return Flow(_all(out, worst))
    handler = _handler(func)
    if handler is None:
        return Flow(_all(out, Unknown(f"no data-flow rule for {_name(func)}")))
    try:
        got = handler(ctx, func, args, kwargs, out)
    except (IndexError, TypeError, ValueError, RuntimeError) as err:  # an unforeseen form
        return Flow(_all(out, Unknown(f"{_name(func)}: {err}")))
    return got if isinstance(got, Flow) else Flow(got)


def _handler(func: Any) -> Handler | None:
    found = _HANDLERS.get(func)
    if found is None and getattr(func, "__name__", "") == "__get__":
        found = _GETTERS.get(getattr(getattr(func, "__self__", None), "__name__", ""))
    return found


def _reads_values(func: Any) -> bool:
    """Ops that read a mixed index tensor only as positions (``index_select`` by
    ``torch.sort``'s indices, the lengths of ``pack_padded_sequence``)."""
    return func in _VALUE_READERS


def _name(func: Any) -> str:
    owner = getattr(getattr(func, "__self__", None), "__name__", None)
    return f"{owner}.{func.__name__}" if owner and func.__name__ == "__get__" else getattr(
        func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def _worst(layouts: list[Layout]) -> Layout | None:
    """Mixed over Unknown over batched; ``None`` when every input is free."""
    found = None
    for lay in layouts:
        if isinstance(lay, Mixed):
            return lay
        if isinstance(lay, Unknown) or (lay is not FREE and found is None):
            found = lay
    return found


def _all(out: Any, layout: Layout) -> Any:
    """``layout`` for every tensor of ``out`` (a tensor or a tuple/list of them)."""
    if isinstance(out, (tuple, list)):
        return tuple(_all(o, layout) for o in out)
    return layout


def _register(handler: Handler, *funcs: Any, override: bool = False) -> None:
    for f in funcs:
        if f is None:
            continue
        if not override and _HANDLERS.get(f, handler) is not handler:
            raise AssertionError(f"{f} has two data-flow rules")
        _HANDLERS[f] = handler


def _aliases(*names: str, where: tuple = ()) -> list:
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


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``name``) of an op, or ``default``."""
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _mixed(func: Any, what: str) -> Mixed:
    return Mixed(f"{_name(func)} {what}")


# ---------------------------------------------------------------------------
# elementwise ops: broadcasting right-aligns the inputs


def _self_only(ctx: Ctx, func, args, kwargs, out) -> Any:
    """Unary ops and ops whose other tensors are references only (``x.to(y)``)."""
    return _all(out, ctx.layout(args[0] if args else kwargs.get("input")))


def _broadcast(ctx: Ctx, func, args, kwargs, out) -> Flow:
    """Elementwise ops: each batched input's batch dim lands on the output dim
    broadcasting aligns it with. Inputs disagreeing on that dim mix samples."""
    shape = (args[0].shape if in_place(func, kwargs) and isinstance(args[0], Tensor)
             else _out_shape(out))
    if shape is None:
        return Flow(_all(out, Unknown(f"{_name(func)} returned no tensor")))
    leaves = op_leaves(args, kwargs)
    rank, found = len(shape), None
    for t in leaves:
        lay = ctx.layout(t)
        if not isinstance(lay, Batched):
            continue
        d = lay.dim + rank - t.dim()
        if t.shape[lay.dim] != shape[d]:  # one position (a sub-batch of one) spread wide
            return Flow(_all(out, _mixed(func, "spreads one sample's data over others")))
        here = lay.moved(d)
        if found is None:
            found = here
        elif found != here:
            return Flow(_all(out, _mixed(func, "combines samples from different dims")))
    if found is None:
        return Flow(_all(out, FREE))
    align = tuple(_aligned(ctx, t, found, rank) for t in leaves)
    return Flow(_all(out, found), align if any(a is not None for a in align) else None)


def _aligned(ctx: Ctx, t: Tensor, lay: Batched, rank: int) -> Layout | None:
    """How a broadcast input pairs with the samples: its own layout, a free input of
    full size along the batch dim (``cls.expand(B, 1, E)`` in ``cat``) as batched
    there, else shared."""
    own = ctx.layout(t)
    if own is not FREE:
        return own
    d = lay.dim - (rank - t.dim())
    if d >= 0 and t.shape[d] > 1:
        return lay.moved(d)
    return None


def _out_shape(out: Any) -> torch.Size | None:
    if isinstance(out, Tensor):
        return out.shape
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0].shape
    return None


_UNARY = """abs absolute acos arccos acosh arccosh asin arcsin asinh arcsinh atan arctan atanh
arctanh ceil clamp clip cos cosh deg2rad rad2deg digamma erf erfc erfinv exp exp2 expm1 fix
floor frac lgamma log log10 log1p log2 logit i0 isnan isinf isfinite isposinf isneginf isreal
nan_to_num neg negative positive reciprocal round rsqrt sigmoid sign sgn signbit sin sinc sinh
sqrt square tan tanh trunc relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh
hardswish hardsigmoid hardshrink softshrink tanhshrink softsign softplus logsigmoid threshold
rrelu dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d bitwise_not
logical_not float double half bfloat16 int long short bool byte char cpu cuda to type type_as
contiguous clone detach requires_grad_ conj resolve_conj resolve_neg pin_memory bernoulli
__neg__ __abs__ __invert__ __pos__ angle expit log_ndtr ndtr ndtri erfcx xlog1py entr sinc
polygamma mvlgamma fill_ zero_ normal_ uniform_ exponential_ cauchy_ log_normal_ geometric_
random_ detach_ relu_ sigmoid_ tanh_ exp_ log_ sqrt_ rsqrt_ neg_ abs_ clamp_ clip_ floor_
ceil_ round_ trunc_ reciprocal_ square_ sin_ cos_ hardtanh_ leaky_relu_ elu_ selu_ celu_
rrelu_ threshold_ nan_to_num_ bernoulli_ clamp_min clamp_max clamp_min_ clamp_max_""".split()

_BINARY = """add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow
float_power atan2 arctan2 hypot maximum minimum fmax fmin eq ne lt le gt ge greater less
greater_equal less_equal not_equal logical_and logical_or logical_xor bitwise_and bitwise_or
bitwise_xor bitwise_left_shift bitwise_right_shift where masked_fill lerp addcmul addcdiv
copysign xlogy heaviside rsub isclose __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__
__mul__ __rmul__ __imul__ __truediv__ __rtruediv__ __itruediv__ __div__ __rdiv__ __idiv__
__floordiv__ __rfloordiv__ __ifloordiv__ __mod__ __rmod__ __imod__ __pow__ __rpow__ __ipow__
__and__ __or__ __xor__ __rand__ __ror__ __rxor__ __iand__ __ior__ __ixor__ __eq__ __ne__
__lt__ __le__ __gt__ __ge__ __lshift__ __rshift__ __ilshift__ __irshift__ add_ sub_ mul_
div_ true_divide_ floor_divide_ remainder_ fmod_ pow_ masked_fill_ lerp_ addcmul_ addcdiv_
maximum_ minimum_ copysign_ xlogy_ logical_and_ logical_or_ bitwise_and_ bitwise_or_ eq_ ne_
lt_ le_ gt_ ge_ atan2_ hypot_ copy_ subtract_ multiply_ divide_ clamp""".split()

# ops whose extra tensor arguments are references (dtype, device, shape), not data
_SELF_ONLY = "to type_as type contiguous".split()
_FREE_DATA = """zeros_like ones_like empty_like full_like rand_like randn_like randint_like
new_zeros new_ones new_full new_empty new_tensor""".split()


def _free(ctx, func, args, kwargs, out) -> Any:
    """Ops whose data does not come from their tensor arguments (``zeros_like``)."""
    return _all(out, FREE)


_register(_broadcast, *_aliases(*_BINARY))
_register(_self_only, *_aliases(*[u for u in _UNARY if u not in ("clamp", "clip", "clamp_",
                                                                 "clip_")]))
_register(_broadcast, *_aliases("clamp", "clip", "clamp_", "clip_"))
_register(_free, *_aliases(*_FREE_DATA))


def _where(ctx, func, args, kwargs, out) -> Any:
    if len(args) + len(kwargs) == 1:  # where(cond): nonzero
        return _positions_of(ctx, func, args[0], out)
    return _broadcast(ctx, func, args, kwargs, out)


_register(_where, *_aliases("where"), override=True)


def _positions_of(ctx, func, x, out) -> Any:
    lay = ctx.layout(x)
    return _all(out, FREE if lay is FREE else Unknown(f"{_name(func)} lists positions"))


_register(lambda c, f, a, k, o: _positions_of(c, f, a[0], o),
          *_aliases("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"))


# ---------------------------------------------------------------------------
# reductions and ops along one dim


def _dims_arg(args, kwargs, pos: int, rank: int) -> list[int] | None:
    """The ``dim`` argument (position ``pos`` or keyword) as a list; ``None``: all."""
    d = kwargs.get("dim", kwargs.get("axis", args[pos] if len(args) > pos else None))
    if d is None:
        return None
    if isinstance(d, (tuple, list)):
        return [_dim(x, rank) for x in d] if d else None
    if isinstance(d, int):
        return [_dim(d, rank)]
    raise TypeError(f"dim={d!r}")


def _reduce(ctx, func, args, kwargs, out, pos: int = 1) -> Any:
    """``sum(x, dim, keepdim)`` and kin: reducing over the batch dim mixes samples."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return _all(out, lay)
    dims = _dims_arg(args, kwargs, pos, x.dim())
    if dims is None or lay.dim in dims:
        return _all(out, _mixed(func, "reduces over the batch"))
    keep = kwargs.get("keepdim", args[pos + 1] if len(args) > pos + 1 and isinstance(
        args[pos + 1], bool) else False)
    d = lay.dim if keep else lay.dim - sum(1 for r in dims if r < lay.dim)
    return _all(out, lay.moved(d))


_register(_reduce, *_aliases(
    "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "argmax", "argmin", "all",
    "any", "logsumexp", "count_nonzero", "median", "nanmedian", "mode", "var", "std",
    "var_mean", "std_mean", "aminmax"))
_register(lambda c, f, a, k, o: _reduce(c, f, a, k, o, pos=2), *_aliases("kthvalue"))


def _norm(ctx, func, args, kwargs, out) -> Any:
    """``x.norm(p, dim, keepdim)`` / ``linalg.vector_norm(x, ord, dim, keepdim)``."""
    return _reduce(ctx, func, args, kwargs, out, pos=2)


_register(_norm, *_aliases("norm", "vector_norm", "linalg_vector_norm"))


def _max_min(ctx, func, args, kwargs, out) -> Any:
    """``max(x)`` (all), ``max(x, dim)``, or the elementwise ``max(x, y)``."""
    if len(args) > 1 and isinstance(args[1], Tensor) or isinstance(kwargs.get("other"), Tensor):
        return _broadcast(ctx, func, args, kwargs, out)
    return _reduce(ctx, func, args, kwargs, out)


_register(_max_min, *_aliases("max", "min"))


def _along(ctx, func, args, kwargs, out, pos: int = 1) -> Any:
    """``softmax(x, dim)`` and kin: the shape is kept; along the batch dim samples mix."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return _all(out, lay)
    dims = _dims_arg(args, kwargs, pos, x.dim())
    if dims is None or lay.dim in dims:
        return _all(out, _mixed(func, "works along the batch dim"))
    return _all(out, lay)


_register(_along, *_aliases(
    "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin",
    "logcumsumexp", "sort", "argsort", "normalize", "gumbel_softmax", "cumsum_", "cumprod_",
    "diff", "msort"))
_register(lambda c, f, a, k, o: _along(c, f, a, k, o, pos=2), *_aliases("topk"))
_register(lambda c, f, a, k, o: _along(c, f, a, k, o, pos=1), *_aliases("flip"))


def _roll(ctx, func, args, kwargs, out) -> Any:
    lay = ctx.layout(args[0])
    if isinstance(lay, Batched):
        dims = _dims_arg(args, {"dim": _arg(args, kwargs, 2, "dims", None)},
                         99, args[0].dim())
        if dims is None or lay.dim in dims:
            return _mixed(func, "rolls along the batch dim")
    return lay


_register(_roll, *_aliases("roll"))


def _glu(ctx, func, args, kwargs, out) -> Any:
    lay = ctx.layout(args[0])
    d = _dim(_arg(args, kwargs, 1, "dim", -1), args[0].dim())
    if isinstance(lay, Batched) and lay.dim == d:
        return _mixed(func, "splits the batch dim")
    return lay


_register(_glu, *_aliases("glu"))


# ---------------------------------------------------------------------------
# views: the batch moves with its dim


def _reshape(ctx, func, args, kwargs, out) -> Any:
    """``view``/``reshape``/``flatten``/``unflatten``: where the batch's index digit
    lands in the new shape (row-major index arithmetic, exact)."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not isinstance(out, Tensor):
        return lay
    return reshaped(lay, tuple(x.shape), tuple(out.shape), ctx.n) or Unknown(
        f"{_name(func)} {tuple(x.shape)} -> {tuple(out.shape)} splits the batch dim")


def reshaped(lay: Batched, before: tuple, after: tuple, n: int) -> Batched | None:
    """The layout after reshaping ``before`` to ``after``, or ``None`` if the samples'
    index digit is split across dims.

    In the row-major index the sample is a digit of radix ``n`` and place value
    ``P = inner * prod(before[dim+1:])``. Output dim ``k`` holds the place values
    ``S_k .. S_k * after[k]`` (``S_k = prod(after[k+1:])``); the digit fits in it iff
    ``S_k`` divides ``P`` and ``P * n`` divides ``S_k * after[k]``.
    """
    if lay.index is not None:  # irregular: only if the batch dim itself is untouched
        d = lay.dim
        prefix = math.prod(before[:d])
        suffix = math.prod(before[d + 1:])
        acc = 1
        for k in range(len(after)):
            if acc == prefix and after[k] == before[d] and math.prod(after[k + 1:]) == suffix:
                return lay.moved(k)
            acc *= after[k]
        return None
    place = lay.inner * math.prod(before[lay.dim + 1:])
    suffix = 1
    for k in range(len(after) - 1, -1, -1):
        size = after[k]
        if place % suffix == 0 and (suffix * size) % (place * n) == 0 and size > 1:
            inner = place // suffix
            return Batched(k, size // (inner * n), inner)
        suffix *= size
    return None


_register(_reshape, *_aliases("view", "reshape", "flatten", "unflatten", "ravel",
                              "view_as", "reshape_as", "_reshape_alias"))
_register(_self_only, *_aliases(*_SELF_ONLY))


def _view_or_dtype(ctx, func, args, kwargs, out) -> Any:
    """``x.view(dtype)`` reinterprets the last dim; ``x.view(*shape)`` reshapes."""
    if len(args) == 2 and isinstance(args[1], torch.dtype):
        lay = ctx.layout(args[0])
        if isinstance(lay, Batched) and lay.dim == args[0].dim() - 1:
            return Unknown("view(dtype) on the batch dim")
        return lay
    return _reshape(ctx, func, args, kwargs, out)


_register(_view_or_dtype, torch.Tensor.view, override=True)


def _permute(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    if "dims" in kwargs:
        dims = kwargs["dims"]
    else:
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    order = [_dim(d, x.dim()) for d in dims]
    return lay.moved(order.index(lay.dim))


_register(_permute, *_aliases("permute"))


def _transpose(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    a = _dim(_arg(args, kwargs, 1, "dim0", 0), x.dim())
    b = _dim(_arg(args, kwargs, 2, "dim1", 1), x.dim())
    d = lay.dim
    return lay.moved(b if d == a else a if d == b else d)


_register(_transpose, *_aliases("transpose", "swapaxes", "swapdims", "transpose_"))


def _t(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if isinstance(lay, Batched) and x.dim() == 2:
        return lay.moved(1 - lay.dim)
    return lay


def _last_two(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if isinstance(lay, Batched) and x.dim() >= 2 and lay.dim >= x.dim() - 2:
        return lay.moved(2 * x.dim() - 3 - lay.dim)
    return lay


_register(_t, *_aliases("t", "t_"))
_GETTERS.update({"T": _t, "mT": _last_two, "H": _t, "mH": _last_two,
                 "data": _self_only, "real": _self_only, "imag": _self_only})


def _movedim(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    src = _arg(args, kwargs, 1, "source")
    dst = _arg(args, kwargs, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    rank = x.dim()
    src, dst = [_dim(s, rank) for s in src], [_dim(d, rank) for d in dst]
    order = [None] * rank
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(i for i in range(rank) if i not in src)
    order = [o if o is not None else next(rest) for o in order]
    return lay.moved(order.index(lay.dim))


_register(_movedim, *_aliases("movedim", "moveaxis"))


def _squeeze(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not isinstance(out, Tensor):
        return lay
    dims = _dims_arg(args, kwargs, 1, x.dim())
    dims = [d for d in (dims if dims is not None else range(x.dim())) if x.shape[d] == 1]
    return lay.moved(lay.dim - sum(1 for d in dims if d < lay.dim))


def _unsqueeze(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    d = _dim(_arg(args, kwargs, 1, "dim"), x.dim() + 1)
    return lay.moved(lay.dim + (1 if d <= lay.dim else 0))


_register(_squeeze, *_aliases("squeeze", "squeeze_"))
_register(_unsqueeze, *_aliases("unsqueeze", "unsqueeze_"))


def _expand(ctx, func, args, kwargs, out) -> Any:
    """``expand``/``broadcast_to``: new leading dims shift the batch dim."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not isinstance(out, Tensor):
        return lay
    d = lay.dim + out.dim() - x.dim()
    if out.shape[d] != x.shape[lay.dim]:
        return Unknown(f"{_name(func)} broadcasts the batch dim")
    return lay.moved(d)


_register(_expand, *_aliases("expand", "broadcast_to"))


def _repeat(ctx, func, args, kwargs, out) -> Any:
    """``x.repeat(*reps)`` tiles: the batch dim repeated ``r`` times gets ``outer * r``."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or lay.index is not None:
        return lay if not isinstance(lay, Batched) else Unknown("repeat of an irregular batch")
    reps = list(args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size))
                else args[1:])
    d = lay.dim + len(reps) - x.dim()
    return Batched(d, lay.outer * reps[d], lay.inner)


_register(_repeat, *_aliases("repeat", "tile"))


def _repeat_interleave(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    reps = _arg(args, kwargs, 1, "repeats", None)
    dim = _arg(args, kwargs, 2, "dim", None)
    if dim is None or not isinstance(reps, int) or lay.index is not None:
        return Unknown("repeat_interleave without one int repeat count along a dim")
    dim = _dim(dim, x.dim())
    if dim != lay.dim:
        return lay
    return Batched(lay.dim, lay.outer, lay.inner * reps)


_register(_repeat_interleave, *_aliases("repeat_interleave"))


def _narrow(ctx, func, args, kwargs, out) -> Any:
    """``narrow``/``select`` along a dim other than the batch's keep it (shifted)."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    d = _dim(_arg(args, kwargs, 1, "dim"), x.dim())
    if d == lay.dim:
        if isinstance(out, Tensor) and out.shape == x.shape:
            return lay
        return Unknown(f"{_name(func)} takes part of the batch dim")
    if func in (torch.select, torch.Tensor.select) and d < lay.dim:
        return lay.moved(lay.dim - 1)
    return lay


_register(_narrow, *_aliases("narrow", "select"))


def _pieces(ctx, func, args, kwargs, out) -> Any:
    """``split``/``chunk``/``tensor_split``/``unbind`` along a dim other than the batch."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return _all(out, lay)
    pos = 1 if func in _UNBINDS else 2  # unbind(x, dim); split(x, sizes, dim)
    d = _dim(kwargs.get("dim", args[pos] if len(args) > pos else 0), x.dim())
    if d == lay.dim:
        return _all(out, Unknown(f"{_name(func)} cuts the batch dim"))
    if func in _UNBINDS:
        return _all(out, lay.moved(lay.dim - (1 if d < lay.dim else 0)))
    return _all(out, lay)


_UNBINDS = set(_aliases("unbind"))
_register(_pieces, *_aliases("split", "chunk", "tensor_split", "split_with_sizes", "unbind",
                             "unsafe_split", "unsafe_chunk"))


def _cat(ctx, func, args, kwargs, out) -> Flow:
    """``cat``: along another dim the batched inputs must agree (free inputs of full
    size are paired with the samples); along the batch dim, ``k`` plain batched
    inputs give ``outer = k``."""
    tensors = [t for t in (args[0] if args else kwargs["tensors"]) if isinstance(t, Tensor)]
    rank = out.dim()
    d = _dim(kwargs.get("dim", _arg(args, kwargs, 1, "axis", 0)), rank)
    lays = [ctx.layout(t) for t in tensors if t.dim() == rank]
    batched = [lay for lay in lays if isinstance(lay, Batched)]
    first = batched[0]
    if first.dim == d:
        if len(batched) == len(lays) and all(lay.plain for lay in batched):
            return Flow(Batched(d, len(batched), 1))
        return Flow(Unknown("cat along the batch dim of unlike tensors"))
    if any(lay != first for lay in batched):
        return Flow(_mixed(func, "joins tensors with samples in different dims"))
    align = tuple(ctx.layout(t) if ctx.layout(t) is not FREE else (
        first if t.dim() == rank and t.shape[first.dim] == out.shape[first.dim] else None)
        for t in tensors)
    return Flow(first, align)


def _stack(ctx, func, args, kwargs, out) -> Any:
    tensors = [t for t in (args[0] if args else kwargs["tensors"]) if isinstance(t, Tensor)]
    rank = out.dim()
    d = _dim(_arg(args, kwargs, 1, "dim", 0), rank)
    lays = [ctx.layout(t) for t in tensors]
    batched = [lay for lay in lays if isinstance(lay, Batched)]
    first = batched[0]
    if any(lay != first for lay in batched):
        return _mixed(func, "joins tensors with samples in different dims")
    if len(batched) != len(lays):
        return Unknown("stack of batched and free tensors")
    return first.moved(first.dim + (1 if d <= first.dim else 0))


_register(_cat, *_aliases("cat", "concat", "concatenate"))
_register(_stack, *_aliases("stack"))


def _pad(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    pad = _arg(args, kwargs, 1, "pad")
    padded = {x.dim() - 1 - k // 2 for k, p in enumerate(pad) if p}
    if lay.dim in padded:
        return Unknown("F.pad pads the batch dim")
    return lay


_register(_pad, F.pad, getattr(torch._C._nn, "pad", None))


def _unfold_dim(ctx, func, args, kwargs, out) -> Any:
    """``x.unfold(dim, size, step)``: a new last dim; the batch dim must not be unfolded."""
    x = args[0]
    lay = ctx.layout(x)
    if isinstance(lay, Batched) and _dim(args[1], x.dim()) == lay.dim:
        return Unknown("unfold of the batch dim")
    return lay


_register(_unfold_dim, torch.Tensor.unfold)


# ---------------------------------------------------------------------------
# indexing


def _getitem(ctx, func, args, kwargs, out) -> Any:
    """``x[...]``: basic indices move the batch dim; an index tensor on the batch dim
    gives the samples by its values (``logits[arange(B), last]`` keeps them in order)."""
    x, index = args[0], args[1]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not isinstance(out, Tensor):
        lay_i = _worst([ctx.layout(t) for t in _index_tensors(index)])
        if lay_i is not None and lay is FREE:
            return _indexed_by_batched(ctx, func, x, index, out)
        return lay
    return indexed_layout(ctx, lay, x, index, out) or Unknown(
        f"indexing {tuple(x.shape)} with {_describe(index)} moves the samples irregularly")


def _index_tensors(index: Any) -> list[Tensor]:
    items = index if isinstance(index, tuple) else (index,)
    return [i for i in items if isinstance(i, Tensor)]


def _describe(index: Any) -> str:
    items = index if isinstance(index, tuple) else (index,)
    return "[" + ", ".join(f"tensor{tuple(i.shape)}" if isinstance(i, Tensor) else repr(i)
                           for i in items) + "]"


def _indexed_by_batched(ctx, func, x: Tensor, index: Any, out: Tensor) -> Any:
    """A free tensor indexed by batched ids (a table lookup): the ids' samples, if the
    one index tensor indexes dim 0 and the rest is basic."""
    items = index if isinstance(index, tuple) else (index,)
    if (len(items) >= 1 and isinstance(items[0], Tensor) and items[0].dtype != torch.bool
            and not any(isinstance(i, Tensor) for i in items[1:])
            and all(i == slice(None) or i is Ellipsis for i in items[1:])):
        lay = ctx.layout(items[0])
        return lay
    return Unknown("a table indexed by per-sample ids in a form not followed")


def indexed_layout(ctx, lay: Batched, x: Tensor, index: Any, out: Tensor) -> Layout | None:
    """The layout of ``x[index]`` for ``x`` batched at ``lay.dim``; ``None`` if not exact."""
    items = list(index) if isinstance(index, tuple) else [index]
    # expand the ellipsis and count dims consumed
    consumed = sum(1 if (isinstance(i, (int, slice)) or (isinstance(i, Tensor) and
                                                        i.dtype != torch.bool))
                   else i.dim() if isinstance(i, Tensor) else 0 for i in items
                   if i is not None and i is not Ellipsis)
    if any(i is Ellipsis for i in items):
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (x.dim() - consumed) + items[k + 1:]
    else:
        items = items + [slice(None)] * (x.dim() - consumed)
    advanced = [k for k, i in enumerate(items) if isinstance(i, (Tensor, list))]
    # walk the items: which input dim each consumes, where basic dims land
    in_dim, out_basic, batch_item = 0, [], None
    for k, item in enumerate(items):
        if item is None:
            out_basic.append(("new", k))
            continue
        width = item.dim() if isinstance(item, Tensor) and item.dtype == torch.bool else 1
        covers = range(in_dim, in_dim + width)
        if lay.dim in covers:
            batch_item = k
        if isinstance(item, slice):
            out_basic.append(("dim", k, in_dim))
        in_dim += width
    if not advanced:
        return _basic_indexed(lay, x, items, out)
    if any(isinstance(items[k], Tensor) and items[k].dtype == torch.bool for k in advanced):
        return _masked(ctx, lay, x, items, advanced, out)
    index_tensors = [torch.as_tensor(items[k]) for k in advanced]
    shape = torch.broadcast_shapes(*[t.shape for t in index_tensors])
    adjacent = advanced == list(range(advanced[0], advanced[-1] + 1))
    # result dims: basic dims before the advanced block, the block, the basic dims after
    before = [b for b in out_basic if b[1] < advanced[0]] if adjacent else []
    start = sum(1 for b in before)
    if batch_item is None or batch_item not in advanced:
        if any(ctx.layout(t) is not FREE for t in index_tensors):
            return None
        # the batch dim is a basic dim: find where it lands
        pos = 0
        basics = [b for b in out_basic]
        if adjacent:
            order = [b for b in basics if b[1] < advanced[0]] + ["adv"] + [
                b for b in basics if b[1] > advanced[-1]]
        else:
            order = ["adv"] + basics
        for b in order:
            if b == "adv":
                pos += len(shape)
                continue
            if b[0] == "dim" and b[2] == lay.dim:
                if items[b[1]] != slice(None) and out.shape[pos] != x.shape[lay.dim]:
                    return None
                return lay.moved(pos)
            pos += 1
        return None
    # the batch dim is indexed by a tensor: its values name the samples
    if not lay.plain:
        return None
    where = advanced.index(batch_item)
    samples = index_tensors[where]
    if ctx.layout(samples) is not FREE or samples.dtype == torch.bool:
        return None
    samples = _dim_index(samples, x.shape[lay.dim]).expand(shape)
    other = [t for k, t in enumerate(index_tensors) if k != where]
    # find the one dim of the block along which the samples vary as arange(n)
    for k in range(len(shape)):
        if shape[k] != ctx.n:
            continue
        ref = torch.arange(ctx.n, device=samples.device).view(
            [ctx.n if j == k else 1 for j in range(len(shape))])
        if not bool((samples == ref).all()):
            continue
        if all(_index_pairs(ctx, t, shape, k) for t in other):
            return Batched(start + k)
    return None


def _masked(ctx, lay: Batched, x: Tensor, items: list, advanced: list, out: Tensor
            ) -> Layout | None:
    """``x[mask]`` with one boolean mask over the leading dims, the batch among them:
    the kept positions, in row-major order, each of its sample (``mask.nonzero()``)."""
    mask = items[advanced[0]]
    if (advanced != [0] or not lay.plain or lay.dim >= mask.dim()
            or any(i != slice(None) for i in items[1:])):
        return None
    index = mask.nonzero()[:, lay.dim]
    if index.numel() == ctx.n and bool((index == torch.arange(ctx.n, device=index.device)).all()):
        return Batched(0)
    return Batched(0, index=index)


def _index_pairs(ctx, t: Tensor, shape: torch.Size, k: int) -> bool:
    """Another index tensor of the block: free, or batched along block dim ``k`` plainly."""
    lay = ctx.layout(t)
    if lay is FREE:
        return True
    return isinstance(lay, Batched) and lay.plain and lay.dim + len(shape) - t.dim() == k


def _dim_index(t: Tensor, size: int) -> Tensor:
    t = t.long()
    return torch.where(t < 0, t + size, t)


def _basic_indexed(lay: Batched, x: Tensor, items: list, out: Tensor) -> Layout | None:
    pos, in_dim = 0, 0
    for item in items:
        if item is None:
            pos += 1
            continue
        if in_dim == lay.dim:
            if isinstance(item, int):
                return None  # one position of the batch dim: not a batch any more
            if item != slice(None) and out.shape[pos] != x.shape[lay.dim]:
                start, stop, step = item.indices(x.shape[lay.dim])
                if lay.plain:
                    return Batched(pos, index=torch.arange(start, stop, step,
                                                           device=x.device))
                return None
            return lay.moved(pos)
        if isinstance(item, slice):
            pos += 1
        in_dim += 1
    return None


_register(_getitem, torch.Tensor.__getitem__)


def _index_select(ctx, func, args, kwargs, out) -> Any:
    """``index_select(dim, idx)``: on the batch dim the samples follow ``idx``'s values."""
    x = args[0]
    lay = ctx.layout(x)
    d = _dim(_arg(args, kwargs, 1, "dim"), x.dim())
    idx = _arg(args, kwargs, 2, "index")
    if not isinstance(lay, Batched):
        if lay is FREE and ctx.layout(idx) is not FREE:
            return Unknown("a free tensor indexed by per-sample positions")
        return lay
    if d != lay.dim:
        return lay if ctx.layout(idx) is FREE else Unknown("index_select by per-sample ids")
    if ctx.layout(idx) not in (FREE,) and not isinstance(ctx.layout(idx), Mixed):
        return Unknown("index_select of the batch dim by per-sample ids")
    base = lay.index if lay.index is not None else (
        torch.arange(ctx.n, device=x.device) if lay.plain else None)
    if base is None:
        return Unknown("index_select of a merged batch dim")
    index = base[_dim_index(idx, x.shape[d])]
    if index.numel() == ctx.n and bool((index == torch.arange(ctx.n, device=index.device)).all()):
        return Batched(d)
    return Batched(d, index=index)


_register(_index_select, *_aliases("index_select"))
_VALUE_READERS = set(_aliases("index_select", "_pack_padded_sequence")) | {
    F.embedding_bag, torch.embedding_bag}


def _gather(ctx, func, args, kwargs, out) -> Any:
    """``gather(x, dim, index)``: the output has ``index``'s shape; along dims other than
    ``dim`` it pairs positions with ``x``; the batch must not be the gathered dim."""
    x = args[0]
    d = _dim(_arg(args, kwargs, 1, "dim"), x.dim())
    idx = _arg(args, kwargs, 2, "index")
    lx, li = ctx.layout(x), ctx.layout(idx)
    found = [lay for lay in (lx, li) if isinstance(lay, Batched)]
    if any(lay.dim == d for lay in found):
        return Unknown(f"{_name(func)} along the batch dim")
    if len(found) == 2 and found[0] != found[1]:
        return _mixed(func, "pairs samples from different dims")
    lay = found[0]
    if idx.shape[lay.dim] != x.shape[lay.dim]:
        return Unknown(f"{_name(func)} with an index not covering the batch")
    return lay


_register(_gather, *_aliases("gather", "take_along_dim"))


# ---------------------------------------------------------------------------
# matrix products


def _linear(ctx, func, args, kwargs, out) -> Any:
    """``linear(x, W, b)``: the batch stays where it is unless it is the feature dim."""
    x = _arg(args, kwargs, 0, "input")
    w = _arg(args, kwargs, 1, "weight", None)
    lay = ctx.layout(x)
    others = [ctx.layout(t) for t in (w, _arg(args, kwargs, 2, "bias", None))]
    if any(o is not FREE for o in others):
        return Unknown(f"{_name(func)} with a per-sample weight")
    if isinstance(lay, Batched) and lay.dim == x.dim() - 1:
        return _mixed(func, "contracts the batch dim")
    return lay


_register(_linear, *_aliases("linear"))


def _matmul(ctx, func, args, kwargs, out) -> Any:
    """``a @ b`` with broadcasting batch dims: a batch in ``a``'s rows or ``b``'s columns
    or a broadcast dim stays; in the contracted dim it mixes samples. A free operand of
    full size in the batch's broadcast dim is paired with the samples
    (DeBERTa's relative keys repeated to ``(B*H, ...)``)."""
    a, b = (args[0], args[1]) if func not in _ADDMM else (args[1], args[2])
    la, lb = ctx.layout(a), ctx.layout(b)
    rank = out.dim()
    place = []
    for t, lay, side in ((a, la, "a"), (b, lb, "b")):
        if not isinstance(lay, Batched):
            continue
        r = t.dim()
        if r == 1:
            return _mixed(func, "contracts the batch dim")
        if side == "a":
            if lay.dim == r - 1:
                return _mixed(func, "contracts the batch dim")
            d = rank - 1 - (1 if b.dim() > 1 else 0) if lay.dim == r - 2 else (
                lay.dim + rank - r)
        else:
            if lay.dim == r - 2:
                return _mixed(func, "contracts the batch dim")
            d = rank - 1 if lay.dim == r - 1 else lay.dim + rank - r
        if lay.dim < r - 2 and t.shape[lay.dim] != out.shape[d]:
            return _mixed(func, "spreads one sample's data over others")
        place.append(lay.moved(d))
    if len(place) == 2 and place[0] != place[1]:
        return _mixed(func, "pairs samples of its two operands")
    found = place[0] if place else FREE
    if func in _ADDMM:
        bias = ctx.layout(args[0])
        if isinstance(bias, Batched) and bias.moved(bias.dim + rank - args[0].dim()) != found:
            return _mixed(func, "adds samples from different dims")
    if not isinstance(found, Batched) or found.dim >= rank - 2:
        return found
    align = []
    for t in op_leaves(args, kwargs):
        own = ctx.layout(t)
        d = found.dim - (rank - t.dim())
        if own is not FREE:
            align.append(own)
        elif 0 <= d < t.dim() - 2 and t.shape[d] == out.shape[found.dim] > 1:
            align.append(found.moved(d))
        else:
            align.append(None)
    return Flow(found, tuple(align))


_ADDMM = set(_aliases("addmm", "baddbmm", "addmm_", "baddbmm_", "addmv"))
_register(_matmul, *_aliases("matmul", "mm", "bmm", "__matmul__", "addmm", "baddbmm", "mv",
                             "addmv", "addmm_", "baddbmm_"))


def _rmatmul(ctx, func, args, kwargs, out) -> Any:
    return _matmul(ctx, torch.matmul, (args[1], args[0]), {}, out)


_register(_rmatmul, torch.Tensor.__rmatmul__)


def _einsum(ctx, func, args, kwargs, out) -> Any:
    """``einsum``: the batch's letter, if the output keeps it."""
    equation = args[0].replace(" ", "")
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if "..." in equation or "->" not in equation:
        return Unknown("einsum with '...' or an implicit output")
    inputs, output = equation.split("->")
    found = None
    for spec, t in zip(inputs.split(","), operands):
        lay = ctx.layout(t)
        if not isinstance(lay, Batched):
            continue
        letter = spec[lay.dim]
        if letter not in output:
            return _mixed(func, "sums over the batch")
        here = lay.moved(output.index(letter))
        if found is not None and found != here:
            return _mixed(func, "pairs samples of its operands")
        found = here
    return found or FREE


_register(_einsum, *_aliases("einsum"))


def _bilinear(ctx, func, args, kwargs, out) -> Any:
    l1, l2 = ctx.layout(args[0]), ctx.layout(args[1])
    found = [lay for lay in (l1, l2) if isinstance(lay, Batched)]
    if any(lay.dim == args[0].dim() - 1 for lay in found):
        return _mixed(func, "contracts the batch dim")
    if len(found) == 2 and found[0] != found[1]:
        return _mixed(func, "pairs samples of its operands")
    return found[0]


_register(_bilinear, *_aliases("bilinear"))


# ---------------------------------------------------------------------------
# layers: the op's own batch dim (0) holds the samples


def _leading(ctx, func, args, kwargs, out, spatial: int | None = None) -> Any:
    """Ops on ``(N, C, *s)`` (convolutions, pooling, GroupNorm, ...): the samples must
    be in (or merged into) dim 0, the op's batch; an unbatched input ``(C, *s)`` has
    its samples in the channels, mixing them."""
    x = _arg(args, kwargs, 0, "input")
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return _all(out, lay)
    if lay.dim != 0:
        return _all(out, _mixed(func, f"has the samples in dim {lay.dim}, which it mixes "
                                      "(an unbatched input?)"))
    if spatial is not None and x.dim() != spatial + 2:
        return _all(out, _mixed(func, "got an unbatched input, whose samples are its "
                                      "channels"))
    if isinstance(out, (tuple, list)):
        return tuple(lay if isinstance(o, Tensor) and o.dim() and o.shape[0] == x.shape[0]
                     else Unknown("an output without the batch dim") for o in out)
    if out.shape[0] != x.shape[0]:
        return Unknown(f"{_name(func)} changed the op's batch dim")
    return lay


for _k, _names in {1: ["conv1d", "conv_transpose1d", "max_pool1d", "avg_pool1d",
                       "adaptive_avg_pool1d", "adaptive_max_pool1d", "lp_pool1d",
                       "max_pool1d_with_indices", "adaptive_max_pool1d_with_indices"],
                   2: ["conv2d", "conv_transpose2d", "max_pool2d", "avg_pool2d",
                       "adaptive_avg_pool2d", "adaptive_max_pool2d", "lp_pool2d",
                       "max_pool2d_with_indices", "adaptive_max_pool2d_with_indices",
                       "fractional_max_pool2d", "pixel_shuffle", "pixel_unshuffle",
                       "grid_sample", "channel_shuffle"],
                   3: ["conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d",
                       "adaptive_avg_pool3d", "adaptive_max_pool3d", "lp_pool3d",
                       "max_pool3d_with_indices", "adaptive_max_pool3d_with_indices",
                       "fractional_max_pool3d"]}.items():
    _register(lambda c, f, a, k, o, s=_k: _leading(c, f, a, k, o, s), *_aliases(*_names))
_register(_leading, *_aliases("group_norm", "instance_norm", "interpolate", "upsample",
                              "upsample_nearest", "upsample_bilinear", "local_response_norm",
                              "convolution", "_convolution"), F.unfold, F.fold)


def _prelu(ctx, func, args, kwargs, out) -> Any:
    """``prelu(x, w)``: one slope per channel (dim 1) or one shared slope."""
    x, w = args[0], args[1]
    lay = ctx.layout(x)
    if isinstance(lay, Batched) and lay.dim == 1 and w.numel() > 1:
        return _mixed(func, "has per-channel slopes on the batch dim")
    return lay


_register(_prelu, *_aliases("prelu", "_prelu_kernel"))


def _trailing(ctx, func, args, kwargs, out) -> Any:
    """``layer_norm``/``rms_norm(x, shape, ...)``: the trailing ``shape`` dims are
    normalised together, so the batch must be before them."""
    x = _arg(args, kwargs, 0, "input")
    shape = _arg(args, kwargs, 1, "normalized_shape")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    lay = ctx.layout(x)
    if any(ctx.layout(t) is not FREE for t in op_leaves(args[2:], {})):
        return Unknown(f"{_name(func)} with a per-sample weight")
    if isinstance(lay, Batched) and lay.dim >= x.dim() - len(shape):
        return _mixed(func, "normalises over the batch dim")
    return lay


_register(_trailing, *_aliases("layer_norm", "rms_norm"))


def _batch_norm(ctx, func, args, kwargs, out) -> Any:
    """Eval mode: a per-channel affine map (channels in dim 1); training mode
    normalises with the batch's statistics, which mixes samples."""
    x = _arg(args, kwargs, 0, "input")
    lay = ctx.layout(x)
    training = _arg(args, kwargs, 5, "training", False)
    if not isinstance(lay, Batched):
        return lay
    if training:
        return _mixed(func, "normalises with the batch's statistics (training mode)")
    if x.dim() > 1 and lay.dim == 1:
        return _mixed(func, "has the batch in the channel dim")
    return lay


_register(_batch_norm, F.batch_norm, torch.batch_norm)


def _embedding(ctx, func, args, kwargs, out) -> Any:
    """``F.embedding(ids, W)`` (``torch.embedding(W, ids)``): the ids' samples, one
    trailing embedding dim more."""
    ids = _arg(args, kwargs, 0, "input") if func is F.embedding else args[1]
    weight = _arg(args, kwargs, 1, "weight") if func is F.embedding else args[0]
    if ctx.layout(weight) is not FREE:
        return Unknown("embedding with a per-sample table")
    return ctx.layout(ids)


_register(_embedding, F.embedding, torch.embedding)


def _one_hot(ctx, func, args, kwargs, out) -> Any:
    return ctx.layout(args[0])


_register(_one_hot, *_aliases("one_hot"))


def _embedding_bag(ctx, func, args, kwargs, out) -> Any:
    """``F.embedding_bag(ids, W, offsets, ...)``: 2-d ids are one bag per row; 1-d ids
    with offsets: every position of bag ``k`` must belong to sample ``k`` (read from the
    ids' layout and the offsets' values, whatever computed them: ``lengths.cumsum(0)``
    mixes samples but only places them). An empty bag holds no sample's data; its
    row stays at its place."""
    ids = _arg(args, kwargs, 0, "input")
    offsets = _arg(args, kwargs, 2, "offsets", None)
    weights = _arg(args, kwargs, 8, "per_sample_weights", None)
    lay = ctx.layout(ids)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if ctx.layout(_arg(args, kwargs, 1, "weight")) is not FREE:
        return _all(out, Unknown("embedding_bag with a per-sample table"))
    if weights is not None and isinstance(ctx.layout(weights), (Mixed, Unknown)):
        return _all(out, ctx.layout(weights))
    if not isinstance(lay, Batched):
        return _all(out, lay)
    if ids.dim() == 2:
        if lay.dim != 0:
            return _all(out, _mixed(func, "bags the batch dim"))
        return tuple(lay for _ in outs) if isinstance(out, (tuple, list)) else lay
    include_last = _arg(args, kwargs, 9, "include_last_offset", False)
    bags = 0 if offsets is None else offsets.shape[0] - (1 if include_last else 0)
    if bags != ctx.n:
        return _all(out, Unknown("embedding_bag whose bags are not one per sample"))
    positions = ids.shape[0]
    sample = lay.index if lay.index is not None else (
        torch.arange(positions, device=ids.device) // lay.inner % ctx.n)
    t = torch.arange(positions, dtype=offsets.dtype, device=offsets.device)
    bag = (torch.searchsorted(offsets[:bags].contiguous(), t, right=True) - 1).clamp(0, bags - 1)
    if not bool((sample.to(bag.device) == bag).all()):
        return _all(out, _mixed(func, "puts several samples' positions in one bag"))
    found = Batched(0)
    return tuple(found for _ in outs) if isinstance(out, (tuple, list)) else found


_register(_embedding_bag, F.embedding_bag, torch.embedding_bag)


def _sdpa(ctx, func, args, kwargs, out) -> Any:
    """``scaled_dot_product_attention(q, k, v, attn_mask)``: samples in the leading
    dims of ``q``, ``k``, ``v`` (the same dim); keys and values of other samples must
    not be attended to."""
    q = _arg(args, kwargs, 0, "query")
    k = _arg(args, kwargs, 1, "key", None)
    v = _arg(args, kwargs, 2, "value", None)
    mask = _arg(args, kwargs, 3, "attn_mask", None)
    rank = out.dim()
    found = None
    for t in (q, k, v, mask):
        lay = ctx.layout(t) if isinstance(t, Tensor) else FREE
        if not isinstance(lay, Batched):
            continue
        d = lay.dim + rank - t.dim()
        if t is not q and d >= rank - 2:
            return _mixed(func, "attends across samples")
        if t is q and d == rank - 1:
            return _mixed(func, "contracts the batch dim")
        here = lay.moved(d)
        if found is not None and found != here:
            return _mixed(func, "pairs samples of its operands")
        found = here
    return found


_register(_sdpa, *_aliases("scaled_dot_product_attention"))


def _losses(ctx, func, args, kwargs, out) -> Any:
    """Loss functions: per element (``reduction="none"``) the batch stays (the class
    dim 1 of ``cross_entropy``/``nll_loss`` is dropped); reduced, samples mix."""
    reduction = kwargs.get("reduction", "mean")
    leaves = op_leaves(args, kwargs)
    found = [(t, ctx.layout(t)) for t in leaves if isinstance(ctx.layout(t), Batched)]
    if reduction != "none":
        return _mixed(func, f"reduces over the batch (reduction={reduction!r})")
    x, lay = found[0]
    if func in _CLASS_LOSSES and x is args[0] and x.dim() > 1:
        if lay.dim == 1:
            return _mixed(func, "has the batch in the class dim")
        return lay.moved(lay.dim - (1 if lay.dim > 1 else 0))
    return lay.moved(lay.dim + out.dim() - x.dim())


_CLASS_LOSSES = set(_aliases("cross_entropy", "nll_loss", "multi_margin_loss"))
_register(_losses, *_aliases(
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss",
    "poisson_nll_loss", "gaussian_nll_loss", "hinge_embedding_loss", "multi_margin_loss"))


def _cosine(ctx, func, args, kwargs, out) -> Any:
    """``cosine_similarity(a, b, dim)``/``pairwise_distance``: reduce one dim."""
    return _broadcast_reduce(ctx, func, args, kwargs, out, kwargs.get(
        "dim", args[2] if len(args) > 2 and isinstance(args[2], int) else -1 if func in
        _PAIRWISE else 1))


_PAIRWISE = set(_aliases("pairwise_distance"))


def _broadcast_reduce(ctx, func, args, kwargs, out, dim) -> Any:
    flow = _broadcast(ctx, func, args[:2], {}, torch.empty(torch.broadcast_shapes(
        args[0].shape, args[1].shape), device="meta"))
    lay = flow.outputs
    if not isinstance(lay, Batched):
        return lay
    d = _dim(dim, max(args[0].dim(), args[1].dim()))
    if lay.dim == d:
        return _mixed(func, "reduces over the batch dim")
    return lay.moved(lay.dim - (1 if d < lay.dim and out.dim() < len(
        torch.broadcast_shapes(args[0].shape, args[1].shape)) else 0))


_register(_cosine, *_aliases("cosine_similarity", "pairwise_distance"))


# ---------------------------------------------------------------------------
# recurrent kernels and packed sequences


def _rnn(ctx, func, args, kwargs, out) -> Any:
    """``_VF.lstm/gru/rnn_tanh/rnn_relu``: padded input ``(T, B, I)`` (or batch first) or a
    packed ``(data, batch_sizes)``; output like the input, states ``(L*D, B, H)``."""
    x = args[0]
    lay = ctx.layout(x)
    packed = isinstance(args[1], Tensor) and args[1].dim() == 1 and not args[1].is_floating_point()
    outs = list(out)
    if not isinstance(lay, Batched):
        return _all(out, lay)
    if packed:
        if lay.index is None:
            return _all(out, Unknown("a packed sequence without its samples' rows"))
        batch = int(args[1][0])
        state = Batched(1, index=lay.index[:batch])
        return (lay, *[state] * (len(outs) - 1))
    batch_first = bool(args[-1])
    want = 0 if batch_first else 1
    if x.dim() != 3 or lay.dim != want or not lay.plain:
        return _all(out, _mixed(func, "runs its recurrence over the samples' dim"))
    return (lay, *[Batched(1)] * (len(outs) - 1))


_register(_rnn, *_aliases("lstm", "gru", "rnn_tanh", "rnn_relu",
                          where=(torch._VF, torch._C._VariableFunctions)))


def _pack(ctx, func, args, kwargs, out) -> Any:
    """``_pack_padded_sequence(input, lengths, batch_first)``: rows time-major, the
    sample of each row from the input's layout and the lengths."""
    x, _lengths, batch_first = args[0], args[1], args[2]
    lay = ctx.layout(x)
    want = 0 if batch_first else 1
    if not isinstance(lay, Batched) or lay.dim != want or lay.outer != 1 or lay.inner != 1:
        return (Unknown("pack_padded_sequence of an unlike layout"), FREE)
    order = lay.index if lay.index is not None else torch.arange(ctx.n, device=x.device)
    sizes = out[1]  # (T,) number of sequences still running at each step
    rows = torch.cat([order[: int(s)] for s in sizes])
    return (Batched(0, index=rows), FREE)


_register(_pack, *_aliases("_pack_padded_sequence", where=(torch._VF,
                                                           torch._C._VariableFunctions)))


def _unpack(ctx, func, args, kwargs, out) -> Any:
    """``_pad_packed_sequence(data, batch_sizes, batch_first, ...)``: positions in the
    order of the packed rows' first step."""
    data, sizes, batch_first = args[0], args[1], args[2]
    lay = ctx.layout(data)
    if not isinstance(lay, Batched) or lay.index is None:
        return (Unknown("pad_packed_sequence of an unlike layout"), FREE)
    order = lay.index[: int(sizes[0])]
    d = 0 if batch_first else 1
    if order.numel() == ctx.n and bool((order == torch.arange(ctx.n, device=order.device)).all()):
        return (Batched(d), FREE)
    return (Batched(d, index=order), FREE)


_register(_unpack, *_aliases("_pad_packed_sequence", where=(torch._VF,
                                                             torch._C._VariableFunctions)))


def _mha(ctx, func, args, kwargs, out) -> Any:
    """``F.multi_head_attention_forward`` left whole (sequence-first ``(T, B, E)``)."""
    q = args[0] if args else kwargs["query"]
    lay = ctx.layout(q)
    if isinstance(lay, Batched) and q.dim() == 3 and lay.dim == 1 and lay.plain:
        return (lay, Batched(0) if isinstance(out[1], Tensor) else FREE)
    return _all(out, Unknown("multi_head_attention_forward on an unlike layout"))


_register(_mha, F.multi_head_attention_forward)
