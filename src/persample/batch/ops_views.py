"""Views and joins: the batch moves with its dim; a reshape moves it by index
arithmetic.

Registered with :func:`persample.batch.flow.register`; see that module.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .flow import (
    FLOAT_BLIND,
    GETTERS,
    HANDLERS,
    LAYOUTS_ONLY,
    VALUE_READERS,
    Flow,
    aliases,
    arg,
    dim_of,
    every,
    mixed,
    name_of,
    own_piece,
    register,
)
from .forms import forms
from .layouts import SHARED, Batched, Piece, Unknown, nonnegative, sample_of_positions
from .ops_elementwise import SELF_ONLY, dims_arg, self_only
from .ops_indexing import (
    NO_SAMPLE,
    Partly,
    Sorted,
    agree,
    as_located,
    followed,
    follows_partly,
    keys_of,
    located,
    merge,
    one_position,
    pieces_of,
    regular,
    samples_along,
    trouble,
    with_keys,
)

# ---------------------------------------------------------------------------
# views: the batch moves with its dim


def _reshape(ctx, func, args, kwargs, out) -> Any:
    """``view``/``reshape``/``flatten``/``unflatten``: where the batch's index digit
    lands in the new shape (row-major index arithmetic, exact)."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not isinstance(out, Tensor):
        return lay
    if (lay.index is not None and not isinstance(lay, Sorted)
            and lay.index.numel() % max(ctx.n, 1) == 0 and nonnegative(lay.index)):
        lay = regular(lay.dim, lay.index.long(), ctx.n)  # graphs of equal sizes: merged
        # (only a multiple of the batch's positions can be: no pass over the index else)
    return reshaped(lay, tuple(x.shape), tuple(out.shape), ctx.n) or Unknown(
        f"{name_of(func)} {tuple(x.shape)} -> {tuple(out.shape)} splits the batch dim")


