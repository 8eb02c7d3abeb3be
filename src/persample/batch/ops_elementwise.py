"""Elementwise ops and reductions: broadcasting right-aligns the inputs; a
reduction or an op along the batch dim mixes samples.

Registered with :func:`persample.batch.flow.register`; see that module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .flow import (
    BROADCASTING,
    FLOAT_BLIND,
    LAYOUTS_ONLY,
    SHAPE_READERS,
    UNBROADCASTS,
    VALUE_READERS,
    Ctx,
    Flow,
    aliases,
    arg,
    dim_of,
    every,
    in_place,
    mixed,
    name_of,
    op_leaves,
    register,
)
from .layouts import SHARED, Batched, Layout, Unknown
from .ops_indexing import (
    Partly,
    agree,
    as_located,
    followed,
    follows_partly,
    located,
    merge,
    partly,
    samples_along,
    trouble,
    where_positions,
)

# ---------------------------------------------------------------------------
# elementwise ops: broadcasting right-aligns the inputs


def self_only(ctx: Ctx, func, args, kwargs, out) -> Any:
    """Unary ops and ops whose other tensors are references only (``x.to(y)``)."""
    x = args[0] if args else kwargs.get("input")
    lay = ctx.layout(x)
    if isinstance(lay, Partly):
        if partly(ctx, x) is None or not isinstance(out, Tensor):
            return every(out, Unknown(lay.why))
        return as_located(ctx, out, lay)
    return every(out, lay)


def broadcast(ctx: Ctx, func, args, kwargs, out) -> Flow:
    """Elementwise ops: each batched input's batch dim lands on the output dim
    broadcasting aligns it with. Inputs disagreeing on that dim mix samples. Positions
    that hold no sample's data (:class:`~persample.batch.ops_indexing.Partly`) take
    the sample of the other inputs' data there."""
    shape = (args[0].shape if in_place(func, kwargs) and isinstance(args[0], Tensor)
             else _out_shape(out))
    if shape is None:
        return Flow(every(out, Unknown(f"{name_of(func)} returned no tensor")))
    leaves = op_leaves(args, kwargs)
    lays = [followed(ctx, t) for t in leaves]
    bad = trouble(lays)
    if bad is not None:
        return Flow(every(out, bad))
    if any(isinstance(lay, Partly) for lay in lays):
        return _with_free_positions(ctx, func, leaves, lays, shape, out)
    rank, found = len(shape), None
    for t, lay in zip(leaves, lays):
        if not isinstance(lay, Batched):
            continue
        d = lay.dim + rank - t.dim()
        if t.shape[lay.dim] != shape[d]:  # one position (a sub-batch of one) spread wide
            return Flow(every(out, mixed(func, "spreads one sample's data over others")))
        here = lay.moved(d)
        if found is None:
            found = here
        elif found != here and (same := agree(found, here, shape[d], ctx.n)) is not None:
            found = same
        elif found != here:
            return Flow(every(out, mixed(func, "combines samples from different dims")))
    if found is None:
        return Flow(every(out, SHARED))
    pairing = tuple(_paired(t, own, found, rank) for t, own in zip(leaves, lays))
    return Flow(every(out, found), pairing if any(a is not None for a in pairing) else None)


def _with_free_positions(ctx: Ctx, func, leaves: list, lays: list, shape, out) -> Flow:
    """``broadcast`` where an input has positions holding no sample's data: the samples
    of each position along the one batch dim, merged over the inputs."""
    rank, dim, rows = len(shape), None, None
    for t, lay in zip(leaves, lays):
        found = samples_along(ctx, t, lay)
        if found is None:
            continue
        d = found[0] + rank - t.dim()
        if t.shape[found[0]] != shape[d]:
            return Flow(every(out, mixed(func, "spreads one sample's data over others")))
        if dim is not None and d != dim:
            return Flow(every(out, mixed(func, "combines samples from different dims")))
        dim, rows = d, found[1] if rows is None else merge(rows, found[1])
        if rows is None:
            return Flow(every(out, mixed(func, "combines different samples' positions")))
    target = out if isinstance(out, Tensor) else next(o for o in out if isinstance(o, Tensor))
    got = located(dim, rows, ctx.n, target, name_of(func))
    if not isinstance(got, Batched):
        return Flow(every(out, got))
    pairing = tuple(got.moved(lay.dim + rank - t.dim()) if isinstance(lay, Partly) else
                  _paired(t, lay, got, rank) for t, lay in zip(leaves, lays))
    return Flow(every(out, got), pairing)


