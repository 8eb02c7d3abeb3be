"""Indexing: basic indices move the batch dim; index tensors on it name the
samples by their values.

Registered with :func:`persample.batch.flow.register`; see that module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .flow import (
    VALUE_READERS,
    aliases,
    arg,
    dim_of,
    mixed,
    name_of,
    register,
    worst,
)
from .layouts import FREE, Batched, Layout, Mixed, Unknown, indexed

# ---------------------------------------------------------------------------
# indexing


def _getitem(ctx, func, args, kwargs, out) -> Any:
    """``x[...]``: basic indices move the batch dim; an index tensor on the batch dim
    gives the samples by its values (``logits[arange(B), last]`` keeps them in order)."""
    x, index = args[0], args[1]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not isinstance(out, Tensor):
        lay_i = worst([ctx.layout(t) for t in _index_tensors(index)])
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
    return indexed(0, mask.nonzero()[:, lay.dim], ctx.n)


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


register(_getitem, torch.Tensor.__getitem__)


def _index_select(ctx, func, args, kwargs, out) -> Any:
    """``index_select(dim, idx)``: on the batch dim the samples follow ``idx``'s values."""
    x = args[0]
    lay = ctx.layout(x)
    d = dim_of(arg(args, kwargs, 1, "dim"), x.dim())
    idx = arg(args, kwargs, 2, "index")
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
    return indexed(d, base[_dim_index(idx, x.shape[d])], ctx.n)


register(_index_select, *aliases("index_select"))
VALUE_READERS.update(aliases("index_select"))


def _gather(ctx, func, args, kwargs, out) -> Any:
    """``gather(x, dim, index)``: the output has ``index``'s shape; along dims other than
    ``dim`` it pairs positions with ``x``; the batch must not be the gathered dim."""
    x = args[0]
    d = dim_of(arg(args, kwargs, 1, "dim"), x.dim())
    idx = arg(args, kwargs, 2, "index")
    lx, li = ctx.layout(x), ctx.layout(idx)
    found = [lay for lay in (lx, li) if isinstance(lay, Batched)]
    if any(lay.dim == d for lay in found):
        return Unknown(f"{name_of(func)} along the batch dim")
    if len(found) == 2 and found[0] != found[1]:
        return mixed(func, "pairs samples from different dims")
    lay = found[0]
    if idx.shape[lay.dim] != x.shape[lay.dim]:
        return Unknown(f"{name_of(func)} with an index not covering the batch")
    return lay


register(_gather, *aliases("gather", "take_along_dim"))