def reshaped(lay: Batched, before: tuple, after: tuple, n: int) -> Batched | None:
    """The layout after reshaping ``before`` to ``after``, or ``None`` if the samples'
    index digit is split across dims.

    In the row-major index the sample is a digit of radix ``n`` and place value
    ``P = inner * prod(before[dim+1:])``. Output dim ``k`` holds the place values
    ``S_k .. S_k * after[k]`` (``S_k = prod(after[k+1:])``); the digit fits in it iff
    ``S_k`` divides ``P`` and ``P * n`` divides ``S_k * after[k]``. A tensor of no
    entries (a dim of size 0) has no index arithmetic: the batch dim must stay where it
    is, with the same dims before it.
    """
    if math.prod(before) == 0:
        d = lay.dim
        return lay if tuple(after[:d + 1]) == tuple(before[:d + 1]) else None
    if lay.index is not None:  # irregular: only if the batch dim itself is untouched
        return _untouched(lay, before, after)
    if n == 1:  # a digit of radix 1 fits in any dim: keep the batch dim where it was if
        # the reshape leaves it alone (FSDP2's view_as of (1, 8) as (1, 8) is not (1, inner 8))
        kept = _untouched(lay, before, after)
        if kept is not None:
            return kept
    place = lay.inner * math.prod(before[lay.dim + 1:])
    suffix = 1
    for k in range(len(after) - 1, -1, -1):
        size = after[k]
        if place % suffix == 0 and (suffix * size) % (place * n) == 0 and size > 1:
            inner = place // suffix
            return Batched(k, size // (inner * n), inner)
        suffix *= size
    return None


def _untouched(lay: Batched, before: tuple, after: tuple) -> Batched | None:
    """The batch dim moved to the output dim of its size with as many entries before and
    after it as in ``before``, or ``None`` if the reshape touches it."""
    d = lay.dim
    prefix = math.prod(before[:d])
    suffix = math.prod(before[d + 1:])
    acc = 1
    for k in range(len(after)):
        if acc == prefix and after[k] == before[d] and math.prod(after[k + 1:]) == suffix:
            return lay.moved(k)
        acc *= after[k]
    return None


_RESHAPES = aliases("view", "reshape", "flatten", "unflatten", "ravel", "view_as", "reshape_as",
                    "_reshape_alias")
register(follows_partly(_reshape), *_RESHAPES)
VALUE_READERS.update(_RESHAPES)
register(self_only, *aliases(*SELF_ONLY))


def _view_or_dtype(ctx, func, args, kwargs, out) -> Any:
    """``x.view(dtype)`` reinterprets the last dim; ``x.view(*shape)`` reshapes."""
    if len(args) == 2 and isinstance(args[1], torch.dtype):
        lay = ctx.layout(args[0])
        if isinstance(lay, Batched) and lay.dim == args[0].dim() - 1:
            return Unknown("view(dtype) on the batch dim")
        return lay
    return _reshape(ctx, func, args, kwargs, out)


register(follows_partly(_view_or_dtype), torch.Tensor.view, override=True)


def _permute(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    if "dims" in kwargs:
        dims = kwargs["dims"]
    else:
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    order = [dim_of(d, x.dim()) for d in dims]
    return lay.moved(order.index(lay.dim))


register(follows_partly(_permute), *aliases("permute"))


def _transpose(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    a = dim_of(arg(args, kwargs, 1, "dim0", 0), x.dim())
    b = dim_of(arg(args, kwargs, 2, "dim1", 1), x.dim())
    d = lay.dim
    return lay.moved(b if d == a else a if d == b else d)


register(follows_partly(_transpose), *forms(torch.transpose))


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


register(follows_partly(_t), *aliases("t", "t_"))
GETTERS.update({"T": _t, "mT": _last_two, "H": _t, "mH": _last_two,
                 "data": self_only, "real": self_only, "imag": self_only})


def _movedim(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    src = arg(args, kwargs, 1, "source")
    dst = arg(args, kwargs, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    rank = x.dim()
    src, dst = [dim_of(s, rank) for s in src], [dim_of(d, rank) for d in dst]
    order = [None] * rank
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(i for i in range(rank) if i not in src)
    order = [o if o is not None else next(rest) for o in order]
    return lay.moved(order.index(lay.dim))


register(follows_partly(_movedim), *aliases("movedim", "moveaxis"))


def _squeeze(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not isinstance(out, Tensor):
        return lay
    dims = dims_arg(args, kwargs, 1, x.dim())
    dims = [d for d in (dims if dims is not None else range(x.dim())) if x.shape[d] == 1]
    if lay.dim in dims:  # one position of the batch dim (one sample's) leaves no batch dim
        return Unknown(f"{name_of(func)} removes the batch dim (one sample's position)")
    return lay.moved(lay.dim - sum(1 for d in dims if d < lay.dim))


def _unsqueeze(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    d = dim_of(arg(args, kwargs, 1, "dim"), x.dim() + 1)
    return lay.moved(lay.dim + (1 if d <= lay.dim else 0))


register(follows_partly(_squeeze), *aliases("squeeze", "squeeze_"))
register(follows_partly(_unsqueeze), *aliases("unsqueeze", "unsqueeze_"))


def _expand(ctx, func, args, kwargs, out) -> Any:
    """``expand``/``broadcast_to``: new leading dims shift the batch dim."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not isinstance(out, Tensor):
        return lay
    d = lay.dim + out.dim() - x.dim()
    if out.shape[d] != x.shape[lay.dim]:
        return Unknown(f"{name_of(func)} broadcasts the batch dim")
    return lay.moved(d)


register(follows_partly(_expand), *aliases("expand", "broadcast_to", "expand_as"))


def _broadcast_tensors(ctx, func, args, kwargs, out) -> Any:
    """``broadcast_tensors(*xs)`` (what ``torch.distributions`` does to its parameters):
    output ``k`` is input ``k`` expanded to the common shape, ``expand``'s data flow
    output by output; it combines nothing, so a shared input stays shared beside a
    batched one and an input whose samples are mixed or unknown affects its own
    output only."""
    xs = [t for t in (args[0] if len(args) == 1 and isinstance(args[0], (list, tuple))
                      else args) if isinstance(t, Tensor)]
    return tuple(_EXPANDED(ctx, func, (x,), {}, o) for x, o in zip(xs, out))


_EXPANDED = follows_partly(_expand)


register(_broadcast_tensors, *aliases("broadcast_tensors"))


def _repeat(ctx, func, args, kwargs, out) -> Any:
    """``x.repeat(*reps)`` tiles: the batch dim repeated ``r`` times gets ``outer * r``
    (an index layout: its sample ids tiled ``r`` times)."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    reps = list(args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size))
                else args[1:])
    d = lay.dim + len(reps) - x.dim()
    if lay.index is not None:
        return Batched(d, index=lay.index if reps[d] == 1 else lay.index.repeat(reps[d]))
    return Batched(d, lay.outer * reps[d], lay.inner)


register(_repeat, *aliases("repeat", "tile"))


def _repeat_interleave(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    reps = arg(args, kwargs, 1, "repeats", None)
    dim = arg(args, kwargs, 2, "dim", None)
    if dim is None or not isinstance(reps, int) or lay.index is not None:
        return Unknown("repeat_interleave without one int repeat count along a dim")
    dim = dim_of(dim, x.dim())
    if dim != lay.dim:
        return lay
    return Batched(lay.dim, lay.outer, lay.inner * reps)


register(_repeat_interleave, *aliases("repeat_interleave"))


def _narrow(ctx, func, args, kwargs, out) -> Any:
    """``narrow``/``select`` along a dim other than the batch's keep it (shifted)."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    d = dim_of(arg(args, kwargs, 1, "dim"), x.dim())
    if d == lay.dim:
        if isinstance(out, Tensor) and out.shape == x.shape:
            return lay
        if func in (torch.select, torch.Tensor.select):  # (one sample's position)
            return one_position(ctx, lay, x, arg(args, kwargs, 2, "index"), out) or Unknown(
                f"{name_of(func)} takes part of the batch dim")
        return Unknown(f"{name_of(func)} takes part of the batch dim")
    if func in (torch.select, torch.Tensor.select) and d < lay.dim:
        return lay.moved(lay.dim - 1)
    return lay


register(follows_partly(_narrow), *aliases("narrow", "select"))


def _pieces(ctx, func, args, kwargs, out) -> Any:
    """``split``/``chunk``/``tensor_split``/``unbind``: along another dim than the batch
    each piece keeps the layout; along the batch dim each piece holds the samples of its
    positions where the cut follows each position's own sort key
    (:class:`~persample.batch.ops_indexing.Sorted`). Other cuts of the batch dim are not
    followed: where the cut falls in a sample's positions depends on other samples, or
    on sizes computed from their data."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return every(out, lay if not isinstance(lay, Partly) else Unknown(lay.why))
    pos = 1 if func in _UNBINDS else 2  # unbind(x, dim); split(x, sizes, dim)
    d = dim_of(kwargs.get("dim", args[pos] if len(args) > pos else 0), x.dim())
    if d == lay.dim:
        if func in _UNBINDS:  # (one position each: each piece one sample's)
            return pieces_of(lay, x, ctx.n, out, f"{name_of(func)} cuts the batch dim")
        keys = keys_of(lay)
        whole = None if keys is not None else _whole_samples(lay, x, ctx.n, out, d,
                                                             name_of(func))
        if whole is not None:
            return whole
        if keys is None or not _by_key(keys, out, d):
            return every(out, Unknown(f"{name_of(func)} cuts the batch dim"))
        rows = sample_of_positions(lay, x.shape[d], ctx.n, x.device)
        found, start = [], 0
        for cut in out:  # (each piece keeps its positions' keys: joined again by cat)
            end = start + cut.shape[d]
            found.append(with_keys(located(d, rows[start:end], ctx.n, cut, name_of(func)),
                                    keys[start:end]))
            start = end
        return tuple(found)
    if func in _UNBINDS:
        return every(out, lay.moved(lay.dim - (1 if d < lay.dim else 0)))
    return every(out, lay)


def _whole_samples(lay: Batched, x: Tensor, n: int, out: Any, d: int, what: str
                   ) -> tuple | None:
    """Pieces of the batch dim each holding all of one sample's positions and no other's
    (LLaVA-NeXT's features split by each image's tile count): that sample's
    :class:`~persample.batch.layouts.Piece` each (an empty piece is shared); ``None``
    where a piece holds several samples or part of one (where such a cut falls may
    depend on other samples' data)."""
    rows = sample_of_positions(lay, x.shape[d], n, x.device).long()
    counts = torch.bincount(rows.clamp(min=0), minlength=n).tolist()
    found, start = [], 0
    for cut in out:
        size = cut.shape[d]
        if not size:
            found.append(SHARED)
            continue
        sample = int(rows[start])
        if sample < 0 or counts[sample] != size or not bool(
                (rows[start:start + size] == sample).all()):
            return None
        found.append(Piece(f"{what} cuts the batch dim", sample, weakref.ref(cut)))
        start += size
    return tuple(found)


def _by_key(keys: Tensor, pieces: Any, d: int) -> bool:
    """Every position of piece ``j`` has key ``j`` (``split(bincount(keys))`` of positions
    sorted by key): a position's piece is its own key's."""
    start = 0
    for j, cut in enumerate(pieces):
        size = cut.shape[d]
        if size and not bool((keys[start:start + size] == j).all()):
            return False
        start += size
    return start == keys.numel()


_UNBINDS = set(aliases("unbind"))
register(follows_partly(_pieces), *aliases("split", "chunk", "tensor_split", "split_with_sizes",
                                            "unbind", "unsafe_split", "unsafe_chunk"))


def _cat(ctx, func, args, kwargs, out) -> Flow:
    """``cat``: along another dim the batched inputs must agree (shared inputs of full
    size are paired with the samples); along the batch dim each position keeps its
    sample, a shared input's positions holding none (``k`` plain inputs give
    ``outer = k``; a graph's self-loop edges appended to its edges are shared)."""
    tensors = [t for t in (args[0] if args else kwargs["tensors"]) if isinstance(t, Tensor)]
    rank = out.dim()
    d = dim_of(kwargs.get("dim", arg(args, kwargs, 1, "axis", 0)), rank)
    joined = [t for t in tensors if t.dim() == rank]  # 1-d empty tensors join nothing
    if any(own_piece(ctx, t) is not None for t in joined):
        return Flow(_joined_pieces(ctx, func, joined, d, out))
    lays = [followed(ctx, t) for t in joined]
    bad = trouble(lays)
    if bad is not None:
        return Flow(bad)
    if any(isinstance(lay, (Batched, Partly)) and lay.dim == d for lay in lays):
        found = [samples_along(ctx, t, lay) for t, lay in zip(joined, lays)]  # (dims: each its own)
        return Flow(_joined_along(ctx, func, joined, found, d, out))
    if any(isinstance(lay, Partly) for lay in lays):
        return _cat_free_positions(ctx, func, tensors, joined, lays, out)
    batched = [lay for lay in lays if isinstance(lay, Batched)]
    first = batched[0]
    for lay in batched[1:]:
        first = agree(first, lay, out.shape[first.dim], ctx.n) if first is not None else None
    if first is None:
        return Flow(mixed(func, "joins tensors with samples in different dims"))
    pairing = tuple(ctx.layout(t) if ctx.layout(t) is not SHARED else (
        first if t.dim() == rank and t.shape[first.dim] == out.shape[first.dim] else None)
        for t in tensors)
    return Flow(first, pairing)


def _cat_free_positions(ctx, func, tensors: list, joined: list, lays: list, out: Tensor
                        ) -> Flow:
    """``cat`` along another dim than the samples' where an input has positions holding no
    sample's data (:class:`~persample.batch.ops_indexing.Partly`: a graph's aggregates,
    joined feature-wise): each position's samples merged over the inputs, as an
    elementwise op merges them; the inputs paired with the result's samples where it has
    them everywhere (a shared input of full size along that dim too)."""
    dim, rows = None, None
    for t, lay in zip(joined, lays):
        found = samples_along(ctx, t, lay)
        if found is None:
            continue  # (shared: its positions hold none)
        if dim is not None and found[0] != dim:
            return Flow(mixed(func, "joins tensors with samples in different dims"))
        dim = found[0]
        rows = found[1] if rows is None else merge(rows, found[1])
        if rows is None:
            return Flow(mixed(func, "joins different samples' positions"))
    got = located(dim, rows, ctx.n, out, name_of(func))
    if not isinstance(got, Batched):
        return Flow(got)
    pairing = tuple(got if isinstance(ctx.layout(t), Partly) or (
        ctx.layout(t) is SHARED and t.dim() == out.dim() and t.shape[dim] == out.shape[dim])
        else ctx.layout(t) if isinstance(ctx.layout(t), Batched) else None for t in tensors)
    return Flow(got, pairing)


def _joined_along(ctx, func, joined: list, found: list, d: int, out: Tensor) -> Any:
    """``cat`` along the batch dim: the samples of the positions, in order; and their sort
    keys, where every input's positions have them (the pieces of a ``split`` by key,
    each worked on alone, joined again: JetMoE's experts)."""
    rows = []
    for t, f in zip(joined, found):
        if f is not None and f[0] != d:
            return mixed(func, "joins tensors with samples in different dims")
        rows.append(f[1] if f is not None else torch.full(
            (t.shape[d],), NO_SAMPLE, dtype=torch.long, device=out.device))
    got = located(d, torch.cat(rows), ctx.n, out, name_of(func))
    keys = [keys_of(ctx.layout(t)) for t in joined]
    if all(k is not None for k in keys):
        got = with_keys(got, torch.cat(keys))
    return got


def _joined_pieces(ctx, func, joined: list, d: int, out: Tensor, stacked: bool = False
                   ) -> Any:
    """``cat`` (or ``stack``) of tensors among which one sample's pieces
    (:class:`~persample.batch.layouts.Piece`): along ``d`` each position holds its
    piece's sample, a shared tensor's none, a batched one's along ``d`` its own."""
    rows = []
    for t in joined:
        own, lay = own_piece(ctx, t), followed(ctx, t)
        size = 1 if stacked else t.shape[d]
        if own is not None:
            rows.append(torch.full((size,), own.sample, dtype=torch.long, device=out.device))
        elif lay is SHARED:
            rows.append(torch.full((size,), NO_SAMPLE, dtype=torch.long, device=out.device))
        elif isinstance(lay, (Batched, Partly)) and lay.dim == d and not stacked:
            rows.append(samples_along(ctx, t, lay)[1].to(out.device))
        else:
            return trouble([lay]) or Unknown(
                f"{name_of(func)} joins one sample's pieces with a batch along another dim")
    return located(d, torch.cat(rows), ctx.n, out, name_of(func))


def _stack(ctx, func, args, kwargs, out) -> Any:
    tensors = [t for t in (args[0] if args else kwargs["tensors"]) if isinstance(t, Tensor)]
    rank = out.dim()
    d = dim_of(arg(args, kwargs, 1, "dim", 0), rank)
    if any(own_piece(ctx, t) is not None for t in tensors):
        return _joined_pieces(ctx, func, tensors, d, out, stacked=True)
    lays = [followed(ctx, t) for t in tensors]
    bad = trouble(lays)
    if bad is not None:
        return bad
    batched = [lay for lay in lays if isinstance(lay, Batched)]
    if not batched:  # (positions of no sample in each: a Partly)
        return Unknown(f"{name_of(func)} of tensors with positions of no sample")
    first = batched[0]
    if any(lay != first for lay in batched):
        return mixed(func, "joins tensors with samples in different dims")
    if len(batched) != len(lays):
        return Unknown("stack of batched and shared tensors")
    return first.moved(first.dim + (1 if d <= first.dim else 0))


register(_cat, *aliases("cat", "concat", "concatenate"))
register(_stack, *aliases("stack"))
FLOAT_BLIND.update(HANDLERS[f] for f in (  # (each reads layouts and shapes alone)
    torch.Tensor.reshape, torch.Tensor.view, torch.permute, torch.transpose, torch.t,
    torch.movedim, torch.squeeze, torch.unsqueeze, torch.Tensor.expand, torch.narrow,
    torch.Tensor.repeat, torch.repeat_interleave, torch.split, torch.broadcast_tensors,
    torch.cat, torch.stack))
LAYOUTS_ONLY.update(HANDLERS[f] for f in (  # (on plain layouts: no values read at all)
    torch.Tensor.reshape, torch.Tensor.view, torch.permute, torch.transpose, torch.t,
    torch.movedim, torch.squeeze, torch.unsqueeze, torch.Tensor.expand, torch.cat,
    torch.stack))
# views and joins carry positions that hold no sample's data (ops_indexing.Partly)
VALUE_READERS.update(aliases("permute", "transpose", "swapaxes", "swapdims", "transpose_", "t",
                             "t_", "movedim", "moveaxis", "squeeze", "squeeze_", "unsqueeze",
                             "unsqueeze_", "expand", "broadcast_to", "expand_as",
                             "broadcast_tensors", "narrow",
                             "select", "split", "chunk", "tensor_split", "split_with_sizes",
                             "unbind", "unsafe_split", "unsafe_chunk", "cat", "concat",
                             "concatenate", "stack"))


def _flip(ctx, func, args, kwargs, out) -> Any:
    """``flip(x, dims)``: the positions of each of ``dims`` in reverse order; along the
    batch dim each keeps its sample (an index layout, the samples in reverse)."""
    x = args[0]
    lay = followed(ctx, x)
    if not isinstance(lay, (Batched, Partly)):
        return lay
    d, rows = samples_along(ctx, x, lay)
    if d not in (dims_arg(args, kwargs, 1, x.dim()) or range(x.dim())):
        return as_located(ctx, out, lay)
    return located(d, rows.flip(0), ctx.n, out, name_of(func))


register(_flip, *aliases("flip"))
VALUE_READERS.update(aliases("flip"))
FLOAT_BLIND.add(_flip)


def _pad(ctx, func, args, kwargs, out) -> Any:
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return lay
    pad = arg(args, kwargs, 1, "pad")
    padded = {x.dim() - 1 - k // 2 for k, p in enumerate(pad) if p}
    if lay.dim in padded:
        return Unknown("F.pad pads the batch dim")
    return lay


register(_pad, F.pad, getattr(torch._C._nn, "pad", None))


def _unfold_dim(ctx, func, args, kwargs, out) -> Any:
    """``x.unfold(dimension, size, step)`` (PatchTST's patches of a ``(B, C, L)`` series,
    ``(B, C, N, size)``): a new last dim, the batch dim in place; the batch dim must not
    be unfolded."""
    x = args[0]
    lay = ctx.layout(x)
    if isinstance(lay, Batched) and dim_of(arg(args, kwargs, 1, "dimension"), x.dim()) == lay.dim:
        return Unknown("unfold of the batch dim")
    return lay


register(_unfold_dim, torch.Tensor.unfold)


def _as_strided(ctx, func, args, kwargs, out) -> Any:
    """``as_strided`` (Longformer's overlapping chunks): which position of the input's
    batch dim each output entry reads, found in memory: the positions written into a
    copy of the input's storage, read back through the output's size, stride and
    offset. Where one output dim reads one position per index, in order, the samples
    are there, as they were along the input's dim."""
    x = args[0]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or lay.index is not None or not out.dim():
        return Unknown(f"{name_of(func)} of an unlike layout")
    d = lay.dim
    with torch._C.DisableTorchFunction():
        room = x.storage_offset() + _span(x, -1) + 1
        memory = torch.full((max(room, out.storage_offset() + _span(out, -1) + 1),), -1,
                            dtype=torch.long)
        mine = memory.as_strided(x.shape, x.stride(), x.storage_offset())
        shape = [1] * x.dim()
        shape[d] = x.shape[d]
        mine.copy_(torch.arange(x.shape[d]).view(shape).expand(x.shape))
        if not torch.equal(mine, torch.arange(x.shape[d]).view(shape).expand(x.shape)):
            return Unknown(f"{name_of(func)} of a tensor whose entries share memory")
        read = memory.as_strided(out.shape, out.stride(), out.storage_offset())
        for k in range(out.dim()):
            if out.shape[k] != x.shape[d]:
                continue
            want = [1] * out.dim()
            want[k] = out.shape[k]
            if torch.equal(read, torch.arange(out.shape[k]).view(want).expand(out.shape)):
                return lay.moved(k)
    return Unknown(f"{name_of(func)} whose entries read several positions of the batch dim")


def _span(t: Tensor, skip: int) -> int:
    """How far in memory the dims of ``t`` other than ``skip`` reach."""
    return sum((size - 1) * stride for k, (size, stride) in enumerate(zip(t.shape, t.stride()))
               if k != skip and size > 0)


register(_as_strided, *aliases("as_strided"))