def _paired(t: Tensor, own: Layout, lay: Batched, rank: int) -> Layout | None:
    """How a broadcast input pairs with the samples: its own layout, a shared input of
    full size along the batch dim (``cls.expand(B, 1, E)`` in ``cat``) as batched
    there, else shared."""
    if own is not SHARED:
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
SELF_ONLY = "to type_as type contiguous".split()
_FREE_DATA = """zeros_like ones_like empty_like full_like rand_like randn_like randint_like
new_zeros new_ones new_full new_empty""".split()


def _free(ctx, func, args, kwargs, out) -> Any:
    """Ops whose data does not come from their tensor arguments (``zeros_like``)."""
    return every(out, SHARED)


_SELF_ONLY_OPS = aliases(*[u for u in _UNARY if u not in ("clamp", "clip", "clamp_", "clip_")])
_BROADCAST_OPS = aliases(*_BINARY, "clamp", "clip", "clamp_", "clip_")
register(broadcast, *_BROADCAST_OPS)
register(self_only, *_SELF_ONLY_OPS)
register(_free, *aliases(*_FREE_DATA))
FLOAT_BLIND.update((broadcast, self_only, _free))
LAYOUTS_ONLY.update((broadcast, self_only, _free))
SHAPE_READERS.update(aliases(*_FREE_DATA))
VALUE_READERS.update(aliases(*_FREE_DATA))  # (shared whatever their inputs hold: the
# zeros of a graph's aggregation made like its messages, where some nodes got none)
VALUE_READERS.update(_SELF_ONLY_OPS + _BROADCAST_OPS)  # they carry Partly themselves


def _as_tensor(ctx, func, args, kwargs, out) -> Any:
    """``as_tensor(data, dtype, device)`` (``Gamma.log_prob`` reads its value so): a
    tensor keeps its layout; tensors inside a list are not followed."""
    data = args[0] if args else kwargs.get("data")
    if isinstance(data, Tensor):
        return self_only(ctx, func, (data,), {}, out)
    return every(out, Unknown(f"{name_of(func)} of a list holding sample data"))


register(_as_tensor, *aliases("as_tensor"))


def _new(ctx, func, args, kwargs, out) -> Any:
    """``x.new(sizes or data)``, ``x.new_tensor(data)`` (Reformer's buffers): a copy of a
    tensor given as data keeps that tensor's layout; sizes or a list of numbers make a
    tensor no sample's data is in (``x`` gives only the dtype and device)."""
    data = [a for a in args[1:] if isinstance(a, Tensor)] + [
        v for v in kwargs.values() if isinstance(v, Tensor)]
    if not data:
        return every(out, SHARED)
    return self_only(ctx, func, (data[0],), {}, out)


register(_new, *aliases("new", "new_tensor", where=(torch.Tensor,)))


def _triangle(ctx, func, args, kwargs, out) -> Any:
    """``tril``/``triu`` (a causal mask, a strictly lower chunk): per matrix of the last
    two dims; samples in those dims would be masked by their place in the batch."""
    x = args[0] if args else kwargs.get("input")
    lay = ctx.layout(x)
    if isinstance(lay, Batched) and lay.dim >= x.dim() - 2:
        return every(out, Unknown(f"{name_of(func)} of matrices the samples are in"))
    return self_only(ctx, func, args, kwargs, out)


register(_triangle, *aliases("tril", "triu", "tril_", "triu_"))


def _where(ctx, func, args, kwargs, out) -> Any:
    if len(args) + len(kwargs) == 1:  # where(cond): nonzero(cond, as_tuple=True)
        return where_positions(ctx, func, args, kwargs, out)
    return broadcast(ctx, func, args, kwargs, out)


register(_where, *aliases("where"), override=True)
BROADCASTING.update((broadcast, _where))


def _unbroadcast(func, args: tuple, kwargs: dict, narrow) -> tuple | None:
    """Elementwise ops read every tensor operand broadcast against the others: one that
    ``narrow`` gives a smaller stand-in for (a tensor an ``expand`` made) may be read as
    that stand-in where the operands still broadcast to the same shape. An in-place op's
    target and an ``out=`` tensor are written, never replaced."""
    if kwargs.get("out") is not None:
        return None
    skip = 0 if in_place(func, kwargs) else -1
    new_args = [_narrowed(a, narrow) if k != skip else a for k, a in enumerate(args)]
    new_kwargs = {key: _narrowed(a, narrow) for key, a in kwargs.items()}
    if all(a is b for a, b in zip(new_args, args)) and all(
            new_kwargs[key] is kwargs[key] for key in kwargs):
        return None
    before = [t.shape for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
    after = [t.shape for t in (*new_args, *new_kwargs.values()) if isinstance(t, Tensor)]
    try:
        same = torch.broadcast_shapes(*before) == torch.broadcast_shapes(*after)
    except RuntimeError:  # the op itself will say what is wrong
        return None
    return (tuple(new_args), new_kwargs) if same else None


def _narrowed(a: Any, narrow) -> Any:
    if not isinstance(a, Tensor):
        return a
    found = narrow(a)
    return a if found is None else found


for _f in _BROADCAST_OPS + aliases("where"):
    UNBROADCASTS[_f] = _unbroadcast


def _positions_of(ctx, func, args, kwargs, out) -> Any:
    """``unique``: values from several samples merged into one list."""
    lay = ctx.layout(args[0])
    return every(out, SHARED if lay is SHARED else Unknown(f"{name_of(func)} lists positions"))


register(_positions_of, *aliases("unique", "unique_consecutive"))


# ---------------------------------------------------------------------------
# reductions and ops along one dim


def dims_arg(args, kwargs, pos: int, rank: int) -> list[int] | None:
    """The ``dim`` argument (position ``pos`` or keyword) as a list; ``None``: all."""
    d = kwargs.get("dim", kwargs.get("axis", args[pos] if len(args) > pos else None))
    if d is None:
        return None
    if isinstance(d, (tuple, list)):
        return [dim_of(x, rank) for x in d] if d else None
    if isinstance(d, int):
        return [dim_of(d, rank)]
    raise TypeError(f"dim={d!r}")


def _reduce(ctx, func, args, kwargs, out, pos: int = 1, along: bool = False) -> Any:
    """``sum(x, dim, keepdim)`` and kin: reducing over the batch dim mixes samples.
    ``along``: an op along ``dim`` that keeps the shape (``softmax``, ``cumsum``)."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return every(out, lay)
    dims = dims_arg(args, kwargs, pos, x.dim())
    if dims is None or lay.dim in dims:
        return every(out, mixed(func, "works along the batch dim" if along
                                else "reduces over the batch"))
    keep = along or kwargs.get("keepdim", args[pos + 1] if len(args) > pos + 1 and isinstance(
        args[pos + 1], bool) else False)
    d = lay.dim if keep else lay.dim - sum(1 for r in dims if r < lay.dim)
    return every(out, lay.moved(d))


_REDUCTIONS = aliases(
    "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "argmax", "argmin", "all",
    "any", "logsumexp", "count_nonzero", "median", "nanmedian", "mode", "var", "std",
    "var_mean", "std_mean", "aminmax")
register(follows_partly(_reduce), *_REDUCTIONS)
VALUE_READERS.update(_REDUCTIONS)  # (over another dim: a position of no sample stays one)
register(lambda c, f, a, k, o: _reduce(c, f, a, k, o, pos=2), *aliases("kthvalue"))


def _norm(ctx, func, args, kwargs, out) -> Any:
    """``x.norm(p, dim, keepdim)`` / ``linalg.vector_norm(x, ord, dim, keepdim)``."""
    return _reduce(ctx, func, args, kwargs, out, pos=2)


register(follows_partly(_norm), *aliases("norm", "vector_norm", "linalg_vector_norm"))
VALUE_READERS.update(aliases("norm", "vector_norm", "linalg_vector_norm"))


def _max_min(ctx, func, args, kwargs, out) -> Any:
    """``max(x)`` (all), ``max(x, dim)``, or the elementwise ``max(x, y)``."""
    if len(args) > 1 and isinstance(args[1], Tensor) or isinstance(kwargs.get("other"), Tensor):
        return broadcast(ctx, func, args, kwargs, out)
    return _reduce(ctx, func, args, kwargs, out)


register(follows_partly(_max_min), *aliases("max", "min"))
VALUE_READERS.update(aliases("max", "min"))  # (over the batch: mixed, whatever it holds)


def _along(ctx, func, args, kwargs, out, pos: int = 1) -> Any:
    """``softmax(x, dim)`` and kin: the shape is kept; along the batch dim samples mix."""
    return _reduce(ctx, func, args, kwargs, out, pos, along=True)


_ALONG = aliases(
    "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin",
    "logcumsumexp", "normalize", "gumbel_softmax", "cumsum_", "cumprod_", "diff", "msort")
register(follows_partly(_along), *_ALONG)
VALUE_READERS.update(_ALONG)


def _cross(ctx, func, args, kwargs, out) -> Any:
    """``cross(a, b, dim)``: elementwise (broadcast) but along ``dim``, whose 3 positions
    each read the others (``torch.cross`` without ``dim``: its first dim of size 3;
    ``torch.linalg.cross``: the last)."""
    got = broadcast(ctx, func, args, kwargs, out)
    d = arg(args, kwargs, 2, "dim", None)
    if d is None:
        d = -1 if func is torch.linalg.cross else next(
            (k for k, size in enumerate(out.shape) if size == 3), -1)
    lay = got.outputs
    if isinstance(lay, (Batched, Partly)) and lay.dim == dim_of(d, out.dim()):
        return mixed(func, "reads the other positions of the batch dim")
    return got


register(_cross, *aliases("cross"))
VALUE_READERS.update(aliases("cross"))  # (it carries Partly itself, as broadcast does)


def _roll(ctx, func, args, kwargs, out) -> Any:
    lay = ctx.layout(args[0])
    if isinstance(lay, Batched):
        dims = dims_arg(args, {"dim": arg(args, kwargs, 2, "dims", None)},
                         99, args[0].dim())
        if dims is None or lay.dim in dims:
            return mixed(func, "rolls along the batch dim")
    return lay


register(_roll, *aliases("roll"))


def _bucketize(ctx, func, args, kwargs, out) -> Any:
    """``bucketize(input, boundaries)`` and ``searchsorted(sorted_sequence, values)`` with
    one 1-D sequence of boundaries: each entry's bucket is a function of that entry and
    the boundaries, so the result keeps the samples of the entries; boundaries that hold
    samples (or several sequences, paired with the values' leading dims) are not
    followed."""
    if func in _SEARCHSORTED:
        edges, values = arg(args, kwargs, 0, "sorted_sequence"), arg(args, kwargs, 1, "input")
    else:
        values, edges = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "boundaries")
    if not isinstance(values, Tensor):  # (a number: a 0-d result of no sample)
        return SHARED if not isinstance(edges, Tensor) or edges.dim() != 1 or ctx.layout(
            edges) is SHARED else Unknown(f"{name_of(func)} of a number in boundaries "
                                          "that hold samples")
    if edges.dim() != 1 or ctx.layout(edges) is not SHARED:
        return Unknown(f"{name_of(func)} of boundaries that hold samples, or of several "
                       "sequences")
    return self_only(ctx, func, (values,), {}, out)


_SEARCHSORTED = set(aliases("searchsorted"))
register(_bucketize, *aliases("bucketize", "searchsorted"))
FLOAT_BLIND.add(_bucketize)
LAYOUTS_ONLY.add(_bucketize)


def _glu(ctx, func, args, kwargs, out) -> Any:
    lay = ctx.layout(args[0])
    d = dim_of(arg(args, kwargs, 1, "dim", -1), args[0].dim())
    if isinstance(lay, Batched) and lay.dim == d:
        return mixed(func, "splits the batch dim")
    return lay


register(_glu, *aliases("glu"))
